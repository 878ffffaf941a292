"""A GRPO step with each picture encoded once for its G answers, against the same step encoding every row's picture.

    python benchmarks/bench_grpo.py [--quick] [--reps 3] [--prompts 2] [--generations 8] [--answer-tokens 32]
                                    [--betas 0,0.04] [--device cpu|cuda] [--config NAME]

One GRPO step's forward + loss + backward (`mmadapt.train.objectives`, fp32, everything training: vision tower,
merger, LLM) over the same R = B x G rows, laid out two ways:
- shared (mmadapt, `GrpoObjective.training_rows`): each prompt's picture encoded once (`encode_prompts`, with its
  graph), handed to the policy's forward (`Encoded.for_rows`: `visual=encoded.take(image_index)`, `scored_rows`),
  and, when beta > 0, to the reference's no-grad forward detached: B encodings per step;
- per row (what trl, verl and EasyR1 do): the same rows with each row's picture in `pixel_values` (no
  `image_index`), so the vision tower runs for every row in every forward: B x G encodings per step (2 B x G with
  the reference).
The rows are rollout-free: fixed answers (`Rollouts` built directly, random ids, T = `--answer-tokens` at most,
each answer between T/2 and T tokens), so generation time does not hide the step and both variants score the same
rows; fixed random rewards give the group advantages (`group_advantages`); the loss is `policy_loss` (trl's
defaults: dapo, epsilon 0.2; the reference, when beta > 0, is the same weights under no_grad, as mmadapt's LoRA
reference costs the same forward). No optimizer step (the same in both).
Measured, alternating the variants, medians over `--reps` after one warm-up step each:
- step seconds: from the encoding (shared) or the forward (per row) to the end of the backward;
- vision seconds: the trainer's own `PartClock` (encoder + merger forward, and the backward from the first gradient
  to reach the merger's output), their share of the step;
- peak memory: on the CPU the process's `VmHWM` (reset through /proc/self/clear_refs) minus its RSS before the step
  (weights; gradients freed, as the trainer's `zero_grad(set_to_none=True)`; freed memory handed back first, and
  glibc's mmap threshold fixed as `mmadapt train` fixes it, `mmadapt.train.cpu_memory`), so it counts the gradients
  the backward allocates; on CUDA `max_memory_allocated` minus the memory allocated before the step.
Both variants must give the same loss, per-token log-probs and gradient norms (vision tower, merger, LLM) within
1e-4 relative (asserted; "gap" is the largest relative difference). The on-policy loss's value does not depend on
the log-probs (the ratio is 1), so the log-probs and the gradients are the real check.

Measured (2026-12-04, x86_64, 2 threads shared with other work, torch 2.14.1; about 17 minutes), Qwen3.5-0.8B-shaped
at its real widths and vocabulary, cut in depth by the same factor on both sides: ViT 768 wide, 2 of 12 blocks; merger;
LLM 1024 wide, 4 of 24 layers (3 Gated DeltaNet + 1 gated attention), 248,320 vocabulary, tied (367 M parameters).
B = 2 prompts x G = 8 answers = 16 rows of up to 343 tokens, one 512 x 512 image per prompt (256 visual tokens),
answers of 16-32 tokens; forward + dapo loss + backward, everything training; medians of 3:

| variant | beta | vision encodings per step | step s | vision s (share) | peak MiB | time ratio | peak ratio | gap |
|---|---:|---|---:|---:|---:|---:|---:|---:|
| shared (each picture once) | 0 | 2 (512 tokens) | 33.42 | 1.35 (4%) | 9,661 | 1.00x | 1.00x | 0 (bitwise) |
| per row (trl, verl, EasyR1) | 0 | 16 (4,096 tokens) | 47.45 | 11.53 (24%) | 11,403 | 1.42x | 1.18x | 0 (bitwise) |
| shared (each picture once) | 0.04 | 2 (512 tokens) | 40.70 | 1.34 (3%) | 9,633 | 1.00x | 1.00x | 0 (bitwise) |
| per row (trl, verl, EasyR1) | 0.04 | 32 (8,192 tokens) | 62.00 | 17.37 (28%) | 11,489 | 1.52x | 1.19x | 0 (bitwise) |

Encoding each picture once cuts the vision tower's time 8.5x (13x with the reference's forward), and the step by 30%
(34%); the peak by the 14 extra pictures' activations (1.7 GiB at 2 ViT blocks; they grow with its depth). The two
layouts' log-probs and gradient norms agreed bit for bit. On the CPU the LLM's Gated DeltaNet layers run
transformers' reference implementation (flash-linear-attention is not installed), which inflates the LLM's share of
the step. `--config "Qwen3.5-0.8B, full depth" --device cuda` is for a GPU (not measured yet).

`--quick`: tiny model, G = 2, 8-token answers, 1 rep (a smoke run for the test suite; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmadapt.heads import TokenLogps

sys.path.insert(0, str(Path(__file__).parent))

from bench_loss import _reset_peak, _status_kib, _trim_heap, build

CONFIGS = {
    "Qwen3.5-0.8B-shaped, ViT 2/12, LLM 4/24": dict(
        names=("qwen3_5_vit", "qwen_merger", "qwen3_5"), preset="qwen3.5-0.8b", encoder_options={"depth": 2},
        backbone_options={"num_hidden_layers": 4}, image_side=(512, 512),
        depth="ViT 768 wide, 2 of 12 blocks; LLM 1024 wide, 4 of 24 layers (3 Gated DeltaNet + 1 gated attention); "
              "248,320 vocabulary, tied"),
    "Qwen3.5-0.8B, full depth": dict(
        names=("qwen3_5_vit", "qwen_merger", "qwen3_5"), preset="qwen3.5-0.8b", encoder_options={},
        backbone_options={}, image_side=(512, 512),
        depth="ViT 12 blocks, LLM 24 layers, 248,320 vocabulary, tied (a GPU's config)"),
}
QUESTION_TOKENS = [38, 51, 44, 30, 57, 41, 35, 48]  # the text after each prompt's image


@dataclass(frozen=True)
class Layout:
    """How a step's rows see their pictures: `shared`, each picture encoded once for its G rows, or each row's own."""

    name: str
    shared: bool


LAYOUTS = (Layout("shared (each picture once)", True),
           Layout("per row (trl, verl, EasyR1)", False))


@dataclass
class Step:
    """One step's results: its loss, the per-token log-probs (R, T), the gradient norms by part, the pictures the
    vision tower encoded, time, memory."""

    loss: float
    logps: torch.Tensor
    grad_norms: dict[str, float]
    pictures: int
    seconds: float
    vision_seconds: float
    peak_mib: float


def prompt_batch(model: Any, config: dict, quick: bool, prompts: int) -> dict[str, Any]:
    """B generation prompts, one image each (then a question), as the prompt collator gives them (no labels)."""
    from mmadapt.synthetic import synthetic_batch

    sides = None if quick else [config["image_side"]] * prompts
    text = (QUESTION_TOKENS * prompts)[:prompts]
    batch = synthetic_batch(model, (1,) * prompts, image_sides=sides, text_lengths=text, seed=1)
    batch["attention_mask"] = batch["attention_mask"].long()
    return {k: v for k, v in batch.items() if k != "labels"}


def fixed_rollouts(model: Any, prompts: int, generations: int, answer_tokens: int) -> Any:
    """R = B x G answers of random ordinary tokens, each between T/2 and T long (the rest `pad`)."""
    from mmadapt.train.objectives.rollout import Rollouts

    g = torch.Generator().manual_seed(3)
    rows = prompts * generations
    special = torch.tensor([t for t in model.tokens.ids() if t is not None])
    ids = torch.randint(0, min(model.backbone.config.vocab_size, 50_000), (rows, answer_tokens), generator=g)
    ids[torch.isin(ids, special)] = 7  # never a vision token
    lengths = torch.randint(max(answer_tokens // 2, 1), answer_tokens + 1, (rows,), generator=g)
    mask = torch.arange(answer_tokens)[None, :] < lengths[:, None]
    return Rollouts(ids.masked_fill(~mask, 0), mask, torch.zeros(rows, dtype=torch.bool), generations)


def per_row_layout(rows: dict[str, Any], prompts: dict[str, Any]) -> dict[str, Any]:
    """The scored rows with each row's own copy of its picture in `pixel_values` (no `image_index`)."""
    out = dict(rows)
    index = out.pop("image_index")
    patches = prompts["image_grid_thw"].prod(dim=1) if "image_grid_thw" in prompts else None
    if patches is None:  # a fixed-size encoder: one (C, H, W) per picture
        out["pixel_values"] = prompts["pixel_values"][index]
        return out
    starts = torch.cumsum(patches, 0) - patches
    out["pixel_values"] = torch.cat([prompts["pixel_values"][int(starts[i]):int(starts[i] + patches[i])]
                                     for i in index.tolist()])
    out["image_grid_thw"] = prompts["image_grid_thw"][index]
    return out


