"""Models for inference, answering a conversation, and a chat session: `load_for_inference(src)`, `respond`, `Chat`.

What training leaves behind (a checkpoint, a run's newest valid one, a model directory) is read by
`mmadapt.train.export.load_trained`: built as in training, loaded strictly, LoRA merged. This module adds what a
user names on the command line: a run's adapters directory (its run), a run directory with an `OUT/model`, or a
base model and `--adapters DIR` merged into it. `chat`, `eval`, `sees` and `explain` load through it.

`respond(model, processor, messages, sampling=)` answers a whole OpenAI-style message list (roles system / user /
assistant, content a string or parts) statelessly: the model's own chat template and its `template_kwargs` (thinking
blocks as the template writes them), the answer streamed through `on_text`, cut at stop strings, with its token ids,
finish reason, usage (visual tokens stated) and log-probs (`Answer`). `Chat(model, processor).ask(text, images=,
videos=, on_text=)` holds a conversation over it (each turn's images and videos kept, placeholders inserted);
`mmadapt chat` is a few lines over `Chat`, and `mmadapt serve` (`mmadapt.serve`) answers each request with
`respond`, so the server, the command line and a notebook decode alike.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmadapt import directory as model_directory
from mmadapt.data.samples import IMAGE, VIDEO
from mmadapt.model import GenerationStep, VisionLanguageModel
from mmadapt.modes import eval_mode
from mmadapt.processor import Processor
from mmadapt.train.export import load_trained
from mmadapt.train.stages import adapter_components, load_adapters

log = logging.getLogger(__name__)


def load_for_inference(src: str | Path, adapters: str | Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) for chat / eval / sees / explain: a model directory, a run directory (its OUT/model,
    else its newest valid checkpoint), a checkpoint, or a run's adapters directory (its run); with `adapters`,
    a base model from any of those and then the LoRA adapters of `adapters` merged into it (`load_adapters`)."""
    src = Path(src)
    if adapter_components(src):
        if adapters is not None:
            raise ValueError(f"{src} is an adapters directory; give the base model first: MODEL --adapters {src}")
        if not (src.parent / "checkpoints").is_dir():
            raise ValueError(f"{src} holds only LoRA adapters, not a model: give the run directory it came from, or "
                             f"the base model they were trained on and --adapters {src}")
        src = src.parent
    if (src / "model" / model_directory.CONFIG_FILE).is_file() and (src / "checkpoints").is_dir():
        src = src / "model"
    model, tokenizer = load_trained(src)
    if adapters is not None:
        if not Path(adapters).is_dir():
            raise FileNotFoundError(f"--adapters {adapters} is not a directory")
        load_adapters(model, adapters)
        model.eval()
    if tokenizer is None:
        raise ValueError(f"{src} holds no tokenizer files; export it again from its run (mmadapt export), or save it "
                         "with save_pretrained(dir, tokenizer=tokenizer)")
    return model, tokenizer


# ---- answering a conversation -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How an answer's tokens are chosen: greedy (`temperature` <= 0, the default) or sampled at `temperature` from
    the `top_p` nucleus, reproducibly from `seed`; at most `max_new_tokens` per answer.

    `repetition_penalty`: transformers' (1.0 = off; > 1 discourages the tokens already in the prompt or the answer,
    `mmadapt.model.penalize_repetition`). `stop`: strings that end the answer, text-level: the answer is cut before
    the first one that appears (it is not part of the answer) and generation stops there. `logprobs`: None for none,
    K >= 0 for each answer token's log-prob and its K most likely alternatives (`TokenLogprob`; the model's own
    distribution, before the penalty, temperature and nucleus: `mmadapt.model.token_logprobs`).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            raise TypeError(f"stop must be a sequence of strings, got the string {self.stop!r}: give (text,)")
        object.__setattr__(self, "stop", tuple(self.stop))
        problems = [
            f"max_new_tokens must be >= 1, got {self.max_new_tokens}" if self.max_new_tokens < 1 else "",
            f"temperature must be >= 0, got {self.temperature}" if not self.temperature >= 0 else "",
            f"top_p must be in (0, 1], got {self.top_p}" if not 0 < self.top_p <= 1 else "",
            f"repetition_penalty must be > 0, got {self.repetition_penalty}" if not self.repetition_penalty > 0 else "",
            "stop strings must be non-empty strings" if not all(isinstance(t, str) and t for t in self.stop) else "",
            f"logprobs must be None or >= 0, got {self.logprobs}" if (self.logprobs or 0) < 0 else "",
        ]
        if any(problems):
            raise ValueError("; ".join(p for p in problems if p))


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
    `Sampling.logprobs` was set, else None."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Prompt:
    """A conversation made ready for the model (`Prompt.build`): the model's keyword inputs, on its device, and the
    prompt's counts (`Usage`, no completion tokens yet). Building it is where a bad conversation fails (a template
    refusal, a placeholder / image mismatch, a prompt over max_length), before any generation."""

    inputs: dict[str, Any]
    usage: Usage

    @classmethod
    def build(cls, model: VisionLanguageModel, processor: Processor, messages: Sequence[Mapping[str, Any]], *,
              images: Sequence[Any] = (), videos: Sequence[Any] = ()) -> Prompt:
        """`messages` (see `respond`) with their images and videos through the Processor (the model's chat template
        and `template_kwargs`, as in training)."""
        turns, images, videos = _conversation(processor, messages, images, videos)
        device = next(model.parameters()).device
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                  for k, v in processor(turns, images=images, videos=videos).items()}
        return cls(inputs, prompt_usage(processor, inputs))


