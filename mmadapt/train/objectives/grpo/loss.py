"""The GRPO family's arithmetic as pure functions over tensors (no model): group-relative advantages from rewards, and
the clipped policy-gradient loss with its KL term, as trl 1.16's `GRPOTrainer` computes them (token-level importance
sampling). The GRPO objective (rollouts, the trainer) calls these; tests/test_grpo_loss.py checks them against trl's
own code on fixed tensors.

Dimensions: B rows (completions: B = prompts x G), G completions per prompt (a group: G consecutive rows), T completion
positions (right-padded; `mask` (B, T) is 1 on a completion's tokens).

Advantages (`group_advantages`; trl `_generate_and_score_completions`, grpo_trainer.py 2759-2810, "sum_then_normalize"),
from r (B,) the weighted reward of each row, NaN for a row no reward function could score:

    mu_g   = nanmean of r over the row's group                                         (B,)
    sigma  = nanstd of r over the row's group ("group", "none") or over all B rows ("batch"); Bessel-corrected, NaN
             for fewer than two scored values; 0 when G = 1 (or B = 1 with "batch")   (B,)
    A      = (r - mu_g) / (sigma + 1e-4)     ("group", "batch");   A = r - mu_g ("none")
    A      = 0 where A is NaN (an unscored row, or a group with one scored row), zero_std = isclose(sigma, 0)

r must hold every group whole: under data parallelism trl gathers all ranks' rewards, computes A, then keeps its slice.

Loss (`policy_loss`; trl `_compute_loss`, grpo_trainer.py 3020-3184 and its clip metrics 3272-3281), from pi (B, T) the
policy's per-token log-probs (with grad), pi_old (B, T) the sampling policy's (None: pi detached, the on-policy case
trl skips computing), pi_ref (B, T) the reference's (needed when beta != 0), A (B,):

    rho    = exp(pi - pi_old)                                                          (B, T)
    l      = -min(rho A, clamp(rho, 1 - eps_low, 1 + eps_high) A)                      (B, T)
    kl     = exp(pi_ref - pi) - (pi_ref - pi) - 1   (k3);  kl = rho kl with `bias_correction_kl` (trl's default)
    l      = l + beta kl                                                               (when beta != 0)

reduced over the tokens (m = mask), per `loss_type`:

    grpo     mean_b [ sum_t m l / max(1, sum_t m) ]            / accumulation_steps
    bnpo     sum m l / max(1, sum m)                           / accumulation_steps
    dr_grpo  sum m l / (B x max_completion_length)             / accumulation_steps
    dapo     sum m l / max(1, num_items)

Gradient accumulation, as trl does it (`GRPOTrainer.loss_is_scaled_for_ga = True`: transformers adds no scaling): if
one optimizer step sums the gradients of M micro-batch losses (M = K micro-batches when the ranks' gradients are
averaged, as DDP does and trl runs; M = K x P for mmadapt's objectives, which back-propagate `loss x world`), pass
`accumulation_steps=M` and, for dapo, `num_items` = M x the mean completion tokens of a micro-batch of the step, i.e.
the step's completion tokens on all ranks / P under averaging (trl: `num_items_in_batch / num_processes x
gradient_accumulation_steps / steps_per_generation`, where `num_items_in_batch` counts the whole generation batch), or
all of them for mmadapt. Then the M losses sum to: grpo and dr_grpo, the one-big-batch loss (micro-batches of equal
rows); dapo, the step's token mean; bnpo, the mean of the micro-batches' token means (trl's, not a global mean).

Logged (`PolicyStats`, masked sums a trainer adds over micro-batches and ranks, then `means()`): `kl` (the mean of the
KL term over completion tokens, bias-corrected when the loss is), `clip_ratio/low_mean` (rho < 1 - eps_low where
A < 0), `clip_ratio/high_mean` (rho > 1 + eps_high where A > 0), `clip_ratio/region_mean` (either). Not covered:
sequence-level importance sampling (GSPO), trl's `delta`, entropy masks and bonus, vLLM importance sampling, the
off-policy mask, and the cispo / sapo / luspo / vespo losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # trl adds it to the std before dividing (grpo_trainer.py 2787)


# ---- advantages ------------------------------------------------------------------------------------------------------
class Advantages(NamedTuple):
    """Per row (B,): the advantage, the std it was scaled by (or checked against, with "none"), and whether that std
    is zero (every row of the group - or of the batch, with "batch" - had the same reward: nothing to learn)."""

    advantages: torch.Tensor
    std: torch.Tensor
    zero_std: torch.Tensor


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> Advantages:
    """Group-relative advantages of `rewards` (B,) (NaN: an unscored row), groups of `num_generations` consecutive
    rows, scaled per `scale_rewards` ("group", "batch", "none"); the module's formulas."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; known: {list(SCALE_REWARDS)}")
    if rewards.dim() != 1 or num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must be (B,) with B a multiple of num_generations ({num_generations}), got shape "
                         f"{tuple(rewards.shape)}: pass every completion of each prompt, groups of consecutive rows")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), std, zero_std)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The Bessel-corrected std of `x` over `dim` (all, when None) ignoring NaNs; NaN with fewer than two values
    (trl.trainer.utils.nanstd)."""
    keep = dim is not None
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keep)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keep)
    correction = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.full_like(variance, float("nan")))
    return torch.sqrt(variance * correction)


# ---- the loss --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PolicyLoss:
    """The loss's settings (trl's `GRPOConfig` names and defaults): `loss_type` (the token reduction), `beta` (the KL
    weight; 0: no reference needed), `epsilon` (the lower clip, eps_low), `epsilon_high` (None: `epsilon`; DAPO's
    clip-higher recommends 0.28), `max_completion_length` (dr_grpo's constant), `bias_correction_kl` (the KL term
    times the importance ratio)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    max_completion_length: int | None = None
    bias_correction_kl: bool = True

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; known: {list(LOSS_TYPES)}")
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0 (the KL weight; 0 turns the KL term off), got {self.beta}")
        if not 0 < self.epsilon < 1 or not self.epsilon_upper > 0:
            raise ValueError(f"epsilon must be in (0, 1) and epsilon_high > 0, got {self.epsilon} and "
                             f"{self.epsilon_high}")
        if self.loss_type == "dr_grpo" and not (self.max_completion_length or 0) > 0:
            raise ValueError(f"loss_type 'dr_grpo' divides by max_completion_length: set it (> 0), got "
                             f"{self.max_completion_length}")

    @property
    def epsilon_upper(self) -> float:
        """eps_high: `epsilon_high`, or `epsilon` when it is None."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class PolicyStats:
    """Masked sums over a micro-batch's completion tokens (0-d tensors, detached): added over micro-batches and
    ranks (`sums`, the trainer's all-reduce, `from_sums`), then `means()` gives trl's metrics. `kl` is None when beta
    is 0 (trl logs no `kl` then); `entropy` (the policy's, summed over the tokens) is None when not measured."""

    tokens: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    clipped_region: torch.Tensor
    kl: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    NAMES = ("tokens", "clipped_low", "clipped_high", "clipped_region", "kl", "entropy")

    def sums(self) -> dict[str, torch.Tensor]:
        """By `NAMES`, the measured ones (a trainer's `Terms.sums`)."""
        return {name: value for name, value in zip(self.NAMES, (self.tokens, self.clipped_low, self.clipped_high,
                                                                 self.clipped_region, self.kl, self.entropy),
                                                   strict=True) if value is not None}

    @classmethod
    def from_sums(cls, sums: dict[str, float], *, kl: bool, entropy: bool) -> PolicyStats:
        """`sums()` added over micro-batches and ranks, back (`kl`, `entropy`: whether they were measured)."""
        values = {name: torch.tensor(float(sums[name])) for name in cls.NAMES}
        return cls(values["tokens"], values["clipped_low"], values["clipped_high"], values["clipped_region"],
                   values["kl"] if kl else None, values["entropy"] if entropy else None)

    def means(self) -> dict[str, float]:
        """The means over completion tokens, by trl's names: `kl` (when beta != 0), `entropy` (when measured),
        `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`."""
        tokens = float(self.tokens.clamp(min=1.0))
        out = {"clip_ratio/low_mean": float(self.clipped_low) / tokens,
               "clip_ratio/high_mean": float(self.clipped_high) / tokens,
               "clip_ratio/region_mean": float(self.clipped_region) / tokens}
        if self.entropy is not None:
            out = {"entropy": float(self.entropy) / tokens, **out}
        return out if self.kl is None else {"kl": float(self.kl) / tokens, **out}


@dataclass(frozen=True)
class PolicyTerms:
    """A micro-batch's loss (0-d, with grad, scaled for accumulation: back-propagate it), its unscaled value (trl's
    logged `policy_loss`, detached) and its `PolicyStats`."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    stats: PolicyStats


def policy_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None,
                ref_per_token_logps: torch.Tensor | None, advantages: torch.Tensor, completion_mask: torch.Tensor,
                settings: PolicyLoss, *, accumulation_steps: int = 1,
                num_items: float | torch.Tensor | None = None) -> PolicyTerms:
    """The clipped policy-gradient loss of one micro-batch (the module's formulas): log-probs (B, T), advantages (B,),
    `completion_mask` (B, T). `accumulation_steps` and `num_items` (dapo's token count) scale it for accumulation
    (the module docstring says what to pass)."""
    check_shapes(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, completion_mask, settings)
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1 (the micro-batch losses one step sums), got "
                         f"{accumulation_steps}")
    mask = completion_mask.to(per_token_logps.dtype)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(per_token_logps - old)
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.epsilon_upper)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if settings.beta != 0.0:
        gap = ref_per_token_logps - per_token_logps
        kl = torch.exp(gap) - gap - 1
        if settings.bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + settings.beta * kl
    loss = reduce_tokens(per_token, mask, settings, accumulation_steps, num_items)
    stats = clip_stats(ratio.detach(), adv, mask, settings, None if kl is None else kl.detach())
    if settings.loss_type == "dapo":  # num_items already spans the step
        return PolicyTerms(loss, loss.detach(), stats)
    return PolicyTerms(loss / accumulation_steps, loss.detach(), stats)


def reduce_tokens(per_token: torch.Tensor, mask: torch.Tensor, settings: PolicyLoss, accumulation_steps: int,
                  num_items: float | torch.Tensor | None) -> torch.Tensor:
    """The per-token losses (B, T) reduced as `settings.loss_type` does (module docstring), before the division by
    `accumulation_steps` (which dapo's `num_items` already holds)."""
    summed = per_token * mask
    if settings.loss_type == "dapo":
        if num_items is None and accumulation_steps != 1:
            raise ValueError("loss_type 'dapo' with accumulation_steps > 1 needs num_items, the step's completion "
                             "tokens to average over (the module docstring says which count), or each micro-batch "
                             "would be averaged over its own tokens only")
        count = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=mask.dtype, device=mask.device)
        return summed.sum() / count.clamp(min=1.0)
    if settings.loss_type == "grpo":
        return (summed.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if settings.loss_type == "bnpo":
        return summed.sum() / mask.sum().clamp(min=1.0)
    return summed.sum() / (per_token.size(0) * settings.max_completion_length)  # dr_grpo (PolicyLoss validated it)


def clip_stats(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, settings: PolicyLoss,
               kl: torch.Tensor | None) -> PolicyStats:
    """The masked sums of the clipped tokens (trl: a ratio clipped where its clipping binds) and of the KL term."""
    low = (ratio < 1 - settings.epsilon) & (adv < 0)
    high = (ratio > 1 + settings.epsilon_upper) & (adv > 0)
    return PolicyStats(mask.sum(), (low * mask).sum(), (high * mask).sum(), ((low | high) * mask).sum(),
                       None if kl is None else (kl * mask).sum())


def check_shapes(logps: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None, advantages: torch.Tensor,
                 mask: torch.Tensor, settings: PolicyLoss) -> None:
    """`ValueError` naming the tensor whose shape does not fit (B, T) / (B,), or the missing reference."""
    if logps.dim() != 2:
        raise ValueError(f"per_token_logps must be (B, T), got shape {tuple(logps.shape)}")
    shapes = {"old_per_token_logps": old, "ref_per_token_logps": ref, "completion_mask": mask}
    for name, tensor in shapes.items():
        if tensor is not None and tensor.shape != logps.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, per_token_logps {tuple(logps.shape)}: both "
                             "must be (B, T) over the same completion positions")
    if advantages.shape != logps.shape[:1]:
        raise ValueError(f"advantages must be (B,) = ({logps.shape[0]},), one per row, got {tuple(advantages.shape)}")
    if settings.beta != 0.0 and ref is None:
        raise ValueError(f"beta = {settings.beta} needs ref_per_token_logps (the reference's log-probs); pass them, "
                         "or set beta to 0 to train without the KL term")