class Meter:
    """Peak memory of a region above what was resident before it: the CPU's VmHWM, or CUDA's allocator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.before = 0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            _trim_heap()
            self.before = _status_kib("VmRSS") * 1024
            if not _reset_peak():
                raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): a Linux process is needed")

    def stop(self) -> float:
        """MiB above the start."""
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.before) / 2**20
        return (_status_kib("VmHWM") * 1024 - self.before) / 2**20


def grpo_step(model: Any, layout: Layout, rows: dict[str, Any], prompts: dict[str, Any], done: Any,
              advantages: torch.Tensor, settings: Any, meter: Meter) -> Step:
    """One step's forward(s) + loss + backward with `layout`'s pictures (the module docstring)."""
    from mmadapt.train.objectives.grpo.loss import policy_loss
    from mmadapt.train.objectives.rollout import completion_logps, encode_prompts
    from mmadapt.train.tracking import PartClock

    model.zero_grad(set_to_none=True)
    clock = PartClock(model, meter.device)
    seen = {"pictures": 0}

    def count(module: Any, args: tuple, output: Any) -> None:
        seen["pictures"] += int(output.grids.shape[0])

    hook = model.encoder.register_forward_hook(count)
    try:
        meter.start()
        started = time.perf_counter()
        if layout.shared:
            encoded = encode_prompts(model, prompts)
            policy_rows = {**rows, **encoded.for_rows(rows)}
            reference_rows = {**rows, **encoded.detached().for_rows(rows)}
        else:
            policy_rows = reference_rows = rows
        per_token = completion_logps(model(**policy_rows, head=TokenLogps()).logps, rows["labels"], done)
        reference = None
        if settings.beta > 0:
            with torch.no_grad():
                reference = completion_logps(model(**reference_rows, head=TokenLogps()).logps, rows["labels"], done)
        terms = policy_loss(per_token, None, reference, advantages, done.mask, settings)
        terms.loss.backward()
        clock.backward_done()
        if meter.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        peak = meter.stop()
    finally:
        clock.close()
        hook.remove()
    return Step(float(terms.loss.detach()), per_token.detach().cpu(), grad_norms(model), seen["pictures"], seconds,
                clock.take(), peak)


def grad_norms(model: Any) -> dict[str, float]:
    """The gradient's norm over each part's parameters."""
    parts = {"vision tower": model.encoder, "merger": model.projector, "LLM": model.backbone}
    return {name: float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in part.parameters()
                                                              if p.grad is not None])))
            for name, part in parts.items()}


def check_same(a: Step, b: Step, tolerance: float) -> float:
    """The largest relative difference of the two steps' loss, log-probs and gradient norms (asserted <= tolerance)."""
    scale = float(a.logps.abs().max().clamp(min=1e-12))
    gaps = {"loss": abs(a.loss - b.loss) / max(abs(a.loss), 1e-12),
            "log-probs": float((a.logps - b.logps).abs().max()) / scale}
    gaps |= {f"{part} gradient": abs(a.grad_norms[part] - b.grad_norms[part]) / max(a.grad_norms[part], 1e-12)
             for part in a.grad_norms}
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] <= tolerance, f"the layouts differ: {worst} by {gaps[worst]:.2e} relative (> {tolerance})"
    return gaps[worst]


