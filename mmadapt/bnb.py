"""Pre-quantised bitsandbytes 4-bit checkpoints (the hub's `*-bnb-4bit`) as backbones: loaded, trained with QLoRA on
one process or DDP, refused under FSDP2, and dequantised for a merge.

A checkpoint is one when its config.json's `quantization_config` says `quant_method: bitsandbytes` and
`load_in_4bit`. Its quantised linear layers are those with a `<layer>.weight.quant_state.bitsandbytes__nf4` (or
`__fp4`) tensor: `<layer>.weight` then holds the packed 4-bit codes ((numel + 1) // 2 bytes, shape (., 1)) beside
`.absmax`, `.quant_map` and, double-quantised, `.nested_absmax` / `.nested_quant_map`; every other tensor
(`llm_int8_skip_modules`, `lm_head`, norms, embeddings) is stored as usual. `load_4bit` builds the causal LM on the
meta device with those layers as `bitsandbytes.nn.Linear4bit` and reads it tensor by tensor
(`Params4bit.from_prequantized`): the modules transformers' `from_pretrained` builds from the same directory.

Where it runs: one process and DDP (every rank reads the same 4-bit weights; DDP does not broadcast them). FSDP2
cannot shard a `Params4bit`: its `quant_state` is a Python attribute that FSDP2's sharded parameters do not carry
(bitsandbytes then fails with "quant_state is required"), so `refuse_fsdp` stops such a run before any weight is read
and says what to use instead. Training: `stages.backbone: qlora` only (peft's own bitsandbytes LoRA layer); the 4-bit
weights are never trained or merged into. What such a run leaves is merged into the dequantised 4-bit weights
(`dequantized`, bitsandbytes' own `dequantize_4bit`): the source holds nothing in full precision.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmadapt.weights import Checkpoint, Rules, load_pretrained, renamed_keys

log = logging.getLogger(__name__)
FORMAT = "bnb-4bit"  # a QuantizedBase record's format for such a base (`mmadapt.qlora`)
INSTALL = "pip install 'mmadapt[qlora]' (bitsandbytes)"
QUANT_STATE = ".quant_state.bitsandbytes__"  # <layer>.weight + this + nf4 / fp4: the layer is stored in 4 bits
FSDP_REFUSAL = ("bitsandbytes' 4-bit weights (Params4bit) carry their quant_state as an attribute that FSDP2's "
                "sharded parameters lose (bitsandbytes then fails with 'quant_state is required'). Fix: start from the "
                "full-precision checkpoint with stages.backbone: qlora (torchao NF4, which FSDP2 shards), or set "
                "distributed.strategy: ddp")


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """A checkpoint config.json's bitsandbytes 4-bit `quantization_config`; None when it has none (or another
    method's); an 8-bit one is refused (mmadapt reads 4-bit ones only)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "bitsandbytes":
        return None
    if qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        raise ValueError("a bitsandbytes 8-bit checkpoint (quantization_config.load_in_8bit) cannot be loaded: mmadapt "
                         "reads bitsandbytes 4-bit (*-bnb-4bit) checkpoints only. Fix: start from the full-precision "
                         "checkpoint (stages.backbone: qlora stores it in 4 bits)")
    return qc if qc.get("load_in_4bit") or qc.get("_load_in_4bit") else None


def is_bnb_4bit(checkpoint: Checkpoint) -> bool:
    """`checkpoint` is a pre-quantised bitsandbytes 4-bit checkpoint (its config.json says so)."""
    return quantization_config(checkpoint.config) is not None


def directory_is_bnb_4bit(path: str | Path) -> bool:
    """The checkpoint directory `path` is a bitsandbytes 4-bit one, read from its config.json alone (no weights)."""
    config = Path(path) / "config.json"
    try:
        saved = json.loads(config.read_text()) if config.is_file() else {}
    except (OSError, ValueError):
        return False  # not ours to judge here: loading it says what is wrong
    return isinstance(saved, dict) and quantization_config(saved) is not None


def refuse_fsdp(sources: list[str | None], strategy: str, world: int) -> None:
    """Raise, in one line, when a run of `world` processes under `strategy` would shard (FSDP2) a backbone read from
    a bitsandbytes 4-bit checkpoint among `sources` (directories; None: none given)."""
    fsdp = strategy == "fsdp" or (strategy == "auto" and world > 1)
    found = [s for s in sources if s and directory_is_bnb_4bit(s)]
    if fsdp and found:
        raise ValueError(f"distributed.strategy: {strategy} ({world} process{'es' if world > 1 else ''}) cannot train "
                         f"the pre-quantised bitsandbytes checkpoint {found[0]}: {FSDP_REFUSAL}")


