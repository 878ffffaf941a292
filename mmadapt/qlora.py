"""QLoRA bases: a model's backbone stored in NF4 under LoRA layers, and where each 4-bit weight's full-precision
original lies, so that what a run leaves is merged into those, never into dequantised NF4.

`quantize_base(model, section)` (training, `stages.backbone: qlora`, before the LoRA layers are injected) stores the
backbone's NF4 layers (`mmadapt.quantize.nf4_layout`) in NF4 - those that `nf4_loading` quantised as they were read
stay as they are - and attaches `model.quantized_base`, a `QuantizedBase`: the settings, the dtype the weights were
quantised from, and for each NF4 weight the checkpoint and key it was read from (the backbone's
`Provenance.read_from`, or an mmadapt model directory's own keys), with the stamps of that checkpoint's files.

A QLoRA checkpoint stores everything but those weights (`mmadapt.quantize.four_bit_parameters`: a resume quantises
the source again, bit for bit the same), and its config.json the record (`QUANTIZED_BASE_KEY`). Loading it for an
export, chat or serving reads them from the source in full precision (`WithBase`), after checking that the source's
files are the ones read when training started, then merges the adapters into them. A backbone read from a
pre-quantised bitsandbytes checkpoint (`mmadapt.bnb`) stays as read (record format "bnb-4bit"): having no
full-precision weights, its adapters are merged into its 4-bit weights dequantised by bitsandbytes, and said so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmadapt import bnb
from mmadapt.quantize import QUANTIZED_BASE_KEY, QuantizationSection, four_bit_parameters, is_nf4, nf4_layout, to_nf4
from mmadapt.run_directory import is_complete
from mmadapt.weights import Checkpoint

log = logging.getLogger(__name__)
FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # what a 4-bit base may have been quantised from


class BaseSourceError(ValueError):
    """A QLoRA base's full-precision weights cannot be read as they were when training started."""


@dataclass(frozen=True)
class QuantizedBase:
    """What a QLoRA model's NF4 weights are (module docstring): `keys` {model key: key in `source`}."""

    format: str
    block_size: int
    scaler_block_size: int
    dtype: str
    source: str
    stamps: tuple[tuple[str, int, int], ...]
    keys: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "stamps": [list(s) for s in self.stamps]}

    @classmethod
    def from_dict(cls, saved: Any) -> QuantizedBase:
        """The record as a checkpoint's config.json holds it, checked field by field (a file from outside: a wrong
        field is an error naming it, never a dtype or key taken on trust)."""
        try:
            record = cls(**{**saved, "stamps": tuple(tuple(s) for s in saved["stamps"])})
            ok = (record.format in ("nf4", bnb.FORMAT) and record.dtype in FLOAT_DTYPES
                  and isinstance(record.source, str) and isinstance(record.keys, dict)
                  and all(isinstance(k, str) and isinstance(v, str) for k, v in record.keys.items()))
        except (TypeError, KeyError) as e:
            ok, record = False, e
        if not ok:
            raise ValueError(f"config.json's {QUANTIZED_BASE_KEY!r} record is not one mmadapt writes "
                             f"({record!r:.200}): the checkpoint was altered or written by another tool; not loaded")
        return record

    def open_source(self, what: str) -> Checkpoint:
        """The source checkpoint, once its files are the ones read when training started; else `BaseSourceError`."""
        try:
            checkpoint = Checkpoint.open(self.source, what=f"{what}'s QLoRA base")
            same = checkpoint.stamps() == self.stamps
        except (OSError, ValueError) as e:
            raise BaseSourceError(f"{what} was trained with a 4-bit (QLoRA) base whose full-precision weights are read "
                                  f"from {self.source}, which cannot be read now ({e}). Fix: restore that checkpoint "
                                  "where it was (its weights are not in the run's checkpoints)") from e
        if not same:
            raise BaseSourceError(f"{what} was trained with a 4-bit (QLoRA) base read from {self.source}, whose weight "
                                  "files changed since (size or modification time). Merging the adapters into other "
                                  "weights than they were trained on would silently change the model. Fix: restore "
                                  "the checkpoint the run started from")
        return checkpoint


def quantize_base(model: Any, section: QuantizationSection) -> QuantizedBase:
    """Store `model`'s backbone NF4 layers in NF4 (frozen) and attach and return their `QuantizedBase` record."""
    four_bit = [name for name, p in model.backbone.named_parameters() if bnb.is_params4bit(p)]
    if four_bit:  # read from a pre-quantised bitsandbytes checkpoint: already 4-bit, nothing to quantise
        return prequantized_base(model, four_bit)
    spec = model.backbone_spec
    layout = nf4_layout(model.backbone, tuple(spec.keep_precision) + tuple(section.keep), section)
    if not layout.quantized:
        raise ValueError(f"stages.backbone: qlora found no linear layer of backbone {spec.name!r} to store in NF4 "
                         f"({layout.summary()}). Fix: train it with stages.backbone: lora, or lower "
                         "quantization.scaler_block_size so that the layers' sizes are multiples of "
                         "block_size x scaler_block_size")
    source, keys = base_source(model, list(layout.quantized))
    dtypes = set()
    for name in layout.quantized:
        module = model.backbone.get_submodule(name.removesuffix(".weight"))
        if not is_nf4(module.weight):
            module.weight = nn.Parameter(to_nf4(module.weight, section), requires_grad=False)
        module.weight.requires_grad_(False)
        dtypes.add(str(module.weight.dtype).removeprefix("torch."))
    record = QuantizedBase("nf4", section.block_size, section.scaler_block_size, dtype=sorted(dtypes)[0],
                           source=str(source.path.resolve()), stamps=source.stamps(), keys=keys)
    model.quantized_base = record
    log.info("backbone in NF4 (QLoRA): %s; base weights read from %s", layout.summary(), record.source)
    return record


