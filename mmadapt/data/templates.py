"""Chat templates: a conversation -> token ids and labels, image spans expanded in place.

A template turns `Turn`s into `Piece`s: plain text, a special token (by its string, looked up
in the tokenizer, never split), or an image (expanded by the backbone's span tokens to
exactly the visual-token count the processor reported). Only assistant content and the
assistant's end-of-turn token are supervised; everything else is labelled -100.
Each backbone names its template (`BackboneSpec.chat_template`); templates register by name.

- `vicuna_v1` (LLaVA-1.5): "<s>{system} USER: <image>\\n{q} ASSISTANT: {a}</s>USER: ..."
- `chatml` (Qwen): "<|im_start|>user\\n<|vision_start|><|image_pad|>...<|vision_end|>{q}<|im_end|>\\n
  <|im_start|>assistant\\n{a}<|im_end|>\\n"; no default system prompt (Qwen3 style).

Text pieces are tokenized one at a time (without the tokenizer's own special tokens), so the
label boundary is exact for any tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mmadapt.data.samples import IMAGE, Turn
from mmadapt.registry import Registry

IGNORE = -100


@dataclass(frozen=True)
class Piece:
    kind: Literal["text", "special", "image"]
    value: str = ""
    supervised: bool = False


@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """Base class: `pieces(turns)` says what to emit; `specials` lists the special tokens it uses."""

    name: str
    description: str
    default_system: str | None = None
    bos: bool = False  # start with the tokenizer's BOS token

    def specials(self, tokenizer: Any) -> list[str]:
        raise NotImplementedError

    def turn_pieces(self, turn: Turn, tokenizer: Any) -> list[Piece]:
        raise NotImplementedError

    def system_pieces(self, system: str | None) -> list[Piece]:
        raise NotImplementedError

    def generation_prompt(self) -> list[Piece]:
        raise NotImplementedError

    def pieces(self, turns: Sequence[Turn], tokenizer: Any, add_generation_prompt: bool = False) -> list[Piece]:
        system = self.default_system
        if turns and turns[0].role == "system":
            system, turns = turns[0].text, turns[1:]
        out = [Piece("special", tokenizer.bos_token)] if self.bos and tokenizer.bos_token else []
        out += self.system_pieces(system)
        for turn in turns:
            if turn.role == "system":
                raise ValueError("a system turn may only come first")
            out += self.turn_pieces(turn, tokenizer)
        return out + (self.generation_prompt() if add_generation_prompt else [])


def content(text: str, supervised: bool = False) -> list[Piece]:
    """Text with `<image>` markers as text and image pieces, in order."""
    out: list[Piece] = []
    for k, chunk in enumerate(text.split(IMAGE)):
        if k:
            out.append(Piece("image"))
        if chunk:
            out.append(Piece("text", chunk, supervised))
    return out


@dataclass(frozen=True, kw_only=True)
class VicunaTemplate(ChatTemplate):
    """LLaVA-1.5's `conv_vicuna_v1` (sep " ", sep2 = EOS), labels as LLaVA's `preprocess_v1`."""

    def specials(self, tokenizer: Any) -> list[str]:
        return [tokenizer.eos_token or "</s>"]

    def system_pieces(self, system: str | None) -> list[Piece]:
        return [Piece("text", f"{system} ")] if system else []

    def turn_pieces(self, turn: Turn, tokenizer: Any) -> list[Piece]:
        if turn.role == "user":
            return [Piece("text", "USER: "), *content(turn.text), Piece("text", " ")]
        return [Piece("text", "ASSISTANT: "), *content(turn.text, supervised=True),
                Piece("special", tokenizer.eos_token or "</s>", supervised=True)]

    def generation_prompt(self) -> list[Piece]:
        return [Piece("text", "ASSISTANT:")]


@dataclass(frozen=True, kw_only=True)
class ChatMLTemplate(ChatTemplate):
    """Qwen's ChatML; the assistant's `<|im_end|>` is supervised (it is how the model learns to stop)."""

    def specials(self, tokenizer: Any) -> list[str]:
        return ["<|im_start|>", "<|im_end|>"]

    def system_pieces(self, system: str | None) -> list[Piece]:
        if not system:
            return []
        return [Piece("special", "<|im_start|>"), Piece("text", f"system\n{system}"), Piece("special", "<|im_end|>"),
                Piece("text", "\n")]

    def turn_pieces(self, turn: Turn, tokenizer: Any) -> list[Piece]:
        answer = turn.role == "assistant"
        return [Piece("special", "<|im_start|>"), Piece("text", f"{turn.role}\n"),
                *content(turn.text, supervised=answer), Piece("special", "<|im_end|>", supervised=answer),
                Piece("text", "\n")]

    def generation_prompt(self) -> list[Piece]:
        return [Piece("special", "<|im_start|>"), Piece("text", "assistant\n")]


TEMPLATES: Registry[ChatTemplate] = Registry("chat template")
TEMPLATES.register("vicuna_v1", VicunaTemplate(
    name="vicuna_v1", description="LLaVA-1.5 / Vicuna v1: 'USER: ... ASSISTANT: ...</s>'", bos=True,
    default_system="A chat between a curious human and an artificial intelligence assistant. The assistant gives "
                   "helpful, detailed, and polite answers to the human's questions.",
))
TEMPLATES.register("chatml", ChatMLTemplate(
    name="chatml", description="Qwen ChatML: '<|im_start|>role\\n...<|im_end|>', vision_start/pad/end spans",
))


def render(
    pieces: Sequence[Piece],
    tokenizer: Any,
    image_span: Any,
    tokens_per_image: Sequence[int],
) -> tuple[list[int], list[int]]:
    """Token ids and labels; `image_span(n)` gives the ids of an image with n visual tokens."""
    ids: list[int] = []
    labels: list[int] = []
    images = iter(tokens_per_image)
    for piece in pieces:
        if piece.kind == "image":
            new = image_span(next(images))
        elif piece.kind == "special":
            new = [tokenizer.convert_tokens_to_ids(piece.value)]
        else:
            new = tokenizer(piece.value, add_special_tokens=False)["input_ids"]
        ids += new
        labels += new if piece.supervised else [IGNORE] * len(new)
    return ids, labels
