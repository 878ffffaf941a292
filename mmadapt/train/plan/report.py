"""The plan as a result: `Plan` (per-GPU bytes by kind, fits or not, the changes that would fit; a QLoRA base's
weights in 4 bits, `QuantizedParameters`) formats its own table and JSON; sizes in GiB both ways (`gib`,
`parse_size`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mmadapt.train.plan.workloads import Workload

GIB = 1024**3
CONTEXT_BYTES = GIB  # CUDA context + NCCL buffers
FRAGMENTATION = 0.05  # the caching allocator's


def cuda_margin(total: float) -> int:
    """What a CUDA device needs beside a step's `total`: its context and NCCL buffers, and fragmentation."""
    return int(CONTEXT_BYTES + FRAGMENTATION * total)


@dataclass(frozen=True)
class QuantizedParameters:
    """A QLoRA base's weights stored in NF4: how many, their bytes as stored, the bytes they would take in the dtype
    they are read in, and which linear layers are in NF4 and which kept (`mmadapt.quantize.NF4Layout.summary`)."""

    parameters: int
    bytes: int
    source_bytes: int
    layout: str

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_parameter": self.bytes / max(self.parameters, 1)}

    def line(self) -> str:
        return (f"4-bit (NF4, QLoRA): {self.parameters:,} parameters in {gib(self.bytes)} "
                f"({self.bytes / max(self.parameters, 1):.4f} bytes each, {gib(self.source_bytes)} unquantised); "
                f"{self.layout}")


@dataclass
class Plan:
    gpus: int
    device: str
    strategy: str
    workload: Workload
    per_gpu: dict[str, int]
    activations_without_checkpointing: int
    activations_with_checkpointing: int
    checkpointing: list[str]
    parameters_by_dtype: dict[str, int]
    margin: int
    gpu_memory: int | None
    notes: list[str] = field(default_factory=list)
    attention: dict[str, str] = field(default_factory=dict)  # {part: its attention path, how it grows with length}
    suggestions: list[tuple[str, int]] = field(default_factory=list)
    host: Any = None  # the data loading's host memory per rank (`mmadapt.data.memory.DataMemory`), when planned
    saving: Any = None  # a checkpoint save's host memory per rank (`mmadapt.train.plan.saving.SavingMemory`)
    quantized: QuantizedParameters | None = None  # stages.backbone: qlora's NF4 weights (in `parameters_by_dtype`)

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.per_gpu["total"] + self.margin <= self.gpu_memory

    def margin_of(self, total: float) -> int:
        """The margin a step of `total` bytes needs on this plan's device (a suggested change's, for one)."""
        return cuda_margin(total) if self.device == "cuda" else 0

    def to_json(self) -> dict[str, Any]:
        return {"fits": self.fits, "per_gpu": dict(self.per_gpu), "margin": self.margin, "gpus": self.gpus,
                "gpu_memory": self.gpu_memory, "device": self.device, "strategy": self.strategy,
                "workload": asdict(self.workload), "parameters_by_dtype": self.parameters_by_dtype,
                "activations": {"without_checkpointing": self.activations_without_checkpointing,
                                "with_checkpointing": self.activations_with_checkpointing},
                "attention": self.attention, "notes": self.notes,
                "suggestions": [{"change": c, "total": t} for c, t in self.suggestions],
                **({"host": self.host.to_json()} if self.host is not None else {}),
                **({"saving": self.saving.to_json()} if self.saving is not None else {}),
                **({"quantized": self.quantized.to_json()} if self.quantized is not None else {})}

    def table(self) -> str:
        rows = [("parameters", self.per_gpu["parameters"],
                 ", ".join(f"{d} {gib(b)}" for d, b in self.parameters_by_dtype.items())),
                ("gradients", self.per_gpu["gradients"], "fp32, trained parameters"),
                ("optimizer", self.per_gpu["optimizer"], "AdamW moments (fp32) + its step's temporaries"),
                ("activations", self.per_gpu["activations"],
                 f"checkpointing {'+'.join(self.checkpointing) or 'off'}: "
                 f"off {gib(self.activations_without_checkpointing)}, all {gib(self.activations_with_checkpointing)}"),
                ("loss", self.per_gpu["loss"], "supervised rows' gradients + one chunk of logits"),
                ("sharding", self.per_gpu["sharding"], "FSDP2 unsharded units / DDP buckets"),
                *([("exchange", self.per_gpu["exchange"], "sequence parallelism's all-to-all: the largest tensor "
                    "exchanged, sent and received")] if "exchange" in self.per_gpu else []),
                *([("rollout", self.per_gpu["rollout"], "GRPO's generation: the cache of B x G rows, logits, a "
                    "prefill layer (between steps)")] if "rollout" in self.per_gpu else []),
                ("total (peak)", self.per_gpu["total"], "one training step, per device")]
        if self.device == "cuda":
            rows.append(("margin", self.margin, "CUDA context 1 GiB + 5% allocator fragmentation"))
        lines = [f"plan: {self.gpus} x {self.device}{'' if self.gpu_memory is None else ' ' + gib(self.gpu_memory)}, "
                 f"{self.strategy}; micro-batch {self.workload.describe()}"]
        lines += [f"  {name:<13} {gib(value):>10}   {what}" for name, value, what in rows]
        if self.quantized is not None:
            lines.append(self.quantized.line())
        if self.fits is not None:
            need = gib(self.per_gpu["total"] + self.margin)
            lines.append(f"fits: {'yes' if self.fits else 'NO'} ({need} needed of {gib(self.gpu_memory)})")
            if not self.fits:
                lines += [f"  would fit: {change} ({gib(total + self.margin_of(total))})"
                          for change, total in self.suggestions if total + self.margin_of(total) <= self.gpu_memory
                          ] or ["  none of: " + ", ".join(c for c, _ in self.suggestions)]
        if self.host is not None:
            lines.append(f"host, per rank (data loading): {gib(self.host.private)} private; {gib(self.host.mapped)} "
                         "of records mapped from the records cache (shared page cache)")
            lines += [f"  {name:<13} {gib(value):>10}   {what}" for name, value, what in self.host.rows]
        if self.saving is not None:
            lines += self.saving.lines()
        lines += [f"attention, {part}: {path}" for part, path in self.attention.items()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def parse_size(text: str, flag: str = "--gpu-memory") -> int:
    """'80GiB', '80GB' (= GiB, as GPUs are sold), '81920MiB', '1.5TiB' -> bytes; `flag`: the option it came from."""
    units = {"t": 1024**4, "g": GIB, "m": 1024**2, "k": 1024}
    value = text.strip().lower().removesuffix("b").removesuffix("i")
    if value and value[-1] in units:
        return int(float(value[:-1]) * units[value[-1]])
    raise ValueError(f"{flag} {text!r}: give a size such as 80GiB, 141GB or 24576MiB")
