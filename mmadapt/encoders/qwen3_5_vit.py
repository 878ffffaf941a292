"""Qwen3.5's dynamic-resolution ViT: the patch embedding and blocks, without the merger.

The merger (2x2 spatial merge + MLP) is the `qwen_merger` projector, so any projector can
follow this tower and the merger can follow any encoder.

Shapes: I images, N = sum_i t_i*h_i*w_i patches, F = C*T*P*P flattened patch, D width.
pixel_values (N, F) + image_grid_thw (I, 3) -> VisualTokens((N, D), grids = image_grid_thw,
window = spatial_merge_size), patches arriving in merge-window order as Qwen's processor emits them.

Pretrained from a Qwen3.5-VL directory: `model.visual.*` without `model.visual.merger.*` (that is the
`qwen_merger` projector's); pixel bounds from its preprocessor_config.json when it has one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from mmadapt.contract import ImageTokenContractError
from mmadapt.encoders.base import VisionEncoder, VisualTokens
from mmadapt.options import hf_options
from mmadapt.weights import Checkpoint, Rules, hf_config, mmadapt_part, wrong_family


class QwenViTEncoder(VisionEncoder):
    dynamic: ClassVar[bool] = True
    family: ClassVar[str] = "qwen3_5_vit"
    hf_classes: ClassVar[tuple[str, str]] = ("Qwen3_5VisionConfig", "Qwen3_5VisionModel")  # transformers' config, tower
    vision_types: ClassVar[tuple[str, ...]] = ("qwen3_5_vision", "qwen3_5_moe_vision")  # vision_config model types
    checkpoint_kind: ClassVar[str] = "a Qwen3.5-VL directory ('qwen3_5' / 'qwen3_5_moe')"
    projector_keys: ClassVar[tuple[str, ...]] = ("model.visual.merger.",)  # the tower's keys that are the projector's

    def __init__(self, *, min_pixels: int = 256 * 256, max_pixels: int = 4096 * 4096, **config: Any) -> None:
        """`min_pixels` / `max_pixels` bound the processor's smart-resize (from preprocessor_config.json)."""
        import transformers

        config_class, model_class = (getattr(transformers, name) for name in self.hf_classes)
        hf_config = config_class(**config)
        super().__init__({"min_pixels": min_pixels, "max_pixels": max_pixels, **hf_options(hf_config)})
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.tower = model_class(hf_config)
        # The merger belongs to the projector (`qwen_merger`); the tower stops at the blocks.
        self.tower.merger = nn.Identity()
        self.output_dim = hf_config.hidden_size
        self.patch_size = hf_config.patch_size
        self.temporal_patch_size = hf_config.temporal_patch_size
        self.merge_size = hf_config.spatial_merge_size
        self.patch_dim = hf_config.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def checkpoint_layout(cls, checkpoint: Checkpoint, what: str) -> tuple[dict[str, Any], Rules, tuple[str, ...]]:
        if checkpoint.model_type == "mmadapt":
            return (*mmadapt_part(checkpoint, "encoder", cls.family, what), ())
        vision = getattr(hf_config(checkpoint, what), "vision_config", None) if checkpoint.config else None
        if getattr(vision, "model_type", None) not in cls.vision_types:
            raise wrong_family(what, checkpoint, cls.checkpoint_kind)
        options = {**hf_options(vision), **preprocessor_pixels(checkpoint.directory)}
        return options, (("model.visual.", "tower."),), cls.projector_keys

    def minimal_input(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One merge window of patches: the smallest image the ViT and the merger take."""
        m = self.merge_size
        return (torch.zeros(m * m, self.patch_dim, device=device),
                torch.tensor([[1, m, m]], device=device, dtype=torch.long))

    def processor_defaults(self) -> dict[str, Any]:
        """Qwen3.5's processor (mean = std = 0.5) with this encoder's pixel bounds (saved with the model)."""
        pixels = {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels}
        return {"patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), **pixels}

    def check_pixels(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None) -> None:
        if pixel_values.ndim != 2:
            raise ImageTokenContractError(
                f"{self.family} is a dynamic-resolution encoder and expects flattened patches "
                f"(patches, {self.patch_dim}) plus image_grid_thw, but got pixel_values of shape "
                f"{tuple(pixel_values.shape)} (a fixed-size processor's output). Fix: preprocess with the "
                "Qwen processor (smart-resize to multiples of patch*merge, flattened patches, grid_thw)."
            )
        if image_grid_thw is None:
            raise ImageTokenContractError(
                f"{self.family} needs image_grid_thw (images, 3) with each image's (t, h, w) patch grid; "
                "it is missing. Fix: pass the image_grid_thw the Qwen processor returned."
            )
        if pixel_values.shape[1] != self.patch_dim:
            raise ImageTokenContractError(
                f"{self.family} expects {self.patch_dim} values per patch (channels*temporal*patch^2), got "
                f"{pixel_values.shape[1]}. Fix: use a processor with patch_size={self.patch_size}, "
                f"temporal_patch_size={self.temporal_patch_size}."
            )
        odd = (image_grid_thw[:, 1:] % self.merge_size != 0).any(-1)
        if odd.any():
            i = int(odd.nonzero()[0])
            raise ImageTokenContractError(
                f"image {i}: grid {image_grid_thw[i].tolist()} is not a multiple of the merge size "
                f"{self.merge_size}. Fix: resize images to multiples of patch*merge = "
                f"{self.patch_size * self.merge_size} px."
            )
        total = int(image_grid_thw.prod(-1).sum())
        if total != pixel_values.shape[0]:
            raise ImageTokenContractError(
                f"image_grid_thw describes {total} patches but pixel_values holds {pixel_values.shape[0]}. "
                "Fix: pass pixel_values and image_grid_thw from the same processor call, images in order."
            )

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> VisualTokens:
        self.check_pixels(pixel_values, image_grid_thw)
        hidden = self.tower(pixel_values.to(self.tower.dtype), grid_thw=image_grid_thw).last_hidden_state
        return VisualTokens(hidden, image_grid_thw, window=self.merge_size)


def preprocessor_pixels(directory: Path) -> dict[str, int]:
    """min/max pixels of a Qwen directory's preprocessor_config.json (`size` edges, or the Qwen2-VL keys)."""
    path = directory / "preprocessor_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    size = config.get("size") or {}
    low, high = config.get("min_pixels", size.get("shortest_edge")), config.get("max_pixels", size.get("longest_edge"))
    return {k: int(v) for k, v in (("min_pixels", low), ("max_pixels", high)) if v is not None}


def _preset(depth: int, hidden: int, intermediate: int, heads: int, out: int) -> dict[str, Any]:
    return dict(
        depth=depth, hidden_size=hidden, intermediate_size=intermediate, num_heads=heads, out_hidden_size=out,
        patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
        hidden_act="gelu_pytorch_tanh",
    )


QWEN_VIT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64,
        patch_size=8, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
        min_pixels=16 * 16, max_pixels=512 * 512,  # from one 16 x 16 merge window up to 512 x 512
    ),
    # Vision towers of the published Qwen3.5 checkpoints (config.json `vision_config`).
    "qwen3.5-0.8b": _preset(12, 768, 3072, 12, 1024),
    "qwen3.5-2b": _preset(24, 1024, 4096, 16, 2048),
    "qwen3.5-4b": _preset(24, 1024, 4096, 16, 2560),
    "qwen3.5-9b": _preset(27, 1152, 4304, 16, 4096),
    # The Qwen3.5-MoE checkpoints' towers (the same blocks; out_hidden_size is the LLM's width).
    "qwen3.5-35b-a3b": _preset(27, 1152, 4304, 16, 2048),
    "qwen3.5-122b-a10b": _preset(27, 1152, 4304, 16, 3072),
    "qwen3.5-397b-a17b": _preset(27, 1152, 4304, 16, 4096),
}
