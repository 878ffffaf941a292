"""Packed rows: several samples in one row, isolated from each other in every layer.

A packed batch carries `cu_seqlens` (S+1,) int: segment boundaries over the flattened
(B*L) token stream, the flash-attention convention. Every row boundary is a segment
boundary; a row's padding tail (attention mask False) is a segment of its own and is never
attended to. From it the model derives:

- `segment_ids` (B, L): which segment each token belongs to;
- a block-diagonal causal mask (B, 1, L, L) for attention layers (True = may attend);
- `PackedRows` (passed to the layers as `packed_segments`): the samples' bounds, regrouped into
  right-padded batches for one call per group (attention, and stateful layers such as Gated
  DeltaNet's causal conv and recurrence, which must restart at every sample), and the flat
  `cu_seqlens` / `seq_idx` of varlen kernels (flash-attn, FLA, causal-conv1d) on CUDA;
- per-sample positions: position counters restart at each segment start.

Masks are `torch.bool`. An integer tensor given as a mask to any function here is a `TypeError`:
indexing with an int tensor gathers rows (a Megatron run on packed Qwen3.5 rows built its all-ones mask as int32 and
used it as `x[i, mask[i]]`: every position received token 1's embedding and position id, loss 21.4 against 0.37).
Only the model's public entry points convert transformers' 0/1 masks, once (`as_bool_mask`).

Shapes: B rows, L tokens per row, S segments (samples and padding tails).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch

from mmadapt.ulysses import Shards, ulysses_attention


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


def as_bool_mask(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
    """The (B, L) bool mask, True = attend; all True when None.

    The public boundary: transformers' 0/1 masks of any integer or float dtype become bool here, once.
    Other values (a segment-id mask such as [1, 1, 2, 2, 0]) are refused: mmadapt packs with `cu_seqlens`.
    """
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    valid = attention_mask != 0
    if bool((attention_mask[valid] != 1).any()):
        values = torch.unique(attention_mask).tolist()[:8]
        raise ValueError(
            f"attention_mask holds values {values}; only 0/1 (or bool) masks are accepted. A mask with other values "
            "looks like per-sample segment ids (another framework's packing convention), which mmadapt does not "
            "read: it packs with cu_seqlens. Fix: pass attention_mask=(segment_ids != 0) and "
            "cu_seqlens=mmadapt.packing.cu_seqlens_from_segment_ids(segment_ids).")
    return valid


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


# ---- packed rows, as the layers see them ------------------------------------------------------------
REGROUP_WASTE: Final[float] = 0.25  # a group's padding may add at most this share to its real tokens


@dataclass(frozen=True)
class Group:
    """Samples run as one right-padded (count, width) batch: `index` (count * width,) into the flat (B * L + 1)
    tokens (B * L = a zero row for padding), `real` (count, width) bool, `sources` / `targets`: where the real
    tokens sit in the group's flat layout and in the batch's."""

    count: int
    width: int
    index: torch.Tensor
    real: torch.Tensor
    sources: torch.Tensor
    targets: torch.Tensor
    padded: bool  # False: every sample of the group is `width` long (no padding mask needed)

    @property
    def mask(self) -> torch.Tensor | None:
        """The group's padding mask for a layer, or None when it has no padding (as transformers passes it)."""
        return self.real if self.padded else None


