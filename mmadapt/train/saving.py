"""How the trainer writes its checkpoints, and reads them back: sharded (every rank its own shards) or gathered, now
or in the background.

`checkpoint.format: sharded` (the default since mmadapt 0.26): the model and optimizer state go through PyTorch
Distributed Checkpoint (`torch.distributed.checkpoint`, DCP). Every rank writes the shards it holds (FSDP2: its
shards of every parameter and of the optimizer's state; DDP and one process: DCP spreads the replicated tensors over
the ranks, each written once) into `state/` of the checkpoint; no rank ever holds the whole state. Rank 0 writes the
small files (scheduler, trainer state, configs, tokenizer); every rank its RNG states (`rng/rank-<r>.pt`: its own
device's generator among them). Each rank hashes the files it wrote; rank 0 gathers
the checksums into the `COMPLETE` marker ({"step", "format": "sharded", "world", "files"}) and swaps the directory in
(`mmadapt.atomic.StagedDirectory`, as every checkpoint): a checkpoint is complete only when every rank's write has
finished and its marker is written; a process killed before that leaves the previous checkpoint the newest complete
one.

`checkpoint.async: true`: `save` copies this rank's shards to host memory (pinned on CUDA; DCP's `async_save`) and
returns; the write, the checksums, the marker and the swap happen in a background thread, whose collectives run on a
process group of their own (gloo), apart from the training's. At most one save is in flight: the next `save` (and
the run's end, `wait`) first waits for it, and a background write that failed raises there, on every rank together
(its outcome is agreed between the ranks before any of them sees it).

Loading (`load_state`) reshards: a checkpoint written by N ranks loads into M ranks, FSDP2 or DDP or one process,
because DCP reads every tensor's chunks into whatever shards this run holds. A gathered checkpoint (mmadapt < 0.26,
or `checkpoint.format: gathered`) loads as before; `describe_format` says which was read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmadapt import sharded_checkpoint
from mmadapt.atomic import CheckpointWriteError, StagedDirectory, is_write_error
from mmadapt.qlora import state_without_4bit
from mmadapt.quantize import four_bit_parameters
from mmadapt.run_directory import COMPLETE as MARKER
from mmadapt.run_directory import CONFIG
from mmadapt.train import distributed as dist_utils
from mmadapt.train.checkpoint import (
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    prune,
    save_checkpoint,
    set_rng_state,
)

log = logging.getLogger(__name__)
SCHEDULER, TRAINER_STATE, RNG_DIR = "scheduler.pt", "trainer_state.json", "rng"


@dataclass
class Saved:
    """One save as the step loop saw it: the checkpoint's `path`, how long the loop `stalled` (seconds: the whole write
    when synchronous; the copy to host memory when asynchronous) and, once complete, how long the write took."""

    step: int
    path: Path
    stalled: float
    written: float | None = None


@dataclass
class Snapshot:
    """What rank 0 writes besides the state, taken when `save` is called (the loop goes on changing the originals)."""

    scheduler: dict[str, Any]
    rng: dict[str, Any]
    trainer_state: dict[str, Any]
    config: Any
    extras: Callable[[Path], None] | None


class CheckpointWriter:
    """The trainer's checkpoints of run `out` (see the module docstring); `on_complete(path)` runs on rank 0 once a
    checkpoint is complete (this run's adapters are written from it)."""

    def __init__(self, out: Path, *, format: str, asynchronous: bool, keep: int, is_main: bool,
                 on_complete: Callable[[Path], None] | None = None) -> None:
        self.out, self.format, self.asynchronous, self.keep = out, format, asynchronous, keep
        self.is_main, self.on_complete = is_main, on_complete
        self.saves: list[Saved] = []
        self._in_flight: Future[Path] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._stager: Any = None
        # the background thread's collectives: a group of their own, never interleaved with the training's
        self._group = dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() else None

    @property
    def in_flight(self) -> int | None:
        """The step of the checkpoint being written in the background, if one is (this rank's view)."""
        future = self._in_flight
        return None if future is None or future.done() else self.saves[-1].step

    def save(self, step: int, *, wrapped: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer,
             snapshot: Snapshot, synchronous: bool = False) -> Path | None:
        """Write step `step`'s checkpoint; returns its path once complete (every rank), or None while it is written
        in the background. `synchronous`: write it now even with `checkpoint.async` (the run's last one)."""
        self.wait()
        start = time.perf_counter()
        if self.format == "gathered":
            path = self._save_gathered(step, wrapped, model, optimizer, snapshot)
            self.saves.append(Saved(step, path, time.perf_counter() - start, time.perf_counter() - start))
            return path
        final = checkpoint_dir(self.out, step)
        stage = self._stage(final, snapshot)
        _write_rng(stage.path if isinstance(stage, StagedDirectory) else stage, snapshot.rng)
        state = self._state(wrapped, optimizer, model)
        if not self.asynchronous or synchronous:
            try:
                self._write(state, stage, group=None)
                path = self._finish(stage, step, group=None)
            except BaseException as e:
                self._abandon(stage)
                raise _write_error(final, e) from e
            self.saves.append(Saved(step, path, time.perf_counter() - start, time.perf_counter() - start))
            return path
        try:
            written = self._write_async(state, stage)  # copies this rank's shards to host memory, then returns
        except BaseException as e:
            self._abandon(stage)
            raise _write_error(final, e) from e
        saved = Saved(step, final, time.perf_counter() - start)
        self.saves.append(saved)
        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="mmadapt-checkpoint")
        self._in_flight = self._pool.submit(self._complete_in_background, written, stage, saved, start)
        log.info("checkpoint %s: the step loop goes on after %.2f s; it is written in the background", final.name,
                 saved.stalled)
        return None

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any; its path, or its error (raised on every rank together)."""
        future, self._in_flight = self._in_flight, None
        return None if future is None else future.result()

    def close(self, *, quietly: bool = False) -> None:
        """Wait for the save in flight and release the background thread and the host memory of its staging.
        `quietly`: a failed save is logged, not raised (the run is already ending with an error of its own)."""
        try:
            self.wait()
        except Exception as e:
            if not quietly:
                raise
            log.error("the checkpoint written in the background failed too: %s", e)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    # ---- the gathered format (mmadapt < 0.26) ----------------------------------------------------------------
    def _save_gathered(self, step: int, wrapped: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer,
                       snapshot: Snapshot) -> Path:
        model_state = state_without_4bit(model, dist_utils.full_model_state(wrapped, model))
        optimizer_state = {"optimizer": dist_utils.full_optimizer_state(wrapped, optimizer),
                           "scheduler": snapshot.scheduler}
        path = checkpoint_dir(self.out, step)
        if self.is_main:
            save_checkpoint(self.out, step, model_state=model_state, optimizer_state=optimizer_state,
                            trainer_state=snapshot.trainer_state, config=snapshot.config, keep=self.keep,
                            extras=snapshot.extras)
            if self.on_complete is not None:
                self.on_complete(path)
        dist_utils.barrier()
        return path

    # ---- the sharded format ----------------------------------------------------------------------------------
    def _stage(self, final: Path, snapshot: Snapshot) -> StagedDirectory | Path:
        """Rank 0: the staging directory, opened, its small files written now; every rank: its path."""
        stage, failure = None, None
        if self.is_main:
            stage = StagedDirectory(final, what="checkpoint", overwrite=True, recognise=lambda _: True,
                                    checksums=True, advice=lambda: _advice(self.out)).__enter__()
            try:
                write_small_files(stage, snapshot)
            except BaseException as e:
                failure = e
                try:
                    stage.__exit__(type(e), e, e.__traceback__)  # removed; a storage error named with its advice
                except BaseException as wrapped:
                    failure = wrapped
        if dist_utils.broadcast_object(failure is not None):
            raise failure or RuntimeError(f"checkpoint {final.name}: rank 0 could not write its files (its log says "
                                          "why)")
        path = Path(dist_utils.broadcast_object(None if stage is None else str(stage.path)))
        return stage if stage is not None else path

    @staticmethod
    def _state(wrapped: nn.Module, optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
        """This rank's part of the model's and the optimizer's state; a QLoRA base's 4-bit weights left out (the
        source holds them: `mmadapt.qlora`)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(wrapped, optimizer)
        return {sharded_checkpoint.MODEL: state_without_4bit(model, model_state),
                sharded_checkpoint.OPTIMIZER: optimizer_state}

    def _write(self, state: dict[str, Any], stage: StagedDirectory | Path, *, group: Any) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=_writer(stage), process_group=group, no_dist=not dist.is_initialized())

    def _write_async(self, state: dict[str, Any], stage: StagedDirectory | Path) -> Future:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:  # kept across saves: its host buffers are reused
            self._stager = DefaultStager(StagingOptions(torch.cuda.is_available(), False, False, False))
        return dcp.async_save(state, storage_writer=_writer(stage), process_group=self._group,
                              async_stager=self._stager, no_dist=not dist.is_initialized())

    def _complete_in_background(self, written: Future, stage: StagedDirectory | Path, saved: Saved,
                                start: float) -> Path:
        try:
            error = None
            try:
                written.result()
            except BaseException as e:  # this rank's write failed (DCP: a BaseException): the ranks still agree below
                error = e
            path = self._finish(stage, saved.step, group=self._group, error=error)
        except BaseException as e:
            self._abandon(stage)
            log.error("checkpoint %s could not be written: %s (the run goes on; the error is raised at the next save "
                      "or at the end)", saved.path.name, e)
            raise
        saved.written = time.perf_counter() - start
        log.info("checkpoint %s complete: written in %.2f s in the background", path.name, saved.written)
        return path

    def _finish(self, stage: StagedDirectory | Path, step: int, *, group: Any, error: BaseException | None = None
                ) -> Path:
        """Every rank: hash its files; rank 0: the marker, the swap, pruning, `on_complete`; the outcome agreed."""
        directory = stage.path if isinstance(stage, StagedDirectory) else stage
        mine: dict[str, str] | str = f"rank {_rank()}: {_storage_error(error) or error}" if error is not None else {}
        if error is None:
            try:
                mine = _hash_own(directory)
            except Exception as e:  # reported, not raised: every rank must reach the gather below
                mine = f"rank {_rank()}: {e}"
        found = _gather(mine, group)
        failures = [f for f in found if isinstance(f, str)]  # each failing rank's error, as text
        outcome: str | None = "; ".join(failures) or None
        written = False
        if isinstance(stage, StagedDirectory) and outcome is None:
            try:
                for files in found:
                    for name, digest in files.items():
                        stage.record(name, digest)
                checksums = stage.settle()
                stage.write_bytes(MARKER, json.dumps({"step": step, "format": "sharded", "world": len(found),
                                                      "files": checksums}, indent=1).encode())
                stage.__exit__(None, None, None)
                written = True
                prune(self.out, self.keep)
                if self.on_complete is not None:
                    self.on_complete(stage.target)
            except BaseException as e:
                outcome = f"rank 0: {e}"
        outcome, written = _broadcast((outcome, written), group)
        final = checkpoint_dir(self.out, step)
        if outcome is not None and written:
            raise RuntimeError(f"checkpoint {final} is complete, but what follows it failed: {outcome}")
        if outcome is not None:
            raise CheckpointWriteError(f"could not write checkpoint {final}: {outcome}. {_advice(self.out)}"
                                       ) from error
        return final

    @staticmethod
    def _abandon(stage: StagedDirectory | Path) -> None:
        if isinstance(stage, StagedDirectory):
            stage.discard()


