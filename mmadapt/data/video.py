"""Videos -> sampled uint8 frames -> Qwen3-VL video patches, equal to transformers' `Qwen3VLVideoProcessor`.

Three steps, each usable alone:
- `VideoSampling.sample_indices(total_frames, source_fps)`: which source frames to keep, exactly
  `Qwen3VLVideoProcessor.sample_frames` (fps sampling clamped to [min_frames, max_frames] and to the frame count,
  or a fixed `num_frames`; `np.linspace(0, total - 1, n).round()`); an unknown source fps counts as 24, like
  transformers, with a warning logged once.
- `load_video(source, sampling=, limits=)` -> `Video`: a file decoded with PyAV (transformers' `read_video_pyav`:
  frame count from the stream header, fps = the stream's average rate, frames converted with
  `to_ndarray(format="rgb24")`), decoding only up to the last sampled frame and writing only the sampled ones
  into one preallocated buffer (peak memory: the sampled frames plus one decoded frame).
  Or a list of frames (paths or PIL images): these are taken as already sampled - every frame is used,
  `indices = range(F)`, and the fps is the `fps=` argument (None: timestamps fall back to 24 fps). transformers
  does the same for a frame list with `do_sample_frames=False` (its default metadata: `frames_indices = range(F)`,
  fps None -> 24 in the prompt); with `do_sample_frames=True` it would instead resample the list as a 24 fps video.
  `Video.frames` is uint8 (F, 3, H, W) (a channels-last view; the resize kernel takes it as it is).
- `VideoProcessor(videos)` -> `ProcessedVideos`: smart-resize with the temporal factor (optionally capping pixels
  per frame like qwen-vl-utils), one antialiased bicubic `tvF.resize` of the uint8 frames, the fused normalisation
  (x - 255*mean) / (255*std) in float32, the last temporal patch padded by repeating the last frame, and patches in
  (t, h/m, w/m, m, m) order, each C*T*P*P. pixel_values_videos (N, C*T*P*P) float32 with N = sum of t*h*w,
  video_grid_thw (V, 3) long, per video `tokens_per_frame` (h*w / projector_merge^2, the LLM tokens of one
  temporal patch), `frames` (t) and `timestamps` (seconds per temporal patch, `Qwen3VLProcessor._calculate_timestamps`).
  `frame_text` writes the prompt text `Qwen3VLProcessor.replace_video_token` writes; `tokens_for` counts tokens
  without pixels.

Shapes: F frames, V videos, C = 3, T temporal patch, P patch, m spatial merge.

Parity: on CPU the outputs equal transformers' `Qwen3VLVideoProcessor` (torchvision backend) bit for bit for the
same file decoded with its pyav backend (tests/test_video.py). Deviations, only where transformers fails or is
inconsistent:
- a video with fewer frames than T (e.g. one frame): transformers' smart_resize raises; here the frame count is
  taken as T (the patch is padded to T frames anyway).
- duplicate indices (`num_frames` above the frame count, or fewer frames than `min_frames` with fps=None):
  transformers' pyav loader keeps each frame once (fewer frames than indices) while its array path repeats them;
  here frames are repeated so that `frames[k]` is source frame `indices[k]` (the array path's result).
- a stream whose header has no frame count (stream.frames == 0, e.g. some WebM/MKV): transformers samples from
  0 frames and fails; here the video packets are counted (demuxed, not decoded) and used as the frame count.
- no average rate in the header: transformers' `float(None)` raises; here source_fps is None (-> 24 fps, warned).

Error policy (like `mmadapt.data.images`): a bad file raises `DataProblem` with reason `missing_video`,
`unreadable_video` (not a container, no video stream, a decode error, or truncated: fewer frames decodable than
the header declares), `video_too_large` (frames, pixels per frame or seconds over `VideoLimits`, known from the
header before any frame is decoded), `empty_video` (no frames) or `variable_frame_size` (frames of different
sizes); never another exception type. Frame paths in a frame list go through `load_image` (its `*_image` reasons).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

import av
import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as tvF

from mmadapt.data.images import load_image, to_rgb
from mmadapt.data.problems import DataProblem

logger = logging.getLogger(__name__)

FALLBACK_FPS: Final[float] = 24.0
"""transformers' fps for a video without metadata (sampling and timestamps)."""
RESCALE: Final[float] = 1 / 255  # transformers' rescale_factor; kept literal so the fused constants match
# What PyAV / FFmpeg raise for malformed files (FFmpegError subclasses also derive from ValueError / OSError).
AV_ERRORS: Final[tuple[type[BaseException], ...]] = (av.FFmpegError, OSError, ValueError, EOFError, IndexError,
                                                     KeyError, RuntimeError, struct.error, ZeroDivisionError)
