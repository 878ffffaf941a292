"""Small builders the tests share: a run file, a JSONL dataset, a noise image.

    from helpers import write_run, write_jsonl, noise_image

`write_run(path, model={...}, data={...}, train={...})` writes a run YAML from plain mappings (paths may be
`Path`s); `write_jsonl(path, records)` one record per line; `noise_image(path, seed)` a small random RGB PNG.
`TRANSFORMERS_KEEPS_VIDEO_WRAPPER`: what the installed transformers' `Qwen3VLProcessor` does with Qwen's own video
placeholder (below). `answer_table(model, ...)`: a tiny Qwen3.5 made to answer by construction (answers of 1, 2 or
`max_new_tokens` tokens, by their seed); `lora_run(out, stages)`: a tiny 3-step LoRA run; `rehash(checkpoint)`: its
`COMPLETE` marker rewritten for its files as they are (an altered checkpoint whose marker matches); `run_bounded(cmd,
timeout)`: a command (torchrun and its workers included) ended whole at its timeout, so a hang fails a test instead of
holding CI. `pairwise(*axes)`: a test matrix whose every pair of values is in the fast tier, the other combinations
marked slow (the full suite runs them all).
Fixtures (tiny transformers checkpoints) live in conftest.py; the real tokenizers in real_tokenizers.py.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from packaging.version import Version
from PIL import Image

# Qwen's own chat templates write a video as `<|vision_start|><|video_pad|><|vision_end|>`, and Qwen's reference
# processor (transformers 4.57, qwen-vl-utils) and mmadapt replace that whole span by the per-frame
# `<t seconds><|vision_start|><|video_pad|>...<|vision_end|>` blocks. transformers 5.10 - 5.24 replace only the
# `<|video_pad|>`, so the template's pair stays around the frames (two tokens more); transformers 5.25 collapses the
# span to the bare pad first (`Qwen3VLProcessor.get_text_with_replacements`) and writes Qwen's reference stream.
# (pyproject's range starts at 5.24.)
TRANSFORMERS_KEEPS_VIDEO_WRAPPER = Version(version("transformers")) < Version("5.25")



def pairwise(*axes: Sequence[Any], ids: bool = True) -> list:
    """The product of `axes` as pytest params: a greedy set that holds every pair of values of any two axes runs
    in the fast tier, the other combinations are marked slow. A bug that needs two settings to show is found by
    the fast tier; one that needs three by the full suite (README, Development). Deterministic: the first
    combination that covers the most pairs not yet covered is taken, in product order."""
    import pytest

    product = list(itertools.product(*axes))
    pairs = lambda combo: {(i, combo[i], j, combo[j]) for i, j in itertools.combinations(range(len(combo)), 2)}  # noqa: E731
    uncovered = set().union(*(pairs(c) for c in product))
    fast: set = set()
    while uncovered:
        best = max(product, key=lambda c: len(pairs(c) & uncovered))
        fast.add(best)
        uncovered -= pairs(best)
    return [pytest.param(*c, marks=() if c in fast else pytest.mark.slow,
                         id="-".join(str(v) for v in c) if ids else None) for c in product]


TINY_LLAVA = {"encoder": "clip", "projector": "mlp2x_gelu", "backbone": "llama", "preset": "tiny"}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, os.PathLike) else value


def write_run(path: str | os.PathLike, **sections: Any) -> Path:
    """A run YAML with these sections (model, data, train, stages, lora, ...); returns its path."""
    path = Path(path)
    path.write_text(yaml.safe_dump(_plain(sections), sort_keys=False))
    return path


def write_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> Path:
    """One JSON record per line; returns the path."""
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def noise_image(path: str | os.PathLike, seed: int | np.random.Generator = 0, size: int = 32) -> Path:
    """A size x size RGB PNG of uniform noise (seed: an int or a generator to draw from)."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
    return Path(path)


