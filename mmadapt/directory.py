"""A model directory on disk: everything inference needs, written and read in this one module.

mmadapt's format (`VisionLanguageModel.save_pretrained`, every training checkpoint, `OUT/model`):
- `config.json`: {"mmadapt": the `ModelConfig` that rebuilds the model with no preset (each part's full options
  and provenance: path + SHA-256 of the checkpoint it came from), "processor": the encoder's image-processor
  settings, "chat_template": the backbone's template name, "carried": what it carries from its starting checkpoint};
- the weights: `model.safetensors`, or shards + `model.safetensors.index.json` above `max_shard_size`
  (`mmadapt.weights.save_weights`: tied tensors stored once);
- `carried.safetensors`, when the model carries weights of no part from the checkpoint it started from (Qwen3.5's
  `mtp.*`: `mmadapt.carried`), as that checkpoint stored them;
- the tokenizer's own files, when one is given, with the chat template the model was trained with
  (`save_tokenizer`; read back by `mmadapt.data.saved_tokenizer`).
`save` writes the directory whole into a sibling and swaps it in (`mmadapt.atomic`): a reader sees the old model or
the new one, never a mix; another model there is replaced only when asked (`overwrite=True`), other files never.
No JSON file of a directory written here (either format, a training checkpoint's model files) holds an `auto_map`,
and one read from a directory is dropped with a warning (`mmadapt.remote_code`): nothing mmadapt writes makes a
`trust_remote_code=True` loader run code.
A directory whose `config.json` has no "mmadapt" key is a transformers LLaVA / Qwen VLM directory, read as its
three parts (`mmadapt.convert`). Reading is strict: built on the meta device, every weight from the files
(`mmadapt.weights.load_pretrained`), a missing weight always an error.

What the model was trained with travels with it: `config.json`'s "data" holds the data settings that decide how a
prompt is rendered and a video sampled (`DataConfig.preprocessing()`: the chat template, its `template_kwargs`, the
video settings); `load` and `structure` attach them to the model (`data_settings(model)`), and `Processor.for_model`
defaults to them, so chat, eval and serving build inputs as training did. A model that never saw a run has none
(the defaults then apply).

`save(..., format="transformers")` writes a directory that transformers' `AutoProcessor` and
`AutoModelForImageTextToText` load, and that vLLM and SGLang serve as they serve the family's hub checkpoints
(docs/export.md): the model (`mmadapt.convert.save_transformers`), its processor side (image and video processor
configs, processor config, the tokenizer with the training chat template), written by the `processor_export` the caller
passes (`mmadapt.processor.export_processor`: that layer knows the data pipeline, which this one may not import; nothing
is installed here by another module's import), the weights it carries from its starting checkpoint (shards of their own,
`mmadapt.carried`) and `mmadapt_export.json`: mmadapt's version, the data settings, the SHA-256 of every file written
and of the checkpoint the weights were read from, what was carried, and what transformers' processor cannot express.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmadapt.atomic import StagedDirectory, recover
from mmadapt.carried import CARRIED_KEY, Carried, carried_of
from mmadapt.config import ModelConfig
from mmadapt.quantize import QUANTIZED_BASE_KEY, four_bit_parameters, nf4_targets
from mmadapt.remote_code import drop_from_directory, warn_dropped, without_auto_map
from mmadapt.run_directory import COMPLETE
from mmadapt.weights import (
    BIN,
    BIN_INDEX,
    MMADAPT_KEY,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    Checkpoint,
    Provenance,
    empty_weights,
    load_pretrained,
    save_weights,
)

CONFIG_FILE = "config.json"
EXPORT_RECORD = "mmadapt_export.json"  # beside a transformers export: its version, data settings, checksums, notes
DATA_KEY = "data"  # in config.json (mmadapt's format) and in the export record: the data settings
log = logging.getLogger(__name__)


def describe(model: Any) -> dict[str, Any]:
    """The `config.json` of `model`: its rebuildable config, its image processor's settings, its chat template and,
    when known, the data settings it was trained with."""
    described = {MMADAPT_KEY: model.resolved_config().to_dict(), "processor": model.encoder.processor_defaults(),
                 "chat_template": model.backbone_spec.chat_template, CARRIED_KEY: carried_of(model).record()}
    if (base := getattr(model, "quantized_base", None)) is not None:  # a QLoRA base: where its weights' originals are
        described[QUANTIZED_BASE_KEY] = base.to_dict()
    settings = data_settings(model)
    return {**described, DATA_KEY: settings} if settings else described


# ---- what a model remembers of where it came from -----------------------------------------------------------------
def data_settings(model: Any) -> dict[str, Any]:
    """A copy of the data settings `model` was trained with (`DataConfig.preprocessing()`), {} when unknown."""
    return copy.deepcopy(getattr(model, "data_settings", None) or {})


def set_data_settings(model: Any, settings: Mapping[str, Any] | None) -> Any:
    """Remember `settings` (`DataConfig.preprocessing()`, or None for none) as the data settings `model` was trained
    with: saved in its directories and exports, the defaults of `Processor.for_model`. Returns `model`."""
    if settings is not None and not isinstance(settings, Mapping):
        raise TypeError(f"data settings must be a mapping (DataConfig.preprocessing()), got {type(settings).__name__}")
    model.data_settings = copy.deepcopy(dict(settings or {}))
    return model


@dataclass(frozen=True)
class Source:
    """The weight files a model was read from, as they were then (name, size, modification time): an export
    records their SHA-256 while they are unchanged (`record`), without hashing anything at load."""

    path: str
    stamps: tuple[tuple[str, int, int], ...] = field(repr=False)

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> Source:
        return cls(str(checkpoint.path.resolve()), checkpoint.stamps())

    def record(self) -> dict[str, Any]:
        """{"path", "files", "sha256"} (`mmadapt.weights.Provenance`) of the files, or {"path", "sha256": None,
        "note"} when they changed or went away since the model was read."""
        try:
            checkpoint = Checkpoint.open(self.path, what="source")
            if checkpoint.stamps() == self.stamps:
                return Provenance(checkpoint).to_dict()
            note = "its weight files changed after the model was read from it"
        except (OSError, ValueError) as e:
            note = f"it cannot be read any more ({e})"
        return {"path": self.path, "sha256": None, "note": note}


def set_source(model: Any, checkpoint: Checkpoint) -> Any:
    """Remember that `model`'s weights were read from `checkpoint` (an export records its checksum). Returns
    `model`."""
    model.source = Source.of(checkpoint)
    return model


def set_carried(model: Any, directory: str | os.PathLike, saved: dict[str, Any]) -> Any:
    """Remember what the mmadapt directory `directory` (its `config.json`: `saved`) carries from its model's starting
    checkpoint (`mmadapt.carried`): its saves and exports carry it on. Returns `model`."""
    model.carried = Carried.in_directory(directory, saved)
    return model


def source_record(model: Any) -> dict[str, Any] | None:
    """Where `model`'s weights were read from, with their SHA-256 (`Source.record`); None for a model built in
    code. A model changed in memory after loading (trained further) still names the files it started from: the
    export's own files carry their checksums beside it."""
    source = getattr(model, "source", None)
    return source.record() if isinstance(source, Source) else None


