"""Activation checkpointing (`train.activation_checkpointing`): peak memory and time of a training step with and
without it, at real widths and reduced depth, two depths so that the growth per layer shows.

    python benchmarks/bench_checkpointing.py            # about 6 minutes on 2 CPU cores
    python benchmarks/bench_checkpointing.py --quick    # tiny shapes: checks that it runs

Rows: Qwen3.5-2B's LLM width (2048 wide, 248,320 vocabulary; its first layers are Gated DeltaNet) at 2 and 4
layers, and LLaVA-1.5-7B's (Vicuna-7B: 4096 wide, 32,064 vocabulary) at 1 and 2 layers (the published models have
24 and 32; this CPU's time bounds the depth), a text batch of 1,024 tokens, fp32, the trainer's
loss without full logits; the backbone only is checkpointed (the vision tower follows the same pattern per
block). "fwd + bwd peak" is `VmHWM` over the forward and backward above what was resident before it (the
high-water mark reset through `/proc/self/clear_refs`), each configuration in its own process (`--quick`: all
in one process, to spare the start-ups). Time: the mean of the measured steps (`--steps`, default 1; a step before
them warms up when there are several).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import time

import torch
from bench_loss import _reset_peak, _status_kib, _trim_heap  # the same peak measurement as the loss benchmark

from mmadapt import build_model
from mmadapt.train.optim import enable_activation_checkpointing

ROWS = {  # name: (backbone, preset, depths)
    "Qwen3.5-2B width": ("qwen3_5", "qwen3.5-2b", (2, 4)),
    "LLaVA-1.5-7B width (Vicuna-7B)": ("llama", "vicuna-7b", (1, 2)),
}
QUICK = {"Qwen3.5 tiny": ("qwen3_5", "tiny", (2, 4)), "llama tiny": ("llama", "tiny", (2, 4))}


def _one(backbone: str, preset: str, layers: int, checkpointed: bool, tokens: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = build_model("clip", "mlp2x_gelu", {"name": backbone, "preset": preset,
                                               "options": {"num_hidden_layers": layers}}).train()
    if checkpointed:
        enable_activation_checkpointing(model, ["backbone"])
    vocab = model.backbone.config.vocab_size
    ids = torch.randint(3, min(vocab, 30000), (1, tokens))
    batch = {"input_ids": ids, "labels": ids.clone()}
    times, peaks = [], []
    warmup = 1 if steps > 1 else 0
    for k in range(steps + warmup):
        model.zero_grad(set_to_none=True)
        before = _status_kib("VmRSS")
        reset = _reset_peak()
        started = time.perf_counter()
        model(**batch).loss.backward()
        if k >= warmup:
            times.append(time.perf_counter() - started)
            peaks.append(_status_kib("VmHWM") - before if reset else float("nan"))
    return {"seconds": sum(times) / len(times), "peak_mib": max(peaks) / 1024}


def _child(configurations: list[tuple], queue: multiprocessing.Queue) -> None:
    results = []
    for k, configuration in enumerate(configurations):
        if k:  # the last configuration's memory handed back: the next one's peak counts only its own
            gc.collect()
            _trim_heap()
        results.append(_one(*configuration))
    queue.put(results)


def measure(configurations: list[tuple]) -> list[dict]:
    """_one(*c) for each (backbone, preset, layers, checkpointed, tokens, steps) c, in one fresh "spawn" process."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(configurations, queue))
    process.start()
    results = queue.get()
    process.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one step: checks that it runs")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    rows, tokens = (QUICK, 64) if args.quick else (ROWS, 1024)
    steps = 1 if args.quick else args.steps
    print(f"#### Activation checkpointing: fwd + bwd of {tokens} tokens, fp32, CPU, reduced depth\n")
    print("| model | layers | peak MiB without | peak MiB with | peak ratio | s without | s with | time ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    pairs = [(name, [(backbone, preset, layers, checkpointed, tokens, steps) for checkpointed in (False, True)])
             for name, (backbone, preset, depths) in rows.items() for layers in depths]
    # each configuration in its own process; --quick: all in one (the peak is reset before each step either way)
    quick_results = iter(measure([c for _, pair in pairs for c in pair])) if args.quick else None
    for name, pair in pairs:
        without, with_ = [next(quick_results) if quick_results else measure([c])[0] for c in pair]
        print(f"| {name} | {pair[0][2]} | {without['peak_mib']:.0f} | {with_['peak_mib']:.0f} | "
              f"{with_['peak_mib'] / max(without['peak_mib'], 1e-9):.2f}x | {without['seconds']:.2f} | "
              f"{with_['seconds']:.2f} | {with_['seconds'] / without['seconds']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
