"""Evidence maps: which parts of the image an answer rests on (`mmadapt explain`).

    result = explain(model, processor, "cat.png", "What animal is this?", out="cat.evidence.png")
    result["answer"], result["quadrants"], result["map"].pixels      # (H, W) over the original image

Contract
- `evidence(model, inputs, answer_ids)` takes the keyword inputs of ONE prompt (`Processor` output, batch of
  one, padding allowed) and the answer's token ids. The answer is appended to the prompt (teacher forcing) and
  the objective is F = sum_t log p(answer_t | prompt, answer_<t). Two places to attribute, `method`:
  * "occlusion" (default) - at the pixels, the whole encoder inside the attribution. The image is cut into the
    cells of the LLM-side token grid (the pixels that feed one visual token: a fixed-size encoder's patch, a
    Qwen merge window of m x m patches; `cell_index` reads the layout off `pixel_values` and `image_grid_thw`)
    and windows of 1 x 1 and 2 x 2 cells (`OCCLUSION_SIZES`; on grids wider than `MASK_CELLS` = 8 the cells are
    first grouped into at most 8 x 8 blocks) are set to the processor's mean colour (0 after normalising), one
    window per forward, `batch_size` masked copies of the prompt per forward through the model's own input path
    (`prepare`: its encoder, projector, DeepStack levels, injection and positions). A window's score is the drop
    of the answer's per-token probability f = exp(F / T) it causes, shared by its cells:
        score_c = sum_{windows W containing c} (f(image) - f(image with W at the mean colour)) / |W|
    Cost: 1 + (windows) forwards without a graph: 25 on a 4 x 4 grid, at most 1 + 64 + 49 = 114 per image.
    "rise" (Petsiuk et al. 2018) is the random-mask variant: `samples` (128) masks keeping each block with
    probability 1/2, score_c = E[f | c kept] - E[f | c masked].
  * "integrated" - at the injected visual tokens (the token map: where the LLM reads). Every visual token n gets
    a score from its feature x_n (D,), the projector output that `contract.scatter` writes into the LLM's input
    embeddings:
      score_n = sum_D x_n * sum_k w_k dF/dx_n (alpha_k * x)      (all visual tokens scaled together)
  `steps=1` is alpha = 1: plain gradient x input, one forward + backward. `steps=K` (default 32) is integrated
  gradients from the empty (all-zero) visual tokens, K log-spaced points (`path_points`), evaluated in batches
  of `batch_size` copies of the prompt; then the scores of all images sum to F(x) - F(0) (`completeness`,
  about 1; raise `steps` when it is not). Only the visual tokens get gradients (`torch.autograd.grad`), the
  model runs in eval mode and is put back; the encoder runs once, without a graph. The injection, positions
  (1-D or M-RoPE) and masks are the model's own (its one input path, `prepare`): the scores equal gradient x
  input through `model.forward`, and the image-token contract is checked as in `forward`.
  Both give one score per LLM token cell, so both are mapped onto the original image by the same geometry
  (below). `image_effect` (F with the image minus F with empty visual tokens) is computed for every method.
- Faithfulness (`faithfulness(model, inputs, answer_ids, maps)`, `Faithfulness`; `explain` runs it): RISE's
  deletion / insertion metric. The cells are removed (set to the mean colour) or revealed in the map's order,
  8 groups (`CURVE_STEPS`), and p(answer) is followed relative to p(answer | image); the areas under the two
  curves are compared with those of 8 random orders (`RANDOM_ORDERS`): score = mean over the random orders r of
  ((deletion_r - deletion) + (insertion - insertion_r)) / 2, 0 = no better than a random map, > 0 better,
  < 0 worse; `trusted` when the map beats every random order on an answer that rests on the pixels.
  2 + 2 * 9 * 7 = 128 forwards by default.
- The rule turns scores into evidence: "positive" (default) keeps max(score, 0), "absolute" keeps |score|.
  Each image's evidence is normalised to sum to 1 over its tokens (`EvidenceMap.tokens`); an image with no
  evidence at all gets an all-zero map and `mass == 0`.
- Given the original images (or their sizes) the token grid is mapped onto the original pixels through the
  exact geometry of the image processor that made `inputs` (`Geometry`, `geometry_for`): each token's share
  is spread uniformly over the part of its cell that shows the original image, dropped where the cell shows
  padding (`outside`), and the result renormalised to sum to 1 over the original pixels the model saw
  (`EvidenceMap.pixels`; 0 on pixels it did not see, e.g. outside CLIP's centre crop).
- `render(image, heat, path)` overlays a map on the original image (PNG), `explain(...)` answers greedily and
  explains the answer; `mmadapt explain` (in `mmadapt.cli`) is the command.

Why occlusion at the pixels is the default, with windows of two sizes: the faithfulness measure chose it
- A token map (integrated gradients at the injected visual tokens) shows where the LLM reads the evidence. An
  encoder with global attention (Qwen's ViTs), once trained, may copy a region's information into every token,
  and the token map then spreads over the copies. Perturbing the pixels puts the whole encoder (and the merger,
  and the DeepStack levels) inside the attribution.
- The test bed (tests/test_evidence.py, benchmarks/bench_evidence.py): the answer ("red", "blue" or "other") is
  the colour of the top-left quadrant, the other three are noise or solid colours, red and blue among them;
  4 x 4 LLM tokens; each encoder family with a LLaMA and a Qwen3.5 backbone, trained by mmadapt's trainer; over
  the right answers that rest on the image, the mean share of the top-left quadrant (uniform: 0.25), the mean
  faithfulness score and the fraction of maps `trusted`. Seed 0, one thread, 12 held-out images
  (share / faithfulness / trusted):
      encoder + backbone       occlusion (default)   integrated gradients   RISE (64 masks)
      clip + llama             1.00 / 0.66 / 1.00    0.96 / 0.66 / 1.00     0.55 / 0.63 / 1.00
      siglip + llama           1.00 / 0.56 / 1.00    0.92 / 0.42 / 0.75     0.54 / 0.56 / 1.00
      timm + llama             1.00 / 0.62 / 1.00    0.99 / 0.62 / 1.00     0.51 / 0.62 / 1.00
      qwen3_5_vit + llama      0.97 / 0.62 / 1.00    0.83 / 0.32 / 0.56     0.55 / 0.52 / 1.00
      qwen3_vl_vit + llama     1.00 / 0.53 / 1.00    0.97 / 0.55 / 1.00     0.45 / 0.54 / 1.00
      clip + qwen3_5           0.93 / 0.47 / 1.00    0.42 / 0.11 / 0.33     0.61 / 0.48 / 1.00
      siglip + qwen3_5         0.89 / 0.43 / 1.00    0.42 / -0.09 / 0.25    0.56 / 0.44 / 1.00
      timm + qwen3_5           0.88 / 0.48 / 1.00    0.62 / 0.23 / 0.62     0.78 / 0.48 / 1.00
      qwen3_5_vit + qwen3_5    0.90 / 0.37 / 1.00    0.50 / 0.15 / 0.42     0.52 / 0.39 / 1.00
      qwen3_vl_vit + qwen3_5   1.00 / 0.63 / 1.00    0.14 / 0.08 / 0.25     0.60 / 0.63 / 1.00
      a map of random numbers  faithfulness -0.13 to +0.08 (per image -0.42 to +0.34), trusted 0 of 86 maps
  Occlusion is as faithful as the best method everywhere and the only one that is both faithful and sharp:
  RISE orders the cells as well but spreads the mass (random masks leave the answer's cells half-present; at
  16 cells its estimate is noisy), integrated gradients at the tokens is poor under a Qwen3.5 backbone (its map
  is where the LLM reads, and it is measured against empty tokens, not against removed pixels). Over seeds
  and thread counts (occlusion; seeds 0 / 1 / 2 x 1 / 2 threads): the minimum over the 60 runs of accuracy 0.83,
  top-left share 0.83, faithfulness +0.37, maps trusted 83% (per pair below). One or two threads train a
  different model, as another seed does (shares up to 0.17 apart, faithfulness up to 0.24, accuracy 0.83 against
  1.00); every range below spans both:
      encoder + backbone       accuracy    top-left share   faithfulness    trusted
      clip + llama             1.00        0.96-1.00        +0.59 to +0.67  100%
      siglip + llama           1.00        0.98-1.00        +0.56 to +0.67  100%
      timm + llama             1.00        1.00             +0.57 to +0.62  100%
      qwen3_5_vit + llama      1.00        0.83-1.00        +0.45 to +0.67  83%-100%
      qwen3_vl_vit + llama     1.00        0.97-1.00        +0.53 to +0.67  100%
      clip + qwen3_5           0.83-1.00   0.88-1.00        +0.47 to +0.60  100%
      siglip + qwen3_5         1.00        0.88-0.98        +0.43 to +0.49  100%
      timm + qwen3_5           1.00        0.88-1.00        +0.48 to +0.59  100%
      qwen3_5_vit + qwen3_5    0.92-1.00   0.85-0.96        +0.37 to +0.61  83%-100%
      qwen3_vl_vit + qwen3_5   1.00        0.88-1.00        +0.45 to +0.63  100%
  Windows of one cell alone miss evidence held redundantly by a region (a trained Qwen ViT's four corner cells
  are copies of one another: removing one changes nothing; measured on the two-answer task that preceded this
  one, single cells 0.33 against 0.82 for both sizes); windows of 2 x 2 alone blur evidence held by one cell.
- Pixel-level gradients (x the normalised pixels, plain or integrated from the mean colour) were tried before:
  they put most of the mass on the noise regions (top-left 0.15-0.18). Attention rollout needs every layer's
  attention matrix (Gated DeltaNet's linear attention in Qwen3.5 has none, fused SDPA kernels do not return
  them), assumes attention mixes linearly, ignores the MLPs and is the same for every answer.
- Occlusion's answer depends on the fill: the processor's mean colour (0 after normalising) is what the
  encoder's inputs centre on, and the faithfulness measure removes regions with the same fill, so the number
  printed next to a map measures the map by the same yardstick whatever the method.
- A limit of every perturbation map, learnt from the task's first version with two answers (red or blue): a
  model may learn "blue, else red" and answer "blue" to the mean-colour image as well. Its "blue" answers then do
  not rest on the pixels (flagged: `rests_on_image` False) and its "red" answers rest on "the image is not
  blank and its corner is not blue", evidence spread over the whole image that no map can localise (removing
  the corner left p(red) at 0.99; share 0.33, faithfulness -0.04, and the number said so). A map explains the
  answer against its baseline; when the baseline is itself an answer, only the other answers have evidence.

Why integrated gradients for the token map, not the plain gradient
- The attribution point is the one interface every combination shares (`VisualTokens.features` -> `scatter`);
  the scatter is a linear copy, so the gradient w.r.t. a feature IS the gradient w.r.t. that LLM input
  position. Measured on the quadrant task (clip + mlp2x_gelu + llama, 24 held-out images, 100% answered
  right), over all answers, plain gradient x input 0.39 (positive) / 0.51 (absolute), integrated 0.93 / 0.88
  (8 to 64 steps alike; over seeds 0 / 1 / 2: 0.93 / 0.86 / 0.84); over the answers that rest on the image,
  plain 0.22, integrated 0.97. The end-point gradient is a poor witness because a pre-norm LLM is
  scale-invariant in each token through its first RMSNorm (d/d alpha of RMSNorm(alpha * x) is about 0 at alpha = 1),
  so gradient x input sees only the residual path; the path from the empty token crosses the point where the
  token's direction appears (alpha ~ sqrt(eps / mean(x^2)), hence the log spacing) and is complete.
- Known limit of every method: an answer the model gives without looking (its default: log p(answer | the
  method's baseline) about as high as with the image) has no evidence; `image_effect` (in nats) says so and
  `rests_on_image` is False below `MIN_EFFECT` (the CLI prints it): such a map is noise, not evidence. The
  baseline is the method's own: empty visual tokens for the token map, the mean-colour image for occlusion
  (what its windows fill in). They can disagree: a model may answer "red" to empty tokens and "blue" to a grey
  image; then its "blue" answers rest on the image for the token map (2.7 nats) but not for occlusion (0.06:
  grey is, to it, "not red", so removing the corner cannot lower p(blue)), and its "red" answers the reverse.

Why the positive part (default)
- With the empty-token baseline the sign has a meaning: a positive score is a token whose presence raises the
  answer's log-probability, a negative one argues against the answer (e.g. a blue region when the answer is
  "red"). "What does the answer rest on" is the first; |score| paints counter-evidence as support and adds the
  noise of distractor regions of both signs (measured above: 0.93 positive vs 0.88 absolute). "absolute" is
  there for "what influences the answer at all". For occlusion a negative score is a region whose removal makes
  the answer more likely.

Geometry (per axis, continuous pixel coordinates: pixel i covers [i, i + 1))
- processed = scale * original + offset, the processed image being S x S (fixed-size encoders) or H' x W'
  (Qwen's smart resize); token cell (row, col) of an (h, w) grid covers processed
  [row * H'/h, (row + 1) * H'/h) x [col * W'/w, (col + 1) * W'/w).
- "pad" (LLaVA-1.5's expand2square): centred on a square of side L = max(H, W), then resized to S:
  scale S / L, offset = centring offset * S / L; the original is a centred sub-rectangle.
- "resize": plain stretch, scale (S / H, S / W), offset 0.  "crop" (CLIP): short side to S (the long side
  truncated as transformers does), then a centre crop: a negative offset, and the sides beyond the crop are
  never seen (`Geometry.seen_box`).
- Qwen: a plain resize to smart_resize(H, W) = (H', W'), multiples of P * m; grid (1, H'/(P*m), W'/(P*m)).
- Extreme aspect ratios (> `max_aspect_ratio`) are first padded, centred, exactly as the processors do.

Shapes: I images in the prompt, N visual tokens (all images, stored order), D LLM width, K path points, T answer
tokens, (t, h, w) an image's LLM-side token grid (`VisualTokens.grids`, after the projector's merge), H x W the
original image, H' x W' the processed image. `EvidenceMap.scores` (t, h, w), `.tokens` (h, w), `.pixels` (H, W).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch

from mmadapt.data.geometry import Box, Geometry
from mmadapt.encoders.base import grid_coords
from mmadapt.packing import as_bool_mask

if TYPE_CHECKING:
    from mmadapt.data.processors import ImageProcessor

RULES: Final[tuple[str, ...]] = ("positive", "absolute")
QUADRANTS: Final[tuple[str, ...]] = ("top_left", "top_right", "bottom_left", "bottom_right")
METHODS: Final[tuple[str, ...]] = ("rise", "occlusion", "integrated")
DEFAULT_METHOD: Final[str] = "occlusion"
DEFAULT_STEPS: Final[int] = 32  # integrated gradients: points on the path
DEFAULT_SAMPLES: Final[int] = 128  # rise: random masks (forwards of the whole model)
MASK_CELLS: Final[int] = 8  # occlusion and rise: at most 8 x 8 blocks of token cells per image
OCCLUSION_SIZES: Final[tuple[int, ...]] = (1, 2)  # occlusion: windows of 1 x 1 and 2 x 2 blocks
CURVE_STEPS: Final[int] = 8  # deletion / insertion: points on each curve
RANDOM_ORDERS: Final[int] = 8  # deletion / insertion: random orders the map's order is compared with
MIN_EFFECT: Final[float] = 0.1  # nats (a probability ratio of 1.1): below it an answer does not rest on the images


# ---- geometry: the processed image the encoder saw <-> the original image ------------------------------------
# `Geometry` and each mode's steps live in mmadapt.data.geometry, next to the processors that run them.
def geometry_for(processor: ImageProcessor, height: int, width: int) -> Geometry:
    """The exact geometry of `processor` (`FixedSizeProcessor` or `QwenProcessor`) for an H x W image."""
    return processor.geometry(height, width)


# ---- the maps --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvidenceMap:
    """The evidence for an answer on one image of the prompt.

    `scores` (t, h, w): the signed score of each visual token (integrated gradients x input; gradient x input for
    `steps` 1), in nats of the answer's log-probability;
    `tokens` (h, w): the image's evidence per token cell under `rule`, summing to 1 (0 everywhere when
    `mass` == 0); `mass`: the evidence before normalising; `image_share`: this image's part of the prompt's
    evidence. With the original image known: `geometry`, `pixels` (H, W) summing to 1 over the pixels the model
    saw, and `outside`: the share of `tokens` that fell on padding rather than on the original.
    Prompt-level (the same in every map of one call): `objective`, the answer's log-probability;
    `baseline_objective`, the same at the method's baseline - every visual token empty (zero) for "integrated",
    every image at the processor's mean colour for "occlusion" and "rise" (what their masks fill in); their
    difference `image_effect`, in nats, is what the images do for the answer; with `steps` > 1 the scores of
    all maps sum to about it (completeness of integrated gradients). An answer the model gives as readily
    without its images (`rests_on_image` False: the image effect is below `MIN_EFFECT`) has no evidence to map:
    its map shows noise. `method`, `steps` (integrated), `samples` (rise); `faithfulness`: the deletion /
    insertion measurement (`Faithfulness`) when `explain` (or the caller) made it.
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
    steps: int = 1
    method: str = "integrated"
    samples: int = 0
    windows: tuple[int, ...] = ()
    faithfulness: Faithfulness | None = None

    @property
    def image_effect(self) -> float | None:
        """log p(answer) - log p(answer | the method's baseline: empty visual tokens for "integrated", the
        mean-colour images for the perturbations), in nats (None when not computed)."""
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
        """JSON-ready: rule, mass, shares, peak cell (and its box), quadrants."""
        out: dict[str, Any] = {"image_index": self.image, "method": self.method, "rule": self.rule,
                               "steps": self.steps, "samples": self.samples,
                               "windows": list(self.windows), "mass": self.mass,
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


def evidence(model: Any, inputs: dict[str, Any], answer_ids: Any, *, images: Sequence[Any] | None = None,
             image_processor: Any = None, rule: str = "positive", method: str = DEFAULT_METHOD,
             steps: int = DEFAULT_STEPS, samples: int = DEFAULT_SAMPLES, windows: Sequence[int] = OCCLUSION_SIZES,
             batch_size: int = 16, seed: int = 0) -> list[EvidenceMap]:
    """Evidence for `answer_ids`, one `EvidenceMap` per image of the prompt.

    `inputs`: one prompt's keyword inputs (`Processor` output, batch of one, padding allowed); `answer_ids`
    (T,) the answer's token ids (without what follows its end). `method` (see the module docstring):
    "integrated" - integrated gradients at the visual tokens, `steps` points on the path from the empty (zero)
    token to the features (1 = plain gradient x input, one forward + backward); "rise" - `samples` random masks of
    the image's token cells filled with the mean colour before the encoder; "occlusion" (default) - square
    windows of token cells, one side per entry of `windows` (default 1 and 2), at the mean colour, one window per
    copy of the prompt. Every method runs `batch_size` copies of the prompt per forward; `seed` fixes the masks
    (a local generator: the global RNG is untouched). `images`: the original images (PIL images, paths or
    (width, height) sizes), one per image of the prompt, to map the evidence onto their pixels through
    `image_processor` (default `processor_for(model)`; pass the processor that made `inputs`).
    """
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known: {list(RULES)}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {list(METHODS)}")
    if steps < 1 or batch_size < 1 or samples < 2:
        raise ValueError(f"steps ({steps}) and batch_size ({batch_size}) must be >= 1, samples ({samples}) >= 2")
    if not windows or min(windows) < 1:
        raise ValueError(f"windows {tuple(windows)}: give window sides in token cells, each >= 1, e.g. (1, 2)")
    prompt = _Prompt.of(model, inputs, answer_ids)
    was_training = model.training
    model.eval()
    try:
        visual = prompt.visual(model)
        with torch.no_grad():  # the two ends of the token path: with the features, and with every visual token empty
            features = torch.stack([visual.features, *visual.levels])
            ends = answer_log_probs(model, prompt.ids, prompt.answer, visual,
                                    torch.stack([features, torch.zeros_like(features)]))
        if method != "integrated":  # the perturbations' own baseline: every cell at the mean colour
            cells = cell_index(prompt.pixel_values, prompt.grid_thw, visual.grids)
            ends[1] = masked_objectives(model, prompt, cells, torch.zeros(1, int(cells.max()) + 1), 1)[0]
        if method == "integrated":
            scores, window = integrated_scores(model, prompt, visual, steps, batch_size), visual.window
        else:
            scores = pixel_scores(model, prompt, visual.grids, method, samples, batch_size, seed, sizes=windows)
            window = 1
    finally:
        model.train(was_training)
    maps = token_maps(scores, visual.grids.cpu(), window, rule=rule, images=images,
                      image_processor=image_processor if image_processor is not None or images is None
                      else _processor_of(model))
    return [dataclasses.replace(m, objective=float(ends[0]), baseline_objective=float(ends[1]), method=method,
                                steps=steps if method == "integrated" else 0,
                                samples=samples if method == "rise" else 0,
                                windows=tuple(windows) if method == "occlusion" else ()) for m in maps]


@dataclass(frozen=True)
class _Prompt:
    """One prompt with its answer appended: `ids` (1, L + T), `answer` (T,), the image inputs on the device."""

    ids: torch.Tensor
    answer: torch.Tensor
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor | None
    counts: torch.Tensor | None

    @classmethod
    def of(cls, model: Any, inputs: dict[str, Any], answer_ids: Any) -> _Prompt:
        input_ids = inputs["input_ids"]
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"evidence() explains one prompt: input_ids must be (1, L), got "
                             f"{tuple(input_ids.shape)}")
        if inputs.get("pixel_values") is None:
            raise ValueError("the prompt has no images (pixel_values is None): there is nothing to map")
        device = next(model.parameters()).device
        valid = as_bool_mask(inputs.get("attention_mask"), input_ids)[0].to(device)
        answer = torch.as_tensor(answer_ids, device=device).flatten().long()
        if not answer.numel():
            raise ValueError("answer_ids is empty: give at least one answer token (e.g. the end token)")
        grid_thw, counts = inputs.get("image_grid_thw"), inputs.get("images_per_sample")
        return cls(torch.cat([input_ids[0].to(device)[valid], answer])[None], answer,
                   inputs["pixel_values"].to(device), None if grid_thw is None else grid_thw.to(device),
                   None if counts is None else counts.to(device))

    def visual(self, model: Any, pixel_values: torch.Tensor | None = None, copies: int = 1) -> Any:
        """The visual tokens of `copies` copies of the prompt (their pixels: `pixel_values`, default the prompt's),
        through the model's one input path with the image-token contract checked; no graph."""
        with torch.no_grad():
            rows = self.ids.expand(copies, -1)
            return model.prepare(rows, torch.ones_like(rows, dtype=torch.bool),
                                 self.pixel_values if pixel_values is None else pixel_values,
                                 None if self.grid_thw is None else self.grid_thw.repeat(copies, 1),
                                 images_per_sample=None if self.counts is None else self.counts.repeat(copies)).visual