def respond(model: VisionLanguageModel, processor: Processor, messages: Sequence[Mapping[str, Any]] | Prompt, *,
            images: Sequence[Any] = (), videos: Sequence[Any] = (), sampling: Sampling = Sampling(),
            generator: torch.Generator | None = None, on_text: Callable[[str], None] | None = None,
            on_token: Callable[[int, TokenLogprob | None], None] | None = None,
            cancelled: Callable[[], bool] | None = None) -> Answer:
    """The model's answer to `messages`, statelessly: what `Chat`, `mmadapt chat` and `mmadapt serve` all run.

    `messages`: `{"role": "system" | "user" | "assistant", "content": ...}`, ending with a user turn (a trailing
    assistant turn would ask for a continuation, which is not supported); content a string (`<image>` / `<video>`
    marking the images and videos of `images` / `videos`, in order) or a list of parts: `{"type": "text", "text":
    ...}`, `{"type": "image", "image": PIL image or path}` and `{"type": "video", "video": file or frames}` (the
    image or video given inline, or - without the key - the next one of `images` / `videos`; not both ways in one
    call). Or a `Prompt` already built from them. The prompt is the model's chat template with its
    `template_kwargs` (`Processor`), as in training, thinking blocks as the template writes them; an assistant
    turn's placeholder text is removed first (`Processor.inert`, logged): an answer is never read as visual input.

    Decoding: `sampling` (greedy by default), random draws from `generator` (default: a new one seeded with
    `sampling.seed`), on the model's device, in eval mode (modes restored after). `on_token(token_id, logprob)`
    gets each generated token (its `TokenLogprob` when `sampling.logprobs` is set, else None), then `on_text(piece)`
    what it added to the answer: pieces that concatenate to `Answer.text` (text that may still turn out to start a
    stop string, or an incomplete character, is held back until it is known). `cancelled()`, asked after each
    token, ends the answer early when true (`finish_reason` "cancelled": a client that went away).
    """
    prompt = messages if isinstance(messages, Prompt) else Prompt.build(model, processor, messages, images=images,
                                                                         videos=videos)
    if generator is None:
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(sampling.seed)
    decoding = Decoding(processor, sampling, on_text, on_token, cancelled)
    with eval_mode(model):
        model.generate(**prompt.inputs, max_new_tokens=sampling.max_new_tokens, eos_token_id=processor.eos_token_ids,
                       pad_token_id=processor.encoder.pad_token_id, temperature=sampling.temperature,
                       top_p=sampling.top_p, generator=generator, repetition_penalty=sampling.repetition_penalty,
                       logprobs=sampling.logprobs, on_step=decoding.step)
    return decoding.answer(prompt.usage)


def prompt_usage(processor: Processor, inputs: Mapping[str, Any]) -> Usage:
    """The prompt's counts of one processed conversation (`Usage` with no completion tokens yet)."""
    ids, valid = inputs["input_ids"][0], inputs["attention_mask"][0].bool()
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
            text = _inert(processor, text, f"messages[{k}]")
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


def _inert(processor: Processor, text: str, where: str) -> str:
    """An answer put back into a prompt, with its placeholder text removed (logged)."""
    context = processor.inert(text)
    if context != text:
        log.warning("%s: the answer holds placeholder text (%s); it is removed from the conversation the model sees: "
                    "an answer is never read as visual input", where,
                    ", ".join(p for p in processor.placeholder_texts if p in text))
    return context


