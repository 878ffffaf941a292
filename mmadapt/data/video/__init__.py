"""Videos -> sampled uint8 frames -> Qwen3-VL video patches, equal to transformers' `Qwen3VLVideoProcessor`.

Three steps, each usable alone, one module each:
- `sampling`: `VideoSampling.sample_indices(total_frames, source_fps)`, which source frames to keep, exactly
  `Qwen3VLVideoProcessor.sample_frames`.
- `decode`: `load_video(source, sampling=, limits=)` -> `Video` (uint8 (F, 3, H, W) frames decoded with PyAV from a
  file or an `EmbeddedVideo`'s bytes, or a list of already sampled frames) and `probe_video` -> `VideoHeader`
  (nothing decoded), with `VideoLimits` checked from the header before any frame is decoded; a bad file raises
  `DataProblem`, never another exception type.
- `processing`: `VideoProcessor(videos)` -> `ProcessedVideos` (pixel_values_videos, video_grid_thw, tokens and
  timestamps per video), on the image processor's `PatchGeometry`; `frame_text` writes Qwen3-VL's prompt text.
`config`: `VideoConfig`, a run's `data.video` settings (a sampling, limits and pixel bounds) parsed from one flat
mapping.

Parity: on CPU the outputs equal transformers' `Qwen3VLVideoProcessor` (torchvision backend) bit for bit for the
same file decoded with its pyav backend (tests/test_video.py); the few deviations, only where transformers fails or
is inconsistent, are listed in `decode` and `processing`.

Shapes: F frames, V videos, C = 3, T temporal patch, P patch, m spatial merge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmadapt.lazy import lazy_names

if TYPE_CHECKING:
    from mmadapt.data.video.config import VideoConfig
    from mmadapt.data.video.decode import (
        EmbeddedVideo,
        FrameSource,
        Video,
        VideoHeader,
        VideoLimits,
        load_video,
        probe_video,
    )
    from mmadapt.data.video.processing import (
        ProcessedVideos,
        VideoProcessor,
        calculate_timestamps,
        frame_text,
        reverse_frames,
    )
    from mmadapt.data.video.sampling import FALLBACK_FPS, VideoSampling

EXPORTS: dict[str, str] = {
    "VideoConfig": "mmadapt.data.video.config",
    "EmbeddedVideo": "mmadapt.data.video.decode",
    "FrameSource": "mmadapt.data.video.decode",
    "Video": "mmadapt.data.video.decode",
    "VideoHeader": "mmadapt.data.video.decode",
    "VideoLimits": "mmadapt.data.video.decode",
    "load_video": "mmadapt.data.video.decode",
    "probe_video": "mmadapt.data.video.decode",
    "ProcessedVideos": "mmadapt.data.video.processing",
    "VideoProcessor": "mmadapt.data.video.processing",
    "calculate_timestamps": "mmadapt.data.video.processing",
    "frame_text": "mmadapt.data.video.processing",
    "reverse_frames": "mmadapt.data.video.processing",
    "FALLBACK_FPS": "mmadapt.data.video.sampling",
    "VideoSampling": "mmadapt.data.video.sampling",
}
"""Each public name -> the module that defines it, imported when the name is first read (`mmadapt.lazy`)."""
__getattr__, __dir__ = lazy_names(__name__, EXPORTS)

__all__ = [
    "FALLBACK_FPS",
    "EmbeddedVideo",
    "FrameSource",
    "ProcessedVideos",
    "Video",
    "VideoConfig",
    "VideoHeader",
    "VideoLimits",
    "VideoProcessor",
    "VideoSampling",
    "calculate_timestamps",
    "frame_text",
    "load_video",
    "probe_video",
    "reverse_frames",
]
