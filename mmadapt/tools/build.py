"""`build_tools`: a run config's tool list (built-in names, `{name, ...options}`, `package.module:function`) as tools.

A user tool is a plain function imported from an installed module when the config names it (as a user reward,
`mmadapt.train.rewards.imported_reward`: a dotted module path, no file paths, nothing fetched; importing runs the
module, so a config file is code to trust as much as the module it names). Its schema comes from its signature and
Google-style docstring through `transformers.utils.get_json_schema`: a summary, an `Args:` line per parameter, a type
hint on each. A parameter named `context` receives the `ToolContext` and is left out of the schema.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from mmadapt.registry import UnknownComponentError
from mmadapt.tools.base import FunctionTool, Tool, one_line
from mmadapt.tools.builtin import TOOLS

CONTEXT = "context"  # the parameter through which a user tool receives its ToolContext
DOCSTRING_FIX = ("give it a Google-style docstring (a summary line, then 'Args:' with a 'name: description' line for "
                 "each parameter) and a type hint on each parameter, as transformers.utils.get_json_schema reads them")


def build_tools(entries: Sequence[Any], where: str = "grpo.tools") -> tuple[Tool, ...]:
    """The tools `entries` name: each a built-in name ("zoom"), a mapping `{name, ...options}`, or a user tool
    `package.module:function` (no options). `ValueError` naming `where[k]` and the fix for an unknown name, a bad
    option, a user tool that cannot be imported or described, and a name given twice. An empty list is no tools."""
    if isinstance(entries, str | Mapping) or not isinstance(entries, Sequence):
        raise ValueError(f"{where} must be a list of tool names or mappings {{name, ...options}}, got {entries!r}; "
                         f"built-in tools: {', '.join(TOOLS.names())}, or 'package.module:function' for your own")
    tools: list[Tool] = []
    for k, entry in enumerate(entries):
        tool = build_tool(entry, f"{where}[{k}]")
        earlier = next((j for j, other in enumerate(tools) if other.name == tool.name), None)
        if earlier is not None:
            raise ValueError(f"{where}[{k}]: a tool named {tool.name!r} is already {where}[{earlier}]; list each tool "
                             "once (the policy calls a tool by its name)")
        tools.append(tool)
    return tuple(tools)


def build_tool(entry: Any, where: str) -> Tool:
    """One entry of the tool list as a tool."""
    if isinstance(entry, str):
        entry = {"name": entry}
    if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
        raise ValueError(f"{where}: expected a tool name or a mapping with a 'name', got {entry!r}; built-in tools: "
                         f"{', '.join(TOOLS.names())}, or 'package.module:function'")
    name = entry["name"]
    options = {key: value for key, value in entry.items() if key != "name"}
    if ":" in name:
        if options:
            raise ValueError(f"{where}: options {sorted(options)} for {name!r}; a user's tool takes none here, bind "
                             "them in its module (a documented function that reads them there)")
        return function_tool(imported_tool(name, where), name, where)
    try:
        kind = TOOLS.get(name)
    except UnknownComponentError as error:
        raise UnknownComponentError(f"{where}: {error}; or 'package.module:function' for your own") from None
    known = [field.name for field in dataclasses.fields(kind)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{where}: tool {name!r} has no option {unknown}; its options: {known or 'none'}")
    try:
        return kind(**options)
    except ValueError as error:  # an option's value the tool refuses
        raise ValueError(f"{where}: {error}") from None


def imported_tool(path: str, where: str) -> Any:
    """`package.module:function` from an installed module (this imports, so runs, that module)."""
    from mmadapt.lazy import imported

    function = imported(path, where, "tool")
    if not inspect.isfunction(function):
        raise TypeError(f"{where}: {path!r} is a {type(function).__name__}, not a function; a tool is a plain "
                        "function with type hints and a Google-style docstring")
    return function


def function_tool(function: Any, path: str, where: str) -> FunctionTool:
    """`function` as a tool: its schema from its docstring and signature, `context` left out of it."""
    from transformers.utils import get_json_schema

    takes_context = CONTEXT in inspect.signature(function).parameters
    try:
        schema = get_json_schema(without_context(function) if takes_context else function)
    except Exception as error:  # transformers' DocstringParsingException / TypeHintParsingException, or a hint it
        # cannot express in JSON: each a refusal of this entry at start, in one line
        raise ValueError(f"{where}: tool {path!r} cannot be described to the model ({one_line(str(error), 200)}); "
                         f"{DOCSTRING_FIX}") from None
    schema = schema.get("function", schema)  # transformers 5 wraps it as {"type": "function", "function": ...}
    if not schema.get("description"):
        raise ValueError(f"{where}: tool {path!r} has no description (its docstring's summary) to show the model; "
                         f"{DOCSTRING_FIX}")
    return FunctionTool(name=schema["name"], description=schema["description"], parameters=schema["parameters"],
                        function=function, takes_context=takes_context)


def without_context(function: Any) -> Any:
    """A stand-in for `function` that get_json_schema reads as if it had no `context` parameter: the same name and
    docstring, the signature and annotations less `context` (its type hints resolved in the function's module, so
    string annotations work). Never called."""
    signature = inspect.signature(function)
    hints = typing.get_type_hints(function)

    def stand_in(**arguments: Any) -> None:  # pragma: no cover - read, not called
        raise AssertionError("a schema stand-in is never called")

    stand_in.__name__ = function.__name__
    stand_in.__doc__ = function.__doc__
    stand_in.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p for name, p in signature.parameters.items() if name != CONTEXT])
    stand_in.__annotations__ = {name: hint for name, hint in hints.items() if name != CONTEXT}
    return stand_in
