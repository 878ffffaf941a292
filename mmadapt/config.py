"""Model configuration: which registered components, from a preset or a checkpoint, which option overrides.

Small keyword-only dataclasses that validate themselves (unknown names fail listing the
known ones) and round-trip through JSON, so a saved model names exactly what built it and,
for parts that came from checkpoints, where they came from (`source`: path and SHA-256).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

DEFAULT_PRESET = "tiny"
# the parts a model is built from when none are named: `mmadapt demo`, the commands that build from names
# (`--encoder / --projector / --backbone`) and the examples of the docs
DEFAULT_PARTS = MappingProxyType({"encoder": "qwen3_5_vit", "projector": "qwen_merger", "backbone": "qwen3_5"})
DEEPSTACK_MODES = ("use", "drop")
COMPONENT_KEYS = ("name", "preset", "options", "pretrained", "dtype", "source")


class _Unset(str):
    """The preset default: 'tiny' for a part built from a preset, nothing for a pretrained one."""


_UNSET = _Unset(DEFAULT_PRESET)


@dataclass(kw_only=True)
class ComponentConfig:
    """A registry name, then either a preset (None: options only) or a `pretrained` checkpoint, and overrides.

    `pretrained` (a directory or weight file) gives the part's architecture *and* weights; `options` may
    still set non-architecture settings (e.g. `feature_layer`). A `preset` given with `pretrained` declares the
    architecture the checkpoint must have (checked at load: every parameter's shape) and lets `mmadapt plan`
    size the run before the checkpoint is downloaded. `dtype` applies to pretrained weights
    (None: the checkpoint's). `source` is filled in by mmadapt: where a saved part's weights came from.
    """

    name: str
    preset: str | None = _UNSET
    options: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None
    dtype: str | None = None
    source: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a component needs a registry name, got {self.name!r}")
        if not isinstance(self.options, dict):
            raise TypeError(f"{self.name}: options must be a dict, got {type(self.options).__name__}")
        if self.pretrained is not None:
            self.pretrained = str(self.pretrained)
            if isinstance(self.preset, _Unset):
                self.preset = None
        elif isinstance(self.preset, _Unset):
            self.preset = DEFAULT_PRESET
        if self.dtype is not None:
            from mmadapt.weights import parse_dtype

            parse_dtype(self.dtype)

    @classmethod
    def coerce(cls, value: str | dict[str, Any] | ComponentConfig, *, preset: str | None = DEFAULT_PRESET,
               where: str = "component") -> ComponentConfig:
        """A name (built from `preset`), a mapping {name, preset, options, pretrained, dtype}, or a config."""
        if isinstance(value, ComponentConfig):
            return value
        if isinstance(value, str):
            return cls(name=value, preset=preset)
        if not isinstance(value, dict):
            raise TypeError(f"{where} must be a registry name or a mapping {{name, preset, options, pretrained}}, "
                            f"got {value!r}")
        unknown = sorted(set(value) - set(COMPONENT_KEYS))
        if unknown or "name" not in value:
            problem = f"unknown keys {unknown}" if unknown else "no 'name'"
            raise ValueError(f"{where}: {problem}; a component mapping has keys {list(COMPONENT_KEYS[:5])}")
        if "preset" not in value and not value.get("pretrained"):
            value = {**value, "preset": preset}
        return cls(**value)


@dataclass(kw_only=True)
class ModelConfig:
    """Encoder -> projector -> backbone. `check_contract` runs the image-token checks on every batch.

    `deepstack`: what becomes of an encoder's DeepStack feature levels (Qwen3-VL). "use" (the default): a backbone
    that takes them gets them, and one that cannot is an error at build time (the levels would be lost silently);
    "drop": the model is built without them (logged), for any backbone.
    """

    encoder: ComponentConfig
    projector: ComponentConfig
    backbone: ComponentConfig
    check_contract: bool = True
    deepstack: str = "use"

    def __post_init__(self) -> None:
        if self.deepstack not in DEEPSTACK_MODES:
            raise ValueError(f"deepstack must be one of {list(DEEPSTACK_MODES)}, got {self.deepstack!r}")
        from mmadapt.backbones import BACKBONES
        from mmadapt.encoders import ENCODERS
        from mmadapt.projectors import PROJECTORS

        for part in ("encoder", "projector", "backbone"):
            value = getattr(self, part)
            if not isinstance(value, ComponentConfig):
                setattr(self, part, ComponentConfig.coerce(value, where=part))
        ENCODERS.get(self.encoder.name)
        PROJECTORS.get(self.projector.name)
        BACKBONES.get(self.backbone.name)

    @classmethod
    def from_names(
        cls, encoder: str | dict[str, Any] | ComponentConfig, projector: str | dict[str, Any] | ComponentConfig,
        backbone: str | dict[str, Any] | ComponentConfig, *, preset: str | None = DEFAULT_PRESET, **kwargs: Any
    ) -> ModelConfig:
        """Names take `preset` (projectors have options, not presets); mappings and configs are used as given."""
        return cls(
            encoder=ComponentConfig.coerce(encoder, preset=preset, where="encoder"),
            projector=ComponentConfig.coerce(projector, preset=None, where="projector"),
            backbone=ComponentConfig.coerce(backbone, preset=preset, where="backbone"),
            **kwargs,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {"encoder", "projector", "backbone", "check_contract", "deepstack"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known: {sorted(known)}")
        return cls(**data)
