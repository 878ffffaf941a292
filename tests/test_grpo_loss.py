"""The GRPO family's arithmetic (`mmadapt.train.objectives.grpo.loss`) equals trl 1.16's `GRPOTrainer` on fixed
tensors: the loss, its gradient w.r.t. the policy's per-token log-probs and the logged clip / KL metrics of
`_compute_loss` for grpo, bnpo, dr_grpo and dapo, beta 0 and 0.04 (with and without trl's bias-corrected KL), with
gradient accumulation; and the group advantages for scale_rewards group / batch / none, unscored rows included.

trl's own `_compute_loss` runs on an object made with `object.__new__(GRPOTrainer)` that carries the attributes it
reads, its `_get_per_token_logps_and_entropies` replaced by one that returns the fixed log-probs: the arithmetic is
trl's, no model or generation is built. The advantages' reference is trl's few lines (grpo_trainer.py 2765-2788, 2810),
which run inside its generation step, copied below over trl's own `nanstd`. fp32, within 1e-5.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from mmadapt.train.objectives.grpo.loss import (
    LOSS_TYPES,
    PolicyLoss,
    PolicyStats,
    group_advantages,
    policy_loss,
)

ATOL = 1e-5
B, G, T = 4, 2, 7  # 2 groups of 2 completions, 7 completion positions
MAX_COMPLETION_LENGTH = 9


def fixed_batch() -> dict[str, torch.Tensor]:
    """Ragged completions (7, 3, 5, 1 tokens); old log-probs off the current ones by up to +-0.6, so the ratio leaves
    [0.8, 1.2] on both sides; advantages of both signs."""
    g = torch.Generator().manual_seed(47)
    logps = -torch.rand(B, T, generator=g) * 3 - 0.05
    old = logps + (torch.rand(B, T, generator=g) - 0.5) * 1.2
    ref = logps + (torch.rand(B, T, generator=g) - 0.5) * 0.8
    lengths = torch.tensor([7, 3, 5, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    advantages = torch.tensor([0.9, -0.7, 1.3, -1.1])
    return {"logps": logps, "old": old, "ref": ref, "mask": mask, "advantages": advantages}


def test_the_fixed_batch_clips_on_both_sides():
    data = fixed_batch()
    ratio = torch.exp(data["logps"] - data["old"])[data["mask"].bool()]
    assert (ratio < 0.8).any() and (ratio > 1.2).any()
    stats = policy_loss(data["logps"], data["old"], data["ref"], data["advantages"], data["mask"],
                        PolicyLoss(loss_type="grpo")).stats.means()
    assert stats["clip_ratio/low_mean"] > 0 and stats["clip_ratio/high_mean"] > 0


# ---- trl's _compute_loss on the fixed tensors ------------------------------------------------------------------------
class Accelerator:
    """What `_compute_loss` asks of the accelerator, for one process standing in for `num_processes`."""

    def __init__(self, num_processes: int = 1) -> None:
        self.num_processes, self.sync_gradients = num_processes, True

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather


def trl_trainer(settings: PolicyLoss, logps: torch.Tensor, *, accumulation_steps: int = 1, num_processes: int = 1,
                steps_per_generation: int = 1):
    """A `GRPOTrainer` holding only what `_compute_loss` reads; its log-probs are `logps`."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    trainer = object.__new__(trl_grpo.GRPOTrainer)
    trainer.__dict__.update(
        loss_type=settings.loss_type, beta=settings.beta, epsilon_low=settings.epsilon,
        epsilon_high=settings.epsilon_upper, max_completion_length=MAX_COMPLETION_LENGTH,
        importance_sampling_level="token", top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        aux_loss_enabled=False, use_vllm=False, vllm_importance_sampling_correction=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=accumulation_steps,
        model=SimpleNamespace(training=True), accelerator=Accelerator(num_processes),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=settings.bias_correction_kl, delta=None,
                             steps_per_generation=steps_per_generation),
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.zeros_like(logps), None))
    return trainer


def trl_inputs(data: dict[str, torch.Tensor], num_items: torch.Tensor, old: bool = True) -> dict[str, torch.Tensor]:
    return {"prompt_ids": torch.ones(B, 3, dtype=torch.long), "prompt_mask": torch.ones(B, 3, dtype=torch.long),
            "completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": data["mask"],
            "advantages": data["advantages"], "old_per_token_logps": data["old"] if old else None,
            "ref_per_token_logps": data["ref"], "num_items_in_batch": num_items}


