"""Per-encoder image preprocessing: RGB images -> pixel tensors, and how many visual tokens each image yields.

One processor per kind of encoder; `processor_for(model)` builds the one the model's encoder takes
(dynamic iff `model.encoder.dynamic`, so a fixed-size processor can never feed a dynamic encoder).
- `FixedSizeProcessor` (CLIP, SigLIP, timm): every image becomes S x S, by mode
  "pad" (LLaVA-1.5's expand2square: centred on a square of the mean colour, then resized),
  "resize" (plain resize, SigLIP) or "crop" (shortest edge to S, centre crop: CLIP's default).
  pixel_values (I, 3, S, S).
- `QwenProcessor` (Qwen ViT): smart-resize to multiples of P*m with min_pixels <= h*w <= max_pixels,
  the frame repeated T times, cut into P x P patches listed in m x m merge-window order.
  pixel_values (N, C*T*P*P), image_grid_thw (I, 3) = (1, h/P, w/P) per image. The patch geometry
  (P, T, m, the bounds, the sizes, grids, tokens and the flattening) is a `PatchGeometry`
  (`mmadapt.data.patches`), the one the video processor builds on.
Each reports `tokens_per_image`: the visual tokens the encoder + projector emit for the image (LLM side,
after any merge: t*h*w / merge^2 for Qwen's merger).

Shapes: I images, S side, N patches in all (sum of t*h*w), C = 3 channels, T temporal patch, P patch,
m spatial merge.

Parity: outputs equal transformers' torchvision-backed processors bit for bit on CPU
(Qwen2VLImageProcessor, CLIPImageProcessor, LlavaImageProcessor(do_pad=True), SiglipImageProcessor):
the same `tvF.resize` on uint8 (antialiased; bicubic by default) and the same fused normalisation
(x - 255*mean) / (255*std) in float32. It is faster (benchmarks/bench_preprocess.py) because it skips
their per-call argument handling and their uint8 HWC -> CHW copy (the resize kernel takes channels-last
data as it is; the layout changes once, in the float conversion), pads on a channels-last canvas, and
writes each image straight into the output tensor instead of stacking or concatenating afterwards.

Policy for tiny and extreme images (a valid RGB image never raises inside a processor):
- tiny (down to 1 x 1): upscaled - fixed modes resize to S; Qwen's smart-resize floor is at least one
  merge window, because `min_pixels >= (P*m)^2` is required.
- aspect ratio above `max_aspect_ratio` (default 200, smart_resize's own limit, where it raises): the
  short side is first padded, centred, with the mean colour up to that ratio (2 x 700 -> 4 x 700), in
  every mode, which also bounds "crop"'s intermediate to S x 200*S instead of growing with the ratio.
- images that are not RGB are converted with `mmadapt.data.images.to_rgb` (same policy as loading).

Memory: a pad followed by a resize (LLaVA's square pad, every mode's aspect pad) never builds the padded canvas at
full resolution (`ImageProcessor.pad_resize`, equal bit for bit): an extreme-aspect image costs about its own
pixels, not the square of its long side.

Geometry: each mode is written once, as steps (`mmadapt.data.geometry`): `plan(height, width)` lists them,
`run` applies them to the pixels and `geometry(height, width)` composes them into the map the evidence maps
read, so the pixels and the maps cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as tvF

from mmadapt.data.geometry import FIXED_MODES, Geometry, Step, aspect_limited, centre_offset
from mmadapt.data.images import to_rgb
from mmadapt.data.patches import PATCH_SHAPE, OnPatches, PatchGeometry

if TYPE_CHECKING:
    from mmadapt.model import VisionLanguageModel

RESAMPLE: Final[dict[str, tvF.InterpolationMode]] = {
    # transformers maps PIL's NEAREST to torchvision's NEAREST_EXACT; so do we.
    "nearest": tvF.InterpolationMode.NEAREST_EXACT,
    "bilinear": tvF.InterpolationMode.BILINEAR,
    "bicubic": tvF.InterpolationMode.BICUBIC,
    "lanczos": tvF.InterpolationMode.LANCZOS,
    "box": tvF.InterpolationMode.BOX,
    "hamming": tvF.InterpolationMode.HAMMING,
}
RESCALE: Final[float] = 1 / 255  # transformers' rescale_factor; kept literal so the fused constants match
PAD_CHUNK_PIXELS: Final[int] = 1 << 22  # `pad_resize`'s width pass: rows padded to the canvas width, ~4 MP at a time


@dataclass
class ProcessedImages:
    """Processor output for I images; `image_grid_thw` only for dynamic encoders."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor | None
    tokens_per_image: list[int]

    def __len__(self) -> int:
        return len(self.tokens_per_image)

    @classmethod
    def concat(cls, parts: Sequence[ProcessedImages]) -> ProcessedImages:
        """The images of `parts` (at least one), in order, as one output (each image is processed on its own, so
        this equals processing them together)."""
        grids = [p.image_grid_thw for p in parts]
        return cls(torch.cat([p.pixel_values for p in parts]),
                   None if grids[0] is None else torch.cat(grids),
                   [n for p in parts for n in p.tokens_per_image])


