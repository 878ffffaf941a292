"""A task a tiny model can only solve by looking again (`tests/test_turns.py`'s learning test, and its measurement).

Each image is 64 x 64 pixels of 1-pixel stripes under a Hann window, vertical (answer A) or horizontal (B). The
model's processor keeps at most 32 x 32 pixels of an image, and halving 1-pixel stripes averages them away: the
first view of an A image and of a B image are the same grey (their pixel values differ by at most one grey level,
`first_views_differ_by`). Zooming on the centre 8 x 8 pixels returns them at the processor's 32 x 32: 4-pixel
stripes, plainly vertical or horizontal.

`run(root, seed, tools=True)`: SFT on recorded trajectories teaches the call format (the question, a call of `look`
- a user tool zooming on the centre -, the zoomed image, then an answer drawn at random: the policy at chance), then
GRPO on 64 prompts with `looked`, the accuracy reward of an answer given after a look that worked (a policy gains
nothing by breaking its call while it learns to read what the call shows; a tiny char-level policy's 60-token call
otherwise drifts and breaks), evaluated on 32 held out before and after (the eval's controls: real, every image
blanked, the tools' images blanked). `tools=False` is the same policy without tools: SFT on the direct answers
(drawn at random), GRPO with one-token answers and the accuracy reward.

    python tests/zoom_task.py --seeds 0 1 2 --threads 1 2      # the measurement the test's bounds come from
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

QUESTION = "<image>Stripes? A or B."
BOX = [28, 28, 36, 36]
SFT_STEPS = 150
CALL = ("look", {})  # the call SFT teaches (`look`: zoom on the centre; or ("zoom", {"box": BOX}))
SIDE = 64
WINDOW = np.outer(*[np.sin(np.pi * (np.arange(SIDE) + 0.5) / SIDE) ** 2] * 2)
STRIPES = np.where(np.arange(SIDE) % 2, 1.0, -1.0)
MODEL = ["model.encoder={name: qwen3_5_vit, preset: tiny, options: {max_pixels: 1024}}"]  # first views: 32 x 32
GRPO = ["train.objective=grpo", "grpo.rewards=[accuracy]", "train.steps=100", "data.batch_size=4", "train.lr=3e-4",
        "train.schedule=cosine", "train.warmup_steps=5", "train.clip_grad_norm=0.2", "grpo.num_generations=4",
        "grpo.loss_type=grpo", "grpo.temperature=0.7"]
TOOLS = ["grpo.tools=[zoom, 'zoom_task:look']", "grpo.rewards=['zoom_task:looked']", "grpo.tools_in_prompt=false",
         "grpo.max_turns=2", "grpo.tool_max_pixels=1024", "grpo.max_completion_length=90"]


def look(context: Any) -> Any:
    """Look closer: the centre of the image, zoomed to as many pixels as images may have.

    Args:
        context: the trajectory's images and limits (given by mmadapt)
    """
    from mmadapt.tools import TOOLS as BUILT_IN

    return BUILT_IN.get("zoom")()(context, {"box": BOX})


def looked(completions: list[str], tool_calls: list[int], tool_problems: list[int], **columns: Any) -> list[float]:
    """The accuracy reward of an answer given after a look that worked (0 after an unreadable or failing call): a
    policy gains nothing by breaking its call while it learns to read what the call shows."""
    from mmadapt.train.rewards import Accuracy

    right = Accuracy()(completions, **columns)
    return [float(bool(r) and calls > 0 and not problems)
            for r, calls, problems in zip(right, tool_calls, tool_problems, strict=True)]


def picture(answer: str, brightness: int) -> Image.Image:
    """1-pixel stripes, vertical (A) or horizontal (B), under a Hann window, around a grey of `brightness`."""
    pattern = STRIPES[None, :].repeat(SIDE, 0) if answer == "A" else STRIPES[:, None].repeat(SIDE, 1)
    grey = np.clip(128 + brightness + 110 * WINDOW * pattern, 0, 255).round().astype(np.uint8)
    return Image.fromarray(np.stack([grey] * 3, -1))


def write_data(root: Path) -> None:
    """96 images (64 to train on, 32 held out), the SFT trajectories (their zoomed images beside them), the direct
    SFT answers and the prompts."""
    from mmadapt.tools import TOOLS as BUILT_IN
    from mmadapt.tools import ToolContext

    rng, guess = np.random.default_rng(100), random.Random(100)
    zoom = BUILT_IN.get("zoom")()
    files: dict[str, list[dict[str, Any]]] = {"sft": [], "direct": [], "train": [], "held": []}
    for k in range(96):
        answer = "AB"[k % 2]
        image = picture(answer, int(rng.integers(-12, 13)))
        image.save(root / f"{k}.png")
        zoomed = zoom(ToolContext(images=(image,), max_pixels=32 * 32), {"box": BOX})
        zoomed.images[0].save(root / f"{k}-zoom.png")
        said = guess.choice("AB")
        files["sft"].append({"id": f"s{k}", "images": [f"{k}.png", f"{k}-zoom.png"], "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": CALL[0], "arguments": CALL[1]}}]},
            {"role": "tool", "content": "<image>" + zoomed.text},
            {"role": "assistant", "content": said}]})
        files["direct"].append({"id": f"d{k}", "image": f"{k}.png", "conversations": [
            {"from": "human", "value": QUESTION}, {"from": "gpt", "value": said}]})
        files["train" if k < 64 else "held"].append({"id": f"p{k}", "problem": QUESTION, "answer": answer,
                                                     "images": [f"{k}.png"]})
    for name, records in files.items():
        (root / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in records))


def first_views_differ_by(root: Path) -> float:
    """The largest difference between the processed first views of an A and a B image (normalised units)."""
    import mmadapt
    from mmadapt.data.processors import processor_for

    model = mmadapt.build_model({"name": "qwen3_5_vit", "preset": "tiny", "options": {"max_pixels": 1024}},
                                "qwen_merger", "qwen3_5")
    processor = processor_for(model)
    a, b = (processor([picture(answer, 0)]).pixel_values for answer in "AB")
    return float((a - b).abs().max())


def run(root: Path, seed: int, tools: bool = True, overrides: tuple[str, ...] = (),
        tokenizer: str | None = None) -> dict[str, Any]:
    """SFT then GRPO (module docstring): the held-out eval before and after, and the seconds each took."""
    from mmadapt.train import RunConfig, Trainer
    from mmadapt.train.run import build_run
    from mmadapt.train.steps import evaluate

    root.mkdir(parents=True, exist_ok=True)
    if not (root / "held.jsonl").is_file():
        write_data(root)
    name = "tools" if tools else "direct"
    common = [*MODEL, f"data.image_root={root}", "train.progress=false", "data.max_length=400",
              "train.log_every=1000", "train.schedule=constant", f"train.seed={seed}"]
    if tokenizer:  # a real tokenizer (tests/real_tokenizers.py) and Qwen3-VL's template
        from real_tokenizers import unpacked

        common += [f"data.tokenizer={unpacked(tokenizer)}", "data.chat_template=qwen3_vl"]
    started = time.perf_counter()
    first = RunConfig.load(None, [*common, f"train.out={root / f'sft-{name}-{seed}'}",
                                  f"data.train={root / ('sft.jsonl' if tools else 'direct.jsonl')}",
                                  f"train.steps={SFT_STEPS}", "data.batch_size=8", "train.lr=1e-3"])
    parts = build_run(first)
    Trainer(parts.model, first, parts.train_data, parts.collate).fit()
    taught = time.perf_counter()
    then = RunConfig.load(None, [*common, f"train.out={root / f'grpo-{name}-{seed}'}",
                                 f"data.train={root / 'train.jsonl'}", f"data.eval={root / 'held.jsonl'}", *GRPO,
                                 *(TOOLS if tools else ["grpo.max_completion_length=1"]), *overrides])
    parts = build_run(then, model=parts.model)
    trainer = Trainer(parts.model, then, parts.train_data, parts.collate, eval_data=parts.eval_data,
                      tokenizer=parts.tokenizer)
    trainer.objective.prepare(trainer)
    start = evaluate(trainer, trainer.objective)
    trainer.fit()
    end = evaluate(trainer, trainer.objective)
    return {"start": start, "end": end, "sft_s": taught - started, "grpo_s": time.perf_counter() - taught}


def main() -> None:
    import tempfile

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="zoom-task-"))
    write_data(root)
    print(f"first views of A and B differ by at most {first_views_differ_by(root):.4f} (normalised; 1 grey level is "
          f"{2 / 255:.4f})")
    print(f"{'threads':>7} {'seed':>4} {'policy':>7} {'start':>6} {'end':>6} {'blanked':>8} {'tools blanked':>14} "
          f"{'calls':>6} {'seconds':>8}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for seed in args.seeds:
            for tools in (True, False):
                result = run(root / f"t{threads}", seed, tools)
                start, end = result["start"], result["end"]
                print(f"{threads:>7} {seed:>4} {'tools' if tools else 'direct':>7} {start['eval_reward']:>6.3f} "
                      f"{end['eval_reward']:>6.3f} {end['eval_reward_blanked']:>8.3f} "
                      f"{end.get('eval_reward_tool_images_blanked', float('nan')):>14.3f} "
                      f"{end.get('eval_tool_calls', float('nan')):>6.2f} {result['sft_s'] + result['grpo_s']:>8.0f}",
                      flush=True)


if __name__ == "__main__":
    main()
