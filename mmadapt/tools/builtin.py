"""The built-in tools, `crop` and `zoom`: a region of one of the trajectory's images, returned as a new image.

Both take `box` = [x0, y0, x1, y1] in pixel coordinates of trajectory image `image` (0: the prompt's first image, then
the images tools returned, in order; negative indexes count from the end, -1 the latest). The box's numbers are rounded
to whole pixels and clipped to the image; a box empty after clipping, or an image index out of range, is refused
(`ToolArgumentError`, the call's problem "bad_arguments", its message what the policy reads after the tool's name)
with the image's size in the message.

- `crop` returns the region at its own pixels: scaled down to fit when it has more than `context.max_pixels`, scaled up
  to `context.min_pixels` when it has fewer (as the processor would), the aspect kept.
- `zoom` returns the region scaled (up, usually) to as many pixels as `context.max_pixels` allows, the aspect kept:
  the region at the resolution the processor allows, so a detail too small to read in the first view becomes legible.

Both resize with PIL's BICUBIC, each side at least 1 px, and say in a short text what they did and the new image's
index (the box there in pixels, after rounding and clipping). Results are deterministic.

Their one option, `coordinates`: "pixels" (the default, as above) or "relative": each axis from 0 to 1000 whatever the
image's size (Qwen3-VL's grounding convention), scaled to the image's pixels before rounding. `TOOLS` is their registry
by exact name: each entry a frozen dataclass whose fields are its options, as `mmadapt.train.rewards.REWARDS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from PIL import Image

from mmadapt.registry import Registry
from mmadapt.tools.base import Tool, ToolArgumentError, ToolContext, ToolResult, finite_number

RESAMPLE = Image.Resampling.BICUBIC

WHICH_IMAGE = ("which image of the conversation: 0 is its first image, 1 the next one, and so on (images returned by "
               "tools count too, in the order they arrived); -1 is the latest image")
CORNERS = ("(x0, y0) its top-left corner and (x1, y1) its bottom-right corner, x counted rightwards and y downwards "
           "from the image's top-left corner")
BOX = {  # the box's description, per `coordinates` option
    "pixels": f"the region as [x0, y0, x1, y1] in pixel coordinates of that image: {CORNERS} (0, 0); parts outside the "
              "image are clipped to it",
    "relative": f"the region as [x0, y0, x1, y1] in relative coordinates of that image, from 0 to 1000 on each axis "
                f"whatever its size: {CORNERS} (0, 0), (1000, 1000) its bottom-right corner; parts outside are clipped",
}
RELATIVE = 1000  # Qwen3-VL's grounding convention: each axis 0..1000


def region_parameters(coordinates: str) -> dict:
    """The JSON schema both built-ins take: a box (described in `coordinates`) and an image index."""
    return {
        "type": "object",
        "properties": {
            "box": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                    "description": BOX[coordinates]},
            "image": {"type": "integer", "description": WHICH_IMAGE, "default": 0},
        },
        "required": ["box"],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class Region:
    """A call's region: the image's index in the trajectory (from the start), its size and the box in its pixels."""

    index: int
    width: int
    height: int
    box: tuple[int, int, int, int]
    image: Image.Image

    @property
    def size(self) -> tuple[int, int]:
        return self.box[2] - self.box[0], self.box[3] - self.box[1]

    def cropped(self) -> Image.Image:
        image = self.image if self.image.mode == "RGB" else self.image.convert("RGB")
        return image.crop(self.box)


def region(context: ToolContext, arguments: dict, relative: bool = False) -> Region:
    """The region `arguments` name (`box`, `image`), checked against the trajectory's images; `relative`: the box is
    in thousandths of the image's sides."""
    count = len(context.images)
    index = arguments.get("image", 0)
    if count == 0:
        raise ToolArgumentError("this conversation has no image to look at")
    if isinstance(index, bool) or not isinstance(index, int) or not -count <= index < count:
        raise ToolArgumentError(f"image must be an image index from {-count} to {count - 1} (this "
                                f"conversation has {count} image{'s' * (count > 1)}), got {index!r}")
    index %= count
    image = context.images[index]
    width, height = image.size
    box = arguments.get("box")
    if not isinstance(box, list | tuple) or len(box) != 4 or not all(map(finite_number, box)):
        raise ToolArgumentError(f"box must be 4 numbers [x0, y0, x1, y1], got {box!r}")
    if relative:
        box = [v * side / RELATIVE for v, side in zip(box, (width, height, width, height), strict=True)]
    x0, y0, x1, y1 = (round(v) for v in box)
    x0, x1 = min(max(x0, 0), width), min(max(x1, 0), width)
    y0, y1 = min(max(y0, 0), height), min(max(y1, 0), height)
    if x1 <= x0 or y1 <= y0:
        span = f"x and y from 0 to {RELATIVE}" if relative else f"x from 0 to {width}, y from 0 to {height}"
        raise ToolArgumentError(f"box {arguments['box']} holds no pixel of image {index}, which is {width}x{height} "
                                f"pixels ({span}; x0 < x1 and y0 < y1)")
    return Region(index, width, height, (x0, y0, x1, y1), image)


