"""What the model's one input path makes of a batch.

`ModelInputs` is `VisionLanguageModel.prepare`'s result: the backbone's keyword inputs (the embeddings with the visual
tokens in place, positions, the attention mask, DeepStack inputs) and what the losses and checks need.
What the model computes at the top of its decoder instead of the loss is a head (`mmadapt.heads`).

Shapes: B batch, L tokens, D LLM width.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from mmadapt import deepstack
from mmadapt.contract import ImageSpans
from mmadapt.encoders import VisualTokens
from mmadapt.packing import PackedRows


@dataclass
class ModelInputs:
    """What `VisionLanguageModel.prepare` makes of a batch: the backbone's inputs and what the losses and checks need.

    `valid` (B, L) bool: real tokens; `spans`: the image spans; `visual`: the visual tokens at LLM width (None without
    images); `inputs_embeds` (B, L, D) with the visual tokens in place; `position_ids` (B, L) or (3, B, L);
    `attention_mask`: what the backbone takes (None, the (B, L) mask, or the packed rows' block mask);
    `packed`: the packed rows' `PackedRows` (None when padded); `checked`: whether the contract was checked.
    """

    valid: torch.Tensor
    spans: ImageSpans
    visual: VisualTokens | None
    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Any
    packed: PackedRows | None
    checked: bool

    def backbone_kwargs(self) -> dict[str, Any]:
        """The keyword inputs of the backbone (or its base model) for this batch."""
        kwargs = {"inputs_embeds": self.inputs_embeds, "attention_mask": self.attention_mask,
                  "position_ids": self.position_ids, **deepstack.backbone_inputs(self.spans, self.visual)}
        if self.packed is not None:
            kwargs["packed_segments"] = self.packed
        return kwargs

    def verified(self, backbone: Any) -> Any:
        """A context around the backbone's forward that verifies the DeepStack levels were added (when checked)."""
        return deepstack.probe(backbone, self.spans, self.visual) if self.checked else contextlib.nullcontext()
