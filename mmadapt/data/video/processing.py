"""Sampled frames -> Qwen3-VL video patches (`VideoProcessor`), equal to transformers' `Qwen3VLVideoProcessor`.

`VideoProcessor(videos)` -> `ProcessedVideos`: smart-resize with the temporal factor (optionally capping pixels per
frame like qwen-vl-utils), one antialiased bicubic `tvF.resize` of the uint8 frames, the fused normalisation
(x - 255*mean) / (255*std) in float32, the last temporal patch padded by repeating the last frame, and patches in
(t, h/m, w/m, m, m) order, each C*T*P*P. pixel_values_videos (N, C*T*P*P) float32 with N = sum of t*h*w,
video_grid_thw (V, 3) long, per video `tokens_per_frame` (h*w / projector_merge^2, the LLM tokens of one temporal
patch), `frames` (t) and `timestamps` (seconds per temporal patch, `Qwen3VLProcessor._calculate_timestamps`).
`frame_text` writes the prompt text `Qwen3VLProcessor.replace_video_token` writes; `tokens_for` counts tokens
without pixels. The patch geometry (sizes, grid, tokens, flattening) is a `PatchGeometry` (`patches`), the one the
image processor holds (`VideoProcessor.from_image_processor`).

Deviation: a video with fewer frames than T (e.g. one frame): transformers' smart_resize raises; here the frame
count is taken as T (the patch is padded to T frames anyway).

Shapes: F frames, V videos, C = 3, T temporal patch, P patch, m spatial merge.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torchvision.transforms.v2 import functional as tvF

from mmadapt.data.patches import PATCH_SHAPE, OnPatches, PatchGeometry
from mmadapt.data.processors import RESCALE
from mmadapt.data.video.decode import FrameSource, Video, VideoHeader, load_video
from mmadapt.data.video.sampling import FALLBACK_FPS, VideoSampling, warn_no_fps


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


class VideoProcessor(OnPatches):
    """Qwen3-VL / Qwen3.5 video preprocessing; defaults are transformers' `Qwen3VLVideoProcessor`'s."""

    def __init__(self, *, patch_size: int = 16, temporal_patch_size: int = 2, merge_size: int = 2,
                 min_pixels: int = 128 * 32 * 32, max_pixels: int = 32 * 32 * 768,
                 mean: Sequence[float] = (0.5, 0.5, 0.5), std: Sequence[float] = (0.5, 0.5, 0.5),
                 cap_pixels_per_frame: bool = False, max_video_tokens: int = 768,
                 projector_merge: int | None = None, sampling: VideoSampling | None = None) -> None:
        if max_video_tokens < 1:
            raise ValueError(f"max_video_tokens must be >= 1, got {max_video_tokens}")
        if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
            raise ValueError(f"mean and std need 3 values each, std > 0; got mean={mean}, std={std}")
        self.patches = PatchGeometry(patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                                     merge_size=merge_size, min_pixels=min_pixels, max_pixels=max_pixels,
                                     projector_merge=projector_merge)
        self.cap_pixels_per_frame, self.max_video_tokens = bool(cap_pixels_per_frame), max_video_tokens
        self.mean, self.std = tuple(float(x) for x in mean), tuple(float(x) for x in std)
        self.sampling = VideoSampling() if sampling is None else sampling
        # transformers fuses rescale and normalise: (x - mean/RESCALE) / (std/RESCALE), float32
        self._shift = (torch.tensor(self.mean) * (1.0 / RESCALE)).view(1, 3, 1, 1)
        self._scale = (torch.tensor(self.std) * (1.0 / RESCALE)).view(1, 3, 1, 1)

    @classmethod
    def from_image_processor(cls, processor: Any, **kwargs: Any) -> VideoProcessor:
        """The video processor on a `QwenProcessor`'s patch geometry (P, T, m, pm; the pixel bounds are the video's
        own, over all its frames) and normalisation; `kwargs` override."""
        settings = {key: getattr(processor.patches, key) for key in PATCH_SHAPE}
        settings.update(mean=processor.mean, std=processor.std, **kwargs)
        return cls(**settings)

    def __repr__(self) -> str:
        return (f"VideoProcessor(patch_size={self.patch_size}, temporal_patch_size={self.temporal_patch_size}, "
                f"merge_size={self.merge_size}, min_pixels={self.min_pixels}, max_pixels={self.max_pixels}, "
                f"mean={self.mean}, std={self.std}, cap_pixels_per_frame={self.cap_pixels_per_frame}, "
                f"max_video_tokens={self.max_video_tokens}, projector_merge={self.projector_merge}, "
                f"sampling={self.sampling})")

    def load(self, source: str | os.PathLike[str] | Sequence[FrameSource], **kwargs: Any) -> Video:
        """`load_video(source, sampling=self.sampling, **kwargs)`."""
        return load_video(source, sampling=self.sampling, **kwargs)

    # ---- sizes ----
    def target_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) the frames of an F-frame video are resized to (`Qwen3VLVideoProcessor.resize`)."""
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:  # qwen-vl-utils' per-frame cap, as transformers applies it
            factor, frames = self.patches.factor, max(num_frames, 1)
            per_frame = max(min(self.max_video_tokens * factor * factor, self.max_pixels // frames),
                            int(self.min_pixels * 1.05))
            max_pixels = per_frame * frames
        return self.patches.video_size(num_frames, height, width, max_pixels=max_pixels)

    def grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of an F-frame H x W video."""
        return self.patches.grid(num_frames, *self.target_size(num_frames, height, width))

    def tokens_for(self, num_frames: int, height: int, width: int) -> int:
        """LLM tokens of a video of `num_frames` (sampled) frames of H x W, without decoding it."""
        return self.patches.tokens(self.grid(num_frames, height, width))

    def sampled_frames(self, header: VideoHeader, *, frame_list: bool = False) -> int:
        """How many frames `load` keeps of a video with this header (a frame list: all of them)."""
        return header.total_frames if frame_list else len(self.sampling.sample_indices(header.total_frames,
                                                                                        header.source_fps))

    def tokens_for_header(self, header: VideoHeader, *, frame_list: bool = False) -> tuple[int, int]:
        """(LLM tokens in all, temporal patches) of a video with this header, nothing decoded."""
        grid = self.grid(self.sampled_frames(header, frame_list=frame_list), header.height, header.width)
        return self.patches.tokens(grid), grid[0]

    def timestamps(self, video: Video) -> list[float]:
        """Seconds per temporal patch; an unknown fps counts as 24 (warned once), like transformers."""
        return self._timestamps(video.indices, video.source_fps)

    def _timestamps(self, indices: Sequence[int], fps: float | None) -> list[float]:
        if fps is None:
            warn_no_fps()
            fps = FALLBACK_FPS
        return calculate_timestamps(indices, fps, self.temporal_patch_size)

    def expected(self, headers: Sequence[VideoHeader], frame_lists: Sequence[bool]) -> ProcessedVideos:
        """What `__call__` returns for videos with these headers (`frame_lists[v]`: video v is a frame list, all its
        frames kept), pixels aside (`pixel_values_videos` has no rows): grids, tokens and timestamps, to render and
        measure a sample before anything is decoded."""
        indices = [list(range(h.total_frames)) if listed else self.sampling.sample_indices(
                   h.total_frames, h.source_fps).tolist() for h, listed in zip(headers, frame_lists, strict=True)]
        grids = [self.grid(len(kept), h.height, h.width) for kept, h in zip(indices, headers, strict=True)]
        return ProcessedVideos(
            pixel_values_videos=torch.empty(0, self.patch_dim),
            video_grid_thw=torch.tensor(grids, dtype=torch.long).view(-1, 3),
            tokens_per_frame=[self.patches.tokens((1, h, w)) for _, h, w in grids],
            frames=[t for t, _, _ in grids],
            timestamps=[self._timestamps(kept, h.source_fps) for kept, h in zip(indices, headers, strict=True)],
        )

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
            tokens_per_frame=[self.patches.tokens((1, h, w)) for _, h, w in grids],
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
        tp, last = self.temporal_patch_size, len(frames) - 1
        rows = frames.shape[-2] * frames.shape[-1] // self.patch_size**2  # h*w patches per temporal patch
        buffer = torch.empty(tp, 3, frames.shape[-2], frames.shape[-1])
        for t, slot in enumerate(out.view(-1, rows, self.patch_dim)):
            buffer.copy_(frames[[min(t * tp + k, last) for k in range(tp)]])
            self.patches.flatten(buffer.sub_(self._shift).div_(self._scale), slot)


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
