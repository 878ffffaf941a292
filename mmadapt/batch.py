"""VisionBatch: the keyword inputs of one batch, as `VisionLanguageModel.prepare` and `contract.check_batch` take them.

Its fields ARE the list of model inputs: `forward` and `generate` build one from their transformers-style keyword
arguments, a collator's or processor's mapping converts with `VisionBatch.of` (keys that are not inputs, such as
`labels` and `meta`, play no part), and every key list is derived from the fields (`VisionBatch.keys()`). A new
input kind is one field here plus the code that reads it.

Shapes: B batch, L tokens, I images, V videos, P pixel rows (dynamic encoders) or (I, C, H, W) images.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class VisionBatch:
    """One batch's inputs; all but `input_ids` optional (None: absent).

    `input_ids` (B, L); `attention_mask` (B, L) bool or 0/1 of any dtype (packed rows: per-sample ids, see
    `mmadapt.packing`); `pixel_values` (I, C, H, W) or (P, C * t * p * p) with `image_grid_thw` (I, 3);
    `mm_token_type_ids` (B, L) (text 0, image 1, video 2); `position_ids` (B, L) or (3, B, L) (M-RoPE);
    `images_per_sample` (B,); `cu_seqlens` (S + 1,) the packed samples' boundaries; `pixel_values_videos` (P, ...)
    with `video_grid_thw` (V, 3) and `videos_per_sample` (B,) (see `mmadapt.frames`); `image_index` (I_rows,): images
    shared by rows (a preference pair's prompt images, `mmadapt.data.preference`): per image of the rows, in row
    order, the index of its pixels among the images `pixel_values` holds (encoded once, their visual tokens reused);
    `video_index` (V_rows,) the same for videos (an RL group's rows showing their prompt's videos): per video of the
    rows, its index among the videos of `pixel_values_videos` / `video_grid_thw`; `videos_per_sample` counts the
    rows' videos.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    mm_token_type_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    images_per_sample: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    videos_per_sample: torch.Tensor | None = None
    image_index: torch.Tensor | None = None
    video_index: torch.Tensor | None = None

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The input names, in field order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, inputs: Mapping[str, Any] | VisionBatch) -> VisionBatch:
        """The batch in `inputs` (a mapping such as a collator's batch, or a `VisionBatch`, returned as is); keys that
        are not inputs (`labels`, `meta`, a method's `self` ...) are ignored. `input_ids` is required."""
        if isinstance(inputs, VisionBatch):
            return inputs
        if "input_ids" not in inputs:
            raise KeyError(f"a batch needs input_ids; it has {sorted(inputs)}")
        return cls(**{k: inputs[k] for k in cls.keys() if k in inputs})

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def replace(self, **changes: Any) -> VisionBatch:
        """This batch with some inputs changed (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)
