"""Evidence maps: the geometry of every processor mode, the model's own forward reproduced, `render` and
`mmadapt explain` end to end. Attribution on a task whose answer lives in one quadrant (trained models) is in
tests/test_evidence_fixed_encoders.py and tests/test_evidence_qwen_encoders.py (the task: tests/quadrant_task.py).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from quadrant_task import QUESTION, corner_image

import mmadapt
from mmadapt import Processor, contract
from mmadapt.cli.explain import add_explain_command
from mmadapt.data import char_tokenizer
from mmadapt.data.processors import FixedSizeProcessor, QwenProcessor, as_uint8, processor_for
from mmadapt.evidence import (
    EvidenceMap,
    Integrated,
    Occlusion,
    cell_index,
    evidence,
    faithfulness,
    geometry_for,
    occlusion_blocks,
    quadrant_shares,
    render,
    token_maps,
)

LLAVA = ("clip", "mlp2x_gelu", "llama")
QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)


# ---- geometry: token cells <-> original pixels, checked against the processors themselves -----------------------
def processed_image(processor, image: Image.Image) -> torch.Tensor:
    """uint8 (3, H', W'): what the processor makes of `image` before normalising (its own code)."""
    pixels = as_uint8(image)
    if processor.dynamic:
        pixels = processor.limit_aspect(pixels)
        return processor.resize(pixels, *processor.target_size(*pixels.shape[-2:]))
    return processor.fit(pixels)


def fixed(mode: str) -> FixedSizeProcessor:
    return FixedSizeProcessor(image_size=32, mean=CLIP_MEAN, std=(0.27, 0.26, 0.28), mode=mode, tokens_per_image=16)


def qwen() -> QwenProcessor:
    return QwenProcessor(patch_size=8, merge_size=2, min_pixels=256, max_pixels=512 * 512)


@pytest.mark.parametrize(("processor", "size"), [
    (fixed("pad"), (48, 32)), (fixed("pad"), (40, 70)), (fixed("resize"), (50, 20)), (fixed("crop"), (64, 40)),
    (fixed("crop"), (33, 90)), (qwen(), (64, 64)), (qwen(), (70, 45)), (qwen(), (100, 30)),
], ids=["pad-wide", "pad-tall", "resize", "crop-wide", "crop-tall", "qwen-square", "qwen-odd", "qwen-wide"])
def test_each_token_cell_maps_to_the_pixels_the_processor_puts_in_it(processor, size):
    """Paint the original pixels that the map assigns to one token black: the processor's own output must be dark
    in exactly that token's cell (and nowhere else), for every token that lies fully on the original."""
    width, height = size
    geometry = geometry_for(processor, height, width)
    step = processor.patch_size * processor.projector_merge if processor.dynamic else 8
    grid = (geometry.processed[0] // step, geometry.processed[1] // step)
    coverage = geometry.coverage(grid)
    checked = 0
    for row in range(grid[0]):
        for col in range(grid[1]):
            if coverage[row, col] < 1:
                continue  # partly padding: checked by the pad tests below
            onehot = np.zeros(grid)
            onehot[row, col] = 1.0
            support = geometry.pixel_map(onehot) > 0
            canvas = np.full((height, width, 3), 255, dtype=np.uint8)
            canvas[support] = 0
            seen = processed_image(processor, Image.fromarray(canvas)).float().mean(0)
            cells = seen.reshape(grid[0], step, grid[1], step).mean((1, 3))
            assert cells[row, col] < 40, (row, col, cells)
            others = cells.clone()
            others[row, col] = 255
            assert others.min() > 120, (row, col, cells)  # white, or white and some mean-colour padding
            checked += 1
    assert checked >= 4


def test_pad_mode_places_the_original_as_a_centred_rectangle_of_a_non_square_image():
    """48 x 24 (W x H) in pad mode: a 48 x 48 square (original at rows 12..36), resized to 32; 4 x 4 tokens of
    12 x 12 original pixels each. Token row 0 is all padding, row 1 half padding."""
    geometry = geometry_for(fixed("pad"), 24, 48)
    assert geometry.processed == (32, 32) and geometry.scale == (32 / 48, 32 / 48)
    assert geometry.cell_box(1, 2, (4, 4)) == pytest.approx((24, 0, 36, 12))  # canvas rows 12..24 -> original 0..12
    assert geometry.cell_box(2, 0, (4, 4)) == pytest.approx((0, 12, 12, 24))
    assert geometry.cell_box(0, 0, (4, 4)) == pytest.approx((0, 0, 12, 0))  # empty: all padding
    np.testing.assert_allclose(geometry.coverage((4, 4))[:, 0], [0.0, 1.0, 1.0, 0.0])
    cells = np.zeros((4, 4))
    cells[1, 2] = 1.0
    pixels = geometry.pixel_map(cells)
    assert pixels.shape == (24, 48) and pixels.sum() == pytest.approx(1.0)
    assert np.array_equal(np.argwhere(pixels > 0)[[0, -1]], [[0, 24], [11, 35]])  # rows 0..11, cols 24..35
    np.testing.assert_allclose(pixels[pixels > 0], 1 / 144)
    maps = token_maps(torch.tensor([0.0] * 4 + [1.0] * 12), torch.tensor([[1, 4, 4]]), images=[(48, 24)],
                      image_processor=fixed("pad"))
    assert maps[0].outside == pytest.approx(1 / 3)  # row 3 is padding (row 0 has no evidence): its share is dropped
    assert maps[0].pixels.sum() == pytest.approx(1.0) and maps[0].quadrants()["top_left"] == pytest.approx(0.25)
    only_padding = token_maps(torch.tensor([1.0] + [0.0] * 15), torch.tensor([[1, 4, 4]]), images=[(48, 24)],
                              image_processor=fixed("pad"))[0]
    assert only_padding.outside == pytest.approx(1.0) and not only_padding.pixels.any()


def test_crop_mode_maps_only_the_centre_the_model_saw_and_qwen_maps_the_whole_resized_image():
    crop = geometry_for(fixed("crop"), 32, 64)  # shortest edge 32 -> 32 x 64, centre crop x 16..48
    assert crop.seen_box() == (16.0, 0.0, 48.0, 32.0)
    pixels = crop.pixel_map(np.full((4, 4), 1 / 16))
    assert not pixels[:, :16].any() and not pixels[:, 48:].any()
    assert pixels[:, 16:48] == pytest.approx(np.full((32, 32), 1 / 1024))
    dynamic = geometry_for(qwen(), 45, 70)  # smart resize to multiples of 16
    assert dynamic.processed == (48, 64) and dynamic.seen_box() == (0.0, 0.0, 70.0, 45.0)
    box = dynamic.cell_box(0, 3, (3, 4))
    assert box == pytest.approx((70 * 3 / 4, 0.0, 70.0, 45 / 3))


def test_token_maps_read_merge_window_order_and_split_the_evidence_per_image():
    """Two images: a 2 x 4 grid stored in 2 x 2 windows, and a 2 x 2 grid; scores follow the stored order."""
    grids = torch.tensor([[1, 2, 4], [1, 2, 2]])
    window_order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    scores = torch.tensor([10.0 * r + c for r, c in window_order] + [-1.0, 3.0, 0.0, 1.0])
    first, second = token_maps(scores, grids, window=2)
    expected = np.array([[0, 1, 2, 3], [10, 11, 12, 13]], dtype=float)
    np.testing.assert_array_equal(first.scores[0], expected)
    np.testing.assert_allclose(first.tokens, expected / expected.sum())
    np.testing.assert_allclose(second.tokens, [[0, 0.75], [0, 0.25]])  # positive part: -1 is not evidence
    assert first.image_share == pytest.approx(52 / 56) and second.image_share == pytest.approx(4 / 56)
    absolute = token_maps(scores, grids, window=2, rule="absolute")[1]
    np.testing.assert_allclose(absolute.tokens, [[0.2, 0.6], [0, 0.2]])
    assert quadrant_shares(np.array([[1.0, 0, 0], [0, 0, 0], [0, 0, 1.0]])) == {
        "top_left": 0.5, "top_right": 0.0, "bottom_left": 0.0, "bottom_right": 0.5}
    assert quadrant_shares(np.ones((3, 3)))["top_left"] == pytest.approx(0.25)  # the middle row and column split


# ---- the attribution itself -------------------------------------------------------------------------------------
def random_prompt(names, seed=0, size=(40, 24)):
    torch.manual_seed(seed)
    model = mmadapt.build_model(*names).eval()
    tokenizer = char_tokenizer()
    processor = Processor.for_model(model, tokenizer)
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    inputs = processor(f"<image>\n{QUESTION}", images=[image])
    answer = torch.tensor(tokenizer.encode("blue", add_special_tokens=False))
    return model, processor, image, inputs, answer


def hooked_scores(model, inputs, answer):
    """Gradient x input through the model's own `forward`, the projector output replaced by a leaf (reference)."""
    leaf = {}

    def hook(module, args, output):
        leaf["features"] = output.features.detach().requires_grad_(True)
        return dataclasses.replace(output, features=leaf["features"])

    ids = torch.cat([inputs["input_ids"][0], answer])[None]
    handle = model.projector.register_forward_hook(hook)
    try:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool),
                       pixel_values=inputs["pixel_values"], image_grid_thw=inputs.get("image_grid_thw")).logits
    finally:
        handle.remove()
    logp = logits[0, -answer.numel() - 1 : -1].log_softmax(-1).gather(-1, answer[:, None]).sum()
    (grad,) = torch.autograd.grad(logp, leaf["features"])
    return (grad * leaf["features"]).sum(-1).detach(), logp.item()


