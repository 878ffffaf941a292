"""Tool calls and tool results in the checkpoint's own chat template: how a template writes a call (so that a
policy's answer can be read as one), and the tokens a tool's result adds after an answer (so that a multi-turn
rollout continues exactly as the template would render the conversation).

`ToolTurns.of(encoder)` probes the encoder's template once:

- its call format (`CALL_FORMATS`), from how it writes an assistant message's `tool_calls`: `qwen_xml` (Qwen3.5,
  Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`),
  `hermes_json` (Qwen3-VL, Qwen2.5, Hermes: `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`) or
  `llama_json` (Llama 3.1+: `{"name": NAME, "parameters": {...}}`); a template that writes no call is refused
  (`ChatTemplateError`, naming it and the fix);
- whether it keeps the images of a `tool` message (trl #5663: templates that render a tool message's content as
  text drop its image parts, and the model then trains on turns whose image it never saw): refused at start
  when it does not.

`parse(text)` reads an answer's calls as (name, arguments) pairs (`ValueError` for a call it cannot read: the
rollout's counted `bad_call`), and `suffix(results)` is the text that follows an answer's end-of-turn token when
the tool results `results` (`Turn("tool", ...)`, `<image>` where each returned image goes) come back: the
template's tool message(s) and its generation prompt for the next answer, rendered by the template itself around
a probe answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from mmadapt.data.templates import ChatTemplate, ChatTemplateError, TemplateRenderError
from mmadapt.data.turns import IMAGE, Turn

CALL_FORMATS = ("qwen_xml", "hermes_json", "llama_json")
PROBE_NAME, PROBE_ARGUMENT, PROBE_VALUE = "probe_tool", "probe_argument", "probe value"
ANSWER = "\ue004"  # a probe answer no template rewrites (private use)
QUESTION = "\ue005"
TOOLS_WITH_IMAGES = "chat_template: qwen3_5, qwen3_vl or chatml"

QWEN_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolTurns:
    """An encoder's template as it writes tool calls and results (module docstring)."""

    template: ChatTemplate
    tokenizer: Any
    image_text: str
    format: str
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, encoder: Any) -> ToolTurns:
        """The probes of `encoder`'s template (a `SampleEncoder`): its call format and that it keeps tool images;
        `ChatTemplateError` naming the template and the fix otherwise."""
        template, tokenizer = encoder.template, encoder.tokenizer
        kwargs = dict(encoder.config.template_kwargs)
        turns = cls(template, tokenizer, encoder.image_text, "", kwargs)
        written = turns.answer_text("", [(PROBE_NAME, json.dumps({PROBE_ARGUMENT: PROBE_VALUE}))])
        found = call_format(written)
        if found is None:
            raise ChatTemplateError(
                f"chat template {template.name!r} writes no tool calls (an assistant's tool_calls rendered to "
                f"{written!r}), so a policy's call could not be read. Fix: a template with tools "
                f"({TOOLS_WITH_IMAGES}, or the checkpoint's own if it has tools)")
        turns = cls(template, tokenizer, encoder.image_text, found, kwargs)
        shown = turns.suffix([Turn("tool", f"{IMAGE}{PROBE_VALUE}")])
        if shown.count(encoder.image_text) != 1 or PROBE_VALUE not in shown:
            raise ChatTemplateError(
                f"chat template {template.name!r} drops the image of a tool message (it rendered a tool result "
                f"holding an image and text as {shown!r}): every image a tool returns would be missing from the "
                f"sequence while the model trains on the turns after it. Fix: a template that renders image parts in "
                f"tool messages ({TOOLS_WITH_IMAGES})")
        return turns

    def render(self, turns: list[Turn], *, add_generation_prompt: bool) -> str:
        try:
            return self.template.render(turns, self.tokenizer, image_text=self.image_text,
                                        add_generation_prompt=add_generation_prompt, **self.template_kwargs).text
        except TemplateRenderError as e:
            raise ChatTemplateError(f"chat template {self.template.name!r} cannot render tool turns: {e}. Fix: a "
                                    f"template with tools ({TOOLS_WITH_IMAGES})") from None

    def answer_text(self, content: str, calls: list[tuple[str, str]]) -> str:
        """An answer's text with `calls` as the template writes them, through its end of turn (what a policy that
        calls them generates after the generation prompt)."""
        text = self.render([Turn("user", QUESTION), Turn("assistant", content + ANSWER if not calls else content,
                                                         calls)], add_generation_prompt=False)
        prompt = self.render([Turn("user", QUESTION)], add_generation_prompt=True)
        start = len(prompt) if text.startswith(prompt) else text.index(QUESTION) + len(QUESTION)
        return text[start:]

    def suffix(self, results: list[Turn]) -> str:
        """The text after an answer's end-of-turn token through the next generation prompt, for tool `results`
        (`Turn("tool", text)`, `<image>` for each returned image)."""
        if not results or any(t.role != "tool" for t in results):
            raise ValueError("suffix takes one or more tool turns")
        text = self.render([Turn("user", QUESTION), Turn("assistant", ANSWER), *results], add_generation_prompt=True)
        after = text[text.index(ANSWER) + len(ANSWER):]
        end = self.template.end_of_turn(self.tokenizer)
        stripped = after.lstrip(" ")
        return stripped[len(end):] if end and stripped.startswith(end) else after

    def parse(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        """The calls an answer's `text` makes, in order ([] for none); `ValueError` saying what could not be read."""
        return parse_calls(text, self.format)

    @property
    def marker(self) -> str:
        """The text that opens a call in this format (an answer holding it meant to call)."""
        return "{\"name\"" if self.format == "llama_json" else "<tool_call>"


def call_format(written: str) -> str | None:
    """Which of `CALL_FORMATS` a template's rendering of the probe call is, or None."""
    if f"<function={PROBE_NAME}>" in written and f"<parameter={PROBE_ARGUMENT}>" in written:
        return "qwen_xml"
    if "<tool_call>" in written and f'"{PROBE_NAME}"' in written:
        return "hermes_json"
    if f'"{PROBE_NAME}"' in written and '"parameters"' in written:
        return "llama_json"
    return None


def parse_calls(text: str, format: str) -> list[tuple[str, dict[str, Any]]]:
    """The calls in `text`, written in `format` (`CALL_FORMATS`)."""
    if format == "qwen_xml":
        calls = [(name.strip(), {key.strip(): _value(value) for key, value in QWEN_PARAMETER.findall(body)})
                 for name, body in QWEN_CALL.findall(text)]
        if text.count("<tool_call>") != len(calls):
            raise ValueError("a <tool_call> is not <tool_call><function=NAME><parameter=KEY>VALUE</parameter>"
                             "</function></tool_call>")
        return calls
    if format == "hermes_json":
        bodies = HERMES_CALL.findall(text)
        if text.count("<tool_call>") != len(bodies):
            raise ValueError("a <tool_call> is not closed by </tool_call>")
        return [_json_call(body, "arguments") for body in bodies]
    if format == "llama_json":
        stripped = text.strip()
        if not stripped.startswith("{"):
            return []
        return [_json_call(stripped, "parameters")]
    raise ValueError(f"unknown call format {format!r}; known: {list(CALL_FORMATS)}")


def _json_call(body: str, arguments_key: str) -> tuple[str, dict[str, Any]]:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"a tool call is not JSON ({e.msg} at character {e.pos})") from None
    arguments = call.get(arguments_key, call.get("arguments")) if isinstance(call, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
        raise ValueError(f'a tool call must be {{"name": ..., "{arguments_key}": {{...}}}}')
    return call["name"], arguments


def _value(text: str) -> Any:
    """A `<parameter>` value: JSON when it parses (numbers, lists, objects), else the text (Qwen's parser)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


__all__ = ["CALL_FORMATS", "ToolTurns", "call_format", "parse_calls"]
