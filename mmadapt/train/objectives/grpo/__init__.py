"""`train.objective: grpo`: online RL from verifiable rewards (`objective.py`: rollouts, rewards, advantages, the
step; `loss.py`: group advantages and the clipped loss of GRPO / DAPO / Dr. GRPO / BNPO; `view.py`: greedy answers'
rewards with real / blanked / shuffled images, its evals and `mmadapt sees` on prompts; `settings.py`: the `grpo`
section)."""

from mmadapt.train.objectives.grpo.objective import GrpoObjective

__all__ = ["GrpoObjective"]
