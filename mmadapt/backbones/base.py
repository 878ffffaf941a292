"""What a backbone registration declares: the facts the glue needs and nothing more.

A backbone is a transformers causal LM used as is (`model.backbone` *is* the
`...ForCausalLM`), plus: its position scheme (1-D RoPE or M-RoPE), its image-span tokens
and their ids, its chat template and its default LoRA targets. Presets are dicts of
transformers config fields plus the three mmadapt token-id fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from mmadapt.options import hf_options, resolve_preset
from mmadapt.registry import Registry, import_object

TOKEN_FIELDS = ("image_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass(frozen=True)
class SpanTokens:
    """Ids of the image placeholder and, for Qwen-style spans, the tokens around it."""

    image_token_id: int
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.image_token_id is None:
            raise ValueError("image_token_id is required: the id of the image placeholder token")


@dataclass(frozen=True, kw_only=True)
class BackboneSpec:
    name: str
    description: str
    model_class: str
    config_class: str
    hf_model_type: str
    positions: Literal["1d", "mrope"] = "1d"
    image_token: str = "<image>"
    vision_start_token: str | None = None
    vision_end_token: str | None = None
    chat_template: str = "vicuna_v1"
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    validate: Callable[[Any], None] | None = None
    # Packing: `isolate(lm)` makes stateful layers restart at sample boundaries (called once at build);
    # `layer_masks` means the model takes {layer_type: mask} (hybrid attention / linear-attention stacks).
    isolate: Callable[[Any], None] | None = None
    layer_masks: bool = False

    def __post_init__(self) -> None:
        if self.positions not in ("1d", "mrope"):
            raise ValueError(f"backbone {self.name!r}: positions must be '1d' or 'mrope', got {self.positions!r}")
        if (self.vision_start_token is None) != (self.vision_end_token is None):
            raise ValueError(f"backbone {self.name!r}: give both vision_start_token and vision_end_token, or neither")

    def options(self, preset: str | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        return resolve_preset(self.presets, preset, overrides, kind=f"backbone {self.name!r}")

    def build_config(self, options: dict[str, Any]) -> tuple[Any, SpanTokens]:
        options = dict(options)
        tokens = SpanTokens(**{k: options.pop(k, None) for k in TOKEN_FIELDS})
        if self.vision_start_token and tokens.vision_start_token_id is None:
            raise ValueError(f"backbone {self.name!r} brackets images with {self.vision_start_token}/"
                             f"{self.vision_end_token}: set vision_start_token_id and vision_end_token_id")
        config = import_object(self.config_class)(**options)
        if self.validate is not None:
            self.validate(config)
        return config, tokens

    def build(self, preset: str | None = "tiny", **overrides: Any) -> tuple[Any, SpanTokens]:
        """A freshly initialised transformers causal LM and its span token ids."""
        config, tokens = self.build_config(self.options(preset, overrides))
        return import_object(self.model_class)(config), tokens

    def saved_options(self, lm: Any, tokens: SpanTokens) -> dict[str, Any]:
        """Options that rebuild exactly this backbone, with no preset."""
        return {**hf_options(lm.config), **{k: getattr(tokens, k) for k in TOKEN_FIELDS}}


BACKBONES: Registry[BackboneSpec] = Registry("backbone")
