"""Does the model see its images and videos? A check on one batch, without training (seconds on a CPU).

    report = sees_images(model, batch)        # batch: the collator's (or synthetic_batch's) keyword inputs
    print(report); assert report.ok
    reports = sees_records(model, encoder, collate, records, batches=4, batch_size=8)   # `mmadapt sees MODEL DATA`
    print(reports); assert reports.ok          # one table row per batch, then the verdict over all of them

Measurements on the answer loss (the batch's `labels`, i.e. the assistant tokens):

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
5. time-shuffled videos: the loss with each video's temporal patches in reverse order
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

from mmadapt.data import DataProblem
from mmadapt.data.video import reverse_frames
from mmadapt.modes import eval_mode

NOT_APPLICABLE = "not applicable: no two images share a patch grid"
NO_TWO_VIDEOS = "not applicable: no two videos share a patch grid"
NO_MOTION = "not applicable: no video has two different temporal patches"


@dataclass(frozen=True, kw_only=True)
class SeesImagesReport:
    """Losses with real / blanked / shuffled images (and videos) and the visual path's gradient norms.

    `loss_blank` is None when the batch has no images (a batch of videos only); `loss_shuffled` is None when
    shuffling images is not applicable; `grad_encoder` is None when the encoder has no trainable parameters.
    Video fields (None / 0 for a batch without videos): `loss_blank_videos` (frames blanked),
    `loss_time_shuffled` (temporal patches reversed; None when no video can be reordered),
    `loss_shuffled_videos` (another sample's video; None when no two videos share a grid); `videos`,
    `videos_time_shuffled` (reordered), `videos_single_frame` (t == 1: cannot be reordered),
    `videos_shuffled` (replaced). A loss change counts when |change| > `tolerance` * max(1, loss).
    """

    loss: float
    loss_blank: float | None
    loss_shuffled: float | None
    grad_projector: float
    grad_encoder: float | None
    images: int
    images_shuffled: int
    tolerance: float = 1e-6
    loss_blank_videos: float | None = None
    loss_time_shuffled: float | None = None
    loss_shuffled_videos: float | None = None
    videos: int = 0
    videos_time_shuffled: int = 0
    videos_single_frame: int = 0
    videos_shuffled: int = 0

    def change(self, loss: float | None) -> float | None:
        """`loss` minus the real loss (None when the measurement does not apply)."""
        return None if loss is None else loss - self.loss

    @property
    def blank_change(self) -> float | None:
        return self.change(self.loss_blank)

    @property
    def shuffled_change(self) -> float | None:
        return self.change(self.loss_shuffled)

    @property
    def blank_videos_change(self) -> float | None:
        return self.change(self.loss_blank_videos)

    @property
    def time_shuffled_change(self) -> float | None:
        return self.change(self.loss_time_shuffled)

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
        checks = (("blanking the images", self.blank_change), ("shuffling the images", self.shuffled_change),
                  ("blanking the videos", self.blank_videos_change),
                  ("reversing the order of the videos' frames", self.time_shuffled_change),
                  ("shuffling the videos", self.shuffled_videos_change))
        for what, change in checks:
            if change is not None and not self.changed(change):
                out.append(f"{what} does not change the answer loss ({change:+.3g})")
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

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "blank_change": self.blank_change, "shuffled_change": self.shuffled_change,
                "blank_videos_change": self.blank_videos_change, "time_shuffled_change": self.time_shuffled_change,
                "shuffled_videos_change": self.shuffled_videos_change, "ok": self.ok, "problems": self.problems}

    def __str__(self) -> str:
        encoder = "frozen (not measured)" if self.grad_encoder is None else f"{self.grad_encoder:.4g}"
        head = f"answer loss, real {self.seen}:"
        lines = [f"{head:<29} {self.loss:.4f}"]
        if self.images:
            shuffled = (NOT_APPLICABLE if self.loss_shuffled is None else
                        f"{self.loss_shuffled:.4f} ({self.shuffled_change:+.4f}; {self.images_shuffled} of "
                        f"{self.images} images moved)")
            blank = "not measured" if self.loss_blank is None else f"{self.loss_blank:.4f} ({self.blank_change:+.4f})"
            lines += [f"answer loss, blanked images:  {blank}", f"answer loss, shuffled images: {shuffled}"]
        if self.videos:
            blank = ("not measured" if self.loss_blank_videos is None else
                     f"{self.loss_blank_videos:.4f} ({self.blank_videos_change:+.4f})")
            single = f", {self.videos_single_frame} with one temporal patch" if self.videos_single_frame else ""
            reordered = (f"{NO_MOTION}{single}" if self.loss_time_shuffled is None else
                         f"{self.loss_time_shuffled:.4f} ({self.time_shuffled_change:+.4f}; "
                         f"{self.videos_time_shuffled} of {self.videos} videos reordered{single})")
            shuffled = (NO_TWO_VIDEOS if self.loss_shuffled_videos is None else
                        f"{self.loss_shuffled_videos:.4f} ({self.shuffled_videos_change:+.4f}; "
                        f"{self.videos_shuffled} of {self.videos} videos moved)")
            lines += [f"answer loss, blanked videos:  {blank}", f"answer loss, frames reversed: {reordered}",
                      f"answer loss, shuffled videos: {shuffled}"]
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
                            **{"loss_blank": None, "loss_shuffled": None, **images}, **videos)


# (title, SeesImagesReport field) of the table's loss columns; the video columns when a batch has videos
COLUMNS = (("loss", "loss"), ("blanked", "loss_blank"), ("shuffled", "loss_shuffled"))
VIDEO_COLUMNS = (("v blank", "loss_blank_videos"), ("reversed", "loss_time_shuffled"),
                 ("v other", "loss_shuffled_videos"))


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
        rows = [f"{'batch':>5} " + " ".join(f"{title:>8}" for title, _ in columns) + f" {'grad proj':>10}  verdict"]
        for b, report in enumerate(self.batches):
            values = [getattr(report, key) for _, key in columns]
            cells = " ".join("     n/a" if v is None else f"{v:>8.4f}" for v in values)
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
    pixels, grids = batch["pixel_values"], batch.get("image_grid_thw")
    shuffled = shuffle_images(pixels, grids)
    return {"loss_blank": float(model(**{**batch, "pixel_values": torch.zeros_like(pixels)}).loss),
            "loss_shuffled": None if shuffled is None else float(model(**{**batch, "pixel_values": shuffled[0]}).loss),
            "images": num_images(pixels, grids), "images_shuffled": 0 if shuffled is None else shuffled[1]}


@torch.no_grad()
def video_losses(model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """Report fields of the video measurements: losses with blanked, time-shuffled and shuffled videos, counts."""
    pixels, grids = batch["pixel_values_videos"], batch.get("video_grid_thw")
    if grids is None:
        raise ValueError("sees_images: the batch has pixel_values_videos but no video_grid_thw")

    def loss_with(videos: torch.Tensor) -> float:
        return float(model(**{**batch, "pixel_values_videos": videos}).loss)

    reordered, moved = reverse_frames(pixels, grids)
    shuffled = shuffle_images(pixels, grids)
    return {"loss_blank_videos": loss_with(torch.zeros_like(pixels)),
            "loss_time_shuffled": loss_with(reordered) if moved else None,
            "loss_shuffled_videos": None if shuffled is None else loss_with(shuffled[0]),
            "videos": int(grids.shape[0]), "videos_time_shuffled": moved,
            "videos_single_frame": int((grids[:, 0] == 1).sum()),
            "videos_shuffled": 0 if shuffled is None else shuffled[1]}


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
    Videos work the same way (`pixel_values_videos`, `video_grid_thw`): each video gets another's.
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
PREFERENCE_CONDITIONS = ("real", "blanked", "shuffled")


@dataclass
class PreferenceView:
    """Per condition (real / blanked / shuffled images): the mean margin over pairs and the share of pairs whose
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
        m = self.margin
        return m["real"] > m["blanked"] and (self.moved is None or m["real"] > m["shuffled"])

    def __str__(self) -> str:
        what = "reward margin / beta (policy - reference)" if self.with_reference else "log-prob margin"
        lines = [f"preference view: {self.pairs} pairs, {what} of chosen over rejected"
                 + (f" ({self.problems} bad pairs skipped)" if self.problems else ""),
                 f"{'images':<10}{'margin':>10}{'chosen wins':>13}"]
        for name in PREFERENCE_CONDITIONS:
            if name == "shuffled" and self.moved is None:
                lines.append(f"{name:<10}{'n/a':>10}{'n/a':>13}   {NOT_APPLICABLE}")
                continue
            lines.append(f"{name:<10}{self.margin[name]:>10.3f}{self.accuracy[name]:>13.1%}")
        lines.append("the preference rests on the images" if self.ok else
                     "the preference does NOT rest on the images: it holds as well without them (text alone)")
        return "\n".join(lines)


@torch.no_grad()
def preference_view(model: nn.Module, batches: Sequence[dict[str, Any]], *,
                    reference: nn.Module | None = None) -> PreferenceView:
    """The margins of `PairCollator` batches with their real images, blanked images (pixels zeroed: the processor's
    mean colour) and shuffled images (each pair gets another pair's image of the same grid, both rows)."""
    sums = {name: [0.0, 0.0] for name in PREFERENCE_CONDITIONS}
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
        shuffled = shuffle_images(pixels, grids)
        variants = {"real": pixels, "blanked": torch.zeros_like(pixels)}
        if shuffled is not None:
            variants["shuffled"], count = shuffled
            moved += count
            shuffle_possible = True
        for name, values in variants.items():
            margins = pair_margins(model, {**batch, "pixel_values": values})
            if reference is not None:
                margins = margins - pair_margins(reference, {**batch, "pixel_values": values})
            sums[name][0] += float(margins.sum())
            sums[name][1] += float((margins > 0).sum())
        pairs += n
    if not pairs:
        raise ValueError(f"no pair could be scored ({problems} bad pairs): check the file with `mmadapt data check`")
    shuffled_pairs = pairs if shuffle_possible else 1
    margin = {k: v[0] / (shuffled_pairs if k == "shuffled" else pairs) for k, v in sums.items()}
    accuracy = {k: v[1] / (shuffled_pairs if k == "shuffled" else pairs) for k, v in sums.items()}
    return PreferenceView(pairs, margin, accuracy, moved if shuffle_possible else None, reference is not None,
                          problems)


def pair_margins(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """(B,) log pi(chosen) - log pi(rejected) of a `PairCollator` batch, in eval mode."""
    inputs = {k: v for k, v in batch.items() if k not in ("pairs", "meta")}
    with eval_mode(model):
        logps = model(**inputs, sequence_logps=True).logps.float()
    chosen, rejected = logps.chunk(2)
    return chosen - rejected
