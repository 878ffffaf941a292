"""Faithfulness of a map: RISE's deletion / insertion measured on the model, against random orders of the cells.

Contract: `faithfulness(model, inputs, answer_ids, maps)` takes one prompt (as `evidence` does) and its maps (one per
image) and returns a `Faithfulness` (declared in `maps`, beside the `EvidenceMap` that carries it): the token cells
are removed (set to the processor's mean colour) or revealed in the maps' order, `CURVE_STEPS` groups, p(answer) is
followed relative to p(answer | image), and the areas under the two curves are compared with those of
`RANDOM_ORDERS` random orders. `score` 0 = no better than a random map; `trusted` when the map beats every random
order on an answer that rests on the pixels. The same yardstick whatever the method made the map.
docs/evidence.md: how to read the number.

Shapes: C token cells of all images (row-major per image), K masked copies of the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mmadapt.evidence.maps import EvidenceMap, Faithfulness
from mmadapt.evidence.prompt import Prompt, masked_objectives
from mmadapt.evidence.settings import CURVE_STEPS, RANDOM_ORDERS
from mmadapt.modes import eval_mode


def faithfulness(model: Any, inputs: dict[str, Any], answer_ids: Any, maps: Sequence[EvidenceMap], *,
                 steps: int = CURVE_STEPS, orders: int = RANDOM_ORDERS, batch_size: int = 16,
                 seed: int = 0) -> Faithfulness:
    """Deletion / insertion of the prompt's token cells in the order of `maps` (one per image, as `evidence`
    returns them) against `orders` random orders (see `Faithfulness`). Costs 2 + 2 * (1 + orders) * (steps - 1)
    forwards (128 by default; fewer when the prompt has fewer cells than `steps`), `batch_size` per forward."""
    if steps < 2 or orders < 1:
        raise ValueError(f"faithfulness: {steps} points on the deletion / insertion curves (--curve-steps) and "
                         f"{orders} random orders; give at least 2 points (or 0 to skip the measurement) and 1 order")
    prompt = Prompt.of(model, inputs, answer_ids)
    with eval_mode(model):
        grids = prompt.visual(model).grids
        if len(maps) != len(grids):
            raise ValueError(f"{len(maps)} maps for a prompt with {len(grids)} images: pass evidence()'s result")
        cells = prompt.cells(grids)
        generator = torch.Generator().manual_seed(seed)
        weights = torch.cat([torch.as_tensor(np.broadcast_to(m.tokens, m.scores.shape) * m.image_share
                                             / m.scores.shape[0], dtype=torch.float64).flatten() for m in maps])
        total = len(weights)
        counts = sorted({round(j * total / steps) for j in range(steps + 1)})
        ranked = [_order(weights, generator)] + [torch.randperm(total, generator=generator) for _ in range(orders)]
        f = masked_objectives(model, prompt, cells, _curve_masks(ranked, counts[1:-1], total), batch_size).exp()
    full, blank, inner = float(f[0]), float(f[1]), f[2:].view(len(ranked), len(counts) - 2, 2)
    x = torch.tensor(counts, dtype=torch.float64) / total

    def area(curve: torch.Tensor, start: float, end: float) -> float:
        return float(torch.trapezoid(torch.cat([torch.tensor([start]), curve, torch.tensor([end])]) / full, x))

    deletion = [area(inner[r, :, 0], full, blank) for r in range(len(ranked))]
    insertion = [area(inner[r, :, 1], blank, full) for r in range(len(ranked))]
    return Faithfulness(deletion[0], insertion[0], tuple(deletion[1:]), tuple(insertion[1:]), full, blank, steps)


def _curve_masks(ranked: Sequence[torch.Tensor], counts: Sequence[int], total: int) -> torch.Tensor:
    """(2 + 2 * orders * counts, cells) keeps: the whole image, none of it, then per order and count n the first n
    cells removed (deletion) and only the first n shown (insertion)."""
    keeps = [torch.ones(total), torch.zeros(total)]
    for order in ranked:
        for n in counts:
            first = torch.zeros(total)
            first[order[:n]] = 1.0
            keeps += [1.0 - first, first]
    return torch.stack(keeps).double()


def _order(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Indices by decreasing weight, ties (e.g. the zeros of the positive part) in a random order."""
    shuffled = torch.randperm(len(weights), generator=generator)
    return shuffled[torch.argsort(weights[shuffled], descending=True, stable=True)]

