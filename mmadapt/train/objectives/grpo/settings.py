"""Online RL's settings (`train.objective: grpo`): the run config's `grpo` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(kw_only=True)
class GrpoSettings:
    """The run config's `grpo` section, with trl's `GRPOConfig` names and defaults, and the rewards."""

    # the verifiable rewards (`mmadapt.train.rewards`): names (accuracy, format), {name, weight, ...options}, or a
    # user's `package.module:function` (before 0.24: train.rewards)
    rewards: list[Any] = field(default_factory=list)

    num_generations: int = 8  # G: answers sampled per prompt (a group)
    max_completion_length: int = 256  # tokens per answer; a prompt leaving less of data.max_length is dropped
    temperature: float = 1.0  # sampling, and the log-probs the loss scores (trl's)
    top_p: float = 1.0
    beta: float = 0.0  # the KL weight to the reference (the model with its LoRA adapters off); 0: no reference
    epsilon: float = 0.2  # the clip below 1 (and above, unless epsilon_high)
    epsilon_high: float | None = None  # DAPO's clip-higher: 0.28
    # grpo (per-answer mean), dapo (token mean over the step), dr_grpo (sum / max_completion_length), bnpo
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"  # the std advantages are divided by (none: Dr. GRPO)
    num_iterations: int = 1  # optimizer steps per rollout (trl's mu), the later ones clipped against its log-probs
    mask_truncated_completions: bool = False  # answers cut at max_completion_length add nothing to the loss

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError(f"grpo.num_generations must be >= 2 (advantages compare a group's answers), got "
                             f"{self.num_generations}")
        if self.max_completion_length < 1:
            raise ValueError(f"grpo.max_completion_length must be >= 1, got {self.max_completion_length}")
        if not self.temperature > 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"grpo.temperature must be > 0 and top_p in (0, 1], got {self.temperature} and "
                             f"{self.top_p}")
        if self.num_iterations < 1:
            raise ValueError(f"grpo.num_iterations must be >= 1 (optimizer steps per rollout), got "
                             f"{self.num_iterations}")
