"""KTO's settings (`train.objective: kto`): the run config's `kto` section, trl's `KTOConfig` names and defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class KtoSettings:
    """The run config's `kto` section: the loss, its weights and its reference."""

    # kto (the paper's Eq. 7, with the KL rows) or apo_zero_unpaired (no KL rows)
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    beta: float = 0.1  # the implied reward's scale (trl's beta)
    desirable_weight: float = 1.0  # the desirable rows' loss weight (the paper's lambda_D)
    undesirable_weight: float = 1.0  # the undesirable rows' loss weight (lambda_U)
    # auto: the LoRA-disabled model when every trained part is LoRA, else precomputed; adapters; precomputed (the
    # starting model's log-probs of every row, computed before the first step and cached in OUT: apo_zero_unpaired
    # only, as `kto`'s KL rows depend on the batch they are drawn in)
    reference: Literal["auto", "adapters", "precomputed"] = "auto"

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"kto.beta must be > 0, got {self.beta}")
        for name in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kto.{name} must be > 0, got {getattr(self, name)}")
