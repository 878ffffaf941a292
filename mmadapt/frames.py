"""Videos as frames: a video's temporal patches become image spans (Qwen3.5-VL, Qwen3-VL).

The Qwen processors render a video (`pixel_values_videos`, `video_grid_thw` (V, 3) (t, h, w) per video,
`videos_per_sample` (B,)) as one span of the backbone's video placeholder per temporal patch, each between its
timestamp text and bracketed like an image. Everything video does on the shared path lives here, in the order
`VisionLanguageModel.prepare` meets it (the model decides when; these functions do it):
1. Refuse what cannot work: `check_inputs` - video pixels need a backbone with a video token, a dynamic encoder,
   and their grids.
2. Encode, as transformers' Qwen models do: `encode` (videos alone) or `encode_together` (images and videos in ONE
   call of the vision side, split after, so every rank runs it once per forward whatever its mix: sharded FSDP2
   parts gather their parameters in step), then `per_frame`: one grid per temporal patch, (t, h, w) -> t x (1, h, w).
   `shared`: rows that show the same videos take them from one encoding (`video_index`); `given`: videos encoded
   beforehand (an RL step's one encoding) in their place.
3. Check: `check` - frame spans per sample == the frames its videos yield, each span's length == its frame's
   tokens; `missing` - the error for frame spans when no video was given.
4. Merge: `merge` - image spans and frame spans as one set in text order, with their visual tokens in that order.
   From there on the injection, the remaining checks, M-RoPE positions and DeepStack treat a frame as an image.

`model` below is the `VisionLanguageModel` (its `tokens`, `encoder`, `encode_images`, `encode_checked`).
Shapes: B batch, L tokens, S spans, V videos, F frames (temporal patches), N visual tokens, D LLM width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mmadapt.batch import VisionBatch
from mmadapt.contract import ImageSpans, ImageTokenContractError, check_spans, violation
from mmadapt.contract import merge as merge_spans
from mmadapt.encoders import VisualTokens


def _first(frames: ImageSpans) -> int:
    """The sample an error names: the first with a frame span (0 without any)."""
    return int(frames.sample[0]) if frames.num_spans else 0


def check_inputs(model: Any, batch: VisionBatch, frames: ImageSpans) -> None:
    """Video pixels need a dynamic encoder, a backbone with a video token, and their grids."""
    if model.tokens.video_token_id is None:
        raise ImageTokenContractError(
            f"sample {_first(frames)}: the batch carries pixel_values_videos, but backbone "
            f"{model.backbone_spec.name!r} has no video placeholder token, so no position can receive the frames. "
            "Fix: give the frames as images, or use a backbone that renders video (qwen3_5, qwen3_vl).")
    if not model.encoder.dynamic:
        raise ImageTokenContractError(
            f"sample {_first(frames)}: encoder {model.config.encoder.name!r} encodes fixed-size images and takes no "
            "video. Fix: give the frames as images (the data pipeline does this for `videos` only with a dynamic "
            "encoder), or use a dynamic encoder (qwen3_5_vit, qwen3_vl_vit).")
    if batch.pixel_values_videos is None or batch.video_grid_thw is None:
        raise ImageTokenContractError(
            f"sample {_first(frames)}: pixel_values_videos and video_grid_thw come together; only one was given. "
            "Fix: pass both, from the same processor call.")


def encode(model: Any, batch: VisionBatch, frames: ImageSpans) -> VisualTokens | None:
    """The videos' visual tokens at LLM width, one grid per frame (`per_frame`); None without videos."""
    if batch.pixel_values_videos is None and batch.video_grid_thw is None:
        return None
    check_inputs(model, batch, frames)
    try:
        visual = model.encode_images(batch.pixel_values_videos, batch.video_grid_thw)
    except ImageTokenContractError as e:
        raise ImageTokenContractError(f"sample {_first(frames)}: videos: {e}") from None
    return per_frame(shared(visual, batch, frames))


def shared(videos: VisualTokens, batch: VisionBatch, frames: ImageSpans) -> VisualTokens:
    """The rows' videos from videos encoded once (`VisionBatch.video_index`: video k of the rows is encoded video
    `video_index[k]`); `videos` itself without an index."""
    index = batch.video_index
    if index is None:
        return videos
    encoded = int(videos.grids.shape[0])
    if index.ndim != 1 or (index.numel() and not 0 <= int(index.min()) <= int(index.max()) < encoded):
        raise ImageTokenContractError(
            f"sample {_first(frames)}: video_index must be a (V,) index into the {encoded} encoded videos, got "
            f"{index.tolist()[:16]}. Fix: build the rows with mmadapt.train.objectives.rollout.group_rows")
    return videos.take(index)


def row_grids(batch: VisionBatch) -> torch.Tensor | None:
    """(V_rows, 3) the (t, h, w) grid of each video of the rows (`video_grid_thw`, through `video_index`)."""
    grids = batch.video_grid_thw
    if grids is None or batch.video_index is None:
        return grids
    return grids[batch.video_index.to(grids.device)]


