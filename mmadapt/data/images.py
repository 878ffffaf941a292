"""Image files -> RGB PIL images, validated: `load_image(path)` and the header-only `image_size(path)`.

Contract: `load_image` returns a fully decoded 8-bit RGB `PIL.Image.Image` with its EXIF orientation
applied, or raises `DataProblem` with one of these reasons (never another exception type):
- `missing_image`: no file at `path`;
- `unreadable_image`: corrupt, truncated or not an image (the detail names PIL's error), or a
  directory, or a colour mode with no conversion to RGB;
- `image_too_large`: more than `max_pixels` pixels (width * height, from the header, before any
  pixel is decoded). The default cap is `DEFAULT_MAX_PIXELS` (64 megapixels); pass
  `max_pixels=` to raise it. PIL's own bomb check (`PIL.Image.MAX_IMAGE_PIXELS`, ~89 MP for a
  warning, twice that for an error) fires inside `Image.open`, so it is caught and reported
  as `image_too_large` too; to load images beyond it set `PIL.Image.MAX_IMAGE_PIXELS = None`.

Truncated files fail because the pixels are decoded (`Image.load()`) inside the error handling
and PIL raises on premature end of data - unless some other code set PIL's global
`ImageFile.LOAD_TRUNCATED_IMAGES = True`, in which case PIL pads truncated images with grey; this
module never sets it and logs a warning when it finds it set.

Colour policy (`to_rgb`): RGB passes through; CMYK, YCbCr, L, 1 and palette images use PIL's
conversion; anything with transparency (RGBA, LA, PA, La, RGBa, palette or L/RGB with a
`transparency` key) is alpha-composited onto white (the same rule as transformers'
`convert_to_rgb`); 16-bit grayscale (I;16, I;16B, I;16L, and 32-bit I, read as 16-bit data) is
scaled by 1/257 with rounding (65535 -> 255, 32768 -> 128; PIL's own `convert` clips every value
above 255 to white); float F images are read as [0, 1] when all values lie there, else as
[0, 255] (clipped). Multi-frame files (GIF, TIFF) give their first frame. ICC profiles are not
applied.

Only the formats in `FORMATS` are opened (PNG, JPEG (its multi-picture MPO variant too), WebP, GIF, BMP, TIFF):
Pillow is asked for exactly these parsers (`Image.open(..., formats=FORMATS)`), so a file in any other format
(PSD, EPS, ICO, PCX, ...) never reaches another parser and is an `unreadable_image` naming the allowed formats.
An allocation failure while decoding (`MemoryError`) is an `out_of_memory` problem.

An image embedded in a dataset (the hub's Parquet files hold them as bytes: the `datasets` `Image` feature) is an
`EmbeddedImage(data, name)`: both functions take it where they take a path, with the same checks in the same order
(the header's pixels against the cap before any pixel is decoded, the allowed formats only); `name` (the dataset
file, row and column) is the `path` its problems name.

`image_size` reads only the header (and the EXIF / XMP orientation stored before the pixel data)
and returns (width, height) as `load_image` would give them, i.e. swapped for orientations 5-8.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import struct
from dataclasses import dataclass
from typing import Final

import numpy as np
from PIL import ExifTags, Image, ImageFile, ImageOps, UnidentifiedImageError

from mmadapt.data.problems import DataProblem

logger = logging.getLogger(__name__)

DEFAULT_MAX_PIXELS: Final[int] = 64 * 1024 * 1024
"""Decompression-bomb cap: 64 megapixels (e.g. 8192 x 8192), below PIL's own ~89 MP warning."""

WHITE: Final[tuple[int, int, int, int]] = (255, 255, 255, 255)
SIXTEEN_BIT_MODES: Final[frozenset[str]] = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
SWAPPING_ORIENTATIONS: Final[frozenset[int]] = frozenset({5, 6, 7, 8})
# What PIL's plugins raise for malformed files: OSError (incl. UnidentifiedImageError and truncation),
# ValueError, SyntaxError (bad headers), EOFError, and IndexError / KeyError / struct.error from parsers.
PIL_ERRORS: Final[tuple[type[BaseException], ...]] = (OSError, ValueError, SyntaxError, EOFError, IndexError,
                                                      KeyError, struct.error)
FORMATS: Final[tuple[str, ...]] = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""The image formats `load_image` and `image_size` open; Pillow's other parsers are never run on data."""
BOMB_ERRORS: Final[tuple[type[BaseException], ...]] = (Image.DecompressionBombError, Image.DecompressionBombWarning)


@dataclass(frozen=True)
class EmbeddedImage:
    """An image's encoded bytes as a dataset holds them; `name` says where (file, row, column) for its problems."""

    data: bytes
    name: str

    def __repr__(self) -> str:
        return f"EmbeddedImage({self.name!r}, {len(self.data)} bytes)"


ImageSource = str | os.PathLike[str] | EmbeddedImage


