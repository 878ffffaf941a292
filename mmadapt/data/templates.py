"""Chat templates: a conversation -> token ids and labels, image spans expanded in place.

The checkpoint's own template is the source of truth (`resolve_template`): `auto` (the default) takes the
tokenizer's jinja `chat_template` when it has one, else the backbone's built-in; `tokenizer` requires the
tokenizer's; a name picks a built-in. A template renders the conversation to text plus the character ranges
that are supervised; the text is then tokenized, each image placeholder token expanded to the N visual tokens
its image yields (the span's start / end tokens written by the template, as it writes them), and a token is
labelled when its characters overlap a supervised range (everything else is -100).

- `JinjaTemplate` (the tokenizer's own, or a shipped official one: `qwen3_5`, `qwen3_vl`, `llava_hf`): the text is
  exactly `tokenizer.apply_chat_template(messages, **template_kwargs)` and the ids exactly its tokenization
  (`add_special_tokens=False`). Supervised spans are found without assuming the template is prefix-stable: the
  conversation is rendered a second time with each assistant content replaced by a marker, the scaffolding
  between markers is located in the real rendering, and what lies between is each assistant's content as the
  template wrote it. **The rule for scaffolding inside an assistant turn**: what the template's generation
  prompt (`add_generation_prompt=True`) writes is the prompt - it is given to the model when serving, so it is
  not supervised -, and anything the template writes in the turn after it is part of the answer: with Qwen3.5's
  thinking default the generation prompt ends in `<think>\\n`, so the `\\n</think>\\n\\n` the template writes before
  an answer is supervised (the model learns to close its empty think block), and with `enable_thinking: false`
  the whole `<think>\\n\\n</think>\\n\\n` is in the prompt and is not. The end-of-turn token the template writes right
  after the content (`<|im_end|>`) is supervised; headers, system, user and image tokens never are. Messages are
  passed with OpenAI-style parts (`{"type": "image"}`, `{"type": "text"}`) when the template writes an image part
  as the backbone's image placeholder text (found by a probe: Qwen's, llava-hf's templates); otherwise - a text
  LLM's own template, as in a LLaVA-style port onto Qwen3, Llama or Mistral - with string content holding that
  placeholder text where each image is (`<image>` for Llama-style backbones, `<|vision_start|><|image_pad|>
  <|vision_end|>` for Qwen's), so the text is the checkpoint's own template's and the placeholders are expanded as
  for any template. A template that then still writes no placeholder cannot take images (`ChatTemplateError`, at
  start).
- `VicunaTemplate` (`vicuna_v1`, LLaVA-1.5): LLaVA's own `conv_vicuna_v1` prompt and its tokenization
  (`tokenizer_image_token`: the text around each `<image>` tokenized as its own string), labels as its
  `preprocess_v1` gives them (each answer and its `</s>`): equal to LLaVA-1.5's training ids token for token with
  a SentencePiece Llama tokenizer (tests/test_templates.py). LLaVA's dataset moves `<image>` to the front of the
  turn; mmadapt keeps the data's placement.
- `ChatMLTemplate` (`chatml`): Qwen's ChatML, no default system prompt, images as the backbone's span; equal to
  Qwen3-VL's official template for text and image conversations, and rendered by it (`qwen3_vl`) for conversations
  with tools, tool calls or tool results (`mmadapt.data.tool_turns`).

Each built-in exports an equivalent jinja template (`jinja`), written into the tokenizer a model is trained
with, so `apply_chat_template` of the saved tokenizer gives the training prompt; mmadapt recognises its own
exports and uses the built-in again (`resolve_template`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from mmadapt.data.problems import is_allocation_error
from mmadapt.data.turns import IMAGE, Turn
from mmadapt.registry import Registry

IGNORE = -100
MODES = ("auto", "tokenizer")  # besides built-in names
Span = tuple[int, int]


class ChatTemplateError(ValueError):
    """A chat template cannot render what the data needs (images, the conversation's shape)."""


class TemplateRenderError(ChatTemplateError):
    """The chat template itself raised while rendering a conversation (jinja's `raise_exception`: "No user query
    found in messages", "System message cannot contain images", ...): a per-sample `template_error`."""


@dataclass(frozen=True)
class Rendered:
    """A conversation as text, with the character ranges whose tokens are supervised."""

    text: str
    supervised: list[Span] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """Base class: `render(turns, ...)` -> `Rendered`; `encode(...)` -> (ids, labels) with image spans expanded."""

    name: str
    description: str

    def specials(self, tokenizer: Any) -> list[str]:
        """Special tokens the template writes (the tokenizer must know them as single tokens)."""
        return []

    def end_of_turn(self, tokenizer: Any) -> str:
        """The token that ends an assistant turn (generation stops there)."""
        raise NotImplementedError

    def jinja(self, tokenizer: Any) -> str:
        """An equivalent jinja template, for `tokenizer.chat_template` (`apply_chat_template` renders the same)."""
        raise NotImplementedError

    def render(self, turns: Sequence[Turn], tokenizer: Any, *, image_text: str, add_generation_prompt: bool = False,
               **template_kwargs: Any) -> Rendered:
        raise NotImplementedError

    def encode(self, turns: Sequence[Turn], tokenizer: Any, *, image_token_id: int | None,
               image_span: Callable[[int], list[int]], image_text: str, tokens_per_image: Sequence[int],
               add_generation_prompt: bool = False, **template_kwargs: Any) -> tuple[list[int], list[int]]:
        """Token ids and labels of the conversation, each image placeholder expanded to its visual tokens."""
        rendered = self.render(turns, tokenizer, image_text=image_text, add_generation_prompt=add_generation_prompt,
                               **template_kwargs)
        encoded = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
        labels = supervised_labels(encoded["input_ids"], encoded["offset_mapping"], rendered.supervised)
        return expand_images(encoded["input_ids"], labels, image_token_id, tokens_per_image, self.name)


def supervised_labels(ids: Sequence[int], offsets: Sequence[Span], supervised: Sequence[Span]) -> list[int]:
    """Each token's id where its characters overlap a supervised range, else -100; O(tokens log ranges), so a
    conversation's labelling stays linear in its turns."""
    ranges = sorted(supervised)
    starts, reach = [lo for lo, _ in ranges], list(itertools.accumulate((hi for _, hi in ranges), max))
    labels = []
    for token, (start, end) in zip(ids, offsets, strict=True):
        # the ranges starting before `end` overlap the token iff the furthest of them reaches past `start`
        last = bisect.bisect_left(starts, end) - 1
        hit = end > start and last >= 0 and reach[last] > start
        labels.append(token if hit else IGNORE)
    return labels


def expand_images(ids: list[int], labels: list[int], image_token_id: int | None, tokens_per_image: Sequence[int],
                  template: str, kind: str = "image") -> tuple[list[int], list[int]]:
    """Every image placeholder token -> its image's N visual tokens (labels -100); `kind`: "video frame" for the
    video token, one per frame."""
    found = [k for k, t in enumerate(ids) if t == image_token_id] if image_token_id is not None else []
    if len(found) != len(tokens_per_image):
        raise ChatTemplateError(f"template {template!r} wrote {len(found)} {kind} placeholder(s) for "
                                f"{len(tokens_per_image)} {kind}(s)")
    out_ids, out_labels, previous = [], [], 0
    for k, n in zip(found, tokens_per_image, strict=True):
        out_ids += ids[previous:k] + [image_token_id] * n
        out_labels += labels[previous:k] + [IGNORE] * n
        previous = k + 1
    return out_ids + ids[previous:], out_labels + labels[previous:]


def split_system(turns: Sequence[Turn], default: str | None = None) -> tuple[str | None, Sequence[Turn]]:
    if turns and turns[0].role == "system":
        return turns[0].text, turns[1:]
    if any(t.role == "system" for t in turns):
        raise ChatTemplateError("a system turn may only come first")
    return default, turns


# ---- LLaVA-1.5 -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class VicunaTemplate(ChatTemplate):
    """LLaVA-1.5's `conv_vicuna_v1` (sep " ", sep2 = EOS) with LLaVA's own tokenization and labels (module doc)."""

    default_system: str

    def specials(self, tokenizer: Any) -> list[str]:
        return [self.end_of_turn(tokenizer)]

    def end_of_turn(self, tokenizer: Any) -> str:
        return tokenizer.eos_token or "</s>"

    def render(self, turns: Sequence[Turn], tokenizer: Any, *, image_text: str = IMAGE,
               add_generation_prompt: bool = False, **template_kwargs: Any) -> Rendered:
        """`Conversation.get_prompt()` of SeparatorStyle.TWO; supervised: each answer with its `</s>`."""
        if any(t.role == "tool" or t.calls for t in turns):
            raise TemplateRenderError(f"template {self.name!r} has no tool calls or tool messages. Fix: a template "
                                      "with tools (chat_template: qwen3_5, qwen3_vl or chatml)")
        system, turns = split_system(turns, self.default_system)
        text, supervised, eos = (system or "") + " ", [], self.end_of_turn(tokenizer)
        for turn in turns:
            role = "USER" if turn.role == "user" else "ASSISTANT"
            text += f"{role}:"
            start = len(text)  # the answer with its leading space: what follows the generation prompt "ASSISTANT:"
            text += " " + turn.text + (" " if turn.role == "user" else eos)
            if turn.role == "assistant":
                supervised.append((start, len(text)))
        return Rendered(text + ("ASSISTANT:" if add_generation_prompt else ""), supervised)

    def encode(self, turns: Sequence[Turn], tokenizer: Any, *, image_token_id: int | None,
               image_span: Callable[[int], list[int]], image_text: str, tokens_per_image: Sequence[int],
               add_generation_prompt: bool = False, **template_kwargs: Any) -> tuple[list[int], list[int]]:
        """LLaVA's `tokenizer_image_token`: each text chunk between images tokenized as its own string (its BOS
        dropped after the first), each `<image>` replaced by the image's span."""
        rendered = self.render(turns, tokenizer, add_generation_prompt=add_generation_prompt)
        chunks = rendered.text.split(IMAGE)
        if len(chunks) - 1 != len(tokens_per_image):
            raise ChatTemplateError(f"template {self.name!r}: {len(chunks) - 1} {IMAGE} placeholder(s) for "
                                    f"{len(tokens_per_image)} image(s)")
        ids: list[int] = []
        labels: list[int] = []
        position = 0
        for k, chunk in enumerate(chunks):
            if k:
                span = image_span(tokens_per_image[k - 1])
                ids += span
                labels += [IGNORE] * len(span)
                position += len(IMAGE)
            encoded = tokenizer(chunk, return_offsets_mapping=True)
            chunk_ids, offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
            bos = tokenizer.bos_token_id
            if chunk_ids[:1] == [bos] and bos is not None:
                if k:  # LLaVA keeps the first chunk's BOS only
                    chunk_ids, offsets = chunk_ids[1:], offsets[1:]
            elif k == 0 and bos is not None:  # a tokenizer that adds no BOS itself: the sequence still starts with one
                chunk_ids, offsets = [bos, *chunk_ids], [(0, 0), *offsets]
            shifted = [(a + position, b + position) if b > a else (0, 0) for a, b in offsets]
            ids += chunk_ids
            labels += supervised_labels(chunk_ids, shifted, rendered.supervised)
            position += len(chunk)
        return ids, labels

    def jinja(self, tokenizer: Any) -> str:
        eos = self.end_of_turn(tokenizer)
        return (JINJA_MARK.format(name=self.name) + "{%- set ns = namespace(system=" + repr(self.default_system)
                + ") -%}{%- if messages and messages[0].role == 'system' %}{%- set ns.system = messages[0].content %}"
                "{%- endif %}{{- bos_token + ns.system + ' ' }}{%- for message in messages %}"
                "{%- if message.role == 'user' %}{{- 'USER: ' + message.content + ' ' }}"
                "{%- elif message.role == 'assistant' %}{{- 'ASSISTANT: ' + message.content + " + repr(eos) + " }}"
                "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}")


# ---- Qwen's ChatML ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ChatMLTemplate(ChatTemplate):
    """Qwen's ChatML; the assistant's `<|im_end|>` is supervised (it is how the model learns to stop)."""

    def specials(self, tokenizer: Any) -> list[str]:
        return ["<|im_start|>", "<|im_end|>"]

    def end_of_turn(self, tokenizer: Any) -> str:
        return "<|im_end|>"

    def render(self, turns: Sequence[Turn], tokenizer: Any, *, image_text: str, add_generation_prompt: bool = False,
               **template_kwargs: Any) -> Rendered:
        if template_kwargs.get("tools") or any(t.role == "tool" or t.calls for t in turns):  # Qwen3-VL's own, whole
            return TEMPLATES.get("qwen3_vl").render(turns, tokenizer, image_text=image_text,
                                                    add_generation_prompt=add_generation_prompt, **template_kwargs)
        system, turns = split_system(turns)
        text = f"<|im_start|>system\n{system.replace(IMAGE, image_text)}<|im_end|>\n" if system else ""
        supervised = []
        for turn in turns:
            text += f"<|im_start|>{turn.role}\n"
            start = len(text)
            text += turn.text.replace(IMAGE, image_text) + "<|im_end|>"
            if turn.role == "assistant":
                supervised.append((start, len(text)))
            text += "\n"
        return Rendered(text + ("<|im_start|>assistant\n" if add_generation_prompt else ""), supervised)

    def jinja(self, tokenizer: Any) -> str:
        """Qwen3-VL's official template (tools and tool messages too), marked as this built-in's export."""
        return JINJA_MARK.format(name=self.name) + shipped_template("qwen3_vl.jinja")


# ---- jinja: the tokenizer's own template, or an official one shipped with mmadapt --------------------------------
MARK = "\ue000{}\ue001"  # private-use characters: an assistant content no template rewrites
PROBE_TEXT = "\ue002"
CONTROL_TOKEN = re.compile(r"<\|[^<>|\s]+\|>")  # Qwen-style control tokens: <|im_start|>, <|im_end|>, ...
JINJA_MARK = "{{#- mmadapt built-in chat template {name!r} -#}}"


@dataclass(frozen=True, kw_only=True)
class JinjaTemplate(ChatTemplate):
    """A jinja chat template rendered by transformers' `apply_chat_template` (module docstring).

    `source`: the template text; None is the tokenizer's own `chat_template`. `file`: a template shipped in
    `mmadapt/data/chat_templates/` (official templates, their sources named in NOTICE there).
    """

    source: str | None = None
    file: str | None = None

    def text(self, tokenizer: Any) -> str:
        if self.file is not None:
            return shipped_template(self.file)
        if self.source is not None:
            return self.source
        own = getattr(tokenizer, "chat_template", None)
        if not isinstance(own, str) or not own:
            raise ChatTemplateError("the tokenizer has no chat_template of its own (chat_template: tokenizer). Fix: "
                                    f"chat_template: auto, or a built-in ({', '.join(TEMPLATES.names())})")
        return own

    def jinja(self, tokenizer: Any) -> str:
        return self.text(tokenizer)

    def apply(self, tokenizer: Any, messages: list[dict], add_generation_prompt: bool, **kwargs: Any) -> str:
        """`apply_chat_template` as text; anything the template raises (its `raise_exception`, a jinja error, a
        TypeError on content it does not expect) is a `TemplateRenderError` with its message."""
        template = self.text(tokenizer)
        try:
            return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:
            if is_allocation_error(e):
                raise
            raise TemplateRenderError(f"template {self.name!r} refused the conversation: {type(e).__name__}: {e}"
                                      ) from e

    def specials(self, tokenizer: Any) -> list[str]:
        """The `<|...|>` control tokens the template writes and its end of turn (for tokenizers that lack them)."""
        written = CONTROL_TOKEN.findall(self._probe(tokenizer, "conversation"))
        return [t for t in dict.fromkeys([*written, self.end_of_turn(tokenizer)]) if t]  # in order: stable ids

    def end_of_turn(self, tokenizer: Any) -> str:
        """The special token the template writes right after an assistant's content (else the tokenizer's EOS)."""
        after = self._probe(tokenizer, "end")
        specials = sorted((t for t in tokenizer.all_special_tokens + list(tokenizer.get_added_vocab())
                           if t and after.startswith(t)), key=len, reverse=True)
        control = CONTROL_TOKEN.match(after)
        return specials[0] if specials else control.group(0) if control else (tokenizer.eos_token or "")

    def reads_parts(self, tokenizer: Any) -> bool:
        """Whether the template reads OpenAI-style content parts (else message content must be a string)."""
        return self._probe(tokenizer, "parts") == "yes"

    def places_images(self, tokenizer: Any, image_text: str) -> bool:
        """Whether the template writes an image part of a message's content as `image_text` (the backbone's image
        placeholder text): then messages carry parts. Otherwise - a text LLM's own template, which knows nothing of
        images - each content is a string with `image_text` in place of each image (`image_mode`)."""
        return self._probe(tokenizer, ("images", image_text)) == "yes"

    def image_mode(self, tokenizer: Any, image_text: str) -> str:
        """How images enter this template, in words (what `mmadapt data show` prints)."""
        if self.places_images(tokenizer, image_text):
            return f"image parts, which it writes as {image_text!r}"
        return f"text only: each image enters a message's content as {image_text!r}"

    def _probe(self, tokenizer: Any, what: str | tuple[str, ...]) -> str:
        return _probe(self, tokenizer, self.text(tokenizer), what)

    def messages(self, turns: Sequence[Turn], tokenizer: Any, contents: Sequence[str],
                 image_text: str | None = None, marks: dict[int, str] | None = None) -> list[dict]:
        """The messages `apply_chat_template` takes: parts when the template places images (`places_images`;
        without `image_text`, when it reads parts), else strings, `image_text` in place of each `<image>`; an
        assistant turn's calls as OpenAI `tool_calls` (`marks` {turn: marker}: the marker as its first call's
        name)."""
        parts = self.reads_parts(tokenizer) if image_text is None else self.places_images(tokenizer, image_text)
        out = []
        for k, (turn, content) in enumerate(zip(turns, contents, strict=True)):
            message: dict[str, Any] = {"role": turn.role}
            if not parts:
                message["content"] = content.replace(IMAGE, image_text or IMAGE)
            else:
                pieces: list[dict] = []
                for n, chunk in enumerate(content.split(IMAGE)):
                    if n:
                        pieces.append({"type": "image"})
                    if chunk:
                        pieces.append({"type": "text", "text": chunk})
                message["content"] = pieces
            if turn.calls:
                message["tool_calls"] = tool_calls(turn.calls, marks.get(k) if marks else None)
            out.append(message)
        return out

    def render(self, turns: Sequence[Turn], tokenizer: Any, *, image_text: str, add_generation_prompt: bool = False,
               **template_kwargs: Any) -> Rendered:
        turns = list(turns)
        real = self.apply(tokenizer, self.messages(turns, tokenizer, [t.text for t in turns], image_text),
                          add_generation_prompt, **template_kwargs)
        # each assistant turn's content marked; a turn with tool calls keeps its content and has its first call's
        # name marked instead (a template writes what separates content from calls by whether the content is empty)
        called = {k: MARK.format(k) for k, t in enumerate(turns) if t.role == "assistant" and t.calls}
        marks = [MARK.format(k) if t.role == "assistant" and k not in called else t.text for k, t in enumerate(turns)]
        marked = self.apply(tokenizer, self.messages(turns, tokenizer, marks, image_text, called),
                            add_generation_prompt, **template_kwargs)
        prompt = self._generation_prompt(tokenizer, template_kwargs)
        end = self.end_of_turn(tokenizer)
        supervised, position = [], 0
        assistants = [k for k, t in enumerate(turns) if t.role == "assistant"]
        if any(MARK.format(k) not in marked for k in called):
            raise TemplateRenderError(f"template {self.name!r} does not write an assistant's tool_calls. Fix: a "
                                      "template with tool calls (chat_template: qwen3_5, qwen3_vl or chatml)")
        scaffolds = _split_marks(marked, assistants)
        answers = [t.text for t in turns if t.role == "assistant"]
        for k in range(len(scaffolds) - 1):
            scaffold = scaffolds[k]  # (a turn with calls trims the next one)
            if not real.startswith(scaffold, position):
                raise ChatTemplateError(
                    f"template {self.name!r} rewrites the text around assistant turn {k} (e.g. a reasoning block in "
                    "its content), so its answer cannot be located. Fix: give reasoning in the template's own field, "
                    "or use a built-in template")
            start = position + _answer_start(scaffold, prompt)
            position += len(scaffold)
            if assistants[k] in called:  # content and calls, supervised through the end of the turn
                stop = real.find(end, position) if end else -1
                if stop < 0:
                    raise ChatTemplateError(f"template {self.name!r}: assistant turn {k}'s tool calls end in no "
                                            f"{end!r}")
                position = stop = stop + len(end)
                supervised.append((start, stop))
                after = scaffolds[k + 1]
                scaffolds[k + 1] = after[after.index(end) + len(end):] if end in after else after
                continue
            stop = _content_end(real, position, answers[k], scaffolds[k + 1], last=k + 2 == len(scaffolds))
            if stop < 0:
                raise ChatTemplateError(f"template {self.name!r}: the text after assistant turn {k} was not found")
            position = stop
            spaces = len(real[stop:]) - len(real[stop:].lstrip(" "))  # Llama-2-chat: answer + ' ' + eos_token
            if end and real.startswith(end, stop + spaces):
                stop += spaces + len(end)
            supervised.append((start, stop))
        return Rendered(real, supervised)

    def _generation_prompt(self, tokenizer: Any, template_kwargs: dict[str, Any]) -> str:
        """What `add_generation_prompt=True` appends (e.g. "<|im_start|>assistant\\n<think>\\n"); cached."""
        key = ("generation prompt", self.text(tokenizer), repr(sorted(template_kwargs.items())))
        cache = tokenizer.__dict__.setdefault("_mmadapt_template_probes", {})
        if key not in cache:
            cache[key] = self._render_generation_prompt(tokenizer, template_kwargs)
        return cache[key]

    def _render_generation_prompt(self, tokenizer: Any, template_kwargs: dict[str, Any]) -> str:
        probe = [{"role": "user", "content": PROBE_TEXT}]
        if self.reads_parts(tokenizer):
            probe = [{"role": "user", "content": [{"type": "text", "text": PROBE_TEXT}]}]
        bare = self.apply(tokenizer, probe, False, **template_kwargs)
        prompted = self.apply(tokenizer, probe, True, **template_kwargs)
        return prompted[len(bare):] if prompted.startswith(bare) else ""


def _split_marks(marked: str, assistants: list[int]) -> list[str]:
    """The scaffolding around the assistant markers: [before the first, between, ..., after the last]."""
    out, position = [], 0
    for k in assistants:
        mark = MARK.format(k)
        found = marked.find(mark, position)
        if found < 0:
            raise ChatTemplateError(f"assistant turn {k}'s content does not appear in the rendered template")
        out.append(marked[position:found])
        position = found + len(mark)
    return [*out, marked[position:]]


def tool_calls(calls: Sequence[tuple[str, str]], mark: str | None = None) -> list[dict[str, Any]]:
    """A turn's calls, (name, arguments as JSON text) each, as OpenAI `tool_calls` (`mark`: the first's name)."""
    import json

    out = []
    for k, (name, arguments) in enumerate(calls):
        parsed = json.loads(arguments)
        out.append({"type": "function", "function": {"name": mark if k == 0 and mark else name,
                                                     "arguments": parsed}})
    return out


def _content_end(real: str, position: int, content: str, following: str, *, last: bool) -> int:
    """Where an assistant's content, starting at `position` of the rendering, ends: before the scaffolding that
    follows it (the content as given or trimmed, as templates write it; else the first place the scaffolding fits,
    at the very end for the last turn). -1 when the scaffolding is not found."""
    for candidate in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
        stop = position + len(candidate)
        if real.startswith(candidate, position) and real.startswith(following, stop) and (
                not last or stop + len(following) == len(real)):
            return stop
    if last:
        return len(real) - len(following) if real.endswith(following) else -1
    return real.find(following, position)


def _answer_start(scaffold: str, prompt: str) -> int:
    """Where the answer starts in the text before an assistant's content: after the generation prompt the template
    writes there (the longest part of it that the turn agrees with), or at the content when it writes none."""
    for size in range(len(prompt), 0, -1):
        found = scaffold.rfind(prompt[:size])
        if found >= 0 and (size == len(prompt) or found + size == len(scaffold)):
            return found + size
    return len(scaffold)


def _probe(template: JinjaTemplate, tokenizer: Any, text: str, what: str | tuple[str, ...]) -> str:
    """Facts about a jinja template, found by rendering probes (cached per tokenizer and template)."""
    cache = tokenizer.__dict__.setdefault("_mmadapt_template_probes", {})
    key = (text, what)
    if key not in cache:
        cache[key] = _run_probe(template, tokenizer, what)
    return cache[key]


def _run_probe(template: JinjaTemplate, tokenizer: Any, what: str | tuple[str, ...]) -> str:
    if isinstance(what, tuple):  # ("images", image_text): an image part written as image_text, once
        if not template.reads_parts(tokenizer):
            return "no"
        parts = [{"type": "image"}, {"type": "text", "text": PROBE_TEXT}]
        try:
            out = template.apply(tokenizer, [{"role": "user", "content": parts}], False)
        except TemplateRenderError:
            return "no"
        return "yes" if out.count(what[1]) == 1 and PROBE_TEXT in out else "no"
    if what == "parts":
        try:
            out = template.apply(tokenizer, [{"role": "user", "content": [{"type": "text", "text": PROBE_TEXT}]}],
                                 False)
        except Exception:  # a template that cannot iterate parts fails on them: it reads strings
            return "no"
        return "yes" if PROBE_TEXT in out else "no"
    mark = MARK.format(0)
    messages = template.messages([Turn("user", "hi"), Turn("assistant", mark)], tokenizer, ["hi", mark])
    if what == "conversation":
        return template.apply(tokenizer, messages, False) + template.apply(tokenizer, messages[:1], True)
    out = template.apply(tokenizer, messages, False)
    return out.split(mark, 1)[1] if mark in out else ""


@functools.cache
def shipped_template(file: str) -> str:
    return resources.files("mmadapt.data").joinpath("chat_templates", file).read_text()


TEMPLATES: Registry[ChatTemplate] = Registry("chat template")
TEMPLATES.register("vicuna_v1", VicunaTemplate(
    name="vicuna_v1", description="LLaVA-1.5 / Vicuna v1 (conv_vicuna_v1): '<s>{system} USER: ... ASSISTANT: ...</s>'",
    default_system="A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                   "helpful, detailed, and polite answers to the user's questions.",
))
TEMPLATES.register("chatml", ChatMLTemplate(
    name="chatml", description="Qwen ChatML (Qwen3-VL's): '<|im_start|>role\\n...<|im_end|>', vision_start/pad/end "
    "spans",
))
TEMPLATES.register("qwen3_5", JinjaTemplate(
    name="qwen3_5", description="Qwen3.5's official template (thinking by default; template_kwargs "
    "{enable_thinking: false} for the non-thinking form)", file="qwen3_5.jinja"))
TEMPLATES.register("qwen3_vl", JinjaTemplate(
    name="qwen3_vl", description="Qwen3-VL-Instruct's official template", file="qwen3_vl.jinja"))
TEMPLATES.register("llava_hf", JinjaTemplate(
    name="llava_hf", description="llava-hf/llava-1.5-*-hf's template: 'USER: <image>\\n... ASSISTANT:', no system "
    "prompt, no end token", file="llava_hf.jinja"))


def with_kwargs(jinja: str, template_kwargs: dict[str, Any]) -> str:
    """`jinja` with `template_kwargs` as its defaults (`{%- if enable_thinking is not defined -%}{%- set
    enable_thinking = false -%}{%- endif -%}`), so that a tokenizer saved with it renders as in training without being
    told them again, and a caller that passes one (`apply_chat_template(..., enable_thinking=True)`, a server's
    `chat_template_kwargs`) still chooses it."""
    import json

    def literal(value: Any) -> str:
        return "none" if value is None else json.dumps(value)

    for key in template_kwargs:
        if not key.isidentifier():
            raise ValueError(f"template_kwargs key {key!r} is not a template variable name")
    sets = "".join(f"{{%- if {k} is not defined -%}}{{%- set {k} = {literal(v)} -%}}{{%- endif -%}}"
                   for k, v in template_kwargs.items())
    head = next((JINJA_MARK.format(name=n) for n in TEMPLATES.names() if jinja.startswith(JINJA_MARK.format(name=n))),
                "")
    return head + sets + jinja[len(head):]


def resolve_template(choice: str, tokenizer: Any, backbone_default: str) -> ChatTemplate:
    """`auto`: the tokenizer's own template (a built-in when it is one of mmadapt's exports), else the backbone's
    built-in; `tokenizer`: the tokenizer's, required; a name: that built-in."""
    own = getattr(tokenizer, "chat_template", None)
    own = own if isinstance(own, str) and own else None
    if choice not in MODES:
        return TEMPLATES.get(choice)
    if own is None:
        if choice == "tokenizer":
            raise ChatTemplateError("chat_template: tokenizer, but the tokenizer has no chat_template. Fix: "
                                    f"chat_template: auto, or a built-in ({', '.join(TEMPLATES.names())})")
        return TEMPLATES.get(backbone_default)
    for name, template in TEMPLATES.items():
        if own.startswith(JINJA_MARK.format(name=name)) or (isinstance(template, JinjaTemplate) and template.file
                                                             and own == template.text(tokenizer)):
            return template  # mmadapt's own export, or a shipped official template: the exact built-in
    return JinjaTemplate(name="tokenizer", description="the tokenizer's own chat_template")
