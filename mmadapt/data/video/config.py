"""A run's video settings (`data.video`): a `VideoSampling`, a `VideoLimits` and the video processor's pixel bounds.

Users write one flat mapping (`data.video: {fps: 1, max_frames: 64, max_pixels: ...}` in a run file, `--video` on
the command line); `VideoConfig.parse` sends each key to the part that declares it (the sampling's, the limits' or
the config's own fields), so every setting and its default is declared once, in its part. An unknown key raises
with the known ones listed. `to_dict` gives the flat mapping back; the nested form `dataclasses.asdict` writes
(a run's saved config: `{sampling: {...}, limits: {...}, ...}`) parses too, so a saved run reads back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Final

from mmadapt.data.video.limits import VideoLimits
from mmadapt.data.video.sampling import VideoSampling

if TYPE_CHECKING:
    from mmadapt.data.video.processing import VideoProcessor

PARTS: Final[dict[str, type]] = {"sampling": VideoSampling, "limits": VideoLimits}
"""VideoConfig's nested parts, whose fields are written flat in `data.video`."""


@dataclass(frozen=True, kw_only=True)
class VideoConfig:
    """A run's video settings: frame sampling, limits and pixel bounds (`VideoConfig.parse` takes them flat).

    `sampling` as transformers' Qwen3-VL video processor: `fps` frames per second (default 2) or a fixed
    `num_frames`, clamped to [`min_frames`, `max_frames`]. `limits`, checked from the header before decoding:
    `max_frames_decoded` (the stream's frames), `max_pixels_per_frame`, `max_seconds`. Pixel bounds over all frames
    of a video (smart-resize's t * h * w): `min_pixels` / `max_pixels`, default 128 and 768 merge windows (P*m)^2 -
    transformers' defaults (131072 / 786432) at Qwen's 32-pixel windows. `frames_fps`: the fps of videos given as
    frame lists (None: 24, transformers' fallback, in their timestamps).
    """

    sampling: VideoSampling = field(default_factory=VideoSampling)
    limits: VideoLimits = field(default_factory=VideoLimits)
    min_pixels: int | None = None
    max_pixels: int | None = None
    frames_fps: float | None = None

    def __post_init__(self) -> None:
        for name, kind in PARTS.items():
            if not isinstance(getattr(self, name), kind):
                got = type(getattr(self, name)).__name__
                raise TypeError(f"VideoConfig: {name} must be a {kind.__name__}, got {got}. Fix: pass one, or give "
                                "the flat settings to VideoConfig.parse({...}).")

    @classmethod
    def settings(cls) -> dict[str, str]:
        """Every flat setting `parse` takes -> the part that declares it ("" for the config's own fields)."""
        own = {f.name: "" for f in fields(cls) if f.name not in PARTS}
        return {**own, **{f.name: part for part, kind in PARTS.items() for f in fields(kind)}}

    @classmethod
    def parse(cls, value: VideoConfig | dict[str, Any] | None) -> VideoConfig:
        """The config of a flat mapping (a run's `data.video`); giving `num_frames` without `fps` means uniform
        sampling (fps None). Raises ValueError for an unknown key, naming the known ones. The nested form that
        `dataclasses.asdict` writes (`{sampling: {...}, limits: {...}, ...}`, a run's saved config) reads back too."""
        if isinstance(value, VideoConfig):
            return value
        flat = cls.flatten(value or {})
        if "num_frames" in flat and "fps" not in flat:
            flat["fps"] = None  # giving num_frames means uniform sampling
        owners = cls.settings()
        unknown = sorted(set(flat) - set(owners))
        if unknown:
            raise ValueError(f"data.video: unknown setting(s) {unknown}; known: {sorted(owners)}")
        grouped: dict[str, dict[str, Any]] = {part: {} for part in ("", *PARTS)}
        for key, setting in flat.items():
            grouped[owners[key]][key] = setting
        own = grouped.pop("")
        return cls(**{part: PARTS[part](**settings) for part, settings in grouped.items()}, **own)

    @staticmethod
    def flatten(value: dict[str, Any]) -> dict[str, Any]:
        """`value` with the parts' nested mappings (`sampling: {...}`, `limits: {...}`) lifted to the top level."""
        flat: dict[str, Any] = {}
        for key, setting in value.items():
            nested = key in PARTS and isinstance(setting, dict)
            for name, item in setting.items() if nested else [(key, setting)]:
                if name in flat:
                    raise ValueError(f"data.video: {name!r} is given twice (flat and nested)")
                flat[name] = item
        return flat

    def to_dict(self) -> dict[str, Any]:
        """The flat settings, as a run's `data.video` writes them (`parse(config.to_dict()) == config`)."""
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PARTS}
        for part in PARTS:
            flat.update(asdict(getattr(self, part)))
        return flat

    def processor(self, image_processor: Any) -> VideoProcessor:
        """The `VideoProcessor` on an image processor's patch geometry and normalisation (a `QwenProcessor`)."""
        from mmadapt.data.video.processing import VideoProcessor  # torchvision: when videos are processed

        factor = image_processor.patches.factor
        low = self.min_pixels if self.min_pixels is not None else 128 * factor**2
        high = self.max_pixels if self.max_pixels is not None else max(768 * factor**2, low)
        return VideoProcessor.from_image_processor(image_processor, min_pixels=low, max_pixels=high,
                                                   sampling=self.sampling)
