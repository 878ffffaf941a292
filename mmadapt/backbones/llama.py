"""LLaMA / Vicuna (LLaVA-1.5's LLM): transformers' `LlamaForCausalLM`, 1-D RoPE, `<image>` spans."""

from mmadapt.backbones.base import BACKBONES, BackboneSpec


def _vicuna(hidden: int, intermediate: int, layers: int, heads: int) -> dict:
    # llava-hf/llava-1.5-*-hf text_config: vocab 32064 with <image> = 32000 and <pad> = 32001.
    return dict(
        vocab_size=32064, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, rms_norm_eps=1e-5, max_position_embeddings=4096,
        pad_token_id=32001, image_token_id=32000,
    )


BACKBONES.register("llama", BackboneSpec(
    name="llama",
    description="LLaMA/Vicuna (LLaVA-1.5), 1-D RoPE, <image> placeholder",
    model_class="transformers:LlamaForCausalLM",
    config_class="transformers:LlamaConfig",
    hf_model_type="llama",
    positions="1d",
    image_token="<image>",
    chat_template="vicuna_v1",
    presets={
        "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, image_token_id=255),
        "vicuna-7b": _vicuna(4096, 11008, 32, 32),
        "vicuna-13b": _vicuna(5120, 13824, 40, 40),
    },
))