# ---- the processor side of a transformers export, written by the writer the caller passes -------------------------
@dataclass(frozen=True)
class ProcessorExport:
    """What the processor side of a transformers export wrote: its `files`, the ids that end an answer (for the
    generation config) and its part of the export record (`mmadapt_version`, "data", "processor", "notes")."""

    files: tuple[str, ...]
    eos_token_ids: tuple[int, ...]
    record: dict[str, Any]


ProcessorWriter = Callable[[Any, Any, str, Path], ProcessorExport]
"""`writer(model, tokenizer or None, architecture, directory)`: writes a transformers export's processor side
(`mmadapt.processor.export_processor`)."""


def export_record(directory: str | os.PathLike) -> dict[str, Any]:
    """The `mmadapt_export.json` of a transformers export mmadapt wrote; {} for any other directory."""
    path = Path(directory) / EXPORT_RECORD
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    if not isinstance(record, dict):
        raise ValueError(f"{path} is not a JSON object; it is not a record mmadapt wrote")
    return record


def write_model_files(model: Any, directory: str | os.PathLike, tokenizer: Any = None) -> None:
    """Everything of a model directory in mmadapt's format but the model's own weights (which a training checkpoint
    writes its own way): the weights it carries from its starting checkpoint (`carried.safetensors`, when it carries
    any), `config.json` and, given one, the tokenizer's files; no JSON file of them holds an `auto_map`."""
    carried_of(model).write(directory)
    write_config(model, directory)
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)
    drop_from_directory(directory)


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
    saved = json.loads(path.read_text())
    warn_dropped(path, saved)
    return without_auto_map(saved)


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
    return CONFIG_FILE in names and bool(weights) and COMPLETE not in names