FrameSource = str | os.PathLike[str] | Image.Image


# ---- sampling and limits ----------------------------------------------------------------------------
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
                _warn_no_fps()
                source_fps = FALLBACK_FPS
            num_frames = int(total_frames / source_fps * self.fps)
            num_frames = min(max(num_frames, self.min_frames), self.max_frames, total_frames)
        if num_frames is None:
            num_frames = min(max(total_frames, self.min_frames), self.max_frames)
        return np.linspace(0, total_frames - 1, num_frames).round().astype(int)


@dataclass(frozen=True)
class VideoLimits:
    """Caps checked from the container header before any frame is decoded (None: no cap).

    `max_frames_decoded` bounds the stream's frame count (the header's, else the counted packets);
    `max_pixels_per_frame` its width * height (rechecked on the first decoded frame, and for frame lists);
    `max_seconds` its duration (stream duration, else the container's).
    """

    max_frames_decoded: int | None = 100_000
    max_pixels_per_frame: int | None = 4096 * 4096
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_frames_decoded", "max_pixels_per_frame", "max_seconds"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"VideoLimits: {name} must be > 0 (or None), got {value}")


# ---- loading ----------------------------------------------------------------------------------------
@dataclass
class Video:
    """Sampled frames: uint8 (F, 3, H, W); `indices[k]` is the source frame of `frames[k]`."""

    frames: torch.Tensor
    indices: list[int]
    source_fps: float | None
    total_frames: int
    path: str | None = None

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the frames."""
        return int(self.frames.shape[-2]), int(self.frames.shape[-1])


def load_video(source: str | os.PathLike[str] | Sequence[FrameSource], *, sampling: VideoSampling | None = None,
               limits: VideoLimits | None = None, fps: float | None = None, sample_id: str | None = None) -> Video:
    """A video file (sampled by `sampling`) or a list of frames (all used, at `fps`) as a `Video`.

    Raises `DataProblem` (attributed to `sample_id`) for a bad file; see the module docstring.
    """
    sampling = VideoSampling() if sampling is None else sampling
    limits = VideoLimits() if limits is None else limits
    try:
        if isinstance(source, str | os.PathLike):
            if fps is not None:
                raise ValueError("load_video: fps= is for frame lists; a file's fps comes from its header")
            return _load_file(os.fspath(source), sampling, limits)
        return _load_frames(source, fps, limits)
    except DataProblem as problem:
        if sample_id is None:
            raise
        raise problem.for_sample(sample_id) from problem


def _load_file(name: str, sampling: VideoSampling, limits: VideoLimits) -> Video:
    if os.path.isdir(name):
        raise DataProblem("unreadable_video", "it is a directory, not a video file. Fix: point to the file.",
                          path=name)
    if not os.path.exists(name):
        raise DataProblem("missing_video", "no such file. Fix: correct the path or the video root, or drop the "
                          "sample.", path=name)
    try:
        container = av.open(name)
    except AV_ERRORS as e:
        raise _unreadable(name, f"not a readable video container: {type(e).__name__}: {e}") from e
    with container:
        if not container.streams.video:
            raise _unreadable(name, "the container has no video stream")
        stream = container.streams.video[0]
        try:
            total, source_fps = _header(container, stream, name, limits)
            if total == 0:
                raise DataProblem("empty_video", "the video stream has no frames. Fix: re-encode or drop the file.",
                                  path=name)
            indices = sampling.sample_indices(total, source_fps)
            frames = _decode(container, stream, indices, total, name, limits)
        except DataProblem:
            raise
        except AV_ERRORS as e:
            raise _unreadable(name, f"decoding failed: {type(e).__name__}: {e}") from e
    return Video(frames, indices.tolist(), source_fps, total, name)


def _header(container: Any, stream: Any, name: str, limits: VideoLimits) -> tuple[int, float | None]:
    """(frame count, fps) from the header, with the limits checked; nothing decoded."""
    rate = stream.average_rate
    source_fps = float(rate) if rate else None
    width, height = int(stream.width or 0), int(stream.height or 0)
    if limits.max_pixels_per_frame is not None and width * height > limits.max_pixels_per_frame:
        raise _too_large(name, f"{width} x {height} = {width * height} pixels per frame exceeds "
                         f"max_pixels_per_frame = {limits.max_pixels_per_frame}")
    seconds = _duration(container, stream)
    if limits.max_seconds is not None and seconds is not None and seconds > limits.max_seconds:
        raise _too_large(name, f"{seconds:.1f} seconds exceeds max_seconds = {limits.max_seconds}")
    total = int(stream.frames)
    if total == 0 and seconds is not None and source_fps is not None:  # no count in the header: check the estimate
        _check_frames(name, round(seconds * source_fps), limits, "estimated from duration x fps")
    if total == 0:
        total = sum(1 for packet in container.demux(stream) if packet.size)  # counted, not decoded
        container.seek(0)
    _check_frames(name, total, limits, "declared by the header" if stream.frames else "counted packets")
    return total, source_fps


def _duration(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * Fraction(stream.time_base))
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def _check_frames(name: str, frames: int, limits: VideoLimits, how: str) -> None:
    if limits.max_frames_decoded is not None and frames > limits.max_frames_decoded:
        raise _too_large(name, f"{frames} frames ({how}) exceeds max_frames_decoded = {limits.max_frames_decoded}")


def _decode(container: Any, stream: Any, indices: np.ndarray, total: int, name: str,
            limits: VideoLimits) -> torch.Tensor:
    """The frames at `indices` (in order, repeats repeated), decoding up to the last one and keeping only those."""
    slots: dict[int, list[int]] = {}
    for position, index in enumerate(indices.tolist()):
        slots.setdefault(index, []).append(position)
    last, kept, decoded, error = int(indices.max()), 0, 0, ""
    frames = _Frames(len(indices), name, limits)
    container.seek(0)  # as read_video_pyav
    try:
        for i, frame in enumerate(container.decode(stream)):
            decoded = i + 1
            if i in slots:
                frames.put(slots[i], frame.to_ndarray(format="rgb24"))
                kept += 1
            if i >= last:
                break
    except AV_ERRORS as e:
        error = f" (decoding stopped with {type(e).__name__}: {e})"
    if kept < len(slots):
        raise _unreadable(name, f"truncated or corrupt: only {decoded} frames could be decoded{error}, but the "
                          f"header declares {total} and frame {last} is needed")
    return frames.tensor()


@dataclass(frozen=True)
class VideoHeader:
    """What a video's header says, nothing decoded: frame count, fps (None: unknown), frame height and width."""

    total_frames: int
    source_fps: float | None
    height: int
    width: int


