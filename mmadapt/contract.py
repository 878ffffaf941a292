"""The image-token contract: every image becomes exactly its visual tokens in the LLM input.

Built from the two injection steps (`locate`, then `scatter`) so the checker and the model
can never disagree about where the images are. Checks run on every batch by default and
cost a few small integer ops (one device sync), nothing per token beyond a comparison.
The checks are pure functions; `VisionLanguageModel.prepare` runs them on its one input path, and
`check_batch` reports over that same path (the DeepStack level checks are in `mmadapt.deepstack`, the video frames'
in `mmadapt.frames`).

Shapes: B batch, L tokens, S image spans, I images, N visual tokens, D LLM width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mmadapt.batch import VisionBatch
from mmadapt.packing import require_bool_mask


class ImageTokenContractError(ValueError):
    """Images and image tokens disagree. The message names the sample, expected vs found, cause and fix."""


@dataclass(frozen=True)
class ImageSpans:
    """Runs of the image placeholder: `mask` (B, L) bool; per span (S,) sample, start, length."""

    mask: torch.Tensor
    sample: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    num_tokens: int

    @property
    def num_spans(self) -> int:
        return int(self.sample.numel())

    def per_sample(self, batch_size: int) -> torch.Tensor:
        return torch.bincount(self.sample, minlength=batch_size)


def locate(input_ids: torch.Tensor, image_token_id: int | None) -> ImageSpans:
    """Find every run of `image_token_id` in `input_ids` (B, L); spans come in batch order (none for None)."""
    mask = input_ids == image_token_id if image_token_id is not None else torch.zeros_like(input_ids, dtype=torch.bool)
    previous = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    starts = mask & ~previous
    sample, start = starts.nonzero(as_tuple=True)
    run_id = starts.flatten().cumsum(0) - 1
    length = torch.bincount(run_id[mask.flatten()], minlength=sample.numel())
    return ImageSpans(mask, sample, start, length, num_tokens=int(length.sum()))


def merge(first: ImageSpans, second: ImageSpans) -> tuple[ImageSpans, torch.Tensor, torch.Tensor]:
    """The spans of two placeholders (images, video frames) as one set in batch and text order; (N,) bool: which of
    the merged positions are `second`'s (in `mask` order); and (S,) the merged spans' indices into first + second."""
    length = first.mask.shape[1]
    sample, start = torch.cat([first.sample, second.sample]), torch.cat([first.start, second.start])
    order = torch.argsort(sample * length + start)
    mask = first.mask | second.mask
    spans = ImageSpans(mask, sample[order], start[order], torch.cat([first.length, second.length])[order],
                       num_tokens=first.num_tokens + second.num_tokens)
    return spans, second.mask[mask], order


def scatter(inputs_embeds: torch.Tensor, spans: ImageSpans, features: torch.Tensor) -> torch.Tensor:
    """Write `features` (N, D) into the image positions of `inputs_embeds` (B, L, D), out of place."""
    if features.shape[0] != spans.num_tokens or features.shape[-1] != inputs_embeds.shape[-1]:
        raise ImageTokenContractError(
            f"cannot inject {tuple(features.shape)} visual features into {spans.num_tokens} image positions "
            f"of width {inputs_embeds.shape[-1]}"
        )
    return inputs_embeds.index_put((spans.mask,), features.to(inputs_embeds.dtype))


def violation(sample: int, what: str, cause: str, fix: str) -> ImageTokenContractError:
    """The error for a broken contract: the sample, what was found, the likely cause and the fix."""
    return ImageTokenContractError(f"sample {sample}: {what}. Likely cause: {cause}. Fix: {fix}.")


def check_spans(
    spans: ImageSpans,
    tokens_per_image: torch.Tensor,
    *,
    batch_size: int,
    images_per_sample: torch.Tensor | None = None,
    kind: str = "image",
) -> None:
    """Spans per sample == images per sample, and each span's length == its image's token count.

    `kind` "video frame": the spans of video frames (one per temporal patch of a video, as Qwen renders them, each
    between its timestamp text and bracketed like an image), `tokens_per_image` per frame and `images_per_sample` the
    frames each sample's videos yield."""
    found = spans.per_sample(batch_size)
    video = kind.startswith("video")
    pixels, grid = ("pixel_values_videos", "video_grid_thw") if video else ("pixel_values", "image_grid_thw")
    num_images = int(tokens_per_image.numel())
    if num_images == 0 and spans.num_spans:
        s = int(spans.sample[0])
        raise violation(s, f"{int(found[s])} {kind} span(s) but no {kind}s were given",
                    f"{pixels} missing from the batch", f"pass the {pixels} (and {grid}) "
                    f"the processor returned, or remove the {kind} placeholders from text-only samples")
    if num_images and not spans.num_spans:
        s = 0 if images_per_sample is None else int(images_per_sample.nonzero()[0])
        raise violation(s, f"{num_images} {kind}(s) given but no {kind} placeholder tokens in any sample",
                    f"the chat template or truncation dropped the {kind} spans",
                    f"render {kind}s with the backbone's span and never truncate inside one")
    if images_per_sample is not None:
        bad = (found != images_per_sample.to(found.device)).nonzero()
        if bad.numel():
            s = int(bad[0])
            raise violation(s, f"expected {int(images_per_sample[s])} {kind} span(s), found {int(found[s])}",
                        f"{'a video' if video else 'an <image>'} placeholder was lost (truncation) or duplicated "
                        "in the text",
                        f"give every {kind} exactly one placeholder and keep spans whole when truncating")
    if spans.num_spans != num_images:
        s = int(spans.sample[min(spans.num_spans, num_images) - 1])
        raise violation(s, f"the batch has {spans.num_spans} {kind} span(s) (per sample {found.tolist()}) but "
                    f"{num_images} {kind}(s)", "placeholders and images are out of step",
                    f"give every {kind} exactly one placeholder span, in the same order as the {kind}s")
    bad = (spans.length != tokens_per_image.to(spans.length.device)).nonzero()
    if bad.numel():
        k = int(bad[0])
        raise violation(int(spans.sample[k]), f"{kind} span at position {int(spans.start[k])} has "
                    f"{int(spans.length[k])} tokens, but {kind} {k} yields {int(tokens_per_image[k])} visual tokens",
                    "preprocessing does not match the encoder (e.g. CLIP-style resizing before a "
                    "dynamic-resolution ViT) or the span was expanded from a different image size",
                    "expand each placeholder to the token count the encoder's processor reports for that image")


