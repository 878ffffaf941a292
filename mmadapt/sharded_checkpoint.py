"""A sharded checkpoint's files (PyTorch Distributed Checkpoint, DCP), read without trusting them.

A sharded training checkpoint (`mmadapt.train.checkpoint`, mmadapt >= 0.26) keeps its model and optimizer state in
`STATE_DIR/`, as `torch.distributed.checkpoint` writes it: every rank's own shards in `__<rank>_<n>.distcp`, and
`.metadata`, which says where each tensor's chunks are. Under the state's top keys `model` and `optimizer` DCP
flattens the names: `model.<parameter name>`, `optimizer.state.<parameter name>.exp_avg`, ...

DCP reads `.metadata` with `pickle.load` and a non-tensor value (an optimizer's `param_groups`) with
`torch.load(weights_only=False)`: either runs whatever code a crafted file names. Here both are read with an
allow-list instead (`SafeReader`, `SafeLoadPlanner`): `.metadata` may name only DCP's own metadata classes and
torch's sizes, dtypes and layouts, and a value only what `torch.load(weights_only=True)` accepts; anything else is
`UnsafeCheckpointError` naming the file and the name it asked for. Every checkpoint mmadapt loads goes through them.

`ModelTensors(checkpoint)` reads the model's tensors of a sharded checkpoint by name, a few at a time, in one process
(no process group): what `mmadapt export` and every loader (chat, eval, serve) read a sharded checkpoint with, never
holding more than the tensors asked for.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

# DCP warns that it "assumes the intent is to save (load) in a single process" even when told so (no_dist=True)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STATE_DIR = "state"  # a sharded checkpoint's DCP directory
METADATA = ".metadata"
MODEL, OPTIMIZER = "model", "optimizer"  # the state's top keys


class UnsafeCheckpointError(ValueError):
    """A sharded checkpoint's file names something other than the data a checkpoint holds (code would run)."""


def is_sharded(checkpoint: str | os.PathLike) -> bool:
    """Whether `checkpoint` (a training checkpoint directory) holds its state as DCP shards."""
    return (Path(checkpoint) / STATE_DIR / METADATA).is_file()


def state_files(checkpoint: str | os.PathLike) -> list[str]:
    """A sharded checkpoint's state files, relative to the checkpoint (`state/.metadata`, `state/__0_0.distcp`)."""
    directory = Path(checkpoint) / STATE_DIR
    return sorted(f"{STATE_DIR}/{p.name}" for p in directory.iterdir() if p.is_file())


_TORCH_NAMES = {"Size", "strided", "sparse_coo", "contiguous_format", "channels_last", "channels_last_3d",
                "preserve_format"} | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint._extension")


_PLAIN = {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
          ("pathlib", "PurePosixPath"), ("pathlib", "Path"), ("pathlib._local", "PosixPath")}  # data, no code


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only DCP's metadata: its dataclasses and enums, torch's sizes, dtypes and layouts."""

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _TORCH_NAMES:
            return getattr(torch, name)
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module in _DCP_MODULES:
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise UnsafeCheckpointError(
            f"{self.source} asks for {module}.{name}, which is not part of a checkpoint's metadata: reading it would "
            "run code the file names. It was not written by mmadapt (or was altered); load only checkpoints you trust, "
            "from their own run directory.")


def _check_files(metadata: Any, source: Path) -> None:
    """Every file `.metadata` points DCP at is a plain name of a file beside it (DCP joins the name to the directory:
    `../x` or an absolute path would read outside the checkpoint)."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise UnsafeCheckpointError(f"{source} points at {name!r}, which is not a file name inside "
                                        f"{source.parent}: a checkpoint's shards are files beside its metadata. It "
                                        "was not written by mmadapt (or was altered).")


def _filesystem_reader() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """DCP's `FileSystemReader`, its `.metadata` read with an allow-list (see the module docstring)."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            path = Path(self._get_metadata_path(kwargs.get("rank")))
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f, path).load()
            _check_files(metadata, path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _load_planner(everything: bool = False) -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class SafeLoadPlanner(_EmptyStateDictLoadPlanner if everything else DefaultLoadPlanner):  # type: ignore[misc]
        """DCP's load planner, a non-tensor value read with `torch.load(weights_only=True)`."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._nested_dict import set_element

            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise UnsafeCheckpointError(f"checkpoint value {read_item.dest_index.fqn} is not plain data ({e}); "
                                            "it was not written by mmadapt (or was altered)") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner


def reader(checkpoint: str | os.PathLike) -> Any:
    """A `SafeReader` of `checkpoint`'s state (a `torch.distributed.checkpoint.FileSystemReader`)."""
    return _filesystem_reader()(Path(checkpoint) / STATE_DIR)


def planner() -> Any:
    """A `SafeLoadPlanner` (a `torch.distributed.checkpoint.DefaultLoadPlanner`)."""
    return _load_planner()()


def read_all(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """Everything a sharded checkpoint's state holds, whole, in this process ({"model": {name: tensor}, "optimizer":
    {"state": ..., "param_groups": ...}}): for a small model, a test, a conversion; training loads with `load`."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # as DCP's dcp_to_torch_save does

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader(checkpoint), planner=_load_planner(everything=True)(), no_dist=True)
    return state


def load(state: dict[str, Any], checkpoint: str | os.PathLike, *, process_group: Any = None) -> None:
    """Fill `state` ({"model": ..., "optimizer": ...}, each rank its own shards' tensors, as DCP loads) in place from
    `checkpoint`, resharded to whatever shards `state`'s tensors are; in one process when no group is running."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    no_dist = not (dist.is_available() and dist.is_initialized())
    dcp.load(state, storage_reader=reader(checkpoint), planner=planner(), process_group=process_group,
             no_dist=no_dist)


class ModelTensors:
    """The model tensors of a sharded checkpoint, by name (without the `model.` prefix), read in one process.

    `keys()`, `shape(key)`, `dtype(key)` and `nbytes(key)` come from `.metadata` (nothing else is read); `read(keys)`
    reads those tensors whole (every rank's chunks), each into a fresh tensor."""

    def __init__(self, checkpoint: str | os.PathLike) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.checkpoint = Path(checkpoint)
        self.metadata = reader(checkpoint).read_metadata()
        prefix = MODEL + "."
        self._meta = {fqn[len(prefix):]: meta for fqn, meta in self.metadata.state_dict_metadata.items()
                      if fqn.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}

    def keys(self) -> list[str]:
        return list(self._meta)

    def __contains__(self, key: str) -> bool:
        return key in self._meta

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self._meta[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self._meta[key].properties.dtype

    def nbytes(self, key: str) -> int:
        return self.shape(key).numel() * self.dtype(key).itemsize

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """{key: tensor} of `keys`, read from every shard that holds a part of them."""
        keys = list(keys)
        missing = [k for k in keys if k not in self._meta]
        if missing:
            raise KeyError(f"{self.checkpoint} holds no model tensor {missing[0]!r}")
        if not keys:
            return {}
        import torch.distributed.checkpoint as dcp

        state = {MODEL: {k: torch.empty(self.shape(k), dtype=self.dtype(k)) for k in keys}}
        dcp.load(state, storage_reader=reader(self.checkpoint), planner=planner(), no_dist=True)
        return state[MODEL]

    def tensor(self, key: str) -> torch.Tensor:
        return self.read([key])[key]