def both(settings: PolicyLoss, *, accumulation_steps=1, num_processes=1, steps_per_generation=1, old=True,
         num_items=None):
    """(ours, trl's): the loss, the gradient w.r.t. the log-probs, the logged metrics."""
    data = fixed_batch()
    trl_items = data["mask"].sum() if num_items is None else torch.tensor(float(num_items))
    theirs_logps = data["logps"].clone().requires_grad_()
    trainer = trl_trainer(settings, theirs_logps, accumulation_steps=accumulation_steps, num_processes=num_processes,
                          steps_per_generation=steps_per_generation)
    their_loss = trainer._compute_loss(None, trl_inputs(data, trl_items, old))
    their_loss.backward()
    their_metrics = {k: v[0] for k, v in trainer._metrics["train"].items() if k != "entropy"}

    ours_logps = data["logps"].clone().requires_grad_()
    items = float(trl_items) / num_processes * accumulation_steps / steps_per_generation  # the module docstring's rule
    terms = policy_loss(ours_logps, data["old"] if old else None, data["ref"] if settings.beta else None,
                        data["advantages"], data["mask"], settings, accumulation_steps=accumulation_steps,
                        num_items=items if settings.loss_type == "dapo" else None)
    terms.loss.backward()
    ours = (terms.loss.detach(), ours_logps.grad, terms.stats.means())
    return ours, (their_loss.detach(), theirs_logps.grad, their_metrics)


def assert_equal(ours, theirs):
    (loss, grad, metrics), (their_loss, their_grad, their_metrics) = ours, theirs
    assert abs(float(loss) - float(their_loss)) <= ATOL, (float(loss), float(their_loss))
    assert grad.abs().sum() > 0 and torch.allclose(grad, their_grad, atol=ATOL, rtol=0), (grad - their_grad).abs().max()
    wanted = {k: their_metrics[k] for k in metrics}  # trl logs more (min / max clip per sequence)
    assert metrics == pytest.approx(wanted, abs=ATOL), (metrics, their_metrics)


