"""CLIP vision tower, LLaVA-1.5 style: fixed resolution, features from layer -2, CLS dropped.

Shapes: I images, S image side, P patch, h = w = S / P, D width.
pixel_values (I, 3, S, S) -> hidden states (I, 1 + h*w, D) -> VisualTokens((I*h*w, D), grids (I, 3)).

Pretrained from a `CLIPModel` directory (text + vision, as openai/clip-vit-large-patch14-336 ships;
the text tower is ignored), a `CLIPVisionModel` one, or a llava-hf directory (its vision tower, with
the LLaVA config's feature layer and CLS handling).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from mmadapt.encoders.base import FixedSizeEncoder, VisualTokens
from mmadapt.options import hf_options
from mmadapt.weights import Checkpoint, Rules, hf_config, mmadapt_part, wrong_family


class ClipEncoder(FixedSizeEncoder):
    """Wraps `transformers.CLIPVisionModel` as `self.tower` (weights load unchanged)."""

    config_class: ClassVar[str] = "CLIPVisionConfig"
    model_class: ClassVar[str] = "CLIPVisionModel"
    registry_name: ClassVar[str] = "clip"
    model_type: ClassVar[str] = "clip"  # the dual-tower model; its vision config is "<model_type>_vision_model"
    has_cls: ClassVar[bool] = True
    # OpenAI CLIP's normalisation; "pad" is LLaVA-1.5's expand2square (image_aspect_ratio="pad").
    processor_mean: ClassVar[tuple[float, float, float]] = (0.48145466, 0.4578275, 0.40821073)
    processor_std: ClassVar[tuple[float, float, float]] = (0.26862954, 0.26130258, 0.27577711)
    processor_mode: ClassVar[str] = "pad"

    def __init__(self, *, feature_layer: int = -2, drop_cls: bool = True, **config: Any) -> None:
        import transformers

        hf_config = getattr(transformers, self.config_class)(**config)
        super().__init__({"feature_layer": feature_layer, "drop_cls": drop_cls, **hf_options(hf_config)})
        if drop_cls and not self.has_cls:
            raise ValueError(f"{type(self).__name__} has no CLS token to drop; set drop_cls=False")
        self.tower = getattr(transformers, self.model_class)(hf_config)
        self.feature_layer = feature_layer
        self.drop_cls = drop_cls
        self.output_dim = hf_config.hidden_size
        self.patch_size = hf_config.patch_size
        self.image_size = hf_config.image_size
        self.num_channels = hf_config.num_channels

    @classmethod
    def checkpoint_layout(cls, checkpoint: Checkpoint, what: str) -> tuple[dict[str, Any], Rules, tuple[str, ...]]:
        vision_type = f"{cls.model_type}_vision_model"
        if checkpoint.model_type == "mmadapt":
            return (*mmadapt_part(checkpoint, "encoder", cls.registry_name, what), ())
        # transformers 5 keeps a vision model's weights at its top level (`embeddings.*`); the hub's files and
        # dual-tower models nest them under `vision_model.`. LLaVA files prefix either with `vision_tower.`.
        if checkpoint.model_type == cls.model_type:
            config = hf_config(checkpoint, what)
            return hf_options(config.vision_config), (("vision_model.", "tower."),), ()
        if checkpoint.model_type == vision_type:
            return hf_options(hf_config(checkpoint, what)), (("vision_model.", "tower."), ("", "tower.")), ()
        if checkpoint.model_type == "llava":
            config = hf_config(checkpoint, what)
            if config.vision_config.model_type == vision_type and isinstance(config.vision_feature_layer, int):
                options = {**hf_options(config.vision_config), "feature_layer": config.vision_feature_layer,
                           "drop_cls": cls.has_cls and config.vision_feature_select_strategy == "default"}
                rules = tuple((f"{outer}{inner}", "tower.") for outer in ("model.vision_tower.", "vision_tower.")
                              for inner in ("vision_model.", ""))
                return options, rules, ()
        dual = cls.model_class.replace("Vision", "")
        raise wrong_family(what, checkpoint, f"{cls.model_type!r} ({dual}), {vision_type!r} ({cls.model_class}) "
                           f"or a LLaVA directory ('llava') with a {cls.model_type} tower")

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> VisualTokens:
        self.check_pixels(pixel_values, image_grid_thw)
        pixel_values = pixel_values.to(self.tower.dtype)
        hidden = self.tower(pixel_values, output_hidden_states=True).hidden_states[self.feature_layer]
        if self.drop_cls:
            hidden = hidden[:, 1:]
        grids = self.grids_for(pixel_values.shape[0], pixel_values.device)
        return VisualTokens(hidden.reshape(-1, hidden.shape[-1]), grids)


CLIP_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        patch_size=8, image_size=32, projection_dim=32,
    ),
    # openai/clip-vit-large-patch14-336, LLaVA-1.5's vision tower.
    "vit-l-14-336": dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        patch_size=14, image_size=336, projection_dim=768, hidden_act="quick_gelu", layer_norm_eps=1e-5,
    ),
}
