"""`check_dataset`: run the whole data pipeline over a dataset without training, and report.

For every record: parse, check placeholders and answers, load and preprocess the images,
render the template, apply the truncation policy, collate. Problems are collected by
reason with the sample id and detail; nothing a sample contains can crash the scan (an
unexpected exception is reported as `unexpected_error` with its type and message).
`mmadapt data check` is this function plus printing and an exit status.

`show_sample` renders one encoded sample as the model will see it (`mmadapt data show`): its text with the
supervised stretches marked, each image span collapsed to `<image x N>`, and its counts.

`BadSampleBudget` is the training-time side of the same report: the trainer's collator drops bad
samples, the budget counts them, logs the first of each reason and stops the run with
`BadDataError` once more than `data.max_bad_fraction` of the samples seen were bad.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mmadapt.data.collate import Collator
from mmadapt.data.pipeline import SampleEncoder
from mmadapt.data.problems import DataProblem, problem_of
from mmadapt.data.samples import record_id

log = logging.getLogger(__name__)


@dataclass
class DataReport:
    total: int = 0
    problems: list[dict[str, Any]] = field(default_factory=list)
    token_lengths: list[int] = field(default_factory=list)
    visual_tokens: list[int] = field(default_factory=list)
    video_tokens: list[int] = field(default_factory=list)  # per video, all its frames

    @property
    def ok(self) -> int:
        return self.total - len(self.problems)

    @property
    def bad_fraction(self) -> float:
        return len(self.problems) / self.total if self.total else 0.0

    def merge(self, other: DataReport) -> None:
        """Add a part's problems and lengths (its total is counted by whoever made the parts)."""
        self.problems.extend(other.problems)
        self.token_lengths.extend(other.token_lengths)
        self.visual_tokens.extend(other.visual_tokens)
        self.video_tokens.extend(other.video_tokens)

    def by_reason(self) -> Counter:
        return Counter(p["reason"] for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "ok": self.ok, "bad_fraction": self.bad_fraction,
                "problems_by_reason": dict(self.by_reason()), "problems": self.problems,
                "token_length": summary(self.token_lengths), "visual_tokens_per_image": summary(self.visual_tokens),
                "images": len(self.visual_tokens), "visual_tokens_per_video": summary(self.video_tokens),
                "videos": len(self.video_tokens)}

    def format(self) -> str:
        lines = [f"samples: {self.total}   usable: {self.ok}   problems: {len(self.problems)} "
                 f"({100 * self.bad_fraction:.1f}%)"]
        for reason, count in self.by_reason().most_common():
            ids = [p["id"] for p in self.problems if p["reason"] == reason]
            shown = ", ".join(map(str, ids[:5])) + (", ..." if len(ids) > 5 else "")
            lines.append(f"  {reason:<26} {count:>6}   e.g. {shown}")
            first = as_problem(next(p for p in self.problems if p["reason"] == reason))
            lines.append(f"      first: {_clip(str(first))}")
        for title, values in (("tokens per sample", self.token_lengths),
                              ("visual tokens per image", self.visual_tokens),
                              ("visual tokens per video", self.video_tokens)):
            s = summary(values)
            if s:
                lines.append(f"{title:<24} min {s['min']}  median {s['median']:.0f}  mean {s['mean']:.1f}  "
                             f"p95 {s['p95']}  max {s['max']}")
        return "\n".join(lines)


