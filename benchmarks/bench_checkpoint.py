"""Checkpoints (issue 57): rank 0's peak host memory and the step loop's stall per save, the gathered checkpoint
(mmadapt < 0.26) against the sharded one (DCP), written synchronously and in the background (`checkpoint.async`).

    python benchmarks/bench_checkpoint.py            # about 5 minutes on 2 CPU cores
    python benchmarks/bench_checkpoint.py --quick    # the tiny Qwen3.5: checks that it runs (its numbers mean nothing)

Rows (`--sizes`): by default SmolLM2-360M's and SmolLM2-1.7B's LLM shapes (the LLMs of SmolVLM-500M and SmolVLM-2.2B:
960 and 2048 wide, their 49,152-token tied vocabulary; mmadapt's LLaMA backbone) cut to 2 decoder layers (the published
models have 32 and 24), behind the tiny SigLIP and a 2-layer MLP projector to the LLM's width; `qwen3.5-0.8b`:
Qwen3.5-0.8B's LLM (1024 wide, 248,320-token tied vocabulary) cut to 1 of its 24 layers, behind the tiny Qwen3.5 ViT and
its merger. The sizes are what 2 CPU cores and 24 GB hold: the gathered save of a model whose weights and AdamW state
take S bytes needs about 3.2 x S of host memory in all (S sharded over the ranks, 1.6 x S on rank 0, 0.6 x S on rank 1).
fp32, FSDP2 over 2 ranks (torchrun; gloo on the CPU, NCCL on GPUs), AdamW whose state was made by one step on a constant
gradient (no forward: a checkpoint holds the state, not the activations). Each configuration (model x format) runs in
fresh processes and saves `--saves` times (default 3) through `mmadapt.train.saving.CheckpointWriter`, as the trainer
does, waiting for each save to complete before the next. Measured on every rank: the peak host memory of a save, `VmHWM`
(reset before each save through `/proc/self/clear_refs`) above the process's RSS before its first save (the same
baseline for every save, so the staging copy that an asynchronous writer keeps between saves counts in every one), what
is still resident above that baseline once the save completed, the seconds `save` blocked the caller (the stall) and the
seconds until the checkpoint was complete (every rank's files written and checked, the `COMPLETE` marker written). The
table gives the median over the saves (the first asynchronous save also allocates the staging buffers; later ones reuse
them).

Expected: the gathered path's rank 0 holds the whole model and optimizer state (and the tensors in flight as they are
gathered), so its peak grows with the model; a sharded save's peak stays small on every rank and flat in the model's
size; an asynchronous one holds a copy of the rank's shards (about model + AdamW / ranks) to stall the loop only for
that copy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1024**2


def _smollm2(hidden: int, intermediate: int, heads: int, kv_heads: int) -> dict:
    """A LLaMA backbone at SmolLM2's shape (SmolVLM's LLMs): its 49,152-token vocabulary, tied embeddings."""
    return {"name": "llama", "preset": "vicuna-7b", "options": {
        "hidden_size": hidden, "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_hidden_layers": 2, "vocab_size": 49152, "tie_word_embeddings": True,
        "image_token_id": 49151, "pad_token_id": 2, "max_position_embeddings": 8192}}


SIZES = {  # --sizes name: (row, encoder, projector, backbone); the encoder at its tiny preset (a small vision side)
    "smollm2-360m": ("SmolLM2-360M width, 2 of 32 layers", "siglip", "mlp2x_gelu", _smollm2(960, 2560, 15, 5)),
    "smollm2-1.7b": ("SmolLM2-1.7B width, 2 of 24 layers", "siglip", "mlp2x_gelu", _smollm2(2048, 8192, 32, 32)),
    "qwen3.5-0.8b": ("Qwen3.5-0.8B width, 1 of 24 layers", "qwen3_5_vit", "qwen_merger",
                     {"name": "qwen3_5", "preset": "qwen3.5-0.8b", "options": {"num_hidden_layers": 1}}),
    "tiny": ("Qwen3.5 tiny, 2 layers", "qwen3_5_vit", "qwen_merger", {"name": "qwen3_5", "preset": "tiny"}),
}
DEFAULT_SIZES = ["smollm2-360m", "smollm2-1.7b"]
FORMATS = {  # column label: (checkpoint.format, checkpoint.async)
    "gathered (full state on rank 0)": ("gathered", False),
    "sharded (DCP)": ("sharded", False),
    "sharded, async (DCP)": ("sharded", True),
}


# ---- one configuration, in every rank of a torchrun -----------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _trim_heap() -> None:
    """Hand what glibc kept after frees back to the system, so that the RSS counts live memory only."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        ctypes.CDLL(name).malloc_trim(0)


