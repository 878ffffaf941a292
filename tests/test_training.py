"""Cross-family combinations learn: 20 AdamW steps on one fixed tiny batch lower the loss."""

from __future__ import annotations

import pytest
import torch

import mmadapt
from mmadapt.testing import synthetic_batch


@pytest.mark.parametrize("names", [("clip", "mlp2x_gelu", "qwen3_5"), ("qwen3_5_vit", "qwen_merger", "llama")])
def test_twenty_steps_lower_the_loss(names):
    torch.manual_seed(0)
    model = mmadapt.build_model(*names).train()
    batch = synthetic_batch(model, (1, 2), seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(20):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("names", [("qwen3_5_vit", "qwen_merger", "qwen3_5"), ("clip", "mlp2x_gelu", "llama"),
                                   ("qwen3_vl_vit", "qwen_merger", "qwen3_vl_moe")],
                         ids=["qwen3_5", "llava", "deepstack-moe"])
def test_a_text_only_batch_runs_the_vision_side_with_exactly_zero_effect(names, monkeypatch):
    """What a rank without images does in a multi-process step (`runs_vision_every_step`, forced here): the encoder
    and projector (DeepStack levels included) run on a minimal input, the loss and the backbone's gradients are
    bit for bit those of the text-only forward, and every vision parameter gets an exactly-zero gradient."""
    torch.manual_seed(0)
    model = mmadapt.build_model(*names).train()
    batch = synthetic_batch(model, (0, 0), seed=3)
    assert batch.get("pixel_values") is None

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert not model.runs_vision_every_step()  # one process: nothing to keep in step
    loss, grads = step()
    assert not any(n.startswith(("encoder.", "projector.")) for n in grads)
    monkeypatch.setattr(model, "runs_vision_every_step", lambda: True)
    loss_with, grads_with = step()
    assert torch.equal(loss, loss_with)
    vision = {n: g for n, g in grads_with.items() if n.startswith(("encoder.", "projector."))}
    with_images = synthetic_batch(model, (1, 0), seed=3)
    model.zero_grad(set_to_none=True)
    model(**with_images).loss.backward()  # the vision parameters an image reaches (CLIP's last layer is unused)
    side = ("encoder.", "projector.")
    reached = [n for n, p in model.named_parameters() if p.grad is not None and n.startswith(side)]
    assert sorted(vision) == sorted(reached) and all(not g.any() for g in vision.values())
    assert grads.keys() == grads_with.keys() - vision.keys()
    assert all(torch.equal(grads[n], grads_with[n]) for n in grads)
