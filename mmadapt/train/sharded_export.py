"""A sharded checkpoint's model written as a model directory without a gather: `export_sharded(checkpoint, dst)`
(mmadapt's format), `transformers_from_sharded(checkpoint, dst)` (transformers').

What `mmadapt.train.export.export` calls for a sharded training checkpoint (`mmadapt.sharded_checkpoint`). The
directory is the one `load_checkpoint_model` + `save_pretrained` write (the same file names, split, index and bitwise
tensors, the same `config.json`, tokenizer and carried weights), but the whole model is never held:

- the model is built twice on the meta device (no memory): with its run's LoRA layers, as training built it (its keys
  are the checkpoint's), and plain, whose `state_dict()` order, shapes and tied names are the merged model's;
- the files are planned from sizes alone (dtypes from `.metadata`), split as `mmadapt.weights.save_weights` splits;
- each file's tensors are then read (one DCP load), merged and written before the next file's are read. A tensor of a
  LoRA'd module comes from a copy of that module alone, materialised from the checkpoint and merged by
  `mmadapt.lora.merge_lora`: the same arithmetic on the same inputs, so bitwise the merged model's weights.

So at most one file's tensors (with the LoRA factors of its modules) are held at once: `max_shard_size` bounds the
memory, except that a single tensor larger than it is a file of its own. `StreamedExport.peak_bytes` counts it.
transformers' format is written from such a directory, memory-mapped (`transformers_from_sharded`).
"""

from __future__ import annotations

import copy
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmadapt import directory as model_directory
from mmadapt.atomic import CheckpointWriteError, StagedDirectory
from mmadapt.convert import export_architecture
from mmadapt.loading import TrainedWith, trained_structure, with_origin
from mmadapt.lora import lora_modules, merge_lora
from mmadapt.model import VisionLanguageModel
from mmadapt.sharded_checkpoint import ModelTensors
from mmadapt.weights import Checkpoint, MissingWeightsError, empty_weights, write_shards

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamedExport:
    """What `export_sharded` wrote: the weight `files`, the most tensor bytes it held at once (`peak_bytes`: distinct
    storages of one file's inputs and outputs) and the model's (`model_bytes`, tied tensors once)."""

    files: tuple[str, ...]
    peak_bytes: int
    model_bytes: int


