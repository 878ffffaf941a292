"""Synthetic, well-formed batches for any component combination (tests, benchmarks, notebooks).

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
    special = {tokens.image_token_id, tokens.vision_start_token_id, tokens.vision_end_token_id}
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
