"""KTO's arithmetic equals trl 1.16's `KTOTrainer` (fp32, 1e-5): the loss and its gradient w.r.t. the policy's
log-probs, the KL estimate and the rewards, through trl's own `_compute_loss` on the same tensors; and the KL rows'
pairing equals what trl's `_prepare_dataset` builds.

trl computes the loss inside `_compute_loss`, which calls the model; it runs here on a stand-in trainer whose
"model" returns given per-row log-probs (a (B, 1) `log_probs`, one scored position per row) and whose reference
log-probs are precomputed (`precompute_ref_logps`, the batch's `ref_logps` / `ref_KL_logps`), so trl's code from the
log-probs to the loss runs unchanged.
"""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from mmadapt.train.objectives.kto import kl_estimate, kl_over_processes, kl_partners, kto_losses

trl = pytest.importorskip("trl")

ATOL = 1e-5
B = 6
BETA = 0.1


class LogProbModel:
    """trl's model call: the rows' summed log-probs by which input ids it is given (the rows' or the KL rows')."""

    training = True

    def __init__(self, rows: dict[int, torch.Tensor]) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, **_: object) -> types.SimpleNamespace:
        logps = self.rows[id(input_ids)].unsqueeze(1)
        zeros = torch.zeros_like(logps.detach())
        return types.SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros)


class Accelerator:
    """One process, or `other` as a second process's value in every gather (its mean of the KL rows)."""

    device = torch.device("cpu")

    def __init__(self, other: float | None = None) -> None:
        self.other = other

    def gather_for_metrics(self, value: torch.Tensor) -> torch.Tensor:
        if self.other is None:
            return value.reshape(1)
        return torch.stack([value.reshape(()), torch.full((), self.other, dtype=value.dtype)])


def trl_loss(policy, policy_kl, reference, reference_kl, labels, *, loss_type, weights=(1.0, 1.0), other=None):
    """trl's loss, its gradient w.r.t. `policy` and its logged metrics."""
    from trl import KTOTrainer

    policy = policy.clone().requires_grad_(True)
    input_ids, kl_input_ids = torch.zeros(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.long)
    mask = torch.tensor([[0, 1]] * B)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones(B, 2, dtype=torch.long), "completion_mask": mask,
             "KL_input_ids": kl_input_ids, "KL_attention_mask": torch.ones(B, 2, dtype=torch.long),
             "KL_completion_mask": mask, "label": labels, "ref_logps": reference, "ref_KL_logps": reference_kl}
    trainer = types.SimpleNamespace(
        model=LogProbModel({id(input_ids): policy, id(kl_input_ids): policy_kl}), accelerator=Accelerator(other),
        loss_type=loss_type, calculate_KL=loss_type == "kto", beta=BETA, desirable_weight=weights[0],
        undesirable_weight=weights[1], precompute_ref_logps=True, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    trainer._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, trainer)
    loss = KTOTrainer._compute_loss(trainer, trainer.model, batch, return_outputs=False)
    loss.backward()
    return loss.detach(), policy.grad, trainer._metrics["train"]


def ours(policy, policy_kl, reference, reference_kl, labels, *, loss_type, weights=(1.0, 1.0), other=None):
    policy = policy.clone().requires_grad_(True)
    kl = None
    if loss_type == "kto":
        others = [] if other is None else [torch.tensor(other)]
        kl = kl_over_processes(kl_estimate(policy_kl, reference_kl), processes(others))
    terms = kto_losses(loss_type, policy, reference, labels, kl, beta=BETA, desirable_weight=weights[0],
                       undesirable_weight=weights[1])
    loss = terms.losses.mean()
    loss.backward()
    return loss.detach(), policy.grad, terms


def processes(others: list[torch.Tensor | None]):
    """An in-place all-reduce SUM as `torch.distributed.all_reduce` does it, the other processes having called
    `kl_over_processes` with `others` (their `kl_estimate`, or None)."""
    def all_reduce(pair: torch.Tensor) -> None:
        for local in others:
            pair += torch.zeros(2) if local is None else torch.stack([local, torch.ones(())])

    return all_reduce


def batch(kl_shift: float = 0.0) -> tuple[torch.Tensor, ...]:
    """Summed log-probs of B rows and their KL rows; the policy's KL rows sit `kl_shift` above the reference's."""
    g = torch.Generator().manual_seed(0)
    policy, reference = -20 * torch.rand(B, generator=g), -20 * torch.rand(B, generator=g)
    reference_kl = -20 * torch.rand(B, generator=g)
    policy_kl = reference_kl + kl_shift + torch.randn(B, generator=g)
    return policy, policy_kl, reference, reference_kl


LABELS = {"mixed": [True, False, True, True, False, False], "all_desirable": [True] * B,
          "all_undesirable": [False] * B}


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("labels", list(LABELS))
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33), (0.7, 1.0)])
def test_equals_trl(loss_type, labels, weights):
    """Loss, gradient, KL and mean rewards equal trl's for mixed / all-desirable / all-undesirable batches, equal and
    unequal weights, each loss type (a KL estimate of about 5 nats, so z0 matters)."""
    rows = batch(kl_shift=5.0)
    label = torch.tensor(LABELS[labels])
    ref_loss, ref_grad, metrics = trl_loss(*rows, label, loss_type=loss_type, weights=weights)
    loss, grad, terms = ours(*rows, label, loss_type=loss_type, weights=weights)
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=ATOL, rtol=0)
    assert terms.kl.item() == pytest.approx(metrics["kl"][-1], abs=ATOL)
    assert (terms.kl.item() > 4) == (loss_type == "kto")
    for name, rewards in (("rewards/chosen", terms.chosen_rewards), ("rewards/rejected", terms.rejected_rewards)):
        if rewards.numel():
            assert rewards.mean().item() == pytest.approx(metrics[name][-1], abs=ATOL)
        else:
            assert name not in metrics


