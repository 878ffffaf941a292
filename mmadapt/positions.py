"""Position ids for the LLM: 1-D RoPE, or M-RoPE's (t, h, w) triples for image tokens.

M-RoPE follows transformers' `get_rope_index` for Qwen3.5 exactly, vectorised: text tokens
count up by one in all three rows; an image with token grid (t, h, w) starting at position p
takes (p + t_i, p + h_i, p + w_i) and the text after it resumes at p + max(h, w). Padding
(attention_mask False) gets 0 and does not advance the count, so left and right padding agree.
In a packed row (`segments` given) every count restarts at 0 at each sample's first token.

Shapes: B batch, L tokens, N visual tokens; returns (B, L) for 1-D, (3, B, L) for M-RoPE.
"""

from __future__ import annotations

import torch

from mmadapt.contract import ImageSpans
from mmadapt.encoders.base import VisualTokens, grid_coords
from mmadapt.packing import Segments, require_bool_mask


def text_positions(valid: torch.Tensor, segments: Segments | None = None) -> torch.Tensor:
    """0, 1, 2, ... over the attended tokens of each row (of each sample, when packed); padding gets 0."""
    require_bool_mask(valid)
    count = valid.long().cumsum(-1) - valid.long()
    if segments is not None:
        count = segments.restart(count)
    return count * valid


def mrope_positions(valid: torch.Tensor, spans: ImageSpans, visual: VisualTokens | None,
                    segments: Segments | None = None) -> torch.Tensor:
    """(3, B, L) positions; `visual` holds the LLM-side token grids, one per span, in span order."""
    require_bool_mask(valid)
    advance = (valid & ~spans.mask).long()
    if visual is not None and spans.num_spans:
        last = spans.start + spans.length - 1
        advance[spans.sample, last] = visual.grids[:, 1:].amax(-1).to(advance.dtype)
    base = advance.cumsum(-1) - advance
    if segments is not None:
        base = segments.restart(base)
    positions = base.unsqueeze(0).repeat(3, 1, 1)
    if visual is not None and spans.num_spans:
        _, coords = grid_coords(visual.grids.to(base.device), visual.window)
        positions[:, spans.mask] = base[spans.mask] + coords
    return positions * valid
