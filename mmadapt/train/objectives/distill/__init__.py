"""On-policy distillation (`train.objective: distill`, alias `gkd`): the student samples, a teacher with the same
tokenizer scores each token, the loss is trl's GKD generalised JSD (beta 1: the per-token reverse KL).
`objective.py` holds the step and the eval, `settings.py` the `distill` section, `teacher.py` the teacher's loading
and checks, `heads.py` the two heads, `loss.py` the arithmetic (from logits, or chunked from hidden states without
(N, V) logits)."""

from __future__ import annotations

from mmadapt.train.objectives.distill.loss import REDUCTIONS, chunked_generalized_jsd, generalized_jsd
from mmadapt.train.objectives.distill.objective import DistillObjective
from mmadapt.train.objectives.distill.settings import DistillSettings

__all__ = ["REDUCTIONS", "DistillObjective", "DistillSettings", "chunked_generalized_jsd", "generalized_jsd"]
