"""A model directory on disk: everything inference needs, written and read in this one module.

mmadapt's format (`VisionLanguageModel.save_pretrained`, every training checkpoint, `OUT/model`):
- `config.json`: {"mmadapt": the `ModelConfig` that rebuilds the model with no preset (each part's full options
  and provenance: path + SHA-256 of the checkpoint it came from), "processor": the encoder's image-processor
  settings, "chat_template": the backbone's template name};
- the weights: `model.safetensors`, or shards + `model.safetensors.index.json` above `max_shard_size`
  (`mmadapt.weights.save_weights`: tied tensors stored once);
- the tokenizer's own files, when one is given, with the chat template the model was trained with
  (`save_tokenizer`; read back by `mmadapt.data.load_tokenizer`).
`save` writes the directory whole into a sibling and swaps it in (`mmadapt.atomic`): a reader sees the old model or
the new one, never a mix; another model there is replaced only when asked (`overwrite=True`), other files never.
A directory whose `config.json` has no "mmadapt" key is a transformers LLaVA / Qwen VLM directory, read as its
three parts (`mmadapt.convert`). Reading is strict: built on the meta device, every weight from the files
(`mmadapt.weights.load_pretrained`), a missing weight always an error.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from mmadapt.atomic import StagedDirectory, recover
from mmadapt.config import ModelConfig
from mmadapt.weights import (
    BIN,
    BIN_INDEX,
    MMADAPT_KEY,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    Checkpoint,
    empty_weights,
    load_pretrained,
    save_weights,
)

CONFIG_FILE = "config.json"
CHECKPOINT_MARKER = "COMPLETE"  # a training checkpoint's (`mmadapt.train.checkpoint.MARKER`): not a model directory
log = logging.getLogger(__name__)


def describe(model: Any) -> dict[str, Any]:
    """The `config.json` of `model`: its rebuildable config, its image processor's settings, its chat template."""
    return {MMADAPT_KEY: model.resolved_config().to_dict(), "processor": model.encoder.processor_defaults(),
            "chat_template": model.backbone_spec.chat_template}


def write_config(model: Any, directory: str | os.PathLike) -> Path:
    """Write (atomically) the `config.json` of `model` into `directory`; returns its path."""
    path = Path(directory) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(describe(model), indent=2))
    os.replace(tmp, path)
    return path


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` of a model directory (mmadapt or transformers) as a dict."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file() and recover(directory):
        log.warning("%s was restored from the previous version an interrupted write left beside it", directory)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a saved mmadapt or transformers model directory")
    return json.loads(path.read_text())


def is_mmadapt(saved: dict[str, Any]) -> bool:
    return MMADAPT_KEY in saved


def model_config(saved: dict[str, Any]) -> ModelConfig:
    return ModelConfig.from_dict(saved[MMADAPT_KEY])


def is_model_directory(path: Path) -> bool:
    """`path` holds a model directory (mmadapt's or transformers'): a `config.json` beside weights (one file or an
    index). What `save` may replace when asked to overwrite; a training checkpoint (a `COMPLETE` marker) is not one."""
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    weights = {SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX} & names or any(
        n.startswith("model-") and n.endswith(".safetensors") for n in names)
    return CONFIG_FILE in names and bool(weights) and CHECKPOINT_MARKER not in names


def save(model: Any, directory: str | os.PathLike, *, format: str = "mmadapt", tokenizer: Any = None,
         max_shard_size: int | str = "5GB", overwrite: bool = False) -> Path:
    """A complete model directory, written atomically: weights, `config.json` and, given one, the tokenizer's files;
    `format="transformers"` writes the equivalent transformers model (`mmadapt.convert.save_transformers`).

    Everything goes to a sibling temporary directory that is swapped in whole (`mmadapt.atomic.StagedDirectory`): a
    reader, or a write that fails or is killed, leaves `directory` as it was or as the new model, never a mix. An
    existing model directory is replaced only with `overwrite=True`; a non-empty directory holding anything else is
    never written into (`TargetExistsError`). A storage error (a full disk) is a `CheckpointWriteError`."""
    if format not in ("mmadapt", "transformers"):
        raise ValueError(f"unknown format {format!r}; use 'mmadapt' or 'transformers'")
    with StagedDirectory(directory, what="model directory", overwrite=overwrite, recognise=is_model_directory) as stage:
        if format == "transformers":
            from mmadapt.convert import save_transformers

            save_transformers(model, stage.path, max_shard_size=max_shard_size)
        else:
            save_weights(model.state_dict(), stage.path, max_shard_size=max_shard_size, on_file=stage.record)
            stage.record(write_config(model, stage.path).name)
        if tokenizer is not None:
            save_tokenizer(tokenizer, stage.path)
    return Path(directory)


def save_tokenizer(tokenizer: Any, directory: str | os.PathLike) -> None:
    """The tokenizer's files (with the chat template it carries), written so that loading them gives a tokenizer
    that tokenizes the same. transformers 5 drops a SentencePiece Llama tokenizer's `legacy: true` on save, and the
    reloaded tokenizer then tokenizes differently ("</s>USER" as "USER" where LLaVA-1.5 trained on "▁US" "ER", no
    "▁" after a special token): the flag is written back into `tokenizer_config.json`."""
    tokenizer.save_pretrained(directory)
    if getattr(tokenizer, "legacy", None) is True:
        path = Path(directory) / "tokenizer_config.json"
        config = json.loads(path.read_text())
        if config.get("legacy") is not True:
            config["legacy"] = True
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False))
            os.replace(tmp, path)


def load(cls: type, directory: str | os.PathLike, *, strict: bool = True) -> Any:
    """`cls` (the model class) from an mmadapt or transformers model directory; see the module docstring."""
    saved = read_config(directory)
    if not is_mmadapt(saved):
        from mmadapt.convert import load_transformers

        return load_transformers(cls, directory, saved)
    checkpoint = Checkpoint.open(directory, what="model")
    return load_pretrained(lambda: cls(model_config(saved)), checkpoint, what=f"model {directory}",
                           tied=lambda model: model.backbone_tied_keys(), strict=strict, provenance=False)


def structure(cls: type, directory: str | os.PathLike) -> Any:
    """The model of `directory` with its parameters on the meta device (its structure, no weights read), for what
    needs only the parts' settings (the processor); a transformers directory is loaded as it comes."""
    saved = read_config(directory)
    if not is_mmadapt(saved):
        return load(cls, directory)
    with empty_weights():
        return cls(model_config(saved))
