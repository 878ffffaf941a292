"""Does the model see its images and videos? A check on one batch, without training (seconds on a CPU).

    report = sees_images(model, batch)        # batch: the collator's (or synthetic_batch's) keyword inputs
    print(report); assert report.ok
    reports = sees_records(model, encoder, collate, records, batches=4, batch_size=8)   # `mmadapt sees MODEL DATA`
    print(reports); assert reports.ok          # one table row per batch, then the verdict over all of them

Measurements on the answer loss (the batch's `labels`, i.e. the assistant tokens), under the image controls of
`mmadapt.controls` (their names are the report's: `loss_blanked`, `blanked_change`, ...):

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

When the batch has videos (`pixel_values_videos`, `video_grid_thw`; dynamic encoders), three more:

4. blanked videos: the loss with `pixel_values_videos` zeroed (every frame the processor's mean colour).
5. reversed videos (frames reversed): the loss with each video's temporal patches in reverse order
   (`mmadapt.data.video.reverse_frames`: the rows of temporal patch j, the block [j*h*w, (j+1)*h*w) of the
   video's rows, move to patch t-1-j), so the
   same frames arrive in the wrong order. A video with t == 1 cannot be shuffled (counted in
   `videos_single_frame`), nor one whose temporal patches are all equal; "not applicable" when no video moves.
6. shuffled videos: the loss with each video replaced by another sample's video of the same `video_grid_thw`
   (a cyclic shift, like shuffled images). "not applicable" when no two videos share a grid.

Images and videos are changed one kind at a time (the other kind stays real). A batch may have images,
videos or both; one with neither is refused.

A model that sees its images (videos) has a non-zero projector gradient and a loss that changes when
its images (videos) are blanked or shuffled, and when the frames of its videos are put out of order (the sign
is arbitrary before training; after training all should go up). `SeesImagesReport.ok` is that verdict.

The call runs in eval mode (no dropout, so the losses differ only by their pixels) and
restores the mode; gradients come from `torch.autograd.grad`, so no `.grad` is written and
no parameter changes.

Shapes: I images; pixel_values (I, C, H, W) for fixed-size encoders or (patches, F) with
image_grid_thw (I, 3) for dynamic ones, patches = sum_i t_i * h_i * w_i. V videos: pixel_values_videos
(patches, F) with video_grid_thw (V, 3) = (t, h, w), a video's rows ordered temporal patch by temporal patch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from mmadapt.controls import BLANKED, IMAGE_CONTROLS, IMAGES, REAL, REVERSED, SHUFFLED, VIDEOS, Control, count
from mmadapt.data import DataProblem
from mmadapt.heads import SequenceLogps
from mmadapt.modes import eval_mode

NOT_APPLICABLE = "not applicable: no two images share a patch grid"
NO_TWO_VIDEOS = "not applicable: no two videos share a patch grid"
NO_MOTION = "not applicable: no video has two different temporal patches"


@dataclass(frozen=True, kw_only=True)
class SeesImagesReport:
    """Losses with real / blanked / shuffled images (and videos) and the visual path's gradient norms.

    `loss` is the answer loss with the real inputs. `loss_blanked` is None when the batch has no images (a batch of
    videos only); `loss_shuffled` is None when shuffling images is not applicable; `grad_encoder` is None when the
    encoder has no trainable parameters. Video fields (None / 0 for a batch without videos): `loss_blanked_videos`
    (frames blanked), `loss_reversed` (temporal patches reversed; None when no video can be reordered),
    `loss_shuffled_videos` (another sample's video; None when no two videos share a grid); `videos`,
    `videos_reversed` (reordered), `videos_single_frame` (t == 1: cannot be reordered),
    `videos_shuffled` (replaced). A loss change counts when |change| > `tolerance` * max(1, loss).
    """

    loss: float
    loss_blanked: float | None
    loss_shuffled: float | None
    grad_projector: float
    grad_encoder: float | None
    images: int
    images_shuffled: int
    tolerance: float = 1e-6
    loss_blanked_videos: float | None = None
    loss_reversed: float | None = None
    loss_shuffled_videos: float | None = None
    videos: int = 0
    videos_reversed: int = 0
    videos_single_frame: int = 0
    videos_shuffled: int = 0

    def change(self, loss: float | None) -> float | None:
        """`loss` minus the real loss (None when the measurement does not apply)."""
        return None if loss is None else loss - self.loss

    @property
    def blanked_change(self) -> float | None:
        return self.change(self.loss_blanked)

    @property
    def shuffled_change(self) -> float | None:
        return self.change(self.loss_shuffled)

    @property
    def blanked_videos_change(self) -> float | None:
        return self.change(self.loss_blanked_videos)

    @property
    def reversed_change(self) -> float | None:
        return self.change(self.loss_reversed)

    @property
    def shuffled_videos_change(self) -> float | None:
        return self.change(self.loss_shuffled_videos)

    def changed(self, delta: float) -> bool:
        return math.isfinite(delta) and abs(delta) > self.tolerance * max(1.0, abs(self.loss))

    @property
    def problems(self) -> list[str]:
        """Why the model does not see its images (videos); empty when it does."""
        out = []
        if not math.isfinite(self.loss):
            out.append(f"the answer loss is not finite ({self.loss})")
        if self.images == 0 and self.videos == 0:
            out.append("the batch has no images")
        if not (math.isfinite(self.grad_projector) and self.grad_projector > 0):
            out.append(f"no gradient reaches the projector from the answer loss (norm {self.grad_projector:.3g}): "
                       "the visual tokens do not reach the LLM")
        if self.grad_encoder is not None and not (math.isfinite(self.grad_encoder) and self.grad_encoder > 0):
            out.append(f"no gradient reaches the trainable encoder parameters (norm {self.grad_encoder:.3g})")
        for control, kind, change in self.changes():
            if change is not None and not self.changed(change):
                out.append(f"the answer loss does not change with {control.label(kind)} ({change:+.3g})")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def seen(self) -> str:
        """What the batch shows the model: "images", "videos" or "images and videos"."""
        if self.videos == 0:
            return "images"
        return "videos" if self.images == 0 else "images and videos"

    @property
    def verdict(self) -> str:
        return f"sees its {self.seen}" if self.ok else f"does NOT see its {self.seen}: " + "; ".join(self.problems)

    def changes(self) -> list[tuple[Control, str, float | None]]:
        """(control, "images" / "videos", loss change) of each measurement, in the table's order."""
        return [(BLANKED, "images", self.blanked_change), (SHUFFLED, "images", self.shuffled_change),
                (BLANKED, "videos", self.blanked_videos_change), (REVERSED, "videos", self.reversed_change),
                (SHUFFLED, "videos", self.shuffled_videos_change)]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "blanked_change": self.blanked_change, "shuffled_change": self.shuffled_change,
                "blanked_videos_change": self.blanked_videos_change, "reversed_change": self.reversed_change,
                "shuffled_videos_change": self.shuffled_videos_change, "ok": self.ok, "problems": self.problems}

    def __str__(self) -> str:
        encoder = "frozen (not measured)" if self.grad_encoder is None else f"{self.grad_encoder:.4g}"
        lines = [line(REAL.label(self.seen), f"{self.loss:.4f}")]
        if self.images:
            shuffled = (NOT_APPLICABLE if self.loss_shuffled is None else
                        f"{self.loss_shuffled:.4f} ({self.shuffled_change:+.4f}; {self.images_shuffled} of "
                        f"{self.images} images moved)")
            blank = ("not measured" if self.loss_blanked is None else
                     f"{self.loss_blanked:.4f} ({self.blanked_change:+.4f})")
            lines += [line(BLANKED.label("images"), blank), line(SHUFFLED.label("images"), shuffled)]
        if self.videos:
            blank = ("not measured" if self.loss_blanked_videos is None else
                     f"{self.loss_blanked_videos:.4f} ({self.blanked_videos_change:+.4f})")
            single = f", {self.videos_single_frame} with one temporal patch" if self.videos_single_frame else ""
            reordered = (f"{NO_MOTION}{single}" if self.loss_reversed is None else
                         f"{self.loss_reversed:.4f} ({self.reversed_change:+.4f}; "
                         f"{self.videos_reversed} of {self.videos} videos reordered{single})")
            shuffled = (NO_TWO_VIDEOS if self.loss_shuffled_videos is None else
                        f"{self.loss_shuffled_videos:.4f} ({self.shuffled_videos_change:+.4f}; "
                        f"{self.videos_shuffled} of {self.videos} videos moved)")
            lines += [line(BLANKED.label("videos"), blank), line(REVERSED.label("videos"), reordered),
                      line(SHUFFLED.label("videos"), shuffled)]
        return "\n".join([
            *lines,
            f"gradient norm at projector:   {self.grad_projector:.4g}",
            f"gradient norm at encoder:     {encoder}",
            f"verdict: the model {self.verdict}",
        ])


