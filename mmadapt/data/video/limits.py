"""`VideoLimits`: a video's caps, checked from its container header before any frame is decoded (`decode`).

Declared apart from the decoder so that the settings that hold them (`VideoConfig`, and through it the data settings
behind every command's flags) import neither PyAV nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VideoLimits:
    """Caps checked from the container header before any frame is decoded (None: no cap).

    `max_frames_decoded` bounds the stream's frame count (the header's, else the counted packets; a frame list's
    length, checked before any frame is opened); `max_pixels_per_frame` its width * height (rechecked on the first
    decoded frame, and for frame lists); `max_seconds` its duration (stream duration, else the container's);
    `max_bytes_decoded` the frames kept in memory, sampled frames x height x width x 3 (a frame list: its length x
    its first frame's header size), before the buffer is allocated.
    """

    max_frames_decoded: int | None = 100_000
    max_pixels_per_frame: int | None = 4096 * 4096
    max_seconds: float | None = None
    max_bytes_decoded: int | None = 1 << 30

    def __post_init__(self) -> None:
        for name in ("max_frames_decoded", "max_pixels_per_frame", "max_seconds", "max_bytes_decoded"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"VideoLimits: {name} must be > 0 (or None), got {value}")
