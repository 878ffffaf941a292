"""The language-model loss without the full logits: supervised positions only, `lm_head` in chunks.

The loss `VisionLanguageModel.forward` computes from `labels` (`causal_lm_loss`, below), its per-token losses, and the
MoE router's load-balancing loss. What the objectives compute at the top instead (sequence and token log-probs, the
KL to a reference) are heads, `mmadapt.heads`, built on the same pieces (`next_tokens`, `output_chunk_rows`,
`TiedEmbedding`, `accumulate_product`).

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


def output_chunk_rows(head: nn.Module) -> int:
    """`chunk_rows` for an output layer: its `out_features`, else its weight's rows, is the vocabulary."""
    return chunk_rows(head.out_features if hasattr(head, "out_features") else head.weight.shape[0])


def next_tokens(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) the label each position predicts (transformers' shift: position t predicts labels[t + 1], a row's last
    position -100), and (B, L) bool where that is a label (the supervised positions)."""
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return shifted, shifted != IGNORE_INDEX


def supervised(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, D) hidden states of the positions that predict a label, and the (N,) labels they predict."""
    shifted, keep = next_tokens(labels)
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
    rows = rows or output_chunk_rows(head)
    each = None if token_losses is None else states.new_zeros(targets.shape, dtype=torch.float32)
    if type(head) is nn.Linear:
        tied = None if embeds is None else TiedEmbedding.find(embeds, head.weight)
        total = LinearCrossEntropy.apply(states, head.weight, head.bias, targets, rows, tied, each)
    else:
        total = checkpointed_cross_entropy(states, head, targets, rows, each)
    if token_losses is not None:
        token_losses.zero_()
        token_losses[next_tokens(labels)[1].to(token_losses.device)] = each.to(token_losses.device)
    if num_items_in_batch is None:
        return total / targets.numel()  # 0 / 0 = NaN with nothing supervised, as transformers' mean
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def logits_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, L) fp32 token losses from full (B, L, V) logits, as `causal_lm_loss(token_losses=)` gives them (0 where
    nothing is predicted; differentiable: their sum / the token count is transformers' loss of those logits)."""
    shifted = next_tokens(labels)[0].to(logits.device)
    return F.cross_entropy(logits.float().transpose(1, 2), shifted, ignore_index=IGNORE_INDEX, reduction="none")


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


def accumulate_product(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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
                grad_weight = accumulate_product(grad_weight, grad.t(), part.to(dtype))
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