def given(model: Any, batch: VisionBatch, frames: ImageSpans, videos: VisualTokens) -> VisualTokens:
    """Videos encoded beforehand (`forward(visual_videos=)`: one entry per video of the rows, its (t, h, w) grid)
    -> per frame; they must be the rows' videos: their grids equal the batch's `video_grid_thw`."""
    if model.tokens.video_token_id is None:
        check_inputs(model, batch, frames)
    grids = row_grids(batch)
    if grids is not None:
        grids = model.projector.output_grids(grids)  # the LLM side's (t, h, w), as VisualTokens carry them
    if grids is None or not torch.equal(videos.grids.to(grids.device), grids):
        raise ImageTokenContractError(
            f"sample {_first(frames)}: the videos handed in have (merged) grids "
            f"{videos.grids.tolist()[:8]}, the rows' video_grid_thw gives "
            f"{None if grids is None else grids.tolist()[:8]}. "
            "Fix: hand in the rows' own videos, in row order (VisualTokens.take), with their video_grid_thw")
    return per_frame(videos)


def encode_together(model: Any, batch: VisionBatch, spans: ImageSpans,
                    frames: ImageSpans) -> tuple[VisualTokens | None, VisualTokens | None]:
    """Images and videos through the encoder and projector in ONE call (split after): every forward runs the
    vision side once, whatever mix of images and videos a rank holds, so sharded (FSDP2) vision parts gather their
    parameters the same number of times on every rank. The ViT attends within each image / frame, so this equals
    two calls up to float rounding. Returns (images' tokens, videos' tokens per frame)."""
    check_inputs(model, batch, frames)
    pixel_values, image_grid_thw, video_grid_thw = batch.pixel_values, batch.image_grid_thw, batch.video_grid_thw
    if image_grid_thw is None or pixel_values.ndim != 2:  # two calls: the encoder's own error names what is wrong
        return model.encode_checked(pixel_values, image_grid_thw, spans), encode(model, batch, frames)
    both = model.encode_checked(torch.cat([pixel_values, batch.pixel_values_videos.to(pixel_values.dtype)]),
                                torch.cat([image_grid_thw, video_grid_thw.to(image_grid_thw.device)]), spans)
    images, videos = split(both, len(image_grid_thw))
    return images, per_frame(shared(videos, batch, frames))


def split(both: VisualTokens, images: int) -> tuple[VisualTokens, VisualTokens]:
    """One encoding of `images` images then videos -> (the images' tokens, the videos' tokens)."""
    cut = int(both.tokens_per_image[:images].sum())

    def part(rows: slice, grids: torch.Tensor) -> VisualTokens:
        return VisualTokens(both.features[rows], grids, both.window, tuple(level[rows] for level in both.levels))

    return part(slice(0, cut), both.grids[:images]), part(slice(cut, None), both.grids[images:])


def per_frame(video: VisualTokens) -> VisualTokens:
    """Videos' visual tokens with one grid per temporal patch, (t, h, w) -> t x (1, h, w): the LLM sees each patch
    as its own span (the Qwen processors write one per patch, between timestamps). The features are frame-major
    already, so only the grids change."""
    grids = torch.repeat_interleave(video.grids, video.grids[:, 0], dim=0)
    return dataclasses.replace(video, grids=torch.cat([torch.ones_like(grids[:, :1]), grids[:, 1:]], dim=1))


def frames_per_sample(batch: VisionBatch) -> torch.Tensor | None:
    """(B,) the frames (temporal patches) each sample's videos yield; None without `video_grid_thw` and
    `videos_per_sample`."""
    grids, videos = row_grids(batch), batch.videos_per_sample
    if videos is None or grids is None:
        return None
    owner = torch.repeat_interleave(torch.arange(batch.batch_size, device=grids.device), videos.to(grids.device))
    per_sample = torch.zeros(batch.batch_size, dtype=torch.long, device=grids.device)
    return per_sample.index_add_(0, owner, grids[:, 0].long())


def check(batch: VisionBatch, frames: ImageSpans, video: VisualTokens | None) -> None:
    """The video side of the contract: frame spans per sample == the frames its videos yield, each frame span's
    length == its frame's tokens."""
    tokens = video.tokens_per_image if video is not None else frames.length.new_zeros(0)
    expected = frames_per_sample(batch)
    check_spans(frames, tokens, batch_size=batch.batch_size, images_per_sample=expected, kind="video frame")


def missing(frames: ImageSpans) -> ImageTokenContractError:
    """The error for frame spans in a batch without video (raised even when the checks are off: nothing could fill
    those positions)."""
    return violation(_first(frames), f"{frames.num_tokens} video placeholder token(s) but no video was given",
                     "pixel_values_videos missing from the batch",
                     "pass the processor's pixel_values_videos and video_grid_thw")


def merge(spans: ImageSpans, visual: VisualTokens | None, frames: ImageSpans,
          video: VisualTokens) -> tuple[ImageSpans, VisualTokens]:
    """Image spans and video-frame spans as one set in text order, with their visual tokens (features, grids and
    DeepStack levels) in the same order: what the injection, the positions and DeepStack read."""
    if visual is None:
        width = video.features.shape[-1]
        empty = video.features.new_zeros(0, width)
        visual = VisualTokens(empty, video.grids.new_zeros(0, 3), video.window, tuple(empty for _ in video.levels))
    merged, is_video, order = merge_spans(spans, frames)
    positions = torch.arange(is_video.numel(), device=is_video.device)
    image_rows, video_rows = positions[~is_video], positions[is_video]

    def mix(image: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
        out = frame.new_zeros(is_video.numel(), frame.shape[-1])
        return out.index_put((image_rows,), image.to(frame.dtype)).index_put((video_rows,), frame)

    grids = torch.cat([visual.grids.to(video.grids.device), video.grids])[order.to(video.grids.device)]
    levels = tuple(mix(a, b) for a, b in zip(visual.levels, video.levels, strict=True))
    return merged, VisualTokens(mix(visual.features, video.features), grids, video.window, levels)