def test_negative_kl_is_clamped_like_trl():
    """A KL estimate below 0 counts as 0 (trl clamps after averaging), and no gradient flows through it."""
    rows, label = batch(kl_shift=-5.0), torch.tensor(LABELS["mixed"])
    assert kl_estimate(rows[1], rows[3]) < -4
    ref_loss, ref_grad, metrics = trl_loss(*rows, label, loss_type="kto")
    loss, grad, terms = ours(*rows, label, loss_type="kto")
    assert terms.kl.item() == 0.0 == metrics["kl"][-1]
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=ATOL, rtol=0)


def test_kl_averaged_across_processes_like_trl():
    """Two processes: trl averages each process's mean KL (gather, mean, clamp); `kl_over_processes` over an
    all-reduce gives the same KL, loss and gradient."""
    rows, label = batch(kl_shift=2.0), torch.tensor(LABELS["mixed"])
    ref_loss, ref_grad, metrics = trl_loss(*rows, label, loss_type="kto", other=7.5)
    loss, grad, terms = ours(*rows, label, loss_type="kto", other=7.5)
    assert terms.kl.item() == pytest.approx(metrics["kl"][-1], abs=ATOL)
    assert terms.kl.item() > kl_estimate(rows[1], rows[3]).item() + 2
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=ATOL, rtol=0)


def test_a_process_without_kl_rows_counts_for_nothing():
    """Three processes, one without KL rows (a placeholder batch): the estimate is the mean of the other two's, and
    that process gets the same value through the same all-reduce; no process with rows: 0."""
    a, b = torch.tensor(2.0), torch.tensor(5.0)
    assert kl_over_processes(a, processes([b, None])).item() == pytest.approx(3.5)
    assert kl_over_processes(None, processes([a, b])).item() == pytest.approx(3.5)
    assert kl_over_processes(None, processes([None])).item() == 0.0
    assert kl_over_processes(a).item() == 2.0
    with pytest.raises(ValueError, match="no KL rows"):
        kl_estimate(torch.zeros(0), torch.zeros(0))


def test_per_row_losses_follow_the_formula_in_batch_order():
    """Row b's loss is its own (weighted) term in the batch's order; rewards are beta (pi - ref), detached."""
    policy, policy_kl, reference, reference_kl = batch(kl_shift=3.0)
    label = torch.tensor(LABELS["mixed"])
    terms = kto_losses("kto", policy, reference, label, kl_estimate(policy_kl, reference_kl), beta=BETA,
                       undesirable_weight=2.0)
    ratio, z0 = policy - reference, kl_estimate(policy_kl, reference_kl)
    expected = torch.where(label, 1 - torch.sigmoid(BETA * (ratio - z0)), 2 * (1 - torch.sigmoid(BETA * (z0 - ratio))))
    torch.testing.assert_close(terms.losses, expected)
    torch.testing.assert_close(terms.chosen_rewards, BETA * ratio[label])
    torch.testing.assert_close(terms.rejected_rewards, BETA * ratio[~label])


def test_bad_inputs_are_named():
    policy, policy_kl, reference, reference_kl = batch()
    label = torch.tensor(LABELS["mixed"])
    with pytest.raises(ValueError, match="needs the KL estimate"):
        kto_losses("kto", policy, reference, label, None, beta=BETA)
    with pytest.raises(ValueError, match="has no KL term"):
        kto_losses("apo_zero_unpaired", policy, reference, label, torch.tensor(1.0), beta=BETA)
    with pytest.raises(ValueError, match=r"unknown KTO loss_type 'bco'.*'kto', 'apo_zero_unpaired'"):
        kto_losses("bco", policy, reference, label, None, beta=BETA)
    with pytest.raises(TypeError, match="desirable must be a bool tensor"):
        kto_losses("kto", policy, reference, label.long(), torch.tensor(1.0), beta=BETA)
    with pytest.raises(ValueError, match=r"all \(B,\)"):
        kto_losses("kto", policy, reference[:3], label, torch.tensor(1.0), beta=BETA)
    with pytest.raises(ValueError, match="must be a scalar"):
        kto_losses("kto", policy, reference, label, policy_kl - reference_kl, beta=BETA)
    with pytest.raises(ValueError, match="at least 2 rows per batch"):
        kl_partners(4, 1)


@pytest.mark.parametrize(("rows", "batch_size"), [(8, 4), (7, 3), (5, 2), (4, 8)])
def test_kl_partners_equal_trls_dataset(rows, batch_size):
    """Each row's KL completion is the one trl's `_prepare_dataset` gives it (completions rotated by one within each
    group of `per_device_train_batch_size` rows, the last group possibly shorter), on a real tokenizer."""
    from datasets import Dataset
    from real_tokenizers import real_tokenizer
    from trl import KTOTrainer

    tokenizer = real_tokenizer("qwen3")
    words = ["apple", "river", "stone", "cloud", "green", "seven", "table", "music"][:rows]
    data = Dataset.from_list([{"prompt": f"Say {w}:", "completion": f" {w}", "label": k % 2 == 0}
                              for k, w in enumerate(words)])
    trainer = types.SimpleNamespace(_tokenizer=tokenizer, calculate_KL=True, desirable_weight=1.0,
                                    undesirable_weight=1.0)
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, per_device_train_batch_size=batch_size)
    prepared = KTOTrainer._prepare_dataset(trainer, data, tokenizer, args, "train")
    completions = prepared["completion_ids"]
    assert len({tuple(c) for c in completions}) == rows  # every completion tells its row apart
    expected = [completions[j] for j in kl_partners(rows, batch_size).tolist()]
    assert prepared["KL_completion_ids"] == expected
