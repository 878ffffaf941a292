"""Same weights, same batch: mmadapt equals transformers' LLaVA and Qwen3.5-VL (fp32, max abs diff <= 1e-5).

Logits are compared at attended positions (padding rows' outputs are undefined in both).
"""

from __future__ import annotations

import pytest
import torch

from mmadapt import VisionLanguageModel
from mmadapt.contract import locate
from mmadapt.positions import mrope_positions
from mmadapt.processor import export_processor
from mmadapt.synthetic import synthetic_batch

ATOL = 1e-5


def hf_inputs(batch: dict, model: VisionLanguageModel) -> dict:
    inputs = {k: v for k, v in batch.items() if k != "images_per_sample"}
    inputs["attention_mask"] = batch["attention_mask"].long()  # transformers' convention
    if model.uses_mrope:
        inputs["mm_token_type_ids"] = (batch["input_ids"] == model.tokens.image_token_id).int()
    return inputs


def assert_same_outputs(ours, theirs, mask: torch.Tensor) -> None:
    diff = (ours.logits - theirs.logits)[mask].abs().max().item()
    assert diff <= ATOL, f"max |logit diff| {diff:.2e} > {ATOL}"
    assert abs(ours.loss.item() - theirs.loss.item()) <= ATOL


def qwen_batch(model: VisionLanguageModel) -> dict:
    # sample 0: one 32x32 image; sample 1: two images, 48x64 and 64x32 (different grids); right padding
    return synthetic_batch(model, (1, 2), image_sides=[32, (48, 64), (64, 32)], text_lengths=[9, 5])


@pytest.fixture(scope="module")
def qwen_pair(hf_qwen_dir):
    from transformers import Qwen3_5ForConditionalGeneration

    return VisionLanguageModel.from_pretrained(hf_qwen_dir).eval(), \
        Qwen3_5ForConditionalGeneration.from_pretrained(hf_qwen_dir).eval()


@pytest.fixture(scope="module")
def llava_pair(hf_llava_dir):
    from transformers import LlavaForConditionalGeneration

    return VisionLanguageModel.from_pretrained(hf_llava_dir).eval(), \
        LlavaForConditionalGeneration.from_pretrained(hf_llava_dir).eval()


def test_qwen3_5_loads_as_the_right_components(qwen_pair):
    ours, _ = qwen_pair
    assert (ours.config.encoder.name, ours.config.projector.name, ours.config.backbone.name) == \
        ("qwen3_5_vit", "qwen_merger", "qwen3_5")


def test_qwen3_5_logits_and_loss_match_transformers(qwen_pair):
    ours, theirs = qwen_pair
    batch = qwen_batch(ours)
    assert batch["attention_mask"].sum(1).tolist()[0] != batch["attention_mask"].shape[1]  # really padded
    with torch.no_grad():
        assert_same_outputs(ours(**batch), theirs(**hf_inputs(batch, ours)), batch["attention_mask"])


def test_mrope_positions_match_get_rope_index(qwen_pair):
    ours, theirs = qwen_pair
    batch = qwen_batch(ours)
    inputs = hf_inputs(batch, ours)
    expected, _ = theirs.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                              image_grid_thw=inputs["image_grid_thw"],
                                              attention_mask=inputs["attention_mask"])
    with torch.no_grad():
        visual = ours.encode_images(batch["pixel_values"], batch["image_grid_thw"])
    got = mrope_positions(batch["attention_mask"], locate(batch["input_ids"], ours.tokens.image_token_id), visual)
    assert torch.equal(got, expected)


