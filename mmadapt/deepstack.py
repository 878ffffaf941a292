"""DeepStack (Qwen3-VL): an encoder's extra feature levels, added to the LLM's hidden states after its first layers.

Everything DeepStack does on the shared path lives here, in the order a model meets it:
1. Decide, before the parts are built: `emits(backbone_spec, mode)` - the encoder computes its levels only when
   the backbone takes them and the config does not say `deepstack: drop` (the encoder spec builds the encoder
   that way; nothing is switched off afterwards).
2. Count, once the parts exist: `levels_for(...)` - how many levels the backbone gets (0: none), refusing to lose
   them silently (an encoder that emits levels beside a backbone that cannot take them is a build error unless
   `deepstack: drop`, and a backbone too shallow for them is an error). The projector is built with that many
   level projections.
3. Check, on every batch: `check_levels` - the levels are there, each shaped like the main visual tokens.
4. Inject: `backbone_inputs(spans, visual)` - the backbone's `visual_pos_masks` + `deepstack_visual_embeds`.
5. Verify: `Probe` / `probe(...)` - hooks on the declared decoder layers confirm that every level was added.

Shapes: B batch, L tokens, N visual tokens (all images), D LLM width, K levels.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from mmadapt.contract import ImageSpans, violation

log = logging.getLogger(__name__)
MODES = ("use", "drop")


def emits(backbone_spec: Any, mode: str) -> bool:
    """Whether the encoder should compute its DeepStack levels: only for a backbone that takes them, unless dropped."""
    return bool(backbone_spec.deepstack) and mode != "drop"


def levels_for(encoder: Any, backbone_spec: Any, backbone_config: Any, *, encoder_name: str, mode: str,
               deepstack_backbones: list[str]) -> int:
    """How many DeepStack levels the backbone gets from `encoder` (0: none); refuses to lose them silently."""
    blocks, takes, bb = encoder.deepstack_levels, backbone_spec.deepstack, backbone_spec.name
    if blocks and not takes and mode != "drop":
        raise ValueError(
            f"encoder {encoder_name!r} emits {len(blocks)} DeepStack feature levels (blocks {list(blocks)}), but "
            f"backbone {bb!r} cannot take them: they would be dropped silently. Fix: a DeepStack backbone "
            f"({', '.join(deepstack_backbones)}), or build without them with "
            "deepstack: drop (`build_model(..., deepstack=\"drop\")`, `model.deepstack: drop` in a run config, "
            "`--deepstack drop`).")
    if blocks and (mode == "drop" or not takes):
        log.warning("deepstack: drop - the %d DeepStack levels of encoder %r (blocks %s) are not computed; "
                    "backbone %r gets the main visual tokens only", len(blocks), encoder_name, list(blocks), bb)
    elif takes and not blocks:
        log.info("backbone %r takes DeepStack levels but encoder %r emits none: it runs without them", bb,
                 encoder_name)
    if not (blocks and takes) or mode == "drop":
        return 0
    layers = backbone_config.num_hidden_layers
    if len(blocks) > layers:
        raise ValueError(f"encoder {encoder_name!r} emits {len(blocks)} DeepStack levels, added after decoder layers "
                         f"0..{len(blocks) - 1}, but backbone {bb!r} has {layers} layers: the last levels would be "
                         "skipped. Fix: fewer deepstack_visual_indexes, or a deeper backbone.")
    return len(blocks)


def check_levels(spans: ImageSpans, visual: Any, expected: int) -> None:
    """The `expected` levels are there, each with one LLM-width token per image position, like the main tokens
    (`visual.features`), so each image's span receives exactly its own level tokens."""
    if len(visual.levels) != expected:
        s = int(spans.sample[0]) if spans.num_spans else 0
        raise violation(s, f"the visual tokens carry {len(visual.levels)} DeepStack level(s), the backbone expects "
                        f"{expected}", "the encoder's levels were switched off or added after the model was built",
                        "build the model from its config (its levels follow the encoder and backbone)")
    for i, level in enumerate(visual.levels):
        if tuple(level.shape) != tuple(visual.features.shape):
            s = int(spans.sample[0]) if spans.num_spans else 0
            raise violation(s, f"DeepStack level {i} has shape {tuple(level.shape)} but the main visual tokens "
                            f"{tuple(visual.features.shape)} (one row per image position)", "a level projection "
                            "changes the token count or width differently from the main projector",
                            "project every level with a projector of the main one's kind (`levels` of the projector)")


def backbone_inputs(spans: ImageSpans, visual: Any) -> dict[str, Any]:
    """The backbone's DeepStack arguments for these visual tokens ({} without levels)."""
    if visual is None or not visual.levels:
        return {}
    return {"visual_pos_masks": spans.mask, "deepstack_visual_embeds": list(visual.levels)}


def probe(backbone: Any, spans: ImageSpans, visual: Any) -> Any:
    """A context that verifies, during the backbone's forward, that each level was added after its decoder layer
    (`Probe`); nothing to verify without levels."""
    if visual is None or not visual.levels:
        return contextlib.nullcontext()
    decoder = backbone.get_decoder()
    return Probe(decoder.layers, decoder.norm, spans, visual.levels)


class Probe:
    """Verifies that DeepStack level i was added at the image positions after decoder layer i.

    While active, a hook on layer i keeps `hidden[image positions] + level i` (the addition the backbone must
    make, in its dtype) and a pre-hook on the next module (layer i + 1, or the final norm) compares its input
    with it, bit for bit. On leaving, a level not added (a backbone that ignores `deepstack_visual_embeds`) is an
    `ImageTokenContractError`. Hooks run in the forward only: recomputation in backward (activation checkpointing)
    happens after they are removed. Cost: one (N, D) addition and comparison per level.
    """

    def __init__(self, layers: nn.ModuleList, norm: nn.Module, spans: ImageSpans,
                 levels: tuple[torch.Tensor, ...]) -> None:
        self.layers, self.norm, self.spans, self.levels = layers, norm, spans, levels
        self.expected: dict[int, torch.Tensor] = {}
        self.added: dict[int, bool] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> Probe:
        for i in range(len(self.levels)):
            following = self.layers[i + 1] if i + 1 < len(self.layers) else self.norm
            self.handles.append(self.layers[i].register_forward_hook(self._after(i)))
            self.handles.append(following.register_forward_pre_hook(self._before(i)))
        return self

    def _after(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            hidden = (output[0] if isinstance(output, tuple) else output).detach()
            mask = self.spans.mask.to(hidden.device)
            self.expected[i] = hidden[mask] + self.levels[i].detach().to(hidden.device, hidden.dtype)
        return hook

    def _before(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if i in self.expected and args:
                hidden = args[0].detach()
                self.added[i] = torch.equal(hidden[self.spans.mask.to(hidden.device)], self.expected.pop(i))
        return hook

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        for handle in self.handles:
            handle.remove()
        if kind is not None:
            return
        lost = [i for i in range(len(self.levels)) if not self.added.get(i, False)]
        if lost:
            i = lost[0]
            raise violation(int(self.spans.sample[0]), f"DeepStack level {i} was not added to the LLM's hidden states "
                            f"at the image positions after decoder layer {i} (levels not added: {lost})",
                            "the backbone ignores deepstack_visual_embeds / visual_pos_masks, or something changed "
                            "the hidden states between the layers", "register a backbone that adds them "
                            "(deepstack=True only for models whose forward does), or build with deepstack: drop")