class MergedTensors:
    """The merged model of sharded checkpoint `path` (of `run`), by name, read a few tensors at a time.

    `planned` holds, in the merged model's `state_dict()` order and with tied tensors once (`aliases`: {alias: stored
    name}), a meta tensor of each tensor's shape and dtype; `read(names)` materialises those tensors."""

    def __init__(self, path: Path, run: TrainedWith | Any) -> None:
        saved = model_directory.read_config(path)
        self.path, self.tensors = path, ModelTensors(path)
        with empty_weights():
            self.trained = trained_structure(saved, run)
            plain = VisionLanguageModel(model_directory.model_config(saved))
        if plain.backbone_tied_keys():  # as loading ties them: one tensor under both names (outside empty_weights,
            plain.tie_weights()  # whose parameter hook would make the tied one a new meta parameter)
        self.model = with_origin(plain, path, saved, run, Checkpoint.open(path, what="checkpoint"))
        self.lora = set(lora_modules(self.trained))
        self.state = plain.state_dict(keep_vars=True)
        self.aliases = _aliases(self.state)
        self.sources, self.planned = self._plan()

    def _plan(self) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
        """({key: the checkpoint key it is read from}, {key: meta tensor of its shape and dtype}) of every tensor the
        files hold; a tensor the checkpoint lacks, or holds with another shape, is an error before anything is
        written."""
        sources, planned, missing, wrong = {}, {}, [], []
        for key, value in self.state.items():
            if key in self.aliases:
                continue
            source = self._source(key, [k for k, v in self.aliases.items() if v == key])
            if source is None:
                missing.append(key)
            elif source in self.tensors and self.tensors.shape(source) != value.shape:
                wrong.append(f"{source} {tuple(self.tensors.shape(source))} vs {tuple(value.shape)}")
            else:
                sources[key] = source
                dtype = self.tensors.dtype(source) if source in self.tensors else value.dtype
                planned[key] = torch.empty(value.shape, dtype=dtype, device="meta")
        for unit in self.lora:  # the LoRA factors too: a merge reads every tensor of its module
            for name, value in self.trained.get_submodule(unit).state_dict(keep_vars=True).items():
                name = f"{unit}.{name}"
                if name not in self.tensors:
                    missing.append(name)
                elif self.tensors.shape(name) != value.shape:
                    wrong.append(f"{name} {tuple(self.tensors.shape(name))} vs {tuple(value.shape)}")
        missing, wrong = sorted(set(missing)), sorted(set(wrong))
        if missing or wrong:
            problem = (f"lacks {len(missing)} of its model's tensors: {missing[:5]}" if missing else
                       f"holds {len(wrong)} weights with another shape than its model's (checkpoint vs model): "
                       f"{wrong[:5]}")
            raise MissingWeightsError(f"checkpoint {self.path} {problem}. Its config.json and state/ do not belong "
                                      "together: is it a complete checkpoint of this run?")
        return sources, planned

    def _unit(self, key: str) -> str | None:
        """The outermost LoRA'd module that `key` belongs to (None: a plain tensor)."""
        parts = key.split(".")
        return next((p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in self.lora), None)

    def _source(self, key: str, aliases: list[str]) -> str | None:
        """The checkpoint key `key`'s dtype is read from (its own, a tied name's, or its LoRA'd base layer's); for a
        buffer the checkpoint lacks, `key` itself (the model's computed buffer); None: missing."""
        unit = self._unit(key)
        if unit is not None:
            rest = key[len(unit):]  # under nested LoRA layers (peft's parameter wrappers), one base_layer each
            return next((c for depth in (1, 2, 3) if (c := unit + ".base_layer" * depth + rest) in self.tensors), None)
        found = next((k for k in (key, *aliases) if k in self.tensors), None)
        if found is None and not isinstance(self.state[key], nn.Parameter):
            return key  # a persistent buffer the checkpoint lacks: the one the model computes (as loading keeps it)
        return found

    @property
    def model_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.planned.values())

    def read(self, keys: list[str]) -> tuple[dict[str, torch.Tensor], int]:
        """({key: tensor} of `keys`, the bytes held meanwhile: distinct storages of everything read and made)."""
        units = list(dict.fromkeys(u for k in keys if (u := self._unit(k)) is not None))
        modules = {unit: copy.deepcopy(self.trained.get_submodule(unit)) for unit in units}
        inputs = {f"{unit}.{k}" for unit, module in modules.items() for k in module.state_dict()}
        inputs |= {self.sources[k] for k in keys if self._unit(k) is None and self.sources[k] in self.tensors}
        read = self.tensors.read(sorted(inputs))
        merged = {}
        for unit, module in modules.items():
            merged.update(self._merge(unit, module, read))
        out = {}
        for key in keys:
            value = merged[key] if key in merged else read.get(self.sources[key], self.state[key])
            planned = self.planned[key]
            if value.shape != planned.shape or value.dtype != planned.dtype:
                raise MissingWeightsError(f"checkpoint {self.path}: {key} is {value.dtype} {tuple(value.shape)}, the "
                                          f"model's {planned.dtype} {tuple(planned.shape)}")
            out[key] = value.detach().contiguous()
        return out, _storage_bytes([*read.values(), *out.values()])

    def _merge(self, unit: str, module: nn.Module, read: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{model key: tensor} of LoRA'd module `unit` merged: its copy `module` materialised from `read` and merged
        by `merge_lora` inside a holder whose path to it is the model's (the same names, the same steps)."""
        module.load_state_dict({k: read[f"{unit}.{k}"] for k in module.state_dict()}, strict=True, assign=True)
        holder = nn.Module()
        parent = holder
        *path, child = unit.split(".")
        for name in path:
            parent.add_module(name, nn.Module())
            parent = getattr(parent, name)
        parent.add_module(child, module)
        merge_lora(holder)
        return {f"{unit}.{k}": v for k, v in holder.get_submodule(unit).state_dict().items()}


def _aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """{alias: stored name} of the tensors `state` holds under several names (tied), each stored under its first name,
    as `mmadapt.weights.without_aliases` decides on real tensors (here: the same parameter object)."""
    stored: dict[int, str] = {}
    aliases = {}
    for key, value in state.items():
        if id(value) in stored:
            aliases[key] = stored[id(value)]
        else:
            stored[id(value)] = key
    return aliases


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def export_sharded(path: Path, dst: Path, run: TrainedWith | Any, *, tokenizer: Any = None,
                   max_shard_size: int | str = "5GB", overwrite: bool = False) -> StreamedExport:
    """Write the model of sharded checkpoint `path` (of `run`) to `dst` in mmadapt's format, one weight file's tensors
    at a time (module docstring), atomically as `mmadapt.directory.save` writes (`overwrite`: replace a model
    directory there)."""
    merged = MergedTensors(path, run)
    peak = 0

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        nonlocal peak
        tensors, held = merged.read(keys)
        peak = max(peak, held)
        return tensors

    with StagedDirectory(dst, what="model directory", overwrite=overwrite,
                         recognise=model_directory.is_model_directory) as stage:
        files = write_shards(merged.planned, merged.aliases, read, stage.path, max_shard_size=max_shard_size,
                             on_file=stage.record)
        model_directory.write_model_files(merged.model, stage.path, tokenizer)
    return StreamedExport(tuple(files), peak, merged.model_bytes)


def transformers_from_sharded(path: Path, dst: Path, run: TrainedWith | Any, *, tokenizer: Any = None,
                              max_shard_size: int | str = "5GB", overwrite: bool = False) -> None:
    """Write the model of sharded checkpoint `path` (of `run`) to `dst` in transformers' format without a gather.

    transformers' `save_pretrained` writes an export from a whole model (it reverts its weight conversions over the
    whole state dict), so it is given one whose tensors are memory-mapped: the model directory `export_sharded` writes
    (one file's tensors at a time) into a staging directory beside `dst` (on its filesystem: the model's size of disk
    space meanwhile), read back by `from_pretrained` (safetensors maps its files: their pages are read as the export is
    written and are the page cache's, not memory of the process's own), then exported exactly as a loaded model is
    (`mmadapt.directory.save`), its record naming `path` as the source. The staging directory is removed after."""
    from mmadapt.directory import structure
    from mmadapt.processor import export_processor

    export_architecture(structure(VisionLanguageModel, path))  # no transformers equivalent: refused before writing
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dst.name}.staging-", dir=dst.parent) as staging:
        staged = Path(staging) / "streamed"
        try:
            export_sharded(path, staged, run, tokenizer=tokenizer, max_shard_size=max_shard_size)
        except CheckpointWriteError as e:
            raise CheckpointWriteError(
                f"could not export {path} to {dst}: the staging directory beside it (the model in mmadapt's format, "
                f"read back memory-mapped for transformers' save; it needs the model's size of free space in "
                f"{dst.parent}) could not be written ({e}). {dst} was not touched and the staging directory is "
                "removed. Fix: free disk space there (or export in mmadapt's format: it needs no staging), then "
                "export again.") from e
        model = VisionLanguageModel.from_pretrained(staged)
        model_directory.set_source(model, Checkpoint.open(path, what="checkpoint"))  # the export records the source
        model.save_pretrained(dst, format="transformers", tokenizer=tokenizer, processor_export=export_processor,
                              max_shard_size=max_shard_size, overwrite=overwrite)
        del model  # its maps of the staging files, before they are removed
