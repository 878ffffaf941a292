"""The heads of on-policy distillation (`mmadapt.heads.Head`): the teacher's `CompletionStates` (its last hidden
states at the positions that predict a completion token, and its output layer) and the student's `Divergence` (trl's
generalised JSD from those, `loss.chunked_generalized_jsd`: no (N, V) logits).

Both take the positions in the order `HeadInputs.supervised` gives them (row by row, left to right) over the same
rows and labels, so the student's n-th state and the teacher's n-th state predict the same token.

Shapes: N positions predicting a completion token, D / D_t the student's / teacher's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from mmadapt.heads import Head, HeadInputs
from mmadapt.train.objectives.distill.loss import chunked_generalized_jsd


@dataclass(frozen=True)
class CompletionStates(Head):
    """(states (N, D_t) detached, the output layer): what the teacher hands the student's `Divergence`."""

    def __call__(self, top: HeadInputs) -> tuple[torch.Tensor, nn.Module]:
        states, _, _ = top.supervised()
        return states.detach(), top.output


@dataclass
class DivergenceOutput(ModelOutput):
    """`Divergence`'s result: `divergence` the summed per-token divergence (a differentiable fp32 scalar), `tokens`
    the positions it sums over."""

    divergence: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class Divergence(Head):
    """The sum over the completion positions of trl's generalised JSD between the student's next-token distribution
    (its states through its output layer, with grad) and the teacher's (`CompletionStates`), `chunk_size` positions'
    logits at a time, recomputed in the backward."""

    teacher: tuple[torch.Tensor, Any]
    beta: float
    temperature: float
    chunk_size: int

    def __call__(self, top: HeadInputs) -> DivergenceOutput:
        states, _, _ = top.supervised()
        teacher_states, teacher_head = self.teacher
        total = chunked_generalized_jsd(states, top.output, teacher_states.to(states.device), teacher_head,
                                        beta=self.beta, temperature=self.temperature, chunk_size=self.chunk_size)
        return DivergenceOutput(divergence=total, tokens=torch.tensor(len(states), device=states.device))
