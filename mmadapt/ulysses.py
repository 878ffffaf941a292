"""Ulysses sequence parallelism's exchanges: a sequence split across a group of ranks, heads exchanged by all-to-all.

Under sequence parallelism (`distributed.sequence_parallel: N`) the N ranks of a group share each sample: rank r holds
tokens [r * n, (r + 1) * n) of every row (n = L / N; L padded to a multiple of N). Token-wise layers (norms, MLPs,
projections, experts) run on the shard as they are. A layer that mixes tokens (attention, Gated DeltaNet's conv and
recurrence) exchanges its inputs by one all-to-all: afterwards each rank holds the whole sequence for H / N of the
heads, runs the unchanged computation on it (padding, packed samples' isolation and the causal order exactly as in
one process, since it sees the whole sequence), and a second all-to-all gives every rank its own tokens back with
all the heads. Every exchange is differentiable: its backward is the inverse exchange.

`Shards` is what a forward's layers are handed (the `sequence_parallel` keyword, beside `packed_segments`): the
group, this rank's place, the whole sequence's real tokens, packed rows and attention mask. `ulysses_attention`
wraps any attention function of transformers' signature; `mmadapt.packing.varlen_sdpa` (every SDPA backbone's
attention) calls it when a forward passes `sequence_parallel`. Grouped KV heads are divided like the query heads
(their count a multiple of N) or, fewer than N, replicated first (N a multiple of their count); anything else is
refused by `check_heads` (when a run's model is built) naming the numbers and the sizes that work.

`gather_sequence` (all-gather along the sequence, the backward keeping this rank's slice) and `sum_replicated`
(all-reduce, the backward passing the gradient through) combine per-shard results for computations that run
identically on every rank of the group afterwards (a loss, an objective's arithmetic): each rank's gradient then
holds its own shard's contribution once, and the group's gradients add up to one process's.

No mmadapt imports: the layers below the model (packing, the backbones) use it. Shapes: B rows, L tokens, n = L / N
tokens per rank, H heads, Dh head width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def exchange(x: torch.Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """All-to-all, differentiable: `x` cut into `size` parts along `scatter_dim` (part j to rank j), the parts received
    from ranks 0..size-1 joined along `gather_dim`. The backward is the inverse exchange."""
    return _Exchange.apply(x, group, size, scatter_dim, gather_dim)


def _exchange(x: torch.Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    if x.shape[scatter_dim] % size:
        raise ValueError(f"cannot split dimension {scatter_dim} of size {x.shape[scatter_dim]} across {size} ranks")
    sent = torch.stack([part.contiguous() for part in x.chunk(size, dim=scatter_dim)])
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.args = group, size, scatter_dim, gather_dim
        return _exchange(x, group, size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group, size, scatter_dim, gather_dim = ctx.args
        return _exchange(grad.contiguous(), group, size, gather_dim, scatter_dim), None, None, None, None


def gather_sequence(x: torch.Tensor, group: Any, size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Every rank's shard of `x` joined along `dim` (all-gather); the backward keeps this rank's slice of the gradient
    (the computation after the gather runs identically on every rank of the group, so each shard's gradient is its
    own rank's)."""
    return _Gather.apply(x, group, size, rank, dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, rank: int, dim: int) -> torch.Tensor:
        ctx.rank, ctx.size, ctx.dim = rank, size, dim
        parts = [torch.empty_like(x.contiguous()) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


def sum_replicated(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of `x` over the group's ranks (all-reduce); the backward passes the gradient through unchanged (the
    computation after the sum runs identically on every rank of the group, so each rank's term gets it once)."""
    return _Sum.apply(x, group)


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None


def check_heads(what: str, heads: int, size: int, *, kv_heads: int | None = None, max_size: int = 64) -> None:
    """Refuse a sequence-parallel size that `heads` (and grouped `kv_heads`) cannot be divided by, naming the numbers
    and the sizes that work. Query heads must divide by N; KV heads divide by N or N by them (replicated)."""
    def works(n: int) -> bool:
        return heads % n == 0 and (kv_heads is None or kv_heads % n == 0 or n % kv_heads == 0)

    if size < 1 or works(size):
        return
    sizes = [n for n in range(2, max_size + 1) if works(n)]
    kv = "" if kv_heads is None else f" and {kv_heads} KV heads"
    raise ValueError(f"distributed.sequence_parallel: {size} does not divide {what}'s {heads} heads{kv} (Ulysses gives "
                     f"each rank heads / {size}{' and needs the KV heads to divide by it or it by them' if kv else ''}"
                     f"). Sizes that work: {sizes or 'none above 1'}.")


@dataclass(frozen=True)
class Shards:
    """A sequence-parallel forward as its layers see it (the `sequence_parallel` keyword).

    `group`, `size` N, `rank` (this rank's place in the group); `valid` (B, L) bool the whole sequence's real tokens;
    `packed`: the whole sequence's packed rows (`mmadapt.packing.PackedRows`) or None; `attention_mask`: what SDPA
    takes over the whole sequence (None: causal, every row right-padded; else a (B, 1, L, L) bool mask)."""

    group: Any
    size: int
    rank: int
    valid: torch.Tensor
    packed: Any = None
    attention_mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    @property
    def shard_length(self) -> int:
        return self.length // self.size

    @property
    def start(self) -> int:
        return self.rank * self.shard_length

    def to_heads(self, x: torch.Tensor, heads_dim: int, sequence_dim: int) -> torch.Tensor:
        """This rank's tokens with every head -> the whole sequence with this rank's heads (H / N)."""
        return exchange(x, self.group, self.size, heads_dim, sequence_dim)

    def to_tokens(self, x: torch.Tensor, heads_dim: int, sequence_dim: int) -> torch.Tensor:
        """The whole sequence with this rank's heads -> this rank's tokens with every head."""
        return exchange(x, self.group, self.size, sequence_dim, heads_dim)

    def mine(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a whole-sequence tensor."""
        return x.narrow(dim, self.start, self.shard_length)


def ulysses_attention(attention: Any, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      shards: Shards, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`attention` (transformers' signature: query (B, H, n, Dh), key / value (B, H_kv, n, Dh) -> (B, n, H, Dh)) over
    the whole sequence: q / k / v exchanged to this rank's heads, `attention` run on the whole sequence with its mask
    and packed rows (`shards`), the output exchanged back to this rank's tokens."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % shards.size and shards.size % kv_heads == 0:  # fewer KV heads than ranks: each rank gets its copy
        key = key.repeat_interleave(shards.size // kv_heads, dim=1)
        value = value.repeat_interleave(shards.size // kv_heads, dim=1)
    check_heads(type(module).__name__, heads, shards.size, kv_heads=kv_heads)
    q, k, v = (shards.to_heads(t, heads_dim=1, sequence_dim=2) for t in (query, key, value))
    kwargs.pop("attention_mask", None)
    out, _ = attention(module, q, k, v, shards.attention_mask, packed_segments=shards.packed, **kwargs)
    return shards.to_tokens(out, heads_dim=2, sequence_dim=1), None  # (B, L, H / N, Dh) -> (B, n, H, Dh)
