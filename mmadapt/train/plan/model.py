"""The run's model as the plan sees it: built on the meta device (no weight is read: a pretrained part from its
checkpoint's config, or from the `preset` it declares when the checkpoint is not here yet), with the run's stages
applied; its block lists and their kinds; parameters counted once each."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmadapt.quantize import NF4Layout, nf4_layout, to_nf4
from mmadapt.train.config import RunConfig


def planning_model(config: RunConfig) -> tuple[Any, list[str]]:
    """The run's model on the meta device, with its stages applied (LoRA adapters included), and notes."""
    model, notes = planning_model_for_probe(config)
    return trained_as_in_run(model, config), notes


def trained_as_in_run(model: Any, config: RunConfig) -> Any:
    """`model` with the run's stages applied and its trained parameters in fp32, as the trainer makes it; a `qlora`
    backbone's NF4 layers stored in NF4 (`quantized_as_in_run`) under LoRA layers."""
    from mmadapt.train.stages import StagesSection, apply_stages
    from mmadapt.train.trainer import upcast_trainable

    stages = config.stages
    if stages.modes()["backbone"] == "qlora":
        quantized_as_in_run(model, config)
        stages = StagesSection(**{**stages.modes(), "backbone": "lora"}, router=stages.router)
    apply_stages(model, stages, config.lora)
    upcast_trainable(model)
    return model


def quantized_as_in_run(model: Any, config: RunConfig) -> NF4Layout:
    """The backbone's NF4 layers (`mmadapt.quantize.nf4_layout`) stored as NF4 tensors, as `mmadapt.qlora.quantize_base`
    stores them, without its record of the source checkpoint (the plan reads no weights). On the meta device too:
    torchao's NF4 of a meta weight is its codes and scales on the meta device, their sizes exact."""
    keep = tuple(model.backbone_spec.keep_precision) + tuple(config.quantization.keep)
    layout = nf4_layout(model.backbone, keep, config.quantization)
    for name in layout.quantized:
        module = model.backbone.get_submodule(name.removesuffix(".weight"))
        module.weight = nn.Parameter(to_nf4(module.weight, config.quantization), requires_grad=False)
    return layout


def available_parts(config: RunConfig) -> tuple[Any, list[str]]:
    if config.model.pretrained:
        if not Path(config.model.pretrained).exists():
            raise FileNotFoundError(f"model.pretrained {config.model.pretrained} does not exist: plan needs its "
                                    "config.json (no weights are read)")
        return None, []
    model_config, notes = config.model.model_config(), []
    for part in ("encoder", "projector", "backbone"):
        c = getattr(model_config, part)
        if c.pretrained and not Path(c.pretrained).exists():
            if c.preset is None and part != "projector":
                raise FileNotFoundError(
                    f"model.{part}.pretrained {c.pretrained} is not here, and model.{part} declares no preset: give "
                    f"the preset of its architecture (model.{part}.preset) so that the run can be planned before the "
                    "download, or plan where the checkpoint is")
            notes.append(f"model.{part}.pretrained {c.pretrained} is not here: planned from "
                         f"{'preset ' + repr(c.preset) if c.preset else 'its options'}")
            setattr(model_config, part, replace(c, pretrained=None))
    return model_config, notes


def planning_model_for_probe(config: RunConfig) -> tuple[Any, list[str]]:
    """The run's model on the meta device before its stages (the probe applies them once materialised)."""
    model_config, notes = available_parts(config)
    return _meta_model(config, model_config), notes


def _meta_model(config: RunConfig, model_config: Any) -> Any:
    """Built on the meta device; a part loaded from a checkpoint takes its `dtype` (as its loaded weights would;
    without one, the checkpoint's `torch_dtype` when its config names it, else fp32)."""
    from mmadapt.model import VisionLanguageModel
    from mmadapt.weights import architecture_only, parse_dtype

    with architecture_only():
        if model_config is None:
            return VisionLanguageModel.from_pretrained(config.model.pretrained)
        model = VisionLanguageModel(model_config)
    model.tie_weights()
    declared = config.model.model_config()
    for part in ("encoder", "projector", "backbone"):
        c = getattr(declared, part)
        dtype = parse_dtype(c.dtype) if c.pretrained else None
        if c.pretrained and dtype is None and Path(c.pretrained, "config.json").is_file():
            saved = json.loads(Path(c.pretrained, "config.json").read_text())
            named = saved.get("torch_dtype") or saved.get("dtype") or (saved.get("text_config") or {}).get("dtype")
            dtype = parse_dtype(named) if isinstance(named, str) and named != "auto" else None
        if dtype is not None:
            getattr(model, part).to(dtype)
    return model


def materialise(module: nn.Module) -> None:
    """Meta parameters become CPU tensors of small random values (tied parameters stay tied)."""
    done: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                data = torch.empty(p.shape, dtype=p.dtype)
                data.normal_(0, 0.02) if data.is_floating_point() else data.zero_()
                done[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            sub._parameters[name] = done[id(p)]


def block_lists(model: Any) -> dict[str, nn.ModuleList]:
    from mmadapt.train.distributed import BLOCK_LISTS

    lists = {}
    for part in ("encoder", "backbone"):
        for name, module in getattr(model, part).named_modules():
            if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_LISTS and len(module):
                lists[f"{part}.{name}"] = module
    return lists


def block_kinds(model: Any, key: str, blocks: nn.ModuleList) -> list[str]:
    """The kind of every block of a list: the backbone's `layer_types` where it declares them, else one kind."""
    types = getattr(model.backbone.config, "layer_types", None) if key.startswith("backbone") else None
    if types and len(types) >= len(blocks):
        return [str(t) for t in types[: len(blocks)]]
    return ["block"] * len(blocks)


def own_parameters(model: Any, module: nn.Module) -> list[nn.Parameter]:
    """A part's parameters outside its blocks (and, for the backbone, outside its output layer)."""
    inside = {id(p) for blocks in block_lists(model).values() for p in blocks.parameters()}
    head = model.backbone.get_output_embeddings()
    inside |= {id(p) for p in head.parameters()} if module is model.backbone else set()
    return [p for p in module.parameters() if id(p) not in inside]


def unique_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p
