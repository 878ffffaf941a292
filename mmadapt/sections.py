"""Settings sections from mappings: `build_section(cls, data, where)` builds a keyword-only dataclass (its nested
dataclasses too) from what a YAML file held, with the errors a user can act on: an unknown key names the closest valid
one and lists the valid keys; a value of the wrong kind names its dotted key.

The run config (`mmadapt.train.config.RunConfig`) is read with it, and so are the sections of a run's saved config
that loading a checkpoint needs (`mmadapt.loading`), which must not import training. Imports nothing of mmadapt.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from dataclasses import fields
from typing import Any, Literal, get_type_hints


def build_section(cls: type, data: Any, where: str) -> Any:
    """`cls` (a keyword-only dataclass) from the mapping `data`, its nested sections built the same way; `where` is
    the dotted prefix that names it in errors ("" for the top level, "lora." for a section)."""
    if not isinstance(data, dict):
        raise ValueError(f"config section {where.rstrip('.') or '(top level)'} must be a mapping, got {data!r}")
    names = {section_key(f): f.name for f in fields(cls)}
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.5)
            hint = f" Did you mean '{where}{close[0]}'?" if close else ""
            raise ValueError(f"unknown config key '{where}{key}'.{hint} Valid keys here: {sorted(names)}")
        hint = hints[names[key]]
        kwargs[names[key]] = build_section(hint, value, f"{where}{key}.") if dataclasses.is_dataclass(hint) else (
            coerce(value, hint, f"{where}{key}"))
    return cls(**kwargs)


def section_key(f: dataclasses.Field) -> str:
    """The key a field is written under: its name, or `metadata["key"]` for a key that is a Python keyword (a field
    `async_` read and written as `async`)."""
    return f.metadata.get("key", f.name)


def as_written(section: Any) -> dict[str, Any]:
    """`dataclasses.asdict(section)` under the keys a file writes (`section_key`), nested sections too."""
    return {section_key(f): as_written(value) if dataclasses.is_dataclass(value := getattr(section, f.name))
            else copy.deepcopy(value) for f in fields(section)}


def coerce(value: Any, hint: Any, key: str) -> Any:
    """Light type checking: numbers from YAML strings like '1e-4', lists to tuples, literal choices."""
    origin = getattr(hint, "__origin__", None)
    args = getattr(hint, "__args__", ())
    if value is None:
        return None
    if origin is dict and not isinstance(value, dict):
        raise ValueError(f"{key} must be a mapping, got {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list, got {value!r}")
        return tuple(value) if origin is tuple else list(value)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{key} must be one of {list(args)}, got {value!r}")
        return value
    if hint is float or (float in args and not isinstance(value, bool)):
        try:
            return float(value)
        except (TypeError, ValueError):
            if float in args and len(args) > 1:
                return value
            raise ValueError(f"{key} must be a number, got {value!r}") from None
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
    if hint is bool and not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value