def probe_video(source: str | os.PathLike[str] | Sequence[FrameSource], *, limits: VideoLimits | None = None,
                fps: float | None = None, sample_id: str | None = None) -> VideoHeader:
    """A video file's (or frame list's) `VideoHeader` with the limits checked, decoding no frame (a frame list's
    size comes from its first frame's image header): for token counts before loading (lengths, `mmadapt plan`)."""
    from mmadapt.data.images import image_size

    limits = VideoLimits() if limits is None else limits
    try:
        if not isinstance(source, str | os.PathLike):
            if len(source) == 0:
                raise DataProblem("empty_video", "the frame list is empty. Fix: give at least one frame.")
            _check_frames("frame list", len(source), limits, "in the list")
            first = source[0]
            width, height = first.size if isinstance(first, Image.Image) else image_size(first)
            return VideoHeader(len(source), fps, height, width)
        name = os.fspath(source)
        if not os.path.isfile(name):
            raise DataProblem("missing_video", "no such file. Fix: correct the path or the video root, or drop the "
                              "sample.", path=name)
        try:
            with av.open(name) as container:
                if not container.streams.video:
                    raise _unreadable(name, "the container has no video stream")
                stream = container.streams.video[0]
                total, source_fps = _header(container, stream, name, limits)
                return VideoHeader(total, source_fps, int(stream.height or 0), int(stream.width or 0))
        except DataProblem:
            raise
        except AV_ERRORS as e:
            raise _unreadable(name, f"not a readable video container: {type(e).__name__}: {e}") from e
    except DataProblem as problem:
        raise problem if sample_id is None else problem.for_sample(sample_id) from None


