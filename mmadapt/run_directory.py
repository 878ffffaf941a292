"""A run's directory (`train.out`, "OUT"): where each of its files lives, and which run a path belongs to.

    run = RunDirectory("runs/demo")
    run.config_file, run.log_file, run.model_dir, run.checkpoint(300), run.checkpoints(complete=True)
    RunDirectory.of("runs/demo/model")       # RunDirectory(path=PosixPath('/abs/runs/demo')); None outside a run

The layout, declared here and nowhere else (every reader and writer of a run asks this object for its paths):

    OUT/config.yaml                    the run's config, its paths absolute (`mmadapt.train.config.RunConfig.save`)
    OUT/log.jsonl                      one JSON record per step (`mmadapt.train.tracking.Tracker`)
    OUT/checkpoints/step-0000123/      an atomic checkpoint (`mmadapt.train.checkpoint`), loadable once its
                                       `COMPLETE` marker is written; its own copy of config.yaml inside
    OUT/model/                         the final model directory, LoRA merged (`mmadapt.train.export`)
    OUT/adapters/                      the run's LoRA adapters (`mmadapt.lora.save_adapters`)
    OUT/.lock                          the running process's claim on OUT (`mmadapt.train.checkpoint.OutLock`)
    OUT/reference_logps.safetensors    the starting model's log-probs of every preference pair (dpo, precomputed)
    OUT/plan.json                      the run's memory plan, when `mmadapt plan` cached its probe
    OUT/loss.png                       the loss curve (`mmadapt.train.plots`)
    OUT/nonfinite.txt                  why a run stopped on non-finite steps
    OUT/tensorboard/, OUT/wandb/       the trackers' folders (`train.report_to`)
    OUT/lmms_eval/step-0000123.json    each lmms-eval step's answers and record (`train.eval_tasks`)
    OUT/report.json, OUT/predictions.png, OUT/data/, OUT/.mmadapt-demo
                                       `mmadapt demo`'s report, figure, digits, and the marker that lets a rerun
                                       clear OUT

A directory is a run once it has a `checkpoints/` folder (the trainer makes it with the first checkpoint); a path
belongs to a run when it is the run, something directly in it (OUT/model, OUT/adapters, OUT/config.yaml) or one of its
checkpoints. This module imports nothing from mmadapt: it sits below everything that reads or writes a run,
`mmadapt.directory` included (a training checkpoint, marked `COMPLETE`, is never taken for a model directory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

COMPLETE: Final = "COMPLETE"  # a checkpoint's marker: {step, files: {name: sha256}}, written last
CONFIG: Final = "config.yaml"  # the run's config: in OUT and in each checkpoint
CHECKPOINTS: Final = "checkpoints"
STEP_PREFIX: Final = "step-"


@dataclass(frozen=True)
class RunDirectory:
    """The directory of one run (`train.out`). Only paths: nothing is read or created until a caller uses them.
    A `RunDirectory` is an `os.PathLike`, so it goes wherever OUT's path does."""

    path: Path

    def __init__(self, path: str | os.PathLike) -> None:
        object.__setattr__(self, "path", Path(path))

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    # ---- which run a path belongs to ------------------------------------------------------------------------------
    @classmethod
    def of(cls, path: str | os.PathLike) -> RunDirectory | None:
        """The run `path` belongs to (module docstring: the run itself, anything directly in it, one of its
        checkpoints), as an absolute path; None when it belongs to no run."""
        path = Path(os.path.abspath(path))
        for candidate in (path, path.parent):
            if cls(candidate).exists():
                return cls(candidate)
        if path.parent.name == CHECKPOINTS and cls(path.parent.parent).exists():
            return cls(path.parent.parent)
        return None

    @classmethod
    def saving(cls, config: str | os.PathLike) -> RunDirectory | None:
        """The run whose saved config `config` is, as the path was given: a directory holding a `config.yaml` (a run
        directory given as it is, checkpoints or not yet), or the `config.yaml` of a run (one with `checkpoints/`);
        None for any other file (a user's run file). Where a run's directory is now is the one it is used in: a copied
        or moved run holds the old place in its saved `train.out`, and `RunConfig.load` takes this one instead."""
        path = Path(config)
        if path.is_dir():
            return cls(path) if cls(path).config_file.is_file() else None
        return cls(path.parent) if path.name == CONFIG and cls(path.parent).exists() else None

    def exists(self) -> bool:
        """This directory is a run: it has a `checkpoints/` folder."""
        return self.checkpoints_dir.is_dir()

    # ---- checkpoints ------------------------------------------------------------------------------------------------
    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        """Where the checkpoint of step `step` is (or will be) written."""
        return self.checkpoints_dir / f"{STEP_PREFIX}{step:07d}"

    def checkpoints(self, *, complete: bool = False) -> list[Path]:
        """The checkpoint directories, oldest step first; `complete`: only those with their `COMPLETE` marker (the
        others were being written when a run stopped). Writers' temporary directories are never listed."""
        root = self.checkpoints_dir
        found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None] if root.is_dir() else []
        return sorted((p for p in found if not complete or is_complete(p)), key=step_of)

    # ---- the run's files --------------------------------------------------------------------------------------------
    @property
    def config_file(self) -> Path:
        return self.path / CONFIG

    @property
    def log_file(self) -> Path:
        return self.path / "log.jsonl"

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def adapters_dir(self) -> Path:
        return self.path / "adapters"

    @property
    def lock_file(self) -> Path:
        return self.path / ".lock"

    @property
    def reference_file(self) -> Path:
        return self.path / "reference_logps.safetensors"

    @property
    def plan_file(self) -> Path:
        return self.path / "plan.json"

    @property
    def loss_plot(self) -> Path:
        return self.path / "loss.png"

    @property
    def nonfinite_file(self) -> Path:
        return self.path / "nonfinite.txt"

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tensorboard"

    @property
    def wandb_dir(self) -> Path:
        return self.path / "wandb"

    @property
    def lmms_eval_dir(self) -> Path:
        return self.path / "lmms_eval"

    def trajectories(self, step: int) -> Path:
        """A GRPO run's recorded trajectories at the eval of `step` (`grpo.record_trajectories`): records in the
        messages format, their images beside them."""
        return self.path / "trajectories" / f"step-{step:08d}"

    # ---- what `mmadapt demo` adds -----------------------------------------------------------------------------------
    @property
    def report_file(self) -> Path:
        return self.path / "report.json"

    @property
    def predictions_plot(self) -> Path:
        return self.path / "predictions.png"

    @property
    def data_dir(self) -> Path:
        return self.path / "data"

    @property
    def demo_marker(self) -> Path:
        return self.path / ".mmadapt-demo"


def step_of(checkpoint: str | os.PathLike) -> int | None:
    """The step a checkpoint directory's name (`step-0000123`) says; None for any other name."""
    number = Path(checkpoint).name.removeprefix(STEP_PREFIX)
    return int(number) if Path(checkpoint).name.startswith(STEP_PREFIX) and number.isdigit() else None


def is_complete(checkpoint: str | os.PathLike) -> bool:
    """The checkpoint's `COMPLETE` marker is written (its files' checksums: `mmadapt.train.checkpoint` verifies
    them)."""
    return (Path(checkpoint) / COMPLETE).is_file()
