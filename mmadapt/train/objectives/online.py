"""What the objectives that learn from the policy's own answers share (GRPO, on-policy distillation: `OnlineObjective`):
the prompts they train on (`mmadapt.data.prompts`), the step's one encoding of each picture by the policy (`encode`),
the stand-in a rank without prompts answers under FSDP2 (`stand_ins`, `stand_in`), the counted answer tokens a step
is normalised by (`units`), and the FSDP2 helpers their rollouts need (`is_sharded`, `gathered`).

Under FSDP2 every rank's encoding, rollout and forward gather parameters with the others', so a micro-batch whose
every prompt was a counted problem is answered by a stand-in (the training set's first good prompt) whose rows then
count for nothing (the objective's `masked_out`); elsewhere (one process, DDP) nothing runs a collective before the
backward, where the trainer's placeholder pairs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from mmadapt.train.batches import first_usable, placeholder_forward, to_device
from mmadapt.train.objectives.base import Objective, ObjectiveData, Run
from mmadapt.train.objectives.rollout import Encoded, encode_prompts

ROLLOUT = "rollout"  # the key of a scored micro-batch that holds its rollouts and its counted tokens' mask


def is_sharded(wrapped: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(wrapped, FSDPModule)


@contextlib.contextmanager
def gathered(wrapped: Any) -> Iterator[None]:
    """Under FSDP2, the root's own parameters (embeddings, head: those of no sharded unit) gathered while
    the block runs: `generate` and `encode_images` are not the root's forward, whose hooks would gather them (each
    block's forward still gathers its own)."""
    if not is_sharded(wrapped):
        yield
        return
    wrapped.unshard()
    try:
        yield
    finally:
        wrapped.reshard()


def vision_trains(model: Any) -> bool:
    """Whether the encoder or projector has trained parameters (its encoding then carries a graph, and changes with
    each optimizer step)."""
    return any(p.requires_grad for part in (model.encoder, model.projector) for p in part.parameters())


class OnlineObjective(Objective):
    """An objective whose rows are the policy's answers to prompts (see the module docstring); a subclass gives
    `bind` (what answering its prompts needs) and `answer_length` (the most tokens an answer may have)."""

    shares_videos = True  # a group's rows take their prompt's videos from one encoding (video_index)
    without_sequence_parallel = ("its rollout generates the answers token by token with a KV cache on each rank, "
                                 "which a split sequence does not have")

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._stand_in: dict[str, Any] | None = None  # the collated prompt a rank without prompts answers (FSDP2)

    @property
    def answer_length(self) -> int:
        return self.settings.max_completion_length

    def bind(self, encoder: Any, model: Any) -> None:
        """What answering the prompts needs, from the run's `SampleEncoder` and model."""
        raise NotImplementedError

    def data(self, model: Any, encoder: Any) -> ObjectiveData:
        """`data.train` / `data.eval` as prompts (trl / EasyR1 / ms-swift records, each encoded once), leaving room
        for `answer_length` tokens."""
        from mmadapt.data import Collator
        from mmadapt.data.prompts import PromptCollator, PromptDataset

        d = self.config.data
        self.require_one_unpacked_file(" of prompts", "lays out each prompt's answers side by side")
        self.bind(encoder, model)
        prompts = self.prompt_encoder(encoder)
        collate = PromptCollator(Collator.for_model(model, encoder.pad_token_id))
        return ObjectiveData(PromptDataset(d.train, prompts), PromptDataset(d.eval, prompts) if d.eval else None,
                             collate)

    def prompt_encoder(self, encoder: Any) -> Any:
        """How its prompts are encoded (`PromptEncoder`: room for `answer_length` tokens)."""
        from mmadapt.data.prompts import PromptEncoder

        return PromptEncoder(encoder, self.answer_length)

    def first_forward(self, run: Run) -> None:
        """Under FSDP2, one forward of the root before any of its blocks runs alone (a rollout, an encoding): FSDP2
        sets itself up in the root's first forward."""
        if is_sharded(run.wrapped):
            with torch.no_grad():
                placeholder_forward(run)

    def stand_ins(self, run: Run, micro: list[dict[str, Any]]) -> dict[int, Any]:
        """Under FSDP2, the micro-batches that hold no prompt (every record of them a counted problem), with their own
        meta: a stand-in answers for each (`stand_in`). None elsewhere."""
        if not is_sharded(run.wrapped):
            return {}
        return {k: batch.get("meta", {}) for k, batch in enumerate(micro) if not batch["input_ids"].shape[0]}

    def stand_in(self, run: Run) -> dict[str, Any]:
        """The micro-batch a rank answers in place of one without prompts: the training set's first good prompt,
        encoded, answered and scored like any other, its every collective paired with the other ranks' (the vision
        units', the blocks', the decoding steps' agreement), its answers then masked out."""
        if self._stand_in is None:
            found = first_usable(run.train_data)
            if not found:
                raise ValueError("no prompt of data.train can be answered (every record is a problem): check it with "
                                 "`mmadapt data check`")
            self._stand_in = run.collate_fn(found)
        return to_device(self._stand_in, run.device)

    def encode(self, run: Run, batch: dict[str, Any]) -> Encoded | None:
        """The micro-batch's pictures (images and videos) encoded once, by the policy in training mode, with
        gradients when the vision side trains (its graph is kept for the backward; under FSDP2 the vision units'
        hooks gather their parameters and reduce their gradients); without pictures, the vision side's run on no
        picture where every rank must run it (`rollout.encode_prompts`), else None."""
        model = run.model
        if not batch["input_ids"].shape[0]:
            return None
        was_training = model.training
        model.train()
        try:
            with torch.set_grad_enabled(vision_trains(model)), run.precision_context(), gathered(run.wrapped):
                return encode_prompts(model, batch)
        finally:
            model.train(was_training)

    def units(self, batch: dict[str, Any]) -> int:
        """A micro-batch's counted answer tokens (a stand-in's: none)."""
        return int(batch[ROLLOUT]["mask"].sum()) if ROLLOUT in batch else 0

    def tokens(self, batch: dict[str, Any]) -> int:
        return self.units(batch)
