"""The image effect of an answer: what the model says, and how sure it stays of its answer, without its image.

    effect = image_effect(model, processor, messages, image, other, answer, max_new_tokens=32)
    effect.blanked_answer, effect.blanked_change    # the greedy answer with the image blanked; change of log p, nats
    effect.other_answer, effect.other_change    # the same with `other` in the image's place (None without one)

Contract: the conversation (`messages`, one image) is answered again greedily - by the one answering function,
`mmadapt.answering.answer_prompts` - with the image's pixel values zeroed (the processor's mean colour, as `mmadapt
eval` blanks) and with another image in its place, and the log-probability of the shown answer (`log_p`, teacher
forcing through the model's one input path) is compared with the real image's. What the page's evidence view says
under the map.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmadapt.answering import Answer, PromptInputs, respond
from mmadapt.controls import BLANKED
from mmadapt.evidence.maps import MIN_EFFECT
from mmadapt.evidence.prompt import Prompt, answer_log_probs
from mmadapt.modes import eval_mode
from mmadapt.sampling import Sampling


@dataclass(frozen=True)
class Effect:
    """The answer with the image blanked / another image: the greedy answer then, and the change of log p(answer)
    (the displayed answer's) from the real image, in nats (negative: less likely without this image)."""

    blanked_answer: str
    blanked_change: float
    other_answer: str | None
    other_change: float | None

    @property
    def rests_on_image(self) -> bool:
        """Whether every change lowers log p(answer) by at least `MIN_EFFECT`: without the image, less sure."""
        return all(c <= -MIN_EFFECT for c in (self.blanked_change, self.other_change) if c is not None)

    def lines(self, other_name: str | None = None) -> list[str]:
        """The effect in words (Markdown list items; `other_name`: what the other image is called)."""
        lines = [f"- image blanked (the mean colour): the model answers “{self.blanked_answer or '(empty)'}”; "
                 f"log p(answer) {self.blanked_change:+.2f} nats"]
        if self.other_answer is not None and other_name is not None:
            lines.append(f"- another image ({other_name}): “{self.other_answer or '(empty)'}”; log p(answer) "
                         f"{self.other_change:+.2f} nats")
        lines.append("- so the answer **rests on this image**: without it the model is less sure of it."
                     if self.rests_on_image else "- so the answer does **not clearly rest on this image**: the "
                     "model gives it about as readily without it.")
        return lines


def image_effect(model: Any, processor: Any, messages: Sequence[Mapping[str, Any]], image: Any, other: Any,
                 answer: Answer, max_new_tokens: int) -> Effect:
    """`Effect` of the conversation's one image on `answer`: the same conversation with the image's pixel values
    zeroed and with `other` (None: not asked) in its place."""
    greedy = Sampling(max_new_tokens=max_new_tokens)
    real = PromptInputs.build(model, processor, messages, images=[image])
    blank = dataclasses.replace(real, inputs={**real.inputs, "pixel_values": BLANKED.pixels(
        real.inputs["pixel_values"]).pixels})
    ids = list(answer.content_ids) or list(answer.token_ids[:1])  # an empty answer: its end token
    base = log_p(model, real.inputs, ids)
    blanked_text = respond(model, processor, blank, sampling=greedy).text
    blanked_change = log_p(model, blank.inputs, ids) - base
    if other is None:
        return Effect(blanked_text, blanked_change, None, None)
    swapped = PromptInputs.build(model, processor, messages, images=[other])
    return Effect(blanked_text, blanked_change, respond(model, processor, swapped, sampling=greedy).text,
                  log_p(model, swapped.inputs, ids) - base)


def log_p(model: Any, inputs: dict[str, Any], ids: list[int]) -> float:
    """log p(ids | prompt) under the model (teacher forcing through its one input path)."""
    prompt = Prompt.of(model, inputs, ids)
    with eval_mode(model), torch.no_grad():
        return float(answer_log_probs(model, prompt.ids, prompt.answer, prompt.visual(model), None, copies=1)[0])
