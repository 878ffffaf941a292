"""On-policy distillation's settings (`train.objective: distill`): the run config's `distill` section."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class DistillSettings:
    """The run config's `distill` section: the teacher, trl 1.16's `GKDConfig` names and defaults where trl has the
    setting (temperature 0.9, max_new_tokens 128 as `max_completion_length`), and beta 1 (the per-token reverse KL of
    on-policy distillation, Qwen3 / Thinking Machines; trl's default is 0.5)."""

    # the teacher: an mmadapt model directory, a run or checkpoint directory, or a transformers export; it must share
    # the student's tokenizer (and take the student's image inputs)
    teacher: str | None = None
    beta: float = 1.0  # trl's GKD beta: 0 KL(teacher || student), 1 KL(student || teacher), between: the JSD(beta)
    temperature: float = 0.9  # the student's sampling temperature (trl's GKDConfig.temperature)
    loss_temperature: float = 1.0  # the divergence's softmax temperature (trl's compute_loss passes none: 1)
    top_p: float = 1.0  # the student's sampling nucleus
    num_generations: int = 1  # G: answers the student samples per prompt (prefilled once; trl's GKD: 1)
    max_completion_length: int = 128  # tokens per answer (trl's max_new_tokens)
    chunk_size: int = 1024  # completion positions whose (C, V) logits the loss holds at once

    def __post_init__(self) -> None:
        if not self.teacher:
            raise ValueError("train.objective distill needs distill.teacher: a model, run or checkpoint directory, or "
                             "a transformers export, with the student's tokenizer (e.g. "
                             "distill.teacher=runs/big/model)")
        if not 0 <= self.beta <= 1:
            raise ValueError(f"distill.beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {self.beta}")
        if not self.temperature > 0 or not self.loss_temperature > 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"distill.temperature and loss_temperature must be > 0 and top_p in (0, 1], got "
                             f"{self.temperature}, {self.loss_temperature} and {self.top_p}")
        for name in ("num_generations", "max_completion_length", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"distill.{name} must be >= 1, got {getattr(self, name)}")
