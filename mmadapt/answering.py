"""The one way a model answers: `answer_prompts` (a batch) and `respond` (one conversation), and `Sampling`.

Every answering path runs through here: `mmadapt chat` and notebooks (`mmadapt.inference.Chat`), the server and its
page (`mmadapt.serve`), `mmadapt eval` (`mmadapt.evaluate.predict`), the lmms-eval model (`mmadapt.lmms_eval`),
evidence maps (`mmadapt.evidence.explain`) and RL: GRPO's evals and `mmadapt sees` on prompts answer greedily with
`answer_prompts` (`mmadapt.train.objectives.grpo.view`), and its rollouts (`mmadapt.train.objectives.rollout`), which
sample G answers per prompt from one prefill, take `generate`'s settings from `generate_settings` (the same end and
pad ids, the same `Sampling`) and their answers' texts from `decoded` (the same `Decoding`). So the same image,
question and sampling give the same answer on each, and a reward scores the text a person would have been shown.

    prompt = PromptInputs.build(model, processor, [{"role": "user", "content": [
        {"type": "image", "image": "cat.png"}, {"type": "text", "text": "What is it?"}]}])
    answer = respond(model, processor, prompt, sampling=Sampling(max_new_tokens=32))   # an `Answer`
    answers = answer_prompts(model, processor, PromptInputs.of(processor(...)), sampling=...)  # one per row

The steps, each written once: the prompt (`PromptInputs.build`: OpenAI-style messages through the `Processor`, the
model's chat template with its `template_kwargs`, as in training), `model.generate` (greedy or sampled, on the
model's device, in eval mode), decoding (`Decoding`: ids -> text as `mmadapt.text_stream.TextStream` streams it at a
constant cost per token, stop strings, the end tokens `Processor.eos_token_ids`, log-probs) and the end cut
(`Answer.content_ids`: the answer's ids before its end token). `decoded(processor, ids)` is the `Answer` that
decoding gives for ids generated elsewhere (an RL rollout's).

An image and a question are one prompt everywhere: the content parts `[{"type": "image"}, {"type": "text", "text":
Q}]` (what an OpenAI request sends, and what transformers' processors take), rendered by the model's own template as
it renders those parts (Qwen's: the image span directly followed by the question, no newline between). `Chat.ask`
with images and a question without `<image>` builds exactly those parts.

`Sampling` (`mmadapt.sampling`, which imports no torch) declares the sampling settings once, with their defaults
and help: `mmadapt chat`'s flags and the page's controls are generated from it (`sampling_settings()`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mmadapt.data.samples import IMAGE, VIDEO
from mmadapt.generation import GenerationStep
from mmadapt.model import VisionLanguageModel
from mmadapt.modes import eval_mode
from mmadapt.processor import Processor
from mmadapt.sampling import DEFAULT_SAMPLING, Sampling
from mmadapt.text_stream import TextStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Usage:
    """What an answer counted: `prompt_tokens` (the whole prompt, visual tokens included), of which `image_tokens`
    and `video_tokens` are the positions the vision side filled (the image / video placeholder positions; a Qwen
    span's start / end tokens are text), and `completion_tokens` (every generated token, the end token included)."""

    prompt_tokens: int
    image_tokens: int
    video_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token (or an alternative to it): its id, its text (special tokens written out, e.g.
    `<|im_end|>`), its exact bytes (a byte-level BPE piece of a multi-byte character is that piece's bytes), its
    log-prob, and - for a generated token - the alternatives asked for, most likely first."""

    token_id: int
    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Answer:
    """A model's answer to a conversation (`respond`).

    `text`: the decoded answer (special tokens skipped, whitespace stripped at both ends as `Processor.decode` strips
    it, cut before the first stop string); `token_ids`: every token generated, the end token (or the one completing
    a stop string) included; `finish_reason`: "stop" (an end token or a stop string), "length" (`max_new_tokens`
    reached) or "cancelled" (`cancelled()` turned true); `logprobs`: one `TokenLogprob` per generated token when
    `Sampling.logprobs` was set, else None; `content_ids` the ids without the end token."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] | None = None
    end_token: int | None = None  # the end token that closed `token_ids`, when one did

    @property
    def content_ids(self) -> tuple[int, ...]:
        """The end cut: the answer's ids without the end token that closed it (what `text` decodes)."""
        return self.token_ids[:-1] if self.end_token is not None else self.token_ids


@dataclass(frozen=True)
class PromptInputs:
    """Conversations made ready for the model: the model's keyword inputs for B rows, on its device, and each row's
    prompt counts (`usages`, no completion tokens yet). Building them (`build`, `batch`) is where a bad conversation
    fails (a template refusal, a placeholder / image mismatch, a prompt over max_length), before any generation."""

    inputs: dict[str, Any]
    usages: tuple[Usage, ...]

    @property
    def usage(self) -> Usage:
        """The counts of a one-row prompt."""
        if len(self.usages) != 1:
            raise ValueError(f"these inputs hold {len(self.usages)} prompts; read usages[k]")
        return self.usages[0]

    @classmethod
    def of(cls, model: VisionLanguageModel, processor: Processor, inputs: Mapping[str, Any]) -> PromptInputs:
        """Inputs already processed (`Processor` output, or a `Collator` batch of generation prompts), moved to the
        model's device; keys that are not `generate`'s inputs (labels, metadata) are dropped."""
        device = next(model.parameters()).device
        kept = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
                if k not in ("labels", "meta")}
        rows = kept["input_ids"].shape[0]
        return cls(kept, tuple(prompt_usage(processor, kept, row) for row in range(rows)))

    @classmethod
    def build(cls, model: VisionLanguageModel, processor: Processor, messages: Sequence[Mapping[str, Any]], *,
              images: Sequence[Any] = (), videos: Sequence[Any] = ()) -> PromptInputs:
        """One conversation (`messages`, see `respond`) with its images and videos through the Processor (the
        model's chat template and `template_kwargs`, as in training)."""
        return cls.batch(model, processor, [(messages, images, videos)])

    @classmethod
    def batch(cls, model: VisionLanguageModel, processor: Processor,
              conversations: Sequence[tuple[Sequence[Mapping[str, Any]], Sequence[Any], Sequence[Any]]]
              ) -> PromptInputs:
        """Several conversations, each (messages, images, videos), as one batch of rows (right-padded)."""
        prepared = [_conversation(processor, *conversation) for conversation in conversations]
        inputs = processor([p[0] for p in prepared], images=[p[1] for p in prepared], videos=[p[2] for p in prepared])
        return cls.of(model, processor, inputs)


def answer_prompts(model: VisionLanguageModel, processor: Processor, prompt: PromptInputs, *,
                   sampling: Sampling = DEFAULT_SAMPLING, generator: torch.Generator | None = None,
                   on_text: Callable[[str], None] | None = None,
                   on_token: Callable[[int, TokenLogprob | None], None] | None = None,
                   cancelled: Callable[[], bool] | None = None) -> list[Answer]:
    """The answers to the B rows of `prompt`, generated together: THE answering function (module docstring).

    Decoding: `sampling` (greedy by default), random draws from `generator` (default: a new one seeded with
    `sampling.seed`), on the model's device, in eval mode (modes restored after); each row ends at an end token
    (`Processor.eos_token_ids`), a stop string or `max_new_tokens`. For one row (a chat, a request): `on_token(
    token_id, logprob)` gets each generated token (its `TokenLogprob` when `sampling.logprobs` is set, else None),
    then `on_text(piece)` what it added to the answer: pieces that concatenate to `Answer.text` (text that may still
    turn out to start a stop string, or an incomplete character, is held back until it is known). `cancelled()`,
    asked after each token, ends the answers early when true (`finish_reason` "cancelled": a client that went away).
    """
    rows = len(prompt.usages)
    if rows > 1 and (on_text is not None or on_token is not None):
        raise ValueError(f"on_text / on_token stream one answer; these inputs hold {rows} prompts: answer one at a "
                         "time to stream")
    if generator is None:
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(sampling.seed)
    decodings = [Decoding(processor, sampling, on_text, on_token, cancelled) for _ in range(rows)]

    def step(generated: GenerationStep) -> torch.Tensor:
        return torch.tensor([decoding.step(generated, row) for row, decoding in enumerate(decodings)])

    with eval_mode(model):
        model.generate(**prompt.inputs, **generate_settings(processor, sampling), generator=generator, on_step=step)
    return [decoding.answer(usage) for decoding, usage in zip(decodings, prompt.usages, strict=True)]


def generate_settings(processor: Processor, sampling: Sampling) -> dict[str, Any]:
    """What `model.generate` takes of the processor and the sampling, for every answering path (`answer_prompts`,
    an RL rollout): the end ids (`Processor.eos_token_ids`: the tokenizer's EOS and the template's end of turn), the
    pad id (the encoder's, as training pads) and the `Sampling` settings that `generate` applies."""
    return {"max_new_tokens": sampling.max_new_tokens, "eos_token_id": processor.eos_token_ids,
            "pad_token_id": processor.encoder.pad_token_id, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "repetition_penalty": sampling.repetition_penalty, "logprobs": sampling.logprobs}


def decoded(processor: Processor, ids: Sequence[int], sampling: Sampling = DEFAULT_SAMPLING) -> Answer:
    """The `Answer` that `answer_prompts` gives a row for which `generate` chose `ids`: the same `Decoding` (end
    tokens, `sampling.stop`, the text as `TextStream` gives it) fed the ids in order, none read after the answer's
    end. For answers generated elsewhere (an RL rollout's G answers per prompt), so that what a reward scores is what
    answering returns. Without log-probs (the ids alone), and `usage` counts no prompt."""
    decoding = Decoding(processor, replace(sampling, logprobs=None), None, None, None)
    for token in ids:
        if decoding.take(int(token)):
            break
    return decoding.answer(Usage(0, 0, 0, 0))


def respond(model: VisionLanguageModel, processor: Processor, messages: Sequence[Mapping[str, Any]] | PromptInputs,
            *, images: Sequence[Any] = (), videos: Sequence[Any] = (), sampling: Sampling = DEFAULT_SAMPLING,
            generator: torch.Generator | None = None, on_text: Callable[[str], None] | None = None,
            on_token: Callable[[int, TokenLogprob | None], None] | None = None,
            cancelled: Callable[[], bool] | None = None) -> Answer:
    """The model's answer to one conversation, statelessly (`answer_prompts` of one row): what `Chat`, `mmadapt chat`
    and `mmadapt serve` run.

    `messages`: `{"role": "system" | "user" | "assistant", "content": ...}`, ending with a user turn (a trailing
    assistant turn would ask for a continuation, which is not supported); content a string (`<image>` / `<video>`
    marking the images and videos of `images` / `videos`, in order) or a list of parts: `{"type": "text", "text":
    ...}`, `{"type": "image", "image": PIL image or path}` and `{"type": "video", "video": file or frames}` (the
    image or video given inline, or - without the key - the next one of `images` / `videos`; not both ways in one
    call). Or `PromptInputs` already built from them. The prompt is the model's chat template with its
    `template_kwargs` (`Processor`), as in training, thinking blocks as the template writes them; an assistant
    turn's placeholder text is removed first (`Processor.inert`, logged): an answer is never read as visual input.
    The rest (`sampling`, `generator`, `on_text`, `on_token`, `cancelled`): see `answer_prompts`.
    """
    prompt = messages if isinstance(messages, PromptInputs) else PromptInputs.build(
        model, processor, messages, images=images, videos=videos)
    (answer,) = answer_prompts(model, processor, prompt, sampling=sampling, generator=generator, on_text=on_text,
                               on_token=on_token, cancelled=cancelled)
    return answer


def prompt_usage(processor: Processor, inputs: Mapping[str, Any], row: int = 0) -> Usage:
    """The prompt's counts of row `row` of processed inputs (`Usage` with no completion tokens yet)."""
    ids, valid = inputs["input_ids"][row], inputs["attention_mask"][row].bool()
    encoder = processor.encoder

    def count(token_id: int | None) -> int:
        return 0 if token_id is None else int(((ids == token_id) & valid).sum())

    return Usage(prompt_tokens=int(valid.sum()), image_tokens=count(encoder.image_token_id),
                 video_tokens=count(encoder.video_token_id), completion_tokens=0)


def _conversation(processor: Processor, messages: Sequence[Mapping[str, Any]], images: Sequence[Any],
                  videos: Sequence[Any]) -> tuple[list[dict[str, str]], list[Any], list[Any]]:
    """`messages` as the Processor takes them (string content, placeholders in place) with their images and videos
    in order: those given inline in parts, or else `images` / `videos`."""
    if isinstance(messages, (str, Mapping)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} messages")
    inline: dict[str, list[Any]] = {"image": [], "video": []}
    turns = []
    for k, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{k}] needs a role of 'system', 'user' or 'assistant', got {role!r}")
        text = _content(message.get("content"), f"messages[{k}]", inline)
        if role == "assistant":
            text = inert(processor, text, f"messages[{k}]")
        turns.append({"role": role, "content": text})
    if turns[-1]["role"] != "user":
        raise ValueError(f"the conversation's last message is the {turns[-1]['role']}'s; it must end with the user's "
                         "turn that the model answers (continuing a given assistant answer is not supported)")
    for kind, given in (("image", images), ("video", videos)):
        if inline[kind] and len(given):
            raise ValueError(f"{kind}s given both inside the messages ({{'type': '{kind}', '{kind}': ...}}) and as "
                             f"{kind}s=; give each {kind} one way")
    return turns, inline["image"] or list(images), inline["video"] or list(videos)


