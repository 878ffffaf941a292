"""Evidence maps: the geometry of every processor mode, attribution on a task whose answer lives in one quadrant,
the model's own forward reproduced, `render` and `mmadapt explain` end to end.

The quadrant task: 32 x 32 images whose top-left quadrant is red or blue (the answer) while the other three are
pixel noise or solid colours - red and blue among them - that carry no signal. A model that learned the task
must rest its answer on the top-left quadrant, so its evidence map must put far more than the uniform 25% there.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import mmadapt
from mmadapt import Processor, contract
from mmadapt.cli import add_explain_command
from mmadapt.data import Collator, SampleEncoder, VLMDataset, char_tokenizer
from mmadapt.data.processors import FixedSizeProcessor, QwenProcessor, as_uint8, processor_for
from mmadapt.evidence import (
    EvidenceMap,
    evidence,
    explain,
    geometry_for,
    quadrant_shares,
    render,
    token_maps,
)

LLAVA = ("clip", "mlp2x_gelu", "llama")
QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
QUESTION = "What colour is the top-left corner?"
COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)


# ---- the quadrant task ----------------------------------------------------------------------------------------
def corner_image(rng: np.random.Generator, size: int, label: str) -> Image.Image:
    """Top-left quadrant: the label's colour (jittered); each other quadrant: noise, red, blue or a random colour."""
    half = size // 2
    pixels = np.empty((size, size, 3), dtype=np.uint8)
    for qy in (0, 1):
        for qx in (0, 1):
            block = pixels[qy * half : (qy + 1) * half, qx * half : (qx + 1) * half]
            if (qy, qx) == (0, 0):
                block[:] = np.array(COLOURS[label]) + rng.integers(-25, 26, 3)
            elif rng.random() < 0.5:
                block[:] = rng.integers(0, 256, (half, half, 3))
            elif rng.random() < 0.6:
                block[:] = list(COLOURS.values())[rng.integers(2)]
            else:
                block[:] = rng.integers(0, 256, 3)
    return Image.fromarray(pixels)


def corner_records(root: Path, n: int, size: int, seed: int, prefix: str) -> list[dict]:
    """n PNGs under root/images and their LLaVA records (answers balanced at random)."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for k in range(n):
        label = "red" if rng.random() < 0.5 else "blue"
        name = f"images/{prefix}-{k:04d}.png"
        corner_image(rng, size, label).save(root / name)
        records.append({"id": f"{prefix}-{k}", "image": name, "conversations": [
            {"from": "human", "value": f"<image>\n{QUESTION}"}, {"from": "gpt", "value": label}]})
    return records


def train_corner_model(names: tuple[str, ...], root: Path, *, size: int = 32, steps: int = 100, lr: float = 3e-3,
                       encoder_stage: str = "full", seed: int = 0) -> tuple:
    """(model, tokenizer, held-out records, seconds): mmadapt's own pipeline and trainer, fixed seeds."""
    from mmadapt.train import RunConfig, Trainer

    started = time.perf_counter()
    train = corner_records(root, 256, size, seed, "train")
    held_out = corner_records(root, 24, size, seed + 1, "eval")
    torch.manual_seed(seed)
    model = mmadapt.build_model(*names)
    tokenizer = char_tokenizer()
    encoder = SampleEncoder.for_model(model, tokenizer, image_root=str(root))
    config = RunConfig.load(None, [f"train.out={root / 'run'}", f"train.steps={steps}", f"train.lr={lr}",
                                   "train.warmup_steps=5", "data.batch_size=16", "train.progress=false",
                                   f"train.seed={seed}", f"stages.encoder={encoder_stage}", "checkpoint.keep=1"])
    Trainer(model, config, VLMDataset(train, encoder), Collator.for_model(model, encoder.pad_token_id)).fit()
    return model.eval(), tokenizer, held_out, time.perf_counter() - started


def quadrant_report(model, tokenizer, root: Path, records: list[dict], **options) -> dict:
    """Accuracy of `explain` on `records` and the top-left shares of its maps (over the answers that rest on the
    image: the others have no evidence to map, see `EvidenceMap.rests_on_image`)."""
    processor = Processor.for_model(model, tokenizer)
    started, correct, top_left, peaks, effects = time.perf_counter(), 0, [], 0, []
    for record in records:
        result = explain(model, processor, root / record["image"], QUESTION, max_new_tokens=6, **options)
        correct += result["answer"] == record["conversations"][1]["value"]
        effects.append(result["image_effect"])
        if not result["rests_on_image"]:
            continue
        shares = result["quadrants"]
        top_left.append(shares["top_left"])
        peaks += max(shares, key=shares.get) == "top_left"
    return {"accuracy": correct / len(records), "top_left": float(np.mean(top_left)),
            "top_left_min": float(np.min(top_left)), "peak_top_left": peaks / len(top_left),
            "resting": len(top_left) / len(records), "effects": [round(e, 3) for e in effects],
            "seconds": time.perf_counter() - started}


