"""Image processors: bit-exact parity with transformers' processors, the tiny / extreme-image policy,
and `processor_for(model)` token counts that the model really emits.

Tolerance for every parity test: exact (`torch.equal`, max abs diff 0). Both sides run the same
torchvision uint8 resize kernel and the same fused float32 normalisation, so no kernel difference exists.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from skimage import data
from transformers import CLIPImageProcessor, LlavaImageProcessor, Qwen2VLImageProcessor, SiglipImageProcessor
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from mmadapt import ENCODERS, ImageTokenContractError, VisionLanguageModel
from mmadapt.data.geometry import FIXED_MODES
from mmadapt.data.processors import (
    FixedSizeProcessor,
    ImageProcessor,
    ProcessedImages,
    QwenProcessor,
    as_uint8,
    aspect_limited,
    processor_for,
)
from mmadapt.encoders.qwen3_5_vit import QwenViTEncoder

HALF = (0.5, 0.5, 0.5)


def photos() -> list[Image.Image]:
    """Real photos: square, landscape, portrait, a small odd-sized one and a grayscale one."""
    return [
        Image.fromarray(data.astronaut()),  # 512 x 512
        Image.fromarray(data.coffee()),  # 600 x 400
        Image.fromarray(data.chelsea()).resize((123, 457)),  # portrait, odd sizes
        Image.fromarray(data.astronaut()).resize((37, 20)),  # below min_pixels
        Image.fromarray(data.camera()).convert("RGB").resize((1500, 1100)),  # above max_pixels below
    ]


def assert_exact(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs), f"max abs diff {(ours - theirs).abs().max().item()}"


# ---- parity with transformers ---------------------------------------------------------------------
QWEN_SETTINGS = {
    "qwen3.5": dict(patch_size=16, min_pixels=65536, max_pixels=16777216, mean=HALF, std=HALF),
    "qwen2-vl": dict(patch_size=14, min_pixels=56 * 56, max_pixels=28 * 28 * 1280, mean=OPENAI_CLIP_MEAN,
                     std=OPENAI_CLIP_STD),
    "clamped": dict(patch_size=16, min_pixels=512 * 512, max_pixels=640 * 640, mean=HALF, std=HALF),
    "tiny": dict(patch_size=8, min_pixels=16 * 16, max_pixels=128 * 128, mean=HALF, std=HALF),
}


@pytest.mark.parametrize("name", QWEN_SETTINGS)
def test_qwen_parity(name):
    s = QWEN_SETTINGS[name]
    theirs = Qwen2VLImageProcessor(size={"shortest_edge": s["min_pixels"], "longest_edge": s["max_pixels"]},
                                   patch_size=s["patch_size"], image_mean=list(s["mean"]), image_std=list(s["std"]))
    images = photos()
    expected = theirs(images, return_tensors="pt")
    out = QwenProcessor(**s)(images)
    assert_exact(out.pixel_values, expected["pixel_values"])
    assert_exact(out.image_grid_thw, expected["image_grid_thw"])
    assert out.tokens_per_image == (expected["image_grid_thw"].prod(-1) // 4).tolist()
    grids = out.image_grid_thw.tolist()
    if name == "clamped":  # every image was pushed into [min, max] pixels
        assert all(512 * 512 <= h * w * 256 <= 640 * 640 for _, h, w in grids)


def test_qwen_one_image_per_call_equals_batch():
    processor, images = QwenProcessor(**QWEN_SETTINGS["qwen3.5"]), photos()
    batch = processor(images)
    singles = [processor([image]) for image in images]
    assert_exact(torch.cat([s.pixel_values for s in singles]), batch.pixel_values)
    assert [s.tokens_per_image[0] for s in singles] == batch.tokens_per_image


@pytest.mark.parametrize("side", [336, 224])
def test_clip_crop_parity(side):
    theirs = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    ours = FixedSizeProcessor(image_size=side, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, mode="crop",
                              tokens_per_image=1)
    images = photos()
    assert_exact(ours(images).pixel_values, theirs(images, return_tensors="pt")["pixel_values"])


@pytest.mark.parametrize("side", [336, 32])
def test_llava_pad_parity(side):
    theirs = LlavaImageProcessor(do_pad=True, size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    ours = FixedSizeProcessor(image_size=side, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, mode="pad",
                              tokens_per_image=1)
    images = photos()  # landscape and portrait, odd padding on one side
    assert_exact(ours(images).pixel_values, theirs(images, return_tensors="pt")["pixel_values"])


def test_pad_background_is_llava_mean_colour():
    ours = FixedSizeProcessor(image_size=8, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, mode="pad",
                              tokens_per_image=1, resample="nearest")
    assert ours.fill == (122, 116, 104)  # LLaVA-1.5's tuple(int(x * 255) for x in image_mean)
    out = ours([Image.new("RGB", (8, 2), (0, 0, 0))]).pixel_values[0]
    corner = out[:, 0, 0] * torch.tensor(OPENAI_CLIP_STD) * 255 + torch.tensor(OPENAI_CLIP_MEAN) * 255
    assert torch.allclose(corner, torch.tensor([122.0, 116.0, 104.0]), atol=1e-3)


def test_siglip_resize_parity():
    theirs = SiglipImageProcessor(size={"height": 384, "width": 384})
    ours = FixedSizeProcessor(image_size=384, mean=HALF, std=HALF, mode="resize", tokens_per_image=1)
    images = photos()
    assert_exact(ours(images).pixel_values, theirs(images, return_tensors="pt")["pixel_values"])


# ---- tiny and extreme images ----------------------------------------------------------------------
EXTREME = {"1x1": (1, 1), "2x700": (2, 700), "700x2": (700, 2), "1x1000": (1, 1000)}


def all_processors() -> dict[str, ImageProcessor]:
    fixed = {mode: FixedSizeProcessor(image_size=336, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, mode=mode,
                                      tokens_per_image=576) for mode in ("pad", "resize", "crop")}
    return {**fixed, "qwen": QwenProcessor(), "qwen_tiny": QwenProcessor(**QWEN_SETTINGS["tiny"])}


@pytest.mark.parametrize("size", EXTREME.values(), ids=EXTREME.keys())
@pytest.mark.parametrize("name", list(all_processors()))
def test_tiny_and_extreme_images(name, size):
    processor = all_processors()[name]
    image = Image.fromarray(data.astronaut()).resize(size)
    out = processor([image])
    assert torch.isfinite(out.pixel_values).all()
    assert out.tokens_per_image == [processor.tokens_for_size(*size)]
    if processor.dynamic:
        assert out.pixel_values.shape == (int(out.image_grid_thw.prod()), processor.patch_dim)
        _, h, w = out.image_grid_thw[0].tolist()
        assert max(h, w) / min(h, w) <= 200 and h % 2 == w % 2 == 0
    else:
        assert out.pixel_values.shape == (1, 3, 336, 336) and out.image_grid_thw is None


def test_extreme_aspect_is_padded_with_mean_colour():
    assert aspect_limited(700, 2, 200) == (700, 4) and aspect_limited(2, 700, 200) == (4, 700)
    assert aspect_limited(400, 2, 200) == (400, 2)  # exactly 200 is allowed
    processor = QwenProcessor(patch_size=2, merge_size=1, temporal_patch_size=1, min_pixels=4, max_pixels=10**6)
    out = processor([Image.new("RGB", (2, 1200), (0, 0, 0))])  # padded to 6 x 1200: no resize after
    assert out.image_grid_thw.tolist() == [[1, 600, 3]]
    image = out.pixel_values.view(600, 3, 3, 2, 2).permute(2, 0, 3, 1, 4).reshape(3, 1200, 6)
    grey = torch.tensor((127 - 127.5) / 127.5)  # mean colour 0.5 -> 127, normalised
    assert (image[:, :, 2:4] == -1).all() and (image[:, :, :2] == grey).all() and (image[:, :, 4:] == grey).all()


def test_empty_input_shapes():
    fixed = FixedSizeProcessor(image_size=32, mean=HALF, std=HALF, tokens_per_image=16)([])
    assert fixed.pixel_values.shape == (0, 3, 32, 32) and fixed.image_grid_thw is None and len(fixed) == 0
    dynamic = QwenProcessor(patch_size=14)([])
    assert dynamic.pixel_values.shape == (0, 3 * 2 * 14 * 14) and dynamic.image_grid_thw.shape == (0, 3)
    assert dynamic.image_grid_thw.dtype == torch.long and dynamic.tokens_per_image == []


def test_non_rgb_input_uses_loading_policy():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent -> white
    processor = FixedSizeProcessor(image_size=4, mean=HALF, std=HALF, mode="resize", tokens_per_image=1)
    assert torch.equal(processor([rgba]).pixel_values, torch.ones(1, 3, 4, 4))


def test_bad_arguments():
    with pytest.raises(TypeError, match="list of images"):
        QwenProcessor()(Image.new("RGB", (4, 4)))
    with pytest.raises(TypeError, match="PIL images"):
        QwenProcessor()([torch.zeros(3, 4, 4)])
    with pytest.raises(ValueError, match="min_pixels"):
        QwenProcessor(patch_size=16, min_pixels=16 * 16)  # below one 32 x 32 merge window
    with pytest.raises(ValueError, match="mode"):
        FixedSizeProcessor(image_size=32, mean=HALF, std=HALF, mode="letterbox", tokens_per_image=1)
    with pytest.raises(ValueError, match="resample"):
        FixedSizeProcessor(image_size=32, mean=HALF, std=HALF, tokens_per_image=1, resample="cubic")
    with pytest.raises(ValueError, match="200"):
        QwenProcessor(max_aspect_ratio=500)


def test_the_image_and_video_processors_hold_one_patch_geometry():
    """The video processor is built on the image processor's PatchGeometry (its own pixel bounds); an image is one
    temporal patch of T copies of itself, so flattening T copies of a frame is the image's patchify."""
    from mmadapt.data.patches import PatchGeometry
    from mmadapt.data.video import VideoConfig

    image = QwenProcessor(patch_size=14, merge_size=2, projector_merge=1, min_pixels=28 * 28)
    video = VideoConfig(max_pixels=28 * 28 * 800).processor(image)
    assert video.patches == dataclasses.replace(image.patches, min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 800)
    assert (video.patch_size, video.merge_size, video.projector_merge, video.patch_dim) == (14, 2, 1, 3 * 2 * 14 * 14)
    pixels = torch.randn(3, 56, 84)
    as_image, as_frames = torch.empty(24, image.patch_dim), torch.empty(24, image.patch_dim)
    image.patchify(pixels, as_image)
    video.patches.flatten(pixels.expand(2, -1, -1, -1).clone(), as_frames)
    assert torch.equal(as_image, as_frames)
    assert image.patches.grid(1, 56, 84) == (1, 4, 6) and image.patches.tokens((1, 4, 6)) == 24
    assert video.patches.grid(5, 56, 84) == (3, 4, 6) and video.patches.tokens((3, 4, 6)) == 3 * 24
    with pytest.raises(ValueError, match="projector_merge"):
        PatchGeometry(merge_size=2, projector_merge=3, min_pixels=1, max_pixels=1)
    with pytest.raises(ValueError, match="min_pixels"):
        PatchGeometry(min_pixels=2, max_pixels=1)


