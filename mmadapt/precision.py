"""The precision policy as a type: what a run computes, keeps and reduces in, declared once.

A run config names its policy (`precision: {policy: bf16-autocast}`); the name is parsed here once
(`RunConfig.precision.mode`, `Precision.named`) and every reader asks the object instead of comparing names:

    precision = Precision.named("bf16-autocast")      # or FP32, BF16_AUTOCAST
    with precision.autocast(device): loss = model(**batch).loss
    precision.compute_dtype, precision.hidden_bytes    # bfloat16, 2: what activations are computed and kept in
    precision.param_dtype, precision.reduce_dtype      # FSDP2's MixedPrecisionPolicy: bfloat16, float32
    precision.describe()                               # the line the trainer prints at start

Policies: `fp32` (everything in fp32) and `bf16-autocast` (bf16 compute under autocast; fp32 master weights, AdamW
state, gradient accumulation and reduction). torch is imported when a dtype is asked for, so reading a config does
not import it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Precision:
    """A precision policy: `name` as a run config writes it (`precision.policy`), `flag` as `mmadapt numerics dump
    --autocast` writes it, the autocast dtype (None: no autocast, fp32 compute) and the sentence that describes it."""

    name: str
    flag: str
    autocast_dtype: str | None
    summary: str

    @classmethod
    def named(cls, name: str) -> Precision:
        """The policy a run config names (`precision.policy`)."""
        return _by("name", name, "precision.policy")

    @classmethod
    def from_flag(cls, flag: str) -> Precision:
        """The policy a command-line flag names (`--autocast none | bf16`)."""
        return _by("flag", flag, "--autocast")

    @property
    def autocasts(self) -> bool:
        """Whether the forward runs under autocast (a compute dtype narrower than the fp32 weights)."""
        return self.autocast_dtype is not None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run and activations are kept in."""
        import torch

        return getattr(torch, self.autocast_dtype or "float32")

    @property
    def hidden_bytes(self) -> int:
        """Bytes per element of a kept activation (the supervised rows' hidden states, the gathered parameters)."""
        return self.compute_dtype.itemsize

    @property
    def logit_bytes(self) -> int:
        """Bytes per logit the chunked loss keeps alive at once: one fp32 chunk, or (autocast) the compute-dtype
        logits, their fp32 copy and their compute-dtype gradient."""
        return 4 + 2 * self.hidden_bytes if self.autocasts else 4

    @property
    def param_dtype(self) -> torch.dtype | None:
        """FSDP2's parameter dtype for the forward (None: the parameters' own, fp32)."""
        return self.compute_dtype if self.autocasts else None

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are accumulated and reduced in: always fp32."""
        import torch

        return torch.float32

    def autocast(self, device: Any) -> AbstractContextManager:
        """The context the forward runs in on `device` (a torch.device or its type): autocast, or nothing."""
        if not self.autocasts:
            return nullcontext()
        import torch

        kind = device if isinstance(device, str) else device.type
        return torch.autocast(kind, dtype=self.compute_dtype)

    def describe(self) -> str:
        """The line the trainer prints at start."""
        return f"precision: {self.summary}"

    def __str__(self) -> str:
        return self.name


FP32 = Precision("fp32", "none", None, "fp32 everywhere (weights, compute, gradients, optimizer state, reduction)")
BF16_AUTOCAST = Precision("bf16-autocast", "bf16", "bfloat16",
                          "bf16 autocast compute; fp32 master weights, fp32 AdamW state, fp32 gradient accumulation, "
                          "fp32 gradient reduction")
PRECISIONS = (FP32, BF16_AUTOCAST)


def as_precision(value: Precision | str) -> Precision:
    """`value` as a `Precision` (a policy's name is parsed: `Precision.named`)."""
    return value if isinstance(value, Precision) else Precision.named(value)


def _by(field: str, value: str, setting: str) -> Precision:
    """The policy whose `field` is `value`; else a ValueError naming `setting` and its choices."""
    for precision in PRECISIONS:
        if getattr(precision, field) == value:
            return precision
    raise ValueError(f"{setting} must be one of {[getattr(p, field) for p in PRECISIONS]}, got {value!r}")
