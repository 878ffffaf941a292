"""LoRA layers (peft): a run's `stages` and `lora` sections, the layers injected and merged, and adapters on disk.

`StagesSection` says which component is `frozen`, `full` or `lora`, `LoraSection` how the LoRA layers are made;
`add_lora(model, component, lora)` injects them in place (peft's `inject_adapter_in_model`, so parameter names stay
under `backbone.`). Backbone LoRA targets are the backbone's declared `lora_targets` (exact module names, matched by
peft as name suffixes inside the backbone only); encoder LoRA targets every linear layer of the tower and only when
asked. `merge_lora` folds adapters into the base weights; `save_adapters` writes the adapters alone, in peft's format
(with the run's stages), and `load_adapters` applies them to a model without them (`mmadapt chat BASE --adapters DIR`).

Training (`mmadapt.train.stages.apply_stages`: freezing, the MoE routers, the counts) and loading what it leaves
(`mmadapt.loading`: a checkpoint's LoRA layers rebuilt, adapters merged) both stand on this module, which imports
nothing of training.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

log = logging.getLogger(__name__)
COMPONENTS = ("encoder", "projector", "backbone")

COMPONENT_MODES = ("frozen", "full", "lora", "qlora")  # qlora: the backbone's only (`mmadapt.qlora`)
LORA_MODES = ("lora", "qlora")  # the modes that inject LoRA layers
STAGE_PRESETS: dict[str, dict[str, str]] = {
    # LLaVA-1.5: stage 1 aligns the projector alone, stage 2 tunes projector + LLM; the tower stays frozen.
    "llava-stage1": {"encoder": "frozen", "projector": "full", "backbone": "frozen"},
    "llava-stage2": {"encoder": "frozen", "projector": "full", "backbone": "full"},
    "lora": {"encoder": "frozen", "projector": "full", "backbone": "lora"},
    # QLoRA: the LLM's large linear layers stored in 4-bit NF4 under the LoRA layers (mmadapt.qlora)
    "qlora": {"encoder": "frozen", "projector": "full", "backbone": "qlora"},
}


@dataclass(kw_only=True)
class StagesSection:
    """A run's `stages`: each component `frozen`, `full` or `lora`, the backbone also `qlora` (LoRA over a 4-bit
    base); or a `preset` of `STAGE_PRESETS`."""

    preset: str | None = None
    encoder: Literal["frozen", "full", "lora"] = "frozen"
    projector: Literal["frozen", "full", "lora"] = "full"
    backbone: Literal["frozen", "full", "lora", "qlora"] = "full"
    # MoE routers stay frozen when the backbone trains fully (and are never LoRA targets); "full" trains them too
    router: Literal["frozen", "full"] = "frozen"

    def modes(self) -> dict[str, str]:
        if self.preset is not None:
            if self.preset not in STAGE_PRESETS:
                raise ValueError(f"unknown stages.preset {self.preset!r}; known: {sorted(STAGE_PRESETS)}")
            return dict(STAGE_PRESETS[self.preset])
        modes = {"encoder": self.encoder, "projector": self.projector, "backbone": self.backbone}
        wrong = [c for c in ("encoder", "projector") if modes[c] == "qlora"]
        if wrong:
            raise ValueError(f"stages.{wrong[0]} cannot be 'qlora': only the backbone (the LLM) is stored in 4 bits. "
                             f"Fix: stages.{wrong[0]}: lora (or full / frozen) and stages.backbone: qlora")
        return modes


@dataclass(kw_only=True)
class LoraSection:
    """A run's `lora`: the LoRA layers' rank, scale, dropout and backbone targets."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    targets: list[str] | None = None  # None = the backbone's declared default targets


def lora_config(model: Any, component: str, lora: LoraSection) -> Any:
    """peft's config of `component`'s adapters: `lora.targets` for the backbone when given, else its declared
    targets (and MoE expert parameters); every linear layer of the encoder."""
    from peft import LoraConfig

    if component == "projector":
        raise ValueError("stages.projector cannot be 'lora' (the projector is small; train it 'full' or freeze it)")
    parameters = None
    targets = lora.targets if component == "backbone" else None
    if targets is None:
        targets = list(model.backbone_spec.lora_targets) if component == "backbone" else linear_names(model.encoder)
        moe = model.backbone_spec.moe
        if component == "backbone" and moe is not None and moe.expert_parameters:
            parameters = list(moe.expert_parameters)
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                      target_parameters=parameters, bias="none")


def linear_names(module: nn.Module) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, m in module.named_modules() if isinstance(m, nn.Linear)})


def add_lora(model: Any, component: str, lora: LoraSection) -> Any:
    """Inject LoRA layers into `component` of `model` in place (peft's `inject_adapter_in_model`, so parameter names
    stay under the component), as training does (`mmadapt.train.stages.apply_stages`) and as loading its checkpoint
    must (`mmadapt.loading`); returns the module, its peft config kept as `lora_config` for `save_adapters`."""
    from peft import inject_adapter_in_model

    module = getattr(model, component)
    config = lora_config(model, component, lora)
    inject_adapter_in_model(config, module)
    module.lora_config = config
    return module