class Decoding:
    """One answer as it is generated: `step` is `generate`'s `on_step` (ids, log-probs, stop strings, end tokens,
    cancellation); `answer` is the `Answer` once generation returns."""

    def __init__(self, processor: Processor, sampling: Sampling, on_text: Callable[[str], None] | None,
                 on_token: Callable[[int, TokenLogprob | None], None] | None,
                 cancelled: Callable[[], bool] | None) -> None:
        self.processor, self.sampling, self.on_token, self.cancelled = processor, sampling, on_token, cancelled
        self.stream = TextStream(lambda ids: processor.tokenizer.decode(ids, skip_special_tokens=True), on_text,
                                 stop=sampling.stop)
        self.ends = set(processor.eos_token_ids)
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.reason = "length"

    def step(self, step: GenerationStep) -> bool:
        """Take the step's token (row 0); True ends the answer (a stop string completed, or cancelled)."""
        token = int(step.tokens[0])
        self.ids.append(token)
        if step.logprobs is not None:
            self.logprobs.append(self.token_logprob(step))
        if self.on_token is not None:
            self.on_token(token, self.logprobs[-1] if step.logprobs is not None else None)
        if token in self.ends:
            self.reason = "stop"  # generate itself ends at an end token
            return True
        if self.stream.update(self.ids):
            self.reason = "stop"
            return True
        if self.cancelled is not None and self.cancelled():
            self.reason = "cancelled"
            return True
        return False

    def token_logprob(self, step: GenerationStep) -> TokenLogprob:
        assert step.logprobs is not None and step.top_ids is not None and step.top_logprobs is not None
        top = tuple(self.entry(int(i), float(v)) for i, v in zip(step.top_ids[0].tolist(),
                                                                 step.top_logprobs[0].tolist(), strict=True))
        chosen = self.entry(int(step.tokens[0]), float(step.logprobs[0]))
        return TokenLogprob(chosen.token_id, chosen.token, chosen.bytes, chosen.logprob, top)

    def entry(self, token_id: int, logprob: float) -> TokenLogprob:
        text, raw = token_text(self.processor.tokenizer, token_id)
        return TokenLogprob(token_id, text, raw, logprob)

    def answer(self, usage: Usage) -> Answer:
        text = self.stream.finish(self.ids)
        usage = Usage(usage.prompt_tokens, usage.image_tokens, usage.video_tokens, len(self.ids))
        return Answer(text, tuple(self.ids), self.reason, usage,
                      tuple(self.logprobs) if self.sampling.logprobs is not None else None)


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


# ---- a chat session ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatTurn:
    """One turn of a chat: its role, its text (placeholders included) and the images and videos it brought."""

    role: str
    content: str
    images: tuple[Any, ...] = ()
    videos: tuple[Any, ...] = ()


