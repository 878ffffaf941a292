"""Image loading: every kind of bad or unusual file gives RGB pixels or a `DataProblem` naming the file.

Real photos come from `skimage.data`; bad files are written into `tmp_path` with Pillow.
"""

from __future__ import annotations

import io
import logging
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile
from skimage import data

from mmadapt.data.images import DEFAULT_MAX_PIXELS, image_size, load_image, to_rgb
from mmadapt.data.problems import DataProblem


def save(image: Image.Image, path, **kwargs) -> str:
    image.save(path, **kwargs)
    return str(path)


def problem(path, reason: str, **kwargs) -> DataProblem:
    with pytest.raises(DataProblem) as info:
        load_image(path, **kwargs)
    assert info.value.reason == reason, info.value
    assert info.value.path == str(path) and str(path) in str(info.value)
    return info.value


@pytest.fixture(scope="module")
def astronaut() -> Image.Image:
    return Image.fromarray(data.astronaut())


# ---- good files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "TIFF"])
def test_real_photo_loads_as_rgb(tmp_path, astronaut, fmt):
    path = save(astronaut, tmp_path / f"astronaut.{fmt.lower()}", format=fmt)
    image = load_image(path)
    assert image.mode == "RGB" and image.size == (512, 512)
    assert image_size(path) == (512, 512)
    if fmt in ("PNG", "BMP", "TIFF"):  # lossless
        assert np.array_equal(np.asarray(image), data.astronaut())


@pytest.mark.parametrize("size", [(1, 1), (2, 700), (700, 2)])
def test_tiny_and_extreme_images_load(tmp_path, size):
    path = save(Image.new("RGB", size, (10, 20, 30)), tmp_path / "small.png")
    image = load_image(path)
    assert image.size == size and image.getpixel((0, 0)) == (10, 20, 30)
    assert image_size(path) == size


def test_grayscale_and_bilevel(tmp_path):
    camera = data.camera()
    gray = load_image(save(Image.fromarray(camera), tmp_path / "camera.png"))
    assert gray.mode == "RGB" and np.array_equal(np.asarray(gray)[..., 1], camera)
    bilevel = load_image(save(Image.fromarray(camera > 128), tmp_path / "bilevel.png"))
    assert set(np.unique(np.asarray(bilevel))) <= {0, 255}


# ---- missing, corrupt, truncated ----------------------------------------------------------------
def test_missing_file(tmp_path):
    error = problem(tmp_path / "nope.jpg", "missing_image")
    assert "Fix" in str(error)
    with pytest.raises(DataProblem, match="missing_image"):
        image_size(tmp_path / "nope.jpg")


def test_directory_is_unreadable(tmp_path):
    problem(tmp_path, "unreadable_image")


def test_corrupt_bytes(tmp_path):
    path = tmp_path / "noise.jpg"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    error = problem(path, "unreadable_image")
    assert "UnidentifiedImageError" in error.detail  # PIL's error is named
    with pytest.raises(DataProblem, match="unreadable_image"):
        image_size(path)


