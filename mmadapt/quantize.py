"""4-bit NormalFloat (NF4) weights for QLoRA bases: which of a backbone's linear layers are stored in 4 bits, and
what stays in its precision, with why.

`stages.backbone: qlora` stores the frozen LLM's large linear layers as torchao's `NF4Tensor` (QLoRA's NormalFloat:
a 4-bit code per weight, an absmax scale per `block_size` weights, and those scales themselves quantised to int8 per
`scaler_block_size` of them: QLoRA's double quantisation) and trains LoRA layers on top (`mmadapt.qlora`). An NF4
weight is a plain PyTorch tensor subclass: `F.linear` dequantises it to its dtype on the fly, on CPU and GPU, and
FSDP2 shards it (torchao implements FSDP2's all-gather hooks for it).

Kept in their precision, always: every parameter that is not an `nn.Linear` weight (embeddings, norms, Gated
DeltaNet's conv and decay parameters, fused MoE experts, biases), the vision tower and the projector, and the linear
layers a backbone declares (`BackboneSpec.keep_precision`: `lm_head`, MoE routers, Gated DeltaNet's small `in_proj_a`
/ `in_proj_b`), plus those the run names (`quantization.keep`); a layer whose size NF4's blocks do not divide is kept
too, and said so. `nf4_layout` is that decision, made on the module's shapes alone (the meta device included: the
plan uses it).

Loading straight to NF4: inside `nf4_loading(section)`, `mmadapt.weights.load_part` quantises each such weight as it
reads it (`nf4_targets`), one tensor at a time, so the host never holds the full-precision layers whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)
NF4_TENSOR = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
INSTALL = "pip install 'mmadapt[qlora]' (torchao)"
QUANTIZED_BASE_KEY = "quantized_base"  # a QLoRA checkpoint's config.json: where its 4-bit weights' originals are


@dataclass(kw_only=True)
class QuantizationSection:
    """A run's `quantization`: how `stages.backbone: qlora` stores the frozen base (torchao's NF4, QLoRA's layout)."""

    block_size: int = 64  # weights per absmax scale (QLoRA: 64)
    scaler_block_size: int = 256  # scales per second-level scale: the double quantisation of the scales (QLoRA: 256)
    keep: list[str] = field(default_factory=list)  # more linear layers kept in precision (module name suffixes)

    def __post_init__(self) -> None:
        for name in ("block_size", "scaler_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"quantization.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.keep, list) or not all(isinstance(k, str) and k for k in self.keep):
            raise ValueError(f"quantization.keep must be a list of module names (e.g. [lm_head, o_proj]), got "
                             f"{self.keep!r}")

    @property
    def divisor(self) -> int:
        """What an NF4 weight's size must be a multiple of: both levels of blocks must be whole."""
        return self.block_size * self.scaler_block_size

    def bytes_per_weight(self, itemsize: int) -> float:
        """Storage per quantised weight: a 4-bit code, an int8 scale per block, a scale of `itemsize` bytes (the
        weight's dtype) per block of scales (torchao's `NF4Tensor`; its two scalars and 16-entry table aside)."""
        return 0.5 + 1 / self.block_size + itemsize / self.divisor


