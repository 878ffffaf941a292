"""Synthetic, well-formed batches and samples for any component combination: the memory plan's probe, `mmadapt
check-model`, benchmarks, notebooks and tests.

The text is random token ids; each image span is expanded to exactly the token count the
encoder + projector yield for that image, bracketed when the backbone uses start/end tokens.
Rows are right-padded; `attention_mask` is bool; `labels` supervise the text after the images.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmadapt.data.samples import EncodedSample
from mmadapt.encoders.base import FixedSizeEncoder


def image_grid(model: Any, side: int | tuple[int, int]) -> torch.Tensor:
    """The encoder's patch grid for an image of `side` (or (height, width)) pixels; fixed encoders ignore it."""
    if isinstance(model.encoder, FixedSizeEncoder):
        return torch.tensor(model.encoder.grid)
    height, width = (side, side) if isinstance(side, int) else side
    return torch.tensor([1, height // model.encoder.patch_size, width // model.encoder.patch_size])


def random_pixels(model: Any, grids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if isinstance(model.encoder, FixedSizeEncoder):
        size = model.encoder.image_size
        return torch.randn(len(grids), model.encoder.num_channels, size, size, generator=generator)
    return torch.randn(int(grids.prod(-1).sum()), model.encoder.patch_dim, generator=generator)


def synthetic_batch(
    model: Any,
    images_per_sample: Sequence[int] = (1, 2),
    *,
    image_sides: Sequence[int | tuple[int, int]] | None = None,
    text_lengths: Sequence[int] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A right-padded batch; `image_sides` (pixels or (h, w), one per image) vary dynamic encoders' grids."""
    g = torch.Generator().manual_seed(seed)
    tokens = model.tokens
    num_images = sum(images_per_sample)
    merges = getattr(model.projector, "merge_size", 1) * getattr(model.encoder, "merge_size", 1)
    step = model.encoder.patch_size * merges
    sides = list(image_sides) if image_sides is not None else [step * (2 + i % 2) for i in range(num_images)]
    grids = torch.stack([image_grid(model, s) for s in sides]) if num_images else torch.zeros(0, 3, dtype=torch.long)
    counts = model.projector.output_grids(grids).prod(-1).tolist() if num_images else []
    special = {tokens.image_token_id, tokens.vision_start_token_id, tokens.vision_end_token_id, tokens.video_token_id}
    vocab = [t for t in range(model.backbone.config.vocab_size) if t not in special]
    rows, image = [], 0
    for b, n in enumerate(images_per_sample):
        text = text_lengths[b] if text_lengths is not None else 6 + 3 * b
        row: list[int] = []
        for _ in range(n):
            row += [vocab[int(i)] for i in torch.randint(len(vocab), (2,), generator=g)]
            span = [tokens.image_token_id] * counts[image]
            if tokens.vision_start_token_id is not None:
                span = [tokens.vision_start_token_id, *span, tokens.vision_end_token_id]
            row += span
            image += 1
        row += [vocab[int(i)] for i in torch.randint(len(vocab), (text,), generator=g)]
        rows.append(row)
    length = max(map(len, rows))
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.bool)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, : len(row)] = torch.tensor(row)
        attention_mask[b, : len(row)] = True
        answer = text_lengths[b] if text_lengths is not None else 6 + 3 * b
        labels[b, len(row) - answer // 2 : len(row)] = input_ids[b, len(row) - answer // 2 : len(row)]
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
             "images_per_sample": torch.tensor(list(images_per_sample))}
    if num_images:
        batch["pixel_values"] = random_pixels(model, grids, g)
        if model.encoder.dynamic:
            batch["image_grid_thw"] = grids
    return batch


def synthetic_samples(model: Any, images_per_sample: Sequence[int] = (1, 2), **kwargs: Any) -> list[EncodedSample]:
    """The rows of `synthetic_batch` as separate `EncodedSample`s (for collators and packing tests)."""
    batch = synthetic_batch(model, images_per_sample, **kwargs)
    lengths = batch["attention_mask"].sum(1).tolist()
    tokens = _tokens_per_image(model, batch)
    pixels_per_image = _pixel_rows_per_image(model, batch)
    samples, image = [], 0
    for b, n in enumerate(images_per_sample):
        mine = slice(image, image + n)
        rows = sum(pixels_per_image[mine])
        first_row = sum(pixels_per_image[:image])
        samples.append(EncodedSample(
            id=f"sample-{b}", input_ids=batch["input_ids"][b, : lengths[b]], labels=batch["labels"][b, : lengths[b]],
            pixel_values=batch["pixel_values"][first_row : first_row + rows] if n else None,
            image_grid_thw=batch["image_grid_thw"][mine] if n and "image_grid_thw" in batch else None,
            tokens_per_image=tokens[mine]))
        image += n
    return samples


def _tokens_per_image(model: Any, batch: dict[str, torch.Tensor]) -> list[int]:
    if "pixel_values" not in batch:
        return []
    grids = batch.get("image_grid_thw")
    if grids is None:
        grids = torch.tensor([model.encoder.grid] * batch["pixel_values"].shape[0])
    return model.projector.output_grids(grids).prod(-1).tolist()


def _pixel_rows_per_image(model: Any, batch: dict[str, torch.Tensor]) -> list[int]:
    if "pixel_values" not in batch:
        return []
    if "image_grid_thw" in batch:
        return batch["image_grid_thw"].prod(-1).tolist()
    return [1] * batch["pixel_values"].shape[0]


def synthetic_video_batch(
    model: Any,
    layout: Sequence[Sequence[str]] = (("video", "image"), ("video",)),
    *,
    video_shapes: Sequence[tuple[int, int, int]] = ((4, 32, 48), (2, 48, 32)),
    image_sides: Sequence[int | tuple[int, int]] = (32,),
    timestamp_tokens: int = 3,
    text_lengths: Sequence[int] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A right-padded batch of images and videos for a dynamic encoder + Qwen backbone, rendered as the Qwen
    processors render them: per sample, `layout` lists its items in text order ("image" or "video"); each video
    (`video_shapes`: (frames, height, width) in pixels, frames even, in order) becomes, per temporal patch,
    `timestamp_tokens` text tokens (standing in for "<0.5 seconds>") + <|vision_start|> + <|video_pad|> x tokens
    + <|vision_end|>. Keys: as `synthetic_batch` plus pixel_values_videos, video_grid_thw, videos_per_sample."""
    g = torch.Generator().manual_seed(seed)
    tokens, encoder = model.tokens, model.encoder
    special = {tokens.image_token_id, tokens.vision_start_token_id, tokens.vision_end_token_id, tokens.video_token_id}
    vocab = [t for t in range(model.backbone.config.vocab_size) if t not in special]

    def text(n: int) -> list[int]:
        return [vocab[int(i)] for i in torch.randint(len(vocab), (n,), generator=g)]

    def span(token: int, count: int) -> list[int]:
        return [tokens.vision_start_token_id, *[token] * count, tokens.vision_end_token_id]

    p, t = encoder.patch_size, encoder.temporal_patch_size
    video_grids = torch.tensor([[f // t, h // p, w // p] for f, h, w in video_shapes], dtype=torch.long)
    image_grids = torch.stack([image_grid(model, s) for s in image_sides]) if image_sides else \
        torch.zeros(0, 3, dtype=torch.long)
    frame_tokens = model.projector.output_grids(video_grids)[:, 1:].prod(-1).tolist() if len(video_shapes) else []
    image_tokens = model.projector.output_grids(image_grids).prod(-1).tolist() if len(image_sides) else []
    rows, answers, next_image, next_video = [], [], 0, 0
    for b, items in enumerate(layout):
        row = text(2)
        for item in items:
            if item == "image":
                row += span(tokens.image_token_id, image_tokens[next_image]) + text(2)
                next_image += 1
            else:
                for _ in range(int(video_grids[next_video, 0])):
                    row += text(timestamp_tokens) + span(tokens.video_token_id, frame_tokens[next_video])
                row += text(2)
                next_video += 1
        answer = text_lengths[b] if text_lengths is not None else 6 + 3 * b
        rows.append(row + text(answer))
        answers.append(answer)
    if (next_image, next_video) != (len(image_grids), len(video_grids)):
        raise ValueError(f"layout uses {next_image} image(s) and {next_video} video(s); image_sides gives "
                         f"{len(image_grids)} and video_shapes {len(video_grids)}")
    length = max(map(len, rows))
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.bool)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for b, (row, answer) in enumerate(zip(rows, answers, strict=True)):
        input_ids[b, : len(row)] = torch.tensor(row)
        attention_mask[b, : len(row)] = True
        labels[b, len(row) - answer : len(row)] = input_ids[b, len(row) - answer : len(row)]
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
             "images_per_sample": torch.tensor([list(items).count("image") for items in layout]),
             "videos_per_sample": torch.tensor([list(items).count("video") for items in layout])}
    if len(image_grids):
        batch["pixel_values"] = random_pixels(model, image_grids, g)
        batch["image_grid_thw"] = image_grids
    if len(video_grids):
        batch["pixel_values_videos"] = random_pixels(model, video_grids, g)
        batch["video_grid_thw"] = video_grids
    return batch


def synthetic_video_samples(model: Any, layout: Sequence[Sequence[str]] = (("video", "image"), ("video",)),
                            **kwargs: Any) -> list[EncodedSample]:
    """The rows of `synthetic_video_batch` as separate `EncodedSample`s (for collators and packing tests)."""
    batch = synthetic_video_batch(model, layout, **kwargs)
    lengths = batch["attention_mask"].sum(1).tolist()
    image_rows = batch["image_grid_thw"].prod(-1).tolist() if "image_grid_thw" in batch else []
    video_rows = batch["video_grid_thw"].prod(-1).tolist() if "video_grid_thw" in batch else []
    image_tokens = _tokens_per_image(model, batch)
    video_tokens = model.projector.output_grids(batch["video_grid_thw"]).prod(-1).tolist() if video_rows else []
    samples, image, video = [], 0, 0
    for b, items in enumerate(layout):
        n, v = list(items).count("image"), list(items).count("video")
        first_image, first_video = sum(image_rows[:image]), sum(video_rows[:video])
        samples.append(EncodedSample(
            id=f"sample-{b}", input_ids=batch["input_ids"][b, : lengths[b]], labels=batch["labels"][b, : lengths[b]],
            pixel_values=batch["pixel_values"][first_image : first_image + sum(image_rows[image : image + n])]
            if n else None,
            image_grid_thw=batch["image_grid_thw"][image : image + n] if n else None,
            tokens_per_image=image_tokens[image : image + n],
            pixel_values_videos=batch["pixel_values_videos"][
                first_video : first_video + sum(video_rows[video : video + v])] if v else None,
            video_grid_thw=batch["video_grid_thw"][video : video + v] if v else None,
            tokens_per_video=video_tokens[video : video + v]))
        image, video = image + n, video + v
    return samples


def moving_square(frames: int, height: int = 32, width: int = 32, *, direction: tuple[int, int] = (0, 1),
                  side: int = 8, start: tuple[int, int] = (0, 0), step: int = 4) -> torch.Tensor:
    """uint8 (F, H, W, 3) frames of a white square on black moving `step` pixels per frame along (dy, dx)."""
    out = torch.zeros(frames, height, width, 3, dtype=torch.uint8)
    for f in range(frames):
        top = (start[0] + direction[0] * step * f) % (height - side + 1)
        left = (start[1] + direction[1] * step * f) % (width - side + 1)
        out[f, top : top + side, left : left + side] = 255
    return out


def write_video(path: Any, frames: Any, fps: float = 10) -> Any:
    """Encode uint8 (F, H, W, 3) frames (even H and W) to a video file with PyAV (H.264 when the wheel has it, else
    MPEG-4 Part 2) at `fps`; returns `path`. For tests and examples: real containers, made offline."""
    import av
    import numpy as np

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    frames = np.asarray(frames, dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width, stream.pix_fmt = int(frames.shape[1]), int(frames.shape[2]), "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path
