"""Preprocessing geometry: the steps that turn an original image into the processed one, and the map they make.

Every resize mode is written ONCE, as a list of `Step`s (a centred pad, a resize or a centre crop, each naming
the size it produces). The image processors run those steps on the pixels (`ImageProcessor.plan` / `run` in
`mmadapt.data.processors`) and the evidence maps compose them into one affine map per axis (`Geometry`,
processed = scale * original + offset), so a new mode is one new entry in `FIXED_MODES` (or one processor's
`mode_steps`) and the pixels and the maps cannot disagree.

- "pad" (LLaVA-1.5's expand2square): centred on a square of the long side, then resized to S x S.
- "resize" (SigLIP): a plain stretch to S x S.
- "crop" (CLIP): the short side resized to S (the long side scaled and truncated, transformers' rule), then the
  centre S x S is kept; the sides beyond it are never seen (`Geometry.seen_box`).
- Qwen's smart resize is a single resize step (`QwenProcessor.mode_steps`).
Every mode is preceded by the aspect limit: the short side padded, centred, to long / max_aspect_ratio.

Coordinates are continuous (pixel i covers [i, i + 1)) and pairs are (y, x) = (height, width), except `Box`,
which is (x0, y0, x1, y1). Pure arithmetic: the pixel operations live in `mmadapt.data.processors`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

Box = tuple[float, float, float, float]  # (x0, y0, x1, y1) in original pixel coordinates
STEP_OPS: Final[tuple[str, ...]] = ("pad", "resize", "crop")


# ---- sizes and offsets -------------------------------------------------------------------------------------
def aspect_limited(height: int, width: int, max_ratio: float) -> tuple[int, int]:
    """(height, width) with the short side grown so that long / short <= max_ratio."""
    short = math.ceil(max(height, width) / max_ratio)
    return (max(height, short), width) if height < width else (height, max(width, short))


def shortest_edge_size(height: int, width: int, side: int) -> tuple[int, int]:
    """CLIP's resize target: the short side to `side`, the long side scaled and truncated (transformers' rule)."""
    if height <= width:
        return side, int(side * width / height)
    return int(side * height / width), side


def centre_offset(inner: int, outer: int) -> int:
    """Where a centred `inner` span starts inside an `outer` one (outer >= inner). LLaVA's expand2square and
    transformers' center_crop agree on it: (outer - inner) // 2 == int((outer - inner) / 2.0)."""
    return (outer - inner) // 2


# ---- steps and modes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One geometric step of a processor: `op` turns an image into one of `size` (height, width).

    "pad": the image centred on a larger canvas (`centre_offset`); "resize": stretched to `size`;
    "crop": its centre `size` kept.
    """

    op: str
    size: tuple[int, int]

    def __post_init__(self) -> None:
        if self.op not in STEP_OPS:
            raise ValueError(f"unknown step {self.op!r}; known: {list(STEP_OPS)}")

    def scale(self, before: tuple[int, int]) -> tuple[float, float]:
        """Per axis, how much this step stretches an image of size `before`."""
        if self.op == "resize":
            return self.size[0] / before[0], self.size[1] / before[1]
        return 1.0, 1.0

    def shift(self, before: tuple[int, int]) -> tuple[int, int]:
        """Per axis, where the input's top-left corner lands on the output (>= 0 for a pad, <= 0 for a crop)."""
        if self.op == "pad":
            return centre_offset(before[0], self.size[0]), centre_offset(before[1], self.size[1])
        if self.op == "crop":
            return -centre_offset(self.size[0], before[0]), -centre_offset(self.size[1], before[1])
        return 0, 0


def square_pad_steps(height: int, width: int, side: int) -> list[Step]:
    """"pad" (LLaVA-1.5's expand2square): centred on a square of the long side, then resized to side x side."""
    longest = max(height, width)
    return [Step("pad", (longest, longest)), Step("resize", (side, side))]


def stretch_steps(height: int, width: int, side: int) -> list[Step]:
    """"resize" (SigLIP): a plain stretch to side x side."""
    return [Step("resize", (side, side))]


def centre_crop_steps(height: int, width: int, side: int) -> list[Step]:
    """"crop" (CLIP's default): the short side resized to `side`, then the centre side x side kept."""
    return [Step("resize", shortest_edge_size(height, width, side)), Step("crop", (side, side))]


