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
Qwen3.5-MoE's `Qwen3_5MoeGatedDeltaNet` is the same layer under another class name; it gets the same
treatment (`gated_delta_net_classes`).

Shapes: B rows, L tokens, D width, T = B * L; a group runs as (count, width, D).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from mmadapt.packing import PackedRows, packed_path


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


class PerSample:
    """Mixin over a transformers Gated DeltaNet class (Qwen3.5's, Qwen3.5-MoE's: the same layer, two classes)."""

    def forward(self, hidden_states: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None,
                packed_segments: PackedRows | None = None, **kwargs: Any) -> torch.Tensor:
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
        mixed_qkv = conv(self.in_proj_qkv(x).transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias,
                         seq_idx=packed.segment_ids, activation=self.activation).transpose(1, 2)
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(1, rows * length, -1, self.head_k_dim)
        key = key.reshape(1, rows * length, -1, self.head_k_dim)
        value = value.reshape(1, rows * length, -1, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        core, _ = rule(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=True, cu_seqlens=packed.cu_seqlens.long())
        z = self.in_proj_z(x).reshape(-1, self.head_v_dim)
        core = self.norm(core.reshape(-1, self.head_v_dim), z).reshape(1, rows * length, -1)
        out = self.out_proj(core).view(rows, length, -1)
        return out * packed.valid.view(rows, length, 1).to(out.dtype)


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
