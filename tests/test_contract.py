"""The image-token contract over every registered encoder x projector x backbone (tiny presets).

Each combination must train (finite forward + backward, gradients reaching the projector)
and must refuse each kind of broken batch with an `ImageTokenContractError` naming the sample. The fast tier runs a
set of combinations that holds every encoder x projector, projector x backbone and encoder x backbone pair
(`helpers.pairwise`, 32 of 150); the full suite runs all of them.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import pairwise

import mmadapt
from mmadapt import BACKBONES, ENCODERS, PROJECTORS, ImageTokenContractError, VisionLanguageModel
from mmadapt.contract import check_batch
from mmadapt.synthetic import synthetic_batch

COMBOS = pairwise(ENCODERS.names(), PROJECTORS.names(), BACKBONES.names())
_models: dict = {}


def tiny(encoder: str, projector: str, backbone: str) -> VisionLanguageModel:
    """The combination's tiny model; DeepStack levels that the backbone cannot take must be dropped explicitly."""
    key = (encoder, projector, backbone)
    if key not in _models:
        torch.manual_seed(0)
        lost = ENCODERS.get(encoder).build().deepstack_levels and not BACKBONES.get(backbone).deepstack
        if lost:
            with pytest.raises(ValueError, match=r"DeepStack feature levels .* cannot take them.*deepstack: drop"):
                mmadapt.build_model(*key)
        _models[key] = mmadapt.build_model(*key, deepstack="drop" if lost else "use")
        expected = len(ENCODERS.get(encoder).build().deepstack_levels) if BACKBONES.get(backbone).deepstack else 0
        assert _models[key].levels == expected and len(_models[key].projector.deepstack) == expected
    return _models[key]


def broken_batches(model: VisionLanguageModel) -> dict:
    """name -> (batch, sample the error must name), each violating one contract line."""
    good = lambda: synthetic_batch(model, (1, 2))  # noqa: E731
    image_id, text_id = model.tokens.image_token_id, 3
    cases = {}

    b = good()  # sample 1 loses one whole image span (and its brackets)
    row = b["input_ids"][1]
    first = int((row == image_id).nonzero()[0])
    length = int((row[first:] == image_id).int().cumprod(0).sum())
    bracketed = int(model.tokens.vision_start_token_id is not None)
    row[first - bracketed : first + length + bracketed] = text_id
    cases["span_count"] = (b, 1)

    b = good()  # sample 1's second span is one token short
    row = b["input_ids"][1]
    last = int((row == image_id).nonzero()[-1])
    b["input_ids"][1] = torch.cat([row[:last], row[last + 1 :], row.new_tensor([0])])
    cases["span_length"] = (b, 1)

    b = good()  # images but no spans at all
    b["input_ids"][b["input_ids"] == image_id] = text_id
    cases["images_without_spans"] = (b, 0)

    b = good()  # spans but no images
    b.pop("pixel_values"), b.pop("image_grid_thw", None), b.pop("images_per_sample")
    cases["spans_without_images"] = (b, 0)

    b = good()  # wrong pixel format: fixed-size pixels to a dynamic encoder or the reverse
    if model.encoder.dynamic:
        b["pixel_values"] = torch.randn(3, 3, 32, 32)
    else:
        b["pixel_values"] = torch.randn(48, 3 * 2 * 8 * 8)
    cases["pixel_format"] = (b, 0)

    b = good()  # an image token hidden by the attention mask
    b["attention_mask"][1, int((b["input_ids"][1] == image_id).nonzero()[0])] = False
    cases["masked_image_token"] = (b, 1)

    b = good()  # mm_token_type_ids that disagree with the placeholders
    b["mm_token_type_ids"] = (b["input_ids"] == image_id).int()
    b["mm_token_type_ids"][1, 0] = 1
    cases["token_types"] = (b, 1)

    if model.uses_mrope:  # 1-D positions for image tokens
        b = good()
        b["position_ids"] = torch.arange(b["input_ids"].shape[1]).expand_as(b["input_ids"])
        cases["positions_1d"] = (b, 0)
    return cases


