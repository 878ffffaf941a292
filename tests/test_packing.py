"""Packed rows equal padded rows, per sample, and no packed sample can see another.

Tolerances (fp32): packed vs padded logits within 1e-5; a change to one packed sample moves
no other sample's logits by more than 1e-6. Covered layer types: Llama attention, Qwen3.5
gated full attention and Gated DeltaNet (causal conv + recurrent state), with images.
"""

import itertools

import pytest
import torch

from mmadapt import VisionLanguageModel
from mmadapt.data import Collator
from mmadapt.packing import Segments, cu_seqlens_from_lengths
from mmadapt.testing import synthetic_samples

COMBOS = [("clip", "mlp2x_gelu", "llama"), ("qwen3_5_vit", "qwen_merger", "qwen3_5")]
IMAGES = (1, 0, 2, 1, 0)
TEXT = (9, 14, 5, 30, 3)


def build(names):
    torch.manual_seed(0)
    model = VisionLanguageModel.from_names(*names, preset="tiny").eval()
    if model.backbone_spec.name == "qwen3_5":  # both layer types present, several of each
        assert {"linear_attention", "full_attention"} <= set(model.backbone.config.layer_types)
    return model


def per_sample_logits(model, batch):
    """{sample id: logits over its own tokens} from a padded or packed batch."""
    logits = model(**batch).logits
    out = {}
    for r, ids in enumerate(batch["meta"]["sample_ids"]):
        at = 0
        lengths = _lengths(batch, r, len(ids))
        for sample_id, n in zip(ids, lengths, strict=True):
            out[sample_id] = logits[r, at : at + n]
            at += n
    return out


def _lengths(batch, row, count):
    if "cu_seqlens" not in batch:
        return [int(batch["attention_mask"][row].sum())]
    width = batch["input_ids"].shape[1]
    cu = batch["cu_seqlens"].tolist()
    inside = [b - a for a, b in itertools.pairwise(cu) if row * width <= a < (row + 1) * width]
    return inside[:count]


@pytest.mark.parametrize("names", COMBOS, ids=lambda n: "-".join(n))
def test_packed_equals_padded_and_samples_are_isolated(names):
    model = build(names)
    samples = synthetic_samples(model, IMAGES, text_lengths=TEXT, seed=1)
    collate_pad = Collator.for_model(model, pad_token_id=0)
    collate_pack = Collator.for_model(model, pad_token_id=0, max_tokens=max(map(len, samples)) + 16)
    packed_batch = collate_pack(samples)
    assert packed_batch["input_ids"].shape[0] < len(samples)  # really packed: several samples share a row
    with torch.no_grad():
        padded = per_sample_logits(model, collate_pad(samples))
        packed = per_sample_logits(model, packed_batch)
        for sample_id, logits in padded.items():
            torch.testing.assert_close(packed[sample_id], logits, rtol=0, atol=1e-5)

        # Change one sample's text (same length, so the layout stays): no other sample may move.
        changed = synthetic_samples(model, IMAGES, text_lengths=TEXT, seed=1)
        victim = next(s for s in changed if s.num_images)
        victim.input_ids = victim.input_ids.clone()
        victim.input_ids[-3:] = (victim.input_ids[-3:] + 7) % 200
        after = per_sample_logits(model, collate_pack(changed))
    for sample_id, logits in packed.items():
        diff = (after[sample_id] - logits).abs().max()
        if sample_id == victim.id:
            assert diff > 1e-3
        else:
            assert diff <= 1e-6, f"{sample_id} moved by {diff} when {victim.id} changed"


@pytest.mark.parametrize("names", COMBOS, ids=lambda n: "-".join(n))
def test_zero_one_integer_masks_equal_bool_masks_in_packed_rows(names):
    """A packed batch with transformers' int masks converts at the boundary and gives the bool mask's logits."""
    model = build(names).eval()
    batch = Collator.for_model(model, pad_token_id=0, max_tokens=128)(synthetic_samples(model, (1, 1)))
    with torch.no_grad():
        expected = model(**batch).logits
        for dtype in (torch.int32, torch.long):
            assert torch.equal(model(**{**batch, "attention_mask": batch["attention_mask"].to(dtype)}).logits, expected)


def test_packed_training_forward_never_builds_a_cache():
    model = build(COMBOS[1])
    batch = Collator.for_model(model, pad_token_id=0, max_tokens=128)(synthetic_samples(model, (1, 0)))
    assert model(**batch).cache is None
    with pytest.raises(ValueError, match="cache"):
        model(**batch, use_cache=True)


def test_transformers_own_qwen3_5_leaks_across_packed_samples():
    """Why the isolation exists: the same packed row through transformers' layers as they are leaks."""
    model = build(COMBOS[1])
    samples = synthetic_samples(model, (0, 0), text_lengths=(20, 20), seed=3)
    batch = Collator.for_model(model, pad_token_id=0, max_tokens=200)(samples)
    ids, first = batch["input_ids"], int(batch["cu_seqlens"][1])
    other = ids.clone()
    other[0, first - 3 : first] = (other[0, first - 3 : first] + 11) % 200  # the end of the first sample only
    plain = model.backbone  # transformers' forward, 1-D positions, block mask only via 4-D attention
    segments = Segments.from_cu_seqlens(batch["cu_seqlens"], batch["attention_mask"])
    mask = {"full_attention": segments.attention_mask(batch["attention_mask"]), "linear_attention": None}
    with torch.no_grad():
        leak = (plain(other, attention_mask=mask).logits - plain(ids, attention_mask=mask).logits)[0, first:]
        ours = model(**{**batch, "input_ids": other}).logits - model(**batch).logits
    assert leak.abs().max() > 1e-3  # the second sample moved: state crossed the boundary
    assert ours[0, first:].abs().max() <= 1e-6


def test_cu_seqlens_must_respect_rows_and_padding():
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    Segments.from_cu_seqlens(cu_seqlens_from_lengths([[1, 2], [4]], 4), valid)
    with pytest.raises(ValueError, match="row end"):
        Segments.from_cu_seqlens(torch.tensor([0, 2, 6, 8]), valid)
    with pytest.raises(ValueError, match="mixes real tokens and padding"):
        Segments.from_cu_seqlens(torch.tensor([0, 4, 8]), valid)
    with pytest.raises(ValueError, match="do not fit"):
        cu_seqlens_from_lengths([[3, 3]], 4)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_block_diagonal_mask_path_equals_varlen(implementation):
    """Varlen SDPA is the default; plain SDPA and eager take the (B, 1, L, L) block mask and agree with it."""
    for names in COMBOS:
        model = build(names)
        batch = Collator.for_model(model, pad_token_id=0, max_tokens=256)(
            synthetic_samples(model, IMAGES, text_lengths=TEXT, seed=1))
        with torch.no_grad():
            varlen = model(**batch).logits
            model.backbone.set_attn_implementation(implementation)
            masked = model(**batch).logits
        real = batch["attention_mask"]
        torch.testing.assert_close(masked[real], varlen[real], rtol=0, atol=1e-5)