@pytest.mark.parametrize("names", [LLAVA, QWEN, ("clip", "mlp2x_gelu", "qwen3_5"), ("qwen3_5_vit", "qwen_merger",
                                                                                     "llama")],
                         ids=["llava", "qwen", "clip-qwen3_5", "qwenvit-llama"])
def test_evidence_reproduces_the_models_own_forward_and_integrated_gradients_are_complete(names):
    """steps=1 equals gradient x input through `model.forward` (1-D RoPE and M-RoPE, every encoder kind); with
    steps > 1 the scores sum to log p(answer) - log p(answer | empty visual tokens)."""
    model, _, _, inputs, answer = random_prompt(names)
    expected, logp = hooked_scores(model, inputs, answer)
    (plain,) = evidence(model, inputs, answer, method=Integrated(steps=1))
    visual = model.encode_images(inputs["pixel_values"], inputs.get("image_grid_thw"))
    (reference,) = token_maps(expected, visual.grids, visual.window)
    np.testing.assert_allclose(plain.scores, reference.scores, rtol=1e-4, atol=1e-7)
    assert plain.objective == pytest.approx(logp, abs=1e-5)
    (integrated,) = evidence(model, inputs, answer, method=Integrated(steps=128), batch_size=64)
    assert integrated.objective == pytest.approx(logp, abs=1e-5)
    delta = integrated.objective - integrated.baseline_objective
    assert integrated.scores.sum() == pytest.approx(delta, rel=0.02, abs=1e-5)


