"""The training loss without full logits (`mmadapt.loss`) equals transformers' full computation.

Reference: the same model and batch with `return_logits=True` (transformers' own `ForCausalLM` forward and
`ForCausalLMLoss`). Tolerances, fp32: loss <= 1e-5 relative; gradients <= 1e-5 relative on every parameter
whose gradient norm is at least 1e-4 of the largest one (smaller ones, e.g. Gated DeltaNet's dt_bias at 1e-9
of it, are covered by the global check: <= 1e-6 relative over all parameters). bf16 autocast: both sides run
the same bf16 matmuls, so loss <= 2e-3 and gradients <= 2e-2 relative (bf16 rounding of the logits, which
the two sides reach through differently ordered sums). The chunk size is forced small (`CHUNK_BYTES`) so that
every test crosses several chunks.
"""

from __future__ import annotations

import math

import pytest
import torch

import mmadapt
from mmadapt import loss as loss_module
from mmadapt.data import Collator
from mmadapt.testing import synthetic_batch, synthetic_samples

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
LLAVA = ("clip", "mlp2x_gelu", "llama")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 4 * 256 * 5)  # 5 positions per chunk at the tiny vocab of 256


def tiny(names, seed=0, **backbone_options):
    torch.manual_seed(seed)
    if backbone_options:
        return mmadapt.build_model(names[0], names[1], {"name": names[2], "preset": "tiny",
                                                         "options": backbone_options})
    return mmadapt.build_model(*names)


