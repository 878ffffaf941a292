"""What training leaves, loaded as a model: `load_for_inference(src)`, `load_trained(src)`, `resolve_source(src)`.

A source is a model directory (mmadapt's, or a transformers export: `mmadapt.directory`), a complete checkpoint
directory (`OUT/checkpoints/step-N`: its `config.json` names the components, its `config.yaml` the stages and LoRA
settings, the tokenizer's files sit beside them; its files must match the checksums of its `COMPLETE` marker:
`check_checkpoint`; a QLoRA checkpoint's 4-bit weights are read in full precision from the checkpoint its run started
from: `mmadapt.qlora`), a run directory (its `OUT/model`, else its newest checkpoint whose files match), or a run's
adapters directory (its run); `load_for_inference(base, adapters)` merges LoRA adapters into a base model
(`mmadapt.lora.load_adapters`). A checkpoint's model is built on the meta device with its LoRA layers injected
exactly as in training (`TrainedWith`: the sections of its run config that say how), loaded strictly, and LoRA is
merged, so the result holds plain weights, frozen, in eval mode.

Below training in the layers (it imports nothing of `mmadapt.train`): chat, eval, sees, explain and the server load
through it without importing the trainer, and so can training itself (`mmadapt export`, a teacher or a reference
model loaded from inside an objective).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mmadapt import directory as model_directory
from mmadapt.data.config import DataConfig
from mmadapt.data.tokenizer import saved_tokenizer
from mmadapt.lora import (
    LORA_MODES,
    LoraSection,
    StagesSection,
    adapter_components,
    add_lora,
    load_adapters,
    lora_modules,
    merge_lora,
)
from mmadapt.model import VisionLanguageModel
from mmadapt.qlora import WithBase, quantized_base
from mmadapt.run_directory import COMPLETE, CONFIG, RunDirectory, is_complete, step_of
from mmadapt.run_directory import COMPLETE as MARKER
from mmadapt.sections import build_section
from mmadapt.sharded_checkpoint import is_sharded
from mmadapt.weights import Checkpoint, load_pretrained

log = logging.getLogger(__name__)


def load_for_inference(src: str | Path, adapters: str | Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) for chat / eval / sees / explain: a model directory, a run directory (its OUT/model,
    else its newest valid checkpoint), a checkpoint, or a run's adapters directory (its run); with `adapters`,
    a base model from any of those and then the LoRA adapters of `adapters` merged into it (`load_adapters`)."""
    src = Path(src)
    if adapter_components(src):
        if adapters is not None:
            raise ValueError(f"{src} is an adapters directory; give the base model first: MODEL --adapters {src}")
        if not RunDirectory(src.parent).exists():
            raise ValueError(f"{src} holds only LoRA adapters, not a model: give the run directory it came from, or "
                             f"the base model they were trained on and --adapters {src}")
        src = src.parent
    run = RunDirectory(src)
    if run.exists() and (run.model_dir / model_directory.CONFIG_FILE).is_file():
        src = run.model_dir
    model, tokenizer = load_trained(src)
    if adapters is not None:
        if not Path(adapters).is_dir():
            raise FileNotFoundError(f"--adapters {adapters} is not a directory")
        load_adapters(model, adapters)
        model.eval()
    if tokenizer is None:
        raise ValueError(f"{src} holds no tokenizer files; export it again from its run (mmadapt export), or save it "
                         "with save_pretrained(dir, tokenizer=tokenizer)")
    return model, tokenizer


def resolve_source(src: str | Path, *, verify: bool = True) -> Path:
    """A checkpoint or model directory itself, or a run directory's newest valid checkpoint. A checkpoint given
    directly must match the checksums of its `COMPLETE` marker (`check_checkpoint`; `verify=False`: a checkpoint this
    process has just written and hashed)."""
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist: give a run directory, a checkpoint or a model directory")
    if RunDirectory(src).exists():
        newest, failed = newest_verified(src)
        if newest is None and failed:
            raise UnverifiedCheckpointError(f"{none_verified(src, failed)}. Fix: restore the failing files from a "
                                            "copy of the checkpoints, or give a model directory (OUT/model)")
        if newest is None:
            raise ValueError(f"{src} has no complete checkpoint (none with a {COMPLETE} marker)")
        return newest
    if not (src / model_directory.CONFIG_FILE).is_file():
        raise ValueError(f"{src} is not a run, checkpoint or model directory (no config.json, no checkpoints/). "
                         "Checkpoints written before mmadapt 0.4 hold no config.json and cannot be exported.")
    return check_checkpoint(src) if verify and is_complete(src) else src


