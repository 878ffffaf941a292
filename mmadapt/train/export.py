"""What training leaves behind, read back as a model: `resolve_source(src)`, `load_trained(src)`, `export(src, dst)`.

A source is a complete checkpoint directory (`OUT/checkpoints/step-N`: its `config.json` names the
components, `config.yaml` the stages and LoRA settings, the tokenizer's files sit beside them; its files must match
their checksums), a run directory (its newest checkpoint whose files match their checksums), or a model directory
(mmadapt or transformers, `mmadapt.directory`). The model is built on the meta device, LoRA layers are
injected exactly as in training, the weights are loaded strictly and LoRA is merged, so the model
directory `export` writes (`mmadapt export`, and the trainer's `OUT/model`) holds plain weights that
`VisionLanguageModel.from_pretrained` opens with no other argument. Loading for chat / eval / sees / explain
(adapters directories, a base model + adapters) is `mmadapt.inference.load_for_inference`, built on this.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mmadapt import directory as model_directory
from mmadapt.atomic import TargetExistsError, check_target
from mmadapt.data.config import DataConfig
from mmadapt.data.tokenizer import saved_tokenizer
from mmadapt.model import VisionLanguageModel
from mmadapt.processor import export_processor
from mmadapt.run_directory import COMPLETE, CONFIG, RunDirectory, is_complete
from mmadapt.train.checkpoint import UnverifiedCheckpointError, check_checkpoint, newest_verified, none_verified
from mmadapt.train.config import RunConfig
from mmadapt.train.stages import apply_stages, lora_modules, merge_lora
from mmadapt.weights import Checkpoint, load_pretrained

log = logging.getLogger(__name__)


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
    run = RunConfig.load(path / CONFIG) if is_complete(path) else None  # None: a model directory
    tokenizer = saved_tokenizer(path)
    model = VisionLanguageModel.from_pretrained(path) if run is None else load_checkpoint_model(path, run)
    return model, tokenizer


def load_checkpoint_model(path: Path, run: RunConfig) -> VisionLanguageModel:
    """The model of checkpoint `path` of `run`: built with the run's LoRA layers (so the state's keys match), loaded
    strictly, LoRA merged, frozen and in eval mode, with the data settings it was trained with (its `config.json`'s,
    else - a checkpoint written before they were saved there - its run's `data` section), its source and the weights
    it carries from its starting checkpoint attached (`mmadapt.directory`)."""
    saved = model_directory.read_config(path)
    config = model_directory.model_config(saved)
    lora = "lora" in run.stages.modes().values()

    def build() -> VisionLanguageModel:
        model = VisionLanguageModel(config)
        if lora:
            apply_stages(model, run.stages, run.lora)
        return model

    checkpoint = Checkpoint.open(path, what="checkpoint")
    model = load_pretrained(build, checkpoint, what=f"checkpoint {path}", tied=lambda m: m.backbone_tied_keys(),
                            provenance=False)
    if lora_modules(model):
        merge_lora(model)
    model.requires_grad_(False)
    settings = saved.get(model_directory.DATA_KEY) or DataConfig.of(run.data).preprocessing()
    model_directory.set_source(model_directory.set_data_settings(model, settings), checkpoint)
    model_directory.set_carried(model, path, saved)  # what it carries from its starting checkpoint: its own copy
    return model.eval()


def export(src: str | Path, dst: str | Path, *, format: str = "mmadapt", overwrite: bool = False,
           verify: bool = True) -> Path:
    """Write the model directory of `src` (see module docstring) to `dst`; returns `dst`. `format="transformers"`
    writes what transformers, vLLM and SGLang load, with the processor settings and chat template the model was
    trained with and a record of mmadapt's version and of the checksums of `src` and of every file written
    (`mmadapt.directory.save`, docs/export.md).

    Atomic (`VisionLanguageModel.save_pretrained`): `dst` ends as it was or as the whole new model, never a mix. A
    `dst` that already holds a model directory is replaced only with `overwrite=True` (`mmadapt export --overwrite`;
    the trainer's own `OUT/model`); one that holds anything else (a checkpoint, a run, other files) never. The target
    is checked before the model is loaded, and a checkpoint's files against their checksums (`resolve_source`;
    `verify=False`: the trainer's own just-written one)."""
    dst = Path(dst)
    if is_complete(dst) or RunDirectory(dst).exists():
        raise TargetExistsError(f"{dst} is a training checkpoint or run directory, not a model directory: export "
                                "writes a model directory and never replaces a checkpoint. Choose another dst.")
    check_target(dst, what="model directory", overwrite=overwrite, recognise=model_directory.is_model_directory)
    model, tokenizer = load_trained(src, verify=verify)
    model.save_pretrained(dst, format=format, tokenizer=tokenizer, processor_export=export_processor,
                          overwrite=overwrite)
    log.info("exported %s to %s (%s format%s)", src, dst, format, ", with its tokenizer" if tokenizer else "")
    return dst