def cell_painting(processor, size: tuple[int, int], grid: tuple[int, int]) -> Image.Image:
    """An image whose processed pixels show each LLM token cell (row-major) as grey level 10 * (cell + 1)."""
    height, width = size
    rows = np.arange(height)[:, None] * grid[0] // height
    cols = np.arange(width)[None, :] * grid[1] // width
    return Image.fromarray(np.repeat((10 * (rows * grid[1] + cols + 1)).astype(np.uint8)[..., None], 3, -1))


@pytest.mark.parametrize("names", [LLAVA, QWEN], ids=["fixed", "qwen"])
def test_cell_index_puts_every_processed_pixel_in_the_token_cell_it_feeds(names):
    """Fixed-size pixel grids and Qwen's patch rows in merge-window order: the cell `cell_index` gives each element
    of pixel_values is the cell whose grey level the processor put there (so a mask hides exactly those cells)."""
    torch.manual_seed(0)
    model = mmadapt.build_model(*names)
    processor = Processor.for_model(model, char_tokenizer())
    size = 32 if names == LLAVA else 64
    inputs = processor(f"<image><image>\n{QUESTION}", images=[cell_painting(processor, (size, size), (4, 4))] * 2)
    grids = model.encode_images(inputs["pixel_values"], inputs.get("image_grid_thw")).grids
    assert grids.tolist() == [[1, 4, 4]] * 2
    cells = cell_index(inputs["pixel_values"], inputs.get("image_grid_thw"), grids)
    mean, std = processor.encoder.processor.mean[0], processor.encoder.processor.std[0]
    # the first channel, back to 0..255: (I, 1, S, S) fixed-size; (P, 2 x 8 x 8) per Qwen patch row
    values = inputs["pixel_values"][:, :1] if names == LLAVA else inputs["pixel_values"][:, : 2 * 8 * 8]
    grey = torch.round(values * std * 255 + mean * 255)
    np.testing.assert_array_equal(grey, (10 * (cells % 16 + 1)).expand_as(grey).float())
    assert sorted(cells.unique().tolist()) == list(range(32))


