"""Packed rows: several samples in one row, isolated from each other in every layer.

A packed batch carries `cu_seqlens` (S+1,) int: segment boundaries over the flattened
(B*L) token stream, the flash-attention convention. Every row boundary is a segment
boundary; a row's padding tail (attention mask False) is a segment of its own and is never
attended to. From it the model derives:

- `segment_ids` (B, L): which segment each token belongs to;
- a block-diagonal causal mask (B, 1, L, L) for attention layers (True = may attend);
- `Segments.bounds`: (row, start, end) of every real sample, for stateful layers (Gated
  DeltaNet's causal conv and recurrence) that must restart at every sample boundary;
- per-sample positions: position counters restart at each segment start.

Masks are `torch.bool`. An integer tensor given as a mask to any function here is a `TypeError`:
indexing with an int tensor gathers rows (story 2 in CONTEXT.md: every embedding became token 1's).
Only the model's public entry points convert transformers' 0/1 masks, once (`model.as_bool_mask`).

Shapes: B rows, L tokens per row, S segments (samples and padding tails).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def require_bool_mask(mask: torch.Tensor, name: str = "attention_mask") -> torch.Tensor:
    """`mask` itself if it is bool; otherwise a `TypeError` saying why integers are refused (internal functions)."""
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a torch.bool tensor (True = real token), got {mask.dtype}. mmadapt's internal functions "
            f"refuse integer and float masks because an integer tensor used as a mask indexes instead of masking "
            f"(x[mask] gathers rows 0 and 1). Fix: pass `{name}.bool()` (or `{name} != 0`); the model's forward, "
            f"generate and check_batch convert 0/1 masks themselves."
        )
    return mask


@dataclass(frozen=True)
class Segments:
    """The samples of a packed batch: `ids` (B, L) long segment index, `bounds` [(row, start, end)] of real samples."""

    ids: torch.Tensor
    starts: torch.Tensor
    bounds: list[tuple[int, int, int]]

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, valid: torch.Tensor) -> Segments:
        """Check `cu_seqlens` against the (B, L) batch and derive segment ids and sample bounds (one host sync)."""
        rows, length = require_bool_mask(valid).shape
        cu = cu_seqlens.to(device="cpu", dtype=torch.long)
        if cu.ndim != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != rows * length:
            raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at B*L = {rows * length}; got "
                             f"{cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError("cu_seqlens must be strictly increasing (no empty segments)")
        row_ends = torch.arange(1, rows + 1) * length
        if not bool(torch.isin(row_ends, cu).all()):
            raise ValueError(f"cu_seqlens must have a boundary at every row end ({row_ends.tolist()}): a sample "
                             "cannot continue from one row into the next")
        flat_ids = torch.bucketize(torch.arange(rows * length), cu[1:], right=True)
        ids = flat_ids.view(rows, length).to(valid.device)
        starts_flat = torch.zeros(rows * length, dtype=torch.bool)
        starts_flat[cu[:-1]] = True
        starts = starts_flat.view(rows, length).to(valid.device)
        valid_cpu = valid.cpu().flatten()
        bounds = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            seg_valid = valid_cpu[a:b]
            if bool(seg_valid.any()):
                if not bool(seg_valid.all()):
                    raise ValueError(f"segment [{a}, {b}) of cu_seqlens mixes real tokens and padding; padding must "
                                     "be its own segment at the end of a row")
                bounds.append((a // length, a % length, a % length + (b - a)))
        return cls(ids, starts, bounds)

    def attention_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """(B, 1, L, L) bool: causal, within one segment; padding attends only to itself (no empty rows, no NaN)."""
        length = valid.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
        same = self.ids[:, :, None] == self.ids[:, None, :]
        keys = valid[:, None, :] | torch.eye(length, dtype=torch.bool, device=valid.device)
        return (same & causal & keys)[:, None]

    def restart(self, counter: torch.Tensor) -> torch.Tensor:
        """Subtract from a non-decreasing (..., B, L) counter its value at each token's segment start."""
        at_start = torch.where(self.starts, counter, torch.zeros_like(counter))
        return counter - at_start.cummax(dim=-1).values


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the 0 / -inf-like float mask that eager attention adds to its scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def cu_seqlens_from_lengths(lengths_per_row: list[list[int]], row_length: int) -> torch.Tensor:
    """cu_seqlens for rows holding samples of the given lengths, each row's padding tail its own segment."""
    bounds, offset = [0], 0
    for lengths in lengths_per_row:
        used = sum(lengths)
        if used > row_length:
            raise ValueError(f"samples of lengths {lengths} do not fit a row of {row_length} tokens")
        for n in lengths:
            offset += n
            bounds.append(offset)
        if used < row_length:
            offset += row_length - used
            bounds.append(offset)
    return torch.tensor(bounds, dtype=torch.int32)


def cu_seqlens_from_segment_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens for a (B, L) segment-id mask in other frameworks' convention (1, 1, 2, 2, 0: 0 = padding).

    A new segment starts wherever the id changes along a row and at every row start; padding (0) runs
    become segments of their own, as mmadapt's collator makes them. Pass `attention_mask=segment_ids != 0`.
    """
    if segment_ids.ndim != 2 or segment_ids.dtype.is_floating_point or segment_ids.dtype == torch.bool:
        raise TypeError(f"segment_ids must be a (B, L) integer tensor, got {segment_ids.dtype} "
                        f"{tuple(segment_ids.shape)}")
    ids = segment_ids.cpu()
    change = torch.ones_like(ids, dtype=torch.bool)
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = change.flatten().nonzero().flatten()
    return torch.cat([starts, torch.tensor([ids.numel()])]).to(torch.int32)


# ---- varlen attention --------------------------------------------------------------------------
VARLEN = "mmadapt_sdpa"


def varlen_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                packed_segments: list[tuple[int, int, int]] | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; with `packed_segments`, causal SDPA on each sample alone (varlen).

    query (B, H, L, Dh), key / value (B, H_kv, L, Dh) -> (B, L, H, Dh), transformers' layout.
    Per-sample attention never computes the cross-sample blocks a block-diagonal mask would
    throw away, so packing costs sum(l_i^2) like unpacked samples, not L^2 per row.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = query.new_zeros(query.shape)
    gqa = query.shape[1] != key.shape[1]
    for row, start, end in packed_segments:
        q, k, v = (t[row : row + 1, :, start:end] for t in (query, key, value))
        out[row : row + 1, :, start:end] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def use_varlen_attention(lm: Any) -> None:
    """Switch an SDPA transformers model to `varlen_sdpa` (identical unless a forward passes `packed_segments`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if VARLEN not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN, varlen_sdpa)
        AttentionMaskInterface.register(VARLEN, sdpa_mask)
    if lm.config._attn_implementation == "sdpa":
        lm.set_attn_implementation(VARLEN)
