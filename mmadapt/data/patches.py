"""Qwen's patch geometry, held once by the image processor (`QwenProcessor`) and the video processor (`VideoProcessor`).

A Qwen ViT sees pixels as patches of T frames x P x P pixels. The pixels are smart-resized to multiples of P*m
within [min_pixels, max_pixels] (an image: its h*w; a video: t*h*w over its frames), cut into patches listed in
m x m merge-window order, and each patch is flattened as (C, T, P, P). An image is one temporal patch (its frame
repeated T times); a video of F frames is ceil(F / T) of them (the last padded with copies of the last frame,
by the video processor). The projector merges pm x pm patches of a temporal patch into one LLM token (the Qwen
merger: pm = m; an MLP: pm = 1).

`PatchGeometry` holds P, T, m, pm and the resize bounds, and does the arithmetic (resized sizes, the patch grid,
tokens) and the flattening; a processor holds one as `patches` and reads its fields as its own (`OnPatches`).
The resized sizes are transformers' own smart_resize functions, so the grids equal transformers' processors'.

Shapes: C = 3 channels, T temporal patch, P patch, m spatial merge, pm projector merge; H x W resized pixels
(multiples of P*m), (t, h, w) the patch grid with h = H / P, w = W / P.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import torch

PATCH_SHAPE: Final[tuple[str, ...]] = ("patch_size", "temporal_patch_size", "merge_size", "projector_merge")
"""The fields the encoder and the projector fix (the pixel bounds are settings)."""


@dataclass(frozen=True, kw_only=True)
class PatchGeometry:
    """Patch size P, temporal patch T, spatial merge m, projector merge pm (None: m) and the smart-resize bounds."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int
    max_pixels: int
    projector_merge: int | None = None  # None: merge_size (set in __post_init__; always an int after it)

    def __post_init__(self) -> None:
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise ValueError(f"patch_size, temporal_patch_size, merge_size must be >= 1, got "
                             f"{self.patch_size}, {self.temporal_patch_size}, {self.merge_size}")
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 1 <= min_pixels ({self.min_pixels}) <= max_pixels ({self.max_pixels})")
        if self.projector_merge is None:
            object.__setattr__(self, "projector_merge", self.merge_size)
        if self.projector_merge < 1 or self.merge_size % self.projector_merge:
            raise ValueError(f"projector_merge ({self.projector_merge}) must divide merge_size ({self.merge_size})")

    @property
    def factor(self) -> int:
        """P*m: resized sides are multiples of it (one merge window)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """C*T*P*P: the values of one flattened patch."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    # ---- sizes ----
    def image_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an H x W image is resized to: transformers' Qwen2-VL smart_resize (raises above an
        aspect ratio of 200)."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        return smart_resize(height, width, factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def video_size(self, frames: int, height: int, width: int, *, max_pixels: int | None = None) -> tuple[int, int]:
        """(height, width) the frames of an F-frame H x W video are resized to: transformers' Qwen3-VL video
        smart_resize over t*h*w (`max_pixels` replaces the upper bound), with fewer than T frames counted as T
        (where transformers raises; the temporal patch is padded to T frames anyway)."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        return smart_resize(max(frames, self.temporal_patch_size), height, width,
                            temporal_factor=self.temporal_patch_size, factor=self.factor, min_pixels=self.min_pixels,
                            max_pixels=self.max_pixels if max_pixels is None else max_pixels)

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of F frames of a resized H x W: t = ceil(F / T) (an image: F = 1, t = 1)."""
        return -(-frames // self.temporal_patch_size), height // self.patch_size, width // self.patch_size

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """LLM tokens of a (t, h, w) patch grid: t * (h*w / pm^2)."""
        t, h, w = grid
        return t * (h * w // self.projector_merge**2)

    # ---- pixels ----
    def flatten(self, frames: torch.Tensor, out: torch.Tensor) -> None:
        """float (T, C, H, W), one temporal patch (any strides: an image expanded T times is fine) -> `out`
        (h*w, C*T*P*P): its P x P patches in merge-window order (h/m, w/m, m, m), each (C, T, P, P)."""
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        h, w = frames.shape[-2] // p, frames.shape[-1] // p
        windows = frames.view(tp, 3, h // m, m, p, w // m, m, p).permute(2, 5, 3, 6, 1, 0, 4, 7)  # hb wb m m C T P P
        out.view(windows.shape).copy_(windows)


class PatchField:
    """A read-only attribute of a processor that is the same-named attribute of its `patches` (`OnPatches`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, processor: Any, owner: type | None = None) -> Any:
        return self if processor is None else getattr(processor.patches, self.name)


class OnPatches:
    """Mixin: a processor holding a `PatchGeometry` as `patches` reads its fields as its own (`processor.patch_size`,
    ...), so the geometry is stated once."""

    patches: PatchGeometry
    patch_size = PatchField()
    temporal_patch_size = PatchField()
    merge_size = PatchField()
    projector_merge = PatchField()
    min_pixels = PatchField()
    max_pixels = PatchField()
    patch_dim = PatchField()
