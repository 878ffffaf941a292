"""The tool interface's objects: a call the policy wrote, the context a tool sees, what goes back, and `Tool` itself.

A `Tool` has a name, a description and a JSON-schema object of its parameters (together `schema()`, the form chat
templates list under `tools`), and is called as `tool(context, arguments)` with the call's checked arguments; what it
returns is raw and checked by `mmadapt.tools.calling.run_call`. `ToolResult.problem` is None or one of `PROBLEMS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

# what went wrong with a call, one word each: the tool message says it to the policy and the rollout counts it
PROBLEMS = (
    "bad_call",  # the policy's call could not be read in its template's format (the rollout's, before any tool runs)
    "unknown_tool",  # no tool of the call's name
    "bad_arguments",  # the arguments do not fit the schema, or the tool refused them (`ToolArgumentError`)
    "tool_error",  # the tool raised
    "timeout",  # the tool ran past its time
    "invalid_result",  # the tool returned something that is no result (an int, bytes, a broken image, ...)
    "image_too_large",  # an image over the context's max_pixels
    "too_many_images",  # more images than the context's max_images
    "text_too_long",  # a text over the context's max_text characters (checked before it is tokenized)
)


class ToolArgumentError(ValueError):
    """Raised by a tool for arguments that fit the schema but not the call (a box outside the image): the call's
    problem is "bad_arguments" and the policy reads "error: <tool>: <message>"."""


@dataclass(frozen=True)
class ToolCall:
    """One call the policy wrote, parsed from its text: the tool's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """What goes back to the policy as a `tool` message: text, RGB images, and the problem (None: the tool ran fine;
    else one of `PROBLEMS`, and `text` says what went wrong in one short line)."""

    text: str = ""
    images: tuple[Image.Image, ...] = ()
    problem: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "images", tuple(self.images))
        if not isinstance(self.text, str):
            raise TypeError(f"ToolResult.text must be a str, got {type(self.text).__name__}")
        if self.problem is not None and self.problem not in PROBLEMS:
            raise ValueError(f"ToolResult.problem {self.problem!r} is none of {PROBLEMS}")

    @classmethod
    def failed(cls, problem: str, text: str) -> ToolResult:
        """A problem's result: no images, `text` as one line of at most `MESSAGE_CHARS` characters."""
        return cls(text=one_line(text), problem=problem)


MESSAGE_CHARS = 300  # a problem's message, as the policy reads it: long enough for the cause and the sizes


def one_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    """`text` on one line (whitespace runs collapsed), cut to `limit` characters with an ellipsis."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class ToolContext:
    """What a tool sees of its trajectory: its images so far (the prompt's first, then those tools returned, in
    order) and the limits on the images one call may return (pixels per image, images per call)."""

    images: tuple[Image.Image, ...]
    max_pixels: int
    min_pixels: int = 1
    max_images: int = 4
    max_text: int = 16384  # characters of text one call may return (a trajectory's token budget applies after)

    def __post_init__(self) -> None:
        object.__setattr__(self, "images", tuple(self.images))
        strays = [type(image).__name__ for image in self.images if not isinstance(image, Image.Image)]
        if strays:
            raise TypeError(f"ToolContext.images must be PIL images (the trajectory's, decoded), got {strays}")
        for name in ("max_pixels", "min_pixels", "max_images", "max_text"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ToolContext.{name} must be a positive int, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"ToolContext.min_pixels ({self.min_pixels}) is over max_pixels ({self.max_pixels})")


class Tool:
    """A tool: `name`, `description` (what the model reads in its tool list), `parameters` (a JSON schema of type
    "object") and `__call__(context, arguments) -> raw result`. Subclasses set the three attributes (or properties)
    and implement `__call__`."""

    name: str
    description: str
    parameters: dict

    def schema(self) -> dict:
        """The OpenAI / transformers function schema, as `apply_chat_template(tools=[...])` takes it."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, context: ToolContext, arguments: dict) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement __call__(context, arguments)")


@dataclass(frozen=True, eq=False)
class FunctionTool(Tool):
    """A plain Python function as a tool: called as `function(**arguments)`, or `function(context=..., **arguments)`
    when it declares a parameter named `context` (`takes_context`)."""

    name: str
    description: str
    parameters: dict = field(repr=False)
    function: Any = field(repr=False)
    takes_context: bool = False

    def __call__(self, context: ToolContext, arguments: dict) -> Any:
        if self.takes_context:
            return self.function(context=context, **arguments)
        return self.function(**arguments)


def finite_number(value: Any) -> bool:
    """An int or float that is finite (bools are not numbers here, as in JSON)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
