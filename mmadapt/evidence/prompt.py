"""One prompt with its answer, and the forwards every method and the faithfulness measure make of it.

Contract: `Prompt.of(model, inputs, answer_ids)` takes the keyword inputs of ONE prompt (`Processor` output, batch
of one, padding allowed) and appends the answer (teacher forcing; an answer holding a placeholder token, which would
be read as visual input, is refused with `ImageTokenContractError`); the objective is
F = sum_t log p(answer_t | prompt, answer_<t). Every forward goes through the model's one input path (`prepare`:
encoder, projector, DeepStack levels, injection, positions), so what is measured is what `model.forward` computes.

Shapes: L prompt tokens, T answer tokens, N visual tokens (all images, stored order), D LLM width, K versions of
the prompt, (t, h, w) an image's LLM-side token grid (after the projector's merge).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from mmadapt.batch import VisionBatch
from mmadapt.contract import ImageTokenContractError
from mmadapt.encoders.base import grid_coords
from mmadapt.generation import placeholder_ids
from mmadapt.packing import as_bool_mask

_observer: ContextVar[Callable[[int, int], None] | None] = ContextVar("mmadapt_evidence_observer", default=None)


@contextmanager
def observed(on_batch: Callable[[int, int], None]) -> Iterator[None]:
    """Inside the block, every batch of forwards the evidence makes (a method's masked copies or path points, the
    faithfulness curves) calls `on_batch(done, total)`: the versions of the prompt done so far in that sweep and
    how many it makes. An exception it raises stops the sweep there (a page's cancel button); the model is left as
    it was (`eval_mode` restores it)."""
    token = _observer.set(on_batch)
    try:
        yield
    finally:
        _observer.reset(token)


def report_batch(done: int, total: int) -> None:
    """Tell the observer of `observed`, if any, that a sweep has done `done` of its `total` versions."""
    on_batch = _observer.get()
    if on_batch is not None:
        on_batch(done, total)


@dataclass(frozen=True)
class Prompt:
    """One prompt with its answer appended: `ids` (1, L + T), `answer` (T,), the image inputs on the device."""

    ids: torch.Tensor
    answer: torch.Tensor
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor | None
    counts: torch.Tensor | None

    @classmethod
    def of(cls, model: Any, inputs: dict[str, Any], answer_ids: Any) -> Prompt:
        input_ids = inputs["input_ids"]
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"evidence() explains one prompt: input_ids must be (1, L), got "
                             f"{tuple(input_ids.shape)}")
        if inputs.get("pixel_values") is None:
            raise ValueError("the prompt has no images (pixel_values is None): there is nothing to map")
        device = next(model.parameters()).device
        valid = as_bool_mask(inputs.get("attention_mask"), input_ids)[0].to(device)
        answer = torch.as_tensor(answer_ids, device=device).flatten().long()
        if not answer.numel():
            raise ValueError("answer_ids is empty: give at least one answer token (e.g. the end token)")
        placeholders = torch.tensor(placeholder_ids(model.tokens), dtype=torch.long, device=device)
        if torch.isin(answer, placeholders).any():
            found = sorted(set(answer[torch.isin(answer, placeholders)].tolist()))
            raise ImageTokenContractError(
                f"answer_ids hold placeholder token(s) {found} (the image / video span tokens {placeholders.tolist()})"
                ": an answer is never read as visual input. Fix: explain an answer from model.generate (which never "
                "emits them), or drop those ids from answer_ids")
        grid_thw, counts = inputs.get("image_grid_thw"), inputs.get("images_per_sample")
        return cls(torch.cat([input_ids[0].to(device)[valid], answer])[None], answer,
                   inputs["pixel_values"].to(device), None if grid_thw is None else grid_thw.to(device),
                   None if counts is None else counts.to(device))

    def visual(self, model: Any, pixel_values: torch.Tensor | None = None, copies: int = 1) -> Any:
        """The visual tokens of `copies` copies of the prompt (their pixels: `pixel_values`, default the prompt's),
        through the model's one input path with the image-token contract checked; no graph."""
        with torch.no_grad():
            rows = self.ids.expand(copies, -1)
            return model.prepare(VisionBatch(
                rows, torch.ones_like(rows, dtype=torch.bool),
                self.pixel_values if pixel_values is None else pixel_values,
                None if self.grid_thw is None else self.grid_thw.repeat(copies, 1),
                images_per_sample=None if self.counts is None else self.counts.repeat(copies))).visual

    def cells(self, grids: torch.Tensor) -> torch.Tensor:
        """`cell_index` of this prompt's pixels."""
        return cell_index(self.pixel_values, self.grid_thw, grids)


def answer_log_probs(model: Any, ids: torch.Tensor, answer: torch.Tensor, visual: Any,
                     features: torch.Tensor | None, copies: int | None = None) -> torch.Tensor:
    """(K,) sum of the answer's log-probabilities for K versions (K, 1 + levels, N, D) of the visual tokens of prompt
    `ids` (1, L) - the main features, then each DeepStack level -, the answer being its last T tokens; the model's
    own injection and positions (1-D or M-RoPE). `features` None: `visual` already holds the tokens of `copies`
    copies of the prompt."""
    k = copies if features is None else features.shape[0]
    rows = ids.expand(k, -1)
    tokens = visual
    if features is not None:
        width = features.shape[-1]
        tokens = dataclasses.replace(
            visual, features=features[:, 0].reshape(-1, width), grids=visual.grids.repeat(k, 1),
            levels=tuple(features[:, i].reshape(-1, width) for i in range(1, features.shape[1])))
    inputs = model.prepare(VisionBatch(rows, torch.ones_like(rows, dtype=torch.bool)), visual=tokens, check=False)
    out = model.backbone(**inputs.backbone_kwargs(), use_cache=False,
                         logits_to_keep=answer.numel() + 1)  # the positions that predict the answer, and the last
    logits = out.logits[:, -answer.numel() - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, answer.expand(k, -1)[..., None]).squeeze(-1).sum(-1)


def cell_index(pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, grids: torch.Tensor) -> torch.Tensor:
    """The LLM token cell of every element of `pixel_values`, broadcastable against it: cells are numbered
    image by image, row-major over each image's (t, h, w) LLM-side grid (`grids`, after the projector's merge).

    Fixed-size encoders: pixel_values (I, C, S, S) -> (I, 1, S, S), pixel (y, x) in cell (y * h // S, x * w // S).
    Dynamic resolution (Qwen): pixel_values (P, C * T' * p * p), one row per patch in merge-window order over the
    patch grid `grid_thw` -> (P, 1), a patch in the cell of its merge window (the merge read off the two grids).
    """
    grids = grids.to(pixel_values.device)
    sizes = grids.prod(-1)
    offsets = torch.cumsum(sizes, 0) - sizes
    if grid_thw is None:
        height, width = pixel_values.shape[-2:]
        h, w = grids[:, 1].view(-1, 1, 1, 1), grids[:, 2].view(-1, 1, 1, 1)
        rows = torch.arange(height, device=grids.device).view(1, 1, -1, 1) * h // height
        cols = torch.arange(width, device=grids.device).view(1, 1, 1, -1) * w // width
        return offsets.view(-1, 1, 1, 1) + rows * w + cols
    merge = int(grid_thw[0, 1] // grids[0, 1])
    image, (frame, row, col) = grid_coords(grid_thw, merge)
    h, w = grids[image, 1], grids[image, 2]
    return (offsets[image] + frame * h * w + row // merge * w + col // merge)[:, None]


def masked_objectives(model: Any, prompt: Prompt, cells: torch.Tensor, keeps: torch.Tensor,
                      batch_size: int) -> torch.Tensor:
    """(K,) sum of the answer's log-probabilities with the cells where `keeps` (K, cells) is 0 set to 0 in the
    normalised pixels (the processor's mean colour), `batch_size` masked copies of the prompt per forward."""
    values: list[torch.Tensor] = []
    for chunk in keeps.split(batch_size):
        k = len(chunk)
        pixels = torch.cat([prompt.pixel_values * keep.to(prompt.pixel_values)[cells] for keep in chunk])
        visual = prompt.visual(model, pixels, copies=k)
        with torch.no_grad():
            values.append(answer_log_probs(model, prompt.ids, prompt.answer, visual, None, copies=k))
        report_batch(sum(len(v) for v in values), len(keeps))
    return torch.cat(values).cpu().double()