def check_brackets(input_ids: torch.Tensor, spans: ImageSpans, start_id: int | None, end_id: int | None) -> None:
    """Each span sits between the backbone's vision-start and vision-end tokens, when it has them."""
    for token_id, position, name in ((start_id, spans.start - 1, "start"),
                                     (end_id, spans.start + spans.length, "end")):
        if token_id is None or not spans.num_spans:
            continue
        inside = (position >= 0) & (position < input_ids.shape[1])
        found = input_ids[spans.sample, position.clamp(0, input_ids.shape[1] - 1)]
        bad = (~inside | (found != token_id)).nonzero()
        if bad.numel():
            k = int(bad[0])
            raise violation(int(spans.sample[k]), f"image span at position {int(spans.start[k])} is not "
                        f"bracketed by the vision-{name} token (id {token_id})",
                        "the text was not rendered with this backbone's chat template",
                        "render images as <vision_start> + image tokens + <vision_end>")


def check_attention(spans: ImageSpans, attention_mask: torch.Tensor | None) -> None:
    """No image position may be masked out: the LLM would never read those visual tokens."""
    if attention_mask is None or not spans.num_spans:
        return
    hidden = (spans.mask & ~require_bool_mask(attention_mask)).nonzero()
    if hidden.numel():
        s, pos = (int(v) for v in hidden[0])
        raise violation(s, f"image token at position {pos} has attention_mask == 0",
                    "padding was written over an image span or the mask was built from the wrong lengths",
                    "build attention_mask from each sample's true length (bool, True = attend)")


