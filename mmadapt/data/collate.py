"""Collators: pad samples into rows, or pack several samples per row up to a token budget.

Both take a list of `EncodedSample` (or `DataProblem` for samples the dataset could not
encode: these are dropped and reported in `batch["meta"]["problems"]`) and return the
keyword inputs of `VisionLanguageModel.forward`:

    input_ids (B, L) long, attention_mask (B, L) bool, labels (B, L) long (-100 = no loss),
    images_per_sample (B,), pixel_values / image_grid_thw (images in row order),
    videos_per_sample (B,), pixel_values_videos / video_grid_thw (when any sample has a video),
    mm_token_type_ids (B, L) (M-RoPE backbones: 1 at image tokens, 2 at video tokens, as transformers' Qwen needs),
    cu_seqlens (S+1,) int32 (packing only; see `mmadapt.packing`), meta {sample_ids, problems, and for a
    mixture's samples: sources and lengths, per row}.

Position ids are computed by the model from the mask, the image spans and `cu_seqlens`, so
they restart at every packed sample (per-sample M-RoPE for Qwen) and can never disagree
with the tokens. Rows are right-padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmadapt.data.problems import DataProblem
from mmadapt.data.samples import EncodedSample
from mmadapt.packing import cu_seqlens_from_lengths


@dataclass(frozen=True, kw_only=True)
class Collator:
    """Pads (`max_tokens=None`) or packs samples into rows of at most `max_tokens` tokens."""

    pad_token_id: int
    image_token_id: int
    token_types: bool = False
    video_token_id: int | None = None
    max_tokens: int | None = None
    pad_to_multiple_of: int = 1

    @classmethod
    def for_model(cls, model: Any, pad_token_id: int, *, max_tokens: int | None = None, **kw: Any) -> Collator:
        return cls(pad_token_id=pad_token_id, image_token_id=model.tokens.image_token_id,
                   token_types=model.uses_mrope, video_token_id=model.tokens.video_token_id,
                   max_tokens=max_tokens, **kw)

    @property
    def packing(self) -> bool:
        return self.max_tokens is not None

    def __call__(self, items: Sequence[EncodedSample | DataProblem]) -> dict[str, Any]:
        samples = [s for s in items if isinstance(s, EncodedSample)]
        problems = [p.to_dict() for p in items if isinstance(p, DataProblem)]
        rows = self.pack(samples) if self.packing else [[s] for s in samples]
        batch = self.rows_to_batch(rows)
        batch["meta"] = {"sample_ids": [[s.id for s in row] for row in rows], "problems": problems}
        if any(s.source is not None for s in samples):  # a mixture's: per-source counts and loss
            batch["meta"]["sources"] = [[s.source for s in row] for row in rows]
            batch["meta"]["lengths"] = [[len(s) for s in row] for row in rows]
        return batch

    def pack(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        """First-fit decreasing: longest samples first, each into the first row with room."""
        assert self.max_tokens is not None
        rows: list[list[EncodedSample]] = []
        room: list[int] = []
        for sample in sorted(samples, key=len, reverse=True):
            if len(sample) > self.max_tokens:
                raise ValueError(f"sample {sample.id!r} has {len(sample)} tokens, more than the packing budget "
                                 f"max_tokens={self.max_tokens}. Fix: set max_length <= max_tokens in the "
                                 "preprocessing (over-long samples are then dropped and counted) or raise max_tokens.")
            row = next((r for r, left in enumerate(room) if left >= len(sample)), None)
            if row is None:
                rows.append([])
                room.append(self.max_tokens)
                row = len(rows) - 1
            rows[row].append(sample)
            room[row] -= len(sample)
        return rows

    def rows_to_batch(self, rows: list[list[EncodedSample]]) -> dict[str, Any]:
        lengths = [[len(s) for s in row] for row in rows]
        width = max((sum(n) for n in lengths), default=0)
        width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for r, row in enumerate(rows):
            at = 0
            for s in row:
                input_ids[r, at : at + len(s)] = s.input_ids
                labels[r, at : at + len(s)] = s.labels
                labels[r, at] = -100  # a sample's first token is never predicted from the previous sample
                at += len(s)
            mask[r, :at] = True
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": mask, "labels": labels,
                                 "images_per_sample": torch.tensor([sum(s.num_images for s in row) for row in rows])}
        samples = [s for row in rows for s in row]
        batch.update(images_of(samples))
        if any(s.num_videos for s in samples):
            batch["videos_per_sample"] = torch.tensor([sum(s.num_videos for s in row) for row in rows])
            batch.update(videos_of(samples))
        if self.token_types:
            batch["mm_token_type_ids"] = (input_ids == self.image_token_id).long()
            if self.video_token_id is not None:
                batch["mm_token_type_ids"] += 2 * (input_ids == self.video_token_id).long()
        if self.packing:
            batch["cu_seqlens"] = cu_seqlens_from_lengths(lengths, width)
        return batch


def images_of(samples: list[EncodedSample]) -> dict[str, torch.Tensor]:
    """pixel_values (and image_grid_thw) of all images, in sample order; {} when there are none."""
    with_pixels = [s for s in samples if s.num_images and s.pixel_values is not None]  # (a pair's shared images: once)
    if not with_pixels:
        return {}
    out = {"pixel_values": torch.cat([s.pixel_values for s in with_pixels])}
    grids = [s.image_grid_thw for s in with_pixels]
    if all(g is not None for g in grids):
        out["image_grid_thw"] = torch.cat(grids)
    return out


def videos_of(samples: list[EncodedSample]) -> dict[str, torch.Tensor]:
    """pixel_values_videos and video_grid_thw of all videos, in sample order; {} when there are none."""
    with_videos = [s for s in samples if s.num_videos]
    if not with_videos:
        return {}
    return {"pixel_values_videos": torch.cat([s.pixel_values_videos for s in with_videos]),
            "video_grid_thw": torch.cat([s.video_grid_thw for s in with_videos])}
