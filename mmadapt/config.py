"""Model configuration: which registered components, which preset, which option overrides.

Small keyword-only dataclasses that validate themselves (unknown names fail listing the
known ones) and round-trip through JSON, so a saved model names exactly what built it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(kw_only=True)
class ComponentConfig:
    """A registry name, a preset of that component (None: options only), and option overrides."""

    name: str
    preset: str | None = "tiny"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.options, dict):
            raise TypeError(f"{self.name}: options must be a dict, got {type(self.options).__name__}")


@dataclass(kw_only=True)
class ModelConfig:
    """Encoder -> projector -> backbone. `check_contract` runs the image-token checks on every batch."""

    encoder: ComponentConfig
    projector: ComponentConfig
    backbone: ComponentConfig
    check_contract: bool = True

    def __post_init__(self) -> None:
        from mmadapt.backbones import BACKBONES
        from mmadapt.encoders import ENCODERS
        from mmadapt.projectors import PROJECTORS

        for part in ("encoder", "projector", "backbone"):
            value = getattr(self, part)
            if isinstance(value, dict):
                value = ComponentConfig(**value)
                setattr(self, part, value)
        ENCODERS.get(self.encoder.name)
        PROJECTORS.get(self.projector.name)
        BACKBONES.get(self.backbone.name)

    @classmethod
    def from_names(
        cls, encoder: str, projector: str, backbone: str, *, preset: str | None = "tiny", **kwargs: Any
    ) -> ModelConfig:
        """One preset name for encoder and backbone (projectors have options, not presets)."""
        return cls(
            encoder=ComponentConfig(name=encoder, preset=preset),
            projector=ComponentConfig(name=projector, preset=None),
            backbone=ComponentConfig(name=backbone, preset=preset),
            **kwargs,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {"encoder", "projector", "backbone", "check_contract"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known: {sorted(known)}")
        return cls(**data)