class ImageProcessor:
    """Base: `__call__(images) -> ProcessedImages`; `tokens_for_size(width, height)` estimates without pixels."""

    dynamic: ClassVar[bool] = False
    mode: str  # the resize mode, named in `Geometry.mode`

    def __init__(self, *, mean: Sequence[float], std: Sequence[float], resample: str, max_aspect_ratio: float) -> None:
        if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
            raise ValueError(f"mean and std need 3 values each, std > 0; got mean={mean}, std={std}")
        if resample not in RESAMPLE:
            raise ValueError(f"unknown resample {resample!r}; known: {sorted(RESAMPLE)}")
        if max_aspect_ratio < 1:
            raise ValueError(f"max_aspect_ratio must be >= 1, got {max_aspect_ratio}")
        self.mean, self.std = tuple(float(x) for x in mean), tuple(float(x) for x in std)
        self.resample, self.max_aspect_ratio = resample, float(max_aspect_ratio)
        self.fill = tuple(int(x * 255) for x in self.mean)  # LLaVA's background colour
        # transformers fuses rescale and normalise the same way: (x - mean/RESCALE) / (std/RESCALE)
        self._shift = torch.tensor(self.mean) * (1.0 / RESCALE)
        self._scale = torch.tensor(self.std) * (1.0 / RESCALE)

    def __call__(self, images: Sequence[Image.Image]) -> ProcessedImages:
        if isinstance(images, Image.Image):
            raise TypeError("pass a list of images, e.g. processor([image]), not a single PIL image")
        return self.process([as_uint8(image) for image in images])

    def process(self, pixels: list[torch.Tensor]) -> ProcessedImages:
        """`pixels`: uint8 (3, H, W) tensors of RGB images."""
        raise NotImplementedError

    def tokens_for_size(self, width: int, height: int) -> int:
        """Visual tokens an image of this size yields (for length estimates from `image_size`)."""
        raise NotImplementedError

    def resize(self, pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return tvF.resize(pixels, [height, width], interpolation=RESAMPLE[self.resample], antialias=True)

    def normalize(self, pixels: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 (3, H, W), any strides -> float32 (x - 255*mean) / (255*std), written to contiguous `out`."""
        out = torch.empty(pixels.shape, dtype=torch.float32) if out is None else out
        out.copy_(pixels)  # to planar float: the per-channel broadcasts below are fast on this layout
        return out.sub_(self._shift.view(3, 1, 1)).div_(self._scale.view(3, 1, 1))

    def limit_aspect(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pad the short side (centred, mean colour) so that long / short <= max_aspect_ratio."""
        return self.apply(self.aspect_step(*pixels.shape[-2:]), pixels)

    # ---- geometry: the steps of `mode`, run on pixels here and composed into a map for the evidence maps ----
    def aspect_step(self, height: int, width: int) -> Step:
        """Every mode's first step: the short side padded, centred, so that long / short <= max_aspect_ratio."""
        return Step("pad", aspect_limited(height, width, self.max_aspect_ratio))

    def mode_steps(self, height: int, width: int) -> list[Step]:
        """The mode's own steps for an (aspect-limited) H x W image."""
        raise NotImplementedError

    def plan(self, height: int, width: int) -> list[Step]:
        """All steps from an H x W original to the processed image."""
        first = self.aspect_step(height, width)
        return [first, *self.mode_steps(*first.size)]

    def geometry(self, height: int, width: int) -> Geometry:
        """Where an H x W original lies on the processed image (processed = scale * original + offset)."""
        return Geometry.of((height, width), self.plan(height, width), self.mode)

    def run(self, pixels: torch.Tensor, steps: Sequence[Step] | None = None) -> torch.Tensor:
        """uint8 (3, H, W) -> the processed uint8 image: `steps` (default: its `plan`) applied in order; a pad
        followed by a resize runs as one `pad_resize`, so the padded canvas is never built at full resolution."""
        steps = list(self.plan(*pixels.shape[-2:]) if steps is None else steps)
        k = 0
        while k < len(steps):
            if steps[k].op == "pad" and k + 1 < len(steps) and steps[k + 1].op == "resize":
                pixels, k = self.pad_resize(pixels, steps[k].size, steps[k + 1].size), k + 2
            else:
                pixels, k = self.apply(steps[k], pixels), k + 1
        return pixels

    def pad_resize(self, pixels: torch.Tensor, canvas: tuple[int, int], size: tuple[int, int]) -> torch.Tensor:
        """The pad to `canvas` (H, W) then the resize to `size` (h, w), equal bit for bit to the two steps, in
        memory of canvas H x w instead of H x W (LLaVA's pad of a 20000 x 100 image: 20 MB, not 1.2 GB).

        torch's antialiased uint8 resize is separable: a width pass, then a height pass, each rounded to uint8. So
        the width pass runs on the image's rows padded to the canvas width (in chunks of rows), the rows are then
        padded to the canvas height (a row of fill colour stays fill colour) and the height pass runs on that."""
        (canvas_height, canvas_width), (height, width) = canvas, size
        if canvas_width != width:
            rows = max(1, PAD_CHUNK_PIXELS // canvas_width)
            pixels = torch.cat([self.resize(pad_centred(chunk, chunk.shape[-2], canvas_width, self.fill),
                                            chunk.shape[-2], width) for chunk in pixels.split(rows, dim=-2)], dim=-2)
        else:
            pixels = pad_centred(pixels, pixels.shape[-2], canvas_width, self.fill)
        pixels = pad_centred(pixels, canvas_height, width, self.fill)
        return pixels if canvas_height == height else self.resize(pixels, height, width)

    def apply(self, step: Step, pixels: torch.Tensor) -> torch.Tensor:
        """One step on uint8 (3, H, W) pixels: the pad in the mean colour, the resize with `resample`."""
        if step.op == "pad":
            return pad_centred(pixels, *step.size, self.fill)
        if step.op == "crop":
            return centre_crop(pixels, *step.size)
        return self.resize(pixels, *step.size)


class FixedSizeProcessor(ImageProcessor):
    """Every image to `image_size` x `image_size` by `mode` ("pad", "resize" or "crop"), then normalised."""

    def __init__(self, *, image_size: int, mean: Sequence[float], std: Sequence[float], mode: str = "pad",
                 tokens_per_image: int, resample: str = "bicubic", max_aspect_ratio: float = 200.0) -> None:
        super().__init__(mean=mean, std=std, resample=resample, max_aspect_ratio=max_aspect_ratio)
        if mode not in FIXED_MODES:
            raise ValueError(f"unknown mode {mode!r}; known: {list(FIXED_MODES)}")
        if image_size < 1 or tokens_per_image < 1:
            raise ValueError(f"image_size and tokens_per_image must be >= 1, got {image_size}, {tokens_per_image}")
        self.image_size, self.mode, self.tokens_per_image = image_size, mode, tokens_per_image

    def __repr__(self) -> str:
        return (f"FixedSizeProcessor(image_size={self.image_size}, mode={self.mode!r}, mean={self.mean}, "
                f"std={self.std}, tokens_per_image={self.tokens_per_image}, resample={self.resample!r})")

    def process(self, pixels: list[torch.Tensor]) -> ProcessedImages:
        out = torch.empty(len(pixels), 3, self.image_size, self.image_size)  # filled in place: no stacking copy
        for image, slot in zip(pixels, out, strict=True):
            self.normalize(self.fit(image), out=slot)
        return ProcessedImages(out, None, [self.tokens_per_image] * len(pixels))

    def fit(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 (3, H, W) -> uint8 (3, S, S) by `mode`."""
        return self.run(pixels)

    def mode_steps(self, height: int, width: int) -> list[Step]:
        return FIXED_MODES[self.mode](height, width, self.image_size)

    def tokens_for_size(self, width: int, height: int) -> int:
        return self.tokens_per_image


class QwenProcessor(OnPatches, ImageProcessor):
    """Qwen2-VL / Qwen3-VL / Qwen3.5 image preprocessing; defaults are Qwen3.5's preprocessor_config.json.

    Its patch geometry (`patches`, a `PatchGeometry`) is the one the video processor builds on
    (`VideoProcessor.from_image_processor`); `patch_size`, ..., `max_pixels`, `patch_dim` read it.
    """

    dynamic: ClassVar[bool] = True
    mode: str = "qwen"

    def __init__(self, *, patch_size: int = 16, temporal_patch_size: int = 2, merge_size: int = 2,
                 min_pixels: int = 65536, max_pixels: int = 16777216, mean: Sequence[float] = (0.5, 0.5, 0.5),
                 std: Sequence[float] = (0.5, 0.5, 0.5), projector_merge: int | None = None,
                 resample: str = "bicubic", max_aspect_ratio: float = 200.0) -> None:
        super().__init__(mean=mean, std=std, resample=resample, max_aspect_ratio=max_aspect_ratio)
        if max_aspect_ratio > 200:
            raise ValueError(f"max_aspect_ratio={max_aspect_ratio}: Qwen's smart_resize rejects ratios above 200")
        self.patches = PatchGeometry(patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                                     merge_size=merge_size, min_pixels=min_pixels, max_pixels=max_pixels,
                                     projector_merge=projector_merge)
        if self.patches.factor**2 > min_pixels:
            raise ValueError(f"need (patch_size*merge_size)^2 = {self.patches.factor**2} <= min_pixels ({min_pixels}) "
                             f"<= max_pixels ({max_pixels}), so every image covers at least one merge window")

    def __repr__(self) -> str:
        return (f"QwenProcessor(patch_size={self.patch_size}, temporal_patch_size={self.temporal_patch_size}, "
                f"merge_size={self.merge_size}, min_pixels={self.min_pixels}, max_pixels={self.max_pixels}, "
                f"mean={self.mean}, std={self.std}, projector_merge={self.projector_merge}, "
                f"resample={self.resample!r})")

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image is resized to: aspect limited, then Qwen's smart_resize."""
        return self.plan(height, width)[-1].size

    def mode_steps(self, height: int, width: int) -> list[Step]:
        """One plain resize to smart_resize(H, W): multiples of P*m, min_pixels <= area <= max_pixels."""
        return [Step("resize", self.patches.image_size(height, width))]

    def tokens_for_size(self, width: int, height: int) -> int:
        return self.patches.tokens(self.patches.grid(1, *self.target_size(height, width)))

    def process(self, pixels: list[torch.Tensor]) -> ProcessedImages:
        if not pixels:
            return ProcessedImages(torch.zeros(0, self.patch_dim), torch.zeros(0, 3, dtype=torch.long), [])
        plans = [self.plan(*p.shape[-2:]) for p in pixels]
        grids = [self.patches.grid(1, *plan[-1].size) for plan in plans]  # (1, h, w) of the smart-resized image
        counts = [t * h * w for t, h, w in grids]
        out = torch.empty(sum(counts), self.patch_dim)  # written in place: no concatenation copy
        for image, plan, chunk in zip(pixels, plans, out.split(counts), strict=True):
            self.patchify(self.normalize(self.run(image, plan)), out=chunk)
        return ProcessedImages(out, torch.tensor(grids), [self.patches.tokens(grid) for grid in grids])

    def patchify(self, image: torch.Tensor, out: torch.Tensor) -> None:
        """float (3, H, W) -> `out` (h*w, C*T*P*P): P x P patches in merge-window order, each repeated T times."""
        self.patches.flatten(image.expand(self.temporal_patch_size, -1, -1, -1), out)


# ---- pixel helpers (uint8 (3, H, W) tensors); their sizes and offsets come from mmadapt.data.geometry ---
def as_uint8(image: Image.Image) -> torch.Tensor:
    """An RGB PIL image as a uint8 (3, H, W) tensor (a channels-last view of one copy of the pixels)."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"processors take PIL images (see mmadapt.data.load_image), got {type(image).__name__}")
    return torch.from_numpy(np.array(to_rgb(image))).permute(2, 0, 1)


def pad_centred(pixels: torch.Tensor, height: int, width: int, fill: tuple[int, ...]) -> torch.Tensor:
    """Place `pixels` centred (LLaVA's expand2square offsets) on a `fill`-coloured (3, height, width) canvas."""
    old_height, old_width = pixels.shape[-2:]
    if (old_height, old_width) == (height, width):
        return pixels
    # channels-last like `as_uint8`'s pixels: the copy below and the resize after it stay fast. One
    # (width * 3) row broadcast down the rows fills far faster than a (3,) colour broadcast per pixel.
    row = torch.tensor(fill, dtype=torch.uint8).repeat(width)
    canvas = row.expand(height, width * 3).contiguous().view(height, width, 3).permute(2, 0, 1)
    top, left = centre_offset(old_height, height), centre_offset(old_width, width)
    canvas[:, top : top + old_height, left : left + old_width] = pixels
    return canvas


def centre_crop(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The centred `height` x `width` window of `pixels` (transformers' center_crop offsets), a view."""
    top, left = centre_offset(height, pixels.shape[-2]), centre_offset(width, pixels.shape[-1])
    return pixels[:, top : top + height, left : left + width]


# ---- the processor a model takes ---------------------------------------------------------------
GEOMETRY: Final[dict[bool, tuple[str, ...]]] = {
    False: ("image_size",),
    True: PATCH_SHAPE,
}


def processor_for(model: VisionLanguageModel, **overrides: Any) -> ImageProcessor:
    """The processor for `model`'s encoder and projector; `overrides` change non-geometric settings.

    Defaults come from the encoder's `processor_defaults()`; tokens per image from
    `model.projector.output_grids`, so they always equal what `model.encode_images` emits.
    """
    encoder = model.encoder
    settings = dict(encoder.processor_defaults())
    if encoder.dynamic:
        settings["projector_merge"] = projector_merge(model)
    else:
        settings["tokens_per_image"] = int(model.projector.output_grids(torch.tensor([encoder.grid])).prod())
    for key in GEOMETRY[encoder.dynamic]:
        if key in overrides and overrides[key] != settings[key]:
            raise ValueError(
                f"processor_for: {key}={overrides[key]} conflicts with encoder {model.config.encoder.name!r}, "
                f"which needs {key}={settings[key]}. Fix: drop the override, or build the encoder with it."
            )
    settings.update(overrides)
    return QwenProcessor(**settings) if encoder.dynamic else FixedSizeProcessor(**settings)


def projector_merge(model: VisionLanguageModel) -> int:
    """How many encoder patches per side the projector merges into one token (Qwen merger: m; MLPs: 1)."""
    step = model.encoder.merge_size
    probe = torch.tensor([[1, 2 * step, 4 * step]])
    out = model.projector.output_grids(probe)[0].tolist()
    merge = probe[0, 1].item() // out[1]
    if out != [1, 2 * step // merge, 4 * step // merge] or 2 * step % merge:
        raise ValueError(
            f"projector {model.config.projector.name!r} maps token grid {probe[0].tolist()} to {out}, which is not a "
            "uniform spatial merge; QwenProcessor cannot count its tokens. Fix: give the projector an "
            "output_grids that divides height and width by one factor."
        )
    return merge
