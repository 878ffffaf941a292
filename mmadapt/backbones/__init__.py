"""LLM backbones, one module per family, registered by exact name in `BACKBONES`."""

from mmadapt.backbones import llama, qwen3_5, qwen3_5_moe, qwen3_vl  # noqa: F401  (registers)
from mmadapt.backbones.base import BACKBONES, BackboneSpec, Hybrid, MoE, SpanTokens

__all__ = ["BACKBONES", "BackboneSpec", "Hybrid", "MoE", "SpanTokens"]
