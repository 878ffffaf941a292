"""`auto_map`: what makes a loader run a model directory's own Python; dropped with a warning where read, never written.

A transformers config, tokenizer config or processor config may name classes through `auto_map` (`{"AutoTokenizer":
["tokenization_x.XTokenizer", null], ...}`): Python files in the directory, which `from_pretrained(...,
trust_remote_code=True)` imports and runs. mmadapt never runs code from a model directory: its loaders pass
`trust_remote_code=False`, and a class that exists only as such code is refused (`mmadapt.data.tokenizer
.RemoteCodeError`, `mmadapt.weights.hf_config`). An `auto_map` that rides along beside standard classes is dropped
where it is read, with a warning naming the file (`warn_dropped`), and nothing mmadapt writes - a model directory,
a training checkpoint, a transformers export - holds one in any of its JSON files (`drop_from_directory`): a
consumer that loads an export with `trust_remote_code=True` (common with vLLM and SGLang) never fetches and runs
another party's code through it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Final

AUTO_MAP: Final = "auto_map"
log = logging.getLogger(__name__)
_warned: set[str] = set()  # files already warned about in this process (a VLM's config is read once per part)


def auto_map_keys(value: Any, where: str = "") -> list[str]:
    """Where the JSON value `value` holds an `auto_map`, at any depth: dotted keys ("auto_map",
    "text_config.auto_map")."""
    if isinstance(value, list):
        return [key for k, item in enumerate(value) for key in auto_map_keys(item, f"{where}{k}.")]
    if not isinstance(value, dict):
        return []
    found = [f"{where}{AUTO_MAP}"] if AUTO_MAP in value else []
    return found + [key for k, item in value.items() if k != AUTO_MAP for key in auto_map_keys(item, f"{where}{k}.")]


def without_auto_map(value: Any) -> Any:
    """A copy of the JSON value `value` with every `auto_map` removed, at any depth."""
    if isinstance(value, list):
        return [without_auto_map(item) for item in value]
    if isinstance(value, dict):
        return {k: without_auto_map(item) for k, item in value.items() if k != AUTO_MAP}
    return value


def warn_dropped(file: str | os.PathLike, value: Any) -> bool:
    """Whether `value` (what was read from `file`) holds an `auto_map`; if so, a warning naming `file` (once per file
    and process) that it is dropped."""
    keys = auto_map_keys(value)
    if keys and os.path.abspath(file) not in _warned:
        _warned.add(os.path.abspath(file))
        log.warning("%s holds %s (classes defined by Python files in its directory): dropped, because mmadapt never "
                    "runs code from a model directory; nothing mmadapt saves or exports from it carries it", file,
                    " and ".join(keys))
    return bool(keys)


def drop_from_directory(directory: str | os.PathLike) -> list[Path]:
    """Rewrite, without its `auto_map`s, every JSON file under `directory` (being written by mmadapt) that holds one;
    the files rewritten. Each is replaced whole (a temporary file, then `os.replace`)."""
    rewritten = []
    for path in sorted(Path(directory).rglob("*.json")):
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError):
            continue  # not JSON after all: nothing a loader reads an auto_map from
        if not auto_map_keys(value):
            continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(without_auto_map(value), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        rewritten.append(path)
    return rewritten
