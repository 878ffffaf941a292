"""Online RL's settings (`train.objective: grpo`): the run config's `grpo` section."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from mmadapt.sampling import Sampling

SAMPLING_NAMES = {"max_new_tokens": "max_completion_length", "temperature": "temperature", "top_p": "top_p"}
"""The `Sampling` fields a GRPO run sets -> their names in the `grpo` section (trl's `GRPOConfig` names)."""


def sampling_default(name: str) -> Any:
    """The default `Sampling` declares for its field `name`."""
    return next(f.default for f in fields(Sampling) if f.name == name)


@dataclass(kw_only=True)
class GrpoSettings:
    """The run config's `grpo` section, with trl's `GRPOConfig` names and defaults, and the rewards."""

    # the verifiable rewards (`mmadapt.train.rewards`): names (accuracy, format), {name, weight, ...options}, or a
    # user's `package.module:function` (before 0.24: train.rewards)
    rewards: list[Any] = field(default_factory=list)

    num_generations: int = 8  # G: answers sampled per prompt (a group)
    # the rollout's sampling (`sampling`: validated as `Sampling` validates it, the defaults Sampling's but for the
    # temperature, trl's 1.0: greedy G answers would be one answer G times)
    max_completion_length: int = sampling_default("max_new_tokens")  # tokens per answer; a prompt leaving less of
    # data.max_length is dropped
    temperature: float = 1.0  # sampling, and the log-probs the loss scores (trl's)
    top_p: float = sampling_default("top_p")
    beta: float = 0.0  # the KL weight to the reference (the model with its LoRA adapters off); 0: no reference
    epsilon: float = 0.2  # the clip below 1 (and above, unless epsilon_high)
    epsilon_high: float | None = None  # DAPO's clip-higher: 0.28
    # grpo (per-answer mean), dapo (token mean over the step), dr_grpo (sum / max_completion_length), bnpo
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"  # the std advantages are divided by (none: Dr. GRPO)
    num_iterations: int = 1  # optimizer steps per rollout (trl's mu), the later ones clipped against its log-probs
    mask_truncated_completions: bool = False  # answers cut at max_completion_length add nothing to the loss
    # multi-turn rollouts (`mmadapt.train.objectives.turns`): the tools the policy may call in its template's format -
    # built-ins (crop, zoom), {name, ...options}, or a user's `package.module:function` (imported only when named)
    tools: list[Any] = field(default_factory=list)
    max_turns: int = 4  # answers per trajectory (with tools): the last one's text is what the rewards score
    max_trajectory_length: int | None = None  # tokens after the prompt, answers and tool messages (None: what
    # data.max_length leaves)
    tool_timeout: float = 10.0  # seconds a call may run; then a counted `timeout` and a tool message saying so
    tool_max_pixels: int | None = None  # the most pixels of an image a tool returns (None: the processor's max_pixels)
    tool_max_images: int = 4  # images one call may return
    tools_in_prompt: bool = True  # the tool list in the prompt as the template writes it (its `tools` argument)
    record_trajectories: int = 8  # with tools: greedy eval trajectories written per eval (OUT/trajectories/step-N,
    # messages records with their images: `mmadapt data show` renders them, SFT trains on them); 0: none

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError(f"grpo.num_generations must be >= 2 (advantages compare a group's answers), got "
                             f"{self.num_generations}")
        try:
            self.sampling  # noqa: B018 (validated as every Sampling is)
        except ValueError as bad:
            raise ValueError(re.sub(r"\b(" + "|".join(SAMPLING_NAMES) + r")\b",
                                    lambda m: "grpo." + SAMPLING_NAMES[m.group(1)], str(bad))) from None
        if not self.temperature > 0:
            raise ValueError(f"grpo.temperature must be > 0 (GRPO compares a group's sampled answers; greedy ones "
                             f"would be one answer G times), got {self.temperature}")
        if self.tools and self.max_turns < 2:
            raise ValueError(f"grpo.max_turns must be >= 2 with grpo.tools (an answer, a tool's result, an "
                             f"answer), got {self.max_turns}")
        if not self.tool_timeout > 0 or (self.max_trajectory_length is not None and self.max_trajectory_length < 1):
            raise ValueError(f"grpo.tool_timeout must be > 0 and grpo.max_trajectory_length >= 1, got "
                             f"{self.tool_timeout} and {self.max_trajectory_length}")
        if self.num_iterations < 1:
            raise ValueError(f"grpo.num_iterations must be >= 1 (optimizer steps per rollout), got "
                             f"{self.num_iterations}")

    @property
    def sampling(self) -> Sampling:
        """The rollout's sampling: `max_completion_length` tokens at most, at `temperature` from the `top_p`
        nucleus (each answer from its own seed, `rollout.row_seeds`)."""
        return Sampling(max_new_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p)

    @property
    def greedy(self) -> Sampling:
        """The evals' sampling (`reward_view`): one greedy answer per prompt, as long as a rollout's."""
        return Sampling(max_new_tokens=self.max_completion_length)