def prequantized_base(model: Any, names: list[str]) -> QuantizedBase:
    """Attach and return the record of a backbone read from a bitsandbytes 4-bit checkpoint (`mmadapt.bnb`): its
    4-bit weights `names` stay as read; what a run leaves is merged into their dequantised values (`WithBase`)."""
    source, keys = base_source(model, names)
    block, nested, dtype = bnb.quant_settings(model.backbone)
    record = QuantizedBase(bnb.FORMAT, block, nested, dtype=dtype, source=str(source.path.resolve()),
                           stamps=source.stamps(), keys=keys)
    model.quantized_base = record
    log.info("backbone read in 4 bits from the bitsandbytes checkpoint %s: %d linear layers (QLoRA over them)",
             record.source, len(names))
    return record


def base_source(model: Any, names: list[str]) -> tuple[Checkpoint, dict[str, str]]:
    """The checkpoint the backbone's `names` were read from, and {model key: its key there}."""
    provenance = getattr(model.backbone, "provenance", None)
    read_from = getattr(provenance, "read_from", None)
    if read_from is not None:
        lacking = [n for n in names if n not in read_from]
        if lacking:
            raise ValueError(f"stages.backbone: qlora: {len(lacking)} weights of the backbone were not read from "
                             f"{provenance.path} (e.g. {lacking[:3]}), so nothing full-precision could be merged into")
        return Checkpoint.open(provenance.path, what="QLoRA base"), {f"backbone.{n}": read_from[n] for n in names}
    source = getattr(model, "source", None)
    if source is not None and not is_complete(Path(source.path)):
        return Checkpoint.open(source.path, what="QLoRA base"), {f"backbone.{n}": f"backbone.{n}" for n in names}
    if source is not None:
        raise ValueError(f"stages.backbone: qlora: the model was read from the training checkpoint {source.path}, "
                         "whose base weights are not the model's (its LoRA is merged at load). Fix: export it "
                         "(mmadapt export CHECKPOINT DIR) and start from DIR")
    raise ValueError("stages.backbone: qlora stores a pretrained backbone in 4 bits, and this one was not read from a "
                     "checkpoint (random init): there would be no full-precision weights to merge the adapters into. "
                     "Fix: start from a checkpoint (model.backbone.pretrained, model.pretrained, or a model saved "
                     "with save_pretrained), or train it with stages.backbone: lora")


def quantized_base(saved: dict[str, Any]) -> QuantizedBase | None:
    """The `QuantizedBase` record of a checkpoint's config.json (`saved`), None for a model without one."""
    record = saved.get(QUANTIZED_BASE_KEY)
    return None if record is None else QuantizedBase.from_dict(record)


def state_without_4bit(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (the model's state dict, any of its forms) less the 4-bit weights, which the source holds."""
    drop = set(four_bit_parameters(model))
    states = tuple(f"{name}." for name in drop)  # bitsandbytes' quant state beside its weight (`weight.absmax`, ...)
    return {k: v for k, v in state.items() if k not in drop and not k.startswith(states)} if drop else state


class WithBase:
    """A QLoRA checkpoint with its base's full-precision weights read from their source (`QuantizedBase`), as one
    checkpoint for `mmadapt.weights.load_pretrained`: the source's weights under the model's keys (both the plain
    `q_proj.weight` and LoRA's `q_proj.base_layer.weight`), cast to the dtype they were quantised from."""

    def __init__(self, checkpoint: Checkpoint, record: QuantizedBase, what: str) -> None:
        self.checkpoint, self.record = checkpoint, record
        self.path, self.config = checkpoint.path, checkpoint.config
        self.source = record.open_source(what)
        self.base, self.notes = {}, []
        if record.format == bnb.FORMAT:  # no full-precision weights exist: bitsandbytes decodes the 4-bit ones
            self.notes.append(bnb.DEQUANTIZED_NOTE)
            log.warning("%s: %s (%s)", what, bnb.DEQUANTIZED_NOTE, record.source)
        for key, source_key in record.keys.items():
            module, _, leaf = key.rpartition(".")
            self.base[key] = self.base[f"{module}.base_layer.{leaf}"] = source_key

    def describe_type(self) -> str:
        return self.checkpoint.describe_type()

    def keys(self) -> list[str]:
        return [*self.checkpoint.keys(), *self.base]

    def tensor(self, key: str) -> torch.Tensor:
        if key in self.base and self.record.format == bnb.FORMAT:
            return bnb.dequantized(self.source, self.base[key]).to(getattr(torch, self.record.dtype))
        if key in self.base:
            return self.source.tensor(self.base[key]).to(getattr(torch, self.record.dtype))
        return self.checkpoint.tensor(key)

    def files(self) -> Iterator[Path]:
        yield from self.checkpoint.files
