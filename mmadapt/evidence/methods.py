"""Attribution methods: how a map's scores are made, one small frozen object per method.

    Occlusion(windows=(1, 2))   windows of token cells at the processor's mean colour, at the pixels (the default)
    Rise(samples=128)           random masks of token cells at the pixels (Petsiuk et al. 2018)
    Integrated(steps=32)        integrated gradients at the injected visual tokens (steps=1: gradient x input)

Contract: a method validates its own parameters when built and has one interface: `scores(model, prompt, visual,
batch_size=, seed=)` -> (N,) one score per LLM token cell, read in merge windows of `window(visual)`;
`baseline(...)` -> the answer's log-probability at the method's baseline (what `EvidenceMap.image_effect` is
measured against: the mean-colour image for the perturbations, empty visual tokens for the gradients);
`describe()` and `baseline_wording` for the printed lines, `name` and `parameters()` for JSON. The model is in
eval mode (the caller's `eval_mode`). docs/evidence.md says how each method works and how they compare.

Shapes: N visual tokens (all images, stored order), D LLM width, K path points or masks, (t, h, w) an image's
LLM-side token grid.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import torch

from mmadapt.evidence.prompt import Prompt, answer_log_probs, masked_objectives, report_batch
from mmadapt.evidence.settings import DEFAULT_SAMPLES, DEFAULT_STEPS, MASK_CELLS, OCCLUSION_SIZES


class Method(ABC):
    """Where and how the answer's evidence is measured. `name`: the class name in lower case (JSON, titles)."""

    name: ClassVar[str] = "method"
    baseline_wording: ClassVar[str]  # "log p(answer) is ... with the image than with <this>"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = cls.__name__.lower()

    @abstractmethod
    def describe(self) -> str:
        """The method and its parameters, for the evidence line."""

    @abstractmethod
    def scores(self, model: Any, prompt: Prompt, visual: Any, *, batch_size: int, seed: int) -> torch.Tensor:
        """(N,) the score of each LLM token cell, stored in merge windows of `window(visual)`."""

    @abstractmethod
    def baseline(self, model: Any, prompt: Prompt, visual: Any, empty: torch.Tensor) -> torch.Tensor:
        """log p(answer) at the method's baseline; `empty`: the same with every visual token empty (zero)."""

    def window(self, visual: Any) -> int:
        """The merge window in which `scores` lists the cells (1: row-major per image)."""
        return 1

    @property
    def complete(self) -> bool:
        """Whether the scores of all maps sum to the image effect (`completeness` is then about 1)."""
        return False

    def parameters(self) -> dict[str, Any]:
        """JSON-ready: every method's parameters, 0 or empty where they are not this method's."""
        return {"steps": 0, "samples": 0, "windows": []}


class PixelMethod(Method):
    """A perturbation at the pixels: token cells set to the processor's mean colour (0 after normalising) before the
    encoder, so the whole vision side is inside the map; the baseline is every cell at the mean colour."""

    baseline_wording: ClassVar[str] = "the image at the mean colour"

    def baseline(self, model: Any, prompt: Prompt, visual: Any, empty: torch.Tensor) -> torch.Tensor:
        cells = prompt.cells(visual.grids)
        return masked_objectives(model, prompt, cells, torch.zeros(1, int(cells.max()) + 1), 1)[0]

    @staticmethod
    def per_token_probability(model: Any, prompt: Prompt, cells: torch.Tensor, keeps: torch.Tensor,
                              batch_size: int) -> torch.Tensor:
        """(K,) f = exp(F / T), the answer's per-token probability, under each of the masks `keeps` (K, cells)."""
        return (masked_objectives(model, prompt, cells, keeps, batch_size) / prompt.answer.numel()).exp()


@dataclass(frozen=True, kw_only=True)
class Occlusion(PixelMethod):
    """Square windows of token cells, one side per entry of `windows` (in blocks: at most `MASK_CELLS` a side),
    at the mean colour, one window per copy of the prompt; a window's drop of f is shared by its cells:
    score_c = sum_{windows W containing c} (f(image) - f(image with W at the mean colour)) / |W|.
    Forwards: 1 + windows (25 on a 4 x 4 grid, at most 1 + 64 + 49 = 114 per image)."""

    windows: tuple[int, ...] = OCCLUSION_SIZES

    def __post_init__(self) -> None:
        windows = tuple(self.windows)
        if not windows or min(windows) < 1:
            raise ValueError(f"windows {windows}: give window sides in token cells, each >= 1, e.g. (1, 2)")
        object.__setattr__(self, "windows", tuple(int(w) for w in windows))

    def describe(self) -> str:
        return f"occlusion of token-cell windows {'+'.join(f'{w}x{w}' for w in self.windows)} at the pixels"

    def scores(self, model: Any, prompt: Prompt, visual: Any, *, batch_size: int, seed: int) -> torch.Tensor:
        blocks = occlusion_blocks(visual.grids, MASK_CELLS, self.windows)
        keeps = torch.cat([torch.ones(1, blocks.shape[1], dtype=torch.float64), 1.0 - blocks])
        f = self.per_token_probability(model, prompt, prompt.cells(visual.grids), keeps, batch_size)
        return ((f[0] - f[1:])[:, None] * blocks / blocks.sum(1, keepdim=True)).sum(0)

    def parameters(self) -> dict[str, Any]:
        return super().parameters() | {"windows": list(self.windows)}