def sees_images(model: nn.Module, batch: dict[str, Any], *, tolerance: float = 1e-6) -> SeesImagesReport:
    """Check on one batch that the answer loss depends on the images and videos (see the module docstring)."""
    labels = batch.get("labels")
    if labels is None or not bool((labels[..., 1:] != -100).any()):
        raise ValueError("sees_images needs a batch with answer labels (labels != -100 after the first token). "
                         "Fix: pass the collator's batch of samples that have an assistant turn.")
    has_images, has_videos = batch.get("pixel_values") is not None, batch.get("pixel_values_videos") is not None
    if not (has_images or has_videos):
        raise ValueError("sees_images needs a batch with images or videos (pixel_values is missing, and so is "
                         "pixel_values_videos)")
    device = next(model.parameters()).device
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with eval_mode(model), projector_requires_grad(model):
        loss, grad_projector, grad_encoder = loss_and_gradients(model, batch)
        images = image_losses(model, batch) if has_images else {"images": 0, "images_shuffled": 0}
        videos = video_losses(model, batch) if has_videos else {}
    return SeesImagesReport(loss=loss, grad_projector=grad_projector, grad_encoder=grad_encoder, tolerance=tolerance,
                            **{"loss_blanked": None, "loss_shuffled": None, **images}, **videos)