@pytest.fixture(scope="module")
def llava_corner(tmp_path_factory):
    root = tmp_path_factory.mktemp("corner_llava")
    return (root, *train_corner_model(LLAVA, root))


@pytest.mark.slow
def test_the_map_of_a_trained_llava_model_finds_the_quadrant_its_answer_depends_on(llava_corner):
    root, model, tokenizer, held_out, train_seconds = llava_corner
    report = quadrant_report(model, tokenizer, root, held_out)
    print(f"clip + mlp2x_gelu + llama: trained in {train_seconds:.1f} s; {report}")
    assert report["accuracy"] >= 0.9  # it learned the task (chance: about 0.5), so its answers rest on the corner
    assert report["top_left"] >= 0.5  # a uniform map gives 0.25
    assert report["peak_top_left"] >= 0.8


@pytest.mark.slow
def test_plain_gradient_x_input_is_kept_but_integrated_gradients_is_the_default_for_a_reason(llava_corner):
    """steps=1 (one backward) is the plain method; on the same model and images it finds the corner far less
    reliably, which is why the default integrates over the path from empty tokens (see the module docstring)."""
    root, model, tokenizer, held_out, _ = llava_corner
    plain = quadrant_report(model, tokenizer, root, held_out[:12], steps=1)
    default = quadrant_report(model, tokenizer, root, held_out[:12])
    print(f"top-left share: plain gradient x input {plain['top_left']:.3f}, integrated {default['top_left']:.3f}")
    assert default["top_left"] > plain["top_left"] + 0.1


@pytest.mark.slow
def test_the_map_of_a_dynamic_resolution_encoder_finds_the_quadrant_its_answer_depends_on(tmp_path):
    """qwen3_5_vit + qwen_merger at 64 px: 8 x 8 patches in merge-window order -> 4 x 4 LLM tokens, M-RoPE-free
    llama so that the encoder side is what is tested. The ViT stays frozen: a trained ViT may legitimately move the
    corner's information into other tokens (the map shows where the LLM reads it: top-left share 0.42 / 0.80 /
    0.88 for seeds 0 / 1 / 2 with a trained ViT, 0.86 / 0.96 / 0.91 frozen)."""
    model, tokenizer, held_out, train_seconds = train_corner_model(("qwen3_5_vit", "qwen_merger", "llama"), tmp_path,
                                                                   size=64, encoder_stage="frozen")
    report = quadrant_report(model, tokenizer, tmp_path, held_out[:12])
    print(f"qwen3_5_vit + qwen_merger + llama (64 px, 4 x 4 tokens): trained in {train_seconds:.1f} s; {report}")
    assert report["accuracy"] >= 0.9
    assert report["top_left"] >= 0.5
    assert report["peak_top_left"] >= 0.8


@pytest.mark.slow
def test_the_map_of_a_qwen3_5_model_prefers_the_quadrant_and_flags_answers_without_evidence(tmp_path):
    """The whole Qwen stack (qwen3_5 backbone: Gated DeltaNet + gated attention, M-RoPE, trained ViT). Measured
    limits, both true of the model rather than errors of the map: (1) it learned "red" as its answer without an
    image (log p(red | empty visual tokens) = -0.06), so a red answer rests on no evidence (image effect about
    0.01 nats) and is flagged, not mapped; (2) for blue answers the trained ViT has copied the corner's
    information into every token (zeroing the corner's four tokens leaves log p(blue) at -0.06, zeroing the other
    twelve too), so the token-level map is spread over redundant copies: its mean top-left share is not a property
    of the method but of how the tiny model trained, which differs with the machine's floating point (0.45 / 0.64
    on seeds 0 / 1 where this was written, 0.40 and 0.46 with 2 and 1 threads on another machine, 0.21 on a
    third), so it is printed, not asserted, until the map localises through the encoder; a frozen-ViT llama reads
    0.86-0.96 from the corner's tokens. Asserted is what holds on every machine: the model learned the task, at
    most one answer (its answer without the image: "red" on every machine measured so far) is flagged, and the
    other answers rest on the image (3.6 nats measured; at least ln 2 = 0.69 for a model that reads the answer from
    the image and would guess between the two colours without it).

    Which colour the model defaults to without the image, and how strongly, is itself a property of the training
    run (a vocabulary one token larger moved it from red at -0.06 nats to blue at about -0.18: effects 1.71 nats
    for red, 0.18 for blue on this machine with 1 and 2 threads), so no single answer's effect is asserted either.
    What holds whatever the default: with confident answers q = p(answer | image), the two colours' effects sum to
    2 log q - log p(red | empty) - log p(blue | empty) >= 2 log q + 2 ln 2 (the two probabilities without the
    image sum to at most 1), about 1.2 nats for q >= 0.9; at least 1.0 is required (1.89 measured here, 3.6
    where first written), and at most one colour can be flagged. The pixel-level map of issue 23 replaces this
    token-level check."""
    model, tokenizer, held_out, train_seconds = train_corner_model(QWEN, tmp_path, size=64)
    report = quadrant_report(model, tokenizer, tmp_path, held_out[:12])
    print(f"qwen3_5_vit + qwen_merger + qwen3_5 (64 px, 4 x 4 tokens): trained in {train_seconds:.1f} s; {report}")
    assert report["accuracy"] >= 0.9
    labels = [r["conversations"][1]["value"] for r in held_out[:12]]
    by_label = {label: float(np.mean([e for lab, e in zip(labels, report["effects"], strict=True) if lab == label]))
                for label in set(labels)}
    assert len(by_label) == 2, by_label  # both colours among the held-out answers
    assert sum(by_label.values()) >= 1.0, by_label  # the image tells the colours apart
    assert sum(effect < 0.1 for effect in by_label.values()) <= 1, by_label  # at most the default answer flagged


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
    (plain,) = evidence(model, inputs, answer, steps=1)
    visual = model.encode_images(inputs["pixel_values"], inputs.get("image_grid_thw"))
    (reference,) = token_maps(expected, visual.grids, visual.window)
    np.testing.assert_allclose(plain.scores, reference.scores, rtol=1e-4, atol=1e-7)
    assert plain.objective == pytest.approx(logp, abs=1e-5)
    (integrated,) = evidence(model, inputs, answer, steps=128, batch_size=64)
    assert integrated.objective == pytest.approx(logp, abs=1e-5)
    delta = integrated.objective - integrated.baseline_objective
    assert integrated.scores.sum() == pytest.approx(delta, rel=0.02, abs=1e-5)