@dataclass(frozen=True, kw_only=True)
class VideoConfig:
    """A run's video settings (`data.video` in a run's YAML): frame sampling, limits and pixel bounds.

    Sampling as transformers' Qwen3-VL video processor: `fps` frames per second (default 2) or a fixed
    `num_frames`, clamped to [`min_frames`, `max_frames`]. Pixel bounds over all frames of a video (smart-resize's
    t * h * w): `min_pixels` / `max_pixels`, default 128 and 768 merge windows (P*m)^2 - transformers' defaults
    (131072 / 786432) at Qwen's 32-pixel windows. Limits checked from the header before decoding: `max_frames_decoded`
    (the stream's frames), `max_pixels_per_frame`, `max_seconds`. `frames_fps`: the fps of videos given as frame
    lists (None: 24, transformers' fallback, in their timestamps).
    """

    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_frames_decoded: int | None = 100_000
    max_pixels_per_frame: int | None = 4096 * 4096
    max_seconds: float | None = None
    frames_fps: float | None = None

    def __post_init__(self) -> None:
        _ = self.sampling, self.limits  # validated now: their errors name the field

    @classmethod
    def parse(cls, value: VideoConfig | dict[str, Any] | None) -> VideoConfig:
        if isinstance(value, VideoConfig):
            return value
        value = dict(value or {})
        if "num_frames" in value and "fps" not in value:
            value["fps"] = None  # giving num_frames means uniform sampling
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"data.video: unknown setting(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    @property
    def sampling(self) -> VideoSampling:
        return VideoSampling(fps=self.fps, num_frames=self.num_frames, min_frames=self.min_frames,
                             max_frames=self.max_frames)

    @property
    def limits(self) -> VideoLimits:
        return VideoLimits(max_frames_decoded=self.max_frames_decoded, max_pixels_per_frame=self.max_pixels_per_frame,
                           max_seconds=self.max_seconds)

    def processor(self, image_processor: Any) -> VideoProcessor:
        """The `VideoProcessor` sharing an image processor's patch geometry and normalisation (a `QwenProcessor`)."""
        factor = image_processor.patch_size * image_processor.merge_size
        low = self.min_pixels if self.min_pixels is not None else 128 * factor**2
        high = self.max_pixels if self.max_pixels is not None else max(768 * factor**2, low)
        return VideoProcessor.from_image_processor(image_processor, min_pixels=low, max_pixels=high,
                                                   sampling=self.sampling)


def _load_frames(frames: Sequence[FrameSource], fps: float | None, limits: VideoLimits) -> Video:
    if isinstance(frames, Image.Image):
        raise TypeError("load_video takes a file path or a list of frames; wrap a single image in a list")
    if fps is not None and not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"load_video: fps must be a finite number > 0 (or None), got {fps}")
    if len(frames) == 0:
        raise DataProblem("empty_video", "the frame list is empty. Fix: give at least one frame or drop the sample.")
    _check_frames("frame list", len(frames), limits, "in the list")
    out = _Frames(len(frames), None, limits)
    for position, frame in enumerate(frames):
        out.put([position], np.asarray(_frame_image(frame, limits)))
    return Video(out.tensor(), list(range(len(frames))), fps, len(frames), None)


def _frame_image(frame: FrameSource, limits: VideoLimits) -> Image.Image:
    if isinstance(frame, Image.Image):
        return to_rgb(frame)
    if isinstance(frame, str | os.PathLike):
        return load_image(frame, **({} if limits.max_pixels_per_frame is None else
                                    {"max_pixels": limits.max_pixels_per_frame}))
    raise TypeError(f"a frame list holds image paths or PIL images, got {type(frame).__name__}")


