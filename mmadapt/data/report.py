"""`check_dataset`: run the whole data pipeline over a dataset without training, and report.

For every record: parse, check placeholders and answers, load and preprocess the images,
render the template, apply the truncation policy, collate. Problems are collected by
reason with the sample id and detail; nothing a sample contains can crash the scan (an
unexpected exception is reported as `unexpected_error` with its type and message).
`mmadapt data check` is this function plus printing and an exit status.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mmadapt.data.collate import Collator
from mmadapt.data.pipeline import SampleEncoder
from mmadapt.data.problems import DataProblem


@dataclass
class DataReport:
    total: int = 0
    problems: list[dict[str, Any]] = field(default_factory=list)
    token_lengths: list[int] = field(default_factory=list)
    visual_tokens: list[int] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return self.total - len(self.problems)

    @property
    def bad_fraction(self) -> float:
        return len(self.problems) / self.total if self.total else 0.0

    def by_reason(self) -> Counter:
        return Counter(p["reason"] for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "ok": self.ok, "bad_fraction": self.bad_fraction,
                "problems_by_reason": dict(self.by_reason()), "problems": self.problems,
                "token_length": summary(self.token_lengths), "visual_tokens_per_image": summary(self.visual_tokens),
                "images": len(self.visual_tokens)}

    def format(self) -> str:
        lines = [f"samples: {self.total}   usable: {self.ok}   problems: {len(self.problems)} "
                 f"({100 * self.bad_fraction:.1f}%)"]
        for reason, count in self.by_reason().most_common():
            ids = [p["id"] for p in self.problems if p["reason"] == reason]
            shown = ", ".join(map(str, ids[:5])) + (", ..." if len(ids) > 5 else "")
            lines.append(f"  {reason:<26} {count:>6}   e.g. {shown}")
        for title, values in (("tokens per sample", self.token_lengths),
                              ("visual tokens per image", self.visual_tokens)):
            s = summary(values)
            if s:
                lines.append(f"{title:<24} min {s['min']}  median {s['median']:.0f}  mean {s['mean']:.1f}  "
                             f"p95 {s['p95']}  max {s['max']}")
        return "\n".join(lines)


def summary(values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"min": ordered[0], "median": statistics.median(ordered), "mean": statistics.fmean(ordered),
            "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], "max": ordered[-1]}


def check_dataset(records: Sequence[Any], encoder: SampleEncoder, *, progress: bool = False) -> DataReport:
    """Every record through `encoder` and a collator; a `DataReport` of what is usable and what is not."""
    from tqdm.auto import tqdm

    collate = Collator(pad_token_id=encoder.pad_token_id, image_token_id=encoder.image_token_id)
    report = DataReport(total=len(records))
    for index, record in enumerate(tqdm(records, desc="checking", unit="sample", disable=not progress)):
        try:
            sample = encoder.encode(record, index)
            collate([sample])
        except DataProblem as problem:
            report.problems.append(problem.to_dict())
            continue
        except Exception as e:  # a bug or an input we did not foresee: report it, keep scanning
            sample_id = record.get("id", index) if isinstance(record, dict) else index
            report.problems.append({"id": str(sample_id), "reason": "unexpected_error",
                                    "detail": f"{type(e).__name__}: {e}", "path": None})
            continue
        report.token_lengths.append(len(sample))
        report.visual_tokens.extend(sample.tokens_per_image)
    return report
