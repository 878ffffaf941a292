"""Packed rows equal padded rows, per sample, and no packed sample can see another.

Tolerances (fp32): packed vs padded logits within 1e-5; a change to one packed sample moves
no other sample's logits by more than 1e-6. Covered layer types: Llama attention, Qwen3.5
gated full attention and Gated DeltaNet (causal conv + recurrent state), Qwen3-VL attention with
DeepStack levels added at the image positions of packed rows, and its MoE MLPs, with images.
"""

import itertools

import pytest
import torch

from mmadapt import VisionLanguageModel
from mmadapt.data import Collator
from mmadapt.packing import Segments, cu_seqlens_from_lengths
from mmadapt.synthetic import synthetic_samples

COMBOS = [("clip", "mlp2x_gelu", "llama"), ("qwen3_5_vit", "qwen_merger", "qwen3_5"),
          ("qwen3_vl_vit", "qwen_merger", "qwen3_vl"), ("qwen3_vl_vit", "qwen_merger", "qwen3_vl_moe")]
IMAGES = (1, 0, 2, 1, 0)
TEXT = (9, 14, 5, 30, 3)


def build(names):
    torch.manual_seed(0)
    model = VisionLanguageModel.from_names(*names, preset="tiny").eval()
    if model.backbone_spec.name == "qwen3_5":  # both layer types present, several of each
        assert {"linear_attention", "full_attention"} <= set(model.backbone.config.layer_types)
    if model.backbone_spec.deepstack:
        assert model.levels == 3
    with torch.no_grad():  # routers that prefer different experts for different tokens (initialised to zeros)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
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


# ---- the packed paths: regrouped batches, and varlen kernels (selection tested with reference kernels) -------
def test_regroup_keeps_every_sample_once_and_bounds_the_padding():
    from mmadapt.packing import REGROUP_WASTE, regroup

    lengths = [128] * 16 + [700, 650, 40, 33, 31, 5]
    groups = regroup(lengths)
    assert sorted(k for g in groups for k in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(lengths[k] for k in g) <= (1 + REGROUP_WASTE) * sum(lengths[k] for k in g) or len(g) == 1
    assert set(range(16)) <= next(set(g) for g in groups if 0 in g)  # equal lengths: one batched call
    assert regroup([]) == [] and regroup([7]) == [[0]]


@pytest.mark.parametrize("names", COMBOS, ids=lambda n: "-".join(n))
def test_packed_equals_padded_across_several_groups(names):
    """Lengths from 4 to ~100 tokens, so the regrouped path runs several batched calls per layer."""
    from mmadapt.packing import PackedRows

    model = build(names)
    images, text = (1, 0, 0, 2, 0, 1, 0, 0), (2, 90, 3, 40, 7, 60, 1, 25)
    samples = synthetic_samples(model, images, text_lengths=text, seed=3)
    batch = Collator.for_model(model, pad_token_id=0, max_tokens=sum(map(len, samples)) // 2 + 8)(samples)
    valid = batch["attention_mask"]
    rows = PackedRows(Segments.from_cu_seqlens(batch["cu_seqlens"], valid), batch["cu_seqlens"], valid)
    assert len(rows.groups(torch.device("cpu"))) >= 3 and len(rows) == len(samples)
    with torch.no_grad():
        padded = per_sample_logits(model, Collator.for_model(model, pad_token_id=0)(samples))
        packed = per_sample_logits(model, batch)
    for sample_id, logits in padded.items():
        torch.testing.assert_close(packed[sample_id], logits, rtol=0, atol=1e-5)


def test_the_path_choice():
    from mmadapt.backbones.qwen3_5_layers import varlen_kernels
    from mmadapt.packing import flash_attention_varlen, packed_path

    assert packed_path(on_cuda=True, kernels_available=True) == "varlen"
    for on_cuda, available, dtype in ((False, True, True), (True, False, True), (True, True, False)):
        assert packed_path(on_cuda=on_cuda, kernels_available=available, dtype_supported=dtype) == "regrouped"
    assert varlen_kernels(torch.zeros(1)) is None  # CPU (and no FLA / causal-conv1d here)
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        assert flash_attention_varlen() is None


def reference_flash(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=True):
    """flash-attn's varlen API, by SDPA on each segment: (T, H, D) in and out."""
    assert causal and torch.equal(cu_q, cu_k) and max_q == int((cu_q[1:] - cu_q[:-1]).max())
    out = torch.empty_like(q)
    for a, b in itertools.pairwise(cu_q.tolist()):
        seg = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            *seg, is_causal=True, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1)
    return out


def reference_conv(x, weight, bias, seq_idx, activation):
    """causal-conv1d's API with seq_idx: the causal depthwise conv restarted at every change of seq_idx."""
    assert activation == "silu" and x.shape[0] == 1 and seq_idx.shape == (1, x.shape[-1])
    ids = seq_idx[0].tolist()
    starts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]] + [len(ids)]
    out = torch.empty_like(x)
    for a, b in itertools.pairwise(starts):
        out[..., a:b] = torch.nn.functional.conv1d(x[..., a:b], weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                                                   groups=x.shape[1])[..., : b - a]
    return torch.nn.functional.silu(out)