def _clip(text: str, width: int = 300) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def summary(values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"min": ordered[0], "median": statistics.median(ordered), "mean": statistics.fmean(ordered),
            "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], "max": ordered[-1]}


def check_dataset(records: Sequence[Any], encoder: SampleEncoder, *, progress: bool = False,
                  indices: Sequence[int] | None = None, workers: int = 1) -> DataReport:
    """Every record (or those at `indices`) through `encoder` and a collator; a `DataReport` of what is usable and
    what is not. `workers` > 1: contiguous chunks checked in that many forked processes (the records are memory-mapped
    and the encoder inherited, nothing is pickled but the chunks' reports); `progress`: a bar on stderr."""
    from tqdm.auto import tqdm

    chosen = range(len(records)) if indices is None else indices
    chunks = [chosen[k : k + CHUNK] for k in range(0, len(chosen), CHUNK)]
    bar = tqdm(total=len(chosen), desc="checking", unit="sample", disable=not progress)
    report = DataReport(total=len(chosen))
    _shared.update(records=records, encoder=encoder)
    try:
        for part in _map(_check_chunk, chunks, workers):
            report.merge(part)
            bar.update(part.total)
    finally:
        _shared.clear()
        bar.close()
    return report


CHUNK = 256  # records a worker checks at a time (a progress step; a memory-mapped batch is read once per chunk)
_shared: dict[str, Any] = {}  # the records and encoder a check's forked workers inherit


def _map(function: Any, chunks: list[Any], workers: int) -> Any:
    """`function` over `chunks` in order: in this process, or in `workers` forked processes (where fork exists)."""
    import multiprocessing

    if workers <= 1 or len(chunks) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield from map(function, chunks)
        return
    with multiprocessing.get_context("fork").Pool(min(workers, len(chunks))) as pool:
        yield from pool.imap(function, chunks)


def _check_chunk(indices: Sequence[int]) -> DataReport:
    records, encoder = _shared["records"], _shared["encoder"]
    collate = Collator(pad_token_id=encoder.pad_token_id, image_token_id=encoder.image_token_id,
                       video_token_id=encoder.video_token_id)
    from mmadapt.data.preference import PairCollator, PairEncoder, is_preference_record

    pairs, pair_collate = PairEncoder(encoder), PairCollator(base=collate)
    report = DataReport(total=len(indices))
    contiguous = isinstance(indices, range) and indices.step == 1 and hasattr(records, "iter_from")
    items = zip(indices, records.iter_from(indices.start) if contiguous else (records[i] for i in indices),
                strict=False)
    for index, record in items:
        try:
            if is_preference_record(record):  # a preference pair: both rows, the prompt's images once
                pair = pairs.encode(record, index)
                pair_collate([pair])
                report.token_lengths.extend([len(pair.chosen), len(pair.rejected)])
                report.visual_tokens.extend(pair.chosen.tokens_per_image)
                report.video_tokens.extend(pair.chosen.tokens_per_video)
                continue
            sample = encoder.encode(record, index)
            collate([sample])
        except DataProblem as problem:
            report.problems.append(problem.to_dict())
            continue
        except Exception as e:  # the collator, or an encoder that lets one through: report it, keep scanning
            report.problems.append(problem_of(e, record_id(record, index)).to_dict())
            continue
        report.token_lengths.append(len(sample))
        report.visual_tokens.extend(sample.tokens_per_image)
        report.video_tokens.extend(sample.tokens_per_video)
    return report


# ---- the training run's budget of bad samples ------------------------------------------------------------------
class BadDataError(ValueError):
    """More of the training samples were bad than `data.max_bad_fraction` allows (a user error: one CLI line)."""


def as_problem(problem: dict[str, Any]) -> DataProblem:
    """The `DataProblem` of a collated batch's `meta["problems"]` entry (for its message)."""
    return DataProblem(problem["reason"], problem["detail"], sample_id=problem["id"], path=problem["path"])


class BadSampleCounts(Protocol):
    """What a `BadSampleBudget` counts into: all ranks' totals; this rank's count and first sample of each reason.

    A training run's `TrainerState` is one, so the counts are saved and restored with its checkpoints.
    """

    samples_seen: int
    bad_samples: int
    bad_counts: dict[str, int]
    first_bad: dict[str, dict[str, Any]]


@dataclass
class BadSampleBudget:
    """Count a training run's bad samples into `counts` (not a copy), log the first of each reason with its sample
    and file, and stop with `BadDataError` once more than `max_fraction` of the samples seen so far were bad
    (after 32 samples, or at once when every one so far was bad). `logger` gets the first-of-a-reason lines."""

    counts: BadSampleCounts
    max_fraction: float
    logger: logging.Logger = log

    def add(self, problems: Sequence[dict[str, Any]], seen: int, bad: int) -> None:
        """One global batch: `seen` samples, `bad` of them bad (all ranks); `problems` are this rank's (`to_dict`s)."""
        counts = self.counts
        counts.samples_seen += seen
        counts.bad_samples += bad
        for problem in problems:
            reason = problem["reason"]
            if reason not in counts.bad_counts:
                self.logger.warning("bad sample skipped (the first %s; the others are counted): %s", reason,
                                    as_problem(problem))
                counts.first_bad[reason] = problem
            counts.bad_counts[reason] = counts.bad_counts.get(reason, 0) + 1

    def exceeded(self) -> bool:
        """More than `max_fraction` of the samples seen were bad, and enough were seen to tell."""
        seen, bad = self.counts.samples_seen, self.counts.bad_samples
        return bad > self.max_fraction * seen and (seen >= 32 or bad == seen)

    def check(self, step: int) -> None:
        """Raise `BadDataError` if the budget is exceeded; its one-line message names `step` (the step being taken),
        the reasons, the first bad sample and the fix."""
        if self.exceeded():
            raise BadDataError(self.message(step))

    def message(self, step: int) -> str:
        counts = self.counts
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(counts.bad_counts.items())) or "on other ranks"
        first = f" First: {as_problem(next(iter(counts.first_bad.values())))}." if counts.first_bad else ""
        hint = (" Image paths are relative to data.image_root (unset: the current directory)."
                if "missing_image" in counts.bad_counts else "")
        return (f"stopping at step {step}: {counts.bad_samples} of the {counts.samples_seen} samples seen were "
                f"bad ({reasons}), more than data.max_bad_fraction = {self.max_fraction}.{first}{hint} Fix the data "
                "(mmadapt data check FILE lists every problem) or raise data.max_bad_fraction.")


