"""SigLIP vision tower: a CLIP-style fixed-resolution encoder without a CLS token.

Same contract, shapes and checkpoint sources as `clip.py` (`SiglipModel`, `SiglipVisionModel`, LLaVA
directories with a SigLIP tower); only the transformers classes and the CLS handling differ.
"""

from __future__ import annotations

from typing import Any, ClassVar

from mmadapt.encoders.clip import ClipEncoder


class SiglipEncoder(ClipEncoder):
    config_class: ClassVar[str] = "SiglipVisionConfig"
    model_class: ClassVar[str] = "SiglipVisionModel"
    registry_name: ClassVar[str] = "siglip"
    model_type: ClassVar[str] = "siglip"
    has_cls: ClassVar[bool] = False
    # SiglipImageProcessor: plain resize to the square input, mean = std = 0.5.
    processor_mean: ClassVar[tuple[float, float, float]] = (0.5, 0.5, 0.5)
    processor_std: ClassVar[tuple[float, float, float]] = (0.5, 0.5, 0.5)
    processor_mode: ClassVar[str] = "resize"

    def __init__(self, *, feature_layer: int = -2, drop_cls: bool = False, **config: Any) -> None:
        super().__init__(feature_layer=feature_layer, drop_cls=drop_cls, **config)


SIGLIP_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        patch_size=8, image_size=32,
    ),
    # google/siglip-so400m-patch14-384
    "so400m-14-384": dict(
        hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
        patch_size=14, image_size=384, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
    ),
}
