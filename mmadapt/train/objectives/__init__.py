"""Training objectives as registered parts: `train.objective` names one of `OBJECTIVES`.

    objective = objective_for(config)           # the one place `train.objective` is read
    parts = objective.data(model, encoder)      # its datasets and collator (mmadapt.train.run)
    Trainer(model, config, parts.train, parts.collate, eval_data=parts.eval).fit()

`sft` (`SupervisedObjective`): next-token loss on the answers; `dpo` (`PreferenceObjective`): DPO, IPO, SimPO and
ORPO on preference pairs (`dpo.loss_type`), with their reference; `grpo` (`GrpoObjective`): online RL from
verifiable rewards (GRPO, DAPO, Dr. GRPO) on prompts, the policy's own answers scored by `grpo.rewards`.
`Objective` (`base.py`) is the interface the trainer runs; a new objective is one module that subclasses it and
registers itself (docs/extending.md).
"""

from __future__ import annotations

from typing import Any

from mmadapt.train.config import RunConfig
from mmadapt.train.objectives.base import (
    OBJECTIVES,
    Objective,
    ObjectiveData,
    Run,
    StepResult,
    ViewOptions,
    check_sections,
)
from mmadapt.train.objectives.distill import DistillObjective
from mmadapt.train.objectives.dpo import (
    STATS,
    PairScorer,
    PreferenceObjective,
    PreferenceTerms,
    check_pairs,
    preference_losses,
)
from mmadapt.train.objectives.grpo import GrpoObjective
from mmadapt.train.objectives.kto import KtoObjective
from mmadapt.train.objectives.reference import (
    ReferenceTable,
    adapters_disabled,
    compute_table,
    data_checksum,
    model_checksum,
    reference_kind,
)
from mmadapt.train.objectives.sft import SupervisedObjective

OBJECTIVES.register("sft", SupervisedObjective)
OBJECTIVES.register("dpo", PreferenceObjective)
OBJECTIVES.register("grpo", GrpoObjective)
OBJECTIVES.register("kto", KtoObjective)
OBJECTIVES.register("distill", DistillObjective)
OBJECTIVES.register("gkd", DistillObjective)  # trl's name for it


def check_sequence_parallel(objective: Objective, model: Any, size: int) -> None:
    """Refuse `distributed.sequence_parallel: size` for an objective or a model that cannot split their sequences
    (`Objective.without_sequence_parallel`; heads that do not divide by it: `mmadapt.sequence_parallel.check_model`).
    """
    if size <= 1:
        return
    if objective.without_sequence_parallel:
        name = objective.config.train.objective
        raise ValueError(f"train.objective {name} does not run under distributed.sequence_parallel: {size}: "
                         f"{objective.without_sequence_parallel}. Fix: distributed.sequence_parallel: 1")
    from mmadapt.sequence_parallel import check_model

    check_model(model, size)


def view_for(records: list) -> type[Objective] | None:
    """The objective whose view `mmadapt eval` / `sees` shows for a file of `records`: the one that claims them
    (`Objective.claims`), or None (conversations: the answers' view, `mmadapt.evaluate` / `mmadapt.sees`)."""
    claimed = [name for name in OBJECTIVES.names() if OBJECTIVES.get(name).claims(records)]
    if len({OBJECTIVES.get(name) for name in claimed}) > 1:
        raise ValueError(f"the records are claimed by several objectives' views ({', '.join(claimed)}): a file holds "
                         "one kind of record (conversations, preference pairs, RL prompts, ...)")
    return OBJECTIVES.get(claimed[0]) if claimed else None


def objective_for(config: RunConfig) -> Objective:
    """The objective `config.train.objective` names (`UnknownComponentError` listing the registered ones), its
    settings parsed from its section; every objective section of `config` is checked (`check_sections`)."""
    cls = OBJECTIVES.get(config.train.objective)
    check_sections(config)
    return cls(config)


__all__ = [
    "OBJECTIVES", "STATS", "GrpoObjective", "Objective", "ObjectiveData", "PairScorer", "PreferenceObjective",
    "PreferenceTerms", "ReferenceTable", "Run", "StepResult", "SupervisedObjective", "ViewOptions",
    "adapters_disabled", "check_pairs", "compute_table", "data_checksum", "model_checksum", "objective_for",
    "preference_losses", "reference_kind", "view_for",
]