def load_trained(src: str | Path, *, verify: bool = True) -> tuple[Any, Any]:
    """(model with LoRA merged, tokenizer or None) from a run, checkpoint or model directory (`resolve_source`)."""
    path = resolve_source(src, verify=verify)
    run = TrainedWith.read(path) if is_complete(path) else None  # None: a model directory
    tokenizer = saved_tokenizer(path)
    model = VisionLanguageModel.from_pretrained(path) if run is None else load_checkpoint_model(path, run)
    return model, tokenizer


def load_checkpoint_model(path: Path, run: TrainedWith | Any) -> VisionLanguageModel:
    """The model of checkpoint `path` of `run` (`TrainedWith`, or a whole `RunConfig`: what is read is its `stages`,
    `lora` and `data`): built with the run's LoRA layers (so the state's keys match), loaded strictly, LoRA merged,
    frozen and in eval mode, with the data settings it was trained with (its `config.json`'s, else - a checkpoint
    written before they were saved there - its run's `data` section), its source and the weights it carries from its
    starting checkpoint attached (`mmadapt.directory`)."""
    saved = model_directory.read_config(path)
    checkpoint = Checkpoint.open(path, what="checkpoint")
    log.info("checkpoint %s: %s format", path, "sharded (DCP state/)" if is_sharded(path) else "gathered")
    base = quantized_base(saved)  # QLoRA: the 4-bit weights' full-precision originals, read from the source
    weights = checkpoint if base is None else WithBase(checkpoint, base, what=f"checkpoint {path}")
    model = load_pretrained(lambda: trained_structure(saved, run), weights, what=f"checkpoint {path}",
                            tied=lambda m: m.backbone_tied_keys(), provenance=False)
    if lora_modules(model):
        merge_lora(model)
    model.requires_grad_(False)
    model.base_notes = getattr(weights, "notes", [])  # a bnb-4bit base: merged into its dequantised weights
    return with_origin(model, path, saved, run, checkpoint).eval()


def trained_structure(saved: dict[str, Any], run: TrainedWith | Any) -> VisionLanguageModel:
    """The model of a checkpoint's `config.json` (`saved`) with `run`'s LoRA layers, as training built it (under
    `mmadapt.weights.empty_weights`: its parameters on the meta device), so that its keys are the checkpoint's."""
    model = VisionLanguageModel(model_directory.model_config(saved))
    for component, mode in run.stages.modes().items():
        if mode in LORA_MODES:
            add_lora(model, component, run.lora)
    return model


def with_origin(model: Any, path: Path, saved: dict[str, Any], run: TrainedWith | Any, checkpoint: Checkpoint) -> Any:
    """`model` (of checkpoint `path`, its `config.json`: `saved`) with the data settings it was trained with (its
    `config.json`'s, else - a checkpoint written before they were saved there - its run's `data` section), its source
    and the weights it carries from its starting checkpoint attached (`mmadapt.directory`). Returns `model`."""
    settings = saved.get(model_directory.DATA_KEY) or DataConfig.of(run.data).preprocessing()
    model_directory.set_source(model_directory.set_data_settings(model, settings), checkpoint)
    model_directory.set_carried(model, path, saved)  # what it carries from its starting checkpoint: its own copy
    return model


@dataclass(frozen=True)
class TrainedWith:
    """What a checkpoint's model was built with, from its run config (`config.yaml`): the `stages` (which components
    carry LoRA layers), the `lora` section (how they were made) and the data settings (`data`). Only those sections are
    read (`mmadapt.sections`, the run config's own reader and errors): loading needs nothing else of training."""

    stages: StagesSection
    lora: LoraSection
    data: DataConfig

    @classmethod
    def read(cls, checkpoint: str | os.PathLike) -> TrainedWith:
        import yaml

        file = Path(checkpoint) / CONFIG
        with open(file) as f:
            saved = yaml.safe_load(f) or {}
        if not isinstance(saved, dict):
            raise ValueError(f"{file} is not a run config (a YAML mapping of sections): checkpoint {checkpoint} "
                             "cannot be loaded")
        data = saved.get("data") or {}
        known = {f.name for f in fields(DataConfig)}
        return cls(stages=build_section(StagesSection, saved.get("stages") or {}, "stages."),
                   lora=build_section(LoraSection, saved.get("lora") or {}, "lora."),
                   data=build_section(DataConfig, {k: v for k, v in data.items() if k in known}, "data."))


