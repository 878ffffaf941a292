"""Plots of a training run's log records, kept apart from the training loop (matplotlib is imported only here).

`plot_history(history, OUT / "loss.png")` is what `Trainer.fit` writes at the end of a run; it works as well on
the records of `OUT/log.jsonl` or on `Trainer.fit()["history"]` in a notebook.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmadapt.atomic import open_unlinked


def plot_history(history: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path | None:
    """Train (and eval) loss over the steps above the gradient norm (log scale), as a PNG at `path`.

    Every record needs `step`, `loss` and `grad_norm`; records with `eval_loss` add the eval curve.
    Returns the path written, or None (nothing written) when there are no records.
    """
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, (ax_loss, ax_grad) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    ax_loss.plot(steps, [r["loss"] for r in history], label="train loss")
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    if evals:
        ax_loss.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_grad.plot(steps, [r["grad_norm"] for r in history], color="tab:orange")
    ax_grad.set_ylabel("grad norm")
    ax_grad.set_xlabel("step")
    ax_grad.set_yscale("log")
    fig.tight_layout()
    path = Path(path)
    with open_unlinked(path, "wb") as f:  # never through a link planted at its name
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return path
