"""A GRPO rollout with each prompt prefilled once and its cache copied G ways, against the G rows prefilled side by
side.

    python benchmarks/bench_rollout.py [--quick] [--reps 3] [--prompts 2] [--generations 8] [--answer-tokens 32]
                                       [--device cpu|cuda] [--config NAME]

B prompts, one image each, answered G times by mmadapt's `generate` (sampled at temperature 1, each answer from its
own seed: `row_seeds`), no end token, so every answer is `--answer-tokens` long and both layouts do the same decode
steps. Three layouts of the same B x G answers:
- prefill once (mmadapt, `rollout` -> `generate(repeats=G)`): the B prompts prefilled, each picture encoded once, and
  the cache (attention keys and values, Gated DeltaNet conv and recurrent states) copied G ways
  (`Cache.reorder_cache`);
- G prefills, pictures shared: the B x G rows prefilled side by side, each picture still encoded once
  (`image_index`): mmadapt's rollout before this change;
- G prefills, a picture per row: every row with its own copy of its picture, as a rollout through transformers'
  `generate` with the prompt repeated G times (`num_return_sequences`, trl without vLLM) runs it.
Measured, alternating the layouts, medians over `--reps` after one warm-up each: the rollout's seconds, the
prefill's (to the first sampled token, `on_step`), and the peak memory above the weights (VmHWM on the CPU, as
bench_grpo.py; `max_memory_allocated` on CUDA). The answers must agree: the share of the B x G answers equal token
for token to the prefill-once layout's is printed (the prefill's batch differs, so float sums may round apart and a
sample may flip; at fp32 they were equal).

Measured (2026-12-04, x86_64, 2 threads, torch 2.14.1; about 5 minutes), Qwen3.5-0.8B-shaped at its real widths and
vocabulary, cut in depth: ViT 768 wide, 2 of 12 blocks; LLM 1024 wide, 4 of 24 layers (3 Gated DeltaNet + 1 gated
attention), 248,320 vocabulary, tied. B = 2 prompts of up to 311 tokens (a 512 x 512 image: 256 visual tokens) x
G = 8 answers of 32 sampled tokens, fp32; medians of 3:

| layout | pictures encoded | prefill rows | rollout s | prefill s | peak MiB | time | prefill | peak | same answers |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| prefill once, cache copied G ways (mmadapt) | 2 | 2 | 15.38 | 1.35 | 330 | 1.00x | 1.00x | 1.00x | 100% |
| G prefills, each picture once | 2 | 16 | 20.68 | 6.89 | 880 | 1.34x | 5.12x | 2.67x | 100% |
| G prefills, a picture per row (HF generate, trl) | 16 | 16 | 24.87 | 10.97 | 868 | 1.62x | 8.15x | 2.63x | 100% |

The prefill runs on 2 rows instead of 16: 5.1x faster than the G rows side by side (8.2x against a picture per row),
and the rollout's peak above the weights is 2.7x lower (the 16 rows' prefill activations). The decode steps are the
same 16 rows in all three, and on the CPU they dominate (each step's 248,320-way head for 16 rows), so the whole
rollout is 1.34x (1.62x) faster. All three layouts sampled the same answers token for token.

`--quick`: tiny model, G = 2, 8 tokens, 1 rep (a smoke run for the test suite; its numbers mean nothing).
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_grpo import CONFIGS, Meter, parse_rl_arguments, per_row_layout, prompt_batch
from bench_loss import build

LAYOUTS = ("prefill once, cache copied G ways (mmadapt)", "G prefills, each picture once",
           "G prefills, a picture per row (HF generate, trl)")


@dataclass
class Rollout:
    answers: torch.Tensor
    seconds: float
    prefill_seconds: float
    pictures: int
    peak_mib: float


def inputs_for(layout: str, prompts: dict[str, Any], g: int) -> dict[str, Any]:
    """`generate`'s inputs for `layout`: the B prompts with repeats=G, or the B x G rows."""
    from mmadapt.train.objectives.rollout import INPUTS, group_rows

    if layout == LAYOUTS[0]:
        return {**{k: v for k, v in prompts.items() if k in INPUTS}, "repeats": g}
    rows = {**{k: v for k, v in prompts.items() if k in ("pixel_values", "image_grid_thw")}, **group_rows(prompts, g)}
    if layout == LAYOUTS[1]:
        return rows
    rows = {**rows, "labels": None}
    out = per_row_layout(rows, prompts)
    out.pop("labels")
    return out