def fit_within(width: int, height: int, pixels: int) -> tuple[int, int]:
    """The largest size with the aspect of `width` x `height` (to a pixel) and at most `pixels` pixels, each side
    at least 1: the scale sqrt(pixels / area), floored per side (so it may hold up to width + height fewer)."""
    scale = math.sqrt(pixels / (width * height))
    # the epsilon keeps an exact fit (scale 1.0 computed as 0.9999999) from losing a row; the caps undo an overshoot
    new_width = max(1, min(math.floor(width * scale + 1e-6), pixels))
    new_height = max(1, min(math.floor(height * scale + 1e-6), pixels // new_width))
    return max(1, min(new_width, pixels // new_height)), new_height


def fit_over(width: int, height: int, pixels: int, limit: int) -> tuple[int, int]:
    """The smallest size with the aspect of `width` x `height` (to a pixel) and at least `pixels` pixels, unless
    that exceeds `limit` pixels (then `fit_within(limit)`)."""
    scale = math.sqrt(pixels / (width * height))
    size = (math.ceil(width * scale - 1e-6), math.ceil(height * scale - 1e-6))
    return size if size[0] * size[1] <= limit else fit_within(width, height, limit)


def resized(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    return image if image.size == size else image.resize(size, RESAMPLE)


def described(verb: str, region: Region, context: ToolContext, size: tuple[int, int]) -> str:
    """The result's text: the box used (after rounding and clipping), the source image, the new size and index."""
    box = ", ".join(map(str, region.box))
    return (f"{verb} [{box}] of image {region.index} ({region.width}x{region.height}) to {size[0]}x{size[1]}: "
            f"image {len(context.images)}")


@dataclass(frozen=True, kw_only=True)
class RegionTool(Tool):
    """What crop and zoom share: their one option, `coordinates`, "pixels" (default: the box in pixels of the image)
    or "relative" (each axis from 0 to 1000, Qwen3-VL's grounding convention), and their parameters."""

    coordinates: str = "pixels"

    def __post_init__(self) -> None:
        if self.coordinates not in BOX:
            raise ValueError(f"tool {self.name!r}: coordinates must be one of {list(BOX)} ('relative': 0 to 1000 on "
                             f"each axis, as Qwen3-VL grounds), got {self.coordinates!r}")

    @property
    def parameters(self) -> dict:
        return region_parameters(self.coordinates)

    def region(self, context: ToolContext, arguments: dict) -> Region:
        return region(context, arguments, relative=self.coordinates == "relative")


@dataclass(frozen=True, kw_only=True)
class Crop(RegionTool):
    """`crop(box, image=0)`: the region at its own pixels (within the context's pixel limits)."""

    name: ClassVar[str] = "crop"
    description: ClassVar[str] = (
        "Crop a region out of an image of this conversation and look at it at its own pixels (scaled down only if "
        "it is larger than the largest image allowed). Returns the region as a new image and its size in pixels.")

    def __call__(self, context: ToolContext, arguments: dict) -> ToolResult:
        area = self.region(context, arguments)
        width, height = area.size
        size = (width, height)
        if width * height > context.max_pixels:
            size = fit_within(width, height, context.max_pixels)
        elif width * height < context.min_pixels:
            size = fit_over(width, height, context.min_pixels, context.max_pixels)
        return ToolResult(text=described("cropped", area, context, size), images=(resized(area.cropped(), size),))


@dataclass(frozen=True, kw_only=True)
class Zoom(RegionTool):
    """`zoom(box, image=0)`: the region scaled to as many pixels as the context allows."""

    name: ClassVar[str] = "zoom"
    description: ClassVar[str] = (
        "Zoom into a region of an image of this conversation: the region is enlarged to the highest resolution "
        "allowed (its aspect kept), so that small details become readable. Returns the enlarged region as a new "
        "image and its size in pixels.")

    def __call__(self, context: ToolContext, arguments: dict) -> ToolResult:
        area = self.region(context, arguments)
        size = fit_within(*area.size, context.max_pixels)
        return ToolResult(text=described("zoomed", area, context, size), images=(resized(area.cropped(), size),))


TOOLS: Registry[type[Tool]] = Registry("tool")  # name -> a frozen dataclass whose fields are its options
TOOLS.register(Crop.name, Crop)
TOOLS.register(Zoom.name, Zoom)
