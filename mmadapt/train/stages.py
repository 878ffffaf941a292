"""Training stages: each component is `frozen`, `full` or `lora`; the LoRA layers themselves are `mmadapt.lora`.

`apply_stages(model, run.stages, run.lora)` (the run config's `StagesSection` and `LoraSection`, e.g.
`StagesSection(preset="lora")`) sets `requires_grad` per component and injects LoRA layers in place
(`mmadapt.lora.add_lora`); MoE routers stay frozen unless asked. `merge_lora`, `save_adapters`, `load_adapters` and
the other LoRA names are `mmadapt.lora`'s, importable from here as before.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from mmadapt import bnb
from mmadapt.lora import (  # noqa: F401  (LoRA's names, where callers have found them: mmadapt.lora)
    ADAPTER_STAGES,
    COMPONENT_MODES,
    COMPONENTS,
    LORA_MODES,
    LoraSection,
    StagesSection,
    adapter_components,
    add_lora,
    is_adapters_directory,
    linear_names,
    load_adapters,
    lora_config,
    lora_modules,
    merge_lora,
    save_adapters,
)
from mmadapt.qlora import quantize_base
from mmadapt.quantize import QuantizationSection

log = logging.getLogger(__name__)


def apply_stages(model: Any, stages: StagesSection, lora: LoraSection | None = None,
                 quantization: QuantizationSection | None = None) -> dict[str, dict[str, int]]:
    """Freeze / unfreeze / add LoRA per component as the run's `stages` say, LoRA layers as its `lora` section says
    (its defaults when None); returns and logs {component: {trainable, total}}. A `qlora` backbone is stored in NF4
    first, as its `quantization` section says (`mmadapt.qlora.quantize_base`), then gets its LoRA layers; a backbone
    read from a bitsandbytes 4-bit checkpoint (`mmadapt.bnb`) trains with `qlora` or stays `frozen` (both recorded).

    MoE routers (the backbone's `moe.router_parameters`) are never LoRA targets and stay frozen when the backbone trains
    fully, unless `stages.router` is "full"."""
    if stages.router not in ("frozen", "full"):
        raise ValueError(f"stages.router must be 'frozen' or 'full', got {stages.router!r}")
    lora = LoraSection() if lora is None else lora
    modes = stages.modes()
    prequantized = bnb.check_stage(model.backbone, modes["backbone"])  # a bnb-4bit base: qlora or frozen only
    for component in COMPONENTS:
        mode = modes[component]
        if mode not in COMPONENT_MODES:
            raise ValueError(f"stages.{component} must be 'frozen', 'full' or 'lora' (the backbone also 'qlora'), got "
                             f"{mode!r}")
        module = getattr(model, component)
        module.requires_grad_(mode == "full")
        if mode == "qlora" or (component == "backbone" and prequantized):
            quantize_base(model, QuantizationSection() if quantization is None else quantization)
        if mode in LORA_MODES:
            add_lora(model, component, lora)
            for name, p in module.named_parameters():
                p.requires_grad_("lora_" in name)
    routers = model.backbone_spec.moe.router_parameters if model.backbone_spec.moe is not None else ()
    if routers and modes["backbone"] == "full" and stages.router == "frozen":
        frozen = [p for name, p in model.backbone.named_parameters() if name.endswith(routers)]
        for p in frozen:
            p.requires_grad_(False)
        log.info("backbone: %d MoE router weights stay frozen (stages.router: full trains them)", len(frozen))
    counts = parameter_counts(model)
    for component, c in counts.items():
        log.info("%-9s %-6s trainable %12s of %12s parameters", component, modes[component],
                 f"{c['trainable']:,}", f"{c['total']:,}")
    return counts


def parameter_counts(model: Any) -> dict[str, dict[str, int]]:
    out = {}
    for component in COMPONENTS:
        params = list(getattr(model, component).parameters())
        out[component] = {"trainable": sum(p.numel() for p in params if p.requires_grad),
                          "total": sum(p.numel() for p in params)}
    return out


def trainable_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