class _Frames:
    """(H, W, 3) uint8 frames of one size written into one uint8 (F, H, W, 3) buffer as they come (no stacking)."""

    def __init__(self, count: int, name: str | None, limits: VideoLimits) -> None:
        self.count, self.name, self.limits = count, name, limits
        self.buffer: torch.Tensor | None = None

    def put(self, positions: list[int], array: np.ndarray) -> None:
        if self.buffer is None:
            height, width = array.shape[:2]
            cap = self.limits.max_pixels_per_frame
            if cap is not None and height * width > cap:
                raise _too_large(self.name or "frame list", f"{width} x {height} = {width * height} pixels per "
                                 f"frame exceeds max_pixels_per_frame = {cap}")
            self.buffer = torch.empty(self.count, height, width, 3, dtype=torch.uint8)
        if array.shape != self.buffer.shape[1:]:
            first, this = tuple(self.buffer.shape[1:3]), array.shape[:2]
            raise DataProblem("variable_frame_size", f"frame {positions[0]} is {this[1]} x {this[0]} (width x "
                              f"height) but the first frame is {first[1]} x {first[0]}. Fix: resize the frames to "
                              "one size (or re-encode the video) before use.", path=self.name)
        for position in positions:
            self.buffer[position].numpy()[...] = array  # also takes read-only arrays (np.asarray of a PIL image)

    def tensor(self) -> torch.Tensor:
        """uint8 (F, 3, H, W): a channels-last view of the buffer."""
        assert self.buffer is not None
        return self.buffer.permute(0, 3, 1, 2)


def _unreadable(name: str, what: str) -> DataProblem:
    return DataProblem("unreadable_video", f"{what}. Fix: re-encode the file (e.g. ffmpeg -i in -c:v libx264 "
                       "out.mp4) or drop the sample.", path=name)


def _too_large(name: str, what: str) -> DataProblem:
    return DataProblem("video_too_large", f"{what} (checked before decoding). Fix: cut or downscale the video, or "
                       "if it is trusted raise the cap with VideoLimits(...).", path=name)


@functools.cache
def _warn_no_fps() -> None:
    logger.warning("a video has no fps (no header rate, or a frame list without fps=): sampling and timestamps "
                   "assume %s fps, like transformers. Pass fps= for frame lists.", FALLBACK_FPS)


# ---- preprocessing ----------------------------------------------------------------------------------
@dataclass
class ProcessedVideos:
    """Processor output for V videos; per video lists of length V."""

    pixel_values_videos: torch.Tensor
    video_grid_thw: torch.Tensor
    tokens_per_frame: list[int]
    frames: list[int]
    timestamps: list[list[float]]

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def tokens_per_video(self) -> list[int]:
        return [t * n for t, n in zip(self.frames, self.tokens_per_frame, strict=True)]


