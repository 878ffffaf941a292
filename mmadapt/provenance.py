"""Where a pretrained part came from (`Provenance`): its checkpoint's path, weight files and their SHA-256, and which of
its keys the part read; hashed once per set of files in a background thread while the model is built. Re-exported by
`mmadapt.weights`, which records it for every part it loads.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

_DIGESTS: dict[tuple, Future[str]] = {}


def _sha256(paths: list[Path], result: Future[str]) -> None:
    digest = hashlib.sha256()
    try:
        for path in paths:
            with open(path, "rb") as f:
                buffer = bytearray(1 << 20)  # one small reused buffer: no peak-memory cost
                view = memoryview(buffer)
                while n := f.readinto(buffer):
                    digest.update(view[:n])
        result.set_result(digest.hexdigest())
    except OSError as e:
        result.set_exception(e)


class Provenance:
    """Where a pretrained part came from: path, weight files, and their SHA-256; `claimed`: the checkpoint's keys
    that the part's key rules claim as its own (None: not recorded), from which `mmadapt.carried` tells the weights of
    no part of a model.

    The hash runs in a background thread while the model is built (hashlib releases the GIL), once per
    set of files: the three parts of one VLM directory share it.
    """

    def __init__(self, checkpoint: Any, *, claimed: Iterable[str] | Mapping[str, str] | None = None) -> None:
        self.path = str(checkpoint.path.resolve())
        self.claimed = None if claimed is None else frozenset(claimed)
        # {part key: checkpoint key} when the rules' renaming is given ({checkpoint key: part key}): where each of the
        # part's weights was read (a QLoRA base's full-precision weights, `mmadapt.qlora`)
        self.read_from = ({target: source for source, target in claimed.items()} if isinstance(claimed, Mapping)
                          else None)
        self.files = [str(f.relative_to(checkpoint.path)) if f != checkpoint.path else f.name
                      for f in checkpoint.files]
        key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in checkpoint.files)
        if key not in _DIGESTS:  # a daemon thread: a script that loads and exits does not wait for the hash
            _DIGESTS[key] = Future()
            threading.Thread(target=_sha256, args=(list(checkpoint.files), _DIGESTS[key]), daemon=True,
                             name="mmadapt-sha256").start()
        self._digest = _DIGESTS[key]

    @property
    def sha256(self) -> str:
        return self._digest.result()

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "files": self.files, "sha256": self.sha256}