def save(model: Any, directory: str | os.PathLike, *, format: str = "mmadapt", tokenizer: Any = None,
         processor_export: ProcessorWriter | None = None, max_shard_size: int | str = "5GB",
         overwrite: bool = False) -> Path:
    """A complete model directory, written atomically: weights, `config.json` and, given one, the tokenizer's files;
    `format="transformers"` writes the equivalent transformers model with its processor and record (module
    docstring), its processor side by `processor_export` (required then: `mmadapt.processor.export_processor`). An
    export checks that the combination has a transformers equivalent and that the tokenizer fits the model before it
    writes anything.

    Everything goes to a sibling temporary directory that is swapped in whole (`mmadapt.atomic.StagedDirectory`): a
    reader, or a write that fails or is killed, leaves `directory` as it was or as the new model, never a mix. An
    existing model directory is replaced only with `overwrite=True`; a non-empty directory holding anything else is
    never written into (`TargetExistsError`). A storage error (a full disk) is a `CheckpointWriteError`."""
    if format not in ("mmadapt", "transformers"):
        raise ValueError(f"unknown format {format!r}; use 'mmadapt' or 'transformers'")
    if four_bit := four_bit_parameters(model):
        raise ValueError(f"the model's backbone holds {len(four_bit)} 4-bit (QLoRA) weights, which a model directory "
                         "never stores: dequantised, they would not be the weights the adapters were trained on. Fix: "
                         "export its run or checkpoint (mmadapt export OUT DIR: the adapters merged into the "
                         "source's full-precision weights), or save its adapters (mmadapt.lora.save_adapters)")
    exporting = format == "transformers"
    if exporting:
        from mmadapt.convert import export_architecture

        writer = _required_writer(processor_export)
        architecture = export_architecture(model)  # before anything is written
    with StagedDirectory(directory, what="model directory", overwrite=overwrite, recognise=is_model_directory,
                         checksums=exporting) as stage:
        if exporting:
            _save_transformers(model, stage, architecture, writer(model, tokenizer, architecture, stage.path),
                               max_shard_size)
        else:
            save_weights(model.state_dict(), stage.path, max_shard_size=max_shard_size, on_file=stage.record)
            write_model_files(model, stage.path, tokenizer)
    return Path(directory)


def _required_writer(writer: ProcessorWriter | None) -> ProcessorWriter:
    if writer is None:
        raise ValueError("format='transformers' writes the processor side too (image / video processor configs, the "
                         "tokenizer with the training chat template), which this layer cannot: pass "
                         "processor_export=mmadapt.processor.export_processor")
    return writer


def _save_transformers(model: Any, stage: StagedDirectory, architecture: str, processor: ProcessorExport,
                       max_shard_size: int | str) -> None:
    """The transformers model beside its processor files (written by `processor`) and the weights it carries from its
    starting checkpoint (`mmadapt.carried`), then the export record with the SHA-256 of every file."""
    from mmadapt.convert import save_transformers

    save_transformers(model, stage.path, max_shard_size=max_shard_size, eos_token_ids=list(processor.eos_token_ids))
    carried = carried_of(model)
    carried.add_to_export(stage.path, max_shard_size=max_shard_size)
    log.info("export: %s", carried.note())
    drop_from_directory(stage.path)  # no auto_map in any JSON file: a trust_remote_code loader runs nothing
    parts = {part: getattr(model.config, part).name for part in ("encoder", "projector", "backbone")}
    record = {**processor.record, "format": "transformers", "architecture": architecture, "components": parts,
              "loaded_from": source_record(model), CARRIED_KEY: carried.record(),
              "notes": [*processor.record.get("notes", []), carried.note(), *getattr(model, "base_notes", [])],
              "files": stage.settle()}
    stage.write_bytes(EXPORT_RECORD, (json.dumps(record, indent=2) + "\n").encode())


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
    """`cls` (the model class) from an mmadapt or transformers model directory, with the data settings it was
    trained with and where it was read from attached (module docstring)."""
    saved = read_config(directory)
    if not is_mmadapt(saved):
        from mmadapt.convert import load_transformers

        model = load_transformers(cls, directory, saved)  # an unsupported model_type is refused before any weight
        checkpoint = Checkpoint.open(directory, what="model")
        settings = export_record(directory).get(DATA_KEY)
    else:
        checkpoint = Checkpoint.open(directory, what="model")
        model = load_pretrained(lambda: cls(model_config(saved)), checkpoint, what=f"model {directory}",
                                tied=lambda model: model.backbone_tied_keys(), strict=strict, provenance=False,
                                quantize=nf4_targets())
        set_carried(model, directory, saved)
        settings = saved.get(DATA_KEY)
    return set_source(set_data_settings(model, settings), checkpoint)


def structure(cls: type, directory: str | os.PathLike) -> Any:
    """The model of `directory` with its parameters on the meta device (its structure, no weights read), for what
    needs only the parts' settings (the processor), with its data settings attached; a transformers directory is
    loaded as it comes."""
    saved = read_config(directory)
    if not is_mmadapt(saved):
        return load(cls, directory)
    with empty_weights():
        return set_data_settings(cls(model_config(saved)), saved.get(DATA_KEY))