@torch.no_grad()
def one_rollout(model: Any, inputs: dict[str, Any], seeds: torch.Tensor, tokens: int, meter: Meter) -> Rollout:
    seen, first = {"pictures": 0}, {}

    def count(module: Any, args: tuple, output: Any) -> None:
        seen["pictures"] += int(output.grids.shape[0])

    def on_step(step: Any) -> None:
        if step.index == 0:
            if meter.cuda:
                torch.cuda.synchronize()
            first["at"] = time.perf_counter()

    hook = model.encoder.register_forward_hook(count)
    try:
        meter.start()
        started = time.perf_counter()
        answers = model.generate(**inputs, max_new_tokens=tokens, eos_token_id=None, pad_token_id=0, temperature=1.0,
                                 row_seeds=seeds, on_step=on_step)
        if meter.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        peak = meter.stop()
    finally:
        hook.remove()
    return Rollout(answers.cpu(), seconds, first["at"] - started, seen["pictures"], peak)


def main() -> None:
    from mmadapt.train.batches import to_device
    from mmadapt.train.objectives.rollout import row_seeds

    args, device = parse_rl_arguments(__doc__.split("\n")[0], "every answer's length (no end token)")
    config = CONFIGS[args.config]
    model = build(config, args.quick).to(device).eval()
    prompts = to_device(prompt_batch(model, config, args.quick, args.prompts), device)
    g = args.generations
    seeds = row_seeds(0, 0, [f"prompt-{b}" for b in range(args.prompts)], g).to(device)
    layouts = {name: inputs_for(name, prompts, g) for name in LAYOUTS}
    meter = Meter(device)
    runs: dict[str, list[Rollout]] = {name: [] for name in LAYOUTS}
    for rep in range(args.reps + 1):
        for name, inputs in layouts.items():
            result = one_rollout(model, inputs, seeds, args.answer_tokens, meter)
            print(f"  {'rep ' + str(rep) if rep else 'warm-up'}, {name}: {result.seconds:.2f} s (prefill "
                  f"{result.prefill_seconds:.2f} s), {result.peak_mib:,.0f} MiB", file=sys.stderr, flush=True)
            if rep:
                runs[name].append(result)
    visual = int(model.projector.output_grids(prompts["image_grid_thw"][:1]).prod())
    prompt_tokens = int(prompts["attention_mask"].sum(1).max())
    where = (f"{platform.machine()}, {torch.get_num_threads()} threads" if device.type == "cpu"
             else torch.cuda.get_device_name())
    name, shape = ("tiny; QUICK: numbers mean nothing", "tiny presets") if args.quick else (args.config,
                                                                                            config["depth"])
    print(f"### GRPO rollout, each prompt prefilled once vs G prefills ({name}; fp32, {where}, torch "
          f"{torch.__version__})\n")
    print(f"{shape}; B = {args.prompts} prompts of up to {prompt_tokens} tokens ({visual} visual tokens each) x G = "
          f"{g} answers of {args.answer_tokens} sampled tokens; medians of {args.reps}\n")
    print("| layout | pictures encoded | prefill rows | rollout s | prefill s | peak MiB | time | prefill | peak | "
          "same answers |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = runs[LAYOUTS[0]]
    base_s, base_p = (statistics.median(r.seconds for r in base), statistics.median(r.prefill_seconds for r in base))
    base_mib = statistics.median(r.peak_mib for r in base)
    for layout, results in runs.items():
        seconds = statistics.median(r.seconds for r in results)
        prefill = statistics.median(r.prefill_seconds for r in results)
        mib = statistics.median(r.peak_mib for r in results)
        same = float((results[0].answers == base[0].answers).all(dim=1).float().mean())
        rows = args.prompts if layout == LAYOUTS[0] else args.prompts * g
        print(f"| {layout} | {results[0].pictures} | {rows} | {seconds:.2f} | {prefill:.2f} | {mib:,.0f} | "
              f"{seconds / base_s:.2f}x | {prefill / base_p:.2f}x | {mib / max(base_mib, 1e-9):.2f}x | {same:.0%} |")


if __name__ == "__main__":
    main()
