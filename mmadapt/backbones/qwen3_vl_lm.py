"""The causal-LM classes of Qwen3-VL's text models, which transformers does not have (only the whole VLM).

Each is the transformers text model, used as is, plus `lm_head`, laid out as every transformers causal LM is
(`model.*`, `lm_head`), so Qwen3-VL checkpoints map by prefix; forward passes DeepStack's `visual_pos_masks` /
`deepstack_visual_embeds` (and packing's `packed_segments`) through to the text model. Imported only when a
`qwen3_vl` / `qwen3_vl_moe` backbone is built (`mmadapt.backbones.qwen3_vl` registers them).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLPreTrainedModel, Qwen3VLTextModel
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
    Qwen3VLMoePreTrainedModel,
    Qwen3VLMoeTextModel,
    load_balancing_loss_func,
)


class _CausalLM:
    """The output layer over a Qwen3-VL text model; `text_model_class` is its transformers class."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}
    base_model_prefix = "model"
    text_model_class: type

    def __init__(self, config: Any) -> None:
        if "tie_word_embeddings" not in config.to_dict():  # Qwen3-VL text configs carry no flag: the VLM's default
            config.tie_word_embeddings = False
        super().__init__(config)
        self.model = self.text_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _head(self, outputs: Any, labels: torch.Tensor | None, logits_to_keep: int | torch.Tensor,
              kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return logits, loss


class Qwen3VLForCausalLM(_CausalLM, Qwen3VLPreTrainedModel, GenerationMixin):
    """`Qwen3VLTextModel` + `lm_head`; forward as transformers' causal LMs, plus DeepStack's two arguments."""

    config: Qwen3VLTextConfig
    text_model_class = Qwen3VLTextModel
    _no_split_modules: ClassVar[list[str]] = ["Qwen3VLTextDecoderLayer"]

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                visual_pos_masks: torch.Tensor | None = None,
                deepstack_visual_embeds: list[torch.Tensor] | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             visual_pos_masks=visual_pos_masks, deepstack_visual_embeds=deepstack_visual_embeds,
                             **kwargs)
        logits, loss = self._head(outputs, labels, logits_to_keep, kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


class Qwen3VLMoeForCausalLM(_CausalLM, Qwen3VLMoePreTrainedModel, GenerationMixin):
    """`Qwen3VLMoeTextModel` + `lm_head`; with `output_router_logits`, transformers' load-balancing loss (over the
    `attention_mask`'s real tokens) is returned as `aux_loss` and added to the loss x `router_aux_loss_coef`."""

    config: Qwen3VLMoeTextConfig
    text_model_class = Qwen3VLMoeTextModel
    _no_split_modules: ClassVar[list[str]] = ["Qwen3VLMoeTextDecoderLayer"]
    # transformers picks the experts' kernel (grouped_mm rather than eager per-expert loops) only for classes whose
    # module source applies its experts-implementation decorator (a text search: this module must not contain that
    # decorator's name, or the dense class above would claim it too); the experts here are decorated ones
    _can_set_experts_implementation_cached_value: ClassVar[bool] = True

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                visual_pos_masks: torch.Tensor | None = None, deepstack_visual_embeds: list[torch.Tensor] | None = None,
                output_router_logits: bool | None = None, **kwargs: Any) -> MoeCausalLMOutputWithPast:
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             visual_pos_masks=visual_pos_masks, deepstack_visual_embeds=deepstack_visual_embeds,
                             output_router_logits=output_router_logits, **kwargs)
        logits, loss = self._head(outputs, labels, logits_to_keep, kwargs)
        aux_loss = None
        if output_router_logits:
            aux_loss = load_balancing_loss_func(outputs.router_logits, self.config.num_experts,
                                                self.config.num_experts_per_tok, attention_mask)
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, cache=outputs.cache,
                                         hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                                         router_logits=outputs.router_logits)
