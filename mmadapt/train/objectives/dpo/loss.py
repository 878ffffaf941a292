"""The DPO family's losses from sequence log-probs (`preference_losses`): the formulas are in the package's
docstring (`mmadapt.train.objectives.dpo.objective`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "simpo", "orpo")


@dataclass(frozen=True)
class PreferenceTerms:
    """Per pair (B,): the loss, the chosen and rejected rewards."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_losses(loss_type: str, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                      reference_chosen: torch.Tensor | None, reference_rejected: torch.Tensor | None,
                      chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, *, beta: float,
                      label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> PreferenceTerms:
    """The per-pair losses of `loss_type` (the module's formulas) from summed sequence log-probs (B,) and answer
    token counts (B,); the reference's log-probs are None for the reference-free losses."""
    eps = label_smoothing
    if loss_type in ("sigmoid", "ipo"):
        if reference_chosen is None or reference_rejected is None:
            raise ValueError(f"loss_type {loss_type!r} needs the reference's log-probs")
        chosen_ratio, rejected_ratio = policy_chosen - reference_chosen, policy_rejected - reference_rejected
        if loss_type == "sigmoid":
            h = beta * (chosen_ratio - rejected_ratio)
            losses = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
        else:
            h = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            losses = (h - 1 / (2 * beta)) ** 2
        return PreferenceTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
    chosen_mean = policy_chosen / chosen_tokens.clamp(min=1)
    rejected_mean = policy_rejected / rejected_tokens.clamp(min=1)
    if loss_type == "simpo":
        h = beta * (chosen_mean - rejected_mean) - simpo_gamma
        losses = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
    elif loss_type == "orpo":
        log_odds = (chosen_mean - rejected_mean) - (log1m_exp(chosen_mean) - log1m_exp(rejected_mean))
        losses = -chosen_mean - beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; known: {list(LOSS_TYPES)}")
    return PreferenceTerms(losses, beta * chosen_mean.detach(), beta * rejected_mean.detach())


def log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurately on both sides of -log 2."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
