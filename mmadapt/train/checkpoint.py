"""Atomic checkpoints that resume exactly.

A checkpoint is a directory `OUT/checkpoints/step-000123/`:

    model.safetensors     every parameter and buffer of the (unwrapped) model, full precision
    config.json           the model's components (as in a model directory), tokenizer files beside it
    optimizer.pt          optimizer + scheduler state (tensors only: loaded with weights_only=True)
    rng.pt                torch / CUDA / numpy / Python RNG states (weights_only-safe)
    trainer_state.json    step, data position, counters, log history
    config.yaml           the resolved run config
    COMPLETE              written last: JSON {step, files: {name: sha256}}; without it a directory is never loaded

Writing goes to a temporary sibling directory; every file is fsync'ed, the directory is
renamed into place, and only then the `COMPLETE` marker is written and fsync'ed. A process
killed at any point leaves the previous complete checkpoint as the newest loadable one; a write
that fails (a full disk) removes the temporary directory and raises `CheckpointWriteError`, the
previous checkpoint intact. `latest_checkpoint(out, verify=True)` (what `--resume` uses) checks
every file against the marker's checksums and skips a corrupt checkpoint with a warning that names
the bad file. Only rank 0 writes; every rank loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmadapt.weights import without_aliases

MARKER = "COMPLETE"
log = logging.getLogger(__name__)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous one is intact."""


def checkpoint_dir(out: str | os.PathLike, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step-{step:07d}"


def latest_checkpoint(out: str | os.PathLike, *, verify: bool = False) -> Path | None:
    """The newest complete checkpoint under OUT, or None. `verify`: the newest whose files match their checksums."""
    root = Path(out) / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if (p / MARKER).is_file()) if root.is_dir() else []
    for path in reversed(done):
        problem = verify_checkpoint(path) if verify else None
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s; trying the one before it", path, problem)
    return None


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_checkpoint(path: Path) -> str | None:
    """None when every file matches the marker's checksum, else what is wrong (naming the file)."""
    try:
        recorded = json.loads((path / MARKER).read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return None  # a marker of mmadapt < 0.4 (no checksums): trusted as before
    for name, digest in recorded.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file_sha256(file) != digest:
            return f"{name} is corrupt (its SHA-256 differs from the one recorded when it was written)"
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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

    `extras(directory)` writes more files into the checkpoint (the model config, the tokenizer)."""
    from safetensors.torch import save_file

    final = checkpoint_dir(out, step)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        weights, aliases = without_aliases(model_state)
        save_file(weights, tmp / "model.safetensors", metadata={"aliases": json.dumps(aliases)})
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        config.save(tmp / "config.yaml")
        if extras is not None:
            extras(tmp)
        for path in tmp.iterdir():
            _fsync(path)
        _fsync(tmp)
        checksums = {p.name: file_sha256(p) for p in sorted(tmp.iterdir())}
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(out)
        raise CheckpointWriteError(
            f"could not write checkpoint {final}: {e}. The previous checkpoint "
            f"{previous.name if previous else '(none)'} is intact. Fix: free disk space (or lower checkpoint.keep), "
            "then continue with --resume.") from e
    if final.exists():  # an incomplete leftover of a killed run at the same step
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)
    (final / MARKER).write_text(json.dumps({"step": step, "files": checksums}, indent=1))
    _fsync(final / MARKER)
    _fsync(final)
    prune(out, keep)
    return final


def prune(out: str | os.PathLike, keep: int) -> None:
    root = Path(out) / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if (p / MARKER).is_file())
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):  # temporaries of killed writers
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Everything a checkpoint holds, loaded without unpickling arbitrary objects."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / MARKER).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER} marker): it was being written when "
                         "the run stopped. Use mmadapt.train.latest_checkpoint(out) to find the newest complete one.")
    from safetensors import safe_open

    model = load_file(path / "model.safetensors")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    model.update({alias: model[stored] for alias, stored in aliases.items()})
    return {"model": model,
            "optimizer": torch.load(path / "optimizer.pt", weights_only=True),
            "rng": torch.load(path / "rng.pt", weights_only=True),
            "trainer": json.loads((path / "trainer_state.json").read_text())}