def measure(model: Any, config: dict, args: argparse.Namespace, beta: float, device: torch.device
            ) -> dict[Layout, list[Step]]:
    """Each layout's steps (a warm-up, then `reps`, alternating) at this beta."""
    from mmadapt.train.batches import to_device
    from mmadapt.train.objectives.grpo.loss import PolicyLoss, group_advantages
    from mmadapt.train.objectives.rollout import scored_rows

    prompts = to_device(prompt_batch(model, config, args.quick, args.prompts), device)
    done = fixed_rollouts(model, args.prompts, args.generations, args.answer_tokens)
    done = dataclasses.replace(done, completions=done.completions.to(device), mask=done.mask.to(device),
                               truncated=done.truncated.to(device))
    rows = scored_rows(prompts, done, pad_token_id=0)
    layouts = {LAYOUTS[0]: rows, LAYOUTS[1]: per_row_layout(rows, prompts)}
    rewards = torch.rand(args.prompts * args.generations, generator=torch.Generator().manual_seed(4))
    advantages = group_advantages(rewards, args.generations).advantages.to(device)
    settings, meter = PolicyLoss(beta=beta), Meter(device)
    steps: dict[Layout, list[Step]] = {layout: [] for layout in LAYOUTS}
    for rep in range(args.reps + 1):
        for layout, layout_rows in layouts.items():
            step = grpo_step(model, layout, layout_rows, prompts, done, advantages, settings, meter)
            print(f"  beta {beta:g}, {'rep ' + str(rep) if rep else 'warm-up'}, {layout.name}: {step.seconds:.2f} s "
                  f"(vision {step.vision_seconds:.2f} s), {step.peak_mib:,.0f} MiB", file=sys.stderr, flush=True)
            if rep:  # the first is a warm-up
                steps[layout].append(step)
    model.zero_grad(set_to_none=True)
    return steps


