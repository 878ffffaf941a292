"""Sequence parallelism at real widths: per-rank peak memory and step time for long samples at SP = 1, 2 and 4.

    python benchmarks/bench_sequence_parallel.py [--quick] [--lengths 8192 16384 32768] [--sizes 1 2 4]

For each length L and size N: `mmadapt train` under torchrun with N processes and `distributed.sequence_parallel: N`
(one data-parallel group: the N ranks share the one sample of each step; DDP, so that parameters are replicated and
what falls with N is the activations), on a long document: Qwen3-VL-2B's widths and vocabulary, the decoder and the
ViT cut to one layer each (the table says so); the vendored Qwen3 tokenizer; one picture at the size the plan
assumes (the largest the processor makes: 448 x 448, `max_pixels`) and a long question filling L tokens, a short
answer supervised; LoRA on the LLM, the projector trained. Measured on every rank: `VmHWM` above the RSS of the same
process after importing the libraries, read when the trainer first saves (after step 1, whose forward, backward and
optimizer step are all behind it), the same high-water mark above the rank's RSS just before that step (the step's
own peak: activations, gradients, the exchange buffers, AdamW's state as it appears), and the step's seconds (the
trainer's `accumulate`, the first step: one sample). Predicted: `mmadapt plan --gpus N --device cpu` on the same run
(`per_gpu.total`), its activations (with the loss and the exchange buffers) beside. Target (issue 56): the plan
within 15% of the measured peak; the activations per rank falling with N.

The runs take about an hour on 2 CPU cores (N processes share the 2 cores, so step times measure the work, not a
speed-up; the picture's ViT step is the same on every rank). `--quick`: the tiny Qwen3-VL at 512 / 1024 tokens (a
smoke run; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

MIB = 1024**2
MODEL = {"encoder": {"name": "qwen3_vl_vit", "preset": "qwen3-vl-2b",  # pictures up to 448 x 448 (196 tokens)
                     "options": {"depth": 1, "deepstack_visual_indexes": [0], "max_pixels": 448 * 448}},
         "projector": "qwen_merger",
         "backbone": {"name": "qwen3_vl", "preset": "qwen3-vl-2b", "options": {"num_hidden_layers": 1}}}
QUICK = {"encoder": "qwen3_vl_vit", "projector": "qwen_merger", "backbone": "qwen3_vl", "preset": "tiny"}
DEPTH = "ViT 1/24, LLM 1/28"
SIDE = 448  # the picture before the plan says its size

MEASURE = """
import os, sys, time
from pathlib import Path
def kib(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1])
import torch, transformers, peft, mmadapt.cli, mmadapt.train.trainer as trainer
idle = kib("VmRSS")
rank = int(os.environ.get("RANK", "0"))
timed = {}
accumulate = trainer.accumulate
def timed_accumulate(*args, **kwargs):
    timed.setdefault("resident", kib("VmRSS"))  # the model, wrapped, before its first step
    started = time.perf_counter()
    out = accumulate(*args, **kwargs)
    timed.setdefault("step", time.perf_counter() - started)
    return out
trainer.accumulate = timed_accumulate
def save(self, **kwargs):
    print("MEASURED", rank, (kib("VmHWM") - idle) / 1024, timed.get("step", float("nan")),
          (kib("VmHWM") - timed.get("resident", idle)) / 1024, flush=True)
    sys.stdout.flush()
    os._exit(0)
