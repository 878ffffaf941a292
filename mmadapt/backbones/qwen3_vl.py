"""Qwen3-VL's language models: dense (`qwen3_vl`) and mixture-of-experts (`qwen3_vl_moe`), with DeepStack.

transformers implements Qwen3-VL's text stack as `Qwen3VLTextModel` / `Qwen3VLMoeTextModel` but has no
causal-LM class for them (only the whole VLM). The two classes in `qwen3_vl_lm.py` are the ones it would
have: the text model, used as is, plus `lm_head`, laid out as every transformers causal LM is (`model.*`,
`lm_head`), so Qwen3-VL checkpoints map by prefix and the glue treats them like any backbone. Their
forward passes DeepStack's `visual_pos_masks` / `deepstack_visual_embeds` through to the text model,
which adds level i at the image positions after decoder layer i (`BackboneSpec.deepstack`).

Both use M-RoPE with interleaved (t, h, w) frequencies; `mrope_section` must sum to head_dim / 2 and
each section must fit its interleaved slots, which transformers does not check (`validate`).
The MoE model's router (`mlp.gate`) is never a LoRA target; its experts are 3-D tensors (peft's
parameter targets), stored by the hub as (E, hidden, 2 x intermediate) and transposed at load as
transformers' loader does (`Transposed`). It has no shared expert.

Presets are the published text configs (`UNCONFIRMED` lists the fields no source gave).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mmadapt.backbones.base import BACKBONES, BackboneSpec, MoE
from mmadapt.backbones.qwen3_5 import QWEN_SPANS
from mmadapt.weights import Transposed

DEFAULT_MROPE_SECTION = [24, 20, 20]  # transformers' fallback when rope_parameters has none


def validate_mrope(config: Any) -> None:
    """Interleaved M-RoPE: frequency j goes to t, h or w by j mod 3, within each axis's count (`mrope_section`)."""
    section = (config.rope_parameters or {}).get("mrope_section", DEFAULT_MROPE_SECTION)
    half = config.head_dim // 2
    # transformers gives h the frequencies 1, 4, 7, ... < 3 * section[1] and w 2, 5, 8, ... < 3 * section[2]
    fits = len(section) == 3 and all(3 * (n - 1) + offset < half for n, offset in zip(section[1:], (1, 2), strict=True))
    if sum(section) != half or not fits:
        raise ValueError(
            f"{config.model_type}: rope_parameters.mrope_section {section} must split head_dim {config.head_dim} / 2 = "
            f"{half} rotary frequencies over (t, h, w), interleaved (h takes frequencies 1, 4, 7, ..., w 2, 5, 8, "
            f"...): it sums to {sum(section)}{'' if fits else ' and h or w runs past the last frequency'}. Fix "
            f"mrope_section (the published models use {DEFAULT_MROPE_SECTION} for head_dim 128).")


# What every published Qwen3-VL text config (dense and MoE) shares.
SHARED = dict(
    vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=262144, hidden_act="silu",
    rope_parameters=dict(rope_type="default", rope_theta=5_000_000.0, mrope_section=[24, 20, 20],
                         mrope_interleaved=True),
    image_token_id=151655, vision_start_token_id=151652, vision_end_token_id=151653, video_token_id=151656,
    bos_token_id=151643, eos_token_id=151645,
)
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True),
    image_token_id=250, vision_start_token_id=248, vision_end_token_id=249, video_token_id=251,
)


def _dense(hidden: int, intermediate: int, layers: int, heads: int, tie: bool) -> dict[str, Any]:
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=8, tie_word_embeddings=tie, **SHARED)


def _moe(hidden: int, intermediate: int, layers: int, heads: int, expert: int) -> dict[str, Any]:
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=4, moe_intermediate_size=expert, num_experts=128, num_experts_per_tok=8,
                decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, **SHARED)


# Sources (no hub access here; faithful copies of the config.json files): 2B: two test fixtures and a note on its
# config; 4B: a vendored copy; 8B: a quoted excerpt; 32B and 235B-A22B: docs checked against the configs; 30B-A3B: a
# byte-for-byte transcription; slime's Megatron recipes for the MoE models.
DENSE_PRESETS = {
    "tiny": TINY,
    "qwen3-vl-2b": _dense(2048, 6144, 28, 16, tie=True),
    "qwen3-vl-4b": _dense(2560, 9728, 36, 32, tie=True),
    "qwen3-vl-8b": _dense(4096, 12288, 36, 32, tie=False),
    "qwen3-vl-32b": _dense(5120, 25600, 64, 64, tie=False),
}
MOE_PRESETS = {
    # experts 16 wide: (E, 2 x 16, 64) is not its own transpose, so the hub layout is told apart at load
    "tiny": {**TINY, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2},
    "qwen3-vl-30b-a3b": _moe(2048, 6144, 48, 32, 768),
    "qwen3-vl-235b-a22b": _moe(4096, 12288, 94, 64, 1536),
}
UNCONFIRMED = {  # fields no source gave for that checkpoint (taken from its family)
    "qwen3-vl-8b": ("intermediate_size",),
}

BACKBONES.register("qwen3_vl", BackboneSpec(
    name="qwen3_vl",
    description="Qwen3-VL's LLM (dense), DeepStack levels after its first layers, interleaved M-RoPE",
    model_class="mmadapt.backbones.qwen3_vl_lm:Qwen3VLForCausalLM",
    config_class="transformers:Qwen3VLTextConfig",
    hf_model_type="qwen3_vl_text",
    **QWEN_SPANS,
    presets=DENSE_PRESETS,
    validate=validate_mrope,
    deepstack=True,
))
BACKBONES.register("qwen3_vl_moe", dataclasses.replace(
    BACKBONES.get("qwen3_vl"), name="qwen3_vl_moe",
    description="Qwen3-VL-MoE's LLM: routed experts (no shared expert), DeepStack, interleaved M-RoPE",
    model_class="mmadapt.backbones.qwen3_vl_lm:Qwen3VLMoeForCausalLM", config_class="transformers:Qwen3VLMoeTextConfig",
    hf_model_type="qwen3_vl_moe_text", presets=MOE_PRESETS,
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),  # dense MLPs if any
    keep_precision=("lm_head", "mlp.gate"),  # the routers too (a linear router in a variant stays exact)
    moe=MoE(expert_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
            router_parameters=("mlp.gate.weight",),
            balance_loss="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe:load_balancing_loss_func",
            weight_layouts=(Transposed("mlp.experts.gate_up_proj"), Transposed("mlp.experts.down_proj"))),
))