def loss_and_grads(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(model, batch, *, loss_tol=1e-5, grad_tol=1e-5, global_tol=1e-6, **kwargs):
    model.train()
    chunked, grads = loss_and_grads(model, batch, **kwargs)
    full, reference = loss_and_grads(model, batch, return_logits=True, **kwargs)
    assert chunked.logits is None and full.logits is not None
    assert grads.keys() == reference.keys() and len(grads) > 4
    assert abs(chunked.loss.item() - full.loss.item()) <= loss_tol * abs(full.loss.item()), (chunked.loss, full.loss)
    largest = max(g.norm() for g in reference.values())
    total = torch.stack([g.norm() for g in reference.values()]).norm()
    assert torch.stack([(grads[n] - g).norm() for n, g in reference.items()]).norm() <= global_tol * total
    for name, g in reference.items():
        if g.norm() >= 1e-4 * largest:
            assert (grads[name] - g).norm() <= grad_tol * g.norm(), name
    return chunked, full


@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen", "llava"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_loss_and_gradients_equal_the_full_logits(names, tied):
    model = tiny(names, tie_word_embeddings=tied)
    assert (model.backbone.get_output_embeddings().weight is model.backbone.get_input_embeddings().weight) == tied
    assert_same(model, synthetic_batch(model, (1, 2, 0), seed=1))


@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen", "llava"])
def test_token_normalised_accumulation_uses_num_items_in_batch(names):
    """The trainer divides every micro-batch's token-loss sum by the global batch's supervised tokens."""
    model = tiny(names)
    batch = synthetic_batch(model, (1, 1), seed=2)
    chunked, _ = assert_same(model, batch, num_items_in_batch=torch.tensor(1000))
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    mean = model(**batch).loss
    assert chunked.loss.item() == pytest.approx(mean.item() * tokens / 1000, rel=1e-6)


def test_lora_on_the_backbone_and_on_lm_head():
    """LoRA on the declared targets (lm_head stays a plain Linear: the fused function), and LoRA on lm_head
    itself (a peft layer: the checkpointed path)."""
    from mmadapt.train import apply_stages

    model = tiny(QWEN)
    apply_stages(model, {"encoder": "frozen", "projector": "full", "backbone": "lora"}, r=4, alpha=8)
    for p in model.parameters():  # LoRA B starts at 0; move it so that its gradient path is exercised fully
        if p.requires_grad:
            p.data.add_(0.02 * torch.randn_like(p))
    assert type(model.backbone.get_output_embeddings()) is torch.nn.Linear
    assert_same(model, synthetic_batch(model, (1, 2), seed=3))
    model = tiny(LLAVA, tie_word_embeddings=False)
    apply_stages(model, {"encoder": "frozen", "projector": "full", "backbone": "lora"}, r=4, alpha=8,
                 targets=["q_proj", "lm_head"])
    assert type(model.backbone.get_output_embeddings()) is not torch.nn.Linear
    for p in model.parameters():
        if p.requires_grad:
            p.data.add_(0.02 * torch.randn_like(p))
    assert_same(model, synthetic_batch(model, (1, 2), seed=3))


@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen", "llava"])
def test_packed_rows(names):
    model = tiny(names)
    samples = synthetic_samples(model, [1, 0, 2, 1, 0], text_lengths=[5, 9, 4, 7, 6], seed=4)
    batch = Collator.for_model(model, 0, max_tokens=sum(len(s) for s in samples) // 2 + 40)(samples)
    assert "cu_seqlens" in batch and batch["input_ids"].shape[0] >= 2
    assert_same(model, batch)


@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen", "llava"])
def test_bf16_autocast(names):
    model = tiny(names)
    batch = synthetic_batch(model, (1, 2), seed=5)
    # bf16 rounds each gradient differently on the two paths. Measured over seeds 0-2 with 2 threads and with 1:
    # loss equal, global gradient difference 4.2e-3 - 4.6e-3, worst single tensor 0.9e-2 - 2.0e-2 (a Qwen ViT norm
    # weight whose gradient is 2e-4 of the largest; 1.5e-2 with 2 threads, 2.0e-2 with 1). The tolerances sit
    # 2.5x and more above the spread; a wrong chunk or a lost gradient is off by O(1).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_same(model, batch, loss_tol=2e-3, grad_tol=5e-2, global_tol=2e-2)


def test_logits_where_they_are_asked_for_and_nothing_supervised():
    model = tiny(QWEN)
    batch = synthetic_batch(model, (1,), seed=6)
    model.train()
    assert model(**batch).logits is None
    assert model(**{k: v for k, v in batch.items() if k != "labels"}).logits is not None  # no labels
    assert model(**batch, return_logits=True).logits is not None  # asked
    model.full_logits_loss = True  # train.full_logits
    assert model(**batch).logits is not None
    model.full_logits_loss = False
    with torch.no_grad():
        evaluated = model.eval()(**batch)
    assert evaluated.logits is not None and evaluated.loss is not None  # eval mode: transformers' path
    model.train()
    nothing = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    assert math.isnan(model(**nothing).loss.item()) and math.isnan(model(**nothing, return_logits=True).loss.item())
    assert model(**nothing, num_items_in_batch=5).loss.item() == 0.0


def test_a_backbone_whose_logits_are_more_than_lm_head_keeps_the_full_path(caplog):
    model = tiny(LLAVA)
    model.backbone.config.final_logit_softcapping = 30.0
    batch = synthetic_batch(model, (1,), seed=7)
    with caplog.at_level("INFO"):
        assert model.train()(**batch).logits is not None
    assert "final_logit_softcapping = 30.0" in caplog.text


def test_the_function_alone_equals_cross_entropy_of_the_full_logits():
    """LinearCrossEntropy against F.cross_entropy on explicit logits, with a bias, chunks of 1..N, and inputs
    that do not all require gradients (a frozen head: only the hidden states' gradient is computed)."""
    torch.manual_seed(0)
    states = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(13, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (11,))
    reference = torch.nn.functional.cross_entropy(states @ weight.t() + bias, targets, reduction="sum")
    expected = torch.autograd.grad(reference, (states, weight, bias))
    for rows in (1, 4, 11, 50):
        total = loss_module.LinearCrossEntropy.apply(states, weight, bias, targets, rows)
        got = torch.autograd.grad(total, (states, weight, bias))
        assert total.item() == pytest.approx(reference.item(), rel=1e-6)
        for a, b in zip(got, expected, strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    frozen = weight.detach()
    total = loss_module.LinearCrossEntropy.apply(states, frozen, None, targets, 4)
    (grad,) = torch.autograd.grad(total, states)
    (expected_grad,) = torch.autograd.grad(
        torch.nn.functional.cross_entropy(states @ frozen.t(), targets, reduction="sum"), states)
    assert torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_a_second_backward_through_the_fused_function_is_refused():
    """Its saved gradients are scaled in place (no second V x D buffer): one backward only, and it says so."""
    states = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    total = loss_module.LinearCrossEntropy.apply(states, weight, None, torch.tensor([1, 2, 3, 4]), 2) / 4
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        total.backward()