def integrated_scores(model: Any, prompt: _Prompt, visual: Any, steps: int, batch_size: int) -> torch.Tensor:
    """(N,) integrated gradients x input of every visual token (stored order), summed over D and DeepStack levels."""
    # A visual token's input is its main features and, with DeepStack, its levels: (1 + levels, N, D), all scaled
    features = torch.stack([visual.features, *visual.levels]).detach()
    device = features.device
    alphas, weights = path_points(steps)
    gradient = torch.zeros(features.shape, dtype=torch.float32, device=device)
    for chunk, chunk_weights in zip(alphas.split(batch_size), weights.split(batch_size), strict=True):
        scaled = (chunk.to(device, torch.float32).view(-1, 1, 1, 1) * features.float()).to(features.dtype)
        scaled.requires_grad_(True)
        with torch.enable_grad():
            values = answer_log_probs(model, prompt.ids, prompt.answer, visual, scaled)
            (grad,) = torch.autograd.grad(values.sum(), scaled)
        gradient += (chunk_weights.to(device, torch.float32).view(-1, 1, 1, 1) * grad.float()).sum(0)
    return (gradient * features.float()).sum((0, -1)).cpu()


# ---- perturbation: masks of token cells on the pixels, before the encoder --------------------------------------
def cell_index(pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, grids: torch.Tensor) -> torch.Tensor:
    """The LLM token cell of every element of `pixel_values`, broadcastable against it: cells are numbered
    image by image, row-major over each image's (t, h, w) LLM-side grid (`grids`, after the projector's merge).

    Fixed-size encoders: pixel_values (I, C, S, S) -> (I, 1, S, S), pixel (y, x) in cell (y * h // S, x * w // S).
    Dynamic resolution (Qwen): pixel_values (P, C * T' * p * p), one row per patch in merge-window order over the
    patch grid `grid_thw` -> (P, 1), a patch in the cell of its merge window (the merge read off the two grids).
    """
    grids = grids.to(pixel_values.device)
    sizes = grids.prod(-1)
    offsets = torch.cumsum(sizes, 0) - sizes
    if grid_thw is None:
        height, width = pixel_values.shape[-2:]
        h, w = grids[:, 1].view(-1, 1, 1, 1), grids[:, 2].view(-1, 1, 1, 1)
        rows = torch.arange(height, device=grids.device).view(1, 1, -1, 1) * h // height
        cols = torch.arange(width, device=grids.device).view(1, 1, 1, -1) * w // width
        return offsets.view(-1, 1, 1, 1) + rows * w + cols
    merge = int(grid_thw[0, 1] // grids[0, 1])
    image, (frame, row, col) = grid_coords(grid_thw, merge)
    h, w = grids[image, 1], grids[image, 2]
    return (offsets[image] + frame * h * w + row // merge * w + col // merge)[:, None]


def masked_objectives(model: Any, prompt: _Prompt, cells: torch.Tensor, keeps: torch.Tensor,
                      batch_size: int) -> torch.Tensor:
    """(K,) sum of the answer's log-probabilities with the cells where `keeps` (K, cells) is 0 set to 0 in the
    normalised pixels (the processor's mean colour), `batch_size` masked copies of the prompt per forward."""
    values = []
    for chunk in keeps.split(batch_size):
        k = len(chunk)
        pixels = torch.cat([prompt.pixel_values * keep.to(prompt.pixel_values)[cells] for keep in chunk])
        visual = prompt.visual(model, pixels, copies=k)
        with torch.no_grad():
            values.append(answer_log_probs(model, prompt.ids, prompt.answer, visual, None, copies=k))
    return torch.cat(values).cpu().double()


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


def pixel_scores(model: Any, prompt: _Prompt, grids: torch.Tensor, method: str, samples: int, batch_size: int,
                 seed: int, coarse: int = MASK_CELLS, sizes: Sequence[int] = OCCLUSION_SIZES) -> torch.Tensor:
    """(cells,) score of each token cell (row-major per image) by perturbing the pixels, in units of the answer's
    per-token probability f = exp(F / T): "occlusion", f(image) - f(image without the cell's block), a block
    being one cell when the grid has at most `coarse` cells a side (else `occlusion_blocks`); "rise",
    E[f | cell kept] - E[f | cell masked] over `samples` random masks."""
    cells = cell_index(prompt.pixel_values, prompt.grid_thw, grids)
    if method == "occlusion":
        blocks = occlusion_blocks(grids, coarse, sizes)
        keeps = torch.cat([torch.ones(1, blocks.shape[1], dtype=torch.float64), 1.0 - blocks])
    else:
        keeps = random_masks(grids, samples, torch.Generator().manual_seed(seed), coarse=coarse)
    f = (masked_objectives(model, prompt, cells, keeps, batch_size) / prompt.answer.numel()).exp()
    if method == "occlusion":  # a block's drop shared by its cells
        return ((f[0] - f[1:])[:, None] * blocks / blocks.sum(1, keepdim=True)).sum(0)
    kept, masked = keeps.sum(0), (1.0 - keeps).sum(0)
    with_cell = (keeps * f[:, None]).sum(0) / kept.clamp(min=1)
    without = ((1.0 - keeps) * f[:, None]).sum(0) / masked.clamp(min=1)
    return torch.where((kept > 0) & (masked > 0), with_cell - without, torch.zeros_like(with_cell))


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


def answer_log_probs(model: Any, ids: torch.Tensor, answer: torch.Tensor, visual: Any,
                     features: torch.Tensor | None, copies: int | None = None) -> torch.Tensor:
    """(K,) sum of the answer's log-probabilities for K versions (K, 1 + levels, N, D) of the visual tokens of prompt
    `ids` (1, L) - the main features, then each DeepStack level -, the answer being its last T tokens; the model's
    own injection and positions (1-D or M-RoPE). `features` None: `visual` already holds the tokens of `copies`
    copies of the prompt."""
    k = copies if features is None else features.shape[0]
    rows = ids.expand(k, -1)
    tokens = visual
    if features is not None:
        width = features.shape[-1]
        tokens = dataclasses.replace(
            visual, features=features[:, 0].reshape(-1, width), grids=visual.grids.repeat(k, 1),
            levels=tuple(features[:, i].reshape(-1, width) for i in range(1, features.shape[1])))
    inputs = model.prepare(rows, torch.ones_like(rows, dtype=torch.bool), visual=tokens, check=False)
    out = model.backbone(**inputs.backbone_kwargs(), use_cache=False,
                         logits_to_keep=answer.numel() + 1)  # the positions that predict the answer, and the last
    logits = out.logits[:, -answer.numel() - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, answer.expand(k, -1)[..., None]).squeeze(-1).sum(-1)


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


def _size_of(image: Any) -> tuple[int, int]:
    """(width, height) of a PIL image, a path or a (width, height) pair."""
    if isinstance(image, (str, os.PathLike)):
        from PIL import Image, ImageOps

        with Image.open(image) as opened:  # EXIF rotation, as `load_image` applies it
            return ImageOps.exif_transpose(opened).size
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


# ---- faithfulness: deletion and insertion (RISE's metric) ----------------------------------------------------
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
    prompt = _Prompt.of(model, inputs, answer_ids)
    was_training = model.training
    model.eval()
    try:
        grids = prompt.visual(model).grids
        if len(maps) != len(grids):
            raise ValueError(f"{len(maps)} maps for a prompt with {len(grids)} images: pass evidence()'s result")
        cells = cell_index(prompt.pixel_values, prompt.grid_thw, grids)
        generator = torch.Generator().manual_seed(seed)
        weights = torch.cat([torch.as_tensor(np.broadcast_to(m.tokens, m.scores.shape) * m.image_share
                                             / m.scores.shape[0], dtype=torch.float64).flatten() for m in maps])
        total = len(weights)
        counts = sorted({round(j * total / steps) for j in range(steps + 1)})
        ranked = [_order(weights, generator)] + [torch.randperm(total, generator=generator) for _ in range(orders)]
        keeps = [torch.ones(total), torch.zeros(total)]
        for order in ranked:
            for n in counts[1:-1]:
                first = torch.zeros(total)
                first[order[:n]] = 1.0
                keeps += [1.0 - first, first]  # deletion: the first n removed; insertion: only the first n shown
        f = masked_objectives(model, prompt, cells, torch.stack(keeps).double(), batch_size).exp()
    finally:
        model.train(was_training)
    full, blank, inner = float(f[0]), float(f[1]), f[2:].view(len(ranked), len(counts) - 2, 2)
    x = torch.tensor(counts, dtype=torch.float64) / total

    def area(curve: torch.Tensor, start: float, end: float) -> float:
        return float(torch.trapezoid(torch.cat([torch.tensor([start]), curve, torch.tensor([end])]) / full, x))

    deletion = [area(inner[r, :, 0], full, blank) for r in range(len(ranked))]
    insertion = [area(inner[r, :, 1], blank, full) for r in range(len(ranked))]
    return Faithfulness(deletion[0], insertion[0], tuple(deletion[1:]), tuple(insertion[1:]), full, blank, steps)


def _order(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Indices by decreasing weight, ties (e.g. the zeros of the positive part) in a random order."""
    shuffled = torch.randperm(len(weights), generator=generator)
    return shuffled[torch.argsort(weights[shuffled], descending=True, stable=True)]


# ---- pictures --------------------------------------------------------------------------------------------------
def render(image: Any, heat: EvidenceMap | np.ndarray, path: str | os.PathLike, *, prompt: str | None = None,
           answer: str | None = None, alpha: float = 0.7, cmap: str = "inferno") -> Path:
    """Save the original `image` (PIL, path or array) with `heat` overlaid as a PNG at `path`; returns the path.

    `heat` is an `EvidenceMap` with pixels, or a 2-D array over the image (any resolution: it is stretched over
    the whole image). Two panels: the image as it is, and the map over the image in dimmed grey. The colour bar
    shows evidence density, 1 = uniform over what the model saw; an area the model did not see (outside a centre
    crop) is hatched; a map that carries its `faithfulness` says it under the shares.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        from mmadapt.data.images import load_image

        image = load_image(image)
    picture = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)
    height, width = picture.shape[:2]
    seen, quadrants, method, measured = (0.0, 0.0, float(width), float(height)), None, None, None
    if isinstance(heat, EvidenceMap):
        if heat.pixels is None:
            raise ValueError("this map has no pixels: pass the original images to evidence(..., images=...)")
        seen, quadrants, method, measured = heat.geometry.seen_box(), heat.quadrants(), heat.method, heat.faithfulness
        heat = heat.pixels
    heat = np.asarray(heat, dtype=np.float64)
    if heat.ndim != 2:
        raise ValueError(f"heat must be 2-D, got shape {heat.shape}")
    quadrants = quadrants or quadrant_shares(heat)
    seen_fraction = max((seen[2] - seen[0]) * (seen[3] - seen[1]) / (width * height), 1e-12)
    total = heat.sum()
    density = heat / total * heat.size * seen_fraction if total > 0 else heat  # 1 = uniform over the seen area

    aspect = min(max(height / width, 0.35), 2.5)
    fig, (left, ax) = plt.subplots(1, 2, figsize=(10.0, 4.6 * aspect + 1.2),
                                   gridspec_kw={"width_ratios": [1.0, 1.12]})
    left.imshow(picture, extent=(0, width, height, 0), interpolation="nearest")
    left.set_title("image", fontsize=10)
    grey = picture[..., :3].mean(-1) if picture.ndim == 3 else picture
    ax.imshow(grey, extent=(0, width, height, 0), interpolation="nearest", cmap="gray", vmin=0, vmax=2 * 255)
    top = max(float(density.max()), 1.0)
    opacity = alpha * (0.25 + 0.75 * np.clip(density / top, 0.0, 1.0))  # the image shows through where no evidence
    overlay = ax.imshow(density, extent=(0, width, height, 0), cmap=cmap, alpha=opacity, interpolation="nearest",
                        vmin=0.0, vmax=top)
    if seen != (0.0, 0.0, float(width), float(height)):
        ax.add_patch(Rectangle((seen[0], seen[1]), seen[2] - seen[0], seen[3] - seen[1], fill=False,
                               edgecolor="white", linestyle="--", linewidth=1.5))
        outside = np.ones((height, width), dtype=bool)
        outside[math.floor(seen[1]) : math.ceil(seen[3]), math.floor(seen[0]) : math.ceil(seen[2])] = False
        ax.contourf(np.arange(width) + 0.5, np.arange(height) + 0.5, outside, levels=[0.5, 1.5], colors="none",
                    hatches=["//"])
    bar = fig.colorbar(overlay, ax=ax, fraction=0.046, pad=0.04)
    bar.set_label("evidence density (1 = uniform over what the model saw)", fontsize=8)
    ax.set_title("evidence" + (f" ({method})" if method else ""), fontsize=10)
    title = " -> ".join(repr(_short(t)) for t in (prompt, answer) if t is not None)
    if title:
        fig.suptitle(title, fontsize=11)
    ax.set_xlabel("quadrant shares: " + ", ".join(f"{k.replace('_', '-')} {v:.0%}" for k, v in quadrants.items())
                  + ("" if measured is None else f"\nfaithfulness {measured.score:+.2f}, beats {measured.wins} of "
                     f"{measured.orders} random orders" + ("" if measured.trusted else
                                                           " (do not trust it)" if measured.decisive else
                                                           " (the answer barely depends on the pixels)")),
                  fontsize=8)
    for axis in (left, ax):
        axis.set_xticks([])
        axis.set_yticks([])
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
    return path


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(text.replace("<image>", "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- one call: answer + evidence ------------------------------------------------------------------------------
def explain(model: Any, processor: Any, image: Any, prompt: str, *, max_new_tokens: int = 32,
            out: str | os.PathLike | None = None, rule: str = "positive", method: str = DEFAULT_METHOD,
            steps: int = DEFAULT_STEPS, samples: int = DEFAULT_SAMPLES, windows: Sequence[int] = OCCLUSION_SIZES,
            curve_steps: int = CURVE_STEPS, batch_size: int = 16, seed: int = 0) -> dict[str, Any]:
    """Answer `prompt` about `image` greedily, map the answer's evidence onto the image and measure the map.

    `processor`: `mmadapt.Processor` of the model; `image`: a PIL image or a path (loaded like training data:
    EXIF rotation, RGB); `prompt`: one user turn, `<image>` where the image goes (default: before the text).
    `method`, `steps`, `samples`, `batch_size`, `seed`: see `evidence`; `curve_steps`: points on the deletion
    and insertion curves (`faithfulness`; 0 skips the measurement). Cost in forwards of the whole model, default
    settings: occlusion 1 + windows (25 on a 4 x 4 grid, at most 114 an image), rise 129, integrated 32
    forwards + backwards; faithfulness 128.
    Returns {"answer", "answer_ids", "map" (`EvidenceMap`), "quadrants", "peak", "peak_box", "outside",
    "completeness" (see `completeness`), "image_effect", "rests_on_image" (see `EvidenceMap`), "faithfulness"
    (`Faithfulness.score`, None when not measured), "deletion_insertion" (the `Faithfulness`, or None),
    "png" (the rendered file when `out` is given, else None)}. An empty answer (the end token first) is
    explained through that end token.
    """
    if curve_steps < 0 or curve_steps == 1:
        raise ValueError(f"curve_steps {curve_steps}: give at least 2 points on the deletion / insertion curves "
                         "(--curve-steps), or 0 to skip the faithfulness measurement")
    picture = processor.image(image)
    text = prompt if "<image>" in prompt else f"<image>\n{prompt}"
    inputs = processor(text, images=[picture])
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    ends = processor.eos_token_ids
    was_training = model.training
    model.eval()
    try:
        generated = model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=ends,
                                   pad_token_id=processor.encoder.pad_token_id)[0].cpu()
    finally:
        model.train(was_training)
    stop = next((k for k, token in enumerate(generated.tolist()) if token in ends), len(generated))
    answer_ids = generated[:stop]
    answer = processor.decode(answer_ids)
    target = answer_ids if stop else generated[:1]
    (heat,) = evidence(model, inputs, target, images=[picture], image_processor=processor.encoder.processor,
                       rule=rule, method=method, steps=steps, samples=samples, windows=windows, batch_size=batch_size,
                       seed=seed)
    if curve_steps:
        heat = dataclasses.replace(heat, faithfulness=faithfulness(model, inputs, target, [heat], steps=curve_steps,
                                                                   batch_size=batch_size, seed=seed))
    png = None if out is None else render(picture, heat, out, prompt=prompt, answer=answer)
    return {"answer": answer, "answer_ids": answer_ids.tolist(), "map": heat, "quadrants": heat.quadrants(),
            "peak": heat.peak(), "peak_box": heat.cell_box(*heat.peak()), "outside": heat.outside,
            "completeness": completeness([heat]), "image_effect": heat.image_effect,
            "rests_on_image": heat.rests_on_image,
            "faithfulness": None if heat.faithfulness is None else heat.faithfulness.score,
            "deletion_insertion": heat.faithfulness, "png": None if png is None else str(png)}


def completeness(maps: Sequence[EvidenceMap]) -> float | None:
    """Sum of the scores of all the prompt's maps / (log p(answer) - log p(answer | empty visual tokens)); about 1
    when the path integral is resolved (raise `steps` otherwise). None for plain gradient x input (steps 1)
    and for the perturbation methods."""
    first = maps[0]
    if first.method != "integrated" or first.steps == 1 or first.baseline_objective is None:
        return None
    delta = first.objective - first.baseline_objective
    total = float(sum(m.scores.sum() for m in maps))
    return total / delta if delta else (1.0 if abs(total) < 1e-9 else math.inf)
