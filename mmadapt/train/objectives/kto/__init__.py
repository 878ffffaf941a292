"""KTO (`train.objective: kto`, once registered): preference from unpaired desirable / undesirable answers, equal
to trl's `KTOTrainer`. `loss.py` holds its arithmetic (the per-row losses, the KL estimate, the KL rows' pairing)."""

from __future__ import annotations

from mmadapt.train.objectives.kto.loss import (
    LOSS_TYPES,
    KtoTerms,
    kl_estimate,
    kl_over_processes,
    kl_partners,
    kto_losses,
)

__all__ = ["LOSS_TYPES", "KtoTerms", "kl_estimate", "kl_over_processes", "kl_partners", "kto_losses"]
