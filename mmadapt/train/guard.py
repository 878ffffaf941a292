"""The step's guards that are not the objective's: a run that keeps producing non-finite values stops naming where
they start, and a step in which no rank saw an image or a video leaves the vision side untouched.

`NonFiniteError` carries the tracer's report (`mmadapt.numerics.find_nonfinite`: the first module whose output or
gradient is non-finite, found by re-running the step's first micro-batch). Under torchrun every rank runs the vision
side of a text-only micro-batch (a zero-effect placeholder, so that the collectives stay paired); its exactly-zero
gradients are dropped, so AdamW applies neither momentum nor weight decay that one process would not.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmadapt.atomic import open_unlinked
from mmadapt.train import distributed as dist_utils
from mmadapt.train.batches import inputs_of, to_device


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite steps; `report` names the first module with non-finite values."""

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


def non_finite_error(model: torch.nn.Module, batch: dict[str, Any], device: torch.device, precision: Callable[[], Any],
                     head: str, write_to: Path | None) -> NonFiniteError:
    """The error that stops the run: `head` and where the tracer finds the first non-finite value when it re-runs
    `batch` (forward and backward, gradients dropped after); written to `write_to` as well (rank 0's OUT)."""
    from mmadapt.numerics import find_nonfinite

    inputs = to_device(inputs_of(batch), device)

    def forward_backward() -> None:
        with precision():
            loss = model(**inputs).loss
        loss.backward()

    report = find_nonfinite(model, forward_backward)
    model.zero_grad(set_to_none=True)
    where = str(report) if report is not None else "the tracer found no non-finite module output or gradient " \
        "when re-running the batch (the values may come from the optimizer state or the data)"
    message = f"{head}. {where}"
    if write_to is not None:
        write_to.parent.mkdir(parents=True, exist_ok=True)
        with open_unlinked(write_to, "w") as f:
            f.write(message + "\n")
    return NonFiniteError(message, report)


def drop_unseen_vision_gradients(model: Any, micro: list[dict[str, Any]], dist: Any, device: torch.device) -> None:
    """When no rank's micro-batches hold an image or a video, the vision side's gradients are dropped (`None`), as one
    process leaves them: the zero gradients of the placeholder forward that kept the ranks' collectives paired must
    not give AdamW a step (momentum, weight decay) that one process would not take."""
    if not dist.active or not hasattr(model, "encoder"):
        return
    mine = sum(b.get(key) is not None for b in micro for key in ("pixel_values", "pixel_values_videos"))
    if int(dist_utils.all_reduce_sum(torch.tensor(mine, device=device)).item()):
        return
    for part in (model.encoder, model.projector):
        for p in part.parameters():
            p.grad = None