def test_mrope_positions_match_with_left_padding(qwen_pair):
    ours, theirs = qwen_pair
    batch = qwen_batch(ours)
    order = torch.argsort(batch["attention_mask"].int(), dim=1, stable=True)
    ids, mask = batch["input_ids"].gather(1, order), batch["attention_mask"].gather(1, order)
    expected, _ = theirs.model.get_rope_index(ids, (ids == 250).int(), image_grid_thw=batch["image_grid_thw"],
                                              attention_mask=mask.long())
    with torch.no_grad():
        visual = ours.encode_images(batch["pixel_values"], batch["image_grid_thw"])
    assert torch.equal(mrope_positions(mask, locate(ids, 250), visual), expected)


def test_llava_logits_and_loss_match_transformers(llava_pair):
    ours, theirs = llava_pair
    assert (ours.config.encoder.name, ours.config.projector.name, ours.config.backbone.name) == \
        ("clip", "mlp2x_gelu", "llama")
    batch = synthetic_batch(ours, (1, 2), text_lengths=[9, 4])
    with torch.no_grad():
        assert_same_outputs(ours(**batch), theirs(**hf_inputs(batch, ours)), batch["attention_mask"])


@pytest.mark.parametrize("pair", ["qwen_pair", "llava_pair"])
def test_transformers_export_reloads_with_same_logits(pair, request, tmp_path):
    import transformers

    ours, theirs = request.getfixturevalue(pair)
    ours.save_pretrained(tmp_path, format="transformers", processor_export=export_processor)
    reloaded, info = getattr(transformers, type(theirs).__name__).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if ours.uses_mrope:  # every span token is the model's own, the video pad included (not transformers' default)
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            assert getattr(reloaded.config, name) == getattr(ours.tokens, name), name
    batch = qwen_batch(ours) if ours.uses_mrope else synthetic_batch(ours, (2, 1))
    with torch.no_grad():
        assert_same_outputs(ours(**batch), reloaded.eval()(**hf_inputs(batch, ours)), batch["attention_mask"])


@pytest.mark.parametrize("pair", ["qwen_pair", "llava_pair"])
def test_mmadapt_format_round_trip(pair, request, tmp_path):
    ours, _ = request.getfixturevalue(pair)
    ours.save_pretrained(tmp_path)
    again = VisionLanguageModel.from_pretrained(tmp_path).eval()
    batch = synthetic_batch(ours, (1, 1))
    with torch.no_grad():
        assert torch.equal(ours(**batch).logits, again(**batch).logits)


@pytest.mark.parametrize("pair", ["qwen_pair", "llava_pair"])
def test_greedy_generate_matches_transformers(pair, request):
    ours, theirs = request.getfixturevalue(pair)
    batch = synthetic_batch(ours, (1,), text_lengths=[4])
    inputs = {k: v for k, v in hf_inputs(batch, ours).items() if k != "labels"}
    expected = theirs.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[:, batch["input_ids"].shape[1]:]
    got = ours.generate(batch["input_ids"], batch["attention_mask"], batch["pixel_values"],
                        batch.get("image_grid_thw"), max_new_tokens=6)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("pair", ["qwen_pair", "llava_pair"])
def test_batched_generate_equals_one_by_one(pair, request):
    ours, _ = request.getfixturevalue(pair)
    batch = synthetic_batch(ours, (1, 2), text_lengths=[7, 3])
    together = ours.generate(batch["input_ids"], batch["attention_mask"], batch["pixel_values"],
                             batch.get("image_grid_thw"), max_new_tokens=5)
    for b in range(2):
        row = batch["attention_mask"][b]
        n_img = int(batch["images_per_sample"][b])
        first = int(batch["images_per_sample"][:b].sum())
        grids = batch.get("image_grid_thw")
        if grids is not None:
            patches = grids.prod(-1)
            start = int(patches[:first].sum())
            pixels = batch["pixel_values"][start : start + int(patches[first : first + n_img].sum())]
            grids = grids[first : first + n_img]
        else:
            pixels = batch["pixel_values"][first : first + n_img]
        alone = ours.generate(batch["input_ids"][b : b + 1, row], None, pixels, grids, max_new_tokens=5)
        assert torch.equal(alone[0], together[b])
