"""KTO (`train.objective: kto`): preference from unpaired desirable / undesirable answers, equal to trl's
`KTOTrainer`. `objective.py` holds the objective the trainer runs (`KtoObjective`), `settings.py` its `kto` section,
`loss.py` its arithmetic (the per-row losses, the KL estimate, the KL rows' pairing), `data.py` its records (trl's
unpaired layout, or preference pairs unpaired), rows and batches (the rows, then the KL rows, each prompt's images
encoded once)."""

from __future__ import annotations

from mmadapt.train.objectives.kto.data import (
    EncodedKto,
    KtoCollator,
    KtoDataset,
    KtoEncoder,
    KtoSample,
    is_kto_record,
    parse_kto,
    unpaired_row,
)
from mmadapt.train.objectives.kto.loss import (
    LOSS_TYPES,
    KtoTerms,
    kl_estimate,
    kl_over_processes,
    kl_partners,
    kto_losses,
)
from mmadapt.train.objectives.kto.objective import KtoObjective
from mmadapt.train.objectives.kto.settings import KtoSettings

__all__ = ["LOSS_TYPES", "EncodedKto", "KtoCollator", "KtoDataset", "KtoEncoder", "KtoObjective", "KtoSample",
           "KtoSettings", "KtoTerms", "is_kto_record", "kl_estimate", "kl_over_processes", "kl_partners", "kto_losses",
           "parse_kto", "unpaired_row"]
