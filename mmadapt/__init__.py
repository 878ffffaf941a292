"""mmadapt: LLaVA-style vision-language models from registered parts, with checked image tokens.

    import mmadapt
    model = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5", preset="tiny")
"""

from mmadapt.backbones import BACKBONES, BackboneSpec, SpanTokens
from mmadapt.batch import VisionBatch
from mmadapt.config import ComponentConfig, ModelConfig
from mmadapt.contract import BatchReport, ImageTokenContractError, check_batch
from mmadapt.encoders import ENCODERS, EncoderSpec, VisualTokens
from mmadapt.model import VisionLanguageModel
from mmadapt.processor import Processor
from mmadapt.projectors import PROJECTORS, ProjectorSpec
from mmadapt.registry import Registry, UnknownComponentError

__version__ = "0.17.0"


def build_model(encoder: str | dict | ComponentConfig, projector: str | dict | ComponentConfig,
                backbone: str | dict | ComponentConfig, *, preset: str | None = "tiny",
                deepstack: str = "use") -> VisionLanguageModel:
    """Build a model from parts: registry names (built from `preset`) or mappings / `ComponentConfig`s
    `{name, preset, options, pretrained, dtype}`, e.g. `{"name": "qwen3_5", "pretrained": "Qwen3.5-0.8B"}`.
    `deepstack="drop"` builds without an encoder's DeepStack levels (see `ModelConfig`)."""
    return VisionLanguageModel.from_names(encoder, projector, backbone, preset=preset, deepstack=deepstack)


__all__ = [
    "BACKBONES", "ENCODERS", "PROJECTORS", "BackboneSpec", "BatchReport", "ComponentConfig", "EncoderSpec",
    "ImageTokenContractError", "ModelConfig", "Processor", "ProjectorSpec", "Registry", "SpanTokens",
    "UnknownComponentError", "VisionBatch", "VisionLanguageModel", "VisualTokens", "build_model", "check_batch",
]
