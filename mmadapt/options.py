"""Component options: presets (plain dicts) updated by overrides, and transformers configs as options.

Shared by the encoder, projector and backbone specs.
"""

from __future__ import annotations

from typing import Any

from mmadapt.remote_code import without_auto_map


def resolve_preset(
    presets: dict[str, dict[str, Any]], preset: str | None, overrides: dict[str, Any] | None, *, kind: str
) -> dict[str, Any]:
    """Preset options (a deep copy) updated by overrides; unknown presets list the known ones."""
    if preset is None:
        base: dict[str, Any] = {}
    elif preset in presets:
        base = presets[preset]
    else:
        raise ValueError(f"unknown preset {preset!r} for {kind}; known: {', '.join(sorted(presets)) or '(none)'}")
    return deep_update(base, overrides or {})


def deep_update(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = {k: (deep_update(v, {}) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in update.items():
        out[key] = deep_update(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def hf_options(config: Any) -> dict[str, Any]:
    """A transformers config as plain options that rebuild it (bookkeeping keys dropped, and `auto_map`s, which no
    directory mmadapt writes holds: `mmadapt.remote_code`)."""
    # quantization_config: how a checkpoint stores its weights (bitsandbytes' 4 bits), not the architecture
    drop = {"transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype", "model_type",
            "quantization_config"}
    return without_auto_map({k: v for k, v in config.to_dict().items() if k not in drop})
