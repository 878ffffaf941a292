"""Evaluation that proves a model reads its images (and videos): answers under each image control.

    report = evaluate_records(model, encoder, collate, records)    # an EvalReport
    print(report)                                                   # the table `mmadapt eval MODEL DATA` prints
    report.accuracy["real"], report.accuracy["blanked"], report.accuracy["shuffled"], report.passed
    for name in report.variants: report.accuracy[name]             # + "reversed" when there are videos
    report.to_dict()                                                # the JSON of `mmadapt eval --json`

Greedy answers to each record's question (its last assistant turn is the reference), by the one answering function
of `mmadapt chat` and the server (`mmadapt.answering.answer_prompts`, batched), are scored per
sample by normalised exact match (case, surrounding whitespace and final punctuation ignored;
`accuracy`) and by "reference contained in the answer" (`contained`), each under the image controls of
`mmadapt.controls` (their names are the report's keys): `real` images, `blanked` images (pixel_values zeroed = the
processor's mean colour: same size, grid and token count, no content) and `shuffled` images (each sample gets the
next sample's image of the same grid, so its span still fits). The verdict: real images must beat the
better of blanked / shuffled by `margin` accuracy points. `chance` is the best constant answer's
accuracy (the majority reference's share). `max_new_tokens` defaults to fit the longest reference.
The digits demo (`mmadapt demo`) reports through this same code.

Videos (prompts with `pixel_values_videos`): "real" means the real inputs, images and videos; blanking zeroes
the videos' pixels too and shuffling also moves each video to the next sample whose videos have the same grids
(images and videos move independently). When any prompt has a video a fourth control is scored,
`reversed` (`accuracy["reversed"]`, `contained["reversed"]`, and a `reversed` answer per prediction): each video's
temporal patches in reverse order (`mmadapt.data.video.reverse_frames`), the same frames in the wrong order;
prompts without a video (or with a one-patch video) are unchanged in it. The verdict then needs real inputs to beat
the best of blanked / shuffled / reversed by the margin. Reports of image-only data hold three controls
(`VARIANTS`); `report.variants` lists the ones a report holds.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmadapt.controls import CONTROLS, IMAGE_CONTROLS, REAL, REVERSED, VIDEO_CONTROLS, VIDEOS, Control

DEFAULT_MARGIN = 0.2
EVAL_BATCH = 64
VARIANTS = tuple(c.name for c in IMAGE_CONTROLS)  # real, blanked, shuffled: the report's keys
VIDEO_VARIANTS = tuple(c.name for c in VIDEO_CONTROLS)  # ... and reversed


def reference_of(record: dict[str, Any]) -> str:
    """The last assistant turn of a LLaVA (`conversations`) or messages record."""
    if "conversations" in record:
        return str(record["conversations"][-1]["value"])
    content = record["messages"][-1]["content"]
    if isinstance(content, list):
        content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def normalise(text: str) -> str:
    return text.strip().rstrip(string.punctuation + " ").strip().lower()


def exact(prediction: str, reference: str) -> bool:
    return normalise(prediction) == normalise(reference)


def contained(prediction: str, reference: str) -> bool:
    return normalise(reference) in normalise(prediction)


def chance_level(references: Sequence[str], classes: int | None = None) -> float:
    """Accuracy of the best constant answer: the majority reference's share (at least 1 / classes if given)."""
    norm = [normalise(r) for r in references]
    majority = max(norm.count(a) for a in set(norm)) / len(norm)
    return max(1 / classes, majority) if classes else majority


def has_videos(samples: Sequence[Any]) -> bool:
    """Whether any sample carries a video (`pixel_values_videos`)."""
    return any(VIDEOS.of(s) is not None for s in samples)


def controls_for(samples: Sequence[Any]) -> tuple[Control, ...]:
    """The controls `samples` are scored under: real, blanked, shuffled (and reversed when a sample has a video)."""
    return VIDEO_CONTROLS if has_videos(samples) else IMAGE_CONTROLS


def answer_budget(encoder: Any, references: Sequence[str], slack: int = 4) -> int:
    """New tokens enough for the longest reference answer (plus its end token and a little slack)."""
    lengths = [len(encoder.tokenizer(r, add_special_tokens=False)["input_ids"]) for r in references]
    return max(lengths, default=0) + slack


