"""The preference objective's settings (`train.objective: dpo`): the run config's `dpo` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class DpoSettings:
    """The run config's `dpo` section: the loss and its reference."""

    # sigmoid (DPO), ipo, and the reference-free simpo and orpo
    loss_type: Literal["sigmoid", "ipo", "simpo", "orpo"] = "sigmoid"
    # DPO / IPO: the KL strength (IPO's tau); SimPO: the reward scale; ORPO: the odds-ratio weight (its lambda)
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid and simpo: the share of pairs assumed flipped (cDPO)
    simpo_gamma: float = 0.5  # simpo: the target reward margin
    # auto: the LoRA-disabled model when every trained part is LoRA, else precomputed; adapters; precomputed (the
    # starting model's log-probs of every pair, computed before the first step and cached in OUT)
    reference: Literal["auto", "adapters", "precomputed"] = "auto"

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
