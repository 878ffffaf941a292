"""Qwen3-VL's dynamic-resolution ViT with DeepStack: the blocks, without the mergers.

The same tower as Qwen3.5's (`qwen3_5_vit`: patch embedding, learned position grid resampled per
image, 2-D rotary blocks, patches in merge-window order) plus DeepStack: the outputs of the blocks
named by `deepstack_visual_indexes` are returned as extra feature levels (`VisualTokens.levels`, at
encoder width, in the main tokens' order). Every merger is the projector's: the main one
(`model.visual.merger`) and one per level (`model.visual.deepstack_merger_list.{i}`), which the
`qwen_merger` projector builds as its level projections; a Qwen3-VL backbone then adds level i to its
hidden states at the image positions after decoder layer i.

Shapes: as `qwen3_5_vit`; each level is (N, D) like the main tokens.

Pretrained from a Qwen3-VL or Qwen3-VL-MoE directory: `model.visual.*` without the mergers.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from mmadapt.encoders.base import VisualTokens
from mmadapt.encoders.qwen3_5_vit import QwenViTEncoder


class Qwen3VLViTEncoder(QwenViTEncoder):
    family: ClassVar[str] = "qwen3_vl_vit"
    hf_classes: ClassVar[tuple[str, str]] = ("Qwen3VLVisionConfig", "Qwen3VLVisionModel")
    vision_types: ClassVar[tuple[str, ...]] = ("qwen3_vl_vision", "qwen3_vl_moe_vision")
    checkpoint_kind: ClassVar[str] = "a Qwen3-VL directory ('qwen3_vl' / 'qwen3_vl_moe')"
    projector_keys: ClassVar[tuple[str, ...]] = ("model.visual.merger.", "model.visual.deepstack_merger_list.")

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.deepstack_levels = tuple(int(i) for i in self.tower.deepstack_visual_indexes)
        bad = [i for i in self.deepstack_levels if not 0 <= i < len(self.tower.blocks)]
        if bad or len(set(self.deepstack_levels)) != len(self.deepstack_levels):
            raise ValueError(f"qwen3_vl_vit: deepstack_visual_indexes {list(self.deepstack_levels)} must be distinct "
                             f"block indices in [0, {len(self.tower.blocks)}) (depth {len(self.tower.blocks)})")
        # The tower returns each level's block output as is; its mergers are the projector's level projections.
        self.tower.deepstack_merger_list = nn.ModuleList(nn.Identity() for _ in self.deepstack_levels)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> VisualTokens:
        self.check_pixels(pixel_values, image_grid_thw)
        out = self.tower(pixel_values.to(self.tower.dtype), grid_thw=image_grid_thw)
        levels = tuple(out.deepstack_features) if self.emit_levels else ()
        return VisualTokens(out.last_hidden_state, image_grid_thw, window=self.merge_size, levels=levels)


def _preset(depth: int, hidden: int, intermediate: int, levels: tuple[int, ...], out: int) -> dict[str, Any]:
    return dict(
        depth=depth, hidden_size=hidden, intermediate_size=intermediate, num_heads=16, out_hidden_size=out,
        deepstack_visual_indexes=list(levels), patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
        num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh",
    )


QWEN3_VL_VIT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        depth=4, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64,
        deepstack_visual_indexes=[0, 1, 2], patch_size=8, temporal_patch_size=2, spatial_merge_size=2,
        num_position_embeddings=16, min_pixels=16 * 16, max_pixels=512 * 512,
    ),
    # Vision towers of the published Qwen3-VL checkpoints (config.json `vision_config`); the
    # preprocessor's pixel bounds (65536 .. 16777216) are the encoder's defaults.
    "qwen3-vl-2b": _preset(24, 1024, 4096, (5, 11, 17), 2048),
    "qwen3-vl-4b": _preset(24, 1024, 4096, (5, 11, 17), 2560),
    "qwen3-vl-8b": _preset(27, 1152, 4304, (8, 16, 24), 4096),
    "qwen3-vl-32b": _preset(27, 1152, 4304, (8, 16, 24), 5120),
    "qwen3-vl-30b-a3b": _preset(27, 1152, 4304, (8, 16, 24), 2048),
    "qwen3-vl-235b-a22b": _preset(27, 1152, 4304, (8, 16, 24), 4096),
}
