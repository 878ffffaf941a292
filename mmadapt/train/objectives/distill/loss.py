"""On-policy distillation's arithmetic: trl 1.16's GKD generalised Jensen-Shannon divergence between the student's
and the teacher's next-token distributions (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes", arXiv 2306.13649, Eq. 1; trl's `GKDTrainer.generalized_jsd_loss`), from
logits (`generalized_jsd`) or chunk by chunk from hidden states without (N, V) logits (`chunked_generalized_jsd`).

Per scored position, with S / T the student's / teacher's distributions over the vocabulary after dividing the
logits by `temperature` (tau), and KL(P || Q) = sum_v P_v (log P_v - log Q_v):

- beta = 0: KL(T || S), the forward KL (supervised KD's direction; trl's config: "the KL divergence");
- beta = 1: KL(S || T), the reverse KL (weighed by the student: the per-token reverse KL that issue 55 names as
  on-policy distillation's loss; trl's config: "the Inverse KL Divergence");
- 0 < beta < 1: with the mixture M = beta T + (1 - beta) S, JSD(beta) = beta KL(T || M) + (1 - beta) KL(S || M)
  (beta = 0.5: the symmetric JSD). The interior does NOT tend to the endpoints: as beta -> 0 it tends to 0, not to
  KL(T || S); trl special-cases beta 0 and 1 exactly as here.

So in trl 1.16 beta = 1 (not 0) is the reverse KL; issue 55's "beta 0 (reverse KL)" has the direction the other way.

trl keeps every vocabulary entry's term before reducing: `reduction="none"` returns the (n, V) terms of the kept
positions ((B, L, V) without a mask), `"sum"` their total, `"batchmean"` the total over the first dimension's size
(torch's and trl's batchmean: the n kept positions with a mask, at least 1 so that none gives 0; B without a mask),
`"mean"` the mean over the n x V terms (trl's, kept for equality; per token it is `batchmean` / V). A position is
kept where `mask` is True (trl's `labels != -100`). trl's `num_items_in_batch` (the global count of scored positions,
for accumulation and ranks) is `reduction="sum"` divided by that count. The student and the teacher must share the
tokenizer: the same V, else a `ValueError`.

`chunked_generalized_jsd` returns the sum over the N given positions (the caller picks the scored ones and divides by
its normaliser), computing each chunk's (C, V) logits from the student's head (any module: `nn.Linear`, with LoRA
or not) and the teacher's (without grad) under `torch.utils.checkpoint`, so the backward keeps only the chunks'
inputs and recomputes one chunk's logits at a time: peak memory O(C x V + N x D) (the states' gradient), not
O(N x V). Its logits are fp32 whatever the heads' dtype.

Dimensions: B rows, L positions, V vocabulary, N scored positions, D / D_t the student's / teacher's width, C the
chunk's positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

REDUCTIONS = ("batchmean", "sum", "mean", "none")


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
                    *, beta: float = 0.5, temperature: float = 1.0, reduction: str = "batchmean") -> torch.Tensor:
    """trl's generalised JSD of (..., V) logits (the module's formulas), over the positions where `mask` (...) bool is
    True (all without one), reduced by `reduction` (one of `REDUCTIONS`)."""
    check_settings(beta, temperature, reduction)
    check_vocabularies(student_logits, teacher_logits)
    terms = divergence_terms(F.log_softmax(student_logits / temperature, dim=-1),
                             F.log_softmax(teacher_logits / temperature, dim=-1), beta)
    if mask is not None:
        positions = tuple(student_logits.shape[:-1])
        if mask.dtype != torch.bool or tuple(mask.shape) != positions:
            raise ValueError(f"mask must be a bool tensor of the logits' leading shape {positions} (True: a scored "
                             f"position); got {mask.dtype} {tuple(mask.shape)}")
        terms = terms[mask]
    return reduce(terms, reduction)


def divergence_terms(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """The per-vocabulary-entry terms (..., V) whose sum over V is the position's divergence; `F.kl_div(q, p,
    log_target=True)` is p (log p - log q), i.e. KL(P || Q) with the arguments the other way round."""
    if beta == 0:
        return F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    if beta == 1:
        return F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    mixture = torch.logaddexp(student_log_probs + math.log1p(-beta), teacher_log_probs + math.log(beta))
    to_teacher = F.kl_div(mixture, teacher_log_probs, reduction="none", log_target=True)
    to_student = F.kl_div(mixture, student_log_probs, reduction="none", log_target=True)
    return beta * to_teacher + (1 - beta) * to_student


def reduce(terms: torch.Tensor, reduction: str) -> torch.Tensor:
    """trl's reductions of the kept (n, V) terms (or all (..., V) without a mask)."""
    if reduction == "batchmean":
        return terms.sum() / max(terms.size(0), 1)
    if reduction == "sum":
        return terms.sum()
    if reduction == "mean":
        return terms.mean()
    return terms


def chunked_generalized_jsd(student_states: torch.Tensor, student_head: nn.Module, teacher_states: torch.Tensor,
                            teacher_head: nn.Module, *, beta: float = 0.5, temperature: float = 1.0,
                            chunk_size: int = 1024) -> torch.Tensor:
    """The sum over N positions of trl's generalised JSD, from the student's states (N, D) through `student_head`
    and the teacher's (N, D_t) through `teacher_head` (no grad), `chunk_size` positions at a time, each chunk's
    logits recomputed in the backward (peak memory O(chunk_size x V + N x D)). A scalar; 0 (still through the head)
    for N = 0."""
    check_settings(beta, temperature, "sum")
    if student_states.dim() != 2 or teacher_states.dim() != 2 or len(student_states) != len(teacher_states):
        raise ValueError(f"the student's and the teacher's states must be (N, D) and (N, D_t) at the same N "
                         f"positions; got {tuple(student_states.shape)} and {tuple(teacher_states.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    total = student_states.new_zeros((), dtype=torch.float32)
    for start in range(0, max(len(student_states), 1), chunk_size):
        rows = slice(start, start + chunk_size)
        total = total + checkpoint(chunk_divergence, student_states[rows], student_head, teacher_states[rows],
                                   teacher_head, beta, temperature, use_reentrant=False)
    return total


def chunk_divergence(student_states: torch.Tensor, student_head: nn.Module, teacher_states: torch.Tensor,
                     teacher_head: nn.Module, beta: float, temperature: float) -> torch.Tensor:
    """One chunk's summed divergence from (C, D) / (C, D_t) states: its (C, V) logits live only inside this call."""
    student_logits = student_head(student_states).float()
    with torch.no_grad():
        teacher_logits = teacher_head(teacher_states).float()
    return generalized_jsd(student_logits, teacher_logits, beta=beta, temperature=temperature, reduction="sum")


def check_settings(beta: float, temperature: float, reduction: str) -> None:
    if not 0 <= beta <= 1:
        raise ValueError(f"beta must be in [0, 1] (0: KL(teacher || student), 1: KL(student || teacher)); got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; known: {list(REDUCTIONS)}")


def check_vocabularies(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(f"the student's vocabulary has {student_logits.shape[-1]} entries and the teacher's "
                         f"{teacher_logits.shape[-1]}: distillation needs the same tokenizer for both (a teacher "
                         f"exported with the student's tokenizer)")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"the student's and the teacher's logits must score the same positions; got "
                         f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}")