class PackedRows:
    """A packed batch as its layers need it, computed once per forward and passed as `packed_segments`.

    - `bounds` [(row, start, end)] of the real samples; `cu_seqlens` (S + 1,) int32 over the flat B * L tokens
      (every segment, padding tails included) and `max_length`, for varlen kernels (flash-attn, FLA);
      `segment_ids` (1, B * L) int32, the conv kernel's `seq_idx`.
    - `groups(device)`: the samples sorted by length and cut into groups whose padding adds at most
      `REGROUP_WASTE` to their tokens; `gather(x, group)` -> (count, width, ...) right-padded, `scatter(parts,
      like)` puts every group's real tokens back (padding tails 0). One batched call per group replaces a
      Python loop over the samples: right padding never reaches a real token of a causal layer (attention
      with is_causal, a causal conv, a recurrence), so per-sample results are exact.
    """

    def __init__(self, segments: Segments, cu_seqlens: torch.Tensor, valid: torch.Tensor) -> None:
        self.rows, self.length = valid.shape
        self.bounds = segments.bounds
        self.cu_seqlens = cu_seqlens.to(device=valid.device, dtype=torch.int32)
        self.max_length = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        self.segment_ids = segments.ids.reshape(1, -1).to(torch.int32)
        self.valid = valid.reshape(-1)
        self._groups: dict[torch.device, list[Group]] = {}

    def __len__(self) -> int:
        return len(self.bounds)

    def __iter__(self) -> Any:
        return iter(self.bounds)

    def groups(self, device: torch.device) -> list[Group]:
        if device not in self._groups:
            self._groups[device] = [self._group(members, device) for members in
                                    regroup([end - start for _, start, end in self.bounds])]
        return self._groups[device]

    def _group(self, members: list[int], device: torch.device) -> Group:
        width = max(self.bounds[k][2] - self.bounds[k][1] for k in members)
        pad = self.rows * self.length  # the zero row appended by `gather`
        index = torch.full((len(members), width), pad, dtype=torch.long)
        for slot, k in enumerate(members):
            row, start, end = self.bounds[k]
            index[slot, : end - start] = torch.arange(row * self.length + start, row * self.length + end)
        real = index != pad
        flat = index.flatten()
        return Group(len(members), width, flat.to(device), real.to(device),
                     real.flatten().nonzero().flatten().to(device), flat[real.flatten()].to(device),
                     padded=not bool(real.all()))

    def gather(self, x: torch.Tensor, group: Group) -> torch.Tensor:
        """(B, L, ...) -> (count, width, ...): the group's samples, right-padded with zeros."""
        flat = x.reshape(self.rows * self.length, *x.shape[2:])
        if group.padded:  # the padding slots read a zero row appended at index B * L
            flat = torch.cat([flat, flat.new_zeros(1, *x.shape[2:])])
        return flat.index_select(0, group.index).view(group.count, group.width, *x.shape[2:])

    def scatter(self, parts: list[torch.Tensor], groups: list[Group]) -> torch.Tensor:
        """Each group's (count, width, ...) output back to (B, L, ...); positions of no sample stay 0."""
        rest = parts[0].shape[2:]
        values = torch.cat([part.reshape(-1, *rest).index_select(0, g.sources) for part, g in zip(parts, groups,
                                                                                                   strict=True)])
        targets = torch.cat([g.targets for g in groups])
        out = values.new_zeros(self.rows * self.length, *rest).index_copy(0, targets, values)
        return out.view(self.rows, self.length, *rest)


def regroup(lengths: list[int], waste: float = REGROUP_WASTE) -> list[list[int]]:
    """Indices of `lengths`, longest first, cut into groups where count * longest <= (1 + waste) * their sum."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        if current and (len(current) + 1) * lengths[current[0]] > (1 + waste) * (total + lengths[k]):
            groups.append(current)
            current, total = [], 0
        current.append(k)
        total += lengths[k]
    if current:
        groups.append(current)
    return groups


# ---- varlen kernels: which path a packed layer takes --------------------------------------------------
def packed_path(*, on_cuda: bool, kernels_available: bool, dtype_supported: bool = True) -> str:
    """"varlen": one kernel call over the whole flattened batch with `cu_seqlens` (CUDA, kernels importable, a
    dtype they take); else "regrouped": one batched torch call per group of samples (any device)."""
    return "varlen" if on_cuda and kernels_available and dtype_supported else "regrouped"


def flash_attention_varlen() -> Any:
    """flash-attn's `flash_attn_varlen_func`, or None when flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


# ---- varlen attention --------------------------------------------------------------------------
VARLEN = "mmadapt_sdpa"


