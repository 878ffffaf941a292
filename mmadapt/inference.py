"""Models for inference, and a chat session over one: `load_for_inference(src)`, `Chat`.

What training leaves behind (a checkpoint, a run's newest valid one, a model directory) is read by
`mmadapt.train.export.load_trained`: built as in training, loaded strictly, LoRA merged. This module adds what a
user names on the command line: a run's adapters directory (its run), a run directory with an `OUT/model`, or a
base model and `--adapters DIR` merged into it. `chat`, `eval`, `sees` and `explain` load through it.

`Chat(model, processor).ask(text, images=, videos=, on_text=)` holds a conversation (each turn's images and videos
kept, placeholders inserted, the answer streamed through `on_text`); `mmadapt chat` is a few lines over it, and a
notebook or a server uses the same object.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmadapt import directory as model_directory
from mmadapt.model import VisionLanguageModel
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


# ---- a chat session ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How a chat chooses its answer's tokens: greedy (`temperature` <= 0, the default) or sampled at `temperature`
    from the `top_p` nucleus, reproducibly from `seed`; at most `max_new_tokens` per answer."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


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
    in pieces that concatenate to the returned answer (what `mmadapt chat` prints). Generation runs in eval mode
    (`eval_mode`: the model's modes are restored after). The model never generates a placeholder token, and an
    answer's placeholder text (`<image>`, `<|video_pad|>`, ...) is removed from what the later turns see
    (`Processor.inert`, logged): an answer is never read as visual input.
    """

    def __init__(self, model: VisionLanguageModel, processor: Processor, *, sampling: Sampling = Sampling()) -> None:
        self.model, self.processor, self.sampling = model, processor, sampling
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
        self.generator = torch.Generator().manual_seed(self.sampling.seed)

    def attach(self, *, images: Sequence[Any] = (), videos: Sequence[Any] = ()) -> None:
        """Images and videos for the next turn."""
        self.images += list(images)
        self.videos += list(videos)

    def ask(self, text: str, images: Sequence[Any] = (), videos: Sequence[Any] = (),
            on_text: Callable[[str], None] | None = None) -> str:
        """The model's answer to `text` (with `images` / `videos` and those attached), after the earlier turns."""
        self.attach(images=images, videos=videos)
        placeholders = ("" if "<video>" in text else "<video>\n" * len(self.videos)) + (
            "" if "<image>" in text else "<image>\n" * len(self.images))
        self.turns.append(ChatTurn("user", placeholders + text, tuple(self.images), tuple(self.videos)))
        self.images, self.videos = [], []
        inputs = self.processor([{"role": t.role, "content": t.content} for t in self.turns],
                                images=[i for t in self.turns for i in t.images],
                                videos=[v for t in self.turns for v in t.videos])
        stream = TextStream(self.processor, on_text)
        with eval_mode(self.model):
            out = self.model.generate(**inputs, max_new_tokens=self.sampling.max_new_tokens,
                                      eos_token_id=self.processor.eos_token_ids,
                                      pad_token_id=self.processor.encoder.pad_token_id,
                                      temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                      generator=self.generator, on_token=stream.token)
        reply = self.processor.decode(out[0])
        stream.text(reply)
        context = self.processor.inert(reply)
        if context != reply:
            log.warning("the answer holds placeholder text (%s); it stays in the answer but is removed from the "
                        "conversation the next turns see: an answer is never read as visual input",
                        ", ".join(p for p in self.processor.placeholder_texts if p in reply))
        self.turns.append(ChatTurn("assistant", context))
        return reply


class TextStream:
    """Token ids in, decoded text increments out: `on_text` gets what the decoded text gained at each token."""

    def __init__(self, processor: Processor, on_text: Callable[[str], None] | None) -> None:
        self.processor, self.on_text = processor, on_text
        self.ids: list[int] = []
        self.sent = ""

    def token(self, tokens: torch.Tensor) -> None:
        """The step's tokens (B,): the first row's is this stream's."""
        self.ids.append(int(tokens[0]))
        if self.on_text is not None:
            self.text(self.processor.decode(self.ids))

    def text(self, so_far: str) -> None:
        """The decoded text so far: its new end goes to `on_text`."""
        if self.on_text is not None and so_far[len(self.sent):]:
            self.on_text(so_far[len(self.sent):])
        self.sent = so_far