# ---- processor_for(model) -------------------------------------------------------------------------
COMBOS = [(enc, proj, "qwen3_5" if enc == "qwen3_5_vit" else "llama")
          for enc in ("clip", "siglip", "timm", "qwen3_5_vit") for proj in ("mlp2x_gelu", "qwen_merger")]
COMBOS += [("clip", "mlp2x_gelu", "qwen3_5"), ("qwen3_5_vit", "qwen_merger", "llama")]


def model_inputs(model: VisionLanguageModel, processed: ProcessedImages) -> dict[str, torch.Tensor]:
    """One sample: text, then each image's span sized by the processor's tokens_per_image."""
    tokens, ids = model.tokens, [5, 6]
    for count in processed.tokens_per_image:
        span = [tokens.image_token_id] * count
        if tokens.vision_start_token_id is not None:
            span = [tokens.vision_start_token_id, *span, tokens.vision_end_token_id]
        ids += [*span, 7]
    batch = {"input_ids": torch.tensor([ids]), "pixel_values": processed.pixel_values}
    if processed.image_grid_thw is not None:
        batch["image_grid_thw"] = processed.image_grid_thw
    return batch


@pytest.mark.parametrize(("encoder", "projector", "backbone"), COMBOS)
def test_processor_for_model_token_counts(encoder, projector, backbone):
    torch.manual_seed(0)
    model = VisionLanguageModel.from_names(encoder, projector, backbone, preset="tiny").eval()
    processor = processor_for(model)
    assert processor.dynamic == model.encoder.dynamic
    images = [Image.fromarray(data.coffee()).resize((60, 40)), Image.fromarray(data.chelsea()).resize((17, 90)),
              Image.new("RGB", (1, 1)), Image.new("RGB", (2, 700))]
    processed = processor(images)
    with torch.no_grad():
        visual = model.encode_images(processed.pixel_values, processed.image_grid_thw)
        assert visual.features.shape[0] == sum(processed.tokens_per_image)
        assert visual.tokens_per_image.tolist() == processed.tokens_per_image
        out = model(**model_inputs(model, processed))  # the image-token contract is checked in forward
    assert torch.isfinite(out.logits).all()
    assert processed.tokens_per_image == [processor.tokens_for_size(*image.size) for image in images]