def varlen_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                packed_segments: PackedRows | None = None, sequence_parallel: Shards | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; with `packed_segments`, causal attention within each sample (varlen); with
    `sequence_parallel` (`mmadapt.ulysses.Shards`: the layer holds its rank's shard of the tokens), Ulysses: the heads
    exchanged for the whole sequence, this attention over it, the tokens exchanged back (`ulysses_attention`).

    query (B, H, L, Dh), key / value (B, H_kv, L, Dh) -> (B, L, H, Dh), transformers' layout.
    Paths (`packed_path`): flash-attn's varlen kernel over the flattened batch (CUDA, fp16 / bf16, flash-attn
    installed), else SDPA with is_causal once per group of samples (`PackedRows.groups`). Neither computes the
    cross-sample blocks a block-diagonal mask would throw away: packing costs sum(l_i^2) like unpacked samples.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if sequence_parallel is not None:
        return ulysses_attention(varlen_sdpa, module, query, key, value, sequence_parallel, dropout=dropout,
                                 scaling=scaling, **kwargs)
    if packed_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    packed = packed_segments
    rows, heads, length, head_dim = query.shape
    flash = flash_attention_varlen()
    path = packed_path(on_cuda=query.is_cuda, kernels_available=flash is not None,
                       dtype_supported=query.dtype in (torch.float16, torch.bfloat16))
    if path == "varlen":
        def flat(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(rows * length, t.shape[1], head_dim)

        out = flash(flat(query), flat(key), flat(value), packed.cu_seqlens, packed.cu_seqlens, packed.max_length,
                    packed.max_length, dropout_p=dropout, softmax_scale=scaling, causal=True)
        out = out * packed.valid[:, None, None].to(out.dtype)  # padding tails 0, as on the other path
        return out.view(rows, length, heads, head_dim), None
    groups = packed.groups(query.device)
    gqa = query.shape[1] != key.shape[1]
    parts = []
    for group in groups:
        q, k, v = (packed.gather(t.transpose(1, 2), group).transpose(1, 2) for t in (query, key, value))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                                    scale=scaling, enable_gqa=gqa)
        parts.append(attended.transpose(1, 2))
    return packed.scatter(parts, groups), None


def right_padded(valid: torch.Tensor) -> bool:
    """Whether every row of a (B, L) bool mask is its tokens then its padding (no token after a padded position)."""
    return bool((valid[:, 1:] <= valid[:, :-1]).all())


def causal_sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                     mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                     local_size: int | None = None, allow_is_causal_skip: bool = True,
                     **kwargs: Any) -> torch.Tensor | None:
    """transformers' `sdpa_mask`, and None for the right-padded rows of a causal forward over the whole sequence (a
    training step, a prefill from an empty cache): SDPA then runs `is_causal` with no (B, 1, L, L) mask, so it may
    take its linear-memory kernels (flash on CUDA and the CPU; transformers' own skip covers rows without padding
    only). Exact for every real token: a causal query attends to earlier positions, and in a right-padded row those
    are all real tokens. A padded position's output is not masked then (it attends to the row before it: finite,
    never read: labels, the loss and every later real position ignore it)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    if (allow_is_causal_skip and mask_function is causal_mask_function and local_size is None
            and attention_mask is not None and attention_mask.dtype == torch.bool
            and q_length == kv_length == attention_mask.shape[-1] and _is_zero(q_offset) and _is_zero(kv_offset)
            and not torch.compiler.is_compiling() and right_padded(attention_mask)):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, local_size=local_size, allow_is_causal_skip=allow_is_causal_skip,
                     **kwargs)


def _is_zero(offset: Any) -> bool:
    return int(offset) == 0 if not isinstance(offset, torch.Tensor) or offset.numel() == 1 else False


def use_varlen_attention(lm: Any) -> None:
    """Switch an SDPA transformers model to `varlen_sdpa` (identical unless a forward passes `packed_segments`) and
    its masks to `causal_sdpa_mask`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if VARLEN not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN, varlen_sdpa)
        AttentionMaskInterface.register(VARLEN, causal_sdpa_mask)
    if lm.config._attn_implementation == "sdpa":
        lm.set_attn_implementation(VARLEN)
