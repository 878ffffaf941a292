"""Heads: what the model computes at the top of its decoder, passed to `VisionLanguageModel.forward(..., head=)`.

Without a head, `forward` is transformers' causal-LM forward: the loss from `labels` (`mmadapt.loss`) and the logits.
With one, the model runs its decoder on the prepared inputs (visual tokens injected, packing, positions) and returns
what the head makes of the top (`HeadInputs`: the last hidden states, the labels, the output layer, the input
embeddings, ...). A new objective that needs another quantity adds a head, not a parameter of `forward`; a head may
live anywhere (an objective's folder), since it needs nothing from the model but what it is handed:

    from mmadapt.heads import Head, HeadInputs

    class MeanState(Head):
        '''Per row, the mean last hidden state of its supervised positions.'''

        def __call__(self, top: HeadInputs) -> torch.Tensor:
            keep = top.supervised_mask().float()  # (B, L)
            return (top.hidden * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)

    means = model(**batch, head=MeanState())  # batch with labels

The heads here (each equal to full-logits arithmetic, without the (B, L, V) logits: the supervised positions only,
`lm_head` one chunk of rows at a time, recomputed in the backward):
- `SequenceLogps` -> `SequenceLogProbs`: per row, the summed log-probs of its labelled tokens (preference objectives),
  optionally the token KL to a reference's states and the positions' own states (to serve as a later reference);
- `TokenLogps` -> `TokenLogProbs`: each labelled token's log-prob under softmax(logits / temperature) and,
  optionally, that distribution's entropy (online RL); returned, not written into a caller's buffer: the result is
  made where the logits are, in their order, and a caller keeps nothing allocated to the right shape in advance;
- `TokenLosses` -> `TokenLossesOutput`: the language-model loss (`.loss`, as `forward(labels=...)` gives it in
  training, with `num_items_in_batch` and an MoE router's loss) and each position's token loss (a mixture's loss per
  source).

A head object is an ordinary keyword argument: DDP and FSDP2 pass it through their wrappers' forward untouched (they
map tensors in containers; a head is neither). A head's result should be a `transformers.utils.ModelOutput` (or a
tensor) so that DDP finds the tensors of the output. Heads compute `output(hidden)`: a backbone whose logits are more
than that (a soft-cap, a logit scale: `mmadapt.loss.full_path_reason`) refuses them.

Shapes: B rows, L tokens, D width, V vocabulary, N supervised positions, R rows scored.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from mmadapt.loss import (
    TiedEmbedding,
    accumulate_product,
    causal_lm_loss,
    logits_token_losses,
    next_tokens,
    output_chunk_rows,
)


@dataclass(frozen=True)
class HeadInputs:
    """What the model hands a head: `hidden` (B, L, D) the decoder's last hidden states; `labels` (B, L) or None, on
    `hidden`'s device (-100: no label; position t predicts labels[t + 1]); `output` the output layer (`lm_head`: an
    `nn.Linear`, possibly LoRA-wrapped, possibly tied to the input embedding); `inputs_embeds` (B, L, D) the input
    embeddings `hidden` came from (a head tied to them then keeps one (V, D) gradient buffer: `TiedEmbedding`);
    `valid` (B, L) bool the real tokens; `num_items_in_batch` the forward's keyword (transformers' token-normalised
    accumulation) or None; `aux_loss` the backbone's weighted auxiliary loss for a training loss to add (an MoE
    router's load balancing, when it outputs router logits) or None; `full_logits` whether the run asked for its loss
    from full logits (`train.full_logits`)."""

    hidden: torch.Tensor
    labels: torch.Tensor | None
    output: nn.Module
    inputs_embeds: torch.Tensor
    valid: torch.Tensor
    num_items_in_batch: Any = None
    aux_loss: torch.Tensor | None = None
    full_logits: bool = False

    def require_labels(self, head: Head | str) -> torch.Tensor:
        """The labels, or a ValueError naming `head` (a head, or what needs them)."""
        if self.labels is None:
            name = head if isinstance(head, str) else type(head).__name__
            raise ValueError(f"head {name} needs labels (the tokens to score): pass labels= to forward")
        return self.labels

    def supervised_mask(self) -> torch.Tensor:
        """(B, L) bool: the positions that predict a label (`mmadapt.loss.next_tokens`)."""
        return next_tokens(self.require_labels("supervised_mask"))[1]

    def supervised(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N, D) the hidden states of the positions that predict a label, (N,) those labels, (N,) each one's row."""
        return supervised_rows(self.hidden, self.require_labels("supervised"))


