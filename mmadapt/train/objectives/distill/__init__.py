"""On-policy distillation (`train.objective: distill`, once registered): the student samples, a teacher with the same
tokenizer scores each token, the loss is trl's GKD generalised JSD (beta 1: the per-token reverse KL). `loss.py` holds
its arithmetic, from logits or chunked from hidden states without (N, V) logits."""

from __future__ import annotations

from mmadapt.train.objectives.distill.loss import REDUCTIONS, chunked_generalized_jsd, generalized_jsd

__all__ = ["REDUCTIONS", "chunked_generalized_jsd", "generalized_jsd"]
