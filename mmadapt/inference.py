"""Models for inference, answering a conversation, and a chat session: `load_for_inference(src)`, `respond`, `Chat`.

Loading is `mmadapt.loading.load_for_inference` (re-exported here): a model directory (mmadapt's or a transformers
export), a run directory (its `OUT/model`, else its newest valid checkpoint), a checkpoint, a run's adapters directory,
or a base model and `--adapters DIR` merged into it; built as in training, loaded strictly, LoRA merged. `chat`,
`eval`, `sees`, `explain` and the server load through it, and import nothing of training.

Answering itself is `mmadapt.answering` (`respond`, `answer_prompts`, `Sampling`, `Answer`, ...; re-exported here):
the one answering function of the command line, the server, the page, `mmadapt eval`, the lmms-eval model and
evidence maps. `Chat(model, processor).ask(text, images=, videos=, on_text=)` holds a conversation over `respond`
(each turn's images and videos kept, placeholders inserted as the parts `[image, text]` are); `mmadapt chat` is a
few lines over `Chat`, and so is each conversation of the page.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmadapt.answering import (  # noqa: F401  (answering's names, where callers of `respond` have found them)
    Answer,
    PromptInputs,
    Sampling,
    TokenLogprob,
    Usage,
    answer_prompts,
    inert,
    respond,
)
from mmadapt.data.samples import IMAGE, VIDEO
from mmadapt.loading import load_for_inference
from mmadapt.model import VisionLanguageModel
from mmadapt.processor import Processor
from mmadapt.sampling import DEFAULT_SAMPLING

log = logging.getLogger(__name__)


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
    placeholder per attached image (video) directly in front of the text: the content parts `[image, text]` of an
    OpenAI request, so a question with an image is the server's prompt too (`mmadapt.answering`). `on_text(piece)`
    receives the answer as it is decoded, in pieces that concatenate to the returned answer (what `mmadapt chat`
    prints). Each turn is answered by
    `respond` (the server's code too), drawing from one generator seeded at `reset`; `last` is the latest `Answer`
    (finish reason, usage, log-probs). The model never generates a placeholder token, and an answer's placeholder
    text (`<image>`, `<|video_pad|>`, ...) is removed from what the later turns see (`Processor.inert`, logged): an
    answer is never read as visual input.
    """

    def __init__(self, model: VisionLanguageModel, processor: Processor, *,
                 sampling: Sampling = DEFAULT_SAMPLING) -> None:
        self.model, self.processor, self.sampling = model, processor, sampling
        self.last: Answer | None = None
        self.reset()

    @classmethod
    def load(cls, src: str | Path, adapters: str | Path | None = None, *,
             sampling: Sampling = DEFAULT_SAMPLING) -> Chat:
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
        placeholders = ("" if VIDEO in text else VIDEO * len(self.videos)) + (
            "" if IMAGE in text else IMAGE * len(self.images))  # the parts [video.., image.., text]: module doc
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
        self.turns.append(ChatTurn("assistant", inert(self.processor, self.last.text, "the answer")))
        return self.last.text
