"""The package's layers: every module is in the layer contract ([tool.importlinter] in pyproject.toml) and in
docs/architecture.md's file map, the contract is kept, and no import cycle exists, counting imports inside
functions and under TYPE_CHECKING.

A new module fails here until it is added to its layer in pyproject.toml and named in the file map (its file name in
its folder's entry, e.g. `clip.py` in the `mmadapt/encoders/` entry; a module directly in mmadapt/ has an entry of
its own).
"""

from __future__ import annotations

import ast
import logging
import re
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mmadapt"


def modules() -> dict[str, Path]:
    """Every module of the package (packages included: their `__init__.py`) -> its file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def contracts() -> list[dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["exclude_type_checking_imports"] is False, "imports under TYPE_CHECKING must count"
    return config["contracts"]


def layer_of(module: str, contract: dict) -> str | None:
    """The layer of `contract` that holds `module` (a layer names a module and everything under it), or None."""
    for layer in contract["layers"]:
        for part in (p.strip() for p in layer.split("|")):
            for container in contract["containers"]:
                name = f"{container}.{part}"
                if module == name or module.startswith(name + "."):
                    return layer
    return None


def test_every_module_is_in_a_layer():
    """Every module under a contract's container is in one of its layers; the root package is the one module in
    none (it is every contract's container, the public face over all layers)."""
    missing = []
    for module, path in modules().items():
        if module == "mmadapt":
            continue
        for contract in contracts():
            inside = any(module.startswith(c + ".") for c in contract["containers"])
            if inside and layer_of(module, contract) is None and not import_free_package(module, path, contract):
                missing.append(f"{module} (contract {contract['name']!r})")
    assert not missing, ("modules in no layer; add each to the layer of [tool.importlinter] in pyproject.toml that "
                         "sits above what it imports and below what imports it: " + ", ".join(missing))


def import_free_package(module: str, path: Path, contract: dict) -> bool:
    """A package the contract names in `exhaustive_ignores` whose own module imports nothing (a docstring over modules
    that sit in layers of their own): it can break no layer. Anything else it holds must be in a layer."""
    ignored = {f"{c}.{name}" for c in contract["containers"] for name in contract.get("exhaustive_ignores", ())}
    if module not in ignored:
        return False
    tree = ast.parse(path.read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and n.module != "__future__"]
    assert path.name == "__init__.py" and not imports, f"{module}: ignored by the contract, not an import-free package"
    return True


def test_the_contract_is_kept():
    """`lint-imports` (as .ci/run runs it) passes: no module imports from a layer above its own."""
    with logging_kept():
        assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


@contextmanager
def logging_kept() -> Iterator[None]:
    """import-linter's command configures logging (`dictConfig`), which disables every logger that exists (every
    mmadapt module the session has imported, so a later test's `caplog` sees nothing of them) and sets the root's
    level: put them back as they were."""
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    saved = [(lg, lg.disabled, lg.level, lg.propagate, list(lg.handlers)) for lg in [logging.root, *loggers]]
    try:
        yield
    finally:
        for lg, disabled, level, propagate, handlers in saved:
            lg.disabled, lg.propagate, lg.handlers = disabled, propagate, handlers
            lg.setLevel(level)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    """Every import of the package: at module top, inside functions and under TYPE_CHECKING."""
    return grimp.build_graph("mmadapt", exclude_type_checking_imports=False, cache_dir=None)


def test_imports_inside_functions_and_under_type_checking_count(graph):
    """The graph the contract is checked on holds both kinds (the CLI imports the model inside a function; the
    data processors name the model under TYPE_CHECKING), so an arrow hidden in either still breaks the contract."""
    assert graph.direct_import_exists(importer="mmadapt.cli.common", imported="mmadapt.model")
    assert graph.direct_import_exists(importer="mmadapt.data.processors", imported="mmadapt.model")


def test_no_import_cycle(graph):
    """No two modules import each other, directly or through others (the layers forbid cycles between layers; this
    also covers the modules of one layer, e.g. evidence.maps and evidence.measure)."""
    cycles = strongly_connected(graph)
    assert not cycles, f"import cycles: {cycles}"


def test_nothing_imports_the_root_package(graph):
    """`mmadapt/__init__.py` re-exports from every layer, so a module that imports it (`from mmadapt import
    __version__`) imports from above itself: import from the defining module (`mmadapt.version`) instead."""
    assert graph.find_modules_that_directly_import("mmadapt") == set()


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import cycles: strongly connected groups of more than one module (Tarjan, iterative)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in edges:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            for nxt in edges[node]:
                if nxt in on_stack:
                    low[node] = min(low[node], low[nxt])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_strongly_connected_finds_a_cycle():
    """The cycle finder itself: a -> b -> c -> a is one cycle, d alone is none."""
    graph = grimp.ImportGraph()
    for importer, imported in (("x.a", "x.b"), ("x.b", "x.c"), ("x.c", "x.a"), ("x.c", "x.d")):
        graph.add_import(importer=importer, imported=imported)
    assert strongly_connected(graph) == [["x.a", "x.b", "x.c"]]


def file_map() -> dict[str, str]:
    """docs/architecture.md's file map: each entry's path (a line that starts with `mmadapt/`) -> its text
    (that line and the indented lines that follow it)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## File map", 1)[1].split("```")[1]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        if line.startswith("mmadapt/"):
            current, _, rest = line.partition(" ")
            entries[current] = rest
        elif line.startswith(" ") and current is not None:
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_architecture_names_every_module():
    """Every module is named in docs/architecture.md's file map: a module directly in mmadapt/ by an entry of its
    own, a module of a package by its file name in the package's entry (`mmadapt/encoders/`: `clip.py`), a package
    by its entry."""
    entries = file_map()
    missing = []
    for path in modules().values():
        relative = path.relative_to(ROOT).as_posix()
        folder = relative.rsplit("/", 1)[0] + "/"
        if path.name == "__init__.py":
            named = folder in entries or (folder == "mmadapt/" and relative in entries)
        elif folder == "mmadapt/":
            named = relative in entries
        else:
            named = bool(re.search(rf"(?<![\w/.]){re.escape(path.name)}\b", entries.get(folder, "")))
        if not named:
            missing.append(relative)
    assert not missing, f"docs/architecture.md's file map does not name: {missing}"


MAX_LINES = 600


def test_no_module_is_over_600_lines():
    """A module past 600 lines holds more than one concept: split it by concept (as `model.py` gave `generation.py`
    and `model_io.py`, and the page gave `serve/examples.py`), not by squeezing lines."""
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
