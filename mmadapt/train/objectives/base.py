"""The `Objective` interface: what the trainer asks of a training objective, and `OBJECTIVES`, the registry of
objectives by the name `train.objective` gives.

The trainer runs the loop (data order, accumulation across micro-batches and ranks, the non-finite guard, clipping,
the optimizer, checkpoints, logging); an objective says what one step learns. Its parts, in the order of a run:

- `data(model, encoder)`: the train and eval datasets and the collator it trains on, from the run's config
  (`mmadapt train` builds them with it; notebooks may pass their own);
- `setup(model)`: once, before the model is moved to its device and wrapped (DDP / FSDP2): what it needs of the
  starting weights (the preference objective decides its reference here and notes their checksum);
- `prepare(run)`: before the first step, fresh or resumed (the preference objective's precomputed reference table);
- `training_rows(run, micro)`: before each step, the loader's micro-batches become the rows it trains on (identity
  here; an online objective generates its rows from the policy); with `steps_per_batch` k > 1 the rows serve k
  optimizer steps (GRPO's `num_iterations`): the loader's batch s is steps s*k ... s*k + k - 1, and
  `training_rows` runs at the first of them;
- `backward(run, micro, clock)`: the gradients of one global batch (`grad_accum` micro-batches on each rank), its
  loss normalised over the whole global batch so that accumulation and ranks equal one big batch; returns a
  `StepResult` (the loss, the supervised tokens, the values it logs);
- `evaluate(run)`: its metrics on the eval set (`eval_loss`, ...);
- `state_dict()` / `load_state_dict(state)`: what it keeps across steps (JSON values), saved with every checkpoint
  (`TrainerState.objective`) and given back on resume;
- `rows_per_sample` (the plan's rows per sample of a micro-batch) and `section` (the `RunConfig` section of its
  settings, `settings`).

`run` is the trainer, seen through `Run`: the config, the model (`model`, and `wrapped`, what DDP / FSDP2 made of
it), the device, the ranks (`dist`), the datasets and collator, the precision context. A new objective is one file:
a subclass (often of `SupervisedObjective`, overriding one method) registered under its name with
`OBJECTIVES.register(name, cls)`; docs/extending.md shows one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from mmadapt.registry import Registry
from mmadapt.train.config import RunConfig


class Run(Protocol):
    """What an objective may use of the trainer that runs it."""

    cfg: RunConfig
    model: Any  # the model as built (its parts, its config)
    wrapped: Any  # the model as it trains: DDP / FSDP2 wrapped under torchrun, else `model`
    device: Any
    dist: Any  # `mmadapt.train.distributed`'s rank, world and device
    out: Path
    step: int  # optimizer steps done
    train_data: Any
    eval_data: Any
    collate_fn: Any

    @property
    def is_main(self) -> bool: ...

    def precision_context(self) -> Any: ...

    def source_names(self) -> list[str]:
        """The training mixture's source names, in order; [] for one source."""
        ...


@dataclass
class StepResult:
    """One global batch's backward: its mean loss (NaN: nothing to learn from), its supervised tokens (all ranks),
    and what the objective logs besides (e.g. `rewards/accuracy`)."""

    loss: float
    tokens: int
    logged: dict[str, Any] = field(default_factory=dict)


@dataclass
class ObjectiveData:
    """The datasets and the collator an objective trains on."""

    train: Any
    eval: Any
    collate: Any


class Objective(ABC):
    """A training objective, built from the run config by `objective_for(config)` (see the module docstring)."""

    section: ClassVar[str | None] = None  # the RunConfig section of its settings (e.g. "dpo")
    rows_per_sample: ClassVar[int] = 1  # rows of a micro-batch per sample (a preference pair: 2)
    steps_per_batch: int = 1  # optimizer steps each loader batch's rows serve (GRPO's num_iterations)
    shares_videos: ClassVar[bool] = False  # a sample's rows take its videos from one encoding (GRPO; a DPO pair's
    # rows each encode theirs)

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    @property
    def settings(self) -> Any:
        """Its section of the run config (`section`), or None."""
        return getattr(self.config, self.section) if self.section else None

    @abstractmethod
    def data(self, model: Any, encoder: Any) -> ObjectiveData:
        """The datasets of `data.train` / `data.eval` and the collator, for `model` and its `SampleEncoder`."""

    def require_one_unpacked_file(self, one_file: str, unpacked: str) -> None:
        """For an objective that reads one `data.train` file (`one_file`: why, appended) and lays out its rows
        unpacked (`unpacked`: how): `ValueError` naming the setting to change for a mixture or `data.packing`."""
        d, name = self.config.data, self.config.train.objective
        if not all(isinstance(v, str | None) for v in (d.train, d.eval)):
            raise ValueError(f"train.objective {name} reads one data.train file{one_file}; a mixture (a list of "
                             "sources) trains with sft")
        if d.packing:
            raise ValueError(f"train.objective {name} {unpacked}; set data.packing: false")

    def setup(self, model: Any) -> None:
        """Once, before the model is moved and wrapped."""
        return None

    def prepare(self, run: Run) -> None:
        """Before the first step of a run (fresh or resumed)."""
        return None

    def training_rows(self, run: Run, micro: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The micro-batches a step trains on, from the loader's."""
        return micro

    @abstractmethod
    def backward(self, run: Run, micro: list[dict[str, Any]], clock: Any = None) -> StepResult:
        """Accumulate the gradients of one global batch; `clock.backward_done()` after each micro-batch's."""

    @abstractmethod
    def evaluate(self, run: Run) -> dict[str, float]:
        """Its metrics on `run.eval_data`, every rank scoring its share."""

    def state_dict(self) -> dict[str, Any]:
        """What it keeps across steps, as JSON values (saved with each checkpoint)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output on resume."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state across steps, but the checkpoint holds "
                             f"{sorted(state)}: it was written by another objective (check train.objective)")


OBJECTIVES: Registry[type[Objective]] = Registry("objective")
