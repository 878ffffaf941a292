"""The training objectives' quantities without the full logits: supervised positions only, `lm_head` in chunks.

Two uses, one method: SFT's token loss (`causal_lm_loss`, below) and the preference objectives' per-row sequence
log-probs (`sequence_logps`, at the end: each row's summed answer log-probs, and optionally the token KL against a
reference's hidden states), both computed over the supervised (answer) positions only, chunk by chunk, for the
objectives of `mmadapt.train.objectives`.

transformers' causal LMs compute logits (B, L, V) for every position and then the loss. At a real
vocabulary (Qwen3.5: V = 248,320) those logits and their fp32 copies dominate a training step's memory
(4.6 fp32 logits tensors at the peak of one fwd+bwd), and in VLM fine-tuning most positions carry no
label (image tokens, prompts), so most of that work is thrown away. In training mode with `labels`
(Liger Kernel's convention) `VisionLanguageModel.forward` therefore runs the backbone's base model for
hidden states and calls `causal_lm_loss` here:

1. Skip: keep the positions whose next-token label is not -100 (transformers' shift: position t predicts
   labels[t + 1]; a row's last position predicts nothing), (N, D) hidden states and (N,) targets.
2. Chunk: `lm_head` + cross-entropy over `chunk_rows(V)` positions at a time (about `CHUNK_BYTES` of fp32
   logits per chunk), never holding more than one chunk's logits.
   - A plain `nn.Linear` head (the usual case, tied or not) goes through `LinearCrossEntropy`, an autograd
     function that computes the loss *and* its gradients chunk by chunk in the forward pass (d loss / d
     logits = softmax - one-hot), so no logits are stored or recomputed: 3 matmuls per chunk, as the full
     path's forward + backward, over N positions instead of B * L.
   - Any other head (a LoRA-wrapped `lm_head`, a custom module) goes through activation checkpointing per
     chunk (`torch.utils.checkpoint`): the chunk's logits are recomputed in the backward pass.
3. Reduce: the per-token losses are summed in fp32 and divided by `num_items_in_batch` when given (the
   trainer's token-normalised gradient accumulation, transformers' `Trainer`), else by N: the same
   numbers as transformers' `ForCausalLMLoss` (logits cast to fp32 before the cross-entropy), including
   its NaN for a batch with no supervised token and no `num_items_in_batch`.

A head tied to the input embedding (one (V, D) weight, e.g. Qwen3.5-0.8B) gets two gradients: the loss's,
computed in the forward pass, and the embedding's, which its backward (`EmbeddingBackward0`) would scatter into a
fresh dense (V, D) buffer for autograd to add to the first: two (V, D) buffers at the end of the backward, on top
of the other parameters' gradients. `causal_lm_loss(..., embeds=)` (the embeddings `hidden` came from) instead
adds the embedding's rows (B * L of them) into the loss's buffer and skips the dense one (`TiedEmbedding`): one
(V, D) buffer, which `AccumulateGrad` then takes as `.grad` (or adds into an existing `.grad`); the same sums.

Under autocast the matmuls run in the autocast dtype, as transformers' `lm_head` does, and the softmax in
fp32. It is torch-native: the same code on CPU and GPU, under DDP and FSDP2 (the head's weight is a plain
tensor inside the forward; its gradient flows back to the sharded parameter as usual).

Backbones whose logits are more than `lm_head(hidden)` (a final soft-cap, a logit scale) keep
transformers' full path: `full_path_reason`. An MoE router's load-balancing loss (`output_router_logits`;
the function its backbone declares, `BackboneSpec.moe.balance_loss`) is added on either path:
`router_balance_loss`, over the real tokens only.

Shapes: B rows, L tokens, D width, V vocabulary, N supervised positions, C positions per chunk.
"""

from __future__ import annotations

