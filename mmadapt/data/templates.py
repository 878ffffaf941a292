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
label boundary is exact for any tokenizer. A piece that does not start the sequence is
tokenized behind a "\n" sentinel whose tokens are then dropped: SentencePiece-style tokenizers
would otherwise add a word-start marker ("▁") at every piece, which whole-string tokenization
(and the published checkpoints) never has.
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

    def end_of_turn(self, tokenizer: Any) -> str:
        """The token that ends an assistant turn (generation stops there)."""
        raise NotImplementedError

    def turn_pieces(self, turn: Turn, tokenizer: Any, first: bool = False) -> list[Piece]:
        """The pieces of one user or assistant turn; `first` when nothing or a special token precedes it."""
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
            out += self.turn_pieces(turn, tokenizer, first=not out or out[-1].kind == "special")
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
    """LLaVA-1.5's `conv_vicuna_v1` (sep " ", sep2 = EOS), labels as LLaVA's `preprocess_v1`.

    Separating spaces lead their piece (" USER:", " " + text), as they attach to the following
    word in whole-string SentencePiece tokenization ("▁USER:", "▁Hi").
    """

    def specials(self, tokenizer: Any) -> list[str]:
        return [tokenizer.eos_token or "</s>"]

    def system_pieces(self, system: str | None) -> list[Piece]:
        return content(system) if system else []

    def end_of_turn(self, tokenizer: Any) -> str:
        return tokenizer.eos_token or "</s>"

    def turn_pieces(self, turn: Turn, tokenizer: Any, first: bool = False) -> list[Piece]:
        if turn.role == "user":
            return [Piece("text", "USER:" if first else " USER:"), *content(" " + turn.text)]
        return [Piece("text", " ASSISTANT:"), *content(" " + turn.text, supervised=True),
                Piece("special", self.end_of_turn(tokenizer), supervised=True)]

    def generation_prompt(self) -> list[Piece]:
        return [Piece("text", " ASSISTANT:")]


@dataclass(frozen=True, kw_only=True)
class ChatMLTemplate(ChatTemplate):
    """Qwen's ChatML; the assistant's `<|im_end|>` is supervised (it is how the model learns to stop)."""

    def specials(self, tokenizer: Any) -> list[str]:
        return ["<|im_start|>", "<|im_end|>"]

    def system_pieces(self, system: str | None) -> list[Piece]:
        if not system:
            return []
        return [Piece("special", "<|im_start|>"), Piece("text", "system\n"), *content(system),
                Piece("special", "<|im_end|>"), Piece("text", "\n")]

    def end_of_turn(self, tokenizer: Any) -> str:
        return "<|im_end|>"

    def turn_pieces(self, turn: Turn, tokenizer: Any, first: bool = False) -> list[Piece]:
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
    text_started = False
    for piece in pieces:
        if piece.kind == "image":
            new = image_span(next(images))
        elif piece.kind == "special":
            new = [tokenizer.convert_tokens_to_ids(piece.value)]
        else:
            new = encode_text(tokenizer, piece.value, first=not text_started)
            text_started = True
        ids += new
        labels += new if piece.supervised else [IGNORE] * len(new)
    return ids, labels


SENTINEL = "\n"


def encode_text(tokenizer: Any, text: str, first: bool) -> list[int]:
    """Token ids of `text` as it tokenizes inside a longer string (see the module docstring)."""
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    if first:
        return plain
    prefix = tokenizer(SENTINEL, add_special_tokens=False)["input_ids"]
    joined = tokenizer(SENTINEL + text, add_special_tokens=False)["input_ids"]
    if joined[: len(prefix)] == prefix:
        return joined[len(prefix):]
    return plain  # the sentinel merged with the text: no clean cut, keep the plain tokens