def test_processor_for_declared_defaults():
    clip = processor_for(VisionLanguageModel.from_names("clip", "mlp2x_gelu", "llama"))
    assert (clip.mode, clip.mean, clip.image_size) == ("pad", tuple(OPENAI_CLIP_MEAN), 32)
    siglip = processor_for(VisionLanguageModel.from_names("siglip", "mlp2x_gelu", "llama"))
    assert (siglip.mode, siglip.mean) == ("resize", HALF)
    qwen_model = VisionLanguageModel.from_names("qwen3_5_vit", "qwen_merger", "qwen3_5")
    qwen = processor_for(qwen_model)
    assert (qwen.patch_size, qwen.min_pixels, qwen.projector_merge, qwen.mean) == (8, 256, 2, HALF)
    published = ENCODERS.get("qwen3_5_vit").options("qwen3.5-0.8b")  # published presets: Qwen3.5's processor config
    assert "min_pixels" not in published
    defaults = QwenViTEncoder.__init__.__kwdefaults__
    assert (defaults["min_pixels"], defaults["max_pixels"]) == (65536, 16777216)


def test_processor_pixel_bounds_survive_save_and_load(tmp_path):
    model = VisionLanguageModel.from_names("qwen3_5_vit", "qwen_merger", "qwen3_5")
    model.save_pretrained(tmp_path)
    reloaded = processor_for(VisionLanguageModel.from_pretrained(tmp_path))
    assert (reloaded.min_pixels, reloaded.max_pixels) == (processor_for(model).min_pixels, 512 * 512)


