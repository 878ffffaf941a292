"""A training run's `train.eval_tasks`: `check_eval_tasks` before training, `evaluate_tasks` at its evaluations.

The trainer imports this module only when `train.eval_tasks` is set (which needs lmms-eval, the optional extra
`mmadapt[lmms]`); it answers the in-memory model with `mmadapt.lmms_eval.model.LmmsChatModel`, as `mmadapt chat`
would answer its export.

A task file is code: its `!function` tags run Python from its folder, and lmms-eval indexes every YAML under an
include path (any of which may claim a task's name). So a task named by its file is indexed alone: lmms-eval is
given a private folder holding one stub per named file, which includes that file by its absolute path
(`indexed_alone`); only the named files, and what they name themselves (`include:`d files, `!function` modules,
data files, resolved from their own folders as before), are ever read (docs/lmms_eval.md, "Task files are code").
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmadapt.atomic import open_unlinked
from mmadapt.lmms_eval.model import LmmsChatModel
from mmadapt.run_directory import RunDirectory

log = logging.getLogger(__name__)


def check_eval_tasks(tasks: Sequence[str], *, world: int, tokenizer: Any) -> None:
    """Before training starts: `train.eval_tasks` can run (one process, a tokenizer, each task found)."""
    if world > 1:
        raise ValueError(f"train.eval_tasks runs in one process, and this run has {world}: evaluate the run's model "
                         "afterwards with `lmms-eval eval --model mmadapt --model_args pretrained=OUT/model` "
                         "(docs/lmms_eval.md), or drop train.eval_tasks")
    if tokenizer is None:
        raise ValueError("train.eval_tasks needs the run's tokenizer: Trainer(..., tokenizer=tokenizer)")
    names, include = task_names(tasks)
    known = task_manager(include, defaults=needs_defaults(tasks)).all_tasks
    for task, name in zip(tasks, names, strict=True):
        if name not in known:
            raise ValueError(f"train.eval_tasks: lmms-eval knows no task {name!r}"
                             + (f" (from {task})" if task != name else "")
                             + "; give a task name (lmms-eval tasks list) or a task YAML file")


def evaluate_tasks(model: Any, tokenizer: Any, config: Any, *, step: int, out: str | os.PathLike) -> dict[str, float]:
    """Evaluate the in-memory `model` on the run's `train.eval_tasks`: {"lmms/TASK/METRIC": value} for the run's log.

    The model is answered as `mmadapt chat` would answer its export (the run's data settings: chat template,
    `template_kwargs`, `max_length`; `data.batch_size` requests at a time). The whole result - scores, each sample's
    answer, and the record of what decides the scores - is written to `OUT/lmms_eval/step-N.json`. lmms-eval's seeds
    and answer post-processing are its command line's (`cli_defaults`), and the process's random states (Python,
    NumPy, torch) are restored after, so evaluating does not change the training that follows."""
    from lmms_eval.evaluator import simple_evaluate

    path = RunDirectory(out).lmms_eval_dir / f"step-{step:07d}.json"
    lm = LmmsChatModel.from_model(model, tokenizer, data=config.data, source=f"run {out}, step {step} (in memory)",
                                  batch_size=config.data.batch_size)
    lm.accelerator = None  # lmms-eval would create an accelerate `Accelerator` in the training process otherwise
    names, include = task_names(config.train.eval_tasks)
    manager = task_manager(include, defaults=needs_defaults(config.train.eval_tasks))
    with kept_random_states():
        results = simple_evaluate(model=lm, tasks=names, task_manager=manager, verbosity="WARNING",
                                  cli_args=cli_defaults())
    scores = {f"lmms/{task}/{name}": value for task, metrics in results["results"].items()
              for name, value in metric_values(metrics).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_unlinked(path, "w") as f:  # a file of OUT: never written through a link
        f.write(json.dumps({"step": step, "scores": scores, "record": lm.record, "results": results["results"],
                            "configs": results.get("configs"), "samples": answers(results.get("samples", {}))},
                           indent=1, default=str))
    log.info("step %d lmms-eval: %s (%s)", step, ", ".join(f"{k} {v:.4g}" for k, v in scores.items()), path)
    return scores


def task_names(tasks: Sequence[str]) -> tuple[list[str], tuple[str, ...]]:
    """`train.eval_tasks` as lmms-eval task names, and the folder that indexes the task files among them (() when
    none), as `lmms-eval --include_path DIR` indexes one: lmms-eval 0.7 builds chat tasks only from indexed names (a
    task given as a config becomes a plain task, which a chat model cannot answer). The folder indexes the named
    files alone (`indexed_alone`), never the rest of their folders."""
    from lmms_eval import utils

    names, files = [], []
    for task in tasks:
        if not is_task_file(task):
            names.append(task)
            continue
        if not Path(task).is_file():
            raise FileNotFoundError(f"train.eval_tasks: task file {task} does not exist")
        config = utils.load_yaml_config(task, mode="simple")
        name = config.get("task") if isinstance(config.get("task"), str) else config.get("group")
        if not isinstance(name, str):
            raise ValueError(f"train.eval_tasks: {task} names no task (its `task:` or `group:` key)")
        names.append(name)
        files.append(str(Path(task).resolve()))
    return names, (indexed_alone(tuple(dict.fromkeys(files))),) if files else ()


def is_task_file(task: str) -> bool:
    return task.endswith((".yaml", ".yml"))


def needs_defaults(tasks: Sequence[str]) -> bool:
    """Whether lmms-eval's own tasks must be indexed: some task is given by name, not by its file."""
    return not all(is_task_file(task) for task in tasks)


