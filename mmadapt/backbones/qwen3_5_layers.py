"""Qwen3.5's Gated DeltaNet, isolated per sample in packed rows.

transformers' `Qwen3_5GatedDeltaNet` runs its causal conv (window 4) and its recurrent state
straight across a packed row, so sample k+1 starts from sample k's state (measured max
|logit diff| 0.62 on the tiny model). transformers has no hook for this, so `isolate_samples`
switches each layer to this subclass, in this one visible place. With `packed_segments` (a
`mmadapt.packing.PackedRows`) the conv window and the recurrence start fresh at every sample:

- "regrouped" (any device; the CPU path): the samples are gathered into right-padded batches
  (`PackedRows.groups`: sorted by length, padding bounded) and the unchanged layer runs once per
  group with the padding mask, exactly as for a padded batch of those samples. Right padding never
  reaches a real token of a causal conv or a recurrence, so this is exact.
- "varlen" (CUDA, with flash-linear-attention and causal-conv1d importable: `varlen_kernels`): one call
  over the whole flattened batch (1, B * L): FLA's `chunk_gated_delta_rule` with `cu_seqlens` restarts
  the recurrence and causal-conv1d's `causal_conv1d_fn` with `seq_idx` restarts the conv window at every
  segment. `varlen_forward` is transformers' forward with those two calls, nothing else changed.

Without `packed_segments` it is the original layer. Parameters and state-dict keys are unchanged.

Under sequence parallelism (`sequence_parallel=`, a `mmadapt.ulysses.Shards`: the layer holds its rank's n = L / N
tokens of every row) `sequence_parallel_forward` is head-parallel (training, no cache): the projections on the shard,
one all-to-all to the whole sequence for this rank's key / value heads (`HeadShare`), the conv (its weight's rows of
those heads) and the recurrence there, per sample in packed rows (`Shards.packed`, either path above) and padding as
in a padded batch (`Shards.valid`), the gated norm, a second all-to-all back to the rank's tokens, out_proj.
Qwen3.5-MoE's `Qwen3_5MoeGatedDeltaNet` is the same layer under another class name; it gets the same
treatment (`gated_delta_net_classes`).

Shapes: B rows, L tokens, D width, T = B * L; a group runs as (count, width, D).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from mmadapt.packing import PackedRows, packed_path
from mmadapt.ulysses import Shards, check_heads


def varlen_kernels(hidden_states: torch.Tensor) -> tuple[Any, Any] | None:
    """(causal_conv1d_fn, chunk_gated_delta_rule) for the "varlen" path, or None: the "regrouped" path."""
    try:
        from causal_conv1d import causal_conv1d_fn
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    if packed_path(on_cuda=hidden_states.is_cuda, kernels_available=True) != "varlen":
        return None
    return causal_conv1d_fn, chunk_gated_delta_rule


@dataclass(frozen=True)
class HeadShare:
    """The heads one call computes: all of them, or rank `rank`'s 1 / `size` under sequence parallelism. Key heads
    [r * Hk / N, (r + 1) * Hk / N) for q and k and value heads [r * Hv / N, ...) for v, z, b, a: transformers' rule
    repeats each key head for Hv / Hk consecutive value heads (`repeat_interleave`), so these value heads are exactly
    the ones this rank's key heads serve. `channels`: their q / k / v channels of the conv (its weight's rows)."""

    size: int
    rank: int
    key_dim: int  # q (and k) channels of this share
    value_dim: int  # v (and z) channels
    heads: int  # value heads
    value_heads: slice  # into A_log, dt_bias
    channels: torch.Tensor

    @classmethod
    def of(cls, layer: Any, size: int = 1, rank: int = 0) -> HeadShare:
        keys, values = layer.key_dim // size, layer.value_dim // size
        heads = layer.num_v_heads // size
        own = torch.arange(keys)
        channels = torch.cat([rank * keys + own, layer.key_dim + rank * keys + own,
                              2 * layer.key_dim + rank * values + torch.arange(values)])
        return cls(size, rank, keys, values, heads, slice(rank * heads, (rank + 1) * heads), channels)

    @property
    def widths(self) -> list[int]:
        """The widths of (qkv, b, a): the conv channels, then the value heads twice."""
        return [2 * self.key_dim + self.value_dim, self.heads, self.heads]


class PerSample:
    """Mixin over a transformers Gated DeltaNet class (Qwen3.5's, Qwen3.5-MoE's: the same layer, two classes)."""

    def forward(self, hidden_states: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None,
                packed_segments: PackedRows | None = None, sequence_parallel: Shards | None = None,
                **kwargs: Any) -> torch.Tensor:
        if sequence_parallel is not None:
            if cache is not None:
                raise ValueError("sequence parallelism cannot use a cache: Gated DeltaNet's state would be split "
                                 "across the ranks of the group (generation runs without sequence parallelism)")
            if packed_segments is not None:
                raise ValueError("under sequence parallelism packed rows come with the Shards (Shards.packed, over "
                                 "the whole sequence), not as packed_segments (this rank's shard)")
            return self.sequence_parallel_forward(hidden_states, sequence_parallel)
        if packed_segments is None:
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if cache is not None:
            raise ValueError("packed rows cannot use a cache: it would carry state from one sample to the next")
        kernels = varlen_kernels(hidden_states)
        if kernels is not None:
            return self.varlen_forward(hidden_states, packed_segments, *kernels)
        groups = packed_segments.groups(hidden_states.device)
        parts = [super(PerSample, self).forward(packed_segments.gather(hidden_states, group),
                                                attention_mask=group.mask, **kwargs)
                 for group in groups]
        return packed_segments.scatter(parts, groups)  # padding tails stay 0, as transformers' padding mask makes them

    def varlen_forward(self, hidden_states: torch.Tensor, packed: PackedRows, conv: Any, rule: Any) -> torch.Tensor:
        """transformers' forward (no cache) over the flattened batch, segments isolated by the kernels."""
        rows, length, _ = hidden_states.shape
        x = (hidden_states * packed.valid.view(rows, length, 1).to(hidden_states.dtype)).reshape(1, rows * length, -1)
        core = self.delta_rule(self.in_proj_qkv(x), self.in_proj_b(x), self.in_proj_a(x), HeadShare.of(self),
                               kernels=(conv, rule), packed=packed)
        z = self.in_proj_z(x).reshape(-1, self.head_v_dim)
        core = self.norm(core.reshape(-1, self.head_v_dim), z).reshape(1, rows * length, -1)
        out = self.out_proj(core).view(rows, length, -1)
        return out * packed.valid.view(rows, length, 1).to(out.dtype)

    def sequence_parallel_forward(self, hidden_states: torch.Tensor, shards: Shards) -> torch.Tensor:
        """Head-parallel Gated DeltaNet (no cache): `hidden_states` (B, n, D) this rank's tokens of every row.

        The projections run on the shard; one all-to-all gives this rank the whole sequence for its heads
        (`HeadShare`); the conv, the recurrence (restarted at every packed sample, padding as for a padded batch)
        and the gated norm run there exactly as in one process; a second all-to-all returns this rank's tokens with
        every head for out_proj. Padding positions come out 0, as from transformers' padded forward (zero input:
        z = 0 gates the norm to 0)."""
        check_heads(f"{type(self).__name__}'s key", self.num_k_heads, shards.size)
        check_heads(f"{type(self).__name__}'s value", self.num_v_heads, shards.size)
        share = HeadShare.of(self, shards.size, shards.rank)
        rows, n, _ = hidden_states.shape
        mask = shards.mine(shards.valid).to(hidden_states.device)
        x = (hidden_states * mask[:, :, None]).to(hidden_states.dtype)  # transformers' apply_mask_to_padding_states
        q, k, v = torch.split(self.in_proj_qkv(x), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        parts = [t.reshape(rows, n, shards.size, -1)  # (B, n, N, C / N): rank j's channels at [:, :, j]
                 for t in (q, k, v, self.in_proj_b(x), self.in_proj_a(x), self.in_proj_z(x))]
        whole = shards.to_heads(torch.cat(parts, dim=-1), heads_dim=2, sequence_dim=1).squeeze(2)  # (B, L, C / N)
        mixed, z = whole.split([sum(share.widths), share.value_dim], dim=-1)  # q | k | v | b | a of this rank's heads
        core = self.whole_sequence(mixed, share, shards.packed)
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        out = shards.to_tokens(out.view(rows, shards.length, -1), heads_dim=2, sequence_dim=1)  # (B, n, Hv * Dv)
        return self.out_proj(out)

    def whole_sequence(self, mixed: torch.Tensor, share: HeadShare, packed: PackedRows | None) -> torch.Tensor:
        """`delta_rule` over whole rows (B, L, q | k | v | b | a of `share`) -> (B, L, value heads, Dv): at once for
        padded rows, per packed sample otherwise (the kernels over the flattened rows, or the regrouped batches)."""
        if packed is None:
            return self.delta_rule(*mixed.split(share.widths, dim=-1), share)
        if (kernels := varlen_kernels(mixed)) is not None:
            flat = mixed.reshape(1, -1, mixed.shape[-1]).split(share.widths, dim=-1)
            core = self.delta_rule(*flat, share, kernels=kernels, packed=packed)
            return core.reshape(*mixed.shape[:2], -1, self.head_v_dim)
        groups = packed.groups(mixed.device)
        return packed.scatter([self.delta_rule(*packed.gather(mixed, group).split(share.widths, dim=-1), share)
                               for group in groups], groups)

    def delta_rule(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, share: HeadShare,
                   kernels: tuple[Any, Any] | None = None, packed: PackedRows | None = None) -> torch.Tensor:
        """transformers' conv and gated delta rule (no cache) for `share`'s heads: qkv (B, L, conv channels), b / a
        (B, L, value heads) -> (B, L, value heads, Dv). With `kernels` (causal-conv1d's, FLA's) over a flattened
        (1, T) batch, restarted at every segment of `packed`; else transformers' own functions, as its forward calls
        them (padding, zero, as in a padded batch)."""
        channels = share.channels.to(self.conv1d.weight.device)
        weight = self.conv1d.weight[channels].squeeze(1)  # indexing the Parameter: its gradient reaches these rows
        bias = None if self.conv1d.bias is None else self.conv1d.bias[channels]
        if kernels is not None:
            conv, rule = kernels
            mixed = conv(qkv.contiguous().transpose(1, 2), weight, bias, seq_idx=packed.segment_ids,
                         activation=self.activation)
            extra = {"cu_seqlens": packed.cu_seqlens.long()}
        else:
            mixed = qwen3_5.causal_conv1d_fn(qkv.transpose(1, 2), weight, bias, activation=self.activation)
            rule, extra = qwen3_5.torch_chunk_gated_delta_rule, {"cu_seqlens": None}
        query, key, value = torch.split(mixed.transpose(1, 2), [share.key_dim, share.key_dim, share.value_dim], dim=-1)
        rows, length = qkv.shape[:2]
        query = query.reshape(rows, length, -1, self.head_k_dim)
        key = key.reshape(rows, length, -1, self.head_k_dim)
        value = value.reshape(rows, length, -1, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log[share.value_heads].float().exp() * F.softplus(a.float() + self.dt_bias[share.value_heads])
        core, _ = rule(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=True, **extra)
        return core


class PerSampleGatedDeltaNet(PerSample, Qwen3_5GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet, isolated per packed sample."""


PER_SAMPLE: dict[type, type] = {Qwen3_5GatedDeltaNet: PerSampleGatedDeltaNet}


def gated_delta_net_classes() -> dict[type, type]:
    """{transformers Gated DeltaNet class: its per-sample subclass}, for every Qwen3.5 family transformers has
    (Qwen3.5-MoE's layer is the same code under another class name)."""
    try:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
    except ImportError:
        return PER_SAMPLE
    if Qwen3_5MoeGatedDeltaNet not in PER_SAMPLE:
        PER_SAMPLE[Qwen3_5MoeGatedDeltaNet] = type("PerSampleQwen3_5MoeGatedDeltaNet",
                                                   (PerSample, Qwen3_5MoeGatedDeltaNet), {"__module__": __name__})
    return PER_SAMPLE


def isolate_samples(lm: nn.Module) -> None:
    """Make every Gated DeltaNet layer of `lm` restart its conv window and state at each packed sample."""
    classes = gated_delta_net_classes()
    for module in lm.modules():
        if type(module) in classes:
            module.__class__ = classes[type(module)]