@pytest.mark.parametrize("encoder,projector,backbone", COMBOS)
def test_every_combination_trains_and_enforces_the_contract(encoder, projector, backbone, monkeypatch):
    model = tiny(encoder, projector, backbone)
    model.zero_grad()
    batch = synthetic_batch(model, (1, 2))
    assert check_batch(model, batch).ok
    out = model(**batch)  # training mode with labels: the loss without full logits (mmadapt.loss)
    assert out.logits is None and torch.isfinite(out.loss)
    assert torch.isfinite(model(**batch, return_logits=True).logits).all()
    out.loss.backward()
    # identity has no parameters: then the gradient must reach the encoder through it
    params = list(model.projector.parameters()) or list(model.encoder.parameters())
    reached = [p.grad for p in params if p.grad is not None]
    assert reached and all(torch.isfinite(g).all() for g in reached)
    assert sum(g.abs().sum() for g in reached) > 0, "no gradient reached the projector"

    for name, (broken, sample) in broken_batches(model).items():
        with pytest.raises(ImageTokenContractError, match=rf"^sample {sample}\b") as info:
            model(**broken)
        assert "Fix:" in str(info.value), name
        assert not check_batch(model, broken).ok, name

    # after injection a placeholder embedding remains: a scatter that skips the last image token
    from mmadapt import contract

    real_scatter = contract.scatter

    def leaky_scatter(embeds, spans, features):
        out = real_scatter(embeds, spans, features)
        b, pos = spans.mask.nonzero()[-1]
        out = out.clone()
        out[b, pos] = embeds[b, pos]
        return out

    monkeypatch.setattr(contract, "scatter", leaky_scatter)
    with pytest.raises(ImageTokenContractError, match=r"^sample 1: position \d+ still holds"):
        model(**batch)


def test_projector_width_mismatch_fails_at_build_naming_both():
    config = mmadapt.ModelConfig.from_names("clip", "identity", "llama")
    config.encoder.options = {"hidden_size": 32, "intermediate_size": 64}
    with pytest.raises(ValueError, match=r"encoder width 32 to backbone width 64"):
        VisionLanguageModel(config)


@pytest.mark.parametrize("names", [("clip", "mlp2x_gelu", "llama"), ("qwen3_5_vit", "qwen_merger", "qwen3_5")],
                         ids=["llava", "qwen"])
def test_zero_one_masks_of_any_dtype_equal_bool_masks(names):
    """transformers' int64 masks (and int32 / float 0-1) give exactly the bool mask's outputs, at every entry point."""
    model = tiny(*names).eval()
    batch = synthetic_batch(model, (1, 2), text_lengths=[8, 3])
    with torch.no_grad():
        expected = model(**batch)
        for dtype in (torch.int64, torch.int32, torch.float32, torch.bfloat16):
            out = model(**{**batch, "attention_mask": batch["attention_mask"].to(dtype)})
            assert torch.equal(out.logits, expected.logits) and torch.equal(out.loss, expected.loss), dtype
    args = (batch["input_ids"], batch["attention_mask"], batch["pixel_values"], batch.get("image_grid_thw"))
    greedy = model.generate(*args, max_new_tokens=3)
    assert torch.equal(model.generate(args[0], args[1].long(), *args[2:], max_new_tokens=3), greedy)
    assert mmadapt.check_batch(model, {**batch, "attention_mask": batch["attention_mask"].long()}).ok


def test_a_segment_id_mask_is_refused_with_the_packing_fix():
    """[1, 1, 2, 2, 0] is other frameworks' packing convention; used as 0/1 it would silently join the samples."""
    model = tiny("clip", "mlp2x_gelu", "llama")
    batch = synthetic_batch(model, (1, 1), text_lengths=[8, 3])
    segment_ids = batch["attention_mask"].long()
    segment_ids[0, 2:] *= 2
    for entry in (lambda: model(**{**batch, "attention_mask": segment_ids}),
                  lambda: model.generate(batch["input_ids"], segment_ids, batch["pixel_values"], max_new_tokens=1)):
        with pytest.raises(ValueError, match=r"values \[0, 1, 2\].*packs with cu_seqlens.*cu_seqlens_from_segment_ids"):
            entry()
    report = mmadapt.check_batch(model, {**batch, "attention_mask": segment_ids})
    assert not report.ok and "cu_seqlens" in report.error