def test_processor_for_overrides():
    model = VisionLanguageModel.from_names("qwen3_5_vit", "qwen_merger", "qwen3_5")
    assert processor_for(model, max_pixels=64 * 64).max_pixels == 64 * 64
    with pytest.raises(ValueError, match="patch_size=14 conflicts"):
        processor_for(model, patch_size=14)
    clip = VisionLanguageModel.from_names("clip", "mlp2x_gelu", "llama")
    assert processor_for(clip, mode="crop").mode == "crop"
    with pytest.raises(ValueError, match="image_size=336 conflicts"):
        processor_for(clip, image_size=336)


def test_fixed_pixels_never_reach_dynamic_encoder():
    qwen = VisionLanguageModel.from_names("qwen3_5_vit", "qwen_merger", "qwen3_5")
    clip = VisionLanguageModel.from_names("clip", "mlp2x_gelu", "llama")
    fixed = processor_for(clip)([Image.new("RGB", (32, 32))])
    with pytest.raises(ImageTokenContractError, match="dynamic-resolution"):
        qwen.encode_images(fixed.pixel_values, fixed.image_grid_thw)


# ---- geometry: each mode's map equals what its pixel path does ----------------------------------------------
def coordinate_image(height: int, width: int) -> Image.Image:
    """Every pixel names itself: red = row, green = column, blue = 255 (the padding colour's blue is 127)."""
    pixels = np.full((height, width, 3), 255, dtype=np.uint8)
    pixels[..., 0], pixels[..., 1] = np.indices((height, width))
    return Image.fromarray(pixels)


