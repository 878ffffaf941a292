"""`TrainerState`: everything of a training run that a checkpoint saves besides weights, optimizer and RNG.

One value instead of counters copied by hand into and out of checkpoints: `Trainer.save` writes
`state.to_dict()` as the checkpoint's `trainer_state.json`, `Trainer.resume` reads it back with
`TrainerState.from_dict`, so what is saved and what is restored cannot drift apart. The bad-sample
counters are fields here too (`BadSampleBudget` in `mmadapt.data.report` counts into this state),
so a resumed run keeps counting where it stopped. So is what the run's objective keeps across steps
(`Objective.state_dict()`, JSON values; empty for SFT and DPO), handed back to it on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

REQUIRED = ("step", "skipped", "consecutive_skips", "history")  # in every checkpoint since the first


@dataclass
class TrainerState:
    """The step, the non-finite skips, the bad-sample counters (all ranks' totals; `bad_counts` and `first_bad` are
    this rank's, by reason), the log records so far, the objective's own state and, for a mixture of sources, the
    samples and problems seen of each (all ranks)."""

    step: int = 0
    skipped: int = 0
    consecutive_skips: int = 0
    samples_seen: int = 0
    bad_samples: int = 0
    bad_counts: dict[str, int] = field(default_factory=dict)
    first_bad: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    objective: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, dict[str, int]] = field(default_factory=dict)  # a mixture's samples and problems per source
    stream: dict[str, int] = field(default_factory=dict)  # a stream's layout (`mmadapt.data.stream.StreamLayout`)
    batching: dict[str, int] = field(default_factory=dict)  # what a step's global batch is made of (`Trainer.batching`)

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint's trainer state: one key per field, in field order (the values are not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainerState:
        """The state of `to_dict()` output; older checkpoints lack the bad-sample counters and the objective's state,
        which then start empty."""
        optional = {f.name: saved[f.name] for f in fields(cls) if f.name not in REQUIRED and f.name in saved}
        return cls(**{name: saved[name] for name in REQUIRED}, **optional)  # KeyError: not a trainer state


def state_field(name: str) -> property:
    """`trainer.<name>` reads and writes `trainer.state.<name>` (the trainer's attributes before `TrainerState`)."""
    return property(lambda self: getattr(self.state, name), lambda self, value: setattr(self.state, name, value),
                    doc=f"`self.state.{name}`")
