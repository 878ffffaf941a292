"""The training loss without full logits (`mmadapt.loss`) equals transformers' full computation.

Reference: the same model and batch with `return_logits=True` (transformers' own `ForCausalLM` forward and
`ForCausalLMLoss`). Tolerances, fp32: loss <= 1e-5 relative; gradients <= 1e-5 relative on every parameter
whose gradient norm is at least 1e-4 of the largest one (smaller ones, e.g. Gated DeltaNet's dt_bias at 1e-9
of it, are covered by the global check: <= 1e-6 relative over all parameters). bf16 autocast: both sides run
the same bf16 matmuls, so loss <= 2e-3 and gradients <= 2e-2 relative (bf16 rounding of the logits, which
the two sides reach through differently ordered sums). The chunk size is forced small (`CHUNK_BYTES`) so that
every test crosses several chunks.

A head tied to the input embedding (issue 20 item 6): the same gradients (<= 1e-6 relative) as when the embedding's
backward builds its own dense (V, D) gradient, with one (V, D) buffer alive in the backward instead of two, counted
from the profiler's allocation events.
"""

from __future__ import annotations

import math

import pytest
import torch

import mmadapt
from mmadapt import loss as loss_module
from mmadapt.data import Collator
from mmadapt.synthetic import synthetic_batch, synthetic_samples

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
    # per tensor within 1e-4 (the whole gradient within 1e-6): scaled by tokens / 1000, a Gated DeltaNet
    # projection's gradient is ~1e-5 in norm, where one thread's summation order alone moves it by 1.0014e-5 of it
    chunked, _ = assert_same(model, batch, grad_tol=1e-4, num_items_in_batch=torch.tensor(1000))
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    mean = model(**batch).loss
    assert chunked.loss.item() == pytest.approx(mean.item() * tokens / 1000, rel=1e-6)


def test_lora_on_the_backbone_and_on_lm_head():
    """LoRA on the declared targets (lm_head stays a plain Linear: the fused function), and LoRA on lm_head
    itself (a peft layer: the checkpointed path)."""
    from mmadapt.train import apply_stages
    from mmadapt.train.config import LoraSection, StagesSection

    model = tiny(QWEN)
    apply_stages(model, StagesSection(preset="lora"), LoraSection(r=4, alpha=8))
    for p in model.parameters():  # LoRA B starts at 0; move it so that its gradient path is exercised fully
        if p.requires_grad:
            p.data.add_(0.02 * torch.randn_like(p))
    assert type(model.backbone.get_output_embeddings()) is torch.nn.Linear
    assert_same(model, synthetic_batch(model, (1, 2), seed=3))
    model = tiny(LLAVA, tie_word_embeddings=False)
    apply_stages(model, StagesSection(preset="lora"), LoraSection(r=4, alpha=8, targets=["q_proj", "lm_head"]))
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


# ---- a head tied to the input embedding: one (V, D) gradient buffer (issue 20 item 6) ---------------------------
def backward_peak(nbytes, loss_fn):
    """The most allocations of exactly `nbytes` alive at once during the backward of `loss_fn()`, counting those its
    forward made and kept (the profiler's allocation events, which hold no tensor: autograd's in-place accumulation
    and gradient stealing run as without it)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = loss_fn()
        with record_function("measured backward"):
            loss.backward()
    events = list(prof.profiler.kineto_results.events())
    start = next(e.start_ns() for e in events if e.name() == "measured backward")
    sizes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and abs(e.nbytes()) == nbytes)
    live = sum(1 if n > 0 else -1 for t, n in sizes if t < start)
    peak = live
    for _, n in ((t, n) for t, n in sizes if t >= start):
        live += 1 if n > 0 else -1
        peak = max(peak, live)
    return peak


def without_the_tie(monkeypatch):
    """The behaviour before: the embedding's backward builds its own dense (V, D) gradient."""
    monkeypatch.setattr(loss_module.TiedEmbedding, "find", classmethod(lambda cls, embeds, weight: None))


def steps(model, batches, **kwargs):
    """Gradients after forward + backward of each batch in turn (accumulated, from None) and the most (V, D)
    fp32 buffers alive at once in each backward."""
    model.zero_grad(set_to_none=True)
    nbytes = model.backbone.get_input_embeddings().weight.numel() * 4
    peaks = [backward_peak(nbytes, lambda b=batch: model(**b, **kwargs).loss) for batch in batches]
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, peaks


