"""Atomic checkpoints that resume exactly, and the lock that keeps one run per OUT.

The trainer writes through `mmadapt.train.saving.CheckpointWriter`: by default sharded (every rank its own shards,
PyTorch DCP, `state/` + `rng/` + `scheduler.pt` in place of the weights and optimizer files below). This module is the
gathered format (`checkpoint.format: gathered`, mmadapt < 0.26), what both formats share (the marker, verification,
pruning, RNG states) and the lock. A gathered checkpoint is a directory `OUT/checkpoints/step-000123/`:

    model.safetensors     every parameter and buffer of the (unwrapped) model, full precision
    config.json           the model's components (as in a model directory), tokenizer files beside it
    carried.safetensors   the starting checkpoint's weights of no part (`mmadapt.carried`), when the model has any
    optimizer.pt          optimizer + scheduler state (tensors only: loaded with weights_only=True)
    rng.pt                torch / CUDA / numpy / Python RNG states (weights_only-safe)
    trainer_state.json    step, data position, counters, log history
    config.yaml           the run config, every path in it absolute (`RunConfig.save`)
    COMPLETE              JSON {step, files: {name: sha256}} of every other file; without it a directory is never loaded

Writing goes to a temporary sibling directory (`mmadapt.atomic.StagedDirectory`): each file's SHA-256 is taken as it
is written (the safetensors file right after, from the page cache, while the next file is written), every file is
fsync'ed, the `COMPLETE` marker is written last, and the directory is renamed into place. A process killed at any
point leaves the previous complete checkpoint as the newest loadable one; a write that fails (a full disk: an
`OSError`, or safetensors' `SafetensorError`) removes the temporary directory and raises `CheckpointWriteError`
naming the checkpoint, the previous one intact. `latest_checkpoint(out, verify=True)` (what `--resume` uses) checks
every file against the marker's checksums and skips, with a warning that names the problem, a checkpoint with a
corrupt, missing or unlisted file or a marker that does not parse (unverified is never trusted); when every one
fails, `--resume` stops and names them (`none_verified`). A checkpoint given directly (to chat, export, serve) is
checked the same way before it is loaded (`check_checkpoint`).

`OutLock.acquire(out)`: the run's exclusive claim on OUT (`flock` on `OUT/.lock`, which names the holder), so a
second run on the same OUT stops at once with `OutInUseError` naming the first; a link planted at `OUT/.lock` is
refused, never written through (`mmadapt.atomic.open_unlinked`). `prune` deletes only old checkpoints
and the temporary directories of writers that are gone (their lock is free), never a live writer's. In the gathered
format only rank 0 writes; every rank loads.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmadapt import sharded_checkpoint
from mmadapt.atomic import HOST, StagedDirectory, clean_leftovers, open_unlinked, save_safetensors
from mmadapt.atomic import CheckpointWriteError as CheckpointWriteError  # raised here; defined low for directory.py
from mmadapt.loading import (  # noqa: F401  (verification is loading's: mmadapt.loading; imported from here too)
    Unverified,
    UnverifiedCheckpointError,
    check_checkpoint,
    file_sha256,
    newest_verified,
    none_verified,
    unverified,
    verify_checkpoint,
)
from mmadapt.run_directory import COMPLETE as MARKER  # the marker's one home is mmadapt.run_directory
from mmadapt.run_directory import CONFIG, RunDirectory
from mmadapt.weights import without_aliases

log = logging.getLogger(__name__)


def checkpoint_dir(out: str | os.PathLike, step: int) -> Path:
    """Where OUT's checkpoint of step `step` is written (`RunDirectory.checkpoint`)."""
    return RunDirectory(out).checkpoint(step)