def test_cu_seqlens_from_segment_ids_matches_the_collator():
    from mmadapt.packing import cu_seqlens_from_lengths, cu_seqlens_from_segment_ids

    segment_ids = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 2, 2]])
    assert torch.equal(cu_seqlens_from_segment_ids(segment_ids), cu_seqlens_from_lengths([[3, 2], [4, 2]], 6))
    with pytest.raises(TypeError, match="integer"):
        cu_seqlens_from_segment_ids(segment_ids.bool())


def test_internal_functions_still_refuse_integer_masks():
    """Only the public boundary converts: inside, an int mask is a TypeError (an int32 all-ones mask used as an
    index gave every position token 1's embedding)."""
    from mmadapt.contract import check_attention, locate
    from mmadapt.packing import Segments
    from mmadapt.positions import mrope_positions, text_positions

    ids = torch.tensor([[5, 255, 255, 6]])
    mask = torch.ones(1, 4, dtype=torch.int64)
    spans = locate(ids, 255)
    for call in (lambda: text_positions(mask), lambda: mrope_positions(mask, spans, None),
                 lambda: check_attention(spans, mask),
                 lambda: Segments.from_cu_seqlens(torch.tensor([0, 2, 4]), mask)):
        with pytest.raises(TypeError, match="indexes instead of masking"):
            call()


def test_contract_check_can_be_switched_off_but_injection_still_counts():
    config = mmadapt.ModelConfig.from_names("clip", "mlp2x_gelu", "llama", check_contract=False)
    model = VisionLanguageModel(config)
    batch = synthetic_batch(model, (1, 1))
    row = batch["input_ids"][0]
    row[int((row == model.tokens.image_token_id).nonzero()[0])] = 3
    with pytest.raises(ImageTokenContractError, match="cannot inject"):
        model(**batch)


def test_check_batch_report_is_readable():
    model = tiny("qwen3_5_vit", "qwen_merger", "qwen3_5")
    report = check_batch(model, synthetic_batch(model, (1, 2)))
    text = str(report)
    assert report.ok and "contract: OK" in text and "36->36" in text


def test_one_batch_type_carries_the_inputs():
    """`VisionBatch`'s fields are the inputs: `forward` takes each by name (transformers' keywords), a mapping
    converts with its other keys ignored, and `prepare` / `check_batch` take the batch itself."""
    import inspect

    from mmadapt import VisionBatch

    assert set(VisionBatch.keys()) <= set(inspect.signature(VisionLanguageModel.forward).parameters)
    model = tiny("qwen3_5_vit", "qwen_merger", "qwen3_5")
    batch = synthetic_batch(model, (1, 2))
    del batch["labels"]
    inputs = VisionBatch.of({**batch, "labels": batch["input_ids"], "meta": {"ids": [0, 1]}})
    assert inputs.input_ids is batch["input_ids"] and inputs.pixel_values is batch["pixel_values"]
    assert inputs.video_grid_thw is None and inputs.batch_size == 2 and VisionBatch.of(inputs) is inputs
    with pytest.raises(KeyError, match="needs input_ids"):
        VisionBatch.of({"pixel_values": batch["pixel_values"]})
    assert str(check_batch(model, inputs)) == str(check_batch(model, batch))
    with torch.no_grad():
        prepared = model.prepare(inputs)
        assert torch.equal(model.backbone(**prepared.backbone_kwargs()).logits, model(**batch).logits)


def test_the_fast_tiers_combinations_hold_every_pair_of_parts():
    fast = [p.values for p in COMBOS if not p.marks]
    for (i, a), (j, b) in itertools.combinations(enumerate((ENCODERS, PROJECTORS, BACKBONES)), 2):
        assert {(c[i], c[j]) for c in fast} == set(itertools.product(a.names(), b.names()))
    assert len(fast) < len(COMBOS) / 4 and len(COMBOS) == len(set(p.values for p in COMBOS))