def grey_clip(path: str | os.PathLike, frames: int = 4, side: int = 32) -> Path:
    """A tiny MP4 (H.264 when PyAV has it, else MPEG-4) of `frames` flat grey frames getting lighter, at 4 fps."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = side, side, "yuv420p"
        for k in range(frames):
            frame = np.full((side, side, 3), 60 * k, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return Path(path)


def supervised_text(tokenizer: Any, ids: Sequence[int], labels: Sequence[int]) -> list[str]:
    """The supervised stretches of a sample (labels other than -100), each decoded."""
    out, run = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != -100:
            run.append(token)
        elif run:
            out.append(tokenizer.decode(run))
            run = []
    return out + ([tokenizer.decode(run)] if run else [])


def answer_table(model: Any, start: int, end: int, a: int, b: int) -> None:
    """`model` (a tiny Qwen3.5) as a table of next tokens: after `start` the end, `a` or `b` (0.2, 0.3, 0.5), after
    `a` the end, after `b` `b` again. Every block adds nothing to the residual stream (output projections zero), so
    the last hidden state is the final norm of the current token's embedding; the three tokens' embeddings are
    orthogonal and the head maps their normed states to the wanted logits (the rest of the vocabulary 20 below). An
    answer after `start` is then 1 or 2 tokens long, or runs to `max_new_tokens`, as its seed draws."""
    import torch

    lm = model.backbone
    with torch.no_grad():
        for layer in lm.model.layers:
            for name, module in layer.named_modules():
                if name.endswith(("out_proj", "o_proj", "down_proj")):
                    module.weight.zero_()
        embeddings = lm.get_input_embeddings().weight
        width = embeddings.shape[1]
        basis = torch.linalg.qr(torch.randn(width, 3, generator=torch.Generator().manual_seed(0)))[0].T * width ** 0.5
        embeddings[[start, a, b]] = basis
        states = lm.model.norm(basis[None])[0]  # (3, D)
        logits = torch.zeros(embeddings.shape[0], 3)
        logits[[end, a, b], 0] = 20 + torch.tensor([0.2, 0.3, 0.5]).log()
        logits[end, 1] = logits[b, 2] = 20
        lm.lm_head.weight.copy_(logits @ torch.linalg.pinv(states.T))


def run_bounded(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run `cmd` in a session of its own: (its return code, its stderr), or (None, its stderr) when it ran past
    `timeout` seconds and was ended. torchrun's workers run in sessions of their own (a signal to the launcher's group
    misses them), and on SIGTERM the launcher ends its workers itself (SIGTERM, then SIGKILL after its grace period);
    SIGKILL to the launcher's group after 60 s more otherwise."""
    import signal
    import subprocess

    process = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=timeout)
        return process.returncode, stderr
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            _, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
        return None, stderr


def lora_run(out: Path, stages: Sequence[str], seed: int = 0, config: Any = None) -> Path:
    """A 3-step LoRA run of the tiny LLaVA combination (or of `config`, a `ModelConfig`; char tokenizer) in OUT/run,
    `stages` its `stages.` overrides; returns the base model's directory (OUT/base)."""
    import torch

    import mmadapt
    from mmadapt import Processor
    from mmadapt.data import Collator, char_tokenizer
    from mmadapt.synthetic import synthetic_samples
    from mmadapt.train import RunConfig, Trainer

    torch.manual_seed(seed)
    if config is None:
        model = mmadapt.build_model("clip", "mlp2x_gelu", "llama")
    else:
        model = mmadapt.VisionLanguageModel(config)
    tokenizer = char_tokenizer()
    Processor.for_model(model, tokenizer)
    model.save_pretrained(out / "base", tokenizer=tokenizer)
    config = RunConfig.load(None, [f"train.out={out / 'run'}", "train.progress=false", "train.steps=3",
                                   "train.lr=5e-2", "lora.r=4", "data.batch_size=4", *stages])
    samples = synthetic_samples(model, [1, 1, 1, 1], text_lengths=[6, 9, 5, 8], seed=seed)
    Trainer(model, config, samples, Collator.for_model(model, 0), tokenizer=tokenizer).fit()
    return out / "base"


def rehash(checkpoint: Path, **fields: Any) -> Path:
    """Rewrite a checkpoint's `COMPLETE` marker with the checksums of its files as they are now (and `fields`): what a
    checkpoint altered by someone who also rewrote its marker looks like. Returns `checkpoint`."""
    import hashlib

    marker = checkpoint / "COMPLETE"
    body = json.loads(marker.read_text())
    body["files"] = {p.relative_to(checkpoint).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                     for p in sorted(checkpoint.rglob("*")) if p.is_file() and p != marker}
    marker.write_text(json.dumps({**body, **fields}, indent=1))
    return checkpoint