def smart_resize(num_frames: int, height: int, width: int, *, temporal_factor: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen3-VL video smart_resize, with fewer than `temporal_factor` frames counted as that many."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as qwen3_smart_resize

    return qwen3_smart_resize(max(num_frames, temporal_factor), height, width, temporal_factor=temporal_factor,
                              factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def calculate_timestamps(indices: Sequence[int], fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds per temporal patch: the mean time of its first and last frame (`_calculate_timestamps`)."""
    indices = [int(i) for i in indices]
    if len(indices) % temporal_patch_size:
        indices.extend(indices[-1] for _ in range(temporal_patch_size - len(indices) % temporal_patch_size))
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def frame_text(timestamps: Sequence[float], tokens_per_frame: int, start: str, pad: str, end: str) -> str:
    """Qwen3-VL's prompt text for a video: `<{t:.1f} seconds>` + start + pad * tokens_per_frame + end per patch."""
    block = start + pad * tokens_per_frame + end
    return "".join(f"<{t:.1f} seconds>{block}" for t in timestamps)


class VideoProcessor:
    """Qwen3-VL / Qwen3.5 video preprocessing; defaults are transformers' `Qwen3VLVideoProcessor`'s."""

    def __init__(self, *, patch_size: int = 16, temporal_patch_size: int = 2, merge_size: int = 2,
                 min_pixels: int = 128 * 32 * 32, max_pixels: int = 32 * 32 * 768,
                 mean: Sequence[float] = (0.5, 0.5, 0.5), std: Sequence[float] = (0.5, 0.5, 0.5),
                 cap_pixels_per_frame: bool = False, max_video_tokens: int = 768,
                 projector_merge: int | None = None, sampling: VideoSampling | None = None) -> None:
        if min(patch_size, temporal_patch_size, merge_size, max_video_tokens) < 1:
            raise ValueError(f"patch_size, temporal_patch_size, merge_size, max_video_tokens must be >= 1, got "
                             f"{patch_size}, {temporal_patch_size}, {merge_size}, {max_video_tokens}")
        if not 1 <= min_pixels <= max_pixels:
            raise ValueError(f"need 1 <= min_pixels ({min_pixels}) <= max_pixels ({max_pixels})")
        if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
            raise ValueError(f"mean and std need 3 values each, std > 0; got mean={mean}, std={std}")
        projector_merge = merge_size if projector_merge is None else projector_merge
        if projector_merge < 1 or merge_size % projector_merge:
            raise ValueError(f"projector_merge ({projector_merge}) must divide merge_size ({merge_size})")
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.min_pixels, self.max_pixels, self.projector_merge = min_pixels, max_pixels, projector_merge
        self.cap_pixels_per_frame, self.max_video_tokens = bool(cap_pixels_per_frame), max_video_tokens
        self.mean, self.std = tuple(float(x) for x in mean), tuple(float(x) for x in std)
        self.sampling = VideoSampling() if sampling is None else sampling
        # transformers fuses rescale and normalise: (x - mean/RESCALE) / (std/RESCALE), float32
        self._shift = (torch.tensor(self.mean) * (1.0 / RESCALE)).view(1, 3, 1, 1)
        self._scale = (torch.tensor(self.std) * (1.0 / RESCALE)).view(1, 3, 1, 1)

    @classmethod
    def from_image_processor(cls, processor: Any, **kwargs: Any) -> VideoProcessor:
        """The video processor sharing a `QwenProcessor`'s patch geometry and normalisation; `kwargs` override."""
        settings = {key: getattr(processor, key) for key in
                    ("patch_size", "temporal_patch_size", "merge_size", "projector_merge", "mean", "std")}
        settings.update(kwargs)
        return cls(**settings)

    def __repr__(self) -> str:
        return (f"VideoProcessor(patch_size={self.patch_size}, temporal_patch_size={self.temporal_patch_size}, "
                f"merge_size={self.merge_size}, min_pixels={self.min_pixels}, max_pixels={self.max_pixels}, "
                f"mean={self.mean}, std={self.std}, cap_pixels_per_frame={self.cap_pixels_per_frame}, "
                f"max_video_tokens={self.max_video_tokens}, projector_merge={self.projector_merge}, "
                f"sampling={self.sampling})")

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    def load(self, source: str | os.PathLike[str] | Sequence[FrameSource], **kwargs: Any) -> Video:
        """`load_video(source, sampling=self.sampling, **kwargs)`."""
        return load_video(source, sampling=self.sampling, **kwargs)

    # ---- sizes ----
    def target_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) the frames of an F-frame video are resized to (`Qwen3VLVideoProcessor.resize`)."""
        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:  # qwen-vl-utils' per-frame cap, as transformers applies it
            frames = max(num_frames, 1)
            per_frame = max(min(self.max_video_tokens * factor * factor, self.max_pixels // frames),
                            int(self.min_pixels * 1.05))
            max_pixels = per_frame * frames
        return smart_resize(num_frames, height, width, temporal_factor=self.temporal_patch_size, factor=factor,
                            min_pixels=self.min_pixels, max_pixels=max_pixels)

    def grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of an F-frame H x W video."""
        resized_height, resized_width = self.target_size(num_frames, height, width)
        return (-(-num_frames // self.temporal_patch_size), resized_height // self.patch_size,
                resized_width // self.patch_size)

    def tokens_for(self, num_frames: int, height: int, width: int) -> int:
        """LLM tokens of a video of `num_frames` (sampled) frames of H x W, without decoding it."""
        t, h, w = self.grid(num_frames, height, width)
        return t * (h * w // self.projector_merge**2)

    def sampled_frames(self, header: VideoHeader, *, frame_list: bool = False) -> int:
        """How many frames `load` keeps of a video with this header (a frame list: all of them)."""
        return header.total_frames if frame_list else len(self.sampling.sample_indices(header.total_frames,
                                                                                        header.source_fps))

    def tokens_for_header(self, header: VideoHeader, *, frame_list: bool = False) -> tuple[int, int]:
        """(LLM tokens in all, temporal patches) of a video with this header, nothing decoded."""
        frames = self.sampled_frames(header, frame_list=frame_list)
        t, h, w = self.grid(frames, header.height, header.width)
        return t * (h * w // self.projector_merge**2), t

    def timestamps(self, video: Video) -> list[float]:
        """Seconds per temporal patch; an unknown fps counts as 24 (warned once), like transformers."""
        fps = video.source_fps
        if fps is None:
            _warn_no_fps()
            fps = FALLBACK_FPS
        return calculate_timestamps(video.indices, fps, self.temporal_patch_size)

    frame_text = staticmethod(frame_text)

    # ---- pixels ----
    def __call__(self, videos: Sequence[Video]) -> ProcessedVideos:
        if isinstance(videos, Video):
            raise TypeError("pass a list of videos, e.g. processor([video]), not a single Video")
        grids = [self.grid(len(v.frames), *v.frames.shape[-2:]) for v in videos]
        counts = [t * h * w for t, h, w in grids]
        out = torch.empty(sum(counts), self.patch_dim)  # written in place: no concatenation copy
        for video, grid, chunk in zip(videos, grids, out.split(counts), strict=True):
            self.patchify(self.resize(video.frames, grid), chunk)
        return ProcessedVideos(
            pixel_values_videos=out,
            video_grid_thw=torch.tensor(grids, dtype=torch.long).view(-1, 3),
            tokens_per_frame=[h * w // self.projector_merge**2 for _, h, w in grids],
            frames=[t for t, _, _ in grids],
            timestamps=[self.timestamps(v) for v in videos],
        )

    def resize(self, frames: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """uint8 (F, 3, H, W) -> uint8 (F, 3, h*P, w*P): transformers' antialiased bicubic torchvision resize."""
        if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[1] != 3:
            raise ValueError(f"frames must be uint8 (F, 3, H, W), got {frames.dtype} {tuple(frames.shape)}")
        size = [grid[1] * self.patch_size, grid[2] * self.patch_size]
        return tvF.resize(frames, size, interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)

    def patchify(self, frames: torch.Tensor, out: torch.Tensor) -> None:
        """uint8 (F, 3, H, W) -> `out` (t*h*w, C*T*P*P), normalised one temporal patch at a time (the last padded
        with copies of the last frame), patches in (t, h/m, w/m, m, m) order, each (C, T, P, P)."""
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        h, w = frames.shape[-2] // p, frames.shape[-1] // p
        last = len(frames) - 1
        per_patch = out.view(-1, h * w, self.patch_dim)
        buffer = torch.empty(tp, 3, frames.shape[-2], frames.shape[-1])
        for t, slot in enumerate(per_patch):
            picks = [min(t * tp + k, last) for k in range(tp)]
            buffer.copy_(frames[picks])
            buffer.sub_(self._shift).div_(self._scale)
            windows = buffer.view(tp, 3, h // m, m, p, w // m, m, p).permute(2, 5, 3, 6, 1, 0, 4, 7)
            slot.view(windows.shape).copy_(windows)


def reverse_frames(pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each video's temporal patches in reverse order, and how many videos changed.

    pixel_values_videos (sum_v t_v*h_v*w_v, F), rows of video v's temporal patch j the contiguous block
    [j*h*w, (j+1)*h*w) of its rows (the processor's order); video_grid_thw (V, 3). The result has the same shape,
    grids and token counts. A video with t == 1, or whose temporal patches are all equal, is unchanged and not
    counted.
    """
    rows = video_grid_thw.prod(-1).tolist()
    out, moved = [], 0
    for chunk, (t, h, w) in zip(pixel_values_videos.split(rows), video_grid_thw.tolist(), strict=True):
        reordered = chunk.view(t, h * w, -1).flip(0).reshape(chunk.shape)
        moved += int(t > 1 and not torch.equal(reordered, chunk))
        out.append(reordered)
    return (torch.cat(out) if out else pixel_values_videos.clone()), moved
