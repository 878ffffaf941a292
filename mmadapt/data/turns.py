"""A conversation's turns and the placeholder texts that mark its images and videos: `Turn`, `IMAGE`, `VIDEO`.

The one schema every sample format becomes (`mmadapt.data.samples`) and every chat template renders
(`mmadapt.data.templates`). Kept apart from the readers so that what only needs the schema (the templates, and through
them the data settings behind every command's flags) imports neither torch nor the dataset readers.
"""

from __future__ import annotations

from dataclasses import dataclass

IMAGE = "<image>"
VIDEO = "<video>"


@dataclass(frozen=True)
class Turn:
    role: str  # "system" | "user" | "assistant" | "tool" (a tool's result, read by the model, never supervised)
    text: str
    # an assistant turn's tool calls, (name, arguments as a JSON object's text) each: the template writes them after
    # `text` in its own format (`mmadapt.data.tool_turns`), and they are supervised with the answer
    calls: tuple[tuple[str, str], ...] = ()
