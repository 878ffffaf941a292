"""Evidence maps: which parts of the image an answer rests on (`mmadapt explain`).

    result = explain(model, processor, "cat.png", "What animal is this?", out="cat.evidence.png")
    result["answer"], result["quadrants"], result["map"].pixels      # (H, W) over the original image

Contract
- `evidence(model, inputs, answer_ids)` takes the keyword inputs of ONE prompt (`Processor` output, batch of
  one, padding allowed) and the answer's token ids. The answer is appended to the prompt (teacher forcing) and
  the objective is F = sum_t log p(answer_t | prompt, answer_<t). Every visual token n gets a score from its
  feature x_n (D,), the projector output that `contract.scatter` writes into the LLM's input embeddings:
      score_n = sum_D x_n * sum_k w_k dF/dx_n (alpha_k * x)      (all visual tokens scaled together)
  `steps=1` is alpha = 1: plain gradient x input, one forward + backward. `steps=K` (default 32) is integrated
  gradients from the empty (all-zero) visual tokens, K log-spaced points (`path_points`), evaluated in batches
  of `batch_size` copies of the prompt; then the scores of all images sum to F(x) - F(0) (`completeness`,
  about 1; raise `steps` when it is not). Only the visual tokens get gradients (`torch.autograd.grad`), the
  model runs in eval mode and is put back; the encoder runs once, without a graph. The injection, positions
  (1-D or M-RoPE) and masks are the model's own (its one input path, `prepare`): the scores equal gradient x
  input through `model.forward`, and the image-token contract is checked as in `forward`.
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

Why attribute at the injected visual tokens, by gradients
- The attribution point is the one interface every combination shares (`VisualTokens.features` -> `scatter`),
  so CLIP, SigLIP, timm and the Qwen ViT + merger are handled by the same code and no encoder internals are
  needed; the scatter is a linear copy, so the gradient w.r.t. a feature IS the gradient w.r.t. that LLM input
  position (exact, nothing approximated through the encoder). Gradients cost one batched backward for all
  tokens at once.
- Attention rollout needs every layer's attention matrix (Gated DeltaNet's linear attention in Qwen3.5 has
  none, fused SDPA kernels do not return them), assumes attention mixes linearly, ignores the MLPs and is the
  same for every answer. Occlusion is model-agnostic but costs one forward per token (or region), and its
  answer depends on the fill value. Pixel-level gradients (x the normalised pixels, plain or integrated from
  the mean colour) were tried as well: they put most of the mass on the noise regions (top-left 0.15-0.18).
- Why the path (the default) and not only the end point: measured on the quadrant task of
  tests/test_evidence.py (clip + mlp2x_gelu + llama, the answer determined by the top-left quadrant, 24
  held-out images, 100% answered right), mean share of the evidence on the top-left quadrant (uniform: 0.25):
  over all answers, plain gradient x input 0.39 (positive) / 0.51 (absolute), integrated 0.93 / 0.88 (8 to 64
  steps alike; over seeds 0 / 1 / 2: 0.93 / 0.86 / 0.84); over the answers that rest on the image (below),
  plain 0.22, integrated 0.97. The end-point gradient is a poor witness because a pre-norm LLM is
  scale-invariant in each token through its first RMSNorm (d/d alpha of RMSNorm(alpha * x) is about 0 at alpha = 1),
  so gradient x input sees only the residual path; the path from the empty token crosses the point where the
  token's direction appears (alpha ~ sqrt(eps / mean(x^2)), hence the log spacing) and is complete.
- Known limits, measured the same way, both properties of the model that the map reports faithfully:
  (1) An answer the model gives without looking (its default: log p(answer | empty visual tokens) about as high
  as with the image) has no evidence; `image_effect` (F(x) - F(0), in nats) says so and `rests_on_image` is
  False below `MIN_EFFECT` (the CLI prints it): such a map is noise, not evidence. (2) An encoder with global
  attention, once trained, can copy the answer's information into every token, and the map then spreads over
  the copies (qwen3_5_vit + qwen_merger + llama, 64 px -> 4 x 4 tokens: top-left 0.86 / 0.96 / 0.91 with a
  frozen ViT, 0.42 / 0.80 / 0.88 with a trained one; with the qwen3_5 backbone and a trained ViT, zeroing the
  corner's tokens or all the others leaves log p(answer) unchanged, and the share is 0.45 / 0.64 for seeds 0 / 1
  where first measured, 0.21-0.46 for seed 0 across machines and thread counts).
  The token map shows where the LLM reads the evidence, which is not always where the pixels were.

Why the positive part (default)
- With the empty-token baseline the sign has a meaning: a positive score is a token whose presence raises the
  answer's log-probability, a negative one argues against the answer (e.g. a blue region when the answer is
  "red"). "What does the answer rest on" is the first; |score| paints counter-evidence as support and adds the
  noise of distractor regions of both signs (measured above: 0.93 positive vs 0.88 absolute). "absolute" is
  there for "what influences the answer at all".

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
DEFAULT_STEPS: Final[int] = 32
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
    `baseline_objective`, the same with every visual token empty (zero); their difference `image_effect`, in
    nats, is what the images do for the answer; with `steps` > 1 the scores of all maps sum to about it
    (completeness of integrated gradients). An answer the model gives as readily without its images
    (`rests_on_image` False: the image effect is below `MIN_EFFECT`) has no evidence to map: its map shows noise.
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

    @property
    def image_effect(self) -> float | None:
        """log p(answer) - log p(answer | empty visual tokens), in nats (None when not computed)."""
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
        out: dict[str, Any] = {"image_index": self.image, "rule": self.rule, "steps": self.steps, "mass": self.mass,
                               "objective": self.objective, "baseline_objective": self.baseline_objective,
                               "image_effect": self.image_effect, "rests_on_image": self.rests_on_image,
                               "image_share": self.image_share, "grid": list(self.grid), "peak": list(self.peak()),
                               "quadrants": self.quadrants(), "tokens": self.tokens.round(4).tolist()}
        if self.geometry is not None:
            out |= {"peak_box": [round(v, 2) for v in self.cell_box(*self.peak())],
                    "seen_box": [round(v, 2) for v in self.geometry.seen_box()], "outside": self.outside,
                    "original_size": list(self.geometry.original), "processed_size": list(self.geometry.processed)}
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
             image_processor: Any = None, rule: str = "positive", steps: int = DEFAULT_STEPS,
             batch_size: int = 16) -> list[EvidenceMap]:
    """Evidence of each visual token for `answer_ids`, one `EvidenceMap` per image of the prompt.

    `inputs`: one prompt's keyword inputs (`Processor` output, batch of one, padding allowed); `answer_ids`
    (T,) the answer's token ids (without what follows its end). `steps`: points on the path from the empty
    (zero) token to the features (1 = plain gradient x input, one forward + backward; see the module
    docstring), evaluated `batch_size` copies of the prompt per forward. `images`: the original images (PIL
    images, paths or (width, height) sizes), one per image of the prompt, to map the evidence onto their
    pixels through `image_processor` (default `processor_for(model)`; pass the processor that made `inputs`).
    """
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known: {list(RULES)}")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps ({steps}) and batch_size ({batch_size}) must be >= 1")
    input_ids = inputs["input_ids"]
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"evidence() explains one prompt: input_ids must be (1, L), got {tuple(input_ids.shape)}")
    if inputs.get("pixel_values") is None:
        raise ValueError("the prompt has no images (pixel_values is None): there is nothing to map")
    device = next(model.parameters()).device
    valid = as_bool_mask(inputs.get("attention_mask"), input_ids)[0].to(device)
    prompt = input_ids[0].to(device)[valid]
    answer = torch.as_tensor(answer_ids, device=device).flatten().long()
    if not answer.numel():
        raise ValueError("answer_ids is empty: give at least one answer token (e.g. the end token)")
    ids = torch.cat([prompt, answer])[None]
    grid_thw, counts = inputs.get("image_grid_thw"), inputs.get("images_per_sample")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():  # the encoder's activations are not needed: only the visual tokens get gradients
            visual = model.prepare(ids, torch.ones_like(ids, dtype=torch.bool), inputs["pixel_values"].to(device),
                                   None if grid_thw is None else grid_thw.to(device),
                                   images_per_sample=None if counts is None else counts.to(device)).visual
        # A visual token's input is its main features and, with DeepStack, its levels: (1 + levels, N, D), all scaled
        features = torch.stack([visual.features, *visual.levels]).detach()
        alphas, weights = path_points(steps)
        gradient = torch.zeros(features.shape, dtype=torch.float32, device=device)
        for chunk, chunk_weights in zip(alphas.split(batch_size), weights.split(batch_size), strict=True):
            scaled = (chunk.to(device, torch.float32).view(-1, 1, 1, 1) * features.float()).to(features.dtype)
            scaled.requires_grad_(True)
            with torch.enable_grad():
                values = answer_log_probs(model, ids, answer, visual, scaled)
                (grad,) = torch.autograd.grad(values.sum(), scaled)
            gradient += (chunk_weights.to(device, torch.float32).view(-1, 1, 1, 1) * grad.float()).sum(0)
        with torch.no_grad():  # the two ends of the path: with the features, and with every visual token empty
            ends = answer_log_probs(model, ids, answer, visual, torch.stack([features, torch.zeros_like(features)]))
        objective, baseline = float(ends[0]), float(ends[1])
    finally:
        model.train(was_training)
    scores = (gradient * features.float()).sum((0, -1)).cpu()
    maps = token_maps(scores, visual.grids.cpu(), visual.window, rule=rule, images=images,
                      image_processor=image_processor if image_processor is not None or images is None
                      else _processor_of(model))
    return [dataclasses.replace(m, objective=objective, baseline_objective=baseline, steps=steps) for m in maps]


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
                     features: torch.Tensor) -> torch.Tensor:
    """(K,) sum of the answer's log-probabilities for K versions (K, 1 + levels, N, D) of the visual tokens of prompt
    `ids` (1, L) - the main features, then each DeepStack level -, the answer being its last T tokens; the model's
    own injection and positions (1-D or M-RoPE)."""
    k, width = features.shape[0], features.shape[-1]
    rows = ids.expand(k, -1)
    tokens = dataclasses.replace(visual, features=features[:, 0].reshape(-1, width), grids=visual.grids.repeat(k, 1),
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


# ---- pictures --------------------------------------------------------------------------------------------------
def render(image: Any, heat: EvidenceMap | np.ndarray, path: str | os.PathLike, *, prompt: str | None = None,
           answer: str | None = None, alpha: float = 0.7, cmap: str = "inferno") -> Path:
    """Save the original `image` (PIL, path or array) with `heat` overlaid as a PNG at `path`; returns the path.

    `heat` is an `EvidenceMap` with pixels, or a 2-D array over the image (any resolution: it is stretched over
    the whole image). The colour bar shows evidence density, 1 = uniform over what the model saw; an area the
    model did not see (outside a centre crop) is hatched.
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
    seen, quadrants = (0.0, 0.0, float(width), float(height)), None
    if isinstance(heat, EvidenceMap):
        if heat.pixels is None:
            raise ValueError("this map has no pixels: pass the original images to evidence(..., images=...)")
        seen, quadrants, heat = heat.geometry.seen_box(), heat.quadrants(), heat.pixels
    heat = np.asarray(heat, dtype=np.float64)
    if heat.ndim != 2:
        raise ValueError(f"heat must be 2-D, got shape {heat.shape}")
    quadrants = quadrants or quadrant_shares(heat)
    seen_fraction = max((seen[2] - seen[0]) * (seen[3] - seen[1]) / (width * height), 1e-12)
    total = heat.sum()
    density = heat / total * heat.size * seen_fraction if total > 0 else heat  # 1 = uniform over the seen area

    fig, ax = plt.subplots(figsize=(6.4, 6.4 * min(max(height / width, 0.35), 2.5) + 1.0))
    ax.imshow(picture, extent=(0, width, height, 0), interpolation="nearest")
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
    bar.set_label("evidence density (1 = uniform over what the model saw)")
    title = " -> ".join(repr(_short(t)) for t in (prompt, answer) if t is not None) or "evidence map"
    ax.set_title(title, fontsize=10, wrap=True)
    ax.set_xlabel("quadrant shares: " + ", ".join(f"{k.replace('_', '-')} {v:.0%}" for k, v in quadrants.items()),
                  fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
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
            out: str | os.PathLike | None = None, rule: str = "positive", steps: int = DEFAULT_STEPS) -> dict[str, Any]:
    """Answer `prompt` about `image` greedily and map the answer's evidence onto the image.

    `processor`: `mmadapt.Processor` of the model; `image`: a PIL image or a path (loaded like training data:
    EXIF rotation, RGB); `prompt`: one user turn, `<image>` where the image goes (default: before the text).
    Returns {"answer", "answer_ids", "map" (`EvidenceMap`), "quadrants", "peak", "peak_box", "outside",
    "completeness" (see `completeness`), "image_effect", "rests_on_image" (see `EvidenceMap`), "png" (the
    rendered file when `out` is given, else None)}. An empty
    answer (the end token first) is explained through that end token.
    """
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
                       rule=rule, steps=steps)
    png = None if out is None else render(picture, heat, out, prompt=prompt, answer=answer)
    return {"answer": answer, "answer_ids": answer_ids.tolist(), "map": heat, "quadrants": heat.quadrants(),
            "peak": heat.peak(), "peak_box": heat.cell_box(*heat.peak()), "outside": heat.outside,
            "completeness": completeness([heat]), "image_effect": heat.image_effect,
            "rests_on_image": heat.rests_on_image, "png": None if png is None else str(png)}


def completeness(maps: Sequence[EvidenceMap]) -> float | None:
    """Sum of the scores of all the prompt's maps / (log p(answer) - log p(answer | empty visual tokens)); about 1
    when the path integral is resolved (raise `steps` otherwise). None for plain gradient x input (steps 1)."""
    first = maps[0]
    if first.steps == 1 or first.baseline_objective is None:
        return None
    delta = first.objective - first.baseline_objective
    total = float(sum(m.scores.sum() for m in maps))
    return total / delta if delta else (1.0 if abs(total) < 1e-9 else math.inf)