# ---- a checkpoint's files against their checksums --------------------------------------------------------------
class UnverifiedCheckpointError(ValueError):
    """A checkpoint (or every checkpoint of a run) fails verification: its files do not match the checksums its
    `COMPLETE` marker recorded. It is never loaded."""


@dataclass(frozen=True)
class Unverified:
    """Why `checkpoint` fails verification: the first `file` (relative to it) that fails, and the `problem`, which
    names that file."""

    checkpoint: Path
    file: str
    problem: str

    @property
    def path(self) -> Path:
        return self.checkpoint / self.file


def newest_verified(out: str | os.PathLike) -> tuple[Path | None, list[Unverified]]:
    """The newest complete checkpoint under OUT whose files match their checksums (None: none), and why each newer one
    fails, newest first (each skipped with a warning naming the problem)."""
    failed = []
    for path in reversed(RunDirectory(out).checkpoints(complete=True)):
        problem = unverified(path)
        if problem is None:
            return path, failed
        log.warning("skipping checkpoint %s: %s; trying the one before it", path, problem.problem)
        failed.append(problem)
    return None, failed


def none_verified(out: str | os.PathLike, failed: list[Unverified]) -> str:
    """What to say when every complete checkpoint of OUT fails verification (`failed`, newest first)."""
    each = "; ".join(f"{f.checkpoint.name}: {f.problem}" for f in failed)
    return (f"every checkpoint in {RunDirectory(out).checkpoints_dir} failed verification ({each}); the first failing "
            f"file is {failed[0].path}")


def check_checkpoint(path: str | os.PathLike) -> Path:
    """`path`, a checkpoint given directly (to chat, export, serve), once its files match the checksums of its
    `COMPLETE` marker; else `UnverifiedCheckpointError` naming the file that fails and what to do."""
    path = Path(path)
    problem = unverified(path)
    if problem is not None:
        run = RunDirectory.of(path)
        instead = f"the run directory {run.path} (it loads the newest checkpoint that verifies)" if run else (
            "another checkpoint")
        raise UnverifiedCheckpointError(
            f"checkpoint {path} failed verification: {problem.problem} ({problem.path}). mmadapt never loads a "
            f"checkpoint whose files do not match the checksums written with them. Fix: give {instead}, or restore "
            f"{problem.path} from a copy of the checkpoint")
    return path


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_checkpoint(path: Path) -> str | None:
    """None when the marker parses, lists every file of the checkpoint and each matches its checksum; else what is
    wrong, naming the file (`unverified`)."""
    problem = unverified(path)
    return None if problem is None else problem.problem


def unverified(path: Path) -> Unverified | None:
    """None when `path`'s marker parses, lists every file of the checkpoint and each matches its checksum; else the
    first file that fails and why. A marker that does not parse (or lists no checksums) is a problem: unverified,
    never trusted."""
    try:
        marker = json.loads((path / MARKER).read_text())
        recorded = marker["files"]
        if not isinstance(recorded, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in recorded.items()):
            raise TypeError(f"'files' is {type(recorded).__name__}, not {{name: sha256}}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Unverified(path, MARKER, f"its {MARKER} marker does not parse or lists no checksums ({e!r}), so its "
                                        "files cannot be checked: unverified")
    if marker.get("step") != step_of(path):
        return Unverified(path, MARKER, f"its {MARKER} marker is for step {marker.get('step')!r}, not for this "
                                        "directory's step")
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {MARKER}
    unlisted = sorted(present - set(recorded))
    if unlisted:
        return Unverified(path, unlisted[0], f"{unlisted[0]} is not in its {MARKER} marker (a file added after the "
                                             "checkpoint was written)")
    for name, digest in sorted(recorded.items()):
        if name not in present:
            return Unverified(path, name, f"{name} is missing")
        if file_sha256(path / name) != digest:
            return Unverified(path, name, f"{name} is corrupt (its SHA-256 differs from the one recorded when it was "
                                          "written)")
    return None
