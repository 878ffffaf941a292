"""Faithfulness of a map: RISE's deletion / insertion measured on the model, against random orders of the cells.

Contract: `faithfulness(model, inputs, answer_ids, maps)` takes one prompt (as `evidence` does) and its maps (one per
image) and returns a `Faithfulness`: the token cells are removed (set to the processor's mean colour) or revealed in
the maps' order, `CURVE_STEPS` groups, p(answer) is followed relative to p(answer | image), and the areas under the
two curves are compared with those of `RANDOM_ORDERS` random orders. `score` 0 = no better than a random map;
`trusted` when the map beats every random order on an answer that rests on the pixels. The same yardstick whatever
the method made the map. docs/evidence.md: how to read the number.

Shapes: C token cells of all images (row-major per image), K masked copies of the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from mmadapt.evidence.maps import MIN_EFFECT, EvidenceMap
from mmadapt.evidence.prompt import Prompt, masked_objectives
from mmadapt.modes import eval_mode

CURVE_STEPS: Final[int] = 8  # deletion / insertion: points on each curve
RANDOM_ORDERS: Final[int] = 8  # deletion / insertion: random orders the map's order is compared with


@dataclass(frozen=True)
class Faithfulness:
    """How well a prompt's maps predict what the answer needs, measured on the model (RISE's deletion/insertion).

    The token cells of all images are put in the maps' order (most evidence first; ties in a random order) and
    removed one group at a time (deletion: filled with the processor's mean colour, from the whole image down to
    none of it) or revealed (insertion: from the mean-colour image up to the whole image), `steps` groups, and the
    answer's probability p(answer) = exp(F) is followed, relative to p(answer) with the whole image (`full`;
    `blank`: with the mean-colour image).
    The areas under the curves over the fraction of cells (0..1): `deletion` (lower = the map found what the
    answer needs first), `insertion` (higher = the same); `deletion_random` and `insertion_random`: the same for
    each of `orders` random orders. Against one random order r the map scores ((deletion_r - deletion) +
    (insertion - insertion_r)) / 2 (`random_scores`); `score` is their mean: 0 = the map orders the image no
    better than chance, > 0 better, < 0 worse (it points at what the answer does not need). One image's score
    is noisy when few cells carry the answer (on a 4 x 4 grid with the answer in 4 cells, a map of random numbers
    scores from -0.31 to +0.44), so the verdict is a count: `wins`, the random orders the map beats; `trusted`
    when it beats every one and the answer rests on the pixels (a map of random numbers passes with probability
    1 / (orders + 1): 1 in 9 by default). An answer that does not rest on the pixels (the mean-colour image
    gives it as readily: `decisive` False, `pixel_effect` below `MIN_EFFECT`) has flat curves and a score near 0
    that says nothing about the map.
    """

    deletion: float
    insertion: float
    deletion_random: tuple[float, ...]
    insertion_random: tuple[float, ...]
    full: float
    blank: float
    steps: int

    @property
    def orders(self) -> int:
        return len(self.deletion_random)

    @property
    def random_scores(self) -> tuple[float, ...]:
        return tuple(((d - self.deletion) + (self.insertion - i)) / 2
                     for d, i in zip(self.deletion_random, self.insertion_random, strict=True))

    @property
    def score(self) -> float:
        return float(np.mean(self.random_scores))

    @property
    def deletion_random_mean(self) -> float:
        return float(np.mean(self.deletion_random))

    @property
    def insertion_random_mean(self) -> float:
        return float(np.mean(self.insertion_random))

    @property
    def wins(self) -> int:
        """How many of the random orders the map's order beats (its score against that order is positive)."""
        return sum(s > 0 for s in self.random_scores)

    @property
    def pixel_effect(self) -> float:
        """log p(answer | image) - log p(answer | the mean-colour image), in nats."""
        return math.log(max(self.full, 1e-300)) - math.log(max(self.blank, 1e-300))

    @property
    def decisive(self) -> bool:
        """Whether the image's pixels raise the answer's log-probability by at least `MIN_EFFECT` over the
        mean-colour image: when not (the model gives this answer as readily to a blank image, its default), removing
        regions cannot lower it, the curves are flat and the score says nothing about the map."""
        return self.pixel_effect >= MIN_EFFECT

    @property
    def trusted(self) -> bool:
        """The answer rests on the pixels (`decisive`) and the map beats every random order (`wins`)."""
        return self.decisive and self.wins == self.orders

    def verdict(self) -> str:
        """Whether to trust the map, in words."""
        if not self.decisive:
            return "the image's pixels barely move this answer, so the curves are flat and say nothing about the map"
        return ("the map beats every random order" if self.trusted else
                "the map does NOT beat every random order: do not trust it")

    def line(self) -> str:
        """The faithfulness line of `mmadapt explain`: the score, the wins, the areas and the verdict."""
        return (f"faithfulness {self.score:+.2f} (0 = a random map; beats {self.wins} of {self.orders} random orders; "
                f"deletion AUC {self.deletion:.2f} vs {self.deletion_random_mean:.2f} random, insertion AUC "
                f"{self.insertion:.2f} vs {self.insertion_random_mean:.2f}): {self.verdict()}")

    def summary(self) -> dict[str, Any]:
        return {"faithfulness": self.score, "trusted": self.trusted, "wins": self.wins, "random_orders": self.orders,
                "decisive": self.decisive, "pixel_effect": self.pixel_effect,
                "deletion_auc": self.deletion, "insertion_auc": self.insertion,
                "deletion_auc_random": self.deletion_random_mean,
                "insertion_auc_random": self.insertion_random_mean,
                "answer_probability_image": self.full, "answer_probability_mean_colour": self.blank,
                "curve_steps": self.steps}


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