GREEN, RESET = "\x1b[32m", "\x1b[0m"


def show_pair(encoder: SampleEncoder, pair: Any, *, colour: bool = False) -> str:
    """An `EncodedPair` as text: its chosen row, then its rejected row, each as `show_sample` shows it."""
    shared = "the prompt's images, shared" if pair.shared else "its own images (rejected_images)"
    return (f"chosen:\n{show_sample(encoder, pair.chosen, colour=colour)}\nrejected ({shared}):\n"
            f"{show_sample(encoder, pair.rejected, colour=colour)}")


def show_sample(encoder: SampleEncoder, sample: Any, *, colour: bool = False) -> str:
    """An `EncodedSample` as text: supervised stretches in green (`colour`) or between `[[` and `]]`, each image's
    visual tokens as `<image x N>`, then a line of counts (tokens, supervised, visual)."""
    ids, labels = sample.input_ids.tolist(), sample.labels.tolist()
    image = encoder.image_token_id
    out, run, state = [], [], None

    def flush() -> None:
        if not run:
            return
        if state == "image":
            out.append(f"<image x {len(run)}>")
            return
        text = encoder.tokenizer.decode(run, skip_special_tokens=False)
        if state == "supervised":
            text = f"{GREEN}{text}{RESET}" if colour else f"[[{text}]]"
        out.append(text)

    for token, label in zip(ids, labels, strict=True):
        kind = "image" if token == image else "supervised" if label != -100 else "prompt"
        if kind != state:
            flush()
            run, state = [], kind
        run.append(token)
    flush()
    visual = sum(1 for t in ids if t == image)
    supervised = sum(1 for label in labels if label != -100)
    counts = (f"-- {sample.id}: {len(ids)} tokens, {supervised} supervised, {visual} visual "
              f"({len(sample.tokens_per_image)} image{'s' if len(sample.tokens_per_image) != 1 else ''})")
    return "".join(out) + "\n" + counts
