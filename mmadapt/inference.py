"""Models for inference from what training leaves behind: `load_trained(src)`, `load_for_inference(src)`, `export`.

A source is a complete checkpoint directory (`OUT/checkpoints/step-N`: its `config.json` names the
components, `config.yaml` the stages and LoRA settings, the tokenizer's files sit beside them), a
run directory (its newest checkpoint whose files match their checksums), or a model directory
(mmadapt or transformers, `mmadapt.directory`). The model is built on the meta device, LoRA layers are
injected exactly as in training, the weights are loaded strictly and LoRA is merged, so the model
directory `export` writes (`mmadapt export`, and the trainer's `OUT/model`) holds plain weights that
`VisionLanguageModel.from_pretrained` opens with no other argument. `chat`, `eval`, `sees` and `explain`
load through `load_for_inference`, which also merges a run's LoRA adapters into a base model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mmadapt import directory as model_directory
from mmadapt.data.tokenizer import load_tokenizer
from mmadapt.model import VisionLanguageModel
from mmadapt.train.checkpoint import MARKER, latest_checkpoint
from mmadapt.train.config import RunConfig
from mmadapt.train.stages import adapter_components, apply_stages, load_adapters, lora_modules, merge_lora
from mmadapt.weights import Checkpoint, load_pretrained

log = logging.getLogger(__name__)


def resolve_source(src: str | Path) -> Path:
    """A checkpoint or model directory itself, or a run directory's newest valid checkpoint."""
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist: give a run directory, a checkpoint or a model directory")
    if (src / "checkpoints").is_dir():
        newest = latest_checkpoint(src, verify=True)
        if newest is None:
            raise ValueError(f"{src} has no complete checkpoint (none with a {MARKER} marker whose files match)")
        return newest
    if not (src / model_directory.CONFIG_FILE).is_file():
        raise ValueError(f"{src} is not a run, checkpoint or model directory (no config.json, no checkpoints/). "
                         "Checkpoints written before mmadapt 0.4 hold no config.json and cannot be exported.")
    return src


def load_trained(src: str | Path) -> tuple[Any, Any]:
    """(model with LoRA merged, tokenizer or None) from a run, checkpoint or model directory."""
    path = resolve_source(src)
    if not (path / MARKER).is_file():  # a model directory
        return VisionLanguageModel.from_pretrained(path), load_tokenizer(path)
    config = model_directory.model_config(model_directory.read_config(path))
    run = RunConfig.load(path / "config.yaml")
    modes = run.stages.modes()

    def build() -> VisionLanguageModel:
        model = VisionLanguageModel(config)
        if "lora" in modes.values():  # the same adapters as in training, so the state's keys match
            apply_stages(model, modes, r=run.lora.r, alpha=run.lora.alpha, dropout=run.lora.dropout,
                         targets=run.lora.targets)
        return model

    model = load_pretrained(build, Checkpoint.open(path, what="checkpoint"), what=f"checkpoint {path}",
                            tied=lambda m: m.backbone_tied_keys(), provenance=False)
    if lora_modules(model):
        merge_lora(model)
    model.requires_grad_(False)
    return model.eval(), load_tokenizer(path)


def export(src: str | Path, dst: str | Path, *, format: str = "mmadapt") -> Path:
    """Write the model directory of `src` (see module docstring) to `dst`; returns `dst`."""
    model, tokenizer = load_trained(src)
    model.save_pretrained(dst, format=format, tokenizer=tokenizer)
    log.info("exported %s to %s (%s format%s)", src, dst, format, ", with its tokenizer" if tokenizer else "")
    return Path(dst)


def load_for_inference(src: str | Path, adapters: str | Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) for chat / eval / sees / explain: a model directory, a run directory (its OUT/model,
    else its newest valid checkpoint), a checkpoint, or a run's adapters directory (its run); with `adapters`,
    a base model from any of those and then the LoRA adapters of `adapters` merged into it (`load_adapters`)."""
    src = Path(src)
    if adapter_components(src):
        if adapters is not None:
            raise ValueError(f"{src} is an adapters directory; give the base model first: MODEL --adapters {src}")
        if not (src.parent / "checkpoints").is_dir():
            raise ValueError(f"{src} holds only LoRA adapters, not a model: give the run directory it came from, or "
                             f"the base model they were trained on and --adapters {src}")
        src = src.parent
    if (src / "model" / model_directory.CONFIG_FILE).is_file() and (src / "checkpoints").is_dir():
        src = src / "model"
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