def load_image(path: ImageSource, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """The image at `path` (or embedded) as a decoded 8-bit RGB image, EXIF orientation applied; `DataProblem` if
    bad."""
    name = _name(path)
    with _open(path, max_pixels) as image:
        if ImageFile.LOAD_TRUNCATED_IMAGES:
            _warn_truncation_allowed()
        try:
            image.load()
            ImageOps.exif_transpose(image, in_place=True)
            return to_rgb(image)
        except BOMB_ERRORS as e:
            raise _too_large(name, f"PIL refused to decode it ({e})") from e
        except PIL_ERRORS as e:
            raise DataProblem("unreadable_image", f"PIL could not decode it: {type(e).__name__}: {e}. "
                              "Fix: re-encode or drop the file.", path=name) from e
        except MemoryError as e:
            raise DataProblem("out_of_memory", f"decoding its {image.size[0]} x {image.size[1]} pixels ran out of "
                              "memory. Fix: lower max_image_pixels or data.num_workers, or downscale the file",
                              path=name) from e


def image_size(path: ImageSource, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """(width, height) after EXIF orientation, from the header only; same `DataProblem`s as `load_image`."""
    name = _name(path)
    with _open(path, max_pixels) as image:
        width, height = image.size
        try:
            # PNG's own getexif() decodes the image to look for an eXIf chunk after the pixel data;
            # the PNG spec puts eXIf before IDAT, so the generic header-only reader is used instead.
            exif = Image.Image.getexif(image) if image.format == "PNG" else image.getexif()
            orientation = exif.get(ExifTags.Base.Orientation, 1)
        except PIL_ERRORS as e:
            raise DataProblem("unreadable_image", f"its EXIF data is corrupt: {type(e).__name__}: {e}. "
                              "Fix: re-encode the file or strip its EXIF block.", path=name) from e
    return (height, width) if orientation in SWAPPING_ORIENTATIONS else (width, height)


def to_rgb(image: Image.Image) -> Image.Image:
    """An 8-bit RGB version of a decoded `image` following the colour policy in the module docstring."""
    if image.mode in SIXTEEN_BIT_MODES:
        values = np.asarray(image)  # 16-bit modes widen to int32 (room for the rounding), 32-bit "I" to int64
        return _gray_to_rgb(values.astype(np.int32 if values.dtype.itemsize <= 2 else np.int64), scale=257)
    if image.mode == "F":
        values = np.nan_to_num(np.asarray(image, dtype=np.float32), nan=0.0, posinf=255.0, neginf=0.0)
        in_unit_range = values.size > 0 and values.min() >= 0.0 and values.max() <= 1.0
        return _gray_to_rgb(values * 255.0 if in_unit_range else values, scale=1)
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, WHITE), rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _gray_to_rgb(values: np.ndarray, scale: int) -> Image.Image:
    """Gray values at `scale` x the 8-bit range -> RGB, rounded half up and clipped to [0, 255]."""
    if scale == 1:
        gray = np.clip(np.floor(values + 0.5), 0, 255).astype(np.uint8)
    else:
        gray = np.clip((values + scale // 2) // scale, 0, 255).astype(np.uint8)
    return Image.fromarray(gray).convert("RGB")


def _name(source: ImageSource) -> str:
    return source.name if isinstance(source, EmbeddedImage) else os.fspath(source)


def _open(source: ImageSource, max_pixels: int) -> Image.Image:
    """`Image.open` (header only) with every failure as a `DataProblem`, and the pixel cap checked."""
    if max_pixels < 1:
        raise ValueError(f"max_pixels must be >= 1, got {max_pixels}")
    name = _name(source)
    if not isinstance(source, EmbeddedImage) and os.path.isdir(name):
        raise DataProblem("unreadable_image", "it is a directory, not an image file", path=name)
    try:
        image = Image.open(io.BytesIO(source.data) if isinstance(source, EmbeddedImage) else name, formats=FORMATS)
    except FileNotFoundError as e:
        raise DataProblem("missing_image", "no such file. Fix: correct the path or the image root, "
                          "or drop the sample.", path=name) from e
    except BOMB_ERRORS as e:
        raise _too_large(name, f"PIL refused to open it ({e})") from e
    except UnidentifiedImageError as e:
        raise DataProblem("unreadable_image", f"not a readable image in a format mmadapt opens ({', '.join(FORMATS)}): "
                          f"{type(e).__name__}: {e}. Fix: convert it to PNG or JPEG, or drop the file.",
                          path=name) from e
    except PIL_ERRORS as e:
        raise DataProblem("unreadable_image", f"not a readable image: {type(e).__name__}: {e}. "
                          "Fix: re-encode or drop the file.", path=name) from e
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise _too_large(name, f"{width} x {height} = {width * height} pixels exceeds max_pixels = {max_pixels}")
    return image


def _too_large(name: str, what: str) -> DataProblem:
    return DataProblem("image_too_large", f"{what}. Fix: downscale the file, or if it is trusted raise the cap "
                       "with load_image(path, max_pixels=...) (and set PIL.Image.MAX_IMAGE_PIXELS = None for "
                       "images beyond PIL's own limit).", path=name)


@functools.cache
def _warn_truncation_allowed() -> None:
    logger.warning("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True (set by other code): truncated image files "
                   "will load padded with grey instead of failing. Set it back to False.")