def _content(content: Any, where: str, inline: dict[str, list[Any]]) -> str:
    """A message's content as the Processor's text: parts joined, `<image>` / `<video>` where the parts were."""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise TypeError(f"{where}.content must be a string or a list of parts, got {type(content).__name__}")
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind in ("image", "video"):
            pieces.append(IMAGE if kind == "image" else VIDEO)
            if part.get(kind) is not None:
                inline[kind].append(part[kind])
        else:
            raise ValueError(f"{where}.content[{j}] is not a part mmadapt reads: {str(part)[:80]}; expected "
                             "{'type': 'text', 'text': ...}, {'type': 'image', 'image': ...} or "
                             "{'type': 'video', 'video': ...}")
    return "".join(pieces)


def inert(processor: Processor, text: str, where: str) -> str:
    """An answer put back into a prompt, with its placeholder text removed (logged)."""
    context = processor.inert(text)
    if context != text:
        log.warning("%s: the answer holds placeholder text (%s); it is removed from the conversation the model sees: "
                    "an answer is never read as visual input", where,
                    ", ".join(p for p in processor.placeholder_texts if p in text))
    return context


class Decoding:
    """One answer as it is generated: `step` takes its row of each `generate` step (ids, log-probs, stop strings, end
    tokens, cancellation); `answer` is the `Answer` once generation returns."""

    def __init__(self, processor: Processor, sampling: Sampling, on_text: Callable[[str], None] | None,
                 on_token: Callable[[int, TokenLogprob | None], None] | None,
                 cancelled: Callable[[], bool] | None) -> None:
        self.processor, self.sampling, self.on_token, self.cancelled = processor, sampling, on_token, cancelled
        self.stream = TextStream(lambda ids: processor.tokenizer.decode(ids, skip_special_tokens=True), on_text,
                                 stop=sampling.stop)
        self.streams = on_text is not None or bool(sampling.stop)  # else the text is decoded once, at the end
        self.ends = set(processor.eos_token_ids)
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.reason: str | None = None  # None while the answer goes on

    def step(self, step: GenerationStep, row: int = 0) -> bool:
        """Take row `row` of the step; True ends the answer (an end token, a stop string completed, cancelled)."""
        if self.reason is not None:
            return True  # generate fills a finished row with padding
        return self.take(int(step.tokens[row]), self.token_logprob(step, row) if step.logprobs is not None else None)

    def take(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """The answer's next token (and its log-prob); True ends the answer."""
        self.ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.on_token is not None:
            self.on_token(token, logprob)
        if token in self.ends or (self.streams and self.stream.update(self.ids)):
            self.reason = "stop"
        elif self.cancelled is not None and self.cancelled():
            self.reason = "cancelled"
        return self.reason is not None

    def token_logprob(self, step: GenerationStep, row: int) -> TokenLogprob:
        assert step.logprobs is not None and step.top_ids is not None and step.top_logprobs is not None
        top = tuple(self.entry(int(i), float(v)) for i, v in zip(step.top_ids[row].tolist(),
                                                                 step.top_logprobs[row].tolist(), strict=True))
        chosen = self.entry(int(step.tokens[row]), float(step.logprobs[row]))
        return TokenLogprob(chosen.token_id, chosen.token, chosen.bytes, chosen.logprob, top)

    def entry(self, token_id: int, logprob: float) -> TokenLogprob:
        text, raw = token_text(self.processor.tokenizer, token_id)
        return TokenLogprob(token_id, text, raw, logprob)

    def answer(self, usage: Usage) -> Answer:
        text = self.stream.finish(self.ids)
        usage = Usage(usage.prompt_tokens, usage.image_tokens, usage.video_tokens, len(self.ids))
        return Answer(text, tuple(self.ids), self.reason or "length", usage,
                      tuple(self.logprobs) if self.sampling.logprobs is not None else None,
                      end_token=self.ids[-1] if self.ids and self.ids[-1] in self.ends else None)


def token_text(tokenizer: Any, token_id: int) -> tuple[str, tuple[int, ...]]:
    """(text, exact bytes) of one token: special tokens as written (`<|im_end|>`); for a byte-level BPE tokenizer
    (Qwen, GPT-2 style) the bytes the token stands for (a piece of a multi-byte character too), else the UTF-8 of
    its text."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if token_id not in added and type(decoder).__name__ == "ByteLevel":
        table = _byte_level_table()
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if all(c in table for c in piece):
            return text, tuple(table[c] for c in piece)
    return text, tuple(text.encode("utf-8"))


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}
