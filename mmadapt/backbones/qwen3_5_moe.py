"""Qwen3.5-MoE: transformers' `Qwen3_5MoeForCausalLM`, the Qwen3.5 stack with mixture-of-experts MLPs.

Everything but the MLP is Qwen3.5's (Gated DeltaNet + gated attention, M-RoPE, the same image span
and chat template), so the registration is Qwen3.5's spec with another model class, its LoRA targets
and its presets. Each MoE MLP is a router (`mlp.gate`, never a LoRA target: `lora_targets` names no
router module), 3-D expert tensors (`mlp.experts.gate_up_proj` / `down_proj`: peft's parameter
targets) and a gated shared expert (`mlp.shared_expert.{gate,up,down}_proj`). Checkpoints as the hub
ships them store the experts one by one (`mlp.experts.{e}.gate_proj.weight`, ...); they are fused at load
(`fused_weights`), as transformers' own loader does.

Presets are the published text configs; fields not confirmed from a released config are listed per
preset in `UNCONFIRMED`.
"""

import dataclasses

from mmadapt.backbones.base import BACKBONES
from mmadapt.backbones.qwen3_5 import TOKENS_AND_ROPE
from mmadapt.weights import Fused

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    num_experts_per_tok=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
    image_token_id=250, vision_start_token_id=248, vision_end_token_id=249,
)
# Qwen3.5-35B-A3B: transformers' Qwen3_5MoeTextConfig defaults are this model ("Qwen3.5-35B-A3B style"), and
# slime's Megatron recipe for it agrees (40 layers, 2048 wide, 16 / 2 heads of 256, 256 experts, 8 active,
# expert and shared-expert width 512, linear attention 16 / 32 heads of 128, every 4th layer full attention).
# Qwen3.5-397B-A17B: slime's recipe (60 layers, 4096 wide, 32 / 2 heads of 256, 512 experts, 10 active, expert
# and shared-expert width 1024); its linear-attention head counts are not in that recipe (taken as 35B-A3B's).
PRESETS = {
    "tiny": TINY,
    "qwen3.5-35b-a3b": dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256,
        num_experts_per_tok=8, tie_word_embeddings=False, **TOKENS_AND_ROPE),
    "qwen3.5-397b-a17b": dict(
        vocab_size=248320, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
        num_experts=512, num_experts_per_tok=10, tie_word_embeddings=False, **TOKENS_AND_ROPE),
}
UNCONFIRMED = {
    "qwen3.5-35b-a3b": ("rms_norm_eps", "max_position_embeddings"),
    "qwen3.5-397b-a17b": ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                          "linear_value_head_dim", "rms_norm_eps", "max_position_embeddings"),
    # Qwen3.5-122B-A10B: no released config was available offline, so it has no preset.
}

BACKBONES.register("qwen3_5_moe", dataclasses.replace(
    BACKBONES.get("qwen3_5"), name="qwen3_5_moe",
    description="Qwen3.5-MoE: Qwen3.5's hybrid stack with routed experts + a shared expert, M-RoPE",
    model_class="transformers:Qwen3_5MoeForCausalLM", config_class="transformers:Qwen3_5MoeTextConfig",
    hf_model_type="qwen3_5_moe_text", presets=PRESETS,
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                  "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"),
    lora_target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    fused_weights=(Fused("mlp.experts.gate_up_proj", ("mlp.experts.{e}.gate_proj.weight",
                                                      "mlp.experts.{e}.up_proj.weight")),
                   Fused("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",))),
))
