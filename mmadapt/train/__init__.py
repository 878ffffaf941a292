"""Training: the run config, stages and LoRA, atomic checkpoints, the trainer, torchrun + FSDP2/DDP.

`from mmadapt.train import Trainer, RunConfig, ...` works as it always has, but each name is imported when it is first
read (`mmadapt.lazy`): importing one module of training (`mmadapt.train.config` for a run's settings) does not import
the trainer, its objectives or peft, so the commands that only answer (`serve`, `chat`) never load training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmadapt.lazy import lazy_names

if TYPE_CHECKING:
    from mmadapt.data.report import BadDataError
    from mmadapt.train.batches import GlobalBatchSampler
    from mmadapt.train.checkpoint import latest_checkpoint, load_checkpoint
    from mmadapt.train.config import STAGE_PRESETS, RunConfig
    from mmadapt.train.guard import NonFiniteError
    from mmadapt.train.plots import plot_history
    from mmadapt.train.stages import apply_stages, load_adapters, merge_lora, parameter_counts, save_adapters
    from mmadapt.train.state import TrainerState
    from mmadapt.train.trainer import Trainer

EXPORTS: dict[str, str] = {
    "latest_checkpoint": "mmadapt.train.checkpoint",
    "load_checkpoint": "mmadapt.train.checkpoint",
    "STAGE_PRESETS": "mmadapt.train.config",
    "RunConfig": "mmadapt.train.config",
    "plot_history": "mmadapt.train.plots",
    "apply_stages": "mmadapt.train.stages",
    "load_adapters": "mmadapt.train.stages",
    "merge_lora": "mmadapt.train.stages",
    "parameter_counts": "mmadapt.train.stages",
    "save_adapters": "mmadapt.train.stages",
    "TrainerState": "mmadapt.train.state",
    "BadDataError": "mmadapt.data.report",
    "GlobalBatchSampler": "mmadapt.train.batches",
    "NonFiniteError": "mmadapt.train.guard",
    "Trainer": "mmadapt.train.trainer",
}
"""Each public name -> the module that defines it, imported when the name is first read (`mmadapt.lazy`)."""
__getattr__, __dir__ = lazy_names(__name__, EXPORTS)

__all__ = [
    "STAGE_PRESETS", "BadDataError", "GlobalBatchSampler", "NonFiniteError", "RunConfig", "Trainer", "TrainerState",
    "apply_stages", "latest_checkpoint", "load_adapters", "load_checkpoint", "merge_lora", "parameter_counts",
    "plot_history", "save_adapters",
]