trainer.Trainer.save = save
sys.exit(mmadapt.cli.main(["train", *sys.argv[1:]]))
"""


def write_run(root: Path, length: int, quick: bool, side: int | None = None, visual: int | None = None) -> Path:
    """run.yaml, the tokenizer, one picture (`side` px, default 448; `visual` its tokens) and 8 records whose question
    fills the sample to about `length` tokens (a 64-word answer supervised)."""
    import random

    import numpy as np
    from PIL import Image

    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from real_tokenizers import unpacked
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(unpacked("qwen3"))
    side = side or (64 if quick else SIDE)
    Image.fromarray((np.random.RandomState(0).rand(side, side, 3) * 255).astype("uint8")).save(root / "page.png")
    words = "the a cat dog image shows red blue green house tree car road sky person table chair window".split()
    rng = random.Random(0)
    budget = length - (visual if visual is not None else (side // 32) ** 2) - 200  # picture, template, answer
    filler = [rng.choice(words) for _ in range(4096)]
    per_word = len(tokenizer(" ".join(filler)).input_ids) / len(filler)
    count = int(budget / per_word)
    question = " ".join(filler[k % len(filler)] for k in range(count))
    answer = " ".join(rng.choice(words) for _ in range(64))
    records = [{"id": f"doc{i}", "image": "page.png", "conversations": [
        {"from": "human", "value": "<image>\n" + question + "\nWhat does the page say?"},
        {"from": "gpt", "value": answer}]} for i in range(8)]
    (root / "train.json").write_text(json.dumps(records))
    config = {"model": QUICK if quick else MODEL,
              "data": {"train": str(root / "train.json"), "image_root": str(root), "tokenizer": str(unpacked("qwen3")),
                       "max_length": length, "batch_size": 1},
              "stages": {"encoder": "frozen", "projector": "full", "backbone": "lora"},
              "train": {"steps": 1, "out": str(root / "out"), "progress": False},
              "distributed": {"strategy": "ddp"}}
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def measure(path: Path, size: int) -> list[tuple[float, float, float]]:
    """[(VmHWM above idle MiB, step seconds, VmHWM above the rank's RSS before its first step MiB)] of each rank of
    `mmadapt train path` with `size` processes."""
    script = path.parent / "measure.py"
    script.write_text(MEASURE)
    launcher = [sys.executable] if size == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc_per_node", str(size)]
    out = subprocess.run([*launcher, str(script), str(path), f"distributed.sequence_parallel={size}"],
                         capture_output=True, text=True)
    lines = sorted(line.split()[1:] for line in out.stdout.splitlines() if line.startswith("MEASURED"))
    if len(lines) != size:
        raise RuntimeError(f"mmadapt train {path} (SP {size}) did not reach its first save:\n{out.stderr[-3000:]}")
    return [(float(mib), float(seconds), float(step)) for _, mib, seconds, step in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lengths", nargs="*", type=int, default=None)
    parser.add_argument("--sizes", nargs="*", type=int, default=[1, 2, 4])
    args = parser.parse_args()
    from mmadapt.train.config import RunConfig
    from mmadapt.train.plan import predict

    lengths = args.lengths or ([512, 1024] if args.quick else [8192, 16384, 32768])
    print(f"Qwen3-VL-2B widths and vocabulary ({'tiny' if args.quick else DEPTH}), LoRA, fp32, CPU; one sample of L "
          "tokens per step, shared by the N ranks of one group (DDP)\n")
    print("| L | SP | tokens per rank | planned activations MiB | measured step peak MiB | planned MiB | "
          "measured VmHWM MiB | error | step s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length in lengths:
        with tempfile.TemporaryDirectory() as root:
            path = write_run(Path(root), length, args.quick)
            # the picture at the size the plan assumes (the largest the processor makes that fits the sample)
            work = predict(RunConfig.load(str(path)), gpus=1, device="cpu").workload
            path = write_run(Path(root), length, args.quick, side=work.image_side, visual=work.visual_per_image)
            for size in args.sizes:
                config = RunConfig.load(str(path), [f"distributed.sequence_parallel={size}"])
                plan = predict(config, gpus=size, device="cpu")
                per = plan.per_gpu
                activations = (per["activations"] + per["loss"] + per.get("exchange", 0)) / MIB
                ranks = measure(path, size)
                measured = max(mib for mib, _, _ in ranks)
                step = max(seconds for _, seconds, _ in ranks)
                above = max(mib for _, _, mib in ranks)
                error = 100 * (per["total"] / MIB / measured - 1)
                print(f"| {length:,} | {size} | {length // size:,} | {activations:,.0f} | {above:,.0f} | "
                      f"{per['total'] / MIB:,.0f} | {measured:,.0f} | {error:+.1f}% | {step:,.1f} |", flush=True)


if __name__ == "__main__":
    main()
