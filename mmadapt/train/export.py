"""Model directories from training outputs: `load_trained(src)` and `export(src, dst)` (`mmadapt export`).

A source is a complete checkpoint directory (`OUT/checkpoints/step-N`: its `config.json` names the
components, `config.yaml` the stages and LoRA settings, the tokenizer's files sit beside them), a
run directory (its newest checkpoint whose files match their checksums), or a model directory
(mmadapt or transformers). The model is built on the meta device, LoRA layers are injected exactly
as in training, the weights are loaded strictly and LoRA is merged, so the model directory holds
plain weights that `VisionLanguageModel.from_pretrained` opens with no other argument.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_source(src: str | Path) -> Path:
    """A checkpoint or model directory itself, or a run directory's newest valid checkpoint."""
    from mmadapt.train.checkpoint import MARKER, latest_checkpoint

    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist: give a run directory, a checkpoint or a model directory")
    if (src / "checkpoints").is_dir():
        newest = latest_checkpoint(src, verify=True)
        if newest is None:
            raise ValueError(f"{src} has no complete checkpoint (none with a {MARKER} marker whose files match)")
        return newest
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} is not a run, checkpoint or model directory (no config.json, no checkpoints/). "
                         "Checkpoints written before mmadapt 0.4 hold no config.json and cannot be exported.")
    return src


def load_tokenizer_from(directory: Path) -> Any:
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def load_trained(src: str | Path) -> tuple[Any, Any]:
    """(model with LoRA merged, tokenizer or None) from a run, checkpoint or model directory."""
    from mmadapt import ModelConfig, VisionLanguageModel
    from mmadapt.train.checkpoint import MARKER
    from mmadapt.weights import Checkpoint, empty_weights, finish, load_part

    path = resolve_source(src)
    if not (path / MARKER).is_file():  # a model directory
        return VisionLanguageModel.from_pretrained(path), load_tokenizer_from(path)
    from mmadapt.train.config import RunConfig
    from mmadapt.train.stages import apply_stages, lora_modules, merge_lora

    saved = json.loads((path / "config.json").read_text())
    with empty_weights():
        model = VisionLanguageModel(ModelConfig.from_dict(saved["mmadapt"]))
    run = RunConfig.load(path / "config.yaml")
    modes = run.stages.modes()
    if "lora" in modes.values():  # the same adapters as in training, so the state's keys match
        with empty_weights():
            apply_stages(model, modes, r=run.lora.r, alpha=run.lora.alpha, dropout=run.lora.dropout,
                         targets=run.lora.targets)
    tied = model.backbone_tied_keys()
    load_part(model, Checkpoint.open(path, what="checkpoint"), (("", ""),), what=f"checkpoint {path}", tied=tied)
    if tied:
        model.backbone.tie_weights()
    finish(model, f"checkpoint {path}")
    if lora_modules(model):
        merge_lora(model)
    model.requires_grad_(False)
    return model.eval(), load_tokenizer_from(path)


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
    from mmadapt.train.stages import adapter_components, load_adapters

    src = Path(src)
    if adapter_components(src):
        if adapters is not None:
            raise ValueError(f"{src} is an adapters directory; give the base model first: MODEL --adapters {src}")
        if not (src.parent / "checkpoints").is_dir():
            raise ValueError(f"{src} holds only LoRA adapters, not a model: give the run directory it came from, or "
                             f"the base model they were trained on and --adapters {src}")
        src = src.parent
    if (src / "model" / "config.json").is_file() and (src / "checkpoints").is_dir():
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