@dataclass(frozen=True)
class NF4Layout:
    """Of a backbone's linear layers: the weights stored in NF4 ({name: shape}) and those kept ({name: why})."""

    quantized: dict[str, tuple[int, ...]]
    kept: dict[str, str]

    @property
    def quantized_parameters(self) -> int:
        return sum(_numel(shape) for shape in self.quantized.values())

    def summary(self) -> str:
        """'12 linear layers in NF4 (1.2M weights); kept: lm_head (declared), in_proj_a x 4 (declared)'."""
        by_kind: dict[str, int] = {}
        for name, why in self.kept.items():
            key = f"{name.rsplit('.', 2)[-2] if name.count('.') else name.removesuffix('.weight')} ({why})"
            by_kind[key] = by_kind.get(key, 0) + 1
        kept = ", ".join(f"{k}{f' x {n}' if n > 1 else ''}" for k, n in sorted(by_kind.items())) or "none"
        return (f"{len(self.quantized)} linear layers in NF4 ({self.quantized_parameters:,} weights); "
                f"kept in precision: {kept}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def matches(name: str, keep: tuple[str, ...] | list[str]) -> bool:
    """`name` (a module's dotted name) is one of `keep` or ends with `.<k>` for one of them."""
    return any(name == k or name.endswith(f".{k}") for k in keep)


def nf4_layout(backbone: nn.Module, keep: tuple[str, ...], section: QuantizationSection) -> NF4Layout:
    """Which `nn.Linear` weights of `backbone` are stored in NF4 and which are kept, with why (module docstring).
    LoRA's own layers (`lora_A` / `lora_B`) are never counted; a LoRA-wrapped layer is its `base_layer`."""
    quantized, kept = {}, {}
    for name, module in backbone.named_modules():
        if not isinstance(module, nn.Linear) or ".lora_" in f".{name}":
            continue
        plain = name.replace(".base_layer", "")
        key = f"{name}.weight"
        shape = tuple(module.weight.shape)
        if matches(plain, keep):
            kept[key] = "declared" if not matches(plain, section.keep) else "quantization.keep"
        elif _numel(shape) % section.divisor:
            kept[key] = (f"{_numel(shape)} weights: not a multiple of block_size x scaler_block_size = "
                         f"{section.divisor}")
        else:
            quantized[key] = shape
    return NF4Layout(quantized, kept)


# ---- NF4 tensors ------------------------------------------------------------------------------------------------
def nf4_module() -> Any:
    """torchao's NF4 module, imported on first use (an optional dependency); its import-time notices kept quiet."""
    try:
        quiet = logging.getLogger("torch.utils._pytree")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            import importlib

            return importlib.import_module(NF4_TENSOR)
        finally:
            quiet.setLevel(level)
    except ImportError as e:
        raise ImportError(f"stages.backbone: qlora stores the base in NF4 with torchao, which is not installed ({e}). "
                          f"Fix: {INSTALL}") from e


def to_nf4(weight: torch.Tensor, section: QuantizationSection) -> torch.Tensor:
    """`weight` as an `NF4Tensor` of its dtype (its blocks as `section` says)."""
    return nf4_module().to_nf4(weight.detach().contiguous(), section.block_size, section.scaler_block_size)


def is_nf4(tensor: Any) -> bool:
    """`tensor` (a parameter, a DTensor shard of one under FSDP2) holds NF4 data."""
    local = getattr(tensor, "_local_tensor", tensor)
    local = getattr(local, "data", local) if isinstance(local, nn.Parameter) else local
    return type(local).__name__ == "NF4Tensor"


def is_4bit(tensor: Any) -> bool:
    """`tensor` is a 4-bit weight: torchao's NF4, or bitsandbytes' `Params4bit` (a pre-quantised checkpoint)."""
    return is_nf4(tensor) or type(tensor).__name__ == "Params4bit"


def four_bit_parameters(module: nn.Module) -> list[str]:
    """The names of `module`'s 4-bit parameters (`is_4bit`): what a QLoRA checkpoint does not store."""
    return [name for name, p in module.named_parameters() if is_4bit(p)]


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """The full-precision tensor an NF4 one decodes to (torchao's own dequantisation)."""
    return tensor.get_original_weight()


# ---- loading straight to NF4 -------------------------------------------------------------------------------------
_LOADING: ContextVar[QuantizationSection | None] = ContextVar("mmadapt_nf4_loading", default=None)


@contextmanager
def nf4_loading(section: QuantizationSection) -> Iterator[None]:
    """Inside, backbones read from checkpoints store their NF4 layers (`nf4_layout`) in NF4 as each weight is read."""
    nf4_module()  # torchao missing: said before anything is read
    token = _LOADING.set(section)
    try:
        yield
    finally:
        _LOADING.reset(token)


def nf4_targets(keep: tuple[str, ...] = ()) -> Callable[[nn.Module], dict[str, Callable[[torch.Tensor], Any]]] | None:
    """Inside `nf4_loading`: for `mmadapt.weights.load_part`, a function of the module being loaded (a backbone's
    causal LM, whose declared kept layers are `keep`, or a whole model: its `backbone`) to {key: quantiser} of the
    weights to store in NF4; None outside (nothing is quantised)."""
    section = _LOADING.get()
    if section is None:
        return None

    def targets(module: nn.Module) -> dict[str, Callable[[torch.Tensor], Any]]:
        whole = hasattr(module, "backbone_spec")
        root, prefix = (module.backbone, "backbone.") if whole else (module, "")
        declared = tuple(module.backbone_spec.keep_precision) if whole else keep
        layout = nf4_layout(root, declared + tuple(section.keep), section)
        return {prefix + name: lambda t: to_nf4(t, section) for name in layout.quantized}

    return targets