def line(what: str, value: str) -> str:
    """A row of the printed report: "answer loss, blanked images:" and its value, aligned."""
    head = f"answer loss, {what}:"
    return f"{head:<29} {value}"


# (title, SeesImagesReport field) of the table's loss columns, titled by the controls' names; the video columns
# ("v " + the name) when a batch has videos
COLUMNS = (("loss", "loss"), (BLANKED.name, "loss_blanked"), (SHUFFLED.name, "loss_shuffled"))
VIDEO_COLUMNS = ((f"v {BLANKED.name}", "loss_blanked_videos"), (f"v {REVERSED.name}", "loss_reversed"),
                 (f"v {SHUFFLED.name}", "loss_shuffled_videos"))


@dataclass(frozen=True)
class SeesRecordsReport:
    """`sees_images` on consecutive batches of a data file (`sees_records`): one report per batch.

    `print(report)` gives the table of `mmadapt sees` (a row of losses, the projector's gradient norm and the
    verdict per batch; video columns when a batch has videos) and a last line saying whether the model sees.
    """

    batches: tuple[SeesImagesReport, ...]
    source: str = "the records"

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.batches)

    @property
    def videos(self) -> bool:
        return any(r.videos for r in self.batches)

    @property
    def seen(self) -> str:
        """What the batches show the model: "images", "videos" or "images and videos"."""
        if not self.videos:
            return "images"
        return "images and videos" if any(r.images for r in self.batches) else "videos"

    def lines(self) -> list[str]:
        columns = COLUMNS + VIDEO_COLUMNS if self.videos else COLUMNS
        rows = [f"{'batch':>5} " + " ".join(f"{title:>10}" for title, _ in columns) + f" {'grad proj':>10}  verdict"]
        for b, report in enumerate(self.batches):
            values = [getattr(report, key) for _, key in columns]
            cells = " ".join(f"{'n/a':>10}" if v is None else f"{v:>10.4f}" for v in values)
            rows.append(f"{b:>5} {cells} {report.grad_projector:>10.3g}  {report.verdict}")
        rows.append(f"the model {'sees' if self.ok else 'does NOT see'} its {self.seen} on {len(self.batches)} "
                    f"batch(es) of {self.source}")
        return rows

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "ok": self.ok, "batches": [r.to_dict() for r in self.batches]}