def table(steps: dict[Layout, list[Step]], args: argparse.Namespace, beta: float, visual_tokens: int) -> list[str]:
    """The two layouts' rows (medians), after checking that each pair of steps agrees."""
    shared = steps[LAYOUTS[0]]
    gap = max(check_same(a, b, 1e-4) for a, b in zip(shared, steps[LAYOUTS[1]], strict=True))
    base_s = statistics.median(s.seconds for s in shared)
    base_mib = statistics.median(s.peak_mib for s in shared)
    agreement = f"{gap:.1e}" if gap else "0 (bitwise)"
    lines = []
    for layout, runs in steps.items():
        seconds = statistics.median(s.seconds for s in runs)
        vision = statistics.median(s.vision_seconds for s in runs)
        mib = statistics.median(s.peak_mib for s in runs)
        encodings = runs[0].pictures
        lines.append(f"| {layout.name} | {beta:g} | {encodings} ({encodings * visual_tokens:,} tokens) | "
                     f"{seconds:.2f} | {vision:.2f} ({vision / seconds:.0%}) | {mib:,.0f} | "
                     f"{seconds / base_s:.2f}x | {mib / base_mib:.2f}x | {agreement} |")
    return lines


def parse_rl_arguments(description: str, answer_help: str, parser: argparse.ArgumentParser | None = None
                       ) -> tuple[argparse.Namespace, torch.device]:
    """The arguments the RL benchmarks share (`--quick`: G = 2, 8 tokens, 1 rep), and the device, readied (on the
    CPU freed memory is handed back, as `mmadapt train` does, so that peaks measure the step)."""
    parser = parser or argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny model, G = 2, 1 rep (smoke run)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2, help="B, prompts (one image each)")
    parser.add_argument("--generations", type=int, default=8, help="G, answers per prompt")
    parser.add_argument("--answer-tokens", type=int, default=32, help=answer_help)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--config", default=next(iter(CONFIGS)), choices=list(CONFIGS))
    args = parser.parse_args()
    if args.quick:
        args.reps, args.generations, args.answer_tokens = 1, 2, 8
    device = torch.device(args.device)
    if device.type == "cpu":
        from mmadapt.train.cpu_memory import return_freed_memory

        return_freed_memory()
    return args, device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--betas", default="0,0.04", help="comma-separated KL weights (> 0: a reference forward)")
    args, device = parse_rl_arguments(parser.description, "T, the longest answer", parser)
    config = CONFIGS[args.config]
    model = build(config, args.quick).to(device).train()
    prompts = prompt_batch(model, config, args.quick, args.prompts)
    visual_tokens = int(model.projector.output_grids(prompts["image_grid_thw"][:1]).prod())
    longest = int(prompts["attention_mask"].sum(1).max()) + args.answer_tokens
    where = (f"{platform.machine()}, {torch.get_num_threads()} threads" if device.type == "cpu"
             else torch.cuda.get_device_name())
    name, shape, side = ("tiny; QUICK: numbers mean nothing", "tiny presets", "") if args.quick else (
        args.config, config["depth"], "x".join(map(str, config["image_side"])) + " px ")
    print(f"### GRPO step, each picture encoded once vs once per row ({name}; fp32, {where}, torch "
          f"{torch.__version__})\n")
    print(f"{shape}; B = {args.prompts} prompts x G = {args.generations} answers = {args.prompts * args.generations} "
          f"rows of up to {longest} tokens, one {side}image per prompt ({visual_tokens} visual tokens), answers of "
          f"{args.answer_tokens // 2}-{args.answer_tokens} tokens; forward + dapo loss + backward, everything "
          f"training; medians of {args.reps}\n")
    print("| variant | beta | vision encodings per step | step s | vision s (share) | peak MiB | time ratio | "
          "peak ratio | gap |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for beta in (float(b) for b in args.betas.split(",")):
        steps = measure(model, config, args, beta, device)
        print("\n".join(table(steps, args, beta, visual_tokens)), flush=True)


if __name__ == "__main__":
    main()
