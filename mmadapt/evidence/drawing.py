"""Pictures of evidence maps: the original image beside the map drawn over it (PNG, matplotlib's Agg backend).

Contract: `render(image, heat, path)` takes the original image and an `EvidenceMap` with pixels (or any 2-D array
over the image) and writes a two-panel PNG; the colour bar is evidence density, 1 = uniform over what the model
saw; areas the model did not see are hatched; a map that carries its faithfulness says it under the shares.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mmadapt.evidence.maps import EvidenceMap, quadrant_shares

if TYPE_CHECKING:
    from mmadapt.evidence.measure import Faithfulness


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

    picture = _picture(image)
    height, width = picture.shape[:2]
    seen, quadrants, method, measured = (0.0, 0.0, float(width), float(height)), None, None, None
    if isinstance(heat, EvidenceMap):
        if heat.pixels is None:
            raise ValueError("this map has no pixels: pass the original images to evidence(..., images=...)")
        seen, quadrants, method, measured = (heat.geometry.seen_box(), heat.quadrants(), heat.method.name,
                                             heat.faithfulness)
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
    _overlay(fig, ax, picture, density, seen, alpha, cmap)
    ax.set_title("evidence" + (f" ({method})" if method else ""), fontsize=10)
    title = " -> ".join(repr(_short(t)) for t in (prompt, answer) if t is not None)
    if title:
        fig.suptitle(title, fontsize=11)
    ax.set_xlabel(_caption(quadrants, measured), fontsize=8)
    for axis in (left, ax):
        axis.set_xticks([])
        axis.set_yticks([])
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
    return path


def _picture(image: Any) -> np.ndarray:
    """The original image as an array (a path is loaded like training data: EXIF rotation, RGB)."""
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        from mmadapt.data.images import load_image

        image = load_image(image)
    return np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)


def _overlay(fig: Any, ax: Any, picture: np.ndarray, density: np.ndarray, seen: tuple[float, ...], alpha: float,
             cmap: str) -> None:
    """The map over the image in dimmed grey, its colour bar, and the unseen area hatched."""
    from matplotlib.patches import Rectangle

    height, width = picture.shape[:2]
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


def _caption(quadrants: dict[str, float], measured: Faithfulness | None) -> str:
    """The quadrant shares and, when measured, the faithfulness and whether to trust the map."""
    shares = "quadrant shares: " + ", ".join(f"{k.replace('_', '-')} {v:.0%}" for k, v in quadrants.items())
    if measured is None:
        return shares
    note = ("" if measured.trusted else " (do not trust it)" if measured.decisive else
            " (the answer barely depends on the pixels)")
    return (f"{shares}\nfaithfulness {measured.score:+.2f}, beats {measured.wins} of {measured.orders} random "
            f"orders{note}")


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(text.replace("<image>", "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