class Head(ABC):
    """What the model computes at the top: called with the top's `HeadInputs`, returns the result `forward` returns
    (see the module's docstring for an example)."""

    @abstractmethod
    def __call__(self, top: HeadInputs) -> Any:
        """The result, from the top of one forward."""


# ---- results -------------------------------------------------------------------------------------------------------
@dataclass
class SequenceLogProbs(ModelOutput):
    """`SequenceLogps`' result: per row, `logps` (R,) fp32 the sum of the log-probs of its labelled tokens, `tokens`
    (R,) how many; `kl` (R,) the summed token KL to a reference (when one was given); `states` (N, D) the supervised
    positions' hidden states, detached (with `keep_states`)."""

    logps: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    states: torch.Tensor | None = None


@dataclass
class TokenLogProbs(ModelOutput):
    """`TokenLogps`' result: `logps` (B, L) fp32, at each labelled position t log p(labels[t] | the tokens before it),
    0 elsewhere, differentiable; `entropy` (B, L) fp32 that distribution's entropy there (0 elsewhere), detached, or
    None when not asked."""

    logps: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


@dataclass
class TokenLossesOutput(ModelOutput):
    """`TokenLosses`' result: `loss` the scalar fp32 training loss (as `forward(labels=...).loss` in training);
    `token_losses` (B, L) fp32 each position's token loss (position t's for predicting labels[t + 1], 0 where nothing
    is predicted), detached; `aux_loss` the weighted auxiliary loss included in `loss` (MoE) or None."""

    loss: torch.Tensor | None = None
    token_losses: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


# ---- the heads -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SequenceLogps(Head):
    """Per row, the sum of the log-probs of its labelled tokens and their count (`SequenceLogProbs`), from the
    supervised positions only. `reference` = (a reference model's supervised states (N, D) at the same positions, a
    callable giving its logits from them) adds the per-row token KL(policy || reference) (no gradient; logged);
    `keep_states` returns the positions' states (a reference's, for that KL)."""

    reference: tuple[torch.Tensor, Any] | None = None
    keep_states: bool = False

    def __call__(self, top: HeadInputs) -> SequenceLogProbs:
        top.require_labels(self)
        states, targets, rows = top.supervised()
        num_rows = top.hidden.shape[0]
        logps, kl = sequence_logps(states, top.output, targets, rows, num_rows, reference=self.reference,
                                   embeds=top.inputs_embeds)
        tokens = torch.bincount(rows, minlength=num_rows)
        return SequenceLogProbs(logps=logps, tokens=tokens, kl=kl, states=states.detach() if self.keep_states else None)


@dataclass(frozen=True)
class TokenLogps(Head):
    """(B, L) per-token log-probs of the labelled tokens under softmax(logits / `temperature`) (`TokenLogProbs`):
    what an online RL objective scores its completions with (trl's `_get_per_token_logps`, the sampling temperature
    included); `entropy=True` adds each labelled position's entropy of that distribution (trl's logged `entropy`)."""

    temperature: float = 1.0
    entropy: bool = False

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"TokenLogps: temperature must be > 0, got {self.temperature}")

    def __call__(self, top: HeadInputs) -> TokenLogProbs:
        labels = top.require_labels(self)
        states, targets, _ = top.supervised()
        scored = token_logps(states, top.output, targets, temperature=self.temperature, entropy=self.entropy)
        logps, entropies = scored if self.entropy else (scored, None)
        rows, positions = top.supervised_mask().nonzero(as_tuple=True)  # the order of `supervised`'s states
        where = (rows, positions + 1)  # position t's state predicts labels[t + 1]
        return TokenLogProbs(logps=logps.new_zeros(labels.shape).index_put(where, logps),
                             entropy=None if entropies is None else entropies.new_zeros(labels.shape).index_put(
                                 where, entropies))


@dataclass(frozen=True)
class TokenLosses(Head):
    """The language-model loss and each position's token loss (`TokenLossesOutput`): a mixture's loss per source.
    The loss is `forward(labels=...)`'s in training: the summed token losses / `num_items_in_batch` (else / their
    count), from the supervised positions in chunks (`mmadapt.loss.causal_lm_loss`), or from full logits when the run
    asks for them (`train.full_logits`), plus the backbone's auxiliary loss (an MoE router's)."""

    def __call__(self, top: HeadInputs) -> TokenLossesOutput:
        labels = top.require_labels(self)
        if top.full_logits:
            each = logits_token_losses(top.output(top.hidden), labels)
            items = top.supervised_mask().sum() if top.num_items_in_batch is None else top.num_items_in_batch
            loss = each.sum() / torch.as_tensor(items, device=each.device)
            token_losses = each.detach()
        else:
            token_losses = top.hidden.new_zeros(labels.shape, dtype=torch.float32)
            loss = causal_lm_loss(top.hidden, top.output, labels, top.num_items_in_batch, embeds=top.inputs_embeds,
                                  token_losses=token_losses)
        if top.aux_loss is not None:
            loss = loss + top.aux_loss.to(loss.device)
        return TokenLossesOutput(loss=loss, token_losses=token_losses, aux_loss=top.aux_loss)