def bnb_module() -> Any:
    """bitsandbytes, imported on first use (an optional dependency)."""
    try:
        import bitsandbytes
    except ImportError as e:
        raise ImportError(f"a pre-quantised (bnb-4bit) checkpoint is read with bitsandbytes, which is not installed "
                          f"({e}). Fix: {INSTALL}") from e
    return bitsandbytes


def is_params4bit(tensor: Any) -> bool:
    return type(tensor).__name__ == "Params4bit"


# ---- loading ------------------------------------------------------------------------------------------------------
def quantized_layers(keys: list[str]) -> dict[str, str]:
    """{checkpoint key of a 4-bit weight: its quant type ("nf4" / "fp4")} among a checkpoint's `keys`."""
    out = {}
    for key in keys:
        weight, found, quant_type = key.partition(QUANT_STATE)
        if found:
            out[weight] = quant_type
    return out


def refuse_4bit_outside(checkpoint: Checkpoint, rules: Rules, what: str) -> dict[str, str]:
    """`quantized_layers` of `checkpoint`, once all of them are the language model's (those `rules` rename): the
    vision tower and projector are read as plain weights."""
    quantized = quantized_layers(checkpoint.keys())
    lm = renamed_keys(quantized, rules)
    outside = sorted(k for k in quantized if k not in lm)
    if outside:
        raise ValueError(f"{what}: {checkpoint.path} stores {len(outside)} layers outside the language model in 4 bits "
                         f"(e.g. {outside[:3]}); mmadapt reads only the language model of a bnb-4bit checkpoint in 4 "
                         "bits. Fix: start from one whose vision tower and projector are kept in precision "
                         "(quantization_config.llm_int8_skip_modules), or from the full-precision checkpoint with "
                         "stages.backbone: qlora")
    return quantized


