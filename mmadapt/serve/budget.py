"""What one request may cost, checked before any work: `RequestBudget` (the limits) and `Tally` (a request's count).

The API and the page share one budget. A request is measured in three steps, each before the next costs anything:

1. from the request itself (the JSON, the page's form): how many images and videos, how many characters of text
   (`RequestBudget.check_counts`), before anything is fetched, decoded or tokenised;
2. from each medium's header (an image's width x height, a video's frames kept x height x width x 3: what training
   reads before decoding, `mmadapt.data.images.image_size`, `SampleEncoder.video_header`), added up by a `Tally`:
   the pixels of all its images, the frames of all its videos and their decoded bytes;
3. only then decoding, with its own small bound (`decode_slots` requests decode at once) after the request holds its
   place in the model's queue, so a waiting request holds at most its own budget of decoded pixels.

Every limit defaults to the model's own data setting - the one training enforced (`max_images`, `max_sample_pixels`,
`max_sample_frames`, `max_video_bytes`) - or to a fixed default; each has a flag of `mmadapt serve`, and a refusal
(400) names the limit, its value and the flag (`FLAGS`).

    budget = RequestBudget(max_videos=2).resolved(processor.encoder.config)
    budget.check_counts(images=3, videos=0, text_chars=120)      # raises APIError (400) naming the limit and flag
    tally = Tally(budget); tally.image(4032, 3024, "messages[0].content[0].image_url")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final

from mmadapt.serve.errors import APIError, bad_request

DEFAULT_MAX_VIDEOS: Final[int] = 4
DEFAULT_MAX_TEXT_CHARS: Final[int] = 256 * 1024
"""Characters of text in one request (about 64k tokens of English): tokenising costs the model's worker about a
second per megabyte, before the prompt's length can be checked."""
DEFAULT_DECODE_SLOTS: Final[int] = 2

FLAGS: Final[dict[str, tuple[str, str | None]]] = {
    # setting: (its flag of `mmadapt serve`, the model's data setting it defaults to)
    "max_images": ("--max-images", "max_images"),
    "max_pixels": ("--max-request-pixels", "max_sample_pixels"),
    "max_videos": ("--max-videos", None),
    "max_frames": ("--max-frames", "max_sample_frames"),
    "max_video_bytes": ("--max-video-decoded-bytes", "max_video_bytes"),
    "max_text_chars": ("--max-text-chars", None),
}


@dataclass(frozen=True, kw_only=True)
class RequestBudget:
    """The most one request may hold: images (`max_images`) and their pixels together (`max_pixels`), videos
    (`max_videos`), their frames kept (`max_frames`) and those frames' decoded bytes (`max_video_bytes`), and
    characters of text (`max_text_chars`); `decode_slots` requests decode their media at once. None: the model's
    data setting (`resolved`)."""

    max_images: int | None = None
    max_pixels: int | None = None
    max_videos: int = DEFAULT_MAX_VIDEOS
    max_frames: int | None = None
    max_video_bytes: int | None = None
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS
    decode_slots: int = DEFAULT_DECODE_SLOTS

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{field.name} must be an integer >= 0 (or None: the model's setting), got {value!r}")
        if self.decode_slots < 1:
            raise ValueError(f"decode_slots must be >= 1, got {self.decode_slots}")

    def resolved(self, data: Any) -> RequestBudget:
        """This budget with each None replaced by the model's data setting (`data`: its `DataConfig`)."""
        return dataclasses.replace(self, **{name: getattr(data, setting) for name, (_, setting) in FLAGS.items()
                                            if setting is not None and getattr(self, name) is None})

    def limit(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"the budget's {name} is unset: use RequestBudget.resolved(data_config) first")
        return int(value)

    def refuse(self, name: str, what: str, code: str, param: str | None = None) -> APIError:
        """The 400 for `what` (e.g. "70 images") over the limit `name`: the limit, its value and its flag."""
        flag, setting = FLAGS[name]
        default = f"; its default is the model's data setting {setting}" if setting else ""
        return bad_request(f"{what} in one request, over this server's limit of {self.limit(name)} ({flag}{default})",
                           param=param, code=code)

    def check_counts(self, *, images: int, videos: int, text_chars: int, param: str | None = "messages") -> None:
        """Step 1: what the request says it holds, before anything is fetched or decoded."""
        if images > self.limit("max_images"):
            raise self.refuse("max_images", f"{images} images", "too_many_images", param)
        if videos > self.limit("max_videos"):
            raise self.refuse("max_videos", f"{videos} videos", "too_many_videos", param)
        if text_chars > self.limit("max_text_chars"):
            raise self.refuse("max_text_chars", f"{text_chars} characters of text", "text_too_long", param)


@dataclass(frozen=True, kw_only=True)
class PageLimits:
    """What the page (`--ui`) keeps in memory: at most `sessions` conversations (one per open page, keyed by an id
    the client chooses; the least recently used beyond are forgotten and their uploads removed), each holding images
    of at most `session_bytes`: each counts its decoded size (width x height x 3) or the bytes it is kept in,
    whichever is more (`mmadapt.serve.page.Page.image`), so the page holds at most `sessions` x `session_bytes` of
    images, whatever the uploads weigh."""

    sessions: int = 32
    session_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        for name in ("sessions", "session_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"page {name} must be >= 1, got {getattr(self, name)}")

    def check_room(self, cost: int, held: int, param: str | None = None) -> None:
        """A conversation whose images take `held` bytes taking one more of `cost`: a 400 beyond `session_bytes`."""
        if held + cost > self.session_bytes:
            raise bad_request(f"the image takes {cost} bytes (decoded) and this conversation's images {held}, over the "
                              f"page's limit of {self.session_bytes} bytes per conversation (--page-session-bytes); "
                              "Clear starts a new one", param=param, code="too_many_pixels")


class Tally:
    """Step 2: a request's media as their headers say they will decode, added up against a resolved budget."""

    def __init__(self, budget: RequestBudget) -> None:
        self.budget = budget
        self.images = self.pixels = self.videos = self.frames = self.video_bytes = 0

    def image(self, width: int, height: int, param: str | None = None) -> None:
        self.images += 1
        self.pixels += width * height
        if self.images > self.budget.limit("max_images"):
            raise self.budget.refuse("max_images", f"{self.images} images", "too_many_images", param)
        if self.pixels > self.budget.limit("max_pixels"):
            raise self.budget.refuse("max_pixels", f"{self.pixels} pixels of images (from their headers)",
                                     "too_many_pixels", param)

    def video(self, frames: int, decoded_bytes: int, param: str | None = None) -> None:
        self.videos += 1
        self.frames += frames
        self.video_bytes += decoded_bytes
        if self.videos > self.budget.limit("max_videos"):
            raise self.budget.refuse("max_videos", f"{self.videos} videos", "too_many_videos", param)
        if self.frames > self.budget.limit("max_frames"):
            raise self.budget.refuse("max_frames", f"{self.frames} video frames (as sampled, from their headers)",
                                     "too_many_frames", param)
        if self.video_bytes > self.budget.limit("max_video_bytes"):
            raise self.budget.refuse("max_video_bytes", f"{self.video_bytes} bytes of decoded video frames (from "
                                     "their headers)", "video_too_large", param)