def check_token_types(spans: ImageSpans, mm_token_type_ids: torch.Tensor, frames: ImageSpans | None = None) -> None:
    """Given `mm_token_type_ids` (B, L) must mark exactly the image positions with 1 and the video positions with 2
    (transformers' text 0, image 1, video 2)."""
    video = frames.mask if frames is not None else torch.zeros_like(spans.mask)
    bad = (((mm_token_type_ids == 1) != spans.mask) | ((mm_token_type_ids == 2) != video)).nonzero()
    if bad.numel():
        s, pos = (int(v) for v in bad[0])
        raise violation(s, f"mm_token_type_ids[{s}, {pos}] = {int(mm_token_type_ids[s, pos])} disagrees with the "
                    "image (1) and video (2) placeholder positions", "mm_token_type_ids came from a different "
                    "tokenisation", "omit mm_token_type_ids (mmadapt derives it) or pass the processor's own")


def check_injected(inputs_embeds: torch.Tensor, spans: ImageSpans, features: torch.Tensor) -> None:
    """After injection every image position holds projector output, so no placeholder reaches the LLM."""
    held = inputs_embeds[spans.mask]
    same = (held == features.to(held.dtype)).all(-1)
    if not bool(same.all()):
        k = int((~same).nonzero()[0])
        s, pos = (int(v) for v in spans.mask.nonzero()[k])
        raise violation(s, f"position {pos} still holds a non-visual embedding after injection",
                    "something rewrote the embeddings after injection (a hook, or input_ids re-embedded)",
                    "pass inputs_embeds, not input_ids, to the backbone and keep hooks out of the image positions")


@dataclass
class BatchReport:
    """What `check_batch` found: per-sample image/span counts and the first contract violation."""

    rows: list[dict]
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def __str__(self) -> str:
        videos = any(r.get("videos") for r in self.rows)
        lines = [f"{'sample':>6}  {'tokens':>6}  {'images':>6}  " + (f"{'videos':>6}  " if videos else "") +
                 f"{'spans':>5}  span lengths -> visual tokens" + (" (video frames count as spans)" if videos else "")]
        for r in self.rows:
            pairs = ", ".join(f"{a}->{b}" for a, b in zip(r["span_lengths"], r["image_tokens"], strict=False))
            column = f"{r.get('videos', 0)!s:>6}  " if videos else ""
            lines.append(f"{r['sample']:>6}  {r['tokens']:>6}  {r['images']!s:>6}  {column}{r['spans']:>5}  {pairs}")
        lines.append("contract: OK" if self.ok else f"contract: FAILED - {self.error}")
        return "\n".join(lines)


@torch.no_grad()
def check_batch(model: Any, batch: Mapping[str, Any] | VisionBatch) -> BatchReport:
    """Run every image-token check on `batch` (a `VisionBatch` or a mapping such as a collator's batch, whose other
    keys play no part) through the model's own input path (`model.prepare`, no LLM forward) and return a readable
    report: per sample its tokens, images and spans, and the first violation."""
    inputs = VisionBatch.of(batch)
    input_ids, images_per_sample, found, error = inputs.input_ids, inputs.images_per_sample, {}, None
    videos_per_sample = inputs.videos_per_sample
    try:
        model.prepare(inputs, check=True, trace=found)
    except (ValueError, TypeError) as e:  # ImageTokenContractError is a ValueError
        error = str(e)
    spans = found.get("spans") or locate(input_ids, model.tokens.image_token_id)
    visual, valid = found.get("visual"), found.get("valid")
    tokens = visual.tokens_per_image.tolist() if visual is not None else []
    lengths_in_tokens = valid.sum(-1) if valid is not None else [input_ids.shape[1]] * input_ids.shape[0]
    rows, lengths = [], spans.length.tolist()
    for b in range(input_ids.shape[0]):
        mine = (spans.sample == b).nonzero().flatten().tolist()
        rows.append({"sample": b, "tokens": int(lengths_in_tokens[b]), "spans": len(mine),
                     "images": int(images_per_sample[b]) if images_per_sample is not None else "?",
                     **({"videos": int(videos_per_sample[b])} if videos_per_sample is not None else {}),
                     "span_lengths": [lengths[k] for k in mine], "image_tokens": [tokens[k] for k in mine
                                                                                   if k < len(tokens)]})
    return BatchReport(rows, error)