def latest_checkpoint(out: str | os.PathLike, *, verify: bool = False) -> Path | None:
    """The newest complete checkpoint under OUT, or None. `verify`: the newest whose files match their checksums."""
    if verify:
        return newest_verified(out)[0]
    complete = RunDirectory(out).checkpoints(complete=True)
    return complete[-1] if complete else None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(),
             "numpy": torch.from_numpy(np.frombuffer(json.dumps(_numpy_state()).encode(), dtype=np.uint8).copy()),
             "python": torch.tensor(list(json.dumps(_python_state()).encode()), dtype=torch.uint8)}
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def _numpy_state() -> list[Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _python_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = json.loads(bytes(state["numpy"].tolist()).decode())
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = json.loads(bytes(state["python"].tolist()).decode())
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def save_checkpoint(out: str | os.PathLike, step: int, *, model_state: dict[str, torch.Tensor],
                    optimizer_state: dict[str, Any], trainer_state: dict[str, Any], config: Any,
                    keep: int = 2, extras: Callable[[Path], None] | None = None) -> Path:
    """Write step `step` atomically (see module docstring); keep the newest `keep` complete ones.

    `extras(directory)` writes more files into the checkpoint (the model config, the tokenizer). A checkpoint of the
    same step already there (a resumed run redoing it) is replaced whole, once the new one is complete."""
    final = checkpoint_dir(out, step)

    def advice() -> str:
        previous = latest_checkpoint(out)
        return (f"The previous checkpoint {previous.name if previous else '(none)'} is intact. Fix: free disk space "
                "(or lower checkpoint.keep), then continue with --resume.")

    with StagedDirectory(final, what="checkpoint", overwrite=True, recognise=lambda _: True, checksums=True,
                         advice=advice) as stage:
        weights, aliases = without_aliases(model_state)
        save_safetensors(weights, stage.path / "model.safetensors", metadata={"aliases": json.dumps(aliases)})
        stage.record("model.safetensors")
        with stage.open("optimizer.pt") as f:
            torch.save(optimizer_state, f)
        with stage.open("rng.pt") as f:
            torch.save(rng_state(), f)
        stage.write_bytes("trainer_state.json", json.dumps(trainer_state, indent=1).encode())
        config.save(stage.path / CONFIG)  # its paths absolute: the checkpoint resumes from any working directory
        stage.record(CONFIG)
        if extras is not None:
            extras(stage.path)
        checksums = stage.settle()
        stage.write_bytes(MARKER, json.dumps({"step": step, "files": checksums}, indent=1).encode())
    prune(out, keep)
    return final


def prune(out: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and the temporary directories of writers that are gone
    (a live writer's, whose lock is held, is left alone)."""
    run = RunDirectory(out)
    if not run.checkpoints_dir.is_dir():
        return
    done = run.checkpoints(complete=True)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    clean_leftovers(run.checkpoints_dir)


class OutInUseError(ValueError):
    """Another run (or another trainer in this process) holds the lock on this OUT."""


class OutLock:
    """A run's exclusive claim on its OUT: a non-blocking `flock` on `OUT/.lock`, which says who holds it (pid, host,
    since when). Held until `release()` or the end of the process (the kernel drops the lock of a killed run, so a
    stale file never blocks a new one); `with OutLock.acquire(out): ...` releases it at the end of the block."""

    def __init__(self, out: Path, file: Any) -> None:
        self.out, self._file = out, file

    @classmethod
    def acquire(cls, out: str | os.PathLike) -> OutLock:
        """Lock `out` (created if missing), or raise `OutInUseError` naming the run that holds it."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        file = open_unlinked(RunDirectory(out).lock_file, "a+")  # held for the run: the lock lives as long as it
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "(it has not written its name yet)"
            file.close()
            raise OutInUseError(f"{out} is in use by another run: {holder}. Two runs writing one OUT would mix their "
                                "checkpoints and model. Fix: wait until it ends, or give this run another train.out."
                                ) from None
        except OSError as e:  # a filesystem without flock (some network filesystems)
            log.warning("could not lock %s (%s): nothing stops a second run from writing into it", out, e)
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on host {HOST}, since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
        file.flush()
        return cls(out, file)

    def release(self) -> None:
        """Give OUT back (idempotent)."""
        if not self._file.closed:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()

    def __enter__(self) -> OutLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Everything a checkpoint holds, whole, loaded without unpickling arbitrary objects: {"model", "optimizer":
    {"optimizer", "scheduler"}, "rng", "trainer"}, from either format (a sharded one's state read whole in this
    process: `mmadapt.sharded_checkpoint.read_all`; training itself loads its shards: `mmadapt.train.saving`)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / MARKER).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER} marker): it was being written when "
                         "the run stopped. Use mmadapt.train.latest_checkpoint(out) to find the newest complete one.")
    trainer = json.loads((path / "trainer_state.json").read_text())
    rng = torch.load(path / ("rng/rank-00000.pt" if sharded_checkpoint.is_sharded(path) else "rng.pt"),
                     weights_only=True)  # a sharded checkpoint keeps every rank's: rank 0's here
    if sharded_checkpoint.is_sharded(path):
        state = sharded_checkpoint.read_all(path)
        return {"model": state[sharded_checkpoint.MODEL],
                "optimizer": {"optimizer": state[sharded_checkpoint.OPTIMIZER],
                              "scheduler": torch.load(path / "scheduler.pt", weights_only=True)},
                "rng": rng, "trainer": trainer}
    from safetensors import safe_open

    model = load_file(path / "model.safetensors")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    model.update({alias: model[stored] for alias, stored in aliases.items()})
    return {"model": model, "optimizer": torch.load(path / "optimizer.pt", weights_only=True), "rng": rng,
            "trainer": trainer}
