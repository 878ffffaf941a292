"""Tiny SFT and DPO runs, their per-step losses and the SHA-256 of their final weights: two versions compared.

    python benchmarks/objective_runs.py [--modes one,fsdp,ddp] [--steps 4] [--json FILE]

Each run is `mmadapt train` in a fresh process (the version on `PYTHONPATH`, or the installed one) on a tiny Qwen3.5
(the default `preset: tiny`), fp32, CPU, over 16 generated images (four colours, two sizes):
- `sft`: LLaVA conversations "What colour is it?" -> the colour; the encoder trained fully;
- `dpo adapters`: preference pairs (chosen: the colour, rejected: another), LoRA on the backbone, projector frozen:
  the reference is the model with its adapters off, per batch;
- `dpo precomputed`: the same pairs, the encoder trained fully: the reference's log-probs precomputed before step 1.
Every run evaluates on 8 held-out samples (pairs) every 2 steps. Modes: `one` (1 process, micro-batches of
2, grad_accum 2), `fsdp` and `ddp` (torchrun, 2 processes on CPU / gloo, 2 per rank): the same global batch of 4.
Printed per run: each step's loss (every digit), the eval loss, and the SHA-256 over the final checkpoint's weights
(names, dtypes, shapes, bytes). `--json FILE` writes every logged value that does not depend on time (losses, gradient
norms, rates, rewards, KL, eval metrics) and the checksums: two versions' files equal, byte for byte, when the
versions train the same (the check behind issue 43's move of the objectives: `diff before.json after.json`).
About 4 minutes for `--modes one`, 15 for all three, on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 220), "yellow": (230, 220, 30)}
RUNS = {"sft": ["stages.encoder=full"],
        "dpo adapters": ["train.objective=dpo", "stages.backbone=lora", "stages.projector=frozen"],
        "dpo precomputed": ["train.objective=dpo", "stages.encoder=full"]}
MODES = {"one": (1, ["data.batch_size=2", "train.grad_accum=2"]),
         "fsdp": (2, ["data.batch_size=2", "distributed.strategy=fsdp"]),
         "ddp": (2, ["data.batch_size=2", "distributed.strategy=ddp"])}
TIMING = ("time", "seconds", "per_s", "memory", "flops", "mfu")  # logged values that differ from run to run


def write_data(root: Path) -> None:
    """16 + 8 noisy one-colour images and, over them, LLaVA samples and trl-style preference pairs."""
    (root / "images").mkdir(parents=True)
    names = list(COLOURS)
    for split, n, seed in (("train", 16, 0), ("eval", 8, 1)):
        rng = np.random.default_rng(seed)
        sft, pairs = [], []
        for k in range(n):
            colour = names[k % 4]
            pixels = np.clip(np.array(COLOURS[colour]) + rng.integers(-25, 25, (32, 32 + 32 * (k % 2), 3)), 0, 255)
            Image.fromarray(pixels.astype(np.uint8)).save(root / "images" / f"{split}{k}.png")
            question = "<image>\nWhat colour is it?" + " please" * (k % 3)
            sft.append({"id": f"{split}{k}", "image": f"{split}{k}.png", "conversations": [
                {"from": "human", "value": question}, {"from": "gpt", "value": colour}]})
            pairs.append({"id": f"{split}{k}", "images": [f"{split}{k}.png"], "prompt": question, "chosen": colour,
                          "rejected": names[(k + 1 + (k // 4) % 3) % 4]})
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
        (root / f"{split}_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))


def weights_sha256(checkpoint: Path) -> str:
    """SHA-256 over the checkpoint's tensors in name order: name, dtype, shape, bytes."""
    import torch
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(checkpoint / "model.safetensors").items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train(root: Path, run: str, mode: str, steps: int) -> dict:
    """One run of `mmadapt train`: its time-free log records and the final weights' checksum."""
    procs, overrides = MODES[mode]
    out = root / "out" / f"{run.replace(' ', '-')}-{mode}"
    data = "_pairs" if run.startswith("dpo") else ""
    launcher = [sys.executable]
    if procs > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    cmd = [*launcher, "-m", "mmadapt", "train", f"train.out={out}", f"data.train={root / f'train{data}.jsonl'}",
           f"data.eval={root / f'eval{data}.jsonl'}", f"data.image_root={root / 'images'}", "data.max_length=256",
           f"train.steps={steps}", "train.lr=1.0e-3", "train.eval_every=2", "train.progress=false", "dpo.beta=0.5",
           *RUNS[run], *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"{run} ({mode}) failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    kept = [{k: v for k, v in r.items() if not any(word in k for word in TIMING)} for r in records]
    checkpoints = sorted((out / "checkpoints").iterdir())
    return {"records": kept, "weights_sha256": weights_sha256(checkpoints[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="one", help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {list(RUNS)}")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path, help="write every time-free logged value and checksum here")
    args = parser.parse_args()
    modes, runs = args.modes.split(","), args.runs.split(",")
    for name, known in ((modes, MODES), (runs, RUNS)):
        unknown = [n for n in name if n not in known]
        if unknown:
            parser.error(f"unknown {unknown}; known: {list(known)}")
    import mmadapt

    print(f"## SFT and DPO runs: per-step losses and final weights (mmadapt {mmadapt.__version__} from "
          f"{Path(mmadapt.__file__).parent}; tiny Qwen3.5, fp32, CPU, {args.steps} steps)\n")
    print("| run | mode | step losses | eval loss (last) | final weights SHA-256 |")
    print("|---|---|---|---|---|")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_data(root)
        for mode in modes:
            for run in runs:
                result = results[f"{run} / {mode}"] = train(root, run, mode, args.steps)
                losses = ", ".join(repr(r["loss"]) for r in result["records"])
                print(f"| {run} | {mode} | {losses} | {result['records'][-1].get('eval_loss')!r} | "
                      f"{result['weights_sha256']} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
