"""What a step's log record holds besides its objective's values: the learning rates (per part), and its speed
(throughput over every rank, FLOPs and MFU per device, peak memory).

The trainer adds these to every record of OUT/log.jsonl (and the trackers); `mmadapt.train.tracking` summarises the
speed of a run from them (`speed_summary`).
"""

from __future__ import annotations

from typing import Any

import torch

from mmadapt.flops import PARTS, step_flops
from mmadapt.train import distributed as dist_utils
from mmadapt.train.tracking import batch_counts, peak_memory_mib


def learning_rates(scheduler: Any, optimizer: Any, lr: float, lr_by_part: dict[str, float]) -> dict[str, Any]:
    """{"lr": this step's rate at `lr` (train.lr)} and, with `lr_by_part`, {"lr_by_part": {part: rate}}."""
    rates, groups = scheduler.get_last_lr(), optimizer.param_groups
    # the schedule's share of the peak, from a group with a peak (train.lr 0 leaves a group at 0: its share is 0)
    shares = [rate / group["initial_lr"] for rate, group in zip(rates, groups, strict=True) if group["initial_lr"]]
    factor = shares[0] if shares else 0.0
    at_peak = [rate for rate, group in zip(rates, groups, strict=True) if group["initial_lr"] == lr]
    out: dict[str, Any] = {"lr": at_peak[0] if at_peak else factor * lr}
    if lr_by_part:
        out["lr_by_part"] = {part: factor * rate for part, rate in lr_by_part.items()}
    return out


def step_speed(model: Any, micro: list[dict[str, Any]], supervised: int, seconds: float, device: torch.device,
               peak_tflops: float | None, data_group: Any = None) -> dict[str, Any]:
    """Tokens, supervised tokens, samples and images per second over every rank; peak memory; for a VLM, this rank's
    FLOPs per part, the vision side's share, TFLOP/s and (with a known peak) MFU. Under sequence parallelism
    (`model.sequence_parallel`) a rank runs its group's vision side whole and 1 / N of the LLM and the output layer.
    """
    counts = torch.tensor([sum(batch_counts(b)[k] for b in micro) for k in range(3)], dtype=torch.float64)
    tokens, samples, images = dist_utils.all_reduce_sum(counts.to(device), data_group).tolist()  # each sample once
    out: dict[str, Any] = dict(tokens_per_s=tokens / seconds, supervised_per_s=supervised / seconds,
                               samples_per_s=samples / seconds, images_per_s=images / seconds,
                               peak_memory_mib=peak_memory_mib(device))
    if hasattr(model, "encoder"):
        flops = dict.fromkeys(PARTS, 0.0)
        split = getattr(getattr(model, "sequence_parallel", None), "size", 1)
        for batch in micro:
            if batch["input_ids"].shape[0]:
                for part, value in step_flops(model, batch).step.items():
                    flops[part] += value / (split if part in ("llm", "output") else 1)
        total = sum(flops.values())
        out.update(flops={**flops, "total": total}, vision_flops_share=(flops["vision"] + flops["projector"]) / max(
            total, 1.0), tflops_per_s=total / seconds / 1e12)
        if peak_tflops is not None:
            out["mfu"] = out["tflops_per_s"] / peak_tflops
    return out