def write_small_files(stage: StagedDirectory, snapshot: Snapshot) -> None:
    """Rank 0's files of a sharded checkpoint: the scheduler, the trainer state, the run config and what makes it a
    model directory (`snapshot.extras`)."""
    with stage.open(SCHEDULER) as f:
        torch.save(snapshot.scheduler, f)
    stage.write_bytes(TRAINER_STATE, json.dumps(snapshot.trainer_state, indent=1).encode())
    snapshot.config.save(stage.path / CONFIG)  # its paths absolute: the checkpoint resumes from any working directory
    stage.record(CONFIG)
    if snapshot.extras is not None:
        snapshot.extras(stage.path)


def rng_file(rank: int) -> str:
    """Where a sharded checkpoint keeps rank `rank`'s RNG states (a run resumed on more ranks: rank 0's for the new)."""
    return f"{RNG_DIR}/rank-{rank:05d}.pt"


def _write_rng(directory: Path, rng: dict[str, Any]) -> None:
    """This rank's RNG states into the checkpoint being written (fsync'ed; hashed with its shards: `_hash_own`)."""
    path = directory / rng_file(_rank())
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as f:
        torch.save(rng, f)
        f.flush()
        os.fsync(f.fileno())


def _writer(stage: StagedDirectory | Path) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    directory = stage.path if isinstance(stage, StagedDirectory) else stage
    return FileSystemWriter(directory / sharded_checkpoint.STATE_DIR, single_file_per_rank=True, sync_files=True)


