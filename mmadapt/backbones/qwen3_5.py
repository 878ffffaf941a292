"""Qwen3.5: transformers' hybrid `Qwen3_5ForCausalLM` (Gated DeltaNet + gated attention), M-RoPE.

Images are `<|vision_start|>` + N x `<|image_pad|>` + `<|vision_end|>`. The rotary section
split (`mrope_section`, t/h/w frequency counts) must sum to head_dim * partial_rotary_factor / 2;
transformers does not check it and a wrong split runs silently, so `validate` does.
Packed rows: Gated DeltaNet layers run per sample (`qwen3_5_layers.py`), attention layers get
a block-diagonal mask through the per-layer-type mask dict the model accepts.
"""

from typing import Any

from mmadapt.backbones.base import BACKBONES, BackboneSpec, Hybrid

DEFAULT_MROPE_SECTION = [11, 11, 10]  # transformers' fallback when rope_parameters has none


def validate_mrope(config: Any) -> None:
    rope = config.rope_parameters or {}
    section = rope.get("mrope_section", DEFAULT_MROPE_SECTION)
    half_rotary = int(config.head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    if sum(section) != half_rotary:
        raise ValueError(
            f"qwen3_5: rope_parameters.mrope_section {section} sums to {sum(section)}, but head_dim "
            f"{config.head_dim} x partial_rotary_factor {rope.get('partial_rotary_factor', 1.0)} / 2 = "
            f"{half_rotary} rotary frequencies must be split over (t, h, w). Fix mrope_section to sum to {half_rotary}."
        )


def isolate_samples(lm: Any) -> None:
    from mmadapt.backbones.qwen3_5_layers import isolate_samples

    isolate_samples(lm)


# What every published Qwen3.5 text config (dense and MoE) shares: M-RoPE, the span and end token ids.
TOKENS_AND_ROPE = dict(
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True),
    image_token_id=248056, vision_start_token_id=248053, vision_end_token_id=248054, video_token_id=248057,
    eos_token_id=248044,
)


def _qwen(hidden: int, intermediate: int, layers: int, heads: int, kv: int, v_heads: int, tie: bool) -> dict:
    # Text configs of the published Qwen3.5 checkpoints (config.json `text_config`).
    return dict(
        vocab_size=248320, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=v_heads, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=tie, **TOKENS_AND_ROPE,
    )

# What every Qwen vision-language LLM declares alike (Qwen3.5, Qwen3-VL and their MoE variants): M-RoPE positions and
# the bracketed image / video spans <|vision_start|> <|image_pad|> x N <|vision_end|> of Qwen's processors.
QWEN_SPANS = dict(positions="mrope", image_token="<|image_pad|>", video_token="<|video_pad|>",
                  vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>", chat_template="chatml")


BACKBONES.register("qwen3_5", BackboneSpec(
    name="qwen3_5",
    description="Qwen3.5 hybrid Gated DeltaNet + gated attention, M-RoPE, <|vision_start|><|image_pad|><|vision_end|>",
    model_class="transformers:Qwen3_5ForCausalLM",
    config_class="transformers:Qwen3_5TextConfig",
    hf_model_type="qwen3_5_text",
    **QWEN_SPANS,
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "in_proj_qkv", "in_proj_z", "out_proj"),
    # Gated DeltaNet's small projections (hidden -> one value per head: the decay and the gate) stay in precision
    keep_precision=("lm_head", "in_proj_a", "in_proj_b"),
    presets={
        "tiny": dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
            image_token_id=250, vision_start_token_id=248, vision_end_token_id=249, video_token_id=251,
        ),
        "qwen3.5-0.8b": _qwen(1024, 3584, 24, 8, 2, 16, tie=True),
        "qwen3.5-2b": _qwen(2048, 6144, 24, 8, 2, 16, tie=True),
        "qwen3.5-4b": _qwen(2560, 9216, 32, 16, 4, 32, tie=True),
        "qwen3.5-9b": _qwen(4096, 12288, 32, 16, 4, 32, tie=False),
    },
    validate=validate_mrope,
    hybrid=Hybrid(isolate=isolate_samples, layer_masks=True),
))