@torch.no_grad()
def predict(model: Any, encoder: Any, collate: Any, prompts: Sequence[Any], max_new_tokens: int,
            progress: Any = None) -> list[str]:
    """Greedy answers to generation prompts, `EVAL_BATCH` at a time, by the one answering function
    (`mmadapt.answering.answer_prompts`: the decoding, end tokens and end cut of `mmadapt chat` and the server)."""
    from mmadapt.answering import PromptInputs, answer_prompts
    from mmadapt.processor import Processor
    from mmadapt.sampling import Sampling

    processor, sampling = Processor(encoder, collate), Sampling(max_new_tokens=max_new_tokens)
    answers: list[str] = []
    for start in range(0, len(prompts), EVAL_BATCH):
        batch = PromptInputs.of(model, processor, collate(prompts[start : start + EVAL_BATCH]))
        answers += [answer.text for answer in answer_prompts(model, processor, batch, sampling=sampling)]
        if progress is not None:
            progress.update(len(batch.usages))
    return answers


def verdict(accuracy: Mapping[str, float], *, chance: float, margin: float) -> tuple[bool, str]:
    """(passed, the verdict's sentence) for accuracies by control name: passed when accuracy with real images beats
    blanked and shuffled images by >= `margin` (and, for videos, frames in reversed order: a "reversed" accuracy)."""
    videos = REVERSED.name in accuracy
    without = [c for c in (VIDEO_CONTROLS if videos else IMAGE_CONTROLS) if c is not REAL]
    real = accuracy[REAL.name]
    gap = real - max(accuracy[c.name] for c in without)
    passed = gap >= margin
    inputs = "images and videos" if videos else "images"
    labels = [c.label(inputs) for c in without]
    scores = ", ".join(f"{label} {accuracy[c.name]:.3f}" for c, label in zip(without, labels, strict=True))
    winner, best, read = (("real inputs", "the best of", "the images and the order of the videos' frames") if videos
                          else (REAL.label(), "the better of", "the images"))
    text = (f"{'PASSED' if passed else 'FAILED'}: accuracy with {REAL.label(inputs)} {real:.3f}, {scores} "
            f"(chance {chance:.3f}); {winner} beat {best} {' / '.join(labels)} by "
            f"{gap:+.3f}, {'>=' if passed else '<'} the margin {margin:.2f}: the model "
            f"{'reads' if passed else 'does not clearly read'} {read}")
    return passed, text


@dataclass(frozen=True, kw_only=True)
class EvalReport:
    """What `evaluate_records` measured: accuracies by control name (`VARIANTS`, + "reversed" with videos), the
    verdict over them, and each sample's answers (`predictions`: id, reference, one answer per control, `exact`).

    `skipped_samples` are the records that could not be encoded (`DataProblem.to_dict()`); `max_new_tokens` the
    answer budget used. `print(report)` gives the table of `mmadapt eval`, `to_dict()` its `--json` file.
    """

    accuracy: Mapping[str, float]  # control name -> normalised exact-match accuracy
    contained: Mapping[str, float]  # control name -> share of answers that contain the reference
    chance: float
    margin: float
    samples: int
    max_new_tokens: int
    skipped_samples: tuple[dict[str, Any], ...] = ()
    predictions: tuple[dict[str, Any], ...] = ()

    @property
    def variants(self) -> tuple[str, ...]:
        """The names of the controls scored: `VARIANTS`, plus "reversed" when the prompts had videos."""
        return tuple(self.accuracy)

    @property
    def controls(self) -> tuple[Control, ...]:
        """The controls scored (`mmadapt.controls`), in report order."""
        return tuple(CONTROLS[name] for name in self.accuracy)

    @property
    def skipped(self) -> int:
        return len(self.skipped_samples)

    @property
    def passed(self) -> bool:
        return verdict(self.accuracy, chance=self.chance, margin=self.margin)[0]

    @property
    def verdict(self) -> str:
        return verdict(self.accuracy, chance=self.chance, margin=self.margin)[1]

    def answers(self, variant: str) -> list[str]:
        """Each sample's answer under the control named `variant`, in record order."""
        return [row[variant] for row in self.predictions]

    def lines(self) -> list[str]:
        """The table of `mmadapt eval`: samples, one row per control (exact, contained), chance, the verdict."""
        return [f"{self.samples} samples ({self.skipped} skipped), up to {self.max_new_tokens} new tokens",
                f"{'with':<13} {'exact':>7} {'contained':>10}",
                *(f"{name:<13} {self.accuracy[name]:>7.3f} {self.contained[name]:>10.3f}" for name in self.variants),
                f"{'chance':<13} {self.chance:>7.3f}",
                self.verdict]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, Any]:
        """The `--json` report: accuracy_<control> and contained_<control> for each control, chance, margin,
        samples, skipped, skipped_samples, max_new_tokens, passed, verdict (the predictions go to
        `write_predictions`)."""
        scores = {f"{kind}_{name}": value[name] for name in self.variants
                  for kind, value in (("accuracy", self.accuracy), ("contained", self.contained))}
        return {**scores, "chance": self.chance, "margin": self.margin, "samples": self.samples,
                "skipped": self.skipped, "skipped_samples": list(self.skipped_samples),
                "max_new_tokens": self.max_new_tokens, "passed": self.passed, "verdict": self.verdict}


