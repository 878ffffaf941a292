"""`train.objective: sft`: next-token cross-entropy on the answers (`objective.py`)."""

from mmadapt.train.objectives.sft.objective import SupervisedObjective, losses_by_source

__all__ = ["SupervisedObjective", "losses_by_source"]