def assert_equal_grads(grads, reference, tol=1e-6):
    assert grads.keys() == reference.keys()
    for name, g in reference.items():
        assert (grads[name] - g).norm() <= tol * g.norm().clamp_min(1e-30), name


@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen", "llava"])
@pytest.mark.parametrize("case", ["one step", "two micro-steps", "nothing supervised", "bf16 autocast"])
def test_a_tied_head_and_its_embedding_share_one_gradient_buffer(names, case, monkeypatch):
    """The trainer's step (gradients None before it): the loss's (V, D) weight gradient takes the embedding's rows and
    becomes `.grad`, the only (V, D) buffer of the step (two before: the embedding's dense gradient too); with a
    `.grad` from an earlier micro-step, the step adds one buffer to it (two before). The same gradients <= 1e-6."""
    model = tiny(names, tie_word_embeddings=True, vocab_size=4096).train()  # V x D fp32: 1 MiB, no other tensor's size
    weight = model.backbone.get_input_embeddings().weight
    assert model.backbone.get_output_embeddings().weight is weight
    batches = [synthetic_batch(model, (1, 2, 0), seed=11)]
    kwargs = {}
    if case == "two micro-steps":
        batches.append(synthetic_batch(model, (2, 1), seed=12))
    if case == "nothing supervised":
        batches = [{**batches[0], "labels": torch.full_like(batches[0]["labels"], -100)}]
        kwargs["num_items_in_batch"] = 7
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16 autocast")
    with autocast:
        grads, peaks = steps(model, batches, **kwargs)
    assert weight.grad.layout == torch.strided and weight.grad.is_contiguous()
    assert not weight._backward_hooks  # the hook on the weight is gone with the backward
    with monkeypatch.context() as patch:
        without_the_tie(patch)
        with autocast:
            reference, before = steps(model, batches, **kwargs)
    assert peaks == [1] * len(batches) and before == [2] * len(batches)
    assert_equal_grads(grads, reference)


@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen", "llava"])
def test_an_untied_head_is_unchanged(names, monkeypatch):
    model = tiny(names, tie_word_embeddings=False, vocab_size=4096).train()
    embeds = model.backbone.get_input_embeddings()(torch.tensor([[1, 2]]))
    assert loss_module.TiedEmbedding.find(embeds, model.backbone.get_output_embeddings().weight) is None
    batches = [synthetic_batch(model, (1, 2), seed=13), synthetic_batch(model, (0, 1), seed=14)]
    grads, peaks = steps(model, batches)
    without_the_tie(monkeypatch)
    reference, before = steps(model, batches)
    # the head's gradient and the embedding's, two parameters; once they have a `.grad`, each is added to it and
    # freed before the other exists
    assert peaks == before == [2, 1]
    assert all(torch.equal(grads[n], g) for n, g in reference.items())


def test_the_tied_embedding_rows_against_full_logits():
    """causal_lm_loss(embeds=) alone, against F.cross_entropy of full logits: the padding row gets no gradient,
    `torch.autograd.grad` (the gradient captured, not accumulated) and `.backward()` both see the embedding's rows,
    and a weight also used elsewhere (its gradient no longer the loss's buffer) gets them too."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 8, padding_idx=3)
    head = torch.nn.Linear(8, 50, bias=False)
    head.weight = embedding.weight
    ids = torch.randint(0, 50, (2, 9))
    ids[0, :3] = 3
    labels = ids.clone()
    labels[0, :4] = -100

    def loss(chunked, extra=False):
        embeds = embedding(ids)
        hidden = torch.tanh(embeds)
        if chunked:
            total = loss_module.causal_lm_loss(hidden, head, labels, rows=4, embeds=embeds)
        else:
            logits = head(hidden)[:, :-1].reshape(-1, 50)
            total = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
        return total + (embedding.weight**2).sum() * 1e-2 if extra else total

    for extra in (False, True):
        (expected,) = torch.autograd.grad(loss(False, extra), embedding.weight)
        (got,) = torch.autograd.grad(loss(True, extra), embedding.weight)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-7)
        embedding.weight.grad = None
        loss(True, extra).backward()
        assert torch.allclose(embedding.weight.grad, expected, rtol=1e-5, atol=1e-7)
    assert not embedding.weight._backward_hooks
    embedding.weight.requires_grad_(False)  # a frozen embedding (LoRA): nothing to share
    assert loss_module.TiedEmbedding.find(embedding(ids), embedding.weight) is None
