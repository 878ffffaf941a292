"""Does the model see its images? A check on one batch, without training (seconds on a CPU).

    report = sees_images(model, batch)        # batch: the collator's (or synthetic_batch's) keyword inputs
    print(report); assert report.ok

Three measurements on the answer loss (the batch's `labels`, i.e. the assistant tokens):

1. gradients: the norm of d(loss)/d(projector parameters) and, when the encoder has trainable
   parameters, d(loss)/d(encoder parameters). A zero norm means the visual tokens never reach
   the loss (dropped, overwritten, or cut off). Frozen projector parameters are measured too
   (their `requires_grad` is switched on for the call and restored): the question is whether
   the loss *depends* on them, not whether a stage trains them.
2. blanked images: the loss with `pixel_values` zeroed. Every processor normalises pixels as
   (x - mean) / std, so 0 is an image filled with the processor's mean colour - same size,
   same grid, same token count, no content.
3. shuffled images: the loss with images moved among the images that share a patch grid
   (a cyclic shift inside each group of identical `image_grid_thw`; fixed-size encoders form one
   group), so every span keeps its token count. "not applicable" when no two images share a grid.

A model that sees its images has a non-zero projector gradient and a loss that changes when
its images are blanked or shuffled (the sign is arbitrary before training; after training both
should go up). `SeesImagesReport.ok` is that verdict.

The call runs in eval mode (no dropout, so the three losses differ only by their images) and
restores the mode; gradients come from `torch.autograd.grad`, so no `.grad` is written and
no parameter changes.

Shapes: I images; pixel_values (I, C, H, W) for fixed-size encoders or (patches, F) with
image_grid_thw (I, 3) for dynamic ones, patches = sum_i t_i * h_i * w_i.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

NOT_APPLICABLE = "not applicable: no two images share a patch grid"


@dataclass(frozen=True, kw_only=True)
class SeesImagesReport:
    """Losses with real / blanked / shuffled images and the visual path's gradient norms.

    `loss_shuffled` is None when shuffling is not applicable; `grad_encoder` is None when the
    encoder has no trainable parameters. A loss change counts when |change| > `tolerance` * max(1, loss).
    """

    loss: float
    loss_blank: float
    loss_shuffled: float | None
    grad_projector: float
    grad_encoder: float | None
    images: int
    images_shuffled: int
    tolerance: float = 1e-6

    @property
    def blank_change(self) -> float:
        return self.loss_blank - self.loss

    @property
    def shuffled_change(self) -> float | None:
        return None if self.loss_shuffled is None else self.loss_shuffled - self.loss

    def changed(self, delta: float) -> bool:
        return math.isfinite(delta) and abs(delta) > self.tolerance * max(1.0, abs(self.loss))

    @property
    def problems(self) -> list[str]:
        """Why the model does not see its images; empty when it does."""
        out = []
        if not math.isfinite(self.loss):
            out.append(f"the answer loss is not finite ({self.loss})")
        if self.images == 0:
            out.append("the batch has no images")
        if not (math.isfinite(self.grad_projector) and self.grad_projector > 0):
            out.append(f"no gradient reaches the projector from the answer loss (norm {self.grad_projector:.3g}): "
                       "the visual tokens do not reach the LLM")
        if self.grad_encoder is not None and not (math.isfinite(self.grad_encoder) and self.grad_encoder > 0):
            out.append(f"no gradient reaches the trainable encoder parameters (norm {self.grad_encoder:.3g})")
        if not self.changed(self.blank_change):
            out.append(f"blanking the images does not change the answer loss ({self.blank_change:+.3g})")
        if self.shuffled_change is not None and not self.changed(self.shuffled_change):
            out.append(f"shuffling the images does not change the answer loss ({self.shuffled_change:+.3g})")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def verdict(self) -> str:
        return "sees its images" if self.ok else "does NOT see its images: " + "; ".join(self.problems)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "blank_change": self.blank_change, "shuffled_change": self.shuffled_change,
                "ok": self.ok, "problems": self.problems}

    def __str__(self) -> str:
        encoder = "frozen (not measured)" if self.grad_encoder is None else f"{self.grad_encoder:.4g}"
        shuffled = (NOT_APPLICABLE if self.loss_shuffled is None else
                    f"{self.loss_shuffled:.4f} ({self.shuffled_change:+.4f}; {self.images_shuffled} of "
                    f"{self.images} images moved)")
        return "\n".join([
            f"answer loss, real images:     {self.loss:.4f}",
            f"answer loss, blanked images:  {self.loss_blank:.4f} ({self.blank_change:+.4f})",
            f"answer loss, shuffled images: {shuffled}",
            f"gradient norm at projector:   {self.grad_projector:.4g}",
            f"gradient norm at encoder:     {encoder}",
            f"verdict: the model {self.verdict}",
        ])


def sees_images(model: nn.Module, batch: dict[str, Any], *, tolerance: float = 1e-6) -> SeesImagesReport:
    """Check on one batch that the answer loss depends on the images (see the module docstring)."""
    labels = batch.get("labels")
    if labels is None or not bool((labels[..., 1:] != -100).any()):
        raise ValueError("sees_images needs a batch with answer labels (labels != -100 after the first token). "
                         "Fix: pass the collator's batch of samples that have an assistant turn.")
    if batch.get("pixel_values") is None:
        raise ValueError("sees_images needs a batch with images (pixel_values is missing)")
    device = next(model.parameters()).device
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    shuffled = shuffle_images(batch["pixel_values"], batch.get("image_grid_thw"))
    with eval_mode(model), projector_requires_grad(model):
        loss, grad_projector, grad_encoder = loss_and_gradients(model, batch)
        with torch.no_grad():
            loss_blank = float(model(**{**batch, "pixel_values": torch.zeros_like(batch["pixel_values"])}).loss)
            loss_shuffled = None if shuffled is None else float(model(**{**batch, "pixel_values": shuffled[0]}).loss)
    return SeesImagesReport(loss=loss, loss_blank=loss_blank, loss_shuffled=loss_shuffled,
                            grad_projector=grad_projector, grad_encoder=grad_encoder,
                            images=num_images(batch["pixel_values"], batch.get("image_grid_thw")),
                            images_shuffled=0 if shuffled is None else shuffled[1], tolerance=tolerance)


def loss_and_gradients(model: nn.Module, batch: dict[str, Any]) -> tuple[float, float, float | None]:
    """(answer loss, projector gradient norm, encoder gradient norm or None when it has nothing trainable)."""
    projector = list(model.projector.parameters())
    encoder = [p for p in model.encoder.parameters() if p.requires_grad]
    with torch.enable_grad():
        loss = model(**batch).loss
        grads = torch.autograd.grad(loss, [*projector, *encoder], allow_unused=True)
    encoder_norm = grad_norm(grads[len(projector) :]) if encoder else None
    return float(loss.detach()), grad_norm(grads[: len(projector)]), encoder_norm


def grad_norm(grads: tuple[torch.Tensor | None, ...]) -> float:
    present = [g.detach().float().norm() for g in grads if g is not None]
    return float(torch.stack(present).norm()) if present else 0.0


def num_images(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None) -> int:
    return int(image_grid_thw.shape[0]) if image_grid_thw is not None else int(pixel_values.shape[0])


def shuffle_images(pixel_values: torch.Tensor,
                   image_grid_thw: torch.Tensor | None = None) -> tuple[torch.Tensor, int] | None:
    """Pixels with each image replaced by the next image of the same grid (cyclic), and how many moved.

    Fixed-size pixels (I, C, H, W) have no `image_grid_thw`: all images share one grid. Returns None
    when no two images share a grid (nothing can move without changing a span's token count).
    """
    if image_grid_thw is None:
        count = pixel_values.shape[0]
        return (pixel_values.roll(1, dims=0), count) if count > 1 else None
    rows = image_grid_thw.prod(-1).tolist()
    chunks = list(pixel_values.split(rows))
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, grid in enumerate(image_grid_thw.tolist()):
        groups.setdefault(tuple(grid), []).append(i)
    moved = 0
    out = list(chunks)
    for members in groups.values():
        if len(members) > 1:
            for k, i in enumerate(members):
                out[i] = chunks[members[k - 1]]
            moved += len(members)
    return (torch.cat(out), moved) if moved else None


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for the block; every submodule's own mode is restored after."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


@contextmanager
def projector_requires_grad(model: nn.Module) -> Iterator[None]:
    """Projector parameters require grad for the block (so a frozen projector is measured too); flags restored."""
    flags = [(p, p.requires_grad) for p in model.projector.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(True)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
