"""The image controls, declared once: how mmadapt asks whether a model uses its images (and videos).

A control changes what the model is shown and keeps every span's token count, so the same prompt fits:

    real       the inputs as they are
    blanked    pixels zeroed: every processor normalises pixels as (x - mean) / std, so 0 is an image (a video's
               every frame) at the processor's mean colour: same size, grid and token count, no content
    shuffled   each image moved to another sample, among the images of the same grid (a cyclic shift inside each
               group), so its span still fits; videos likewise, among the videos of the same grid
    reversed   each video's temporal patches in reverse order (`mmadapt.data.video.reverse_frames`): the same frames
               in the wrong order (videos only)

Every reader of these measurements takes a control's `name` (the key in reports: `accuracy["blanked"]`,
`loss_blanked`, the preference view's `margin["blanked"]`) and its `label(kind)` (for people: "blanked images") from
here: `mmadapt eval` (`mmadapt.evaluate`), `mmadapt sees` and the preference view (`mmadapt.sees`), the demo, the
page's image effect and the docs.

    for control in IMAGE_CONTROLS: control.name, control.label()      # real, blanked, shuffled
    BLANKED.samples(samples)                  # encoded samples (evaluation): images and videos changed together
    BLANKED.pixels(pixels, grids)             # one batch's packed pixels of one kind -> Changed(pixels, moved) | None
    control_named("blanked"); current_key("accuracy_blank") == "accuracy_blanked"   # a report of an older version

Shapes: I images; pixel_values (I, C, H, W) for fixed-size encoders (all one grid) or (patches, F) with grids (I, 3)
= (t, h, w), patches = sum_i t_i * h_i * w_i, an item's rows contiguous; videos the same with their own grids.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from mmadapt.data.video.processing import reverse_frames


class Changed(NamedTuple):
    """A control's pixels and how many items (images or videos) it changed."""

    pixels: torch.Tensor
    moved: int


@dataclass(frozen=True)
class Kind:
    """Images or videos: the sample (and batch) fields a control changes."""

    name: str  # "images" / "videos"
    pixels: str  # "pixel_values" / "pixel_values_videos"
    grids: str  # "image_grid_thw" / "video_grid_thw"
    tokens: str  # "tokens_per_image" / "tokens_per_video"

    def of(self, sample: Any) -> torch.Tensor | None:
        return getattr(sample, self.pixels, None)

    def key(self, sample: Any) -> tuple:
        """What two samples must share for their items to swap: token counts and grids."""
        grids = getattr(sample, self.grids, None)
        return tuple(getattr(sample, self.tokens, ())), () if grids is None else tuple(grids.flatten().tolist())


IMAGES = Kind("images", "pixel_values", "image_grid_thw", "tokens_per_image")
VIDEOS = Kind("videos", "pixel_values_videos", "video_grid_thw", "tokens_per_video")
KINDS = (IMAGES, VIDEOS)


@dataclass(frozen=True)
class Control(ABC):
    """One way of showing a model its inputs: `name` (the key in reports), `former` (the names older versions wrote,
    read back by `current_key`), the `kinds` it changes, `pixels` for a batch and `samples` for encoded samples."""

    name: str
    former: tuple[str, ...] = ()
    kinds: tuple[Kind, ...] = KINDS

    def label(self, kind: str = "images") -> str:
        """For people: "blanked images", "shuffled videos", ..."""
        return f"{self.name} {kind}"

    @abstractmethod
    def pixels(self, pixels: torch.Tensor, grids: torch.Tensor | None = None) -> Changed | None:
        """One batch's pixels of one kind under this control; None when it does not apply (nothing can move)."""

    def samples(self, samples: Sequence[Any]) -> list[Any]:
        """Encoded samples under this control, each kind changed item by item in place (sample by sample)."""
        out = list(samples)
        for kind in self.kinds:
            for i, s in enumerate(out):
                if kind.of(s) is not None:
                    changed = self.pixels(kind.of(s), getattr(s, kind.grids, None))
                    if changed is not None:
                        out[i] = dataclasses.replace(s, **{kind.pixels: changed.pixels})
        return out


@dataclass(frozen=True)
class Real(Control):
    """The inputs as they are."""

    def pixels(self, pixels: torch.Tensor, grids: torch.Tensor | None = None) -> Changed | None:
        return Changed(pixels, 0)

    def samples(self, samples: Sequence[Any]) -> list[Any]:
        return list(samples)


