"""Vision encoders, one module per family, registered by exact name in `ENCODERS`."""

from mmadapt.encoders.base import ENCODERS, EncoderSpec, FixedSizeEncoder, VisionEncoder, VisualTokens
from mmadapt.encoders.clip import CLIP_PRESETS
from mmadapt.encoders.qwen3_5_vit import QWEN_VIT_PRESETS
from mmadapt.encoders.qwen3_vl_vit import QWEN3_VL_VIT_PRESETS
from mmadapt.encoders.siglip import SIGLIP_PRESETS
from mmadapt.encoders.timm_encoder import TIMM_PRESETS

ENCODERS.register("clip", EncoderSpec(
    name="clip", description="CLIP ViT, fixed resolution; LLaVA-1.5 features (layer -2, CLS dropped)",
    factory="mmadapt.encoders.clip:ClipEncoder", dynamic=False, presets=CLIP_PRESETS,
))
ENCODERS.register("siglip", EncoderSpec(
    name="siglip", description="SigLIP ViT, fixed resolution, no CLS token",
    factory="mmadapt.encoders.siglip:SiglipEncoder", dynamic=False, presets=SIGLIP_PRESETS,
))
ENCODERS.register("qwen3_5_vit", EncoderSpec(
    name="qwen3_5_vit", description="Qwen3.5 dynamic-resolution ViT (blocks only; merger is the qwen_merger projector)",
    factory="mmadapt.encoders.qwen3_5_vit:QwenViTEncoder", dynamic=True, presets=QWEN_VIT_PRESETS,
))
ENCODERS.register("qwen3_vl_vit", EncoderSpec(
    name="qwen3_vl_vit", description="Qwen3-VL dynamic-resolution ViT with DeepStack feature levels (blocks only; the "
    "mergers are the qwen_merger projector's)", factory="mmadapt.encoders.qwen3_vl_vit:Qwen3VLViTEncoder", dynamic=True,
    presets=QWEN3_VL_VIT_PRESETS,
))
ENCODERS.register("timm", EncoderSpec(
    name="timm", description="any timm model by name, features from forward_features, prefix tokens dropped",
    factory="mmadapt.encoders.timm_encoder:TimmEncoder", dynamic=False, presets=TIMM_PRESETS,
))

__all__ = ["ENCODERS", "EncoderSpec", "FixedSizeEncoder", "VisionEncoder", "VisualTokens"]
