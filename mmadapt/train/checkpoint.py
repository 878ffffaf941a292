"""Atomic checkpoints that resume exactly.

A checkpoint is a directory `OUT/checkpoints/step-000123/`:

    model.safetensors     every parameter and buffer of the (unwrapped) model, full precision
    optimizer.pt          optimizer + scheduler state (tensors only: loaded with weights_only=True)
    rng.pt                torch / CUDA / numpy / Python RNG states (weights_only-safe)
    trainer_state.json    step, data position, counters, log history
    config.yaml           the resolved run config
    COMPLETE              written last: a directory without it is never loaded

Writing goes to a temporary sibling directory; every file is fsync'ed, the directory is
renamed into place, and only then the `COMPLETE` marker is written and fsync'ed. A process
killed at any point leaves the previous complete checkpoint as the newest loadable one.
Only rank 0 writes; every rank loads.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

MARKER = "COMPLETE"


def checkpoint_dir(out: str | os.PathLike, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step-{step:07d}"


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under OUT, or None."""
    root = Path(out) / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if (p / MARKER).is_file()) if root.is_dir() else []
    return done[-1] if done else None


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
                    keep: int = 2) -> Path:
    """Write step `step` atomically (see module docstring); keep the newest `keep` complete ones."""
    from safetensors.torch import save_file

    final = checkpoint_dir(out, step)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights, aliases = without_aliases(model_state)
    save_file(weights, tmp / "model.safetensors", metadata={"aliases": json.dumps(aliases)})
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    config.save(tmp / "config.yaml")
    for path in tmp.iterdir():
        _fsync(path)
    _fsync(tmp)
    if final.exists():  # an incomplete leftover of a killed run at the same step
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)
    (final / MARKER).write_text(f"step {step}\n")
    _fsync(final / MARKER)
    _fsync(final)
    prune(out, keep)
    return final


def without_aliases(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tied weights (one tensor under two names, e.g. lm_head and embed_tokens) stored once: safetensors refuses
    shared tensors. Returns the weights and {alias: stored name}."""
    weights, aliases, seen = {}, {}, {}
    for key, value in state.items():
        value = value.detach()
        ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        weights[key] = value.to("cpu").contiguous()
    return weights, aliases


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