def test_evidence_leaves_the_model_as_it_was_and_refuses_what_it_cannot_explain():
    model, processor, image, inputs, answer = random_prompt(LLAVA)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (heat,) = evidence(model, inputs, answer, images=[image], image_processor=processor.encoder.processor, steps=4)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert heat.pixels.shape == (24, 40) and heat.pixels.sum() == pytest.approx(1.0)
    assert heat.tokens.sum() == pytest.approx(1.0) and heat.steps == 4
    padded = {**inputs, "input_ids": torch.cat([inputs["input_ids"], torch.ones(1, 3, dtype=torch.long)], 1),
              "attention_mask": torch.cat([inputs["attention_mask"], torch.zeros(1, 3, dtype=torch.bool)], 1)}
    np.testing.assert_allclose(evidence(model, padded, answer, steps=4)[0].scores, heat.scores, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="one prompt"):
        evidence(model, {**inputs, "input_ids": inputs["input_ids"].repeat(2, 1)}, answer)
    with pytest.raises(ValueError, match="no images"):
        evidence(model, {**inputs, "pixel_values": None}, answer)
    with pytest.raises(ValueError, match="unknown rule"):
        evidence(model, inputs, answer, rule="signed")
    with pytest.raises(contract.ImageTokenContractError):  # an image placeholder inside the "answer"
        evidence(model, inputs, torch.tensor([model.tokens.image_token_id]))
    for wrong in (qwen(), FixedSizeProcessor(image_size=64, mean=CLIP_MEAN, std=(0.3,) * 3, tokens_per_image=64)):
        with pytest.raises(ValueError, match="does not give the model's token grid"):
            evidence(model, inputs, answer, images=[image], image_processor=wrong)


def test_render_writes_a_png_of_the_original_image_with_the_map(tmp_path):
    model, processor, image, inputs, answer = random_prompt(LLAVA, size=(64, 40))
    (heat,) = evidence(model, inputs, answer, images=[image], image_processor=processor.encoder.processor, steps=2)
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
            "--out", str(png), "--max-new-tokens", "3", "--steps", "4", "--json", str(summary)]
    args, extra = explain_parser().parse_known_args(argv)
    args.prompt = [*args.prompt, *extra]  # what mmadapt.cli.main does for `chat` (prompt words after an option)
    assert args.prompt == ["What", "colour", "is", "it?"]
    assert args.func(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"wrote {png}" and png.read_bytes()[:4] == b"\x89PNG"
    assert printed[1].startswith("evidence (positive part, integrated gradients, 4 steps): top-left")
    import json

    saved = json.loads(summary.read_text())
    assert saved["answer"] == printed[0] and saved["prompt"] == "What colour is it?"
    assert saved["original_size"] == [30, 48] and sum(saved["quadrants"].values()) == pytest.approx(1.0, abs=1e-6)
    effect = saved["objective"] - saved["baseline_objective"]
    assert saved["image_effect"] == pytest.approx(effect) and saved["rests_on_image"] == (effect >= 0.1)
    assert printed[2].startswith(f"image effect: log p(answer) is {effect:+.2f} nats with the image")
    assert ("below 0.1: the model gives this answer about as readily without the image" in printed[2]) == (
        effect < 0.1)
    args = explain_parser().parse_args(["explain", str(tmp_path / "model"), "--image", str(tmp_path / "corner.png")])
    with pytest.raises(ValueError, match="give a PROMPT"):
        args.func(args)
