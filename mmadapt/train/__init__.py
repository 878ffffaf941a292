"""Training: the run config, stages and LoRA, atomic checkpoints, the trainer, torchrun + FSDP2/DDP."""

from mmadapt.train.checkpoint import latest_checkpoint, load_checkpoint
from mmadapt.train.config import STAGE_PRESETS, RunConfig
from mmadapt.train.plots import plot_history
from mmadapt.train.stages import apply_stages, load_adapters, merge_lora, parameter_counts, save_adapters
from mmadapt.train.state import TrainerState
from mmadapt.train.trainer import BadDataError, GlobalBatchSampler, NonFiniteError, Trainer

__all__ = [
    "STAGE_PRESETS", "BadDataError", "GlobalBatchSampler", "NonFiniteError", "RunConfig", "Trainer", "TrainerState",
    "apply_stages", "latest_checkpoint", "load_adapters", "load_checkpoint", "merge_lora", "parameter_counts",
    "plot_history", "save_adapters",
]