# The fixed-size modes: (height, width, side) of the aspect-limited image -> its steps to side x side.
FIXED_MODES: Final[dict[str, Callable[[int, int, int], list[Step]]]] = {
    "pad": square_pad_steps,
    "resize": stretch_steps,
    "crop": centre_crop_steps,
}


# ---- the composed map: the processed image the encoder saw <-> the original image ---------------------------
@dataclass(frozen=True)
class Geometry:
    """Where an original H x W image lies on the processed H' x W' image: processed = scale * original + offset.

    All tuples are (y, x); coordinates are continuous (pixel i covers [i, i + 1)). `mode` names the processor
    mode ("pad", "resize", "crop", "qwen"). Built from a processor's steps by `Geometry.of`.
    """

    original: tuple[int, int]
    processed: tuple[int, int]
    scale: tuple[float, float]
    offset: tuple[float, float]
    mode: str

    @classmethod
    def of(cls, original: tuple[int, int], steps: Sequence[Step], mode: str) -> Geometry:
        """The steps, applied in order to an `original`-sized image, composed into one map."""
        size, scale, offset = original, (1.0, 1.0), (0.0, 0.0)
        for step in steps:
            stretch, shift = step.scale(size), step.shift(size)
            scale = (scale[0] * stretch[0], scale[1] * stretch[1])
            offset = (offset[0] * stretch[0] + shift[0], offset[1] * stretch[1] + shift[1])
            size = step.size
        return cls(tuple(original), tuple(size), scale, offset, mode)

    def to_original(self, y: float, x: float) -> tuple[float, float]:
        """A processed-image point in original-image coordinates (may lie outside the original)."""
        return (y - self.offset[0]) / self.scale[0], (x - self.offset[1]) / self.scale[1]

    def seen_box(self) -> Box:
        """The rectangle of the original image that lies inside the processed frame (all of it unless cropped)."""
        y0, x0 = self.to_original(0.0, 0.0)
        y1, x1 = self.to_original(*map(float, self.processed))
        height, width = self.original
        return max(x0, 0.0), max(y0, 0.0), min(x1, float(width)), min(y1, float(height))

    def cell_box(self, row: int, col: int, grid: tuple[int, int], *, clip: bool = True) -> Box:
        """Token cell (row, col) of an (h, w) grid as a rectangle of the original image (clipped to it)."""
        cell_h, cell_w = self.processed[0] / grid[0], self.processed[1] / grid[1]
        y0, x0 = self.to_original(row * cell_h, col * cell_w)
        y1, x1 = self.to_original((row + 1) * cell_h, (col + 1) * cell_w)
        if not clip:
            return x0, y0, x1, y1
        height, width = self.original
        return (min(max(x0, 0.0), width), min(max(y0, 0.0), height),
                min(max(x1, 0.0), width), min(max(y1, 0.0), height))

    def coverage(self, grid: tuple[int, int]) -> np.ndarray:
        """(h, w): the fraction of each token cell that shows the original image (the rest is padding)."""
        fractions = []
        for axis in (0, 1):
            cells, extent = grid[axis], self.processed[axis]
            size = extent / cells
            lo = max(self.offset[axis], 0.0)
            hi = min(self.scale[axis] * self.original[axis] + self.offset[axis], float(extent))
            starts = np.arange(cells) * size
            fractions.append(np.clip(np.minimum(starts + size, hi) - np.maximum(starts, lo), 0.0, None) / size)
        return np.outer(*fractions)

    def cell_index(self, grid: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """Token row (H,) and column (W,) of every original pixel's centre; -1 where the model did not see it."""
        out = []
        for axis in (0, 1):
            centres = self.scale[axis] * (np.arange(self.original[axis]) + 0.5) + self.offset[axis]
            index = np.floor(centres * grid[axis] / self.processed[axis]).astype(np.int64)
            out.append(np.where((centres >= 0) & (centres < self.processed[axis]), index, -1))
        return out[0], out[1]

    def pixel_map(self, cells: np.ndarray) -> np.ndarray:
        """Per-cell shares (h, w) -> float32 (H, W) over the original: uniform inside each cell's visible part,
        0 where unseen, renormalised to sum to 1 over the seen pixels (all zeros when none has mass)."""
        rows, cols = self.cell_index(cells.shape)
        heat = cells[np.ix_(rows.clip(0), cols.clip(0))].astype(np.float64)
        heat *= np.outer(rows >= 0, cols >= 0)
        total = heat.sum()
        return (heat / total if total > 0 else heat).astype(np.float32)
