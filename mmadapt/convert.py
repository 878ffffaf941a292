"""Checkpoints both ways between mmadapt and transformers' LLaVA, Qwen3.5(-MoE) and Qwen3-VL(-MoE) classes.

Loading a transformers directory is loading its three parts from it: each family reads its own
weights (`ComponentConfig(pretrained=directory)`, see `mmadapt.weights`), built on the meta device,
strictly, recording the directory as each part's source. Exporting builds the transformers model on
the meta device, loads the renamed weights strictly and calls its `save_pretrained`; the files then hold what the
hub's checkpoints of the family hold, so that the loaders written for those (vLLM, SGLang) read them:
`config.json` names the architecture the hub's checkpoints name (`Qwen3_5MoeForConditionalGeneration`, ...), and
Qwen3-VL-MoE's experts are stored as the hub stores them, (E, hidden, 2 x intermediate) and (E, intermediate,
hidden), where transformers 5 would write its own in-memory layout. The processor side of an export (image / video
processor, chat template) is `mmadapt.processor.export_processor`'s; `mmadapt.directory.save` writes both.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmadapt import bnb
from mmadapt.backbones import BACKBONES
from mmadapt.backbones.base import VLM_TEXT_RULES
from mmadapt.config import ComponentConfig, ModelConfig
from mmadapt.options import hf_options
from mmadapt.projectors import MLPProjector, QwenMergerProjector
from mmadapt.weights import Checkpoint

# transformers runtime parameter prefix -> mmadapt prefix; first match wins.
LLAVA_KEYS = (("model.vision_tower.", "encoder.tower."), ("model.multi_modal_projector.", "projector."),
              ("model.language_model.", "backbone.model."), ("lm_head.", "backbone.lm_head."))
QWEN3_5_KEYS = (("model.visual.merger.", "projector."), ("model.visual.", "encoder.tower."),
                ("model.language_model.", "backbone.model."), ("lm_head.", "backbone.lm_head."))
# Qwen3-VL: the ViT's DeepStack level mergers are the projector's level projections.
QWEN3_VL_KEYS = (("model.visual.deepstack_merger_list.", "projector.deepstack."), *QWEN3_5_KEYS)
LLAVA_ENCODERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
# Qwen3-VL-MoE's fused experts: the module holds (E, 2I, H) / (E, H, I), the hub's files (E, H, 2I) / (E, I, H)
HUB_TRANSPOSED = {"qwen3_vl_moe": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Architecture:
    model_class: str
    keys: tuple[tuple[str, str], ...]


ARCHITECTURES = {
    "llava": Architecture("LlavaForConditionalGeneration", LLAVA_KEYS),
    "qwen3_5": Architecture("Qwen3_5ForConditionalGeneration", QWEN3_5_KEYS),
    "qwen3_5_moe": Architecture("Qwen3_5MoeForConditionalGeneration", QWEN3_5_KEYS),
    "qwen3_vl": Architecture("Qwen3VLForConditionalGeneration", QWEN3_VL_KEYS),
    "qwen3_vl_moe": Architecture("Qwen3VLMoeForConditionalGeneration", QWEN3_VL_KEYS),
}
# transformers model_type -> (mmadapt encoder, backbone, transformers config class); the projector is qwen_merger
QWEN_VLMS = {"qwen3_5": ("qwen3_5_vit", "qwen3_5", "Qwen3_5Config"),
             "qwen3_5_moe": ("qwen3_5_vit", "qwen3_5_moe", "Qwen3_5MoeConfig"),
             "qwen3_vl": ("qwen3_vl_vit", "qwen3_vl", "Qwen3VLConfig"),
             "qwen3_vl_moe": ("qwen3_vl_vit", "qwen3_vl_moe", "Qwen3VLMoeConfig")}


def rename(state: dict[str, torch.Tensor], rules: tuple[tuple[str, str], ...]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for old, new in rules:
            if key.startswith(old):
                out[new + key[len(old):]] = value
                break
        else:
            raise ValueError(f"no mapping for parameter {key!r}; known prefixes: {[old for old, _ in rules]}")
    return out


def _backbone_for(model_type: str) -> str:
    for name, spec in BACKBONES.items():
        if spec.hf_model_type == model_type:
            return name
    known = sorted(spec.hf_model_type for _, spec in BACKBONES.items())
    raise ValueError(f"no registered backbone wraps transformers model_type {model_type!r}; registered: {known}. "
                     f"Register one (see README, 'A new backbone in a few lines').")


def component_names(directory: str | os.PathLike, saved: dict[str, Any]) -> tuple[str, str, str]:
    """The mmadapt encoder, projector and backbone equivalent to a transformers LLaVA / Qwen3.5-VL config."""
    model_type = saved.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{directory}: model_type {model_type!r} is neither an mmadapt directory nor a supported "
                         f"transformers architecture ({sorted(ARCHITECTURES)})")
    if model_type in QWEN_VLMS:
        encoder, backbone, _ = QWEN_VLMS[model_type]
        return encoder, "qwen_merger", backbone
    vision_type = (saved.get("vision_config") or {}).get("model_type", "clip_vision_model")
    if vision_type not in LLAVA_ENCODERS:
        raise ValueError(f"LLaVA vision tower {vision_type!r} has no mmadapt encoder; "
                         f"supported: {sorted(LLAVA_ENCODERS)}")
    if not isinstance(saved.get("vision_feature_layer", -2), int):
        raise ValueError("LLaVA configs with several vision_feature_layer values are not supported")
    text_type = (saved.get("text_config") or {}).get("model_type", "llama")
    return LLAVA_ENCODERS[vision_type], "mlp2x_gelu", _backbone_for(text_type)


def load_transformers(cls: type, directory: str | os.PathLike, saved: dict[str, Any]) -> Any:
    """A transformers LLaVA / Qwen VLM directory as three pretrained parts (keys no part reads are ignored)."""
    names = component_names(directory, saved)
    if bnb.quantization_config(saved) is not None:  # before any part reads a 4-bit tower as plain weights
        bnb.refuse_4bit_outside(Checkpoint.open(directory, what="model"), VLM_TEXT_RULES, what=f"model {directory}")
    parts = {part: ComponentConfig(name=name, pretrained=str(directory))
             for part, name in zip(("encoder", "projector", "backbone"), names, strict=True)}
    return cls(ModelConfig(**parts))


def export_architecture(model: Any) -> str:
    """The transformers `model_type` `model` exports as ("llava", "qwen3_5", ...); ValueError when none is
    equivalent (nothing is built: the check is cheap, so an export checks it before writing anything)."""
    return _export_target(model)[0]


def _export_target(model: Any) -> tuple[str, Any]:
    """Which transformers architecture this component combination is, with its config."""
    import transformers

    enc, proj, bb = model.config.encoder.name, model.config.projector.name, model.config.backbone.name
    tokens, lm_config = model.tokens, model.backbone.config
    qwen = next((t for t, (e, b, _) in QWEN_VLMS.items() if (e, b) == (enc, bb)), None)
    complete = model.levels == len(model.encoder.deepstack_levels)  # an export without its DeepStack levels is not it
    merger = isinstance(model.projector, QwenMergerProjector) and not model.projector.postshuffle_norm
    if qwen is not None and merger and complete:
        vision = {**model.encoder.options, "out_hidden_size": lm_config.hidden_size}
        config_class = getattr(transformers, QWEN_VLMS[qwen][2])
        return qwen, config_class(
            text_config=hf_options(lm_config), vision_config=vision, image_token_id=tokens.image_token_id,
            video_token_id=tokens.video_token_id, vision_start_token_id=tokens.vision_start_token_id,
            vision_end_token_id=tokens.vision_end_token_id,
            tie_word_embeddings=lm_config.tie_word_embeddings)
    is_llava_mlp = isinstance(model.projector, MLPProjector) and model.projector.depth == 2
    if enc in LLAVA_ENCODERS.values() and is_llava_mlp and model.backbone_spec.positions == "1d":
        return "llava", transformers.LlavaConfig(
            vision_config=model.encoder.tower.config.to_dict(), text_config=lm_config.to_dict(),
            image_token_id=tokens.image_token_id, projector_hidden_act=model.projector.options["act"],
            multimodal_projector_bias=model.projector.options["bias"],
            vision_feature_layer=model.encoder.feature_layer,
            vision_feature_select_strategy="default" if model.encoder.drop_cls else "full",
            tie_word_embeddings=lm_config.tie_word_embeddings)
    raise ValueError(
        f"no transformers architecture is equivalent to encoder {enc!r} + projector {proj!r} + backbone {bb!r}. "
        "Exportable: clip/siglip + mlp2x_gelu + a 1-D RoPE backbone (LlavaForConditionalGeneration), "
        "qwen3_5_vit + qwen_merger + qwen3_5 / qwen3_5_moe (Qwen3_5[Moe]ForConditionalGeneration), qwen3_vl_vit + "
        "qwen_merger + qwen3_vl / qwen3_vl_moe with their DeepStack levels (Qwen3VL[Moe]ForConditionalGeneration). "
        "Save with format='mmadapt' instead."
    )


def save_transformers(model: Any, directory: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                      eos_token_ids: list[int] | None = None) -> str:
    """The transformers model equal to `model`, saved by its `save_pretrained` into `directory` (a new directory:
    `mmadapt.directory.save` stages it and swaps it in), sharded above `max_shard_size`; returns its `model_type`.
    `eos_token_ids` (the tokenizer's end of answer) join the generation config's, so transformers' `generate` and
    the servers that read `generation_config.json` stop where `mmadapt chat` stops."""
    import transformers

    from mmadapt.weights import raise_on_key_mismatch

    model_type, hf_config = _export_target(model)
    arch = ARCHITECTURES[model_type]
    inverse = tuple((new, old) for old, new in arch.keys)
    with torch.device("meta"):
        hf_model = getattr(transformers, arch.model_class)(hf_config)
    missing, unexpected = hf_model.load_state_dict(rename(model.state_dict(), inverse), strict=False, assign=True)
    raise_on_key_mismatch(missing, unexpected, "the mmadapt model", strict=True)
    hf_model.tie_weights()
    suppress_placeholders(hf_model.generation_config, model.tokens)
    if eos_token_ids:
        ids = hf_model.generation_config.eos_token_id
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        hf_model.generation_config.eos_token_id = sorted(set(ids) | set(eos_token_ids))
    hf_model.save_pretrained(directory, max_shard_size=max_shard_size)
    if model_type in HUB_TRANSPOSED:
        store_as_the_hub(Path(directory), HUB_TRANSPOSED[model_type])
    return model_type


def store_as_the_hub(directory: Path, suffixes: tuple[str, ...]) -> None:
    """Rewrite the saved tensors whose names end in `suffixes` transposed in their last two dimensions: the layout of
    the hub's files, which vLLM and SGLang read (they transpose at load) and transformers reads too (it transposes a
    tensor whose shape is not its module's). A square tensor would read the same both ways, so transformers could not
    tell the layouts apart: it is left in transformers' own layout, with a warning that servers reading the hub's
    layout would read it transposed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as reader:
            metadata, keys = reader.metadata(), list(reader.keys())
            if not any(key.endswith(suffixes) for key in keys):
                continue
            tensors = {key: reader.get_tensor(key) for key in keys}
        for key, tensor in tensors.items():
            if not key.endswith(suffixes):
                continue
            if tensor.shape[-1] == tensor.shape[-2]:
                log.warning("%s: %s is square (%s), so the hub's layout and transformers' own read the same; it is "
                            "kept in transformers' layout, which vLLM / SGLang (written for the hub's) would read "
                            "transposed", file.name, key, tuple(tensor.shape))
                continue
            tensors[key] = tensor.transpose(-1, -2).contiguous()
        save_file(tensors, str(file), metadata=metadata)


def suppress_placeholders(generation_config: Any, tokens: Any) -> None:
    """The exported model never generates a placeholder: `suppress_tokens` (transformers' generate gives them -inf)
    holds every span id of `tokens` (image / video pads, vision start / end), as `SpanTokens.ids` gives them to
    mmadapt's own `generate`; ids already suppressed are kept."""
    generation_config.suppress_tokens = sorted(set(tokens.ids()) | set(generation_config.suppress_tokens or ()))
