"""`run_call`: one tool call run, bounded in time, its arguments and result checked; never raises for what the call
or the tool does (the package docstring lists the result forms and the problems)."""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from PIL import Image

from mmadapt.tools.base import Tool, ToolArgumentError, ToolCall, ToolContext, ToolResult, one_line

log = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()  # (tool, problem) pairs already logged at WARNING, so a run logs each once
_logged_lock = threading.Lock()


class InvalidResult(ValueError):
    """A tool's return value that is no result; `problem` says which kind ("invalid_result" or an image limit)."""

    def __init__(self, problem: str, message: str) -> None:
        super().__init__(message)
        self.problem = problem


def run_call(tools: Mapping[str, Tool] | Sequence[Tool], call: ToolCall, context: ToolContext, *,
             timeout: float = 10.0) -> ToolResult:
    """Run `call` with the tool of its name on `context`, within `timeout` seconds, and check what it returns.

    Every failure of the call or the tool is a `ToolResult` with `problem` set and a one-line `text` for the policy:
    "unknown_tool", "bad_arguments" (against the tool's JSON schema, checked with `jsonschema`, unknown keys refused
    unless the schema allows them; or the tool's own `ToolArgumentError`), "tool_error" (it raised), "timeout",
    "invalid_result", "image_too_large", "too_many_images". Only the caller's own mistakes raise (`tools` not tools,
    two of one name, `timeout` not a positive number).

    The tool runs in a daemon worker thread; at `timeout` it is abandoned and the call returns "timeout". A Python
    thread cannot be killed: a timed-out tool keeps running (and holding what it holds) until it returns by itself,
    so a tool that may block should bound its own waits. The thread is a daemon, so it never keeps the process from
    exiting."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0 or math.isinf(timeout):
        raise ValueError(f"run_call: timeout must be a positive number of seconds, got {timeout!r}")
    by_name = tool_map(tools)
    tool = by_name.get(call.name) if isinstance(call.name, str) else None
    if tool is None:
        known = ", ".join(sorted(by_name)) or "none"
        return ToolResult.failed("unknown_tool", f"error: there is no tool {call.name!r}; the tools: {known}")
    try:
        refusal = argument_problem(tool, call.arguments)
    except Exception as error:  # the tool's own schema is broken (not JSON, not a schema): its fault, not the call's
        return noted(tool.name, "tool_error", f"error: {tool.name}: its parameters are no valid JSON schema "
                     f"({type(error).__name__}: {error})", error)
    if refusal is not None:
        return ToolResult.failed("bad_arguments", f"error: {tool.name}: {refusal}")
    future = started(tool, context, dict(call.arguments))
    try:
        # exception(), not result(): what the tool raised (SystemExit too) comes back as an object, while an
        # interrupt of this thread's own wait still propagates
        error = future.exception(timeout=timeout)
    except FutureTimeout:
        return noted(tool.name, "timeout", f"error: {tool.name}: no result within {timeout:g} s; the call was "
                     "abandoned")
    if isinstance(error, ToolArgumentError):
        return ToolResult.failed("bad_arguments", f"error: {tool.name}: {error}")
    if error is not None:
        said = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        return noted(tool.name, "tool_error", f"error: {tool.name} failed: {said}", error)
    raw = future.result()
    try:
        return checked_result(raw, context)
    except InvalidResult as error:
        return noted(tool.name, error.problem, f"error: {tool.name}: {error}")


def tool_map(tools: Mapping[str, Tool] | Sequence[Tool]) -> dict[str, Tool]:
    """`tools` by name (a mapping is taken as it is); `ValueError` for two tools of one name in a sequence."""
    if isinstance(tools, Mapping):
        return dict(tools)
    by_name: dict[str, Tool] = {}
    for tool in tools:
        if not isinstance(tool, Tool):
            raise TypeError(f"run_call: tools must be Tool objects (build_tools makes them), got {tool!r}")
        if tool.name in by_name:
            raise ValueError(f"run_call: two tools are named {tool.name!r}; give run_call each name once")
        by_name[tool.name] = tool
    return by_name


def started(tool: Tool, context: ToolContext, arguments: dict) -> Future:
    """`tool(context, arguments)` running in a daemon thread, its outcome in the returned future. A daemon thread,
    not a ThreadPoolExecutor: the executor's threads are joined at interpreter exit, so a tool that never returns
    would hang the process's exit."""
    future: Future = Future()
    future.set_running_or_notify_cancel()

    def work() -> None:
        try:
            future.set_result(tool(context, arguments))
        except BaseException as error:  # everything the tool raises is the call's problem, judged by the caller
            future.set_exception(error)

    threading.Thread(target=work, name=f"tool-{tool.name}", daemon=True).start()
    return future


def noted(tool: str, problem: str, text: str, error: BaseException | None = None) -> ToolResult:
    """The problem's result, logged at WARNING the first time this tool has it (with the traceback of an error, which
    the policy never reads), at DEBUG after that."""
    with _logged_lock:
        first = (tool, problem) not in _logged
        _logged.add((tool, problem))
    log.log(logging.WARNING if first else logging.DEBUG, "tool call problem %s: %s%s", problem, one_line(text),
            " (later ones of this tool and problem: at DEBUG)" if first else "", exc_info=error)
    return ToolResult.failed(problem, text)


