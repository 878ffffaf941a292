"""Which frames of a video to keep: `VideoSampling`, equal to transformers' `Qwen3VLVideoProcessor.sample_frames`.

`VideoSampling.sample_indices(total_frames, source_fps)`: fps sampling clamped to [min_frames, max_frames] and to
the frame count, or a fixed `num_frames`; the indices are `np.linspace(0, total - 1, n).round()`. An unknown
source fps counts as `FALLBACK_FPS` (24, like transformers), with a warning logged once (`warn_no_fps`, which the
processor's timestamps share).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

logger = logging.getLogger(__name__)

FALLBACK_FPS: Final[float] = 24.0
"""transformers' fps for a video without metadata (sampling and timestamps)."""


@dataclass(frozen=True)
class VideoSampling:
    """Which frames to keep: `fps` frames per second, or a fixed `num_frames` (pass `fps=None` with it).

    Equal to `Qwen3VLVideoProcessor.sample_frames(metadata, num_frames=, fps=)` with its `min_frames` and
    `max_frames`. Both None: every frame, clamped to [min_frames, max_frames] (transformers' rule).
    """

    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768

    def __post_init__(self) -> None:
        if self.fps is not None and self.num_frames is not None:
            raise ValueError(f"VideoSampling: fps ({self.fps}) and num_frames ({self.num_frames}) are mutually "
                             "exclusive (as in transformers). Fix: VideoSampling(num_frames=N, fps=None), or "
                             "VideoSampling.uniform(N).")
        if self.fps is not None and not (math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"VideoSampling: fps must be a finite number > 0 (or None), got {self.fps}")
        if self.num_frames is not None and self.num_frames < 1:
            raise ValueError(f"VideoSampling: num_frames must be >= 1 (or None), got {self.num_frames}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"VideoSampling: need 1 <= min_frames ({self.min_frames}) <= max_frames "
                             f"({self.max_frames})")

    @classmethod
    def uniform(cls, num_frames: int, **kwargs: Any) -> VideoSampling:
        """`num_frames` frames spread evenly over the video (fps=None)."""
        return cls(fps=None, num_frames=num_frames, **kwargs)

    def sample_indices(self, total_frames: int, source_fps: float | None) -> np.ndarray:
        """Indices (int, ascending, may repeat with `num_frames` > total) of the source frames to keep."""
        if total_frames < 1:
            raise ValueError(f"sample_indices: total_frames must be >= 1, got {total_frames}")
        num_frames = self.num_frames
        if num_frames is None and self.fps is not None:
            if source_fps is None:
                warn_no_fps()
                source_fps = FALLBACK_FPS
            num_frames = int(total_frames / source_fps * self.fps)
            num_frames = min(max(num_frames, self.min_frames), self.max_frames, total_frames)
        if num_frames is None:
            num_frames = min(max(total_frames, self.min_frames), self.max_frames)
        return np.linspace(0, total_frames - 1, num_frames).round().astype(int)


@functools.cache
def warn_no_fps() -> None:
    """Warn, once per process, that a video's fps is unknown and counts as `FALLBACK_FPS`."""
    logger.warning("a video has no fps (no header rate, or a frame list without fps=): sampling and timestamps "
                   "assume %s fps, like transformers. Pass fps= for frame lists.", FALLBACK_FPS)
