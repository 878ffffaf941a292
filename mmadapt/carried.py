"""Weights of the starting checkpoint that the model does not use, carried unchanged into every save of it.

A hub checkpoint may hold tensors of no part of the model: a multi-token-prediction head (`mtp.*`), which serving
engines use for speculative decoding and transformers drops at load. When the whole model started from one checkpoint
(its encoder, projector and backbone all read from it), `Carried.at_start` finds them: the checkpoint's keys that no
part's key rules claim (`mmadapt.weights.Provenance.claimed`), computed from the key names, never guessed by prefix.
They are never loaded into the model, never trained and never cast: the model remembers where they are
(`model.carried`), and every directory it is saved as holds them with the names, dtypes and bytes the checkpoint gave
them:

- mmadapt's format (a model directory, every training checkpoint): `carried.safetensors` beside the weights, and
  config.json's "carried" record. Reading the directory back carries them on, so an export made long after the start,
  in another process, with the starting checkpoint deleted, still holds them;
- transformers' format (an export): shards of their own beside the model's, every weight file numbered
  `model-0000k-of-0000n.safetensors` and listed in `model.safetensors.index.json` (`add_to_export`); the export
  record's "carried" and "notes" say what was carried from where.

A model that did not start from one checkpoint carries none, and its record says why: built from presets (random
init), parts read from several checkpoints (which of one checkpoint's other weights belong with the new model cannot
be told), a starting checkpoint with no weights outside the model, or a directory written before these were recorded.
The files they are read from must still be the ones seen when the model was read (name, size, modification time): a
changed or missing file is an error that names it, never a silent change.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmadapt.atomic import save_safetensors
from mmadapt.weights import MMADAPT_KEY, SAFETENSORS, SAFETENSORS_INDEX, Checkpoint

CARRIED_FILE = "carried.safetensors"  # in an mmadapt model directory or training checkpoint
CARRIED_KEY = "carried"  # config.json's (mmadapt's format) and the export record's
RANDOM_INIT = "started from no checkpoint (random init): it carries no weights from one"
Stamps = tuple[tuple[str, int, int], ...]


class CarriedWeightsError(ValueError):
    """The carried tensors cannot be read as they were when the model was read."""


@dataclass(frozen=True)
class Carried:
    """The tensors a model carries from the checkpoint it started from (see the module docstring).

    `origin`: that checkpoint's path (None: none); `names`: the tensors, as it named them; `location`: where they are
    read from now (the starting checkpoint, or a saved directory's `carried.safetensors`) with its files' `stamps` when
    the model was read; `why`: when `names` is empty, why the model carries none."""

    origin: str | None
    names: tuple[str, ...] = ()
    location: str | None = field(default=None, repr=False)
    stamps: Stamps = field(default=(), repr=False)
    why: str = ""

    @classmethod
    def none(cls, why: str, origin: str | None = None) -> Carried:
        return cls(origin, why=why)

    @classmethod
    def at_start(cls, parts: Mapping[str, Any]) -> Carried:
        """What a model made of `parts` ({"encoder": module, ...}, each with the `provenance` of the checkpoint it was
        read from, or none) carries from the checkpoint it started from."""
        provenances = {part: getattr(module, "provenance", None) for part, module in parts.items()}
        paths = {p.path for p in provenances.values() if p is not None}
        if not paths:
            return cls.none(RANDOM_INIT)
        if len(paths) > 1 or None in provenances.values():
            where = ", ".join(f"{part} {p.path if p else 'random init'}" for part, p in provenances.items())
            return cls.none(f"its parts did not all start from one checkpoint ({where}): it carries none (a "
                            "checkpoint's weights outside the model are carried only when the whole model started "
                            "from it)")
        (path,) = paths
        checkpoint = Checkpoint.open(path, what="the starting checkpoint")
        if checkpoint.model_type == MMADAPT_KEY:  # a directory mmadapt saved: what it carries, it carries on
            return cls.in_directory(checkpoint.directory, checkpoint.config)
        claimed = [p.claimed for p in provenances.values()]
        if any(keys is None for keys in claimed):
            return cls.none(f"started from {path}, whose weights outside the model were not recorded", path)
        used = frozenset().union(*claimed)
        names = tuple(sorted(key for key in checkpoint.keys() if key not in used))
        if not names:
            return cls.none(f"the starting checkpoint {path} had no weights outside the model", path)
        return cls(path, names, path, checkpoint.stamps())

    @classmethod
    def in_directory(cls, directory: str | os.PathLike, config: Mapping[str, Any]) -> Carried:
        """What the model of an mmadapt directory (a model directory or a training checkpoint, `config` its
        config.json) carries: its "carried" record and `carried.safetensors`."""
        record = config.get(CARRIED_KEY)
        if not isinstance(record, dict):
            return cls.none(f"unknown: {directory} was written before mmadapt kept a starting checkpoint's weights "
                            "outside the model")
        if not record.get("tensors"):
            return cls.none(str(record.get("note") or RANDOM_INIT), record.get("from"))
        file = Path(directory) / CARRIED_FILE
        checkpoint = Checkpoint.open(file, what=f"the weights {directory} carries")
        names = tuple(sorted(checkpoint.keys()))
        if len(names) != record["tensors"]:
            raise CarriedWeightsError(f"{file} holds {len(names)} tensors, but {directory}'s config.json records "
                                      f"{record['tensors']}: the directory is damaged. Save the model again.")
        return cls(record.get("from"), names, str(file.resolve()), checkpoint.stamps())

    # ---- what they are ----------------------------------------------------------------------------------------------
    def prefixes(self) -> dict[str, int]:
        """How many carried tensors each first name component holds ({"mtp": 15})."""
        return dict(Counter(name.split(".")[0] for name in self.names))

    def note(self) -> str:
        if not self.names:
            return self.why
        groups = ", ".join(f"{prefix}.* ({count})" for prefix, count in self.prefixes().items())
        return (f"carried {len(self.names)} tensors from the starting checkpoint {self.origin} unchanged (names, "
                f"dtypes and bytes as it stored them): {groups}. They are no part of the model: mmadapt neither "
                "trained nor used them")

    def record(self) -> dict[str, Any]:
        """config.json's and the export record's "carried": {"from", "tensors", "prefixes", "note"}."""
        return {"from": self.origin, "tensors": len(self.names), "prefixes": self.prefixes(), "note": self.note()}

    # ---- reading and writing them -----------------------------------------------------------------------------------
    def read(self) -> dict[str, torch.Tensor]:
        """{name: tensor} of every carried tensor, from `location`, which must be as it was when the model was read."""
        if not self.names:
            return {}
        try:
            checkpoint = Checkpoint.open(self.location, what="carried weights")
            problem = None if checkpoint.stamps() == self.stamps else "its files changed since the model was read"
        except (OSError, ValueError) as e:
            problem = f"it cannot be read any more ({e})"
        if problem is not None:
            raise CarriedWeightsError(
                f"the {len(self.names)} tensors carried from {self.origin} are read from {self.location} when the "
                f"model is saved, but {problem}: they cannot be carried unchanged. Fix: restore {self.location} as it "
                "was, or read the model again from its newest checkpoint or model directory.")
        return {name: checkpoint.tensor(name) for name in self.names}

    def write(self, directory: str | os.PathLike) -> str | None:
        """`carried.safetensors` in `directory` (a model directory or checkpoint being written); its name, or None
        when nothing is carried (no file)."""
        if not self.names:
            return None
        save_safetensors(self.read(), Path(directory) / CARRIED_FILE, metadata={"format": "pt"})
        return CARRIED_FILE

    def add_to_export(self, directory: str | os.PathLike, *, max_shard_size: int | str) -> None:
        """Add the carried tensors to the transformers model saved in `directory` as shards of their own (split at
        `max_shard_size`): the model's files are renumbered, not rewritten, to `model-0000k-of-0000n.safetensors`, and
        `model.safetensors.index.json` maps every tensor to its file, as the hub's sharded checkpoints do."""
        if not self.names:
            return
        from huggingface_hub import split_torch_state_dict_into_shards

        directory, tensors = Path(directory), self.read()
        weight_map, metadata = _weight_map(directory)
        clash = sorted(set(tensors) & set(weight_map))
        if clash:
            raise CarriedWeightsError(f"carried tensors {clash[:5]} have the names of the exported model's own "
                                      "weights: they were taken for weights of no part by mistake")
        split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
        files, groups = sorted(set(weight_map.values())), list(split.filename_to_tensors.values())
        total = len(files) + len(groups)
        names = [f"model-{k:05d}-of-{total:05d}.safetensors" for k in range(1, total + 1)]
        renamed = dict(zip(files, names, strict=False))
        for old, new in renamed.items():
            os.replace(directory / old, directory / new)
        weight_map = {key: renamed[file] for key, file in weight_map.items()}
        for keys, name in zip(groups, names[len(files):], strict=True):
            save_safetensors({key: tensors[key] for key in keys}, directory / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(keys, name))
        metadata = {**metadata, "total_size": metadata.get("total_size", 0) + split.metadata["total_size"]}
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _weight_map(directory: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """({tensor: file}, the index's metadata) of the safetensors a transformers model was saved as (one file or an
    index)."""
    from safetensors import safe_open

    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        saved = json.loads(index.read_text())
        return dict(saved["weight_map"]), dict(saved.get("metadata") or {})
    file = directory / SAFETENSORS
    with safe_open(str(file), framework="pt") as reader:
        keys = list(reader.keys())
    with open(file, "rb") as f:
        header = int.from_bytes(f.read(8), "little")  # safetensors: 8-byte header length, header, then the data
    return dict.fromkeys(keys, SAFETENSORS), {"total_size": file.stat().st_size - 8 - header}


def carried_of(model: Any) -> Carried:
    """What `model` carries from its starting checkpoint (`model.carried`, set when it was built or read)."""
    value = getattr(model, "carried", None)
    return value if isinstance(value, Carried) else Carried.none("unknown: the model does not say what it carries")
