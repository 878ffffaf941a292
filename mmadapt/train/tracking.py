"""Where a run's per-step records go: `log.jsonl` always, TensorBoard and Weights & Biases when asked.

`train.report_to: [jsonl, tensorboard, wandb]`. TensorBoard writes event files to `OUT/tensorboard` through
torch's `SummaryWriter`; W&B runs in `OUT/wandb` (offline with `WANDB_MODE=offline`, synced later with
`wandb sync`). Each record's numbers are logged as scalars, nested ones under their path (`lr_by_part/encoder`,
`time/data`); the run config (and its memory plan, when given: also `OUT/plan.json`) is logged once. Only the main
process reports.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from mmadapt.atomic import open_unlinked
from mmadapt.run_directory import RunDirectory


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a record, nested dicts flattened to 'a/b' (booleans as 0 / 1)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, bool | int | float) and math.isfinite(float(value)):
            out[name] = float(value)
    return out


class Tracker:
    """The reporters of one run. `log(record)` per step, `close()` at the end."""

    def __init__(self, out: Path, report_to: list[str], config: dict[str, Any], *,
                 plan: dict[str, Any] | None = None) -> None:
        self.out, self.run, self.names = Path(out), RunDirectory(out), report_to
        self.writer = self.wandb = None
        extra = {"plan": plan} if plan is not None else {}
        if plan is not None:
            with open_unlinked(self.run.plan_file, "w") as f:
                f.write(json.dumps(plan, indent=2) + "\n")
        for name in self.names[1:]:
            try:
                __import__(name)
            except ImportError:
                raise ValueError(f"train.report_to has {name}, which is not installed. Fix: pip install "
                                 f"'mmadapt[tracking]' (or {name}), or drop it from train.report_to") from None
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run.tensorboard_dir))
            self.writer.add_text("config", f"```\n{json.dumps({**config, **extra}, indent=2, default=str)}\n```")
        if "wandb" in self.names:
            import wandb

            self.run.wandb_dir.mkdir(parents=True, exist_ok=True)
            self.wandb = wandb.init(project="mmadapt", name=self.out.name, dir=str(self.out),
                                    config={**config, **extra}, reinit="create_new")

    def log(self, record: dict[str, Any]) -> None:
        with open_unlinked(self.run.log_file, "a") as f:
            f.write(json.dumps(record) + "\n")
        values = scalars({k: v for k, v in record.items() if k != "step"})
        step = int(record["step"])
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


class PartClock:
    """Wall time of the vision side (encoder + projector) inside a step's forward and backward; the rest of the
    forward + backward is the LLM's. The encoder's forward pre-hook and the projector's forward hook bound the
    vision forward; the first gradient to reach the projector's outputs marks the start of the vision backward,
    which lasts until the backward returns (`backward_done`). On CUDA each mark synchronises the device."""

    def __init__(self, model: Any, device: Any) -> None:
        import torch

        self.sync = torch.cuda.synchronize if getattr(device, "type", "cpu") == "cuda" else (lambda: None)
        self.seconds = 0.0
        self.started: float | None = None
        self.reached: float | None = None
        self.handles = [model.encoder.register_forward_pre_hook(self._enter),
                        model.projector.register_forward_hook(self._leave)]

    def _enter(self, *_: Any) -> None:
        self.sync()
        self.started = time.perf_counter()

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        self.sync()
        if self.started is not None:
            self.seconds += time.perf_counter() - self.started
            self.started = None
        for tensor in (output.features, *output.levels):
            if tensor.requires_grad:
                tensor.register_hook(self._reach)

    def _reach(self, grad: Any) -> None:
        if self.reached is None:
            self.sync()
            self.reached = time.perf_counter()

    def backward_done(self) -> None:
        if self.reached is not None:
            self.sync()
            self.seconds += time.perf_counter() - self.reached
            self.reached = None

    def take(self) -> float:
        """The vision seconds since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


# bf16 dense tensor-core peaks (TFLOP/s, without sparsity), from NVIDIA's data sheets; matched as substrings of
# torch.cuda.get_device_name(), longest first
PEAK_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "GH200": 989.4, "B200": 2250.0, "A100": 312.0,
               "L40S": 362.05, "L40": 181.05, "L4": 121.0, "A10G": 70.0, "A10": 125.0, "RTX 4090": 165.2,
               "RTX 3090": 71.0}


def peak_tflops(device: Any, configured: float | None) -> float | None:
    """`train.peak_tflops`, else the known peak of this CUDA device, else None (a CPU: no MFU)."""
    if configured is not None:
        return configured
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((PEAK_TFLOPS[k] for k in sorted(PEAK_TFLOPS, key=len, reverse=True) if k in name), None)


def batch_counts(batch: dict[str, Any]) -> tuple[int, int, int]:
    """(tokens, samples, images) of a collated batch: real positions, samples (several per packed row), images."""
    mask = batch.get("attention_mask")
    tokens = int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())
    per_sample = batch.get("images_per_sample")
    if per_sample is not None:
        return tokens, len(per_sample), int(per_sample.sum())
    return tokens, int(batch["input_ids"].shape[0]), 0


def peak_memory_mib(device: Any) -> float:
    """The peak since the last call: CUDA's max allocated (then reset), or the process's peak RSS (`VmHWM`)."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def speed_summary(history: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the run's steps (the first left out when there are more: it warms up) of the time split and
    the throughput."""
    import statistics

    steps = [r for r in history if "time" in r][1:] or [r for r in history if "time" in r]
    if not steps:
        return {}
    keys = [f"time/{k}" for k in ("data", "vision", "llm", "optimizer", "step")]
    keys += ["tokens_per_s", "supervised_per_s", "samples_per_s", "images_per_s", "tflops_per_s"]
    keys += ["mfu"] if all("mfu" in r for r in steps) else []
    return {key: statistics.median(scalars(r)[key] for r in steps) for key in keys}


def speed_table(speed: dict[str, float]) -> str:
    """The end-of-run summary: the median step's time split and throughput, as a small table."""
    step = speed["time/step"]
    shares = " | ".join(f"{100 * speed[f'time/{k}'] / step:.0f}%" for k in ("data", "vision", "llm", "optimizer"))
    mfu = f"{100 * speed['mfu']:.1f}%" if "mfu" in speed else "-"
    return ("| step s | data | vision | LLM | optimizer | tokens/s | supervised/s | samples/s | images/s | TFLOP/s | "
            "MFU |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
            f"| {step:.3f} | {shares} | {speed['tokens_per_s']:,.0f} | {speed['supervised_per_s']:,.0f} | "
            f"{speed['samples_per_s']:.2f} | {speed['images_per_s']:.2f} | {speed['tflops_per_s']:.3g} | {mfu} |")