def _hash_own(directory: Path) -> dict[str, str]:
    """{relative path: SHA-256} of the state files this rank wrote (rank 0: the metadata too)."""
    state = directory / sharded_checkpoint.STATE_DIR
    rank = _rank()
    files = [*sorted(state.glob(f"__{rank}_*.distcp")), directory / rng_file(rank)]
    files += [state / sharded_checkpoint.METADATA] if rank == 0 else []
    return {f.relative_to(directory).as_posix(): _sha256(f) for f in files}


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _gather(value: Any, group: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _broadcast(value: Any, group: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _write_error(final: Path, error: BaseException) -> BaseException:
    """A failed sharded write as a `CheckpointWriteError` naming the checkpoint, the storage's error and the advice;
    an error of ours, or one that no storage error caused, as it is."""
    cause = _storage_error(error)
    if isinstance(error, CheckpointWriteError) or cause is None:
        return error
    return CheckpointWriteError(f"could not write checkpoint {final}: {cause}. {_advice(final.parent.parent)}")


def _storage_error(error: BaseException | None) -> BaseException | None:
    """The storage's error (an `OSError`: a full disk, a file too large) behind `error`: DCP reports each rank's as
    (exception, traceback) in its `CheckpointException`, and torch.save hides a failed write behind a RuntimeError of
    its own ("unexpected pos") whose context is the OSError."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if is_write_error(current):
            return current
        failures = getattr(current, "failures", None) or {}
        pending += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
        pending += [current.__cause__, current.__context__]
    return None


def _advice(out: Path) -> str:
    previous = latest_checkpoint(out)
    return (f"The previous checkpoint {previous.name if previous else '(none)'} is intact. Fix: free disk space (or "
            "lower checkpoint.keep), then continue with --resume.")


# ---- reading back ------------------------------------------------------------------------------------------------
def describe_format(path: Path) -> str:
    """Which format checkpoint `path` holds, as the resume log line says it."""
    if sharded_checkpoint.is_sharded(path):
        marker = json.loads((path / MARKER).read_text())
        return f"sharded, written by {marker.get('world', '?')} rank(s)"
    return "gathered (one model.safetensors: mmadapt < 0.26 or checkpoint.format: gathered)"


def load_state(path: Path, *, wrapped: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer
               ) -> dict[str, Any]:
    """Load checkpoint `path` (either format) into the model, the optimizer and the RNGs, resharded to this run's
    ranks; returns {"scheduler": its state, "trainer": the trainer state's dict}."""
    if not sharded_checkpoint.is_sharded(path):
        state = load_checkpoint(path)
        dist_utils.load_full_model_state(wrapped, model, state["model"], absent=four_bit_parameters(model))
        dist_utils.load_full_optimizer_state(wrapped, optimizer, state["optimizer"]["optimizer"])
        set_rng_state(state["rng"])
        return {"scheduler": state["optimizer"]["scheduler"], "trainer": state["trainer"]}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = CheckpointWriter._state(wrapped, optimizer, model)
    sharded_checkpoint.load(state, path)
    four_bit = four_bit_parameters(model)  # not in the checkpoint: quantised from the source again, bit for bit
    result = set_state_dict(wrapped, optimizer, model_state_dict=state[sharded_checkpoint.MODEL],
                            optim_state_dict=state[sharded_checkpoint.OPTIMIZER],
                            options=StateDictOptions(strict=not four_bit))
    missing_keys = {k.removeprefix("module.") for k in result.missing_keys}  # DDP's names: the model's under module.
    if four_bit and (missing := sorted(missing_keys - set(four_bit))):
        raise ValueError(f"checkpoint {path} lacks {len(missing)} weights of the model (e.g. {missing[:3]}): was it "
                         "written with other components or stages?")
    mine = path / rng_file(_rank())
    set_rng_state(torch.load(mine if mine.is_file() else path / rng_file(0), weights_only=True))
    return {"scheduler": torch.load(path / SCHEDULER, weights_only=True),
            "trainer": json.loads((path / TRAINER_STATE).read_text())}


def adapter_state(path: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of checkpoint `path` that LoRA adapters are made of (`mmadapt.lora.save_adapters`' `state`):
    every `lora_` tensor, and the biases when a component's LoRA trains them; read alone, never the whole model."""
    biases = any(getattr(getattr(module, "lora_config", None), "bias", "none") != "none" for module in model.children())
    if sharded_checkpoint.is_sharded(path):
        tensors = sharded_checkpoint.ModelTensors(path)
        return tensors.read(k for k in tensors.keys() if "lora_" in k or (biases and k.endswith(".bias")))
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if "lora_" in k or (biases and k.endswith(".bias"))}