class Chat:
    """A conversation with a model: each `ask` is one user turn, answered with the whole conversation in context.

        chat = Chat.load("runs/colours", sampling=Sampling(max_new_tokens=64))   # or Chat(model, processor)
        chat.ask("What colour is this?", images=["red.png"])                      # the first turn's image...
        chat.ask("And the border?")                                               # ...is still in context
        chat.attach(videos=["clip.mp4"]); chat.ask("Which way does it move?")     # `/video PATH` in `mmadapt chat`

    Images and videos (paths or PIL images; videos also lists of frames) belong to the turn they are asked with
    (`ask(..., images=, videos=)` or `attach` before it); a turn whose text holds no `<image>` (`<video>`) gets one
    placeholder line per attached image (video) in front. `on_text(piece)` receives the answer as it is decoded,
    in pieces that concatenate to the returned answer (what `mmadapt chat` prints). Each turn is answered by
    `respond` (the server's code too), drawing from one generator seeded at `reset`; `last` is the latest `Answer`
    (finish reason, usage, log-probs). The model never generates a placeholder token, and an answer's placeholder
    text (`<image>`, `<|video_pad|>`, ...) is removed from what the later turns see (`Processor.inert`, logged): an
    answer is never read as visual input.
    """

    def __init__(self, model: VisionLanguageModel, processor: Processor, *, sampling: Sampling = Sampling()) -> None:
        self.model, self.processor, self.sampling = model, processor, sampling
        self.last: Answer | None = None
        self.reset()

    @classmethod
    def load(cls, src: str | Path, adapters: str | Path | None = None, *, sampling: Sampling = Sampling()) -> Chat:
        """A chat with the model of `src` (and `adapters`), as `load_for_inference` loads it."""
        model, tokenizer = load_for_inference(src, adapters)
        return cls(model, Processor.for_model(model, tokenizer), sampling=sampling)

    def reset(self) -> None:
        """Forget the conversation and the attachments; sampling starts again from the seed (as a new chat)."""
        self.turns: list[ChatTurn] = []
        self.images: list[Any] = []  # attached to the next turn
        self.videos: list[Any] = []
        device = next(self.model.parameters()).device
        self.generator = torch.Generator(device=device).manual_seed(self.sampling.seed)

    def attach(self, *, images: Sequence[Any] = (), videos: Sequence[Any] = ()) -> None:
        """Images and videos for the next turn."""
        self.images += list(images)
        self.videos += list(videos)

    def ask(self, text: str, images: Sequence[Any] = (), videos: Sequence[Any] = (),
            on_text: Callable[[str], None] | None = None, cancelled: Callable[[], bool] | None = None) -> str:
        """The model's answer to `text` (with `images` / `videos` and those attached), after the earlier turns.
        `cancelled()`, asked after each token, ends the answer early (what was said so far stays in the chat)."""
        self.attach(images=images, videos=videos)
        placeholders = ("" if "<video>" in text else "<video>\n" * len(self.videos)) + (
            "" if "<image>" in text else "<image>\n" * len(self.images))
        self.turns.append(ChatTurn("user", placeholders + text, tuple(self.images), tuple(self.videos)))
        self.images, self.videos = [], []
        return self._answer(on_text, cancelled)

    def regenerate(self, on_text: Callable[[str], None] | None = None,
                   cancelled: Callable[[], bool] | None = None) -> str:
        """Answer the last question again, in place of its answer (sampled anew from the chat's generator; a greedy
        chat gives the same answer)."""
        if len(self.turns) < 2 or self.turns[-1].role != "assistant":
            raise ValueError("there is no answer to regenerate: ask a question first")
        question, answer = self.turns[-2], self.turns.pop()
        try:
            return self._answer(on_text, cancelled)
        except BaseException:
            self.turns += [question, answer]  # _answer removed the question: both come back
            raise

    def prompt(self) -> tuple[list[dict[str, str]], list[Any], list[Any]]:
        """(messages, images, videos) of the conversation before its latest answer (what that answer was given):
        `respond`'s inputs, placeholders in the text."""
        end = len(self.turns) - (bool(self.turns) and self.turns[-1].role == "assistant")
        turns = self.turns[:end]
        return ([{"role": t.role, "content": t.content} for t in turns], [i for t in turns for i in t.images],
                [v for t in turns for v in t.videos])

    def _answer(self, on_text: Callable[[str], None] | None, cancelled: Callable[[], bool] | None) -> str:
        """Answer the conversation, which ends with the user's turn; a turn that cannot be answered is removed."""
        messages, images, videos = self.prompt()
        try:
            self.last = respond(self.model, self.processor, messages, images=images, videos=videos,
                                sampling=self.sampling, generator=self.generator, on_text=on_text,
                                cancelled=cancelled)
        except BaseException:
            self.turns.pop()  # a turn that could not be answered is not part of the conversation
            raise
        self.turns.append(ChatTurn("assistant", _inert(self.processor, self.last.text, "the answer")))
        return self.last.text


class TextStream:
    """Token ids in, answer text out: `on_text` gets what the answer gained, once it is sure.

    `decode(ids)` is the tokenizer's decoding (special tokens skipped, nothing stripped); the answer is that text
    without its leading and trailing whitespace (`Processor.decode`), cut before the first `stop` string, which is
    searched in the text itself (so a stop string of whitespace, "\n\n", is found as it appears). Held back until
    the next token settles them: trailing whitespace (the answer may end there), an incomplete character (decoded as
    U+FFFD) and an end that may be the start of a stop string. `update(ids)` returns True when a stop string has
    appeared; `finish(ids)` sends the rest and returns the whole answer.
    """

    def __init__(self, decode: Callable[[list[int]], str], on_text: Callable[[str], None] | None, *,
                 stop: Sequence[str] = ()) -> None:
        self.decode, self.on_text, self.stop = decode, on_text, tuple(stop)
        self.sent = ""
        self.final: str | None = None  # the answer, once a stop string ended it

    def update(self, ids: Sequence[int]) -> bool:
        """The tokens so far: send what is sure; True if a stop string appeared."""
        text = self.decode(list(ids)).lstrip()
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:  # never less than what was sent (decoding is prefix-stable once the held-back end is settled)
            self.final = text[:max(min(found), len(self.sent))].rstrip()
            self.send(self.final)
            return True
        self.send(text[:len(text) - self.unsure(text)])
        return False

    def finish(self, ids: Sequence[int]) -> str:
        """All the tokens: the rest is sent; the whole answer, cut before a stop string."""
        if self.final is None:
            self.final = self.decode(list(ids)).strip()
            self.send(self.final)
        return self.final

    def unsure(self, text: str) -> int:
        """How many characters at the end of `text` to hold back: the start of a stop string, and before it any
        whitespace or incomplete character."""
        starts = [k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])]
        settled = len(text) - max(starts, default=0)
        while settled and (text[settled - 1].isspace() or text[settled - 1] == "\ufffd"):
            settled -= 1
        return len(text) - settled

    def send(self, so_far: str) -> None:
        if len(so_far) > len(self.sent):
            if self.on_text is not None:
                self.on_text(so_far[len(self.sent):])
            self.sent = so_far