def evaluate_records(model: Any, encoder: Any, collate: Any, records: Sequence[dict[str, Any]], *,
                     margin: float = DEFAULT_MARGIN, max_new_tokens: int | None = None, classes: int | None = None,
                     progress: bool = False) -> EvalReport:
    """`records` answered under each image control (see module docstring), with each sample's
    answers.

    Records that cannot be encoded (a `DataProblem`) are skipped and counted in `skipped`."""
    from mmadapt.data import DataProblem

    prompts, kept, skipped = [], [], []
    for i, record in enumerate(records):
        try:
            prompts.append(encoder.encode_prompt(record, i))
            kept.append(record)
        except DataProblem as problem:
            if problem.fatal:
                raise
            skipped.append(problem.to_dict())
    if not prompts:
        raise ValueError(f"none of the {len(records)} records can be evaluated: {skipped[:3]}")
    references = [reference_of(r) for r in kept]
    budget = max_new_tokens or answer_budget(encoder, references)
    controls = controls_for(prompts)
    variants = {control.name: control.samples(prompts) for control in controls}
    names = tuple(variants)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(names) * len(prompts), desc=f"eval ({', '.join(c.label() for c in controls)})",
                   unit="answer")
    answers = {name: predict(model, encoder, collate, variant, budget, bar) for name, variant in variants.items()}
    if bar is not None:
        bar.close()
    predictions = tuple(
        {"id": p.id, "reference": ref, **{name: answers[name][k] for name in names},
         "exact": {name: exact(answers[name][k], ref) for name in names}}
        for k, (p, ref) in enumerate(zip(prompts, references, strict=True)))
    return EvalReport(accuracy={name: score(exact, answers[name], references) for name in names},
                      contained={name: score(contained, answers[name], references) for name in names},
                      chance=chance_level(references, classes), margin=margin, samples=len(kept),
                      max_new_tokens=budget, skipped_samples=tuple(skipped), predictions=predictions)


def score(match: Any, answers: Sequence[str], references: Sequence[str]) -> float:
    """The share of answers that `match(answer, reference)`."""
    return sum(map(match, answers, references)) / len(references)


def write_predictions(report: EvalReport, path: str | Path) -> None:
    """One JSON line per sample: id, reference, one answer per control, `exact` per control."""
    with open(path, "w") as f:
        for row in report.predictions:
            f.write(json.dumps(row) + "\n")


def plot_report(report: EvalReport, path: str | Path) -> Path:
    """Bar chart: exact and contained accuracy with real / blanked / shuffled images (and frames reversed, for
    videos), chance and the margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = report.variants
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [report.accuracy[v] for v in names], 0.4, label="exact match")
    ax.bar([x + 0.2 for x in xs], [report.contained[v] for v in names], 0.4, label="reference contained")
    ax.axhline(report.chance, color="gray", linestyle="--", label=f"chance {report.chance:.2f}")
    ax.set_xticks(list(xs), [c.label() for c in report.controls])
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title(("PASSED" if report.passed else "FAILED") + f" (margin {report.margin:.2f}, "
                 f"{report.samples} samples)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