def lora_modules(module: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter into its base layer and put the plain layer back (in place)."""
    for name, layer in lora_modules(model).items():
        layer.merge()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer.get_base_layer())
    return model


ADAPTER_STAGES = "stages.json"


def save_adapters(model: Any, directory: str | os.PathLike, modes: dict[str, str] | None = None,
                  state: dict[str, Any] | None = None, *, overwrite: bool = False) -> list[str]:
    """Each LoRA'd component's adapters in peft's format: DIR/<component>/adapter_model.safetensors + config,
    and DIR/stages.json with the run's stages `modes` (what else the run trained, which the adapters lack).
    `state`: the model's full state dict, when its parameters are sharded (FSDP2: the trainer's gathered copy).

    Written atomically (`mmadapt.atomic.StagedDirectory`): DIR ends as the old adapters or the new ones, never a mix;
    adapters already there are replaced only with `overwrite=True` (the trainer's own OUT/adapters), other files never.
    Nothing is written, and [] returned, when the model has no LoRA layers."""
    from peft import get_peft_model_state_dict

    from mmadapt.atomic import StagedDirectory, save_safetensors

    components = [c for c in COMPONENTS if lora_modules(getattr(model, c))]
    if not components:
        return []
    with StagedDirectory(directory, what="LoRA adapters directory", overwrite=overwrite,
                         recognise=is_adapters_directory) as stage:
        if modes is not None:
            stages = {"stages": {c: modes.get(c, "full") for c in COMPONENTS}}
            stage.write_bytes(ADAPTER_STAGES, json.dumps(stages, indent=2).encode())
        for component in components:
            module = getattr(model, component)
            os.makedirs(stage.path / component)
            own = None if state is None else {k[len(component) + 1:]: v for k, v in state.items()
                                              if k.startswith(f"{component}.")}
            adapters = get_peft_model_state_dict(module, state_dict=own)
            save_safetensors({k: v.detach().to("cpu").contiguous() for k, v in adapters.items()},
                             stage.path / component / "adapter_model.safetensors")
            stage.record(f"{component}/adapter_model.safetensors")
            config = module.lora_config.to_dict()
            body = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
            stage.write_bytes(f"{component}/adapter_config.json", json.dumps(body, indent=2, default=str).encode())
    return [os.path.join(directory, c) for c in components]


def is_adapters_directory(path: os.PathLike) -> bool:
    """`path` holds what `save_adapters` writes: `stages.json` or a component's `adapter_config.json`."""
    return os.path.isfile(os.path.join(path, ADAPTER_STAGES)) or bool(adapter_components(path))


def adapter_components(directory: str | os.PathLike) -> list[str]:
    """The components with peft adapters under `directory` (DIR/<component>/adapter_config.json)."""
    return [c for c in COMPONENTS if os.path.isfile(os.path.join(directory, c, "adapter_config.json"))]


def load_adapters(model: Any, directory: str | os.PathLike, *, merge: bool = True) -> list[str]:
    """Apply the adapters `save_adapters` wrote to a model without them (peft's format, loaded strictly), merged
    into the base weights by default; returns the components. Refuses adapters of a run that also trained a
    component fully (those weights are not in DIR: load the run directory or its OUT/model instead)."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    components = adapter_components(directory)
    if not components:
        raise ValueError(f"{directory} holds no adapters (no <component>/adapter_config.json under it)")
    stages_file = os.path.join(directory, ADAPTER_STAGES)
    if os.path.isfile(stages_file):
        with open(stages_file) as f:
            modes = json.load(f)["stages"]
        full = [c for c, mode in modes.items() if mode == "full"]
        if full:
            raise ValueError(
                f"the run that wrote {directory} also trained {', '.join(full)} fully, and those weights are not in "
                "the adapters: give the run directory (or its model/ directory) instead of a base model + adapters")
    for component in components:
        module = getattr(model, component)
        if lora_modules(module):
            raise ValueError(f"the model's {component} already has LoRA layers; load the adapters into a plain model")
        target = os.path.join(directory, component)
        config = LoraConfig.from_pretrained(target)
        inject_adapter_in_model(config, module)
        state = load_file(os.path.join(target, "adapter_model.safetensors"))
        expected = {k for k in module.state_dict() if "lora_" in k}
        result = set_peft_model_state_dict(module, state)
        missing = sorted(k for k in result.missing_keys if k in expected)
        unexpected = sorted(result.unexpected_keys)
        if missing or unexpected:
            raise ValueError(
                f"{target} does not fit the model's {component}: {len(missing)} LoRA weight(s) missing (e.g. "
                f"{missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}); "
                "the adapters were trained on another architecture or with other lora.targets")
        module.requires_grad_(False)
    if merge:
        merge_lora(model)
    log.info("applied LoRA adapters of %s from %s%s", ", ".join(components), directory, " (merged)" if merge else "")
    return components