from typing import Any, Final

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX: Final[int] = -100
CHUNK_BYTES: Final[int] = 2**28  # fp32 logits per chunk: 256 MiB (270 positions at V = 248,320)
# config fields that make the logits more than lm_head(hidden), or the loss more than the cross-entropy
LOGIT_TRANSFORMS: Final[tuple[str, ...]] = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                                            "output_multiplier_scale")


def full_path_reason(config: Any) -> str | None:
    """Why a backbone with transformers config `config` must compute its loss from full logits, or None."""
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            return f"its config sets {name} = {value} (the logits are more than lm_head(hidden))"
    return None


def chunk_rows(vocab_size: int, budget: int | None = None) -> int:
    """Positions per chunk so that one chunk's fp32 logits take about `budget` bytes (default `CHUNK_BYTES`)."""
    return max(1, (CHUNK_BYTES if budget is None else budget) // (4 * vocab_size))


def supervised(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, D) hidden states of the positions that predict a label, and the (N,) labels they predict."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    keep = shifted != IGNORE_INDEX
    return hidden[keep], shifted[keep]


def causal_lm_loss(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor,
                   num_items_in_batch: torch.Tensor | int | None = None, *, rows: int | None = None,
                   embeds: torch.Tensor | None = None, token_losses: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' causal-LM loss of `head(hidden)` for (B, L) `labels`, without the (B, L, V) logits.

    hidden (B, L, D): the base model's last hidden states; `head`: the LM's output layer (`lm_head`); `embeds`
    (B, L, D), optional: the input embeddings `hidden` was computed from, so that a head tied to them gets one (V, D)
    gradient buffer, not two (`TiedEmbedding`). Returns the fp32 scalar loss: sum of the token losses /
    `num_items_in_batch` (else / N). `token_losses` (B, L) fp32, optional: filled with each position's token loss
    (position t's for predicting labels[t + 1]; 0 where nothing is predicted), detached: what a mixture's per-source
    loss is summed from.
    """
    states, targets = supervised(hidden, labels.to(hidden.device))
    weight = getattr(head, "weight", None)
    rows = rows or chunk_rows(head.out_features if hasattr(head, "out_features") else weight.shape[0])
    each = None if token_losses is None else states.new_zeros(targets.shape, dtype=torch.float32)
    if type(head) is nn.Linear:
        tied = None if embeds is None else TiedEmbedding.find(embeds, head.weight)
        total = LinearCrossEntropy.apply(states, head.weight, head.bias, targets, rows, tied, each)
    else:
        total = checkpointed_cross_entropy(states, head, targets, rows, each)
    if token_losses is not None:
        token_losses.zero_()
        token_losses[F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).to(token_losses.device) != IGNORE_INDEX] = (
            each.to(token_losses.device))
    if num_items_in_batch is None:
        return total / targets.numel()  # 0 / 0 = NaN with nothing supervised, as transformers' mean
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


@torch.no_grad()
def logits_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, L) fp32 token losses from full (B, L, V) logits, as `causal_lm_loss(token_losses=)` gives them."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).to(logits.device)
    losses = F.cross_entropy(logits.float().transpose(1, 2), shifted, ignore_index=IGNORE_INDEX, reduction="none")
    return losses


def _chunk_cross_entropy(head: nn.Module, states: torch.Tensor, targets: torch.Tensor,
                         reduction: str = "sum") -> torch.Tensor:
    return F.cross_entropy(head(states).float(), targets, reduction=reduction)


def checkpointed_cross_entropy(states: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                               rows: int, token_losses: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of the token losses, one chunk of logits at a time, each recomputed in the backward pass; `token_losses`
    (N,), optional: filled with each token's loss (detached)."""
    from torch.utils.checkpoint import checkpoint

    total = states.new_zeros((), dtype=torch.float32)
    start = 0
    for part, part_targets in zip(states.split(rows), targets.split(rows), strict=True):
        if token_losses is None:
            total = total + checkpoint(_chunk_cross_entropy, head, part, part_targets, use_reentrant=False)
            continue
        each = checkpoint(_chunk_cross_entropy, head, part, part_targets, "none", use_reentrant=False)
        token_losses[start : start + len(each)] = each.detach()
        start += len(each)
        total = total + each.sum()
    return total


def _accumulate(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """total + a @ b in fp32: the first product becomes the sum; later ones are added in place (`addmm_`) when
    they are fp32 already, so a (V, D) sum never needs a second (V, D) buffer."""
    if total is None:
        return (a @ b).float()
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return total.addmm_(a, b)
    return total.add_(a @ b)  # a bf16 / fp16 product (autocast): its temporary is half the size of the sum


class LinearCrossEntropy(torch.autograd.Function):
    """sum_n CE(states_n @ weight.T + bias, targets_n), fp32, with its gradients computed chunk by chunk in the
    forward pass (no logits kept for the backward, none recomputed). states (N, D), weight (V, D), bias (V,) or
    None, targets (N,) in [0, V). Gradients are only computed for the inputs that require them. `tied`: the
    input embedding that shares `weight` (`TiedEmbedding.find`), told where the weight's gradient is.
    `token_losses` (N,) fp32, optional: filled with each token's loss (not a differentiable output)."""

    @staticmethod
    def forward(ctx: Any, states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, rows: int, tied: TiedEmbedding | None = None,
                token_losses: torch.Tensor | None = None) -> torch.Tensor:
        want_states, want_weight = states.requires_grad, weight.requires_grad
        want_bias = bias is not None and bias.requires_grad
        grad_states = torch.empty_like(states) if want_states else None
        grad_weight = grad_bias = None  # fp32 sums over the chunks, accumulated in place (no V x D temporary)
        total = torch.zeros((), dtype=torch.float32, device=states.device)
        for start in range(0, states.shape[0], rows):
            part, part_targets = states[start : start + rows], targets[start : start + rows]
            logits = F.linear(part, weight, bias)  # in the autocast dtype when autocast is on, as lm_head
            dtype = logits.dtype
            logits = logits.float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, part_targets[:, None]).squeeze(1)
            each = lse - picked
            total += each.sum()
            if token_losses is not None:
                token_losses[start : start + rows] = each
            if not (want_states or want_weight or want_bias):
                continue
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad[torch.arange(grad.shape[0], device=grad.device), part_targets] -= 1.0
            grad = grad.to(dtype)
            if want_states:
                grad_states[start : start + rows] = (grad @ weight.to(dtype)).to(states.dtype)
            if want_weight:
                grad_weight = _accumulate(grad_weight, grad.t(), part.to(dtype))
            if want_bias:
                grad_bias = grad.float().sum(0) if grad_bias is None else grad_bias.add_(grad.float().sum(0))
        if want_weight and grad_weight is None:  # no supervised position: zero gradients
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if want_bias and grad_bias is None:
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        ctx.save_for_backward(*(t for t in (grad_states, grad_weight, grad_bias) if t is not None))
        ctx.present = (want_states, want_weight, want_bias)
        ctx.used = False
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.tied = tied
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # The saved gradients are scaled in place (no second V x D buffer at the start of the backward, when the
        # activations peak), so this backward can run once: retain_graph=True and a second backward are refused.
        if ctx.used:
            raise RuntimeError("mmadapt.loss.LinearCrossEntropy's backward ran twice (retain_graph=True?): its "
                               "saved gradients were consumed. Compute full logits for that (return_logits=True).")
        ctx.used = True
        saved = iter(ctx.saved_tensors)
        grads = [next(saved).mul_(grad_total) if present else None for present in ctx.present]
        if grads[1] is not None:
            grads[1] = grads[1].to(ctx.dtypes[0])
        if grads[2] is not None:
            grads[2] = grads[2].to(ctx.dtypes[1])
        if ctx.tied is not None and grads[1] is not None and not torch.is_grad_enabled():  # not for create_graph
            ctx.tied.arm(grads[1])
        return grads[0], grads[1], grads[2], None, None, None, None


class TiedEmbedding:
    """The input embedding's gradient added into the loss's (V, D) weight gradient, for a head tied to it.

    In the backward the loss's gradient reaches the weight's `AccumulateGrad` first (autograd holds it until every
    use of the weight has delivered its part); the embedding's backward node comes last. Its pre-hook here takes
    the gradient of its output, (B, L, D), and its indices, and returns None in place of that gradient, so the node
    builds no dense (V, D) gradient; a hook on the weight then adds those rows (`index_put_`, accumulate) to the
    gradient autograd hands to `AccumulateGrad`. That is the loss's own buffer, owned by autograd alone, whenever its
    address is the one `arm` noted (nothing else used the weight, or autograd added the other uses into it in
    place): it is updated in place. Otherwise the rows go into a copy: the same sums, one more buffer.

    Nothing changes for DDP or FSDP2 (the weight's `AccumulateGrad` receives the same dense sum, at the same point
    of the backward) or for optimizers (`.grad` is dense). The hook on the weight is removed when the backward ends.
    Skipped (the embedding's backward runs as usual): the weight is not a plain tensor (a DTensor) or not the
    embedding's leaf, the embedding is sparse or scales by frequency, or the loss gave no weight gradient.
    """

    SEARCH: Final[int] = 64  # autograd nodes searched from the embeddings for the embedding's backward node

    def __init__(self, node: Any, weight: torch.Tensor) -> None:
        # the node's saved indices and padding row, not the node: it holds this object (its pre-hook), no cycle
        self.indices, self.padding, self.weight = node._saved_indices, node._saved_padding_idx, weight
        self.address: int | None = None  # the loss's gradient buffer, once its backward produced it
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (B * L,) indices, (B * L, D) gradients
        node.register_prehook(self.take_rows)

    @classmethod
    def find(cls, embeds: torch.Tensor, weight: torch.Tensor) -> TiedEmbedding | None:
        """The embedding backward node among the first `SEARCH` autograd nodes behind `embeds` (B, L, D) whose weight
        is the leaf `weight`, hooked; None where there is none (untied) or it must run as usual."""
        if embeds.grad_fn is None or not weight.requires_grad or type(weight) not in (torch.Tensor, nn.Parameter):
            return None
        queue, seen = [embeds.grad_fn], set()
        while queue and len(seen) < cls.SEARCH:
            node = queue.pop(0)
            if node is None or node in seen:
                continue
            seen.add(node)
            if type(node).__name__ == "EmbeddingBackward0" and getattr(node.next_functions[0][0], "variable",
                                                                          None) is weight:
                plain = not (node._saved_sparse or node._saved_scale_grad_by_freq)
                return cls(node, weight) if plain else None
            queue.extend(next_node for next_node, _ in node.next_functions)
        return None

    def arm(self, grad_weight: torch.Tensor) -> None:
        """The loss's backward produced the weight's gradient `grad_weight` (V, D): note where it is (no reference,
        which would keep autograd from adding to it in place and from taking it as `.grad`)."""
        self.address = grad_weight.data_ptr()

    def take_rows(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[None] | None:
        """Pre-hook of the embedding's backward: keep its rows for `add_rows`, and give it no gradient to expand."""
        grad = grad_outputs[0]
        if self.address is None or grad is None:
            return None
        indices = self.indices.reshape(-1)
        values = grad.reshape(indices.shape[0], -1)
        if self.padding >= 0:  # the padding row gets no gradient (nn.Embedding(padding_idx=...))
            values = values.masked_fill((indices == self.padding)[:, None], 0)
        self.rows = (indices, values)
        handle = self.weight.register_hook(self.add_rows)
        torch.autograd.Variable._execution_engine.queue_callback(handle.remove)  # when this backward ends
        return (None,)

    def add_rows(self, grad: torch.Tensor) -> torch.Tensor | None:
        """Hook on the weight: its gradient, autograd's sum of every other use, plus the embedding's rows."""
        rows, self.rows = self.rows, None
        if rows is None:
            return None
        indices, values = rows
        values = values.to(grad.dtype)
        if grad.data_ptr() == self.address:  # the loss's buffer, owned by autograd alone: in place
            return grad.index_put_((indices,), values, accumulate=True)
        return grad.index_put((indices,), values, accumulate=True)


def router_balance_loss(spec: Any, router_logits: Any, config: Any, valid: torch.Tensor) -> torch.Tensor:
    """The MoE router's load-balancing loss the backbone declares (`spec.moe.balance_loss`, transformers'
    `load_balancing_loss_func`) with the (B, L) real-token mask `valid`: padding never enters it, and since it
    averages routing statistics over every real token of the batch, a packed batch gives the same value as the
    same samples padded (transformers' own forward counts padding when no mask is given and cannot read the
    per-layer-type masks of packed rows). Unweighted: the caller adds `router_aux_loss_coef` x it."""
    from mmadapt.registry import import_object

    if spec.moe is None:
        raise ValueError(f"backbone {spec.name!r} declares no MoE router (BackboneSpec.moe), yet it output router "
                         "logits; register it with moe=MoE(..., balance_loss=...)")
    balance = import_object(spec.moe.balance_loss)
    return balance(router_logits, config.num_experts, config.num_experts_per_tok, valid)


# ---- sequence log-probs (preference objectives) ---------------------------------------------------------------------
def supervised_rows(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`supervised`, and (N,) the row each supervised position belongs to."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    keep = shifted != IGNORE_INDEX
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
    weight = getattr(head, "weight", None)
    chunk = chunk or chunk_rows(head.out_features if hasattr(head, "out_features") else weight.shape[0])
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
    logits: one chunk of logits at a time, recomputed in the backward (activation checkpointing per chunk). What an
    online RL objective scores its completions with, token by token (trl's `_get_per_token_logps`, the temperature
    of sampling included). `entropy=True` returns (log-probs, entropies): also each position's entropy (nats) of that
    distribution, detached, from the same chunk of logits (trl's logged `entropy`)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    weight = getattr(head, "weight", None)
    chunk = chunk or chunk_rows(head.out_features if hasattr(head, "out_features") else weight.shape[0])
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
    from torch.utils.checkpoint import checkpoint

    return checkpoint(_chunk_logps, head, states, targets, temperature, entropy, use_reentrant=False)


@torch.no_grad()
def token_kl(states: torch.Tensor, head: nn.Module, reference: tuple[torch.Tensor, Any], rows: torch.Tensor,
             num_rows: int, chunk: int) -> torch.Tensor:
    """(R,) per row, the sum over its supervised positions of KL(policy || reference) over the whole vocabulary;
    `reference` = (its states at the same positions, a callable giving its logits from them)."""
    ref_states, ref_head = reference
    total = torch.zeros(num_rows, dtype=torch.float32, device=states.device)
    chunk = max(1, chunk // 2)  # two chunks of logits at once: the budget of one
    for start in range(0, states.shape[0], chunk):
        part = slice(start, start + chunk)
        mine = torch.log_softmax(head(states[part]).float(), dim=-1)
        difference = torch.log_softmax(ref_head(ref_states[part].to(states.device)).float(), dim=-1)
        difference.neg_().add_(mine)  # log p - log q, in place of log q
        total.index_add_(0, rows[part], mine.exp_().mul_(difference).sum(-1))
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
            if reference is not None:
                mine = logits.sub_(lse[:, None])  # log-softmax, in place of the logits
                difference = torch.log_softmax(reference[1](reference[0][part].to(states.device)).float(), dim=-1)
                difference.neg_().add_(mine)  # log p - log q
                kl.index_add_(0, rows[part], mine.exp_().mul_(difference).sum(-1))
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
                grad_weight = _accumulate(grad_weight, grad.t(), chunk_states)
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
