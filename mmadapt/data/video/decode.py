"""Video files and frame lists -> sampled uint8 frames (`load_video`), or their header alone (`probe_video`).

- `load_video(source, sampling=, limits=)` -> `Video`: a file decoded with PyAV (transformers' `read_video_pyav`:
  frame count from the stream header, fps = the stream's average rate, frames converted with
  `to_ndarray(format="rgb24")`), decoding only up to the last sampled frame and writing only the sampled ones
  into one preallocated buffer (peak memory: the sampled frames plus one decoded frame).
  Or a list of frames (paths or PIL images): these are taken as already sampled - every frame is used,
  `indices = range(F)`, and the fps is the `fps=` argument (None: timestamps fall back to 24 fps). transformers
  does the same for a frame list with `do_sample_frames=False` (its default metadata: `frames_indices = range(F)`,
  fps None -> 24 in the prompt); with `do_sample_frames=True` it would instead resample the list as a 24 fps video.
  `Video.frames` is uint8 (F, 3, H, W) (a channels-last view; the resize kernel takes it as it is).
- `probe_video(source, limits=)` -> `VideoHeader`: frame count, fps and frame size, nothing decoded (token counts
  before loading).

A video embedded in a dataset (a Parquet cell's bytes: the `datasets` `Video` feature) is an `EmbeddedVideo(data,
name)`: both functions take it where they take a file, and PyAV opens its bytes from memory through the same code
path (header read and checked against the limits before any frame is decoded, then the same sampling and decoding),
so an embedded video gives the frames of the same file on disk; `name` (the dataset file, row and column) is the
`path` its problems name. A corrupt blob is `unreadable_video`, like a corrupt file.

`VideoLimits` are checked from the header before any frame is decoded: the stream's frames (a frame list's length,
before any frame is opened), pixels per frame, seconds, and the bytes the kept frames take (frames x H x W x 3).
An allocation that fails anyway is an `out_of_memory` problem.

Deviations from transformers, only where it fails or is inconsistent:
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

Shapes: F frames, H x W frame size.
"""

from __future__ import annotations

import io
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

from mmadapt.data.images import image_size, load_image, to_rgb
from mmadapt.data.problems import DataProblem
from mmadapt.data.video.limits import VideoLimits
from mmadapt.data.video.sampling import VideoSampling

# What PyAV / FFmpeg raise for malformed files (FFmpegError subclasses also derive from ValueError / OSError).
AV_ERRORS: Final[tuple[type[BaseException], ...]] = (av.FFmpegError, OSError, ValueError, EOFError, IndexError,
                                                     KeyError, RuntimeError, struct.error, ZeroDivisionError)
FrameSource = str | os.PathLike[str] | Image.Image


@dataclass(frozen=True)
class EmbeddedVideo:
    """A video file's bytes as a dataset holds them; `name` says where (file, row, column) for its problems."""

    data: bytes
    name: str

    def __repr__(self) -> str:
        return f"EmbeddedVideo({self.name!r}, {len(self.data)} bytes)"


FileSource = str | os.PathLike[str] | EmbeddedVideo
"""A video container: a file, or its bytes embedded in a dataset."""


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


def load_video(source: FileSource | Sequence[FrameSource], *, sampling: VideoSampling | None = None,
               limits: VideoLimits | None = None, fps: float | None = None, sample_id: str | None = None) -> Video:
    """A video file or embedded video (sampled by `sampling`) or a list of frames (all used, at `fps`) as a `Video`.

    Raises `DataProblem` (attributed to `sample_id`) for a bad file; see the module docstring.
    """
    sampling = VideoSampling() if sampling is None else sampling
    limits = VideoLimits() if limits is None else limits
    try:
        if isinstance(source, str | os.PathLike | EmbeddedVideo):
            if fps is not None:
                raise ValueError("load_video: fps= is for frame lists; a file's fps comes from its header")
            return _load_file(source, sampling, limits)
        return _load_frames(source, fps, limits)
    except MemoryError as e:
        problem = _out_of_memory(_name(source) if isinstance(source, str | os.PathLike | EmbeddedVideo) else None, e)
        raise problem if sample_id is None else problem.for_sample(sample_id) from e
    except DataProblem as problem:
        if sample_id is None:
            raise
        raise problem.for_sample(sample_id) from problem


def _load_file(source: FileSource, sampling: VideoSampling, limits: VideoLimits) -> Video:
    name = _name(source)
    with _open(source) as container:
        if not container.streams.video:
            raise _unreadable(name, "the container has no video stream")
        stream = container.streams.video[0]
        try:
            total, source_fps = _header(container, stream, name, limits)
            if total == 0:
                raise DataProblem("empty_video", "the video stream has no frames. Fix: re-encode or drop the file.",
                                  path=name)
            indices = sampling.sample_indices(total, source_fps)
            check_bytes(name, len(indices), int(stream.height or 0), int(stream.width or 0), limits)
            frames = _decode(container, stream, indices, total, name, limits)
        except DataProblem:
            raise
        except AV_ERRORS as e:
            raise _unreadable(name, f"decoding failed: {type(e).__name__}: {e}") from e
    return Video(frames, indices.tolist(), source_fps, total, name)