@dataclass(frozen=True, kw_only=True)
class Rise(PixelMethod):
    """`samples` random masks keeping each block of cells with probability 1/2 (`random_masks`):
    score_c = E[f | c kept] - E[f | c masked]. Forwards: `samples`."""

    samples: int = DEFAULT_SAMPLES

    def __post_init__(self) -> None:
        if self.samples < 2:
            raise ValueError(f"Rise(samples={self.samples!r}): give at least 2 random masks")

    def describe(self) -> str:
        return f"RISE, {self.samples} random masks at the pixels"

    def scores(self, model: Any, prompt: Prompt, visual: Any, *, batch_size: int, seed: int) -> torch.Tensor:
        keeps = random_masks(visual.grids, self.samples, torch.Generator().manual_seed(seed), coarse=MASK_CELLS)
        f = self.per_token_probability(model, prompt, prompt.cells(visual.grids), keeps, batch_size)
        kept, masked = keeps.sum(0), (1.0 - keeps).sum(0)
        with_cell = (keeps * f[:, None]).sum(0) / kept.clamp(min=1)
        without = ((1.0 - keeps) * f[:, None]).sum(0) / masked.clamp(min=1)
        return torch.where((kept > 0) & (masked > 0), with_cell - without, torch.zeros_like(with_cell))

    def parameters(self) -> dict[str, Any]:
        return super().parameters() | {"samples": self.samples}


@dataclass(frozen=True, kw_only=True)
class Integrated(Method):
    """Integrated gradients at the injected visual tokens (where the LLM reads): every visual token's feature x_n
    (D,), the projector output that `contract.scatter` writes into the LLM's input embeddings, gets
    score_n = sum_D x_n * sum_k w_k dF/dx_n (alpha_k * x), all visual tokens (and DeepStack levels) scaled together,
    `steps` log-spaced points from the empty (all-zero) tokens (`path_points`); `steps=1` is plain gradient x input.
    With `steps` > 1 the scores of all images sum to F(x) - F(0) (`completeness`). Forwards + backwards: `steps`."""

    steps: int = DEFAULT_STEPS

    baseline_wording: ClassVar[str] = "empty visual tokens"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"Integrated(steps={self.steps!r}): give at least 1 point on the path "
                             "(1 = plain gradient x input)")

    def describe(self) -> str:
        if self.steps == 1:
            return "gradient x input at the visual tokens"
        return f"integrated gradients at the visual tokens, {self.steps} steps"

    def scores(self, model: Any, prompt: Prompt, visual: Any, *, batch_size: int, seed: int) -> torch.Tensor:
        return integrated_scores(model, prompt, visual, self.steps, batch_size)

    def baseline(self, model: Any, prompt: Prompt, visual: Any, empty: torch.Tensor) -> torch.Tensor:
        return empty

    def window(self, visual: Any) -> int:
        return visual.window

    @property
    def complete(self) -> bool:
        return self.steps > 1

    def parameters(self) -> dict[str, Any]:
        return super().parameters() | {"steps": self.steps}


METHODS: Final[tuple[type[Method], ...]] = (Occlusion, Rise, Integrated)
DEFAULT_METHOD: Final[Method] = Occlusion()  # docs/evidence.md: why occlusion is the default
GRADIENT_X_INPUT: Final[Method] = Integrated(steps=1)