def load_4bit(build: Callable[[], nn.Module], checkpoint: Checkpoint, rules: Rules, *, what: str,
              dtype: Any = None, tied: Callable[[nn.Module], dict[str, str]] | None = None,
              layouts: tuple[Any, ...] = ()) -> nn.Module:
    """The causal LM `build()` from the bitsandbytes 4-bit `checkpoint` (module docstring): built on the meta device,
    its 4-bit layers as `Linear4bit`, read tensor by tensor (`mmadapt.weights.load_pretrained`, `rules` as for a
    plain checkpoint). `dtype` casts the weights stored in precision (and is the 4-bit layers' compute dtype). Under
    `mmadapt.weights.architecture_only` (`mmadapt plan`) it stays the full-precision twin: no weight is read."""
    bnb = bnb_module()
    qc = quantization_config(checkpoint.config) or {}
    sources = {target: source for source, target in renamed_keys(checkpoint.keys(), rules).items()}
    quantized = refuse_4bit_outside(checkpoint, rules, what)
    compute = dtype if dtype is not None else qc.get("bnb_4bit_compute_dtype")
    compute = getattr(torch, compute) if isinstance(compute, str) else compute
    storage = getattr(torch, str(qc.get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch."))

    stats: dict[str, list[str]] = {source: [] for source in quantized}  # a 4-bit weight's quant state tensors
    for key in checkpoint.keys():
        weight, _, _ = key.partition(".weight.")
        if f"{weight}.weight" in stats:
            stats[f"{weight}.weight"].append(key)

    def prequantized(lm: nn.Module) -> dict[str, Callable[[torch.Tensor], Any]]:
        # called as the weights are about to be read, so a plan (`architecture_only`: nothing read) builds the
        # full-precision twin; the 4-bit layers go in before the checkpoint's keys are matched to the module's
        for target, source in sources.items():
            if source in quantized:
                _to_linear4bit(bnb, lm, target.removesuffix(".weight"), quantized[source], compute, storage)
        lm.is_loaded_in_4bit = True  # what peft reads to wrap Linear4bit with its bitsandbytes LoRA layer
        return {target: _reader(bnb, lm, checkpoint, target, stats[source])
                for target, source in sources.items() if source in quantized}

    lm = load_pretrained(build, checkpoint, rules, what=what, dtype=dtype, tied=tied, layouts=layouts,
                         quantize=prequantized)
    log.info("%s: %d linear layers read in 4 bits (bitsandbytes %s) from %s", what,
             sum(isinstance(m, bnb.nn.Linear4bit) for m in lm.modules()), ", ".join(sorted(set(quantized.values()))),
             checkpoint.path)
    return lm


def _to_linear4bit(bnb: Any, lm: nn.Module, name: str, quant_type: str, compute: torch.dtype | None,
                   storage: torch.dtype) -> None:
    """Replace the (meta) `nn.Linear` `name` of `lm` by a `Linear4bit` whose weight has the packed codes' shape
    (two codes a byte, in elements of `storage`: bitsandbytes' `quantize_4bit`)."""
    parent, _, child = name.rpartition(".")
    try:
        linear = lm.get_submodule(name)
    except AttributeError:
        linear = None
    if type(linear) is not nn.Linear:
        raise ValueError(f"the bnb-4bit checkpoint stores {name} in 4 bits, but this model's {name} is "
                         f"{'absent' if linear is None else f'a {type(linear).__name__}'}, not a linear layer: the "
                         "checkpoint is not of this architecture")
    layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=compute, quant_type=quant_type, quant_storage=storage, device="meta")
    rows = (linear.in_features * linear.out_features + 1) // (storage.itemsize * 2)
    layer.weight = bnb.nn.Params4bit(torch.empty((rows, 1), dtype=storage, device="meta"), requires_grad=False,
                                     quant_type=quant_type, quant_storage=storage, module=layer, bnb_quantized=True)
    if linear.bias is not None:
        layer.bias = linear.bias
    setattr(lm.get_submodule(parent) if parent else lm, child, layer)


def _reader(bnb: Any, module: nn.Module, checkpoint: Checkpoint, target: str,
            keys: list[str]) -> Callable[[torch.Tensor], Any]:
    """For `load_part`: the packed codes of `target` -> a `Params4bit` whose quant state is read from `keys` (the
    weight's `.absmax`, `.quant_map`, ...)."""
    layer = module.get_submodule(target.removesuffix(".weight"))

    def read(packed: torch.Tensor) -> Any:
        stats = {key.split(".weight.", 1)[1]: checkpoint.tensor(key) for key in keys}
        return bnb.nn.Params4bit.from_prequantized(packed, stats, requires_grad=False, device=packed.device,
                                                   module=layer)

    return read


# ---- merging: the dequantised weights ---------------------------------------------------------------------------
def dequantized(checkpoint: Checkpoint, key: str) -> torch.Tensor:
    """The 4-bit weight `key` of the bnb-4bit `checkpoint`, dequantised by bitsandbytes (its quant state's dtype)."""
    bnb = bnb_module()
    from bitsandbytes.functional import QuantState

    prefix = f"{key}."
    stats = {k[len(prefix):]: checkpoint.tensor(k) for k in checkpoint.keys() if k.startswith(prefix)}
    packed = checkpoint.tensor(key)
    state = QuantState.from_dict(stats, device=packed.device)
    return bnb.functional.dequantize_4bit(packed, state)


def quant_settings(module: nn.Module) -> tuple[int, int, str]:
    """(block size, the scales' block size (0: not double-quantised), original dtype) of `module`'s 4-bit weights."""
    states = [p.quant_state for p in module.parameters() if is_params4bit(p)]
    first = states[0]
    nested = first.state2.blocksize if first.nested else 0
    return first.blocksize, nested, str(first.dtype).removeprefix("torch.")


DEQUANTIZED_NOTE = ("the base was a pre-quantised bitsandbytes 4-bit checkpoint: its 4-bit weights were dequantised "
                    "(bitsandbytes' dequantize_4bit) and the adapters merged into them; no full-precision weights "
                    "existed to merge into")


def check_stage(backbone: nn.Module, mode: str) -> bool:
    """Whether `backbone` was read from a bnb-4bit checkpoint, once its stage `mode` is one it can train with:
    `qlora` (LoRA over the 4-bit layers) or `frozen`; `full` and `lora` are refused."""
    prequantized = any(is_params4bit(p) for p in backbone.parameters())
    if prequantized and mode in ("full", "lora"):
        raise ValueError(f"stages.backbone: {mode} cannot train a backbone read from a pre-quantised bitsandbytes "
                         "4-bit checkpoint: its 4-bit weights can be neither trained nor merged into. Fix: "
                         "stages.backbone: qlora (LoRA over the 4-bit layers), or the full-precision checkpoint")
    return prequantized