@pytest.mark.parametrize("names", [LLAVA, QWEN, ("qwen3_vl_vit", "qwen_merger", "qwen3_vl")],
                         ids=["llava", "qwen", "qwen3_vl-deepstack"])
def test_occlusion_scores_are_the_models_own_forward_with_the_cells_at_the_mean_colour(names):
    """Each occlusion window's drop - exp(log p(answer) / T) with the image minus the same with the window's pixels
    at the processor's mean colour (0 after normalising), both through `model.forward` (DeepStack levels
    included) - shared by its cells, summed over the windows of 1 x 1 and 2 x 2 cells; faithfulness measures
    p(answer) = f ** T and returns a score consistent with its areas."""
    model, processor, image, inputs, answer = random_prompt(names, size=(64, 64))
    (heat,) = evidence(model, inputs, answer, rule="absolute", images=[image],
                       image_processor=processor.encoder.processor)
    visual = model.encode_images(inputs["pixel_values"], inputs.get("image_grid_thw"))
    cells = cell_index(inputs["pixel_values"], inputs.get("image_grid_thw"), visual.grids)
    ids = torch.cat([inputs["input_ids"][0], answer])[None]

    def f(pixels):
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), pixel_values=pixels,
                           image_grid_thw=inputs.get("image_grid_thw")).logits
        logp = logits[0, -answer.numel() - 1 : -1].log_softmax(-1).gather(-1, answer[:, None]).sum()
        return float((logp / answer.numel()).exp())

    full = f(inputs["pixel_values"])
    windows = occlusion_blocks(visual.grids)  # 16 single cells and 9 windows of 2 x 2 cells
    assert windows.shape == (25, 16)
    drops = torch.tensor([full - f(inputs["pixel_values"] * (1 - window.float()[cells])) for window in windows])
    expected = ((drops[:, None] * windows / windows.sum(1, keepdim=True)).sum(0)).reshape(heat.grid).numpy()
    np.testing.assert_allclose(heat.scores[0], expected, rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(heat.tokens, np.abs(expected) / np.abs(expected).sum(), atol=2e-4)
    assert heat.pixels.sum() == pytest.approx(1.0) and heat.method == Occlusion()
    assert heat.summary()["samples"] == 0 and heat.summary()["steps"] == 0
    measured = faithfulness(model, inputs, answer, [heat], steps=4, orders=3)
    p = full ** answer.numel()  # p(answer): f to the T-th power
    blank = f(torch.zeros_like(inputs["pixel_values"])) ** answer.numel()
    assert measured.full == pytest.approx(p, rel=1e-3) and measured.blank == pytest.approx(blank, rel=1e-3)
    # the deletion and insertion curves of the map's order (no ties in an absolute map), through model.forward:
    # the first 4, 8, 12 of the 16 cells at the mean colour / only they shown; trapezoids over 0, 1/4, ..., 1
    order = np.argsort(-heat.tokens.flatten(), kind="stable")
    first = [torch.isin(cells, torch.as_tensor(order[:n])).float() for n in (4, 8, 12)]
    deleted = [f(inputs["pixel_values"] * (1 - m)) ** answer.numel() / p for m in first]
    inserted = [f(inputs["pixel_values"] * m) ** answer.numel() / p for m in first]
    x = [0.0, 0.25, 0.5, 0.75, 1.0]
    assert measured.deletion == pytest.approx(np.trapezoid([1.0, *deleted, blank / p], x), rel=1e-3)
    assert measured.insertion == pytest.approx(np.trapezoid([blank / p, *inserted, 1.0], x), rel=1e-3)
    assert measured.orders == 3 and len(measured.insertion_random) == 3
    pairs = zip(measured.deletion_random, measured.insertion_random, strict=True)
    assert measured.random_scores == pytest.approx([((d - measured.deletion) + (measured.insertion - i)) / 2
                                                    for d, i in pairs])
    assert measured.score == pytest.approx(np.mean(measured.random_scores))
    assert measured.wins == sum(s > 0 for s in measured.random_scores)
    assert measured.trusted == (measured.decisive and measured.wins == 3)
    assert measured.decisive == (np.log(p) - np.log(blank) >= 0.1)
    blocks = occlusion_blocks(torch.tensor([[1, 20, 10]]), sizes=(1,))  # 3 x 2 cells a block: 7 x 5 blocks
    assert blocks.shape == (35, 200) and blocks.sum(0).eq(1).all()
    assert occlusion_blocks(torch.tensor([[1, 24, 24]])).shape == (64 + 49, 576)  # the bound: 114 forwards


def test_evidence_leaves_the_model_as_it_was_and_refuses_what_it_cannot_explain():
    model, processor, image, inputs, answer = random_prompt(LLAVA)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (heat,) = evidence(model, inputs, answer, images=[image], image_processor=processor.encoder.processor,
                       method=Integrated(steps=4))
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert heat.pixels.shape == (24, 40) and heat.pixels.sum() == pytest.approx(1.0)
    assert heat.tokens.sum() == pytest.approx(1.0) and heat.method == Integrated(steps=4)
    padded = {**inputs, "input_ids": torch.cat([inputs["input_ids"], torch.ones(1, 3, dtype=torch.long)], 1),
              "attention_mask": torch.cat([inputs["attention_mask"], torch.zeros(1, 3, dtype=torch.bool)], 1)}
    np.testing.assert_allclose(evidence(model, padded, answer, method=Integrated(steps=4))[0].scores, heat.scores,
                               rtol=1e-4, atol=1e-7)
    (occluded,) = evidence(model, inputs, answer)
    assert occluded.method == Occlusion() and model.training and all(p.grad is None for p in model.parameters())
    np.testing.assert_allclose(evidence(model, padded, answer)[0].scores, occluded.scores, rtol=1e-4, atol=1e-9)
    with pytest.raises(ValueError, match="one prompt"):
        evidence(model, {**inputs, "input_ids": inputs["input_ids"].repeat(2, 1)}, answer)
    with pytest.raises(ValueError, match="no images"):
        evidence(model, {**inputs, "pixel_values": None}, answer)
    with pytest.raises(ValueError, match="unknown rule"):
        evidence(model, inputs, answer, rule="signed")
    with pytest.raises(TypeError, match="unknown method"):
        evidence(model, inputs, answer, method="lime")
    with pytest.raises(ValueError, match="each >= 1"):
        evidence(model, inputs, answer, method=Occlusion(windows=(0, 2)))
    with pytest.raises(contract.ImageTokenContractError):  # an image placeholder inside the "answer"
        evidence(model, inputs, torch.tensor([model.tokens.image_token_id]))
    for wrong in (qwen(), FixedSizeProcessor(image_size=64, mean=CLIP_MEAN, std=(0.3,) * 3, tokens_per_image=64)):
        with pytest.raises(ValueError, match="does not give the model's token grid"):
            evidence(model, inputs, answer, images=[image], image_processor=wrong)


def test_render_writes_a_png_of_the_original_image_with_the_map(tmp_path):
    model, processor, image, inputs, answer = random_prompt(LLAVA, size=(64, 40))
    (heat,) = evidence(model, inputs, answer, images=[image], image_processor=processor.encoder.processor)
    path = render(image, heat, tmp_path / "out" / "map.png", prompt=QUESTION, answer="blue")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(path).size[0] >= 400
    cropped = token_maps(torch.rand(16), torch.tensor([[1, 4, 4]]), images=[image],
                         image_processor=processor_for(model, mode="crop"))[0]
    assert render(image, cropped, tmp_path / "crop.png").stat().st_size > 0  # the unseen sides are hatched
    assert render(image, np.random.rand(4, 4), tmp_path / "array.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no pixels"):
        render(image, EvidenceMap(0, np.zeros((1, 4, 4)), np.zeros((4, 4)), "positive", 0.0, 0.0), tmp_path / "x.png")


def explain_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmadapt")
    add_explain_command(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("names", [LLAVA, QWEN], ids=["llava", "qwen"])
def test_cmd_explain_answers_and_writes_the_png_for_a_saved_model(names, tmp_path, capsys):
    torch.manual_seed(0)
    model = mmadapt.build_model(*names)
    tokenizer = char_tokenizer()
    Processor.for_model(model, tokenizer)  # adds the span tokens the saved tokenizer must hold
    model.save_pretrained(tmp_path / "model", tokenizer=tokenizer)
    corner_image(np.random.default_rng(0), 48, "red").crop((0, 0, 48, 30)).save(tmp_path / "corner.png")
    png, summary = tmp_path / "map.png", tmp_path / "map.json"
    argv = ["explain", str(tmp_path / "model"), "--image", str(tmp_path / "corner.png"), "What", "colour", "is", "it?",
            "--out", str(png), "--max-new-tokens", "3", "--curve-steps", "4", "--json", str(summary)]
    args, extra = explain_parser().parse_known_args(argv)
    args.prompt = [*args.prompt, *extra]  # what mmadapt.cli.main does for `chat` (prompt words after an option)
    assert args.prompt == ["What", "colour", "is", "it?"]
    assert args.func(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"wrote {png}" and png.read_bytes()[:4] == b"\x89PNG"
    assert printed[1].startswith("evidence (positive part, occlusion of token-cell windows 1x1+2x2 at the pixels): "
                                 "top-left")
    import json

    saved = json.loads(summary.read_text())
    assert saved["answer"] == printed[0] and saved["prompt"] == "What colour is it?"
    assert saved["method"] == "occlusion" and saved["windows"] == [1, 2] and saved["curve_steps"] == 4
    assert saved["original_size"] == [30, 48] and sum(saved["quadrants"].values()) == pytest.approx(1.0, abs=1e-6)
    effect = saved["objective"] - saved["baseline_objective"]
    assert saved["image_effect"] == pytest.approx(effect) and saved["rests_on_image"] == (effect >= 0.1)
    assert printed[2].startswith(f"image effect: log p(answer) is {effect:+.2f} nats with the image than with the "
                                 "image at the mean colour")
    assert ("below 0.1: the model gives this answer about as readily without the image" in printed[2]) == (
        effect < 0.1)
    score = saved["faithfulness"]
    assert printed[3].startswith(f"faithfulness {score:+.2f} (0 = a random map; beats {saved['wins']} of 8 random "
                                 f"orders; deletion AUC {saved['deletion_auc']:.2f} vs "
                                 f"{saved['deletion_auc_random']:.2f} random")
    verdict = ("say nothing about the map" if not saved["decisive"] else "the map beats every random order"
               if saved["wins"] == 8 else "do not trust it")
    assert printed[3].endswith(verdict) and saved["trusted"] == (saved["decisive"] and saved["wins"] == 8)
    assert saved["random_orders"] == 8

    argv = ["explain", str(tmp_path / "model"), "Colour?", "--image", str(tmp_path / "corner.png"), "--out", str(png),
            "--max-new-tokens", "3", "--method", "integrated", "--steps", "4", "--curve-steps", "0"]
    args = explain_parser().parse_args(argv)
    assert args.func(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("evidence (positive part, integrated gradients at the visual tokens, 4 steps): ")
    assert "than with empty visual tokens" in printed[2] and not any(p.startswith("faithfulness") for p in printed)
    args = explain_parser().parse_args(["explain", str(tmp_path / "model"), "--image", str(tmp_path / "corner.png")])
    with pytest.raises(ValueError, match="give a PROMPT"):
        args.func(args)
    for wrong in ("0,2", "1,x"):
        with pytest.raises(SystemExit):
            explain_parser().parse_args(["explain", "m", "--image", "x.png", "--windows", wrong])


def test_the_faithfulness_line_says_whether_to_trust_the_map():
    """`mmadapt explain`'s last line: a map that beats every random order on an answer that rests on the pixels is
    trusted; one that loses to any is flagged; an answer the mean-colour image gives as readily says nothing."""
    from mmadapt.evidence import Explanation, Faithfulness

    (heat,) = token_maps(torch.rand(16), torch.tensor([[1, 4, 4]]), images=[(32, 32)], image_processor=fixed("pad"))
    heat = dataclasses.replace(heat, method=Occlusion(windows=(1, 2)), objective=-0.1, baseline_objective=-2.0)

    def line(deletion: float, full: float, blank: float) -> str:
        measured = Faithfulness(deletion, 0.8, (0.5, 0.6, 0.7), (0.5, 0.5, 0.9), full, blank, 8)
        lines = Explanation("blue", (), dataclasses.replace(heat, faithfulness=measured)).lines()
        assert lines[0].startswith("evidence (positive part, occlusion of token-cell windows 1x1+2x2 at the pixels)")
        assert lines[1].startswith("image effect: log p(answer) is +1.90 nats with the image than with the image at")
        return lines[2]

    # against the three random orders: ((0.5 - 0.2) + (0.8 - 0.5)) / 2 = 0.3, 0.35, 0.2: mean 0.28, all won
    assert line(0.2, 0.9, 0.1) == ("faithfulness +0.28 (0 = a random map; beats 3 of 3 random orders; deletion AUC "
                                   "0.20 vs 0.60 random, insertion AUC 0.80 vs 0.63): the map beats every random order")
    # 0.025, 0.075, -0.075: the third order wins
    assert line(0.75, 0.9, 0.1) == ("faithfulness +0.01 (0 = a random map; beats 2 of 3 random orders; deletion AUC "
                                    "0.75 vs 0.60 random, insertion AUC 0.80 vs 0.63): the map does NOT beat every "
                                    "random order: do not trust it")
    assert line(0.2, 0.9, 0.85).endswith("the image's pixels barely move this answer, so the curves are flat and say "
                                         "nothing about the map")
