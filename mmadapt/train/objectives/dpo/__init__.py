"""`train.objective: dpo`: DPO, IPO, SimPO and ORPO on preference pairs (`objective.py`: the objective and its pair
scorer; `loss.py`: the losses; `settings.py`: the `dpo` section)."""

from mmadapt.train.objectives.dpo.loss import LOSS_TYPES, PreferenceTerms, log1m_exp, preference_losses
from mmadapt.train.objectives.dpo.objective import STATS, PairScorer, PreferenceObjective, check_pairs

__all__ = ["LOSS_TYPES", "STATS", "PairScorer", "PreferenceObjective", "PreferenceTerms", "check_pairs", "log1m_exp",
           "preference_losses"]
