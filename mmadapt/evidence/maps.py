"""Evidence maps: one method's scores for an answer, as a map per image over its token grid and its pixels.

Contract: `evidence(model, inputs, answer_ids, method=Occlusion())` -> one `EvidenceMap` per image of ONE prompt
(`Processor` output, batch of one, padding allowed). The rule turns scores into evidence ("positive": max(score, 0),
the default; "absolute": |score|), normalised to sum to 1 over each image's token cells (`tokens`; all zero and
`mass == 0` for an image with no evidence). Given the original images (or their sizes), the token grid is mapped
onto the original pixels through the exact geometry of the image processor that made `inputs`
(`mmadapt.data.geometry.Geometry`): each cell's share spread uniformly over the part of the cell that shows the
original, dropped where it shows padding (`outside`), renormalised over the pixels the model saw (`pixels`).
The map records its method object; `image_effect` is measured against the method's own baseline, and an answer
below `MIN_EFFECT` does not rest on the image (its map is noise). docs/evidence.md: how to read a map.

Shapes: I images in the prompt, N visual tokens (all images, stored order), (t, h, w) an image's LLM-side token
grid, H x W the original image. `EvidenceMap.scores` (t, h, w), `.tokens` (h, w), `.pixels` (H, W).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch

from mmadapt.data.geometry import Box, Geometry
from mmadapt.encoders.base import grid_coords
from mmadapt.evidence.methods import DEFAULT_METHOD, GRADIENT_X_INPUT, Method
from mmadapt.evidence.prompt import Prompt, answer_log_probs
from mmadapt.evidence.settings import RULES
from mmadapt.modes import eval_mode

if TYPE_CHECKING:
    from mmadapt.data.processors import ImageProcessor

QUADRANTS: Final[tuple[str, ...]] = ("top_left", "top_right", "bottom_left", "bottom_right")
MIN_EFFECT: Final[float] = 0.1  # nats (a probability ratio of 1.1): below it an answer does not rest on the images


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


@dataclass(frozen=True)
class EvidenceMap:
    """The evidence for an answer on one image of the prompt.

    `scores` (t, h, w): the signed score of each visual token under `method` (integrated gradients x input: nats of
    the answer's log-probability; the perturbations: its per-token probability);
    `tokens` (h, w): the image's evidence per token cell under `rule`, summing to 1 (0 everywhere when
    `mass` == 0); `mass`: the evidence before normalising; `image_share`: this image's part of the prompt's
    evidence. With the original image known: `geometry`, `pixels` (H, W) summing to 1 over the pixels the model
    saw, and `outside`: the share of `tokens` that fell on padding rather than on the original.
    Prompt-level (the same in every map of one call): `objective`, the answer's log-probability;
    `baseline_objective`, the same at the method's baseline (`Method.baseline`); their difference `image_effect`,
    in nats, is what the images do for the answer. An answer the model gives as readily without its images
    (`rests_on_image` False: the image effect is below `MIN_EFFECT`) has no evidence to map: its map shows noise.
    `faithfulness`: the deletion / insertion measurement (`Faithfulness`) when `explain` (or the caller) made it.
    """

    image: int
    scores: np.ndarray
    tokens: np.ndarray
    rule: str
    mass: float
    image_share: float
    geometry: Geometry | None = None
    pixels: np.ndarray | None = None
    outside: float | None = None
    objective: float | None = None
    baseline_objective: float | None = None
    method: Method = GRADIENT_X_INPUT
    faithfulness: Faithfulness | None = None

    @property
    def image_effect(self) -> float | None:
        """log p(answer) - log p(answer | the method's baseline), in nats (None when not computed)."""
        if self.objective is None or self.baseline_objective is None:
            return None
        return self.objective - self.baseline_objective

    @property
    def rests_on_image(self) -> bool:
        """Whether the images raise the answer's log-probability by at least `MIN_EFFECT` nats."""
        effect = self.image_effect
        return effect is not None and effect >= MIN_EFFECT

    @property
    def grid(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def cell_box(self, row: int, col: int) -> Box:
        """Token cell (row, col) as a rectangle of the original image, clipped to it."""
        if self.geometry is None:
            raise ValueError("this map has no geometry: pass the original images to evidence(..., images=...)")
        return self.geometry.cell_box(row, col, self.grid)

    def peak(self) -> tuple[int, int]:
        """(row, col) of the token cell with the most evidence."""
        row, col = np.unravel_index(int(np.argmax(self.tokens)), self.tokens.shape)
        return int(row), int(col)

    def quadrants(self) -> dict[str, float]:
        """Shares of the evidence in the four quadrants of the original image (of the token grid without
        geometry); a middle row or column of an odd-sized array is split half and half."""
        return quadrant_shares(self.pixels if self.pixels is not None else self.tokens)

    def summary(self) -> dict[str, Any]:
        """JSON-ready: the method and its parameters, rule, mass, shares, peak cell (and its box), quadrants."""
        out: dict[str, Any] = {"image_index": self.image, "method": self.method.name, "rule": self.rule,
                               **self.method.parameters(), "mass": self.mass,
                               "objective": self.objective, "baseline_objective": self.baseline_objective,
                               "image_effect": self.image_effect, "rests_on_image": self.rests_on_image,
                               "image_share": self.image_share, "grid": list(self.grid), "peak": list(self.peak()),
                               "quadrants": self.quadrants(), "tokens": self.tokens.round(4).tolist()}
        if self.geometry is not None:
            out |= {"peak_box": [round(v, 2) for v in self.cell_box(*self.peak())],
                    "seen_box": [round(v, 2) for v in self.geometry.seen_box()], "outside": self.outside,
                    "original_size": list(self.geometry.original), "processed_size": list(self.geometry.processed)}
        if self.faithfulness is not None:
            out |= self.faithfulness.summary()
        return out


def quadrant_shares(heat: np.ndarray) -> dict[str, float]:
    """{top_left, top_right, bottom_left, bottom_right} shares of a 2-D non-negative array (sum 0 -> all 0)."""
    heat = np.asarray(heat, dtype=np.float64)
    weights = []
    for size in heat.shape:
        first = np.zeros(size)
        first[: size // 2] = 1.0
        if size % 2:
            first[size // 2] = 0.5
        weights.append((first, 1.0 - first))
    total = heat.sum()
    shares = [float(wy @ heat @ wx / total) if total > 0 else 0.0 for wy in weights[0] for wx in weights[1]]
    return dict(zip(QUADRANTS, shares, strict=True))


def completeness(maps: Sequence[EvidenceMap]) -> float | None:
    """Sum of the scores of all the prompt's maps / (log p(answer) - log p(answer | empty visual tokens)); about 1
    when the path integral is resolved (raise `steps` otherwise). None when the method's scores do not sum to the
    image effect (plain gradient x input, the perturbations)."""
    first = maps[0]
    if not first.method.complete or first.baseline_objective is None:
        return None
    delta = first.objective - first.baseline_objective
    total = float(sum(m.scores.sum() for m in maps))
    return total / delta if delta else (1.0 if abs(total) < 1e-9 else math.inf)


# ---- scores -> maps ---------------------------------------------------------------------------------------------
def evidence(model: Any, inputs: dict[str, Any], answer_ids: Any, *, method: Method = DEFAULT_METHOD,
             images: Sequence[Any] | None = None, image_processor: Any = None, rule: str = "positive",
             batch_size: int = 16, seed: int = 0) -> list[EvidenceMap]:
    """Evidence for `answer_ids`, one `EvidenceMap` per image of the prompt.

    `inputs`: one prompt's keyword inputs (`Processor` output, batch of one, padding allowed); `answer_ids`
    (T,) the answer's token ids (without what follows its end); `method`: `Occlusion`, `Rise` or `Integrated`
    (`mmadapt.evidence.methods`). Every method runs `batch_size` copies of the prompt per forward; `seed` fixes the
    masks (a local generator: the global RNG is untouched). `images`: the original images (PIL images, paths or
    (width, height) sizes), one per image of the prompt, to map the evidence onto their pixels through
    `image_processor` (default `processor_for(model)`; pass the processor that made `inputs`). The model runs in
    eval mode and is left as it was; only the visual tokens get gradients (`Integrated`).
    """
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known: {list(RULES)}")
    if not isinstance(method, Method):
        raise TypeError(f"unknown method {method!r}: give a method object, e.g. Occlusion(windows=(1, 2)), "
                        "Rise(samples=128) or Integrated(steps=32) from mmadapt.evidence")
    if batch_size < 1:
        raise ValueError(f"batch_size ({batch_size}) must be >= 1")
    prompt = Prompt.of(model, inputs, answer_ids)
    with eval_mode(model):
        visual = prompt.visual(model)
        with torch.no_grad():  # the two ends of the token path: with the features, and with every visual token empty
            features = torch.stack([visual.features, *visual.levels])
            ends = answer_log_probs(model, prompt.ids, prompt.answer, visual,
                                    torch.stack([features, torch.zeros_like(features)]))
        ends[1] = method.baseline(model, prompt, visual, ends[1])
        scores = method.scores(model, prompt, visual, batch_size=batch_size, seed=seed)
    maps = token_maps(scores, visual.grids.cpu(), method.window(visual), rule=rule, images=images,
                      image_processor=image_processor if image_processor is not None or images is None
                      else _processor_of(model))
    return [dataclasses.replace(m, objective=float(ends[0]), baseline_objective=float(ends[1]), method=method)
            for m in maps]


def _processor_of(model: Any) -> Any:
    from mmadapt.data.processors import processor_for

    return processor_for(model)


def token_maps(scores: torch.Tensor, grids: torch.Tensor, window: int = 1, *, rule: str = "positive",
               images: Sequence[Any] | None = None, image_processor: Any = None) -> list[EvidenceMap]:
    """Per-token scores (N,) in stored order -> one `EvidenceMap` per image (see `evidence`)."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known: {list(RULES)}")
    scores = scores.double()
    kept = scores.clamp(min=0) if rule == "positive" else scores.abs()
    image, coords = grid_coords(grids, window)
    sizes = [_size_of(x) for x in images] if images is not None else None
    if sizes is not None and len(sizes) != len(grids):
        raise ValueError(f"{len(sizes)} images given for a prompt with {len(grids)}: give one per image")
    total = float(kept.sum())
    maps = []
    for i, (t, h, w) in enumerate(grids.tolist()):
        mine = image == i
        frame, row, col = coords[:, mine]
        raw = torch.zeros(t, h, w, dtype=torch.float64).index_put_((frame, row, col), scores[mine])
        cells = torch.zeros(t, h, w, dtype=torch.float64).index_put_((frame, row, col), kept[mine]).sum(0).numpy()
        mass = float(cells.sum())
        cells = cells / mass if mass > 0 else cells
        geometry = pixels = outside = None
        if sizes is not None:
            width, height = sizes[i]
            geometry = geometry_for(image_processor, height, width)
            _check_grid(geometry, image_processor, (h, w), i)
            pixels = geometry.pixel_map(cells)
            outside = float(max(0.0, 1.0 - (cells * geometry.coverage((h, w))).sum())) if mass > 0 else 0.0
        maps.append(EvidenceMap(i, raw.numpy(), cells, rule, mass, mass / total if total > 0 else 0.0,
                                geometry, pixels, outside))
    return maps


def geometry_for(processor: ImageProcessor, height: int, width: int) -> Geometry:
    """The exact geometry of `processor` (`FixedSizeProcessor` or `QwenProcessor`) for an H x W image."""
    return processor.geometry(height, width)


def _size_of(image: Any) -> tuple[int, int]:
    """(width, height) of a PIL image, a path or a (width, height) pair."""
    if isinstance(image, (str, os.PathLike)):
        from mmadapt.data.images import image_size

        return image_size(image)  # from the header, after EXIF rotation, the allowed formats only (as `load_image`)
    if hasattr(image, "size") and not isinstance(image, (tuple, list, np.ndarray)):
        return tuple(image.size)
    if isinstance(image, np.ndarray):
        return image.shape[1], image.shape[0]
    width, height = image
    return int(width), int(height)


def _check_grid(geometry: Geometry, processor: Any, grid: tuple[int, int], index: int) -> None:
    """The processor's geometry must produce the token grid the model saw (else the maps would be misplaced)."""
    if processor.dynamic:
        step = processor.patch_size * processor.projector_merge
        expected = (geometry.processed[0] // step, geometry.processed[1] // step)
    else:  # the processor's token count and an integer cell size
        fits = processor.tokens_per_image == grid[0] * grid[1] and all(
            geometry.processed[a] % grid[a] == 0 for a in (0, 1))
        expected = tuple(grid) if fits else None
    if expected != tuple(grid):
        raise ValueError(
            f"image {index}: {processor!r} makes a {geometry.processed[0]} x {geometry.processed[1]} image of the "
            f"{geometry.original[0]} x {geometry.original[1]} original, which does not give the model's token grid "
            f"{list(grid)}. Fix: pass the image processor that made the inputs (Processor.encoder.processor) and "
            "the original images in prompt order.")
