"""The optimizer settings real recipes use: learning rates per part, no weight decay on biases and norms, the
length of a run in epochs, warmup as a share of it.

- `parameter_groups`: the trainable parameters in deterministic groups, one per (part, decay) - parts are the
  model's components (`encoder`, `projector`, `backbone`), each at `train.lr` or its `train.lr_by_part` rate
  (LLaVA's `mm_projector_lr`, Qwen-VL's vision lr); biases and norm weights get no weight decay, chosen as
  transformers' `Trainer` chooses them (`Trainer.get_decay_parameter_names`). The same groups in the same order
  on every build, so a checkpoint's optimizer state loads into them (bitwise resume).
- `total_steps`: `train.steps`, or `train.epochs` x the steps of one epoch (the sampler's: the samples' full
  global batches).
- `warmup_steps`: `train.warmup_steps`, or `train.warmup_ratio` x the total steps rounded up (as transformers).
- `enable_activation_checkpointing`: `train.activation_checkpointing`, per decoder layer / vision block.
- `upcast_trainable`: fp32 master weights (the optimizer updates fp32 copies of what trains).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)
PARTS = ("encoder", "projector", "backbone")
NO_DECAY_NAMES = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]  # transformers'


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters weight decay applies to: not biases, not LayerNorm / RMSNorm weights."""
    from transformers.trainer_pt_utils import get_parameter_names

    return set(get_parameter_names(model, [nn.LayerNorm], NO_DECAY_NAMES))


def parameter_groups(model: nn.Module, wrapped: nn.Module, *, lr: float, weight_decay: float,
                     lr_by_part: dict[str, float]) -> list[dict[str, Any]]:
    """The trainable parameters of `wrapped` (the model as trained: itself, DDP or FSDP2) in groups by part and
    decay, named `<part>` / `<part>.no_decay`; `model` is the unwrapped model (its names decide the groups)."""
    decay = decay_parameter_names(model)
    groups: dict[tuple[str, bool], list[nn.Parameter]] = {}
    for name, p in wrapped.named_parameters():
        if not p.requires_grad:
            continue
        name = name.removeprefix("module.")  # DDP's wrapper
        part = name.split(".", 1)[0]
        if part not in PARTS:
            raise ValueError(f"trainable parameter {name!r} belongs to no part ({', '.join(PARTS)})")
        groups.setdefault((part, name in decay), []).append(p)
    out = []
    for part in PARTS:
        for decays in (True, False):
            if (part, decays) in groups:
                out.append({"params": groups[(part, decays)], "lr": lr_by_part.get(part, lr),
                            "weight_decay": weight_decay if decays else 0.0,
                            "name": part if decays else f"{part}.no_decay"})
    return out


def total_steps(train: Any, steps_per_epoch: int) -> int:
    """`train.steps`, or `train.epochs` x `steps_per_epoch` rounded up when epochs are given."""
    if train.epochs is None:
        return train.steps
    return max(1, math.ceil(train.epochs * steps_per_epoch))


def warmup_steps(train: Any, steps: int) -> int:
    return train.warmup_steps if train.warmup_ratio is None else math.ceil(train.warmup_ratio * steps)


def checkpointed_parts(parts: list[str] | str) -> list[str]:
    """`train.activation_checkpointing` as a list of parts ("all": backbone and encoder)."""
    return ["backbone", "encoder"] if parts == "all" else [parts] if isinstance(parts, str) else list(parts)


def enable_activation_checkpointing(model: nn.Module, parts: list[str] | str) -> list[str]:
    """Checkpoint the activations of `parts` ("all" = backbone and encoder; the projector has no blocks): the
    backbone per decoder layer (transformers' own switch), the encoder per block (`enable_activation_checkpointing`
    of its family), non-reentrant, so it composes with FSDP2 (applied before sharding: the recompute runs inside
    each unit), LoRA on frozen embeddings, the chunked loss, DeepStack's probe (its hooks are gone before the
    backward recomputes), packed rows and MoE. Returns the parts switched on."""
    chosen = checkpointed_parts(parts)
    for part in chosen:
        if part == "backbone":
            model.backbone.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.encoder.enable_activation_checkpointing()
    return chosen


def upcast_trainable(model: torch.nn.Module) -> int:
    """fp32 master weights: trainable parameters loaded in bf16/fp16 (a pretrained part's dtype) become fp32.

    Frozen parts keep their dtype (a frozen bf16 LLM costs half the memory); the model casts at part
    boundaries. Returns the number of tensors upcast.
    """
    low = [p for p in model.parameters() if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32]
    if low:
        log.info("master weights fp32: upcasting %d trainable tensors (%s parameters) from %s", len(low),
                 f"{sum(p.numel() for p in low):,}", sorted({str(p.dtype) for p in low}))
    for p in low:
        p.data = p.data.float()
    return len(low)
