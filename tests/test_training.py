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
