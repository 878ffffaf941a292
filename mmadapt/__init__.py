"""mmadapt: LLaVA-style vision-language models from registered parts, with checked image tokens.

    import mmadapt
    model = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5", preset="tiny")

The names below are imported on first use (a module-level `__getattr__`, PEP 562): `import mmadapt`, which Python
runs before any `mmadapt.*` module and before the `mmadapt` command, imports no torch, so `mmadapt --help` answers
at once. `from mmadapt import BACKBONES` and `mmadapt.build_model(...)` work as before. Nothing inside the package
imports this module (tests/test_layers.py checks): it is the public face over every layer, not a layer itself.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from mmadapt.version import __version__ as __version__


def _quiet_enum_notices(record: logging.LogRecord) -> bool:
    """torchao (imported by peft whenever it is installed) registers enums with torch's pytree, which logs a
    deprecation notice per enum at import; they say nothing about mmadapt's run and are dropped."""
    return "register_constant() on Enum subclasses is deprecated" not in record.getMessage()


def _quiet_kernel_fetch(record: logging.LogRecord) -> bool:
    """bitsandbytes (imported by peft whenever it is installed) tries, on a CPU with AVX512-BF16, to fetch a matmul
    kernel from the Hugging Face hub as code, and falls back to its own exact CPU kernels when it cannot (it cannot
    here: mmadapt runs no code from a hub); the notice of that fallback is dropped."""
    return "Failed to load CPU gemm_4bit_forward" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_quiet_enum_notices)
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_quiet_kernel_fetch)

if TYPE_CHECKING:
    from mmadapt.backbones import BACKBONES, BackboneSpec, SpanTokens
    from mmadapt.batch import VisionBatch
    from mmadapt.config import ComponentConfig, ModelConfig
    from mmadapt.contract import BatchReport, ImageTokenContractError, check_batch
    from mmadapt.encoders import ENCODERS, EncoderSpec, VisualTokens
    from mmadapt.model import VisionLanguageModel
    from mmadapt.processor import Processor
    from mmadapt.projectors import PROJECTORS, ProjectorSpec
    from mmadapt.registry import Registry, UnknownComponentError

EXPORTS: dict[str, str] = {
    **dict.fromkeys(("BACKBONES", "BackboneSpec", "SpanTokens"), "mmadapt.backbones"),
    "VisionBatch": "mmadapt.batch",
    **dict.fromkeys(("ComponentConfig", "ModelConfig"), "mmadapt.config"),
    **dict.fromkeys(("BatchReport", "ImageTokenContractError", "check_batch"), "mmadapt.contract"),
    **dict.fromkeys(("ENCODERS", "EncoderSpec", "VisualTokens"), "mmadapt.encoders"),
    "VisionLanguageModel": "mmadapt.model",
    "Processor": "mmadapt.processor",
    **dict.fromkeys(("PROJECTORS", "ProjectorSpec"), "mmadapt.projectors"),
    **dict.fromkeys(("Registry", "UnknownComponentError"), "mmadapt.registry"),
}
"""Each public name -> the module that defines it (imported when the name is first read)."""


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module 'mmadapt' has no attribute {name!r}")
    value = getattr(importlib.import_module(EXPORTS[name]), name)
    globals()[name] = value  # the next read is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS})


def build_model(encoder: str | dict | ComponentConfig, projector: str | dict | ComponentConfig,
                backbone: str | dict | ComponentConfig, *, preset: str | None = "tiny",
                deepstack: str = "use") -> VisionLanguageModel:
    """Build a model from parts: registry names (built from `preset`) or mappings / `ComponentConfig`s
    `{name, preset, options, pretrained, dtype}`, e.g. `{"name": "qwen3_5", "pretrained": "Qwen3.5-0.8B"}`.
    `deepstack="drop"` builds without an encoder's DeepStack levels (see `ModelConfig`)."""
    from mmadapt.model import VisionLanguageModel

    return VisionLanguageModel.from_names(encoder, projector, backbone, preset=preset, deepstack=deepstack)


__all__ = [
    "BACKBONES", "ENCODERS", "PROJECTORS", "BackboneSpec", "BatchReport", "ComponentConfig", "EncoderSpec",
    "ImageTokenContractError", "ModelConfig", "Processor", "ProjectorSpec", "Registry", "SpanTokens",
    "UnknownComponentError", "VisionBatch", "VisionLanguageModel", "VisualTokens", "build_model", "check_batch",
]
