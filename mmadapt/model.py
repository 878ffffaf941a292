"""VisionLanguageModel: encode -> project -> inject -> backbone, with the image-token contract checked.

`forward` takes the keyword inputs of the equivalent transformers model (LLaVA or
Qwen3.5-VL) and returns a transformers `CausalLMOutputWithPast` with `loss` and `logits`.
The backbone is the transformers causal LM itself; the glue only computes input embeddings
(visual tokens scattered into the image positions) and position ids (1-D or M-RoPE).
In training mode with `labels` the loss skips the full logits (`mmadapt.loss`: the backbone's
base model, then `lm_head` + cross-entropy over the supervised positions only, in chunks; the
same loss and gradients) and `logits` is None; eval mode, no labels, `return_logits=True` or
`model.full_logits_loss = True` (`train.full_logits`) give transformers' full computation.

One input path: `prepare(batch)` turns a batch's inputs (`mmadapt.batch.VisionBatch`, which `forward` and
`generate` build from their transformers-style keywords) into the backbone's (`ModelInputs`: the embeddings with the
visual tokens in place, positions, masks, DeepStack inputs), running the contract checks; `forward`, `generate`,
`contract.check_batch` and the evidence maps all go through it, so a new input kind is one `VisionBatch` field plus
the code here that reads it. `ModelInputs` is in `mmadapt.model_io`; decoding (`generate`) in `mmadapt.generation`.

Parts come from presets (random init) or from checkpoints (`ComponentConfig(pretrained=...)`: each
family reads its own checkpoints, see `mmadapt.weights`); they may differ in dtype, and the glue casts
at the boundaries (pixels to the encoder's dtype, features to the projector's, visual tokens to the
embeddings'). Model directories are read and written by `mmadapt.directory`. A model that started from one
checkpoint carries that checkpoint's weights of no part (`mmadapt.carried`: `model.carried`) into its saves.

DeepStack (Qwen3-VL, `mmadapt.deepstack`): whether the encoder computes its levels is decided before the parts are
built; the levels go through their own projections and, for a backbone that takes them, into its forward, checked
like the main tokens and verified with hooks on the declared decoder layers.

Videos (`mmadapt.frames`): each temporal patch of a video is a span of the video placeholder, encoded with the
images in one call of the vision side and merged with the image spans in text order; `prepare` routes, the module
encodes, checks and merges.

Packed batches add `cu_seqlens` (see `mmadapt.packing`): positions restart per sample,
attention gets a block-diagonal causal mask, and stateful layers (Qwen3.5's Gated DeltaNet)
run per sample; a training forward never builds a KV cache. At the public boundary (`forward`,
`generate`, `check_batch`) masks may be bool or any integer / float dtype holding only 0 and 1
(transformers' tokenizers return int64); they are converted to bool once (`packing.as_bool_mask`),
and everything inside takes `torch.bool` only.

What the model computes at the top, when it is not the loss and logits, is a head (`mmadapt.heads`):
`forward(..., head=SequenceLogps())` runs the decoder and returns the head's result, so an objective that needs a new
quantity adds a head, not a parameter of `forward`.

Shapes: B batch, L tokens, I images, N visual tokens, D LLM width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import distributed as dist
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from mmadapt import contract, deepstack, frames
from mmadapt.backbones import BACKBONES
from mmadapt.batch import VisionBatch
from mmadapt.carried import Carried
from mmadapt.config import ComponentConfig, ModelConfig
from mmadapt.contract import ImageSpans, ImageTokenContractError
from mmadapt.encoders import ENCODERS, VisualTokens
from mmadapt.generation import GenerateMixin
from mmadapt.heads import Head, HeadInputs
from mmadapt.model_io import ModelInputs
from mmadapt.packing import VARLEN, PackedRows, Segments, additive_mask, as_bool_mask, use_varlen_attention
from mmadapt.positions import mrope_positions, text_positions
from mmadapt.projectors import PROJECTORS

if TYPE_CHECKING:
    from mmadapt.directory import ProcessorWriter
    from mmadapt.sequence_parallel import SequenceParallel

log = logging.getLogger(__name__)


class VisionLanguageModel(nn.Module, GenerateMixin):
    """The model (see the module's docstring); `generate` comes from `mmadapt.generation.GenerateMixin`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.backbone_spec = BACKBONES.get(config.backbone.name)
        enc, proj, bb = config.encoder, config.projector, config.backbone
        encoder_spec = ENCODERS.get(enc.name)
        emits = deepstack.emits(self.backbone_spec, config.deepstack)  # decided before the parts are built
        self.encoder = (encoder_spec.from_pretrained(enc.pretrained, dtype=enc.dtype, levels=emits, **enc.options)
                        if enc.pretrained else encoder_spec.build(enc.preset, levels=emits, **enc.options))
        self.backbone, self.tokens = (
            self.backbone_spec.from_pretrained(bb.pretrained, dtype=bb.dtype, **bb.options) if bb.pretrained
            else self.backbone_spec.build(bb.preset, **bb.options))
        if self.backbone_spec.hybrid is not None:
            self.backbone_spec.hybrid.isolate(self.backbone)
        use_varlen_attention(self.backbone)
        self.config = config
        self.levels = deepstack.levels_for(
            self.encoder, self.backbone_spec, self.backbone.config, encoder_name=enc.name, mode=config.deepstack,
            deepstack_backbones=[n for n, s in BACKBONES.items() if s.deepstack])
        width = self.backbone.config.hidden_size
        projector_spec = PROJECTORS.get(proj.name)
        self.projector = (
            projector_spec.from_pretrained(proj.pretrained, self.encoder.output_dim, width, dtype=proj.dtype,
                                           levels=self.levels, **proj.options) if proj.pretrained
            else projector_spec.build(self.encoder.output_dim, width, levels=self.levels, **proj.options))
        parts = (("encoder", encoder_spec, self.encoder), ("backbone", self.backbone_spec, self.backbone))
        for part, spec, built in parts:
            declared = getattr(config, part)
            if declared.pretrained and declared.preset is not None:
                expect_architecture(built, lambda s=spec, d=declared: s.build(d.preset, **d.options),
                                    f"model.{part} {declared.name!r}", declared.preset, declared.pretrained)
        if self.projector.out_dim != width:
            raise ValueError(
                f"projector {config.projector.name!r} outputs width {self.projector.out_dim} but backbone "
                f"{config.backbone.name!r} expects {width}"
            )
        # weights of the checkpoint it started from that no part uses (`mtp.*`): kept for its saves, never loaded
        self.carried = Carried.at_start({"encoder": self.encoder, "projector": self.projector,
                                         "backbone": self.backbone})
        self._full_logits_reason: str | None = None  # see loss_without_logits
        self.full_logits_loss = False  # True: the training loss from full logits, as transformers (train.full_logits)
        # `mmadapt.sequence_parallel.SequenceParallel` when the ranks of a group share each sample's sequence
        self.sequence_parallel: SequenceParallel | None = None

    @classmethod
    def from_names(cls, encoder: str | dict | ComponentConfig, projector: str | dict | ComponentConfig,
                   backbone: str | dict | ComponentConfig, *, preset: str | None = "tiny",
                   **kwargs: Any) -> VisionLanguageModel:
        """`VisionLanguageModel.from_names("clip", "mlp2x_gelu", {"name": "llama", "pretrained": "vicuna-7b"})`."""
        return cls(ModelConfig.from_names(encoder, projector, backbone, preset=preset, **kwargs))

    def set_span_tokens(self, **ids: int) -> None:
        """Point the image span at other token ids (e.g. a tokenizer's); they are saved with the model."""
        self.tokens = dataclasses.replace(self.tokens, **ids)

    @property
    def uses_mrope(self) -> bool:
        return self.backbone_spec.positions == "mrope"

    # ---- the one input path ----------------------------------------------------------------------
    def prepare(self, batch: VisionBatch, *, visual: VisualTokens | None = None,
                visual_videos: VisualTokens | None = None, check: bool | None = None,
                trace: dict[str, Any] | None = None) -> ModelInputs:
        """A batch's inputs (`VisionBatch`) -> the backbone's (`ModelInputs`): locate the image spans, encode the
        images (or take ready `visual` tokens at LLM width; `visual_videos` likewise for the videos, one entry per
        video with its (t, h, w) grid), check the contract, scatter the visual tokens into the
        embeddings, derive positions (unless given) and the attention mask (packed rows: `cu_seqlens`).

        Videos (`mmadapt.frames`; dynamic encoders and backbones with a video token): encoded as transformers' Qwen
        models do, one span of `<|video_pad|>` per temporal patch, and merged with the image spans in text order:
        from there on, checks, injection, M-RoPE positions and DeepStack treat a frame as an image.

        `check`: run the image-token checks (default: the model config's `check_contract`). `trace`: a dict that
        receives `valid`, `spans` and `visual` as soon as they exist, for a report on a batch that fails a check.
        """
        check = self.config.check_contract if check is None else check
        trace = {} if trace is None else trace
        input_ids = batch.input_ids
        trace["spans"] = spans = contract.locate(input_ids, self.tokens.image_token_id)
        frame_spans = contract.locate(input_ids, self.tokens.video_token_id)
        trace["valid"] = valid = as_bool_mask(batch.attention_mask, input_ids)
        segments = None if batch.cu_seqlens is None else Segments.from_cu_seqlens(batch.cu_seqlens, valid)
        given = visual is not None
        # handed the tokens of no image (`vision_placeholder`: the vision side already ran for this batch): none to
        # inject, and no second placeholder; their exact 0 is added below, keeping the vision side in the graph
        no_picture, visual = (visual, None) if given and not visual.num_images else (None, visual)
        if (not given and visual_videos is None and batch.pixel_values is not None
                and batch.pixel_values_videos is not None):
            visual, video = frames.encode_together(self, batch, spans, frame_spans)
        else:
            if not given:
                visual = self.encode_checked(batch.pixel_values, batch.image_grid_thw, spans)
            video = frames.encode(self, batch, frame_spans) if visual_videos is None else frames.given(
                self, batch, frame_spans, visual_videos)
        if batch.image_index is not None and visual is not None and not given:
            visual = self.shared_images(visual, batch.image_index, spans)
        trace["visual"] = visual
        if check:
            self.check_inputs(input_ids, spans, visual, valid, batch.mm_token_type_ids, batch.position_ids,
                              batch.images_per_sample, frames=frame_spans)
            if video is not None or frame_spans.num_spans:
                frames.check(batch, frame_spans, video)
        elif frame_spans.num_spans and video is None:
            raise frames.missing(frame_spans)
        if video is not None:
            spans, visual = frames.merge(spans, visual, frame_spans, video)
            trace["spans"], trace["visual"] = spans, visual
            if check:
                self.check_placement(input_ids, spans, visual, valid)
        inputs_embeds = self.embed(input_ids, spans, visual)
        if check and visual is not None:
            contract.check_injected(inputs_embeds, spans, visual.features)
        if (no_picture is None and visual is None and video is None and batch.pixel_values is None
                and self.runs_vision_for_every_batch()):
            no_picture = self.vision_placeholder(inputs_embeds.device)
        if no_picture is not None:
            inputs_embeds = inputs_embeds + no_picture.zero().to(inputs_embeds.device, inputs_embeds.dtype)
        position_ids = batch.position_ids
        if position_ids is None:
            position_ids = self.positions(valid, spans, visual, segments)
        mask: Any = valid if batch.attention_mask is not None else None
        packed = None
        if segments is not None:
            mask = self.packed_attention(segments, valid, inputs_embeds.dtype)
            packed = PackedRows(segments, batch.cu_seqlens, valid)
        return ModelInputs(valid, spans, visual, inputs_embeds, position_ids, mask, packed, check)

    def shared_images(self, visual: VisualTokens, image_index: torch.Tensor, spans: ImageSpans) -> VisualTokens:
        """The visual tokens of the rows' images when rows share encoded images (`VisionBatch.image_index`): image k
        of the rows gets encoded image `image_index[k]`'s tokens (`VisualTokens.take`)."""
        encoded = int(visual.grids.shape[0])
        if image_index.ndim != 1 or (image_index.numel() and not 0 <= int(image_index.min()) <= int(
                image_index.max()) < encoded):
            first = int(spans.sample[0]) if spans.num_spans else 0
            raise ImageTokenContractError(
                f"sample {first}: image_index must be a (I,) index into the {encoded} encoded images, got "
                f"{image_index.tolist()[:16]}. Fix: build the batch with mmadapt.data.preference.PairCollator")
        return visual.take(image_index)

    def runs_vision_for_every_batch(self) -> bool:
        """Whether a batch without pictures still runs the vision side (`vision_placeholder`), so that every rank runs
        it as often, and at the same point, whatever its batches hold: in a multi-process run whose encoder or
        projector is sharded by FSDP2, in every forward (training, eval, `generate`'s prefill, with or without
        gradients: each forward of a vision unit all-gathers its parameters with the other ranks, whose gathers fall
        out of step otherwise: gloo's "Connection reset", a size mismatch, a hang on NCCL); and in a training forward
        with gradients whose vision side is trained (DDP: its backward reduces their gradients). Not in one process,
        nor where the vision side is unsharded and frozen, or the forward builds no graph (no collective to pair)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        from torch.distributed.fsdp import FSDPModule

        parts = (self.encoder, self.projector)
        if any(isinstance(m, FSDPModule) for part in parts for m in part.modules()):
            return True
        return self.training and torch.is_grad_enabled() and any(p.requires_grad for part in parts
                                                                 for p in part.parameters())

    def vision_placeholder(self, device: torch.device) -> VisualTokens:
        """The vision side's tokens of no picture: the encoder and projector run on their minimal input (one black
        image), none of its tokens kept (`VisualTokens.take` of nothing, DeepStack levels included). Handed to
        `prepare` (as `visual`, from an RL step's one encoding, or made there for a batch without pictures), it adds
        their exact 0 (`VisualTokens.zero`) to the embeddings: nothing changes, and every vision parameter gets an
        exactly-zero gradient while the encoder and projector run their forward and backward (and collectives)."""
        visual = self.encode_images(*self.encoder.minimal_input(device))
        return visual.take(torch.zeros(0, dtype=torch.long))

    def encode_images(self, pixel_values: torch.Tensor | None,
                      image_grid_thw: torch.Tensor | None = None) -> VisualTokens | None:
        """Encoder then projector: visual tokens at LLM width, with their LLM-side grids."""
        if pixel_values is None:
            return None
        visual = self.encoder(pixel_values, image_grid_thw)
        dtype = next(self.projector.parameters(), visual.features).dtype  # parts may differ in dtype
        return self.projector(dataclasses.replace(visual, features=visual.features.to(dtype)))

    def encode_checked(self, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                       spans: ImageSpans) -> VisualTokens | None:
        """`encode_images`, with pixel-format errors attributed to the first sample that has an image."""
        if pixel_values is not None and self.tokens.image_token_id is None:
            raise ImageTokenContractError(
                f"images were given, but backbone {self.backbone_spec.name!r} has no image token id: its checkpoint "
                f"defines none and neither a tokenizer nor options.image_token_id gave one, so no position can "
                f"receive the visual tokens. Fix: mmadapt.data.prepare_tokenizer(model, tokenizer) (adds "
                f"{self.backbone_spec.image_token!r} and resizes the embeddings; `mmadapt train` does it), or set "
                f"the backbone's options.image_token_id.")
        try:
            return self.encode_images(pixel_values, image_grid_thw)
        except ImageTokenContractError as e:
            first = int(spans.sample[0]) if spans.num_spans else 0
            raise ImageTokenContractError(f"sample {first}: {e}") from None

    def embed(self, input_ids: torch.Tensor, spans: ImageSpans, visual: VisualTokens | None) -> torch.Tensor:
        embeds = self.backbone.get_input_embeddings()(input_ids)
        if visual is None:
            return embeds
        return contract.scatter(embeds, spans, visual.features)

    def positions(self, valid: torch.Tensor, spans: ImageSpans, visual: VisualTokens | None,
                  segments: Segments | None = None) -> torch.Tensor:
        if self.uses_mrope:
            return mrope_positions(valid, spans, visual, segments)
        return text_positions(valid, segments)

    def packed_attention(self, segments: Segments, valid: torch.Tensor, dtype: torch.dtype) -> Any:
        """The attention-mask argument that isolates the samples of packed rows in this backbone.

        Varlen SDPA (the default) attends within each sample itself and needs no mask; eager and plain
        SDPA get a (B, 1, L, L) block-diagonal causal mask.
        """
        implementation = self.backbone.config._attn_implementation
        if implementation == VARLEN:
            mask = None
        elif implementation in ("sdpa", "eager"):
            mask = segments.attention_mask(valid)
            if implementation == "eager":
                mask = additive_mask(mask, dtype)
        else:
            raise ValueError(
                f"packed batches need attn_implementation 'sdpa' or 'eager'; the backbone uses {implementation!r}. "
                "Fix: build the backbone with attn_implementation='sdpa', or pad instead of packing."
            )
        if self.backbone_spec.hybrid is not None and self.backbone_spec.hybrid.layer_masks:
            # Hybrid models take one mask per layer type; linear-attention layers isolate samples themselves.
            return {"full_attention": mask, "linear_attention": None}
        return mask

    def check_inputs(self, input_ids: torch.Tensor, spans: ImageSpans, visual: VisualTokens | None,
                     valid: torch.Tensor, mm_token_type_ids: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None,
                     images_per_sample: torch.Tensor | None = None, frames: ImageSpans | None = None) -> None:
        """The image-token contract for one batch; raises `ImageTokenContractError` (`frames`: the video frames'
        spans, for `mm_token_type_ids`; the video checks are `frames.check` and, on the merged spans,
        `check_placement`)."""
        tokens_per_image = visual.tokens_per_image if visual is not None else input_ids.new_zeros(0)
        contract.check_spans(spans, tokens_per_image, batch_size=input_ids.shape[0],
                             images_per_sample=images_per_sample)
        self.check_placement(input_ids, spans, visual, valid)
        if mm_token_type_ids is not None:
            contract.check_token_types(spans, mm_token_type_ids, frames)
        if position_ids is not None and self.uses_mrope and spans.num_spans and position_ids.ndim == 2:
            s = int(spans.sample[0])
            raise ImageTokenContractError(
                f"sample {s}: 1-D position_ids (B, L) were given to M-RoPE backbone "
                f"{self.backbone_spec.name!r} for a batch with images; image tokens need (3, B, L) (t, h, w) "
                "positions. Fix: omit position_ids (mmadapt computes them) or pass 3-D ones."
            )

    def check_placement(self, input_ids: torch.Tensor, spans: ImageSpans, visual: VisualTokens | None,
                        valid: torch.Tensor) -> None:
        """Where the spans sit and what they receive: DeepStack levels shaped like the main tokens, the vision
        brackets around each span, no span position masked out (run on the images, then on images and frames)."""
        if visual is not None:
            deepstack.check_levels(spans, visual, self.levels)
        contract.check_brackets(input_ids, spans, self.tokens.vision_start_token_id, self.tokens.vision_end_token_id)
        contract.check_attention(spans, valid)

    # ---- training and scoring --------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        images_per_sample: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        videos_per_sample: torch.Tensor | None = None,
        meta: dict[str, Any] | None = None,
        return_logits: bool = False,
        image_index: torch.Tensor | None = None,
        video_index: torch.Tensor | None = None,
        visual: VisualTokens | None = None,
        visual_videos: VisualTokens | None = None,
        head: Head | None = None,
        **kwargs: Any,
    ) -> Any:
        """The backbone's output for the injected embeddings: `loss` (given `labels`) and `logits` (B, L, V).

        In training mode with `labels` the loss is computed without the full logits (`mmadapt.loss`: only the
        supervised positions, `lm_head` + cross-entropy in chunks, the same loss and gradients) and the output's
        `logits` is None; `return_logits=True`, eval mode or no labels give transformers' full computation.
        `meta` is the collator's bookkeeping (sample ids, skipped samples); the forward ignores it.

        `head` (`mmadapt.heads.Head`): what to compute at the top instead, e.g. `SequenceLogps()` (per-row answer
        log-probs: preference objectives), `TokenLogps(temperature)` (per-token log-probs and entropy: online RL),
        `TokenLosses()` (the loss and each position's token loss: a mixture's loss per source): the decoder runs on
        the prepared inputs and the head's result is returned (`run_head`). An objective that needs something else
        brings its own head; `forward` takes no objective's flags.

        `visual`: the rows' images already encoded (`VisualTokens` at LLM width, one entry per image of the rows, in
        row order; `VisualTokens.take` gives them from pictures encoded once): the vision side does not run for them
        (an RL step's one encoding, shared by its rollout and its forwards); the tokens of no image
        (`vision_placeholder`) for rows without pictures whose vision side already ran where every rank must run it
        (`runs_vision_for_every_batch`): it does not run again. `visual_videos`: the same for the rows'
        videos (one entry per video of the rows, its (t, h, w) grid; the rows still carry `video_grid_thw` and
        `videos_per_sample`, which the checks compare with it)."""
        if self.sequence_parallel is not None:  # this rank decodes its shard of the sequence
            return self.sequence_parallel.forward(self, VisionBatch.of(locals()), labels, head=head,
                                                  return_logits=return_logits, visual=visual,
                                                  visual_videos=visual_videos, kwargs=kwargs)
        inputs = self.prepare(VisionBatch.of(locals()), visual=visual,  # the inputs, by VisionBatch's fields
                              visual_videos=visual_videos)
        if head is not None:
            with inputs.verified(self.backbone):
                return self.run_head(head, inputs, labels, **kwargs)
        kwargs.setdefault("use_cache", False)  # a training forward never builds a KV cache
        if inputs.packed is not None and (kwargs["use_cache"] or kwargs.get("cache") is not None):
            raise ValueError("packed batches cannot use a KV cache: a cache carries state across the samples "
                             "of a row. Fix: use_cache=False (the default) or generate from unpacked rows.")
        return_logits = return_logits or self.full_logits_loss
        chunked = labels is not None and self.training and not return_logits and self.loss_without_logits()
        with inputs.verified(self.backbone):
            if chunked or self.router_aux_loss(kwargs):
                return self.own_loss(inputs, labels, chunked=chunked, **kwargs)
            return self.backbone(**inputs.backbone_kwargs(), labels=labels, **kwargs)

    def run_head(self, head: Head, inputs: ModelInputs, labels: torch.Tensor | None, *,
                 num_items_in_batch: Any = None, output_router_logits: bool | None = None, **kwargs: Any) -> Any:
        """The decoder (the backbone's base model) on the prepared inputs, then `head` on its top (`HeadInputs`)."""
        if not self.loss_without_logits():
            raise ValueError(f"head {type(head).__name__}: backbone {self.backbone_spec.name!r} computes its logits "
                             f"as more than lm_head(hidden) ({self._full_logits_reason}), which a head cannot "
                             "reproduce. Fix: use forward(labels=...) for its loss, or a backbone without it.")
        kwargs.setdefault("use_cache", False)
        router = self.router_aux_loss({"output_router_logits": output_router_logits})
        if router:
            kwargs["output_router_logits"] = True
        out = self.backbone.get_decoder()(**inputs.backbone_kwargs(), **kwargs)
        hidden = out.last_hidden_state
        aux = self.backbone.config.router_aux_loss_coef * self.balance_loss(out, inputs) if router else None
        return head(HeadInputs(hidden=hidden, labels=None if labels is None else labels.to(hidden.device),
                               output=self.backbone.get_output_embeddings(), inputs_embeds=inputs.inputs_embeds,
                               valid=inputs.valid, num_items_in_batch=num_items_in_batch, aux_loss=aux,
                               full_logits=self.full_logits_loss))

    def router_aux_loss(self, kwargs: dict[str, Any]) -> bool:
        """Whether this forward adds an MoE router's load-balancing loss (`output_router_logits`)."""
        requested = kwargs.get("output_router_logits")
        return bool(getattr(self.backbone.config, "output_router_logits", False) if requested is None else requested)

    def balance_loss(self, out: Any, inputs: ModelInputs) -> torch.Tensor:
        """The MoE router's load-balancing loss of a decoder output, over the real tokens (unweighted)."""
        from mmadapt.loss import router_balance_loss

        return router_balance_loss(self.backbone_spec, out.router_logits, self.backbone.config, inputs.valid)

    def loss_without_logits(self) -> bool:
        """Whether the training loss may skip the full logits (`mmadapt.loss`); logs once why not."""
        if self._full_logits_reason is None:
            from mmadapt.loss import full_path_reason

            self._full_logits_reason = full_path_reason(self.backbone.config) or ""
            if self._full_logits_reason:
                log.info("backbone %r computes its training loss from full logits: %s", self.backbone_spec.name,
                         self._full_logits_reason)
        return not self._full_logits_reason

    def own_loss(self, inputs: ModelInputs, labels: torch.Tensor | None, *, chunked: bool,
                 num_items_in_batch: Any = None, output_router_logits: bool | None = None,
                 **kwargs: Any) -> CausalLMOutputWithPast:
        """The backbone's base model, then the losses computed here: the token loss over the supervised positions
        only, in chunks (`chunked`: `mmadapt.loss`; given the input embeddings, so that a head tied to them has one
        (V, D) gradient buffer), or from full logits with the backbone's own loss function;
        plus, for MoE backbones with `output_router_logits`, the router's load-balancing loss the backbone declares
        (`mmadapt.loss.router_balance_loss`), over the real tokens only."""
        from mmadapt.loss import causal_lm_loss

        kwargs.pop("logits_to_keep", None)
        router = self.router_aux_loss({"output_router_logits": output_router_logits})
        if router:
            kwargs["output_router_logits"] = True
        out = self.backbone.get_decoder()(**inputs.backbone_kwargs(), **kwargs)
        hidden, head, logits, loss = out.last_hidden_state, self.backbone.get_output_embeddings(), None, None
        config = self.backbone.config
        if chunked:
            loss = causal_lm_loss(hidden, head, labels, num_items_in_batch, embeds=inputs.inputs_embeds)
        else:
            logits = head(hidden)
            if labels is not None:
                loss = self.backbone.loss_function(logits, labels, config.vocab_size,
                                                   num_items_in_batch=num_items_in_batch)
        if not router:
            return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache,
                                          hidden_states=out.hidden_states, attentions=out.attentions)
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        aux = self.balance_loss(out, inputs)
        if loss is not None:
            loss = loss + config.router_aux_loss_coef * aux.to(loss.device)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits, cache=out.cache,
                                         hidden_states=out.hidden_states, attentions=out.attentions,
                                         router_logits=out.router_logits)

    # ---- saving and loading ----------------------------------------------------------------
    def resolved_config(self) -> ModelConfig:
        """A config that rebuilds exactly this model with no presets, recording where pretrained parts came from."""
        options = {"encoder": self.encoder.options, "projector": self.projector.options,
                   "backbone": self.backbone_spec.saved_options(self.backbone, self.tokens)}
        parts = {}
        for part, part_options in options.items():
            provenance = getattr(getattr(self, part), "provenance", None)
            source = provenance.to_dict() if provenance is not None else getattr(self.config, part).source
            parts[part] = ComponentConfig(name=getattr(self.config, part).name, preset=None, options=part_options,
                                          source=source)
        return ModelConfig(**parts, check_contract=self.config.check_contract, deepstack=self.config.deepstack)

    def save_pretrained(self, directory: str | os.PathLike, format: str = "mmadapt", *, tokenizer: Any = None,
                        processor_export: ProcessorWriter | None = None, max_shard_size: int | str = "5GB",
                        overwrite: bool = False) -> None:
        """A model directory: everything inference needs (`mmadapt.directory`). `format="transformers"` writes the
        equivalent transformers model instead (LLaVA / Qwen3.5-VL / Qwen3-VL combinations only), its processor side
        written by `processor_export` (`mmadapt.processor.export_processor`, which this layer cannot import):

            from mmadapt.processor import export_processor
            model.save_pretrained("out-hf", format="transformers", tokenizer=tok, processor_export=export_processor)

        mmadapt's format: `config.json` (the components with their full options and provenance, the image
        processor's settings, the chat template's name), safetensors weights (sharded above `max_shard_size`)
        and, given a `tokenizer`, its files. `from_pretrained(directory)` needs nothing else.
        Written atomically (a sibling directory swapped in: the old model or the new one, never a mix); a directory
        that already holds a model is replaced only with `overwrite=True`, one holding other files never.
        """
        from mmadapt import directory as model_directory

        model_directory.save(self, directory, format=format, tokenizer=tokenizer, processor_export=processor_export,
                             max_shard_size=max_shard_size, overwrite=overwrite)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, strict: bool = True) -> VisionLanguageModel:
        """Load mmadapt's format or a transformers LLaVA / Qwen VLM directory (detected from config.json).

        The model is built on the meta device and materialised from the files; a missing weight is always
        an error (nothing is left randomly initialised). `strict=False` tolerates unexpected keys in an
        mmadapt directory; a transformers directory is read as three parts, which ignore keys of no part.
        """
        from mmadapt import directory as model_directory

        return model_directory.load(cls, directory, strict=strict)

    def backbone_tied_keys(self) -> dict[str, str]:
        """{key: key it is tied to} of the backbone's tied embeddings, both ways, as model keys."""
        from mmadapt.backbones.base import tied_keys

        return {f"backbone.{a}": f"backbone.{b}" for a, b in tied_keys(self.backbone).items()}

    def tie_weights(self) -> None:
        """Re-tie the backbone's tied embeddings (after loading weights into them)."""
        self.backbone.tie_weights()


def expect_architecture(module: nn.Module, build_preset: Any, what: str, preset: str, path: str) -> None:
    """A part loaded from `path` must have the architecture its declared `preset` builds: every parameter's shape."""
    from mmadapt.weights import empty_weights

    with empty_weights():
        built = build_preset()
    expected = {k: tuple(v.shape) for k, v in (built[0] if isinstance(built, tuple) else built).state_dict().items()}
    found = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    wrong = [f"{k} {found.get(k)} (preset: {shape})" for k, shape in expected.items() if found.get(k) != shape]
    wrong += [f"{k} {shape} (not in the preset)" for k, shape in found.items() if k not in expected]
    if wrong:
        raise ValueError(f"{what}: the checkpoint {path} does not have the architecture of preset {preset!r}: "
                         f"{'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}. Fix the preset (or drop it: the "
                         "checkpoint's own architecture is used), or point pretrained at the checkpoint you meant.")