# ---- integrated gradients ---------------------------------------------------------------------------------------
def integrated_scores(model: Any, prompt: Prompt, visual: Any, steps: int, batch_size: int) -> torch.Tensor:
    """(N,) integrated gradients x input of every visual token (stored order), summed over D and DeepStack levels."""
    # A visual token's input is its main features and, with DeepStack, its levels: (1 + levels, N, D), all scaled
    features = torch.stack([visual.features, *visual.levels]).detach()
    device = features.device
    alphas, weights = path_points(steps)
    gradient = torch.zeros(features.shape, dtype=torch.float32, device=device)
    done = 0
    for chunk, chunk_weights in zip(alphas.split(batch_size), weights.split(batch_size), strict=True):
        scaled = (chunk.to(device, torch.float32).view(-1, 1, 1, 1) * features.float()).to(features.dtype)
        scaled.requires_grad_(True)
        with torch.enable_grad():
            values = answer_log_probs(model, prompt.ids, prompt.answer, visual, scaled)
            (grad,) = torch.autograd.grad(values.sum(), scaled)
        gradient += (chunk_weights.to(device, torch.float32).view(-1, 1, 1, 1) * grad.float()).sum(0)
        report_batch(done := done + len(chunk), len(alphas))
    return (gradient * features.float()).sum((0, -1)).cpu()


def path_points(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points alpha (K,) on the path alpha * features and their quadrature weights (summing to 1).

    1: alpha = 1 (plain gradient x input). K > 1: log-spaced from 1e-6 to 1 (trapezoid rule, the first interval
    [0, 1e-6] given to its right end): a pre-norm LLM's RMSNorm(alpha * x) jumps from 0 to x / rms(x) within
    alpha ~ sqrt(eps / mean(x^2)), which a uniform grid steps over (its scores then miss most of
    log p(answer) - log p(answer | empty tokens)); log spacing resolves it wherever the model's scale puts it.
    """
    if steps == 1:
        return torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    alphas = torch.logspace(-6, 0, steps, dtype=torch.float64)
    gaps = alphas[1:] - alphas[:-1]
    weights = torch.zeros(steps, dtype=torch.float64)
    weights[:-1] += gaps / 2
    weights[1:] += gaps / 2
    weights[0] += alphas[0]
    return alphas, weights


# ---- masks of token cells ---------------------------------------------------------------------------------------
def random_masks(grids: torch.Tensor, samples: int, generator: torch.Generator, *, keep: float = 0.5,
                 coarse: int = MASK_CELLS) -> torch.Tensor:
    """(samples, cells) RISE masks: per image, Bernoulli(`keep`) on a grid of at most `coarse` x `coarse` blocks of
    token cells, each mask shifted at random by less than a block (so that the map keeps the token resolution)."""
    columns = []
    for t, h, w in grids.tolist():
        block = (math.ceil(h / min(h, coarse)), math.ceil(w / min(w, coarse)))
        size = (h // block[0] + 2, w // block[1] + 2)
        bits = torch.rand(samples, t, *size, generator=generator) < keep
        shift = [torch.randint(0, b, (samples,), generator=generator) for b in block]
        rows = (torch.arange(h)[None] + shift[0][:, None]) // block[0]  # (samples, h)
        cols = (torch.arange(w)[None] + shift[1][:, None]) // block[1]
        picked = bits[torch.arange(samples)[:, None, None, None], torch.arange(t)[None, :, None, None],
                      rows[:, None, :, None], cols[:, None, None, :]]
        columns.append(picked.reshape(samples, -1))
    return torch.cat(columns, 1).double()


def occlusion_blocks(grids: torch.Tensor, coarse: int = MASK_CELLS,
                     sizes: Sequence[int] = OCCLUSION_SIZES) -> torch.Tensor:
    """(windows, cells) membership of the token cells (row-major per image, `cell_index`) in the windows occlusion
    removes one at a time: per image and frame, the cells are grouped in at most `coarse` x `coarse` blocks of
    ceil(h / coarse) x ceil(w / coarse) cells (one cell each on grids of at most `coarse` a side), and a window is
    k x k blocks, k in `sizes`, at every block position (stride 1; k clipped to the grid)."""
    rows, start, total = [], 0, int(grids.prod(-1).sum())
    for t, h, w in grids.tolist():
        block = (math.ceil(h / min(h, coarse)), math.ceil(w / min(w, coarse)))
        by, bx = math.ceil(h / block[0]), math.ceil(w / block[1])
        row_block, col_block = torch.meshgrid(torch.arange(h) // block[0], torch.arange(w) // block[1], indexing="ij")
        windows = sorted({(min(k, by), min(k, bx)) for k in sizes})
        for frame in range(t):
            for ky, kx in windows:
                for y in range(by - ky + 1):
                    for x in range(bx - kx + 1):
                        inside = ((row_block >= y) & (row_block < y + ky) & (col_block >= x) & (col_block < x + kx))
                        member = torch.zeros(total, dtype=torch.float64)
                        member[start + frame * h * w + torch.nonzero(inside.flatten()).flatten()] = 1.0
                        rows.append(member)
        start += t * h * w
    return torch.stack(rows)