@dataclass(frozen=True)
class Blanked(Control):
    """Pixels zeroed: the processor's mean colour, with the same size, grid and token count."""

    def pixels(self, pixels: torch.Tensor, grids: torch.Tensor | None = None) -> Changed | None:
        return Changed(torch.zeros_like(pixels), count(pixels, grids))


@dataclass(frozen=True)
class Shuffled(Control):
    """Each item moved to another of the same grid (cyclic inside each group of equal grids)."""

    def pixels(self, pixels: torch.Tensor, grids: torch.Tensor | None = None) -> Changed | None:
        return shuffle_images(pixels, grids)

    def samples(self, samples: Sequence[Any]) -> list[Any]:
        """Each sample gets the images of the next sample with the same token counts and grids (cyclic), so its
        spans still fit, and likewise the videos (images and videos move independently). A sample whose grids no
        other sample shares keeps its own."""
        out = list(samples)
        for kind in self.kinds:
            present = [i for i, s in enumerate(samples) if kind.of(s) is not None]
            for members in groups_of(present, lambda i, kind=kind: kind.key(samples[i])):
                for k, i in enumerate(members):
                    donor = samples[members[(k + 1) % len(members)]]
                    out[i] = dataclasses.replace(out[i], **{kind.pixels: kind.of(donor),
                                                            kind.grids: getattr(donor, kind.grids, None)})
        return out


@dataclass(frozen=True)
class Reversed(Control):
    """Each video's temporal patches in reverse order (images, one temporal patch each, cannot move)."""

    def label(self, kind: str = "videos") -> str:
        return "frames reversed"

    def pixels(self, pixels: torch.Tensor, grids: torch.Tensor | None = None) -> Changed | None:
        if grids is None:
            return None
        reordered, moved = reverse_frames(pixels, grids)
        return Changed(reordered, moved) if moved else None


REAL = Real("real", former=("images",))
BLANKED = Blanked("blanked", former=("blank",))
SHUFFLED = Shuffled("shuffled")
REVERSED = Reversed("reversed", former=("time_shuffled",), kinds=(VIDEOS,))
IMAGE_CONTROLS = (REAL, BLANKED, SHUFFLED)  # what `mmadapt eval` and the preference view score
VIDEO_CONTROLS = (*IMAGE_CONTROLS, REVERSED)  # ... when a prompt has a video
CONTROLS = {c.name: c for c in VIDEO_CONTROLS}


def control_named(name: str) -> Control:
    """The control called `name` (an older version's name too: "blank", "images", "time_shuffled")."""
    for control in VIDEO_CONTROLS:
        if name == control.name or name in control.former:
            return control
    raise ValueError(f"unknown image control {name!r}; known: {sorted(CONTROLS)}")


def current_key(key: str) -> str:
    """A report key in this vocabulary: an older version's `accuracy_blank` -> `accuracy_blanked` (`accuracy_images`
    -> `accuracy_real`, `..._time_shuffled` -> `..._reversed`); other keys unchanged."""
    for control in VIDEO_CONTROLS:
        for former in control.former:
            if key == former or key.endswith(f"_{former}"):
                return key[: len(key) - len(former)] + control.name
    return key


def count(pixels: torch.Tensor, grids: torch.Tensor | None) -> int:
    """The items (images or videos) in a batch's pixels: one per grid, or one per fixed-size image."""
    return int(grids.shape[0]) if grids is not None else int(pixels.shape[0])


def shuffle_images(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> Changed | None:
    """Pixels with each image replaced by the previous image of the same grid (cyclic), and how many moved.

    Fixed-size pixels (I, C, H, W) have no `image_grid_thw`: all images share one grid. Returns None when no two
    images share a grid (nothing can move without changing a span's token count). Videos work the same way
    (`pixel_values_videos`, `video_grid_thw`): each video gets another's.
    """
    if image_grid_thw is None:
        items = pixel_values.shape[0]
        return Changed(pixel_values.roll(1, dims=0), items) if items > 1 else None
    chunks = list(pixel_values.split(image_grid_thw.prod(-1).tolist()))
    out, moved = list(chunks), 0
    for members in groups_of(range(len(chunks)), lambda i: tuple(image_grid_thw[i].tolist())):
        if len(members) > 1:
            for k, i in enumerate(members):
                out[i] = chunks[members[k - 1]]
            moved += len(members)
    return Changed(torch.cat(out), moved) if moved else None


def groups_of(indices: Sequence[int] | range, key: Callable[[int], Any]) -> list[list[int]]:
    """`indices` grouped by `key(index)`, in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for i in indices:
        groups.setdefault(key(i), []).append(i)
    return list(groups.values())
