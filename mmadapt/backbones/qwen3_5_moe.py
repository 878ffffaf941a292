"""Qwen3.5-MoE: transformers' `Qwen3_5MoeForCausalLM`, the Qwen3.5 stack with mixture-of-experts MLPs.

Everything but the MLP is Qwen3.5's (Gated DeltaNet + gated attention, M-RoPE, the same image span
and chat template), so the registration is Qwen3.5's spec with another model class, its LoRA targets
and its presets. Each MoE MLP is a router (`mlp.gate`, never a LoRA target: `lora_targets` names no
router module), 3-D expert tensors (`mlp.experts.gate_up_proj` / `down_proj`: peft's parameter
targets) and a gated shared expert (`mlp.shared_expert.{gate,up,down}_proj`). The hub's checkpoints store
the experts fused, as the module holds them; checkpoints that store them one by one
(`mlp.experts.{e}.gate_proj.weight`, ...: the multi-token-prediction block, other converters' output) are
fused at load (`MoE.weight_layouts`), as transformers' own loader does.

Presets are the published text configs; fields not confirmed from a released config are listed per
preset in `UNCONFIRMED`.
"""

import dataclasses

from mmadapt.backbones.base import BACKBONES, MoE
from mmadapt.backbones.qwen3_5 import TOKENS_AND_ROPE
from mmadapt.weights import Fused

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    num_experts_per_tok=2, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
    image_token_id=250, vision_start_token_id=248, vision_end_token_id=249, video_token_id=251,
)


def _moe(hidden: int, layers: int, heads: int, v_heads: int, expert: int, experts: int, active: int) -> dict:
    # Text configs of the published Qwen3.5-MoE checkpoints (config.json `text_config`).
    return dict(
        vocab_size=248320, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=v_heads,
        linear_key_head_dim=128, linear_value_head_dim=128, moe_intermediate_size=expert,
        shared_expert_intermediate_size=expert, num_experts=experts, num_experts_per_tok=active,
        tie_word_embeddings=False, **TOKENS_AND_ROPE)


# Sources (no hub access here; faithful copies): Qwen3.5-35B-A3B: a copy of its text_config (mlc-ai/pith-train) and
# slime's Megatron recipe, which transformers' Qwen3_5MoeTextConfig defaults also follow. 122B-A10B: a converter's
# checks against the pinned checkpoint and a spec table. 397B-A17B: slime's recipe plus a quoted config line for
# its 64 linear-attention value heads. Every 4th layer is full attention (transformers' default layer_types).
PRESETS = {
    "tiny": TINY,
    "qwen3.5-35b-a3b": _moe(2048, 40, 16, 32, 512, 256, 8),
    "qwen3.5-122b-a10b": _moe(3072, 48, 32, 64, 1024, 256, 8),
    "qwen3.5-397b-a17b": _moe(4096, 60, 32, 64, 1024, 512, 10),
}
UNCONFIRMED = {  # fields no source gave for that checkpoint (taken from its siblings)
    "qwen3.5-122b-a10b": ("max_position_embeddings", "tie_word_embeddings"),
}

BACKBONES.register("qwen3_5_moe", dataclasses.replace(
    BACKBONES.get("qwen3_5"), name="qwen3_5_moe",
    description="Qwen3.5-MoE: Qwen3.5's hybrid stack with routed experts + a shared expert, M-RoPE",
    model_class="transformers:Qwen3_5MoeForCausalLM", config_class="transformers:Qwen3_5MoeTextConfig",
    hf_model_type="qwen3_5_moe_text", presets=PRESETS,
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                  "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"),
    keep_precision=("lm_head", "in_proj_a", "in_proj_b", "mlp.gate", "shared_expert_gate"),  # + the routers
    moe=MoE(expert_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
            router_parameters=("mlp.gate.weight",),
            balance_loss="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:load_balancing_loss_func",
            weight_layouts=(Fused("mlp.experts.gate_up_proj", ("mlp.experts.{e}.gate_proj.weight",
                                                              "mlp.experts.{e}.up_proj.weight")),
                            Fused("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)))),
))
