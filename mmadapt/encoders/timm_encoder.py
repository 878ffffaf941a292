"""Any timm model as a fixed-size encoder: features from `forward_features`, prefix tokens dropped.

ViTs give (I, prefix + h*w, D); CNNs give (I, D, h, w), flattened row-major to (I, h*w, D).
Preprocessing comes from timm's own data config (`self.data_config`: input size, mean, std,
interpolation). No weights are downloaded: pass `checkpoint_path` to load a local file.
"""

from __future__ import annotations

from typing import Any

import torch

from mmadapt.encoders.base import FixedSizeEncoder, VisualTokens


class TimmEncoder(FixedSizeEncoder):
    def __init__(self, *, model_name: str, checkpoint_path: str | None = None, **model_kwargs: Any) -> None:
        import timm

        super().__init__({"model_name": model_name, "checkpoint_path": checkpoint_path, **model_kwargs})
        if model_name not in timm.list_models():
            raise ValueError(f"timm has no model {model_name!r}; see timm.list_models('*pattern*')")
        self.tower = timm.create_model(model_name, pretrained=False, num_classes=0, **model_kwargs)
        if checkpoint_path is not None:
            timm.models.load_checkpoint(self.tower, checkpoint_path, strict=True)
        self.data_config = timm.data.resolve_data_config(model=self.tower)
        img_size = getattr(getattr(self.tower, "patch_embed", None), "img_size", None)
        if img_size is not None:  # a ViT built with img_size=... keeps its pretrained cfg's input size
            self.data_config["input_size"] = (self.data_config["input_size"][0], *img_size)
        channels, height, width = self.data_config["input_size"]
        if height != width:
            raise ValueError(f"timm encoder {model_name!r} takes {height}x{width} inputs; only square ones work")
        self.num_channels, self.image_size = channels, height
        self.patch_size = self.tower.feature_info[-1]["reduction"]
        self.num_prefix_tokens = getattr(self.tower, "num_prefix_tokens", 0)
        self.output_dim = self.tower.num_features

    def processor_defaults(self) -> dict[str, Any]:
        """Mean, std, interpolation from timm's data config; "pad" (prismatic's letterbox) keeps the whole image."""
        interpolation = self.data_config.get("interpolation", "bicubic")
        fixed = interpolation in ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")  # not "random"
        return {**super().processor_defaults(), "mean": tuple(self.data_config["mean"]),
                "std": tuple(self.data_config["std"]), "resample": interpolation if fixed else "bicubic"}

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> VisualTokens:
        self.check_pixels(pixel_values, image_grid_thw)
        features = self.tower.forward_features(pixel_values.to(next(self.tower.parameters()).dtype))
        if features.ndim == 4:  # CNN feature map (I, D, h, w) -> (I, h*w, D)
            features = features.flatten(2).transpose(1, 2)
        else:
            features = features[:, self.num_prefix_tokens :]
        expected = self.grid[1] * self.grid[2]
        assert features.shape[1] == expected, f"timm gave {features.shape[1]} tokens, grid says {expected}"
        grids = self.grids_for(pixel_values.shape[0], pixel_values.device)
        return VisualTokens(features.reshape(-1, features.shape[-1]), grids)


TIMM_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(model_name="vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2),
    "vit-b-16-224": dict(model_name="vit_base_patch16_224"),
    "convnext-tiny": dict(model_name="convnext_tiny"),
}
