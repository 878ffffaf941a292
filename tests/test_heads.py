"""Heads (`mmadapt.heads`): what `forward(..., head=)` computes at the top equals the same quantity from the full
logits, `forward` takes no objective's flag, and a head defined outside the model layer runs like the built-in ones.

References: the model's own full-logits forward (`return_logits=True`: transformers' `ForCausalLM`) and its default
loss path. Tolerances, fp32, as tests/test_loss.py: values <= 1e-5, gradients <= 1e-5 relative to the largest one.
The chunk size is forced small so that every head crosses several chunks. Token log-probs and entropy against the
tempered full logits: tests/test_rollout.py; the maths alone (LoRA, tied and plain heads, KL, bf16):
tests/test_preference.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import mmadapt
from mmadapt import VisionBatch, VisionLanguageModel
from mmadapt import loss as loss_module
from mmadapt.heads import Head, HeadInputs, SequenceLogps, TokenLogps, TokenLosses
from mmadapt.loss import IGNORE_INDEX, logits_token_losses
from mmadapt.synthetic import synthetic_batch

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
# forward's named parameters besides the inputs (VisionBatch's fields): what may be there. An objective's quantity
# is a head; a flag here is a regression (issue 55: 18 -> 25 named parameters, 3 return types).
NOT_INPUTS = {"self", "labels", "meta", "return_logits", "visual", "visual_videos", "head", "kwargs"}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 4 * 256 * 5)  # 5 positions per chunk at the tiny vocab of 256


@pytest.fixture
def model_and_batch():
    torch.manual_seed(0)
    model = mmadapt.build_model(*QWEN).train()
    return model, synthetic_batch(model, (1, 2), seed=3)


def grads_of(model, value):
    model.zero_grad(set_to_none=True)
    value.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(ours, theirs, tol=1e-5):
    assert ours.keys() == theirs.keys() and len(ours) > 4
    largest = max(float(g.abs().max()) for g in theirs.values())
    for name, grad in ours.items():
        assert float((grad - theirs[name]).abs().max()) <= tol * largest, name


def full_logps(model, batch):
    """(B, L - 1) log p(labels[t + 1]) from the full logits, and where that is a label."""
    logits = model(**batch, return_logits=True).logits
    labels = batch["labels"]
    logps = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    return logps, labels[:, 1:] != IGNORE_INDEX


def test_forward_takes_the_inputs_and_a_head_and_no_objective_flag():
    params = inspect.signature(VisionLanguageModel.forward).parameters
    inputs = set(VisionBatch.keys())
    assert inputs <= set(params)
    extra = set(params) - inputs - NOT_INPUTS
    assert not extra, f"forward grew {sorted(extra)}: an objective's quantity is a head (mmadapt.heads), not a flag"
    assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD and params["head"].default is None


def test_sequence_logps_equal_the_full_logits_sums_with_their_gradients_states_and_kl(model_and_batch):
    model, batch = model_and_batch
    weights = torch.tensor([0.7, -1.3])
    out = model(**batch, head=SequenceLogps(keep_states=True))
    ours = grads_of(model, (out.logps * weights).sum())
    logps, labelled = full_logps(model, batch)
    expected = (logps * labelled).sum(1)
    theirs = grads_of(model, (expected * weights).sum())
    assert torch.allclose(out.logps.detach(), expected.detach(), atol=1e-5, rtol=0)
    assert out.tokens.tolist() == labelled.sum(1).tolist() and out.kl is None
    assert_same_grads(ours, theirs)
    assert out.states.shape == (int(labelled.sum()), model.backbone.config.hidden_size) and not out.states.requires_grad
    with torch.no_grad():  # the KL to the same model's states, through another callable: 0
        again = model(**batch, head=SequenceLogps(reference=(out.states, model.backbone.get_output_embeddings())))
    assert torch.allclose(again.kl, torch.zeros(2), atol=1e-5) and again.states is None


@pytest.mark.parametrize("full_logits", [False, True], ids=["chunked", "full_logits"])
def test_token_losses_give_the_default_loss_and_the_full_logits_token_losses(model_and_batch, full_logits):
    """SFT's mixture path: the same loss and gradients as `forward(labels=...)` in training (the chunked loss, or
    full logits under `train.full_logits`), and each position's token loss as from the full logits."""
    model, batch = model_and_batch
    model.full_logits_loss = full_logits
    out = model(**batch, num_items_in_batch=7, head=TokenLosses())
    ours = grads_of(model, out.loss)
    default = model(**batch, num_items_in_batch=7)
    theirs = grads_of(model, default.loss)
    assert abs(out.loss.item() - default.loss.item()) <= 1e-5 * abs(default.loss.item())
    assert_same_grads(ours, theirs)
    with torch.no_grad():
        expected = logits_token_losses(model(**batch, return_logits=True).logits, batch["labels"])
    assert out.token_losses.shape == batch["labels"].shape and not out.token_losses.requires_grad
    assert torch.allclose(out.token_losses, expected, atol=1e-5, rtol=0) and out.aux_loss is None
    assert abs(float(expected.sum()) / 7 - out.loss.item()) <= 1e-5 * abs(out.loss.item())


def test_token_losses_add_the_moe_routers_loss_as_the_default_path():
    torch.manual_seed(0)
    model = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5_moe").train()
    batch = synthetic_batch(model, (1, 2), seed=4)
    with torch.no_grad():
        out = model(**batch, output_router_logits=True, head=TokenLosses())
        default = model(**batch, output_router_logits=True)
    coefficient = model.backbone.config.router_aux_loss_coef
    assert out.aux_loss is not None and abs(out.aux_loss.item() - coefficient * default.aux_loss.item()) <= 1e-6
    assert abs(out.loss.item() - default.loss.item()) <= 1e-5 * abs(default.loss.item())


class Logits(Head):
    """A head as an objective outside the model layer writes one: here, the full logits from the top."""

    def __call__(self, top: HeadInputs) -> torch.Tensor:
        assert top.labels is not None and top.inputs_embeds.shape == top.hidden.shape
        assert top.valid.dtype == torch.bool and top.supervised_mask().shape == top.labels.shape
        return top.output(top.hidden)


def test_a_head_defined_outside_gets_the_top_the_model_computes(model_and_batch):
    model, batch = model_and_batch
    with torch.no_grad():
        ours = model(**batch, head=Logits())
        theirs = model(**batch, return_logits=True).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)


def test_heads_refuse_what_they_cannot_compute(model_and_batch):
    model, batch = model_and_batch
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    for head in (SequenceLogps(), TokenLogps(), TokenLosses()):
        with pytest.raises(ValueError, match=f"head {type(head).__name__} needs labels"):
            model(**unlabelled, head=head)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        TokenLogps(0.0)


def test_a_backbone_whose_logits_are_more_than_lm_head_refuses_heads():
    torch.manual_seed(0)
    model = mmadapt.build_model(*QWEN).train()
    model.backbone.config.final_logit_softcapping = 30.0  # a head computes lm_head(hidden): it cannot see the cap
    batch = synthetic_batch(model, (1,), seed=3)
    with pytest.raises(ValueError, match=r"final_logit_softcapping = 30\.0"):
        model(**batch, head=SequenceLogps())
