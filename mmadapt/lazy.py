"""A package's public names imported on first use (PEP 562): `__getattr__, __dir__ = lazy_names(__name__, EXPORTS)`.

A package `__init__` that imports its modules eagerly makes every `import mmadapt.pkg.anything` pay for all of them
(torch, transformers, torchvision): a command's `--help` and `mmadapt serve` would load what they never use. With
`lazy_names`, the `__init__` maps each public name to the module that defines it (`EXPORTS`, beside `if
TYPE_CHECKING:` imports for readers and type checkers); `from mmadapt.pkg import Name` imports that module when the
name is first read, and the value is then kept as a plain attribute. A public name that is also a submodule's name
(`mmadapt.numerics.dump`, the function, in `numerics/dump.py`) stays the name's value once the submodule is imported,
as an eager `from .dump import dump` left it (the package's class is a `types.ModuleType` subclass that says so, as
Python's data model documents for customising a module's attributes). Imports nothing of mmadapt.

`imported(path, where, what)`: a user's `package.module:function` (a reward, a tool) imported when a run config
names it, with the one error both give for a name that is no dotted module path or cannot be imported.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) of `package` whose public names are `exports` (name -> defining module)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)  # the next read is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    class Package(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if isinstance(value, types.ModuleType) and exports.get(name) == value.__name__ == f"{package}.{name}":
                value = getattr(value, name)  # the import system binds the submodule `name`: keep the public name
            super().__setattr__(name, value)

    sys.modules[package].__class__ = Package
    return __getattr__, __dir__


def imported(path: str, where: str, what: str) -> Any:
    """`package.module:attribute` from an installed module (this imports, so runs, that module); `ValueError`
    naming `where` for a file path or a name that cannot be imported (`what`: "reward", "tool")."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr or "/" in module_name or module_name.endswith(".py"):
        raise ValueError(f"{where}: {path!r} is not 'package.module:function' (a dotted module path, not a file)")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{where}: cannot import {what} {path!r} ({error}); install its package in this "
                         "environment or fix the name") from None