def sees_records(model: nn.Module, encoder: Any, collate: Any, records: Sequence[dict[str, Any]], *,
                 batches: int = 4, batch_size: int = 8, source: str = "the records",
                 tolerance: float = 1e-6) -> SeesRecordsReport:
    """`sees_images` on the first `batches` batches of `batch_size` records that `encoder` encodes (records with a
    non-fatal `DataProblem` are passed over); `source` names the records in the report and in errors."""
    samples = []
    for i, record in enumerate(records):
        try:
            samples.append(encoder.encode(record, i))
        except DataProblem as problem:
            if problem.fatal:
                raise
        if len(samples) == batches * batch_size:
            break
    if not samples:
        raise ValueError(f"none of the records of {source} could be encoded (see `mmadapt data check`)")
    return SeesRecordsReport(tuple(sees_images(model, collate(samples[b : b + batch_size]), tolerance=tolerance)
                                   for b in range(0, len(samples), batch_size)), source=source)


@torch.no_grad()
def image_losses(model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """Report fields of the image measurements: losses with blanked and shuffled images, image counts."""
    pixels, grids = batch[IMAGES.pixels], batch.get(IMAGES.grids)
    blanked, shuffled = BLANKED.pixels(pixels, grids), SHUFFLED.pixels(pixels, grids)
    return {"loss_blanked": loss_with(model, batch, IMAGES, blanked),
            "loss_shuffled": loss_with(model, batch, IMAGES, shuffled),
            "images": count(pixels, grids), "images_shuffled": 0 if shuffled is None else shuffled.moved}


@torch.no_grad()
def video_losses(model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """Report fields of the video measurements: losses with blanked, reversed and shuffled videos, counts."""
    pixels, grids = batch[VIDEOS.pixels], batch.get(VIDEOS.grids)
    if grids is None:
        raise ValueError("sees_images: the batch has pixel_values_videos but no video_grid_thw")
    reordered, shuffled = REVERSED.pixels(pixels, grids), SHUFFLED.pixels(pixels, grids)
    return {"loss_blanked_videos": loss_with(model, batch, VIDEOS, BLANKED.pixels(pixels, grids)),
            "loss_reversed": loss_with(model, batch, VIDEOS, reordered),
            "loss_shuffled_videos": loss_with(model, batch, VIDEOS, shuffled),
            "videos": count(pixels, grids), "videos_reversed": 0 if reordered is None else reordered.moved,
            "videos_single_frame": int((grids[:, 0] == 1).sum()),
            "videos_shuffled": 0 if shuffled is None else shuffled.moved}


def loss_with(model: nn.Module, batch: dict[str, Any], kind: Any, changed: Any) -> float | None:
    """The answer loss with `kind`'s pixels replaced by a control's (None when the control does not apply)."""
    return None if changed is None else float(model(**{**batch, kind.pixels: changed.pixels}).loss)


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


# ---- preference pairs: does the preference rest on the image? --------------------------------------------------------
@dataclass
class PreferenceView:
    """Per image control (`margin["real"]`, `["blanked"]`, `["shuffled"]`): the mean margin over pairs and the share
    of pairs whose
    chosen answer wins. The margin is log pi(chosen) - log pi(rejected) (summed answer log-probs), minus the
    reference's under the same images when a reference model is given (then it is the DPO reward margin / beta).
    `pairs`: pairs scored; `moved`: pairs whose image the shuffle replaced (None: no two pairs share a grid)."""

    pairs: int
    margin: dict[str, float]
    accuracy: dict[str, float]
    moved: int | None
    with_reference: bool
    problems: int = 0

    @property
    def ok(self) -> bool:
        """The preference rests on the image: the real margin is above the blanked one (and the shuffled one, when
        images could be shuffled)."""
        real, m = self.margin[REAL.name], self.margin
        return real > m[BLANKED.name] and (self.moved is None or real > m[SHUFFLED.name])

    def __str__(self) -> str:
        what = "reward margin / beta (policy - reference)" if self.with_reference else "log-prob margin"
        lines = [f"preference view: {self.pairs} pairs, {what} of chosen over rejected"
                 + (f" ({self.problems} bad pairs skipped)" if self.problems else ""),
                 f"{'images':<10}{'margin':>10}{'chosen wins':>13}"]
        for control in IMAGE_CONTROLS:
            name = control.name
            if name not in self.margin:
                lines.append(f"{name:<10}{'n/a':>10}{'n/a':>13}   {NOT_APPLICABLE}")
                continue
            lines.append(f"{name:<10}{self.margin[name]:>10.3f}{self.accuracy[name]:>13.1%}")
        lines.append("the preference rests on the images" if self.ok else
                     "the preference does NOT rest on the images: it holds as well without them (text alone)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """What `mmadapt eval --json` writes of it."""
        return {"preference": {"pairs": self.pairs, "margin": self.margin, "accuracy": self.accuracy,
                               "problems": self.problems, "rests_on_images": self.ok}}


@torch.no_grad()
def preference_view(model: nn.Module, batches: Sequence[dict[str, Any]], *,
                    reference: nn.Module | None = None) -> PreferenceView:
    """The margins of `PairCollator` batches with their real images, blanked images (pixels zeroed: the processor's
    mean colour) and shuffled images (each pair gets another pair's image of the same grid, both rows)."""
    sums = {control.name: [0.0, 0.0] for control in IMAGE_CONTROLS}
    pairs, moved, problems = 0, 0, 0
    shuffle_possible = False
    for batch in batches:
        problems += len(batch.get("meta", {}).get("problems", ()))
        n = int(batch.get("pairs", 0))
        if not n:
            continue
        pixels, grids = batch.get("pixel_values"), batch.get("image_grid_thw")
        if pixels is None:
            raise ValueError("the preference view needs pairs with images")
        variants = {c.name: c.pixels(pixels, grids) for c in IMAGE_CONTROLS}  # None: the control does not apply
        if variants[SHUFFLED.name] is not None:
            moved += variants[SHUFFLED.name].moved
            shuffle_possible = True
        for name, changed in variants.items():
            if changed is None:
                continue
            values = changed.pixels
            margins = pair_margins(model, {**batch, "pixel_values": values})
            if reference is not None:
                margins = margins - pair_margins(reference, {**batch, "pixel_values": values})
            sums[name][0] += float(margins.sum())
            sums[name][1] += float((margins > 0).sum())
        pairs += n
    if not pairs:
        raise ValueError(f"no pair could be scored ({problems} bad pairs): check the file with `mmadapt data check`")
    if not shuffle_possible:
        del sums[SHUFFLED.name]
    margin = {k: v[0] / pairs for k, v in sums.items()}
    accuracy = {k: v[1] / pairs for k, v in sums.items()}
    return PreferenceView(pairs, margin, accuracy, moved if shuffle_possible else None, reference is not None,
                          problems)


def pair_margins(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """(B,) log pi(chosen) - log pi(rejected) of a `PairCollator` batch, in eval mode."""
    inputs = {k: v for k, v in batch.items() if k not in ("pairs", "meta")}
    with eval_mode(model):
        logps = model(**inputs, head=SequenceLogps()).logps.float()
    chosen, rejected = logps.chunk(2)
    return chosen - rejected