def test_text_file_is_not_an_image(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("not an image\n")
    problem(path, "unreadable_image")


def test_corrupt_pixel_data_with_valid_header(tmp_path, astronaut):
    raw = bytearray(_png_bytes(astronaut))
    start = raw.index(b"IDAT") + 8
    raw[start : start + 2000] = bytes(2000)  # zeroed deflate stream, header still fine
    path = tmp_path / "corrupt.png"
    path.write_bytes(bytes(raw))
    assert image_size(path) == (512, 512)  # the header alone is readable ...
    problem(path, "unreadable_image")  # ... the pixels are not


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_file(tmp_path, astronaut, fmt):
    whole = save(astronaut, tmp_path / f"whole.{fmt.lower()}", format=fmt)
    path = tmp_path / f"truncated.{fmt.lower()}"
    content = open(whole, "rb").read()
    path.write_bytes(content[: len(content) // 2])
    error = problem(path, "unreadable_image")
    assert "truncated" in error.detail or "OSError" in error.detail
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False  # never switched on to make the error go away


def test_truncated_images_allowed_elsewhere_is_warned(tmp_path, astronaut, monkeypatch, caplog):
    content = _png_bytes(astronaut)
    path = tmp_path / "truncated.png"
    path.write_bytes(content[: len(content) // 2])
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    from mmadapt.data import images

    images._warn_truncation_allowed.cache_clear()
    with caplog.at_level(logging.WARNING, logger="mmadapt.data.images"):
        load_image(path)  # PIL pads it: the global flag wins, but not silently
    assert "LOAD_TRUNCATED_IMAGES" in caplog.text


# ---- decompression bombs ------------------------------------------------------------------------
def bomb(path, width: int, height: int) -> str:
    """A tiny PNG whose header claims width x height pixels."""
    raw = bytearray(_png_bytes(Image.new("L", (8, 8))))
    ihdr = raw.index(b"IHDR")
    raw[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    raw[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(raw[ihdr : ihdr + 17])))
    path.write_bytes(bytes(raw))
    return str(path)


def test_bomb_beyond_pil_limit(tmp_path):
    path = bomb(tmp_path / "bomb.png", 100_000, 100_000)  # PIL itself refuses this in Image.open
    error = problem(path, "image_too_large")
    assert "max_pixels" in error.detail
    with pytest.raises(DataProblem, match="image_too_large"):
        image_size(path)


def test_bomb_checked_from_header_before_decoding(tmp_path):
    # 9000 x 9000 = 81 MP: above our 64 MP cap, below PIL's own. The file holds 8 x 8 pixels of data,
    # so decoding would fail as "unreadable"; "too large" proves the header check came first.
    assert 9000 * 9000 > DEFAULT_MAX_PIXELS
    error = problem(bomb(tmp_path / "bomb.png", 9000, 9000), "image_too_large")
    assert "81000000 pixels exceeds max_pixels" in error.detail


def test_cap_is_configurable(tmp_path, astronaut):
    path = save(astronaut, tmp_path / "a.png")
    error = problem(path, "image_too_large", max_pixels=512 * 511)
    assert "max_pixels=" in error.detail  # says how to raise it
    assert load_image(path, max_pixels=512 * 512).size == (512, 512)


# ---- colour modes -------------------------------------------------------------------------------
def test_cmyk_jpeg_colours(tmp_path):
    red = load_image(save(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), tmp_path / "red.jpg"))
    assert np.abs(np.asarray(red).astype(int) - (255, 0, 0)).max() <= 2
    photo = Image.fromarray(data.coffee())
    loaded = load_image(save(photo.convert("CMYK"), tmp_path / "coffee.jpg", quality=95))
    assert np.abs(np.asarray(loaded).astype(int) - data.coffee()).mean() < 4  # JPEG loss only


def test_palette_with_transparency_on_white(tmp_path):
    image = Image.new("P", (4, 1))
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.putdata([0, 1, 1, 0])
    path = save(image, tmp_path / "palette.png", transparency=0)
    assert Image.open(path).mode == "P"
    assert np.asarray(load_image(path)).tolist() == [[[255, 255, 255], [255, 0, 0], [255, 0, 0], [255, 255, 255]]]


def test_sixteen_bit_png_scaled_not_clipped(tmp_path):
    values = np.array([[65535, 32768, 0, 257, 1000]], dtype=np.uint16)
    path = save(Image.fromarray(values), tmp_path / "deep.png")
    assert Image.open(path).mode.startswith("I")
    pixels = np.asarray(load_image(path))
    assert pixels[0, :, 0].tolist() == [255, 128, 0, 1, 4]  # 1000 / 257 = 3.9; PIL's convert gives 255
    assert (pixels == pixels[..., :1]).all()


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I"])
def test_sixteen_bit_modes(mode):
    values = np.array([[65535, 32768, 0]], dtype=">u2" if mode == "I;16B" else "<u2")
    image = Image.frombytes("I;16" if mode == "I" else mode, (3, 1), values.tobytes())
    image = image.convert("I") if mode == "I" else image
    assert image.mode == mode
    assert np.asarray(to_rgb(image))[0].tolist() == [[255] * 3, [128] * 3, [0] * 3]


def test_float_image():
    unit = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))
    assert np.asarray(to_rgb(unit))[0, :, 0].tolist() == [0, 128, 255]
    wide = Image.fromarray(np.array([[0.0, 100.0, 300.0]], dtype=np.float32))
    assert np.asarray(to_rgb(wide))[0, :, 0].tolist() == [0, 100, 255]


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA"])
def test_alpha_composited_on_white(tmp_path, mode):
    rgba = Image.new("RGBA", (3, 1))
    rgba.putdata([(255, 0, 0, 255), (255, 0, 0, 0), (255, 0, 0, 128)])
    image = rgba if mode == "RGBA" else rgba.convert(mode)
    path = save(image, tmp_path / f"alpha_{mode}.png") if mode != "PA" else None
    loaded = load_image(path) if path else to_rgb(image)
    opaque, clear, half = np.asarray(loaded)[0].astype(int)
    assert clear.tolist() == [255, 255, 255]
    expected = np.asarray(image.convert("RGBA").convert("RGB"))[0, 0].astype(int)
    assert opaque.tolist() == expected.tolist()
    assert np.abs(half - (expected * 128 + 255 * 127) / 255).max() <= 1


def test_exif_rotation(tmp_path, astronaut):
    photo = astronaut.crop((0, 0, 300, 200))  # landscape 300 x 200
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = save(photo, tmp_path / "rotated.jpg", exif=exif, quality=95)
    loaded = load_image(path)
    assert loaded.size == (200, 300) and image_size(path) == (200, 300)
    raw = Image.open(path)
    raw.load()
    assert raw.size == (300, 200)  # stored landscape
    assert np.array_equal(np.asarray(loaded), np.asarray(raw.transpose(Image.Transpose.ROTATE_270)))


def test_no_exif_orientation_keeps_size(tmp_path, astronaut):
    exif = Image.Exif()
    exif[0x0112] = 3  # 180 degrees: no swap
    path = save(astronaut.crop((0, 0, 300, 200)), tmp_path / "flipped.jpg", exif=exif)
    assert image_size(path) == (300, 200) == load_image(path).size


def test_first_frame_of_animation(tmp_path):
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:])
    assert load_image(path).getpixel((0, 0)) == (255, 0, 0)


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
