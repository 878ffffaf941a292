"""One generic registry: components found by exact name.

Backbones, encoders, projectors (and later chat templates) each have one `Registry`.
Entries are light *specs* (names, descriptions, dotted paths to classes); the heavy
modules they point at are imported only when a component is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownComponentError(KeyError, ValueError):
    """A name that no registry entry carries. Lists the known names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps exact names to entries. Duplicates and unknown names raise."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
        if name in self._entries:
            raise ValueError(
                f"{self.kind} {name!r} is already registered; pick another name or "
                f"call unregister({name!r}) first"
            )
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        self.get(name)
        del self._entries[name]

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise UnknownComponentError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(sorted(self._entries.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def import_object(path: str) -> Any:
    """Resolve ``"package.module:Attribute"``; the import happens here, lazily."""
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"expected 'module:attribute', got {path!r}")
    return getattr(importlib.import_module(module_name), attr)