# ---- the maths: log-probs without the (B, L, V) logits -------------------------------------------------------------
def supervised_rows(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mmadapt.loss.supervised`, and (N,) the row each supervised position belongs to."""
    shifted, keep = next_tokens(labels)
    rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(labels)[keep]
    return hidden[keep], shifted[keep], rows


def sequence_logps(states: torch.Tensor, head: nn.Module, targets: torch.Tensor, rows: torch.Tensor, num_rows: int,
                   *, chunk: int | None = None, reference: tuple[torch.Tensor, Any] | None = None,
                   embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row, the sum of log p(target) over its supervised positions, without the (B, L, V) logits.

    states (N, D): the hidden states of the positions that predict `targets` (N,); `rows` (N,): the row of each.
    Returns (R,) fp32 sequence log-probs (differentiable), and with `reference` = (its states (N, D) at the same
    positions, its head), (R,) the per-row sum of the token KL(policy || reference) (no gradient; for logging).

    A plain `nn.Linear` head goes through `LinearLogProbs` (the logits of one chunk at a time, recomputed in the
    backward: no logits kept; the KL from the same chunks); any other head through activation checkpointing per
    chunk (and `token_kl`).
    """
    chunk = chunk or output_chunk_rows(head)
    if type(head) is nn.Linear:
        tied = None if embeds is None else TiedEmbedding.find(embeds, head.weight)
        kl = None if reference is None else torch.zeros(num_rows, dtype=torch.float32, device=states.device)
        if reference is not None:
            chunk = max(1, chunk // 2)  # the reference's logits beside the policy's: two half chunks
        logps = LinearLogProbs.apply(states, head.weight, head.bias, targets, rows, num_rows, chunk, tied,
                                     reference, kl)
        return logps, kl
    logps = states.new_zeros(num_rows, dtype=torch.float32)
    for start in range(0, states.shape[0], chunk):
        part = slice(start, start + chunk)
        logps = logps.index_add(0, rows[part], checkpoint_logps(head, states[part], targets[part]))
    kl = None if reference is None else token_kl(states, head, reference, rows, num_rows, chunk)
    return logps, kl


def token_logps(states: torch.Tensor, head: nn.Module, targets: torch.Tensor, *, temperature: float = 1.0,
                chunk: int | None = None, entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(N,) fp32 log p(target) of each position under softmax(head(states) / temperature), without the (B, L, V)
    logits: one chunk of logits at a time, recomputed in the backward (activation checkpointing per chunk).
    `entropy=True` returns (log-probs, entropies): also each position's entropy (nats) of that distribution,
    detached, from the same chunk of logits."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk or output_chunk_rows(head)
    parts = [checkpoint_logps(head, states[start:start + chunk], targets[start:start + chunk], temperature, entropy)
             for start in range(0, states.shape[0], chunk)]
    empty = states.new_zeros(0, dtype=torch.float32)
    if not entropy:
        return torch.cat(parts) if parts else empty
    return (torch.cat([p[0] for p in parts]) if parts else empty, torch.cat([p[1] for p in parts]) if parts else empty)


def _chunk_logps(head: nn.Module, states: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                 entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    logits = head(states).float()
    if temperature != 1.0:
        logits = logits / temperature
    normaliser = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets[:, None]).squeeze(1) - normaliser
    if not entropy:
        return picked
    with torch.no_grad():  # H = logsumexp(l) - sum(softmax(l) * l)
        return picked, normaliser - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def checkpoint_logps(head: nn.Module, states: torch.Tensor, targets: torch.Tensor,
                     temperature: float = 1.0, entropy: bool = False) -> Any:
    """One chunk's log-probs (and entropies), its logits recomputed in the backward (activation checkpointing)."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(_chunk_logps, head, states, targets, temperature, entropy, use_reentrant=False)


def _log_ratio(mine: torch.Tensor, reference: tuple[torch.Tensor, Any], part: slice) -> torch.Tensor:
    """(C,) the sum over the vocabulary of p (log p - log q) for one chunk: `mine` (C, V) the policy's log-softmax
    (used up), `reference` = (its states, a callable giving its logits)."""
    difference = torch.log_softmax(reference[1](reference[0][part].to(mine.device)).float(), dim=-1)
    difference.neg_().add_(mine)  # log p - log q, in place of log q
    return mine.exp_().mul_(difference).sum(-1)


@torch.no_grad()
def token_kl(states: torch.Tensor, head: nn.Module, reference: tuple[torch.Tensor, Any], rows: torch.Tensor,
             num_rows: int, chunk: int) -> torch.Tensor:
    """(R,) per row, the sum over its supervised positions of KL(policy || reference) over the whole vocabulary;
    `reference` = (its states at the same positions, a callable giving its logits from them)."""
    total = torch.zeros(num_rows, dtype=torch.float32, device=states.device)
    chunk = max(1, chunk // 2)  # two chunks of logits at once: the budget of one
    for start in range(0, states.shape[0], chunk):
        part = slice(start, start + chunk)
        total.index_add_(0, rows[part], _log_ratio(torch.log_softmax(head(states[part]).float(), dim=-1),
                                                   reference, part))
    return total


class LinearLogProbs(torch.autograd.Function):
    """(R,) per-row sums of log softmax(states @ weight.T + bias)[target], fp32, one chunk of logits at a time.

    The forward keeps no logits; the backward recomputes each chunk's and applies d logp / d logits = one-hot -
    softmax, scaled by the row's incoming gradient: 4 matmuls per chunk (the SFT path's `LinearCrossEntropy` needs 3,
    since a scalar loss's gradient is known in its forward; a preference loss weighs each row by a factor that is
    known only once every row's log-prob is). The weight's gradient is one fp32 (V, D) sum, accumulated in place, and
    a head tied to the input embedding is told where it is (`TiedEmbedding`), as in `LinearCrossEntropy`."""

    @staticmethod
    def forward(ctx: Any, states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, rows: torch.Tensor, num_rows: int, chunk: int,
                tied: TiedEmbedding | None = None, reference: tuple[torch.Tensor, Any] | None = None,
                kl: torch.Tensor | None = None) -> torch.Tensor:
        """`reference` = (its states at the same positions, a callable giving its logits) and `kl` (R,): the token
        KL(policy || reference) summed per row into `kl` from the same chunks of the policy's logits (no gradient)."""
        total = torch.zeros(num_rows, dtype=torch.float32, device=states.device)
        dtype = states.dtype
        for start in range(0, states.shape[0], chunk):
            part = slice(start, start + chunk)
            logits = F.linear(states[part], weight, bias)
            dtype = logits.dtype
            logits = logits.float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets[part, None]).squeeze(1) - lse
            total.index_add_(0, rows[part], picked)
            if reference is not None:  # log-softmax in place of the logits
                kl.index_add_(0, rows[part], _log_ratio(logits.sub_(lse[:, None]), reference, part))
        ctx.save_for_backward(states, weight, *(() if bias is None else (bias,)), targets, rows)
        ctx.has_bias, ctx.chunk, ctx.dtype, ctx.tied = bias is not None, chunk, dtype, tied
        return total

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        states, weight = saved[0], saved[1]
        bias = saved[2] if ctx.has_bias else None
        targets, rows = saved[-2], saved[-1]
        want_states, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_bias = ctx.has_bias and ctx.needs_input_grad[2]
        dtype = ctx.dtype
        grad_states = torch.empty_like(states) if want_states else None
        grad_weight = grad_bias = None
        scale = grad_rows.float()[rows]  # (N,) each position's row gradient
        weight_c = weight.to(dtype)  # the compute dtype's weight, cast once (a no-op in fp32)
        bias_c = None if bias is None else bias.to(dtype)
        for start in range(0, states.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            chunk_states = states[part].to(dtype)
            logits = F.linear(chunk_states, weight_c, bias_c).float()
            grad = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_().neg_()  # in place: - softmax
            # d logp / d logits = one-hot - softmax
            grad[torch.arange(grad.shape[0], device=grad.device), targets[part]] += 1.0
            grad.mul_(scale[part, None])
            grad = grad.to(dtype)
            if want_states:
                grad_states[part] = (grad @ weight_c).to(states.dtype)
            if want_weight:
                grad_weight = accumulate_product(grad_weight, grad.t(), chunk_states)
            if want_bias:
                grad_bias = grad.float().sum(0) if grad_bias is None else grad_bias.add_(grad.float().sum(0))
        if want_weight and grad_weight is None:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if want_bias and grad_bias is None:
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
            if ctx.tied is not None and not torch.is_grad_enabled():
                ctx.tied.arm(grad_weight)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_states, grad_weight, grad_bias, None, None, None, None, None, None, None