def reference_rule(query, key, value, *, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   cu_seqlens):
    """FLA's chunk_gated_delta_rule API with cu_seqlens (batch 1): transformers' torch reference per segment."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    assert initial_state is None and not output_final_state and query.shape[0] == 1
    parts = []
    for a, b in itertools.pairwise(cu_seqlens.tolist()):
        out, _ = torch_chunk_gated_delta_rule(query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b],
                                              beta=beta[:, a:b], use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        parts.append(out)
    return torch.cat(parts, dim=1), None


@pytest.mark.parametrize("names", COMBOS, ids=lambda n: "-".join(n))
def test_the_varlen_path_with_reference_kernels_equals_padded(names, monkeypatch):
    """The "varlen" path (taken on CUDA with flash-attn / FLA + causal-conv1d) with the kernels replaced by exact
    per-segment references: it hands them the right flattened tensors, cu_seqlens and seq_idx."""
    import mmadapt.backbones.qwen3_5_layers as layers
    import mmadapt.packing as packing

    calls = {"flash": 0, "conv": 0}

    def flash(*args, **kwargs):
        calls["flash"] += 1
        return reference_flash(*args, **kwargs)

    def conv(*args, **kwargs):
        calls["conv"] += 1
        return reference_conv(*args, **kwargs)

    monkeypatch.setattr(packing, "packed_path", lambda **_: "varlen")
    monkeypatch.setattr(packing, "flash_attention_varlen", lambda: flash)
    monkeypatch.setattr(layers, "varlen_kernels", lambda _: (conv, reference_rule))
    model = build(names)
    samples = synthetic_samples(model, IMAGES, text_lengths=TEXT, seed=1)
    with torch.no_grad():
        padded = per_sample_logits(model, Collator.for_model(model, pad_token_id=0)(samples))
        packed = per_sample_logits(model, Collator.for_model(model, pad_token_id=0,
                                                             max_tokens=max(map(len, samples)) + 16)(samples))
    for sample_id, logits in padded.items():
        torch.testing.assert_close(packed[sample_id], logits, rtol=0, atol=1e-5)
    config = model.backbone.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    assert calls["flash"] == layer_types.count("full_attention")  # one call per layer and forward
    assert calls["conv"] == layer_types.count("linear_attention")


# ---- right-padded rows: SDPA's is_causal, no (B, 1, L, L) mask ---------------------------------------------------
@pytest.mark.parametrize("names", COMBOS, ids=lambda n: "-".join(n))
def test_right_padded_rows_attend_without_a_mask_and_equal_the_masked_path(names, monkeypatch):
    """A padded training batch (rows of unequal lengths) reaches SDPA with is_causal and no mask (linear memory; the
    flash kernels), and its loss, real-token logits and gradients equal transformers' masked SDPA (fp32, 1e-5)."""
    model = build(names).train()
    batch = Collator.for_model(model, pad_token_id=0)(synthetic_samples(model, IMAGES, text_lengths=TEXT, seed=1))
    real = batch["attention_mask"]
    assert not bool(real.all())  # there is padding
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        if q.shape[-2] == real.shape[1]:  # the LLM's attention, not the vision tower's
            calls.append((attn_mask, kwargs.get("is_causal")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    runs = {}
    for implementation in ("mmadapt_sdpa", "sdpa"):
        model.backbone.set_attn_implementation(implementation)
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = model(**batch).loss
        loss.backward()
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        runs[implementation] = (loss.detach(), logits[real],
                                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        masks = {type(m).__name__ if m is None else tuple(m.shape) for m, _ in calls}
        assert calls and masks == ({"NoneType"} if implementation == "mmadapt_sdpa" else {(len(real), 1) + (
            real.shape[1],) * 2}), masks
    (loss, logits, grads), (ref_loss, ref_logits, ref_grads) = runs.values()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_mask_is_skipped_only_for_right_padding_over_the_whole_sequence():
    from transformers.masking_utils import causal_mask_function

    from mmadapt.packing import causal_sdpa_mask

    right = torch.tensor([[True, True, True, False], [True, True, True, True]])
    left = right.flip(-1)
    assert causal_sdpa_mask(2, 4, 4, attention_mask=right) is None
    for args, kwargs in [((2, 4, 4), {"attention_mask": left}),  # left padding: real queries must not see padding
                         ((2, 1, 4), {"attention_mask": right, "q_offset": 3}),  # decoding with a cache
                         ((2, 4, 4), {"attention_mask": right, "local_size": 2}),  # sliding window
                         ((2, 4, 4), {"attention_mask": right, "allow_is_causal_skip": False}),
                         ((2, 4, 4), {"attention_mask": right,
                                      "mask_function": lambda b, h, q, k: causal_mask_function(b, h, q, k)})]:
        mask = causal_sdpa_mask(*args, **kwargs)
        assert isinstance(mask, torch.Tensor) and mask.shape[0] == 2, (args, kwargs)
