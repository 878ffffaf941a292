"""VisionLanguageModel: encode -> project -> inject -> backbone, with the image-token contract checked.

`forward` takes the keyword inputs of the equivalent transformers model (LLaVA or
Qwen3.5-VL) and returns a transformers `CausalLMOutputWithPast` with `loss` and `logits`.
The backbone is the transformers causal LM itself; the glue only computes input embeddings
(visual tokens scattered into the image positions) and position ids (1-D or M-RoPE).

Packed batches add `cu_seqlens` (see `mmadapt.packing`): positions restart per sample,
attention gets a block-diagonal causal mask, and stateful layers (Qwen3.5's Gated DeltaNet)
run per sample; a training forward never builds a KV cache. Masks must be `torch.bool`.

Shapes: B batch, L tokens, I images, N visual tokens, D LLM width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from mmadapt import contract
from mmadapt.backbones import BACKBONES
from mmadapt.config import ComponentConfig, ModelConfig
from mmadapt.contract import ImageSpans, ImageTokenContractError
from mmadapt.encoders import ENCODERS, VisualTokens
from mmadapt.packing import VARLEN, Segments, additive_mask, require_bool_mask, use_varlen_attention
from mmadapt.positions import mrope_positions, text_positions
from mmadapt.projectors import PROJECTORS

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


class VisionLanguageModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.backbone_spec = BACKBONES.get(config.backbone.name)
        self.encoder = ENCODERS.get(config.encoder.name).build(config.encoder.preset, **config.encoder.options)
        self.backbone, self.tokens = self.backbone_spec.build(config.backbone.preset, **config.backbone.options)
        if self.backbone_spec.isolate is not None:
            self.backbone_spec.isolate(self.backbone)
        use_varlen_attention(self.backbone)
        width = self.backbone.config.hidden_size
        self.projector = PROJECTORS.get(config.projector.name).build(
            self.encoder.output_dim, width, **config.projector.options
        )
        if self.projector.out_dim != width:
            raise ValueError(
                f"projector {config.projector.name!r} outputs width {self.projector.out_dim} but backbone "
                f"{config.backbone.name!r} expects {width}"
            )
        self.config = config

    @classmethod
    def from_names(cls, encoder: str, projector: str, backbone: str, *, preset: str | None = "tiny",
                   **kwargs: Any) -> VisionLanguageModel:
        """`VisionLanguageModel.from_names("clip", "mlp2x_gelu", "llama", preset="tiny")`."""
        return cls(ModelConfig.from_names(encoder, projector, backbone, preset=preset, **kwargs))

    def set_span_tokens(self, **ids: int) -> None:
        """Point the image span at other token ids (e.g. a tokenizer's); they are saved with the model."""
        self.tokens = dataclasses.replace(self.tokens, **ids)

    @property
    def uses_mrope(self) -> bool:
        return self.backbone_spec.positions == "mrope"

    # ---- the four steps ---------------------------------------------------------------------
    def encode_images(self, pixel_values: torch.Tensor | None,
                      image_grid_thw: torch.Tensor | None = None) -> VisualTokens | None:
        """Encoder then projector: visual tokens at LLM width, with their LLM-side grids."""
        if pixel_values is None:
            return None
        return self.projector(self.encoder(pixel_values, image_grid_thw))

    def encode_checked(self, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                       spans: ImageSpans) -> VisualTokens | None:
        """`encode_images`, with pixel-format errors attributed to the first sample that has an image."""
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
        if self.backbone_spec.layer_masks:
            # Hybrid models take one mask per layer type; linear-attention layers isolate samples themselves.
            return {"full_attention": mask, "linear_attention": None}
        return mask

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
        meta: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """`meta` is the collator's bookkeeping (sample ids, skipped samples); the forward ignores it."""
        valid = as_bool_mask(attention_mask, input_ids)
        segments = None if cu_seqlens is None else Segments.from_cu_seqlens(cu_seqlens, valid)
        spans = contract.locate(input_ids, self.tokens.image_token_id)
        visual = self.encode_checked(pixel_values, image_grid_thw, spans)
        if self.config.check_contract:
            self.check_inputs(input_ids, spans, visual, valid, mm_token_type_ids, position_ids, images_per_sample)
        inputs_embeds = self.embed(input_ids, spans, visual)
        if self.config.check_contract and visual is not None:
            contract.check_injected(inputs_embeds, spans, visual.features)
        if position_ids is None:
            position_ids = self.positions(valid, spans, visual, segments)
        kwargs.setdefault("use_cache", False)  # a training forward never builds a KV cache
        backbone_mask: Any = valid if attention_mask is not None else None
        if segments is not None:
            if kwargs["use_cache"] or kwargs.get("cache") is not None:
                raise ValueError("packed batches cannot use a KV cache: a cache carries state across the samples "
                                 "of a row. Fix: use_cache=False (the default) or generate from unpacked rows.")
            backbone_mask = self.packed_attention(segments, valid, inputs_embeds.dtype)
            kwargs["packed_segments"] = segments.bounds
        return self.backbone(inputs_embeds=inputs_embeds, attention_mask=backbone_mask,
                             position_ids=position_ids, labels=labels, **kwargs)

    def check_inputs(self, input_ids: torch.Tensor, spans: ImageSpans, visual: VisualTokens | None,
                     valid: torch.Tensor, mm_token_type_ids: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None,
                     images_per_sample: torch.Tensor | None = None) -> None:
        """The image-token contract for one batch; raises `ImageTokenContractError`."""
        tokens_per_image = visual.tokens_per_image if visual is not None else input_ids.new_zeros(0)
        contract.check_spans(spans, tokens_per_image, batch_size=input_ids.shape[0],
                             images_per_sample=images_per_sample)
        contract.check_brackets(input_ids, spans, self.tokens.vision_start_token_id, self.tokens.vision_end_token_id)
        contract.check_attention(spans, valid)
        if mm_token_type_ids is not None:
            contract.check_token_types(spans, mm_token_type_ids)
        if position_ids is not None and self.uses_mrope and spans.num_spans and position_ids.ndim == 2:
            s = int(spans.sample[0])
            raise ImageTokenContractError(
                f"sample {s}: 1-D position_ids (B, L) were given to M-RoPE backbone "
                f"{self.backbone_spec.name!r} for a batch with images; image tokens need (3, B, L) (t, h, w) "
                "positions. Fix: omit position_ids (mmadapt computes them) or pass 3-D ones."
            )

    # ---- inference -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                 max_new_tokens: int = 32, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int = 0) -> torch.Tensor:
        """Greedy decoding with images. Returns only the new tokens (B, T), `pad_token_id` after EOS.

        Rows may be padded on either side: they are left-aligned internally.
        """
        valid = as_bool_mask(attention_mask, input_ids)
        order = torch.argsort(valid.int(), dim=1, stable=True)  # padding first, tokens in order
        input_ids, valid = input_ids.gather(1, order), valid.gather(1, order)
        spans = contract.locate(input_ids, self.tokens.image_token_id)
        visual = self.encode_checked(pixel_values, image_grid_thw, spans)
        if self.config.check_contract:
            self.check_inputs(input_ids, spans, visual, valid)
        embeds = self.embed(input_ids, spans, visual)
        positions = self.positions(valid, spans, visual)
        next_position = positions.amax(dim=(0, 2) if self.uses_mrope else 1) + 1
        eos = torch.tensor([] if eos_token_id is None else eos_token_id, device=input_ids.device).flatten()
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        out = self.backbone(inputs_embeds=embeds, attention_mask=valid, position_ids=positions, use_cache=True)
        new_tokens = []
        for _ in range(max_new_tokens):
            token = out.logits[:, -1].argmax(-1).masked_fill(done, pad_token_id)
            new_tokens.append(token)
            done |= torch.isin(token, eos)
            if bool(done.all()):
                break
            valid = torch.cat([valid, valid.new_ones(valid.shape[0], 1)], dim=1)
            step_positions = next_position[:, None]
            if self.uses_mrope:
                step_positions = step_positions.unsqueeze(0).expand(3, -1, -1)
            out = self.backbone(inputs_embeds=self.backbone.get_input_embeddings()(token[:, None]),
                                attention_mask=valid, position_ids=step_positions, cache=out.cache, use_cache=True)
            next_position = next_position + 1
        return torch.stack(new_tokens, dim=1)

    # ---- saving and loading ----------------------------------------------------------------
    def resolved_config(self) -> ModelConfig:
        """A config that rebuilds exactly this model with no presets."""
        return ModelConfig(
            encoder=ComponentConfig(name=self.config.encoder.name, preset=None, options=self.encoder.options),
            projector=ComponentConfig(name=self.config.projector.name, preset=None, options=self.projector.options),
            backbone=ComponentConfig(name=self.config.backbone.name, preset=None,
                                     options=self.backbone_spec.saved_options(self.backbone, self.tokens)),
            check_contract=self.config.check_contract,
        )

    def save_pretrained(self, directory: str | os.PathLike, format: str = "mmadapt") -> None:
        """mmadapt's format (config.json + model.safetensors), or `format="transformers"`."""
        if format == "transformers":
            from mmadapt.convert import save_transformers

            return save_transformers(self, directory)
        if format != "mmadapt":
            raise ValueError(f"unknown format {format!r}; use 'mmadapt' or 'transformers'")
        from safetensors.torch import save_model

        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, CONFIG_FILE), "w") as f:
            json.dump({"mmadapt": self.resolved_config().to_dict()}, f, indent=2)
        save_model(self, os.path.join(directory, WEIGHTS_FILE))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, strict: bool = True) -> VisionLanguageModel:
        """Load mmadapt's format or a transformers LLaVA / Qwen3.5-VL directory (detected from config.json)."""
        path = os.path.join(directory, CONFIG_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: not a saved mmadapt or transformers model directory")
        with open(path) as f:
            saved = json.load(f)
        if "mmadapt" not in saved:
            from mmadapt.convert import load_transformers

            return load_transformers(cls, directory, saved, strict=strict)
        from safetensors.torch import load_model

        model = cls(ModelConfig.from_dict(saved["mmadapt"]))
        missing, unexpected = load_model(model, os.path.join(directory, WEIGHTS_FILE), strict=False)
        raise_on_key_mismatch(missing, unexpected, directory, strict)
        return model


def raise_on_key_mismatch(missing: Any, unexpected: Any, source: Any, strict: bool) -> None:
    if strict and (missing or unexpected):
        raise ValueError(
            f"weights in {source} do not match the model: missing keys {sorted(missing)}, unexpected keys "
            f"{sorted(unexpected)}. Pass strict=False to load anyway (missing weights stay randomly initialised)."
        )


def as_bool_mask(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
    """The (B, L) bool mask, True = attend; all True when None. Integer masks are a `TypeError` (they index)."""
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    return require_bool_mask(attention_mask)