def worker(size: str, fmt: str, asynchronous: bool, saves: int, out: Path) -> None:
    """Build, shard and step the model, save it `saves` times; print this rank's measurements as one JSON line."""
    import torch

    from mmadapt import build_model
    from mmadapt.precision import FP32
    from mmadapt.train import distributed
    from mmadapt.train.config import RunConfig
    from mmadapt.train.saving import CheckpointWriter, Snapshot

    ctx = distributed.init(timeout_minutes=30)
    torch.manual_seed(0)
    _, encoder, projector, backbone = SIZES[size]
    model = build_model(encoder, projector, backbone, preset="tiny")
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    wrapped = distributed.wrap(model.to(ctx.device), ctx, "fsdp", FP32)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-5)
    for p in wrapped.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # AdamW's state: exp_avg and exp_avg_sq of every parameter, as after a training step
    optimizer.zero_grad(set_to_none=True)
    writer = CheckpointWriter(out, format=fmt, asynchronous=asynchronous, keep=1, is_main=ctx.rank == 0)
    # imported by the first save otherwise: their code is no part of a save's cost
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint
    _trim_heap()
    baseline = _status_kib("VmRSS")
    measured = []
    for step in range(1, saves + 1):
        snapshot = Snapshot(scheduler={}, rng={}, trainer_state={"step": step}, config=RunConfig(), extras=None)
        _trim_heap()
        _reset_peak()
        start = time.perf_counter()
        writer.save(step, wrapped=wrapped, model=model, optimizer=optimizer, snapshot=snapshot)
        stalled = time.perf_counter() - start
        writer.wait()
        complete = time.perf_counter() - start
        peak = _status_kib("VmHWM") - baseline
        _trim_heap()
        measured.append({"peak": peak / 1024, "kept": (_status_kib("VmRSS") - baseline) / 1024,
                         "stalled": stalled, "complete": complete})
    writer.close()
    print("MEASURED " + json.dumps({"rank": ctx.rank, "saves": measured, "model_bytes": sum(sizes),
                                    "largest": max(sizes)}), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---- the driver ---------------------------------------------------------------------------------------------------
def measure(size: str, fmt: str, asynchronous: bool, saves: int, ranks: int, device: str) -> list[dict]:
    """Each rank's measurements (by rank) of one configuration, run under torchrun in fresh processes."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU even where GPUs are
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   __file__, "--worker", size, fmt, str(int(asynchronous)), str(saves), out]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    found = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("MEASURED ")]
    if done.returncode or len(found) != ranks:
        raise RuntimeError(f"{size}, {fmt} (async: {asynchronous}) failed:\n{done.stderr[-4000:]}")
    return sorted(found, key=lambda r: r["rank"])


def row(size: str, fmt_label: str, ranks: list[dict]) -> str:
    """One table row: rank 0's medians over the saves (and the largest median peak of the other ranks)."""
    def median(rank: dict, key: str) -> float:
        return statistics.median(s[key] for s in rank["saves"])

    first, other = ranks[0], ranks[1:]
    state = first["model_bytes"] * 3 / MIB  # fp32 weights + AdamW's exp_avg and exp_avg_sq
    others = max((median(r, "peak") for r in other), default=float("nan"))
    return (f"| {SIZES[size][0]} | {first['model_bytes'] / 4 / 1e6:,.1f} M | {state:,.0f} | "
            f"{first['largest'] / MIB:,.0f} | {fmt_label} | {median(first, 'peak'):,.0f} | "
            f"{median(first, 'peak') / state:.2f} | {others:,.0f} | {median(first, 'kept'):,.0f} | "
            f"{median(first, 'stalled'):,.2f} | {median(first, 'complete'):,.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny Qwen3.5 only (a smoke run)")
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=None,
                        help=f"the models (default: {' '.join(DEFAULT_SIZES)})")
    parser.add_argument("--saves", type=int, default=3, help="saves per configuration (the table gives the median)")
    parser.add_argument("--ranks", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU per rank, NCCL (the host memory measured is still the process's RSS)")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        size, fmt, asynchronous, saves, out = args.worker
        return worker(size, fmt, asynchronous == "1", int(saves), Path(out))
    import platform

    sizes = args.sizes or (["tiny"] if args.quick else DEFAULT_SIZES)
    print(f"#### Checkpoints: rank 0's host memory and the stall per save ({args.ranks} ranks, FSDP2, fp32, "
          f"{'gloo, CPU' if args.device == 'cpu' else 'NCCL, CUDA'}, {platform.machine()}, {os.cpu_count()} cores; "
          f"real widths, reduced depth; median of {args.saves} saves; peak = VmHWM above the RSS before the first "
          "save)\n")
    print("| model (LLM shape, depth) | params | model + AdamW MiB | largest tensor MiB | save | rank 0 peak MiB | "
          "/ model + AdamW | rank 1 peak MiB | rank 0 kept after MiB | stall s | complete s |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        for fmt_label, (fmt, asynchronous) in FORMATS.items():
            print(row(size, fmt_label, measure(size, fmt, asynchronous, args.saves, args.ranks, args.device)),
                  flush=True)


if __name__ == "__main__":
    main()