# ---- the arguments ---------------------------------------------------------------------------------------------------
def argument_problem(tool: Tool, arguments: Any) -> str | None:
    """Why `arguments` do not fit `tool.parameters` (its JSON schema), or None when they do. Keys the schema does not
    name are refused unless it sets `additionalProperties`; the first error jsonschema ranks best is reported."""
    if not isinstance(arguments, dict) or not all(isinstance(key, str) for key in arguments):
        return f"the arguments must be a JSON object of named values, got {one_line(repr(arguments), 80)}"
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator(json.dumps(tool.parameters, sort_keys=True)).iter_errors(
        arguments))
    if error is None:
        return None
    where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    if error.validator == "additionalProperties":
        known = ", ".join(tool.parameters.get("properties", {})) or "none"
        return f"{error.message}; its parameters: {known}"
    return f"{where}: {error.message}" if where else error.message


@functools.lru_cache(maxsize=64)
def _validator(schema_text: str) -> Any:
    """A jsonschema validator for a tool's parameters (its text as the cache key: schemas are plain dicts), with
    unknown keys refused when the schema does not say otherwise. jsonschema is imported on the first call."""
    import jsonschema

    schema = json.loads(schema_text)
    schema.setdefault("additionalProperties", False)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator.check_schema(schema)
    return validator(schema)


# ---- the result ------------------------------------------------------------------------------------------------------
def checked_result(raw: Any, context: ToolContext) -> ToolResult:
    """`raw` as a ToolResult with RGB images within the context's limits, or `InvalidResult` saying why not. Forms:
    str; PIL image; ToolResult; {"text": str, "images": [images]} (either key may be left out); a list / tuple of
    str and images (the texts joined with newlines)."""
    if isinstance(raw, ToolResult):  # a problem the tool reports itself reads as run_call's own: one short line
        text, images, problem = raw.text if raw.problem is None else one_line(raw.text), list(raw.images), raw.problem
    elif isinstance(raw, str | Image.Image) or isinstance(raw, list | tuple):
        text, images, problem = parts(raw if isinstance(raw, list | tuple) else [raw])
    elif isinstance(raw, dict):
        text, images, problem = from_dict(raw)
    else:
        raise InvalidResult("invalid_result", f"returned {kind(raw)}; a tool returns a str, a PIL image, a list of "
                            "them, a dict {'text': str, 'images': [images]} or a ToolResult")
    if len(text) > context.max_text:
        raise InvalidResult("text_too_long", f"returned {len(text)} characters of text; a call may return at most "
                            f"{context.max_text}")
    if len(images) > context.max_images:
        raise InvalidResult("too_many_images", f"returned {len(images)} images; a call may return at most "
                            f"{context.max_images}")
    return ToolResult(text=text, images=tuple(rgb(image, k, context) for k, image in enumerate(images)),
                      problem=problem)


def parts(items: Sequence[Any]) -> tuple[str, list[Any], None]:
    """A list of str and images: the texts joined with newlines, the images in order."""
    texts, images = [], []
    for k, item in enumerate(items):
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, Image.Image):
            images.append(item)
        else:
            raise InvalidResult("invalid_result", f"returned a list whose item {k} is {kind(item)}; its items must be "
                                "str or PIL images")
    return "\n".join(texts), images, None


def from_dict(raw: dict) -> tuple[str, list[Any], None]:
    """{"text": str, "images": [PIL images]}, either key optional, no other key."""
    unknown = sorted(map(str, set(raw) - {"text", "images"}))
    if unknown:
        raise InvalidResult("invalid_result", f"returned a dict with keys {unknown}; a result dict holds only 'text' "
                            "and 'images'")
    text, images = raw.get("text", ""), raw.get("images", [])
    if not isinstance(text, str):
        raise InvalidResult("invalid_result", f"returned a dict whose 'text' is {kind(text)}, not a str")
    if not isinstance(images, list | tuple) or not all(isinstance(image, Image.Image) for image in images):
        raise InvalidResult("invalid_result", "returned a dict whose 'images' is not a list of PIL images")
    return text, list(images), None


def rgb(image: Any, k: int, context: ToolContext) -> Image.Image:
    """Image `k` of a result, decoded and converted to RGB; `InvalidResult` when it is no image or over the pixel
    budget (never resized here: a tool must return images within `context.max_pixels`)."""
    if not isinstance(image, Image.Image):
        raise InvalidResult("invalid_result", f"returned {kind(image)} as image {k}; images are PIL images")
    width, height = image.size
    if width * height > context.max_pixels:
        raise InvalidResult("image_too_large", f"image {k} is {width}x{height} = {width * height} pixels, over the "
                            f"limit of {context.max_pixels}; return a smaller image")
    if width < 1 or height < 1:
        raise InvalidResult("invalid_result", f"image {k} is {width}x{height}: it has no pixels")
    try:
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")
    except Exception as error:  # a broken file behind a lazy image, a mode Pillow cannot convert
        raise InvalidResult("invalid_result", f"image {k} cannot be read as RGB ({type(error).__name__}: "
                            f"{error})") from None


def kind(value: Any) -> str:
    """What a value is, for a message: its type and a short repr."""
    return f"a {type(value).__name__} ({one_line(repr(value), 60)})"