@pytest.mark.parametrize("beta,bias_correction_kl", [(0.0, True), (0.04, True), (0.04, False)])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_loss_and_its_gradient_equal_trls(loss_type, beta, bias_correction_kl):
    settings = PolicyLoss(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28,
                          max_completion_length=MAX_COMPLETION_LENGTH, bias_correction_kl=bias_correction_kl)
    ours, theirs = both(settings)
    assert_equal(ours, theirs)
    assert ("kl" in ours[2]) == (beta != 0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_accumulation_scales_as_trl_does(loss_type):
    """Accumulation over 2 micro-batches on 2 ranks, the generation batch spanning 4 micro-batches (dapo's
    `num_items_in_batch` then counts all of them): grpo / bnpo / dr_grpo divide by the steps, dapo by its count."""
    settings = PolicyLoss(loss_type=loss_type, beta=0.04, max_completion_length=MAX_COMPLETION_LENGTH)
    ours, theirs = both(settings, accumulation_steps=2, num_processes=2, steps_per_generation=4, num_items=97)
    assert_equal(ours, theirs)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_without_old_log_probs_equals_trl(loss_type):
    """No old log-probs (trl skips them when each generation is used once): the ratio is 1 with a gradient."""
    settings = PolicyLoss(loss_type=loss_type, beta=0.04, max_completion_length=MAX_COMPLETION_LENGTH)
    ours, theirs = both(settings, old=False)
    assert_equal(ours, theirs)
    assert ours[2]["clip_ratio/region_mean"] == 0


def test_accumulated_dapo_losses_sum_to_the_token_mean():
    """Two micro-batches given the step's token count sum to the whole batch's dapo loss (one big batch)."""
    data = fixed_batch()
    settings = PolicyLoss(loss_type="dapo")
    whole = policy_loss(data["logps"], data["old"], None, data["advantages"], data["mask"], settings).loss
    parts = [policy_loss(data["logps"][s], data["old"][s], None, data["advantages"][s], data["mask"][s], settings,
                         accumulation_steps=2, num_items=data["mask"].sum()).loss for s in (slice(0, 2), slice(2, 4))]
    assert abs(float(sum(parts)) - float(whole)) <= 1e-6
    with pytest.raises(ValueError, match="needs num_items"):
        policy_loss(data["logps"], data["old"], None, data["advantages"], data["mask"], settings, accumulation_steps=2)


def test_stats_add_over_micro_batches_and_round_trip_a_reduce():
    data = fixed_batch()
    settings = PolicyLoss(loss_type="grpo", beta=0.04)
    whole = policy_loss(data["logps"], data["old"], data["ref"], data["advantages"], data["mask"], settings).stats
    parts = [policy_loss(data["logps"][s], data["old"][s], data["ref"][s], data["advantages"][s], data["mask"][s],
                         settings).stats for s in (slice(0, 1), slice(1, 4))]
    added = {name: float(parts[0].sums()[name] + parts[1].sums()[name]) for name in parts[0].sums()}
    summed = PolicyStats.from_sums({**added, "entropy": 0.0}, kl=True, entropy=False)
    assert summed.means() == pytest.approx(whole.means(), abs=1e-6)
    no_kl = policy_loss(data["logps"], data["old"], None, data["advantages"], data["mask"], PolicyLoss()).stats
    assert "kl" not in no_kl.sums() and "kl" not in no_kl.means()
    assert PolicyStats.from_sums({**no_kl.sums(), "kl": 0.0, "entropy": 0.0}, kl=False, entropy=False).kl is None


def test_bad_settings_and_shapes_say_what_to_fix():
    with pytest.raises(ValueError, match=r"unknown loss_type 'ppo'; known: \['grpo', 'bnpo', 'dr_grpo', 'dapo'\]"):
        PolicyLoss(loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        PolicyLoss(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="beta must be >= 0"):
        PolicyLoss(beta=-0.1)
    data = fixed_batch()
    with pytest.raises(ValueError, match="needs ref_per_token_logps"):
        policy_loss(data["logps"], None, None, data["advantages"], data["mask"], PolicyLoss(beta=0.04))
    with pytest.raises(ValueError, match=r"completion_mask has shape \(4, 6\)"):
        policy_loss(data["logps"], None, None, data["advantages"], data["mask"][:, :6], PolicyLoss())
    with pytest.raises(ValueError, match=r"advantages must be \(B,\)"):
        policy_loss(data["logps"], None, None, data["advantages"][:3], data["mask"], PolicyLoss())


# ---- advantages ------------------------------------------------------------------------------------------------------
def trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str):
    """trl 1.16 grpo_trainer.py 2765-2788 and 2810 ("sum_then_normalize", after the weighted sum), over its `nanstd`."""
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    return torch.nan_to_num(advantages, nan=0.0), std_rewards, is_std_zero


# groups of 3: varied; all equal (zero variance); one unscored row (NaN); two unscored rows (one scored value left)
REWARDS = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 1.0, float("nan"), 0.0, float("nan"), 1.0, float("nan")])


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("num_generations", [1, 3])
def test_group_advantages_equal_trls(scale_rewards, num_generations):
    ours = group_advantages(REWARDS, num_generations, scale_rewards)
    theirs = trl_advantages(REWARDS, num_generations, scale_rewards)
    assert torch.allclose(ours.advantages, theirs[0], atol=ATOL, rtol=0)
    assert torch.allclose(ours.std, theirs[1], atol=ATOL, rtol=0, equal_nan=True)
    assert torch.equal(ours.zero_std, theirs[2])


def test_zero_variance_and_unscored_groups_have_no_advantage():
    """A group of equal rewards and unscored rows learn nothing; an all-but-one-unscored group neither (its std is
    NaN, as in trl, so it is not counted as zero variance)."""
    result = group_advantages(REWARDS, 3, "group")
    assert result.advantages[3:6].tolist() == [0.0, 0.0, 0.0] and result.zero_std[3:6].all()
    assert result.advantages[[7, 9, 11]].tolist() == [0.0, 0.0, 0.0]
    assert result.advantages[9:12].tolist() == [0.0, 0.0, 0.0] and not result.zero_std[9:12].any()
    assert result.advantages[:3].sum().abs() < 1e-6 and result.advantages[0] > 0 > result.advantages[1]


def test_group_advantages_refuse_bad_inputs():
    with pytest.raises(ValueError, match=r"unknown scale_rewards 'std'; known: \['group', 'batch', 'none'\]"):
        group_advantages(REWARDS, 3, "std")
    with pytest.raises(ValueError, match="multiple of num_generations"):
        group_advantages(REWARDS, 5)