_INDEXED: dict[tuple[str, ...], str] = {}


def indexed_alone(files: tuple[str, ...]) -> str:
    """A private folder (made once per process for these task `files`, absolute paths; removed at exit) holding one
    stub per file, `{"include": FILE}`: lmms-eval indexes the stubs alone, and reads each named file - loading it
    whole, `!function` modules included, only when its task runs - from where it is, so the paths in it keep their
    meaning. Nothing else of the file's folder is ever read."""
    if files not in _INDEXED:
        folder = tempfile.mkdtemp(prefix="mmadapt-lmms-tasks-")  # mode 0700: no one else adds a task to it
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        for k, file in enumerate(files):
            Path(folder, f"task-{k}.yaml").write_text(json.dumps({"include": file}) + "\n")
        _INDEXED[files] = folder
    return _INDEXED[files]


def cli_defaults() -> Any:
    """lmms-eval's command-line defaults (among them `reasoning_tags`: thinking blocks are stripped from answers
    before scoring), so that a training run scores answers as `lmms-eval eval` does. Its parser reads `sys.argv`,
    which is this process's own: it is given lmms-eval's bare command line while it parses."""
    import sys

    from lmms_eval.__main__ import parse_eval_args

    argv, sys.argv = sys.argv, ["lmms-eval"]
    try:
        return parse_eval_args()[1]
    finally:
        sys.argv = argv


def metric_values(metrics: dict[str, Any]) -> dict[str, float]:
    """lmms-eval's "METRIC,FILTER" numbers as "METRIC" (filter "none") or "METRIC/FILTER"; no stderr, no alias."""
    out = {}
    for key, value in metrics.items():
        name, _, kept = key.partition(",")
        if not kept or "_stderr" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[name if kept == "none" else f"{name}/{kept}"] = float(value)
    return out


def answers(samples: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Each task's samples as {doc_id, target, answer}: what was asked is in the task's data."""
    return {task: [{"doc_id": s.get("doc_id"), "target": s.get("target"),
                    "answer": (s.get("filtered_resps") or [None])[0]} for s in rows] for task, rows in samples.items()}


_TASK_MANAGERS: dict[tuple[tuple[str, ...], bool], Any] = {}


def task_manager(include: tuple[str, ...] = (), *, defaults: bool = True) -> Any:
    """lmms-eval's index of the tasks under the `include` directories and, with `defaults`, of its own (built once
    per process for each: indexing lmms-eval's own reads every task file it ships, seconds)."""
    key = (include, defaults)
    if key not in _TASK_MANAGERS:
        import lmms_eval.models  # noqa: F401  (sets lmms-eval's log to WARNING; indexing logs every file at DEBUG)
        from lmms_eval.tasks import TaskManager

        _TASK_MANAGERS[key] = TaskManager("WARNING", include_path=list(include) or None, include_defaults=defaults,
                                          model_name="mmadapt")
    return _TASK_MANAGERS[key]


@contextmanager
def kept_random_states() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU and CUDA) random states as they were before the block."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