def _name(source: FileSource) -> str:
    return source.name if isinstance(source, EmbeddedVideo) else os.fspath(source)


def _open(source: FileSource) -> Any:
    """The PyAV container of a file or of embedded bytes (read from memory: the same demuxers and decoders, the
    same checks after), every failure to open it a `DataProblem`."""
    name = _name(source)
    if not isinstance(source, EmbeddedVideo):
        if os.path.isdir(name):
            raise DataProblem("unreadable_video", "it is a directory, not a video file. Fix: point to the file.",
                              path=name)
        if not os.path.isfile(name):
            raise DataProblem("missing_video", "no such file. Fix: correct the path or the video root, or drop the "
                              "sample.", path=name)
    embedded = isinstance(source, EmbeddedVideo)
    try:
        return av.open(io.BytesIO(source.data) if embedded else name)
    except AV_ERRORS as e:
        why = getattr(e, "strerror", None) if embedded else None  # PyAV's message names the file, '<none>' here
        raise _unreadable(name, f"not a readable video container: {type(e).__name__}: {why or e}") from e


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


def check_bytes(name: FileSource, frames: int, height: int, width: int, limits: VideoLimits) -> None:
    """`video_too_large` when `frames` frames of H x W RGB exceed `limits.max_bytes_decoded`, before decoding (`name`:
    the video's path, or the video itself)."""
    name = _name(name)
    if limits.max_bytes_decoded is not None and frames * height * width * 3 > limits.max_bytes_decoded:
        raise _too_large(name, f"{frames} frames of {width} x {height} are {frames * height * width * 3} bytes "
                         f"decoded, more than max_bytes_decoded = {limits.max_bytes_decoded}")


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
    except DataProblem:
        raise
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


def probe_video(source: FileSource | Sequence[FrameSource], *, limits: VideoLimits | None = None,
                fps: float | None = None, sample_id: str | None = None) -> VideoHeader:
    """A video file's (an embedded video's, a frame list's) `VideoHeader` with the limits checked, decoding no frame
    (a frame list's size comes from its first frame's image header): for token counts before loading (lengths,
    `mmadapt plan`)."""
    limits = VideoLimits() if limits is None else limits
    try:
        if not isinstance(source, str | os.PathLike | EmbeddedVideo):
            if len(source) == 0:
                raise DataProblem("empty_video", "the frame list is empty. Fix: give at least one frame.")
            _check_frames("frame list", len(source), limits, "in the list")
            first = source[0]
            width, height = first.size if isinstance(first, Image.Image) else image_size(first)
            return VideoHeader(len(source), fps, height, width)
        name = _name(source)
        try:
            with _open(source) as container:
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


def _load_frames(frames: Sequence[FrameSource], fps: float | None, limits: VideoLimits) -> Video:
    if isinstance(frames, Image.Image):
        raise TypeError("load_video takes a file path or a list of frames; wrap a single image in a list")
    if fps is not None and not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"load_video: fps must be a finite number > 0 (or None), got {fps}")
    if len(frames) == 0:
        raise DataProblem("empty_video", "the frame list is empty. Fix: give at least one frame or drop the sample.")
    _check_frames("frame list", len(frames), limits, "in the list")
    first = frames[0]
    if isinstance(first, str | os.PathLike):
        width, height = image_size(first, **_pixel_cap(limits))
    else:
        width, height = first.size if isinstance(first, Image.Image) else (0, 0)
    check_bytes("frame list", len(frames), height, width, limits)
    out = _Frames(len(frames), None, limits)
    for position, frame in enumerate(frames):
        out.put([position], np.asarray(_frame_image(frame, limits)))
    return Video(out.tensor(), list(range(len(frames))), fps, len(frames), None)


def _frame_image(frame: FrameSource, limits: VideoLimits) -> Image.Image:
    if isinstance(frame, Image.Image):
        return to_rgb(frame)
    if isinstance(frame, str | os.PathLike):
        return load_image(frame, **_pixel_cap(limits))
    raise TypeError(f"a frame list holds image paths or PIL images, got {type(frame).__name__}")


def _pixel_cap(limits: VideoLimits) -> dict[str, int]:
    return {} if limits.max_pixels_per_frame is None else {"max_pixels": limits.max_pixels_per_frame}


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
            check_bytes(self.name or "frame list", self.count, height, width, self.limits)
            try:
                self.buffer = torch.empty(self.count, height, width, 3, dtype=torch.uint8)
            except (RuntimeError, MemoryError) as e:  # torch reports a failed allocation as a RuntimeError
                raise _out_of_memory(self.name, e) from e
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


def _out_of_memory(name: str | None, error: BaseException) -> DataProblem:
    return DataProblem("out_of_memory", f"decoding the frames could not allocate memory ({type(error).__name__}: "
                       f"{error}). Fix: lower data.video's max_bytes_decoded, data.max_video_bytes or "
                       "data.num_workers, or drop the sample.", path=name)


def _too_large(name: str, what: str) -> DataProblem:
    return DataProblem("video_too_large", f"{what} (checked before decoding). Fix: cut or downscale the video, or "
                       "if it is trusted raise the cap with VideoLimits(...).", path=name)
