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
- per micro-batch, the trainer's one accumulation (`mmadapt.train.steps.accumulate`: no_sync, precision, a
  placeholder forward for an empty micro-batch, the scaling by the world size, the clock, one all-reduce of the
  stats) asks it `units(batch)` (its share of the step's normaliser: supervised tokens, pairs, completion tokens),
  then `micro_loss(run, batch, totals)`: that micro-batch's share of the step's loss, normalised by `totals` (the
  global batch's units, all micro-batches and ranks) so that accumulation and ranks equal one big batch, and the
  sums it logs (`stat_names`); `step_result` turns the step's summed loss and stats into the logged `StepResult`;
- evaluation, in the trainer's rounds (`mmadapt.train.steps.evaluate`: every rank as many, a stand-in or a
  placeholder where a rank has nothing): `eval_batch(run, items, batch)` gives one batch's sums
  (`eval_stat_names`), `eval_metrics` the metrics of their totals over the ranks (`eval_loss`, ...);
- `state_dict()` / `load_state_dict(state)`: what it keeps across steps (JSON values), saved with every checkpoint
  (`TrainerState.objective`) and given back on resume;
- `rows_per_sample` (the plan's rows per sample of a micro-batch), `memory` (what it holds between steps, for the
  plan), `section` and `settings_class` (the run config's section of its settings, parsed as `settings`), and
  `without_code` (its config with no user code named, for `mmadapt plan`).

`run` is the trainer, seen through `Run`: the config, the model (`model`, and `wrapped`, what DDP / FSDP2 made of
it), the device, the ranks (`dist`), the datasets and collator, the precision context. A new objective is one file:
a subclass (often of `SupervisedObjective`, overriding one method) registered under its name with
`OBJECTIVES.register(name, cls)`; docs/extending.md shows one.
"""

from __future__ import annotations

import dataclasses
import difflib
from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from mmadapt.registry import Registry
from mmadapt.train.batches import supervised_tokens
from mmadapt.train.config import RunConfig, parse_section, plain


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


@dataclass(frozen=True)
class StepTotals:
    """What one step's micro-batch losses are normalised by, over the global batch (every micro-batch, every rank):
    the objective's `units` (may be 0: nothing to learn from), the supervised tokens, and the micro-batches."""

    units: int
    tokens: int
    micro_batches: int

    @property
    def per_unit(self) -> int:
        """The divisor of a summed loss: `units`, at least 1."""
        return max(self.units, 1)


@dataclass
class Terms:
    """One micro-batch's share of the step's loss (differentiable) and the sums it logs (`Objective.stat_names`:
    numbers or detached 0-d tensors, which the trainer adds over the step's micro-batches and ranks on the device)."""

    loss: torch.Tensor
    sums: dict[str, float | torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ViewOptions:
    """What `mmadapt eval` / `mmadapt sees` give an objective's view of a file of records (`Objective.view`): the
    command, the model's path, how much to read (`batches` x `batch_size`; all for `eval`), and the flags views use
    (`Objective.view_flags`)."""

    command: str
    model: str
    batch_size: int = 8
    batches: int | None = None
    reference: str | None = None
    rewards: list[str] | None = None
    max_new_tokens: int | None = None


@dataclass
class ObjectiveData:
    """The datasets and the collator an objective trains on."""

    train: Any
    eval: Any
    collate: Any


class Objective(ABC):
    """A training objective, built from the run config by `objective_for(config)` (see the module docstring)."""

    section: ClassVar[str | None] = None  # the run config's section of its settings (e.g. "dpo")
    settings_class: ClassVar[type | None] = None  # the dataclass that section is parsed as (`parse_section`)
    rows_per_sample: ClassVar[int] = 1  # rows of a micro-batch per sample (a preference pair: 2)
    steps_per_batch: int = 1  # optimizer steps each loader batch's rows serve (GRPO's num_iterations)
    shares_videos: ClassVar[bool] = False  # a sample's rows take its videos from one encoding (GRPO; a DPO pair's
    # rows each encode theirs)
    # why it cannot run with its samples' sequences split across ranks (`distributed.sequence_parallel`), or None
    without_sequence_parallel: ClassVar[str | None] = None

    def __init__(self, config: RunConfig) -> None:
        """`settings`: its section of `config` parsed (None without one); `config` keeps that section resolved (every
        default written out), as the run saves it."""
        self.settings = self.parse_settings(config)
        if self.settings is not None:
            resolved = plain(dataclasses.asdict(self.settings))
            config = dataclasses.replace(config, sections={**config.sections, self.section: resolved})
        self.config = config

    @classmethod
    def parse_settings(cls, config: RunConfig) -> Any:
        """Its section of `config` as its `settings_class` (`ValueError` naming an unknown key and the closest one)."""
        if cls.settings_class is None:
            return None
        return parse_section(cls.settings_class, config.sections.get(cls.section), f"{cls.section}.")

    @classmethod
    def without_code(cls, config: RunConfig, allowed: list[str] | None = None) -> tuple[RunConfig, str | None]:
        """(`config` for a command that must not import code the config names - `mmadapt plan` -, a line saying what
        was left out and how to allow it, or None); `allowed`: the names its command line gives, imported as the run
        would. Nothing to leave out here."""
        return config, None

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

    # ---- a step: the trainer's accumulation asks these ----------------------------------------------------------
    def has_rows(self, batch: dict[str, Any]) -> bool:
        """Whether a micro-batch holds rows to learn from (else: every sample of it was a problem, and the trainer
        runs a placeholder forward in its place)."""
        return batch["input_ids"].shape[0] > 0

    def tokens(self, batch: dict[str, Any]) -> int:
        """A micro-batch's supervised tokens (the step's logged `tokens` and speed)."""
        return int(supervised_tokens(batch["labels"]))

    def units(self, batch: dict[str, Any]) -> int:
        """A micro-batch's share of the step's normaliser (here: its supervised tokens)."""
        return self.tokens(batch)

    def stat_names(self, run: Run) -> tuple[str, ...]:
        """The keys of `Terms.sums`, the same on every rank."""
        return ()

    @abstractmethod
    def micro_loss(self, run: Run, batch: dict[str, Any], totals: StepTotals) -> Terms:
        """One micro-batch's share of the step's loss (normalised by `totals`) and its sums."""

    def step_result(self, run: Run, micro: list[dict[str, Any]], loss: float, sums: dict[str, float],
                    totals: StepTotals) -> StepResult:
        """The logged result of a step: `loss` is the sum of its micro-batch losses over the ranks, `sums` the
        summed `Terms.sums`."""
        return StepResult(loss, max(totals.tokens, 1), dict(sums))

    # ---- evaluation: the trainer's rounds ask these --------------------------------------------------------------
    def evaluating(self, run: Run) -> Any:
        """The context the whole evaluation runs in (entered after the model is put in eval mode)."""
        return nullcontext()

    def eval_stat_names(self, run: Run) -> tuple[str, ...]:
        """The keys of `eval_batch`'s sums, the same on every rank."""
        return ()

    @abstractmethod
    def eval_batch(self, run: Run, items: list[Any], batch: dict[str, Any]) -> dict[str, float]:
        """One eval batch's sums: `items` as the dataset gave them, `batch` collated (it has rows)."""

    @abstractmethod
    def eval_metrics(self, run: Run, sums: dict[str, float]) -> dict[str, float]:
        """The eval metrics from the sums over every batch and rank."""

    def memory(self, model: Any, precision: Any) -> dict[str, int]:
        """`mmadapt plan`: the bytes it holds between steps beyond the resident weights and optimizer state, by name
        (a rollout's generation cache), for this rank's own rows; the plan takes the step's peak or these."""
        return {}

    def resident_memory(self, model: Any, precision: Any) -> dict[str, int]:
        """`mmadapt plan`: the bytes it keeps on every GPU throughout the run beside the model's (a teacher's
        weights), by name; the plan adds them to every moment of the step."""
        return {}

    # ---- its view of a file of records (`mmadapt eval` / `mmadapt sees`) -----------------------------------------
    view_flags: ClassVar[frozenset[str]] = frozenset()  # the command's flags its view reads (`ViewOptions`' names)

    @classmethod
    def claims(cls, records: list[Any]) -> bool:
        """Whether a file of these records (its first ones) is this objective's to view (`objectives.view_for`)."""
        return False

    @classmethod
    def view(cls, model: Any, encoder: Any, records: list[Any], options: ViewOptions) -> Any:
        """Its view of `records` for `model` (its `SampleEncoder`): printable, with `ok` (the view rests on the
        images) and `to_dict()` (`--json`)."""
        raise NotImplementedError(f"{cls.__name__} claims records but has no view")

    def state_dict(self) -> dict[str, Any]:
        """What it keeps across steps, as JSON values (saved with each checkpoint)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output on resume."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state across steps, but the checkpoint holds "
                             f"{sorted(state)}: it was written by another objective (check train.objective)")


OBJECTIVES: Registry[type[Objective]] = Registry("objective")


def check_sections(config: RunConfig) -> None:
    """Every objective section of `config` is a registered objective's and parses (`ValueError` naming an unknown
    section, or key, with the closest one)."""
    by_section = {cls.section: cls for cls in map(OBJECTIVES.get, OBJECTIVES.names()) if cls.section}
    for name in config.sections:
        if name not in by_section:
            valid = sorted([*RunConfig.fixed_sections(), *by_section])
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"unknown config key '{name}'.{hint} Valid keys here: {valid}")
        by_section[name].parse_settings(config)