def geometry_processor(mode: str, max_aspect_ratio: float) -> ImageProcessor:
    """A processor of `mode` with nearest resampling, so every processed pixel is a copy of one original pixel."""
    if mode == "qwen":
        return QwenProcessor(patch_size=8, merge_size=2, min_pixels=256, max_pixels=64 * 64, mean=HALF, std=HALF,
                             resample="nearest", max_aspect_ratio=max_aspect_ratio)
    return FixedSizeProcessor(image_size=32, mean=HALF, std=HALF, mode=mode, tokens_per_image=16,
                              resample="nearest", max_aspect_ratio=max_aspect_ratio)


@pytest.mark.parametrize("mode", [*FIXED_MODES, "qwen"])
@pytest.mark.parametrize(("size", "max_aspect_ratio"), [
    ((48, 32), 200.0), ((31, 70), 200.0), ((5, 3), 200.0), ((250, 1), 200.0), ((10, 90), 3.0),
], ids=["wide", "tall-odd", "tiny", "beyond-200", "beyond-3"])
def test_geometry_maps_each_processed_pixel_onto_the_original_pixel_the_pixel_path_put_there(mode, size,
                                                                                            max_aspect_ratio):
    """`processor.geometry` (the composed map) against `processor.run` (the pixel operations) on an image whose
    pixels hold their own coordinates: every processed pixel whose centre maps inside the original must be a
    copy of the original pixel under it, every one that maps outside must be padding."""
    width, height = size
    processor = geometry_processor(mode, max_aspect_ratio)
    geometry = processor.geometry(height, width)
    seen = processor.run(as_uint8(coordinate_image(height, width))).numpy().astype(float)
    assert (geometry.original, geometry.mode) == ((height, width), mode)
    assert seen.shape[1:] == geometry.processed
    processed = processor([coordinate_image(height, width)])
    if processor.dynamic:
        assert processed.image_grid_thw[0, 1:].tolist() == [n // processor.patch_size for n in geometry.processed]
    else:
        assert processed.pixel_values.shape[-2:] == geometry.processed
    rows, cols = geometry.to_original(np.arange(geometry.processed[0]) + 0.5, np.arange(geometry.processed[1]) + 0.5)
    eps = 1e-6  # centres on the original's border are skipped: either side is right
    inside = np.outer((rows > eps) & (rows < height - eps), (cols > eps) & (cols < width - eps))
    outside = ~np.outer((rows > -eps) & (rows < height + eps), (cols > -eps) & (cols < width + eps))
    assert inside.any() or min(geometry.scale[0] * height, geometry.scale[1] * width) < 1  # thinner than a pixel
    assert (seen[2][inside] == 255).all() and (seen[2][outside] == 127).all()
    assert (np.abs(seen[0] + 0.5 - rows[:, None])[inside] <= 0.5 + eps).all()  # the row under the centre
    assert (np.abs(seen[1] + 0.5 - cols[None, :])[inside] <= 0.5 + eps).all()
    padded = mode == "pad" or max(width, height) > max_aspect_ratio * min(width, height)  # no square sizes here
    assert outside.any() == padded


@pytest.mark.slow
def test_bench_preprocess_quick_run_prints_its_table():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "bench_preprocess.py"
    out = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    assert "| Qwen3.5 dynamic | 1 |" in out and "| LLaVA-1.5 pad 336 | 2 |" in out
    assert all(line.endswith("| 0.0e+00 |") for line in out.splitlines() if line.startswith("| Qwen3.5"))
