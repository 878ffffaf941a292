"""The data settings, declared once: `DataConfig`, each field with its default, its choices and its help.

`DataConfig` is what `SampleEncoder` reads. A run's `data` section (`mmadapt.train.config.DataSection`) extends it
with the run-only fields, and the command line adds one flag per field (`mmadapt.cli.common.add_data_arguments`,
from `settings()`), so a field added here is a run key and a flag of `data check` / `data show` / `eval` / `sees` at
once, with this one default. Values are checked once, in `__post_init__`; choices are the `Literal`s of the hints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args, get_origin, get_type_hints

from mmadapt.data.images import DEFAULT_MAX_PIXELS
from mmadapt.data.table_limits import (
    DEFAULT_MAX_CELL_BYTES,
    DEFAULT_MAX_DECODE_RATIO,
    DEFAULT_MAX_ROW_GROUP_BYTES,
    TableLimits,
)
from mmadapt.data.tar_headers import DEFAULT_MAX_SAMPLE_BYTES, DEFAULT_MAX_SAMPLE_MEMBERS
from mmadapt.data.templates import MODES, TEMPLATES
from mmadapt.data.video import VideoConfig

# Per-sample limits, checked from headers before anything is decoded; sized so that a 24 GiB machine with 4
# DataLoader workers survives the worst sample each worker may take (docs/data.md, "Limits checked before work").
DEFAULT_MAX_IMAGES: Final[int] = 64
DEFAULT_MAX_SAMPLE_PIXELS: Final[int] = 128 * 1024 * 1024
DEFAULT_MAX_SAMPLE_FRAMES: Final[int] = 1024
DEFAULT_MAX_VIDEO_BYTES: Final[int] = 1 << 30
PREPROCESSING: Final[tuple[str, ...]] = ("chat_template", "template_kwargs", "chat_template_mismatch", "video")
"""The `DataConfig` fields a model directory records (`DataConfig.preprocessing`); the others (paths, limits, lengths)
belong to a dataset, not to the model."""

Truncation = Literal["drop", "raise", "text"]
Mismatch = Literal["error", "warn"]


def about(help: str, example: str | None = None) -> dict[str, str | None]:
    """A field's metadata: its help, and for a mapping an example of the YAML it takes."""
    return {"help": help, "example": example}


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """How records become samples: paths, length and truncation, images, the chat template, videos."""

    image_root: str | None = field(default=None, metadata=about("directory image and video paths are relative to"))
    allow_outside_root: bool = field(default=False, metadata=about(
        "accept absolute image paths and paths leaving the image root"))
    columns: dict[str, str] = field(default_factory=dict, metadata=about(
        "a Parquet / Arrow dataset's column names for mmadapt's (conversations, messages, texts, images, videos, "
        "id), when its layout is not recognised as it is", "{conversations: conv, images: pictures}"))
    max_length: int = field(default=2048, metadata=about("tokens per sample, image and video tokens included"))
    truncation: Truncation = field(default="drop", metadata=about(
        "a sample over max_length: drop (a counted problem), raise (stop), or text (cut the text after the last "
        "image or video span)"))
    insert_missing_placeholder: bool = field(default=False, metadata=about(
        "put <image> before the first user text of samples whose text has none"))
    max_image_pixels: int = field(default=DEFAULT_MAX_PIXELS, metadata=about(
        "larger images are a counted image_too_large problem (checked from the header, before decoding)"))
    max_images: int = field(default=DEFAULT_MAX_IMAGES, metadata=about(
        "images per sample; more is a counted sample_too_large problem (checked before any image is opened)"))
    max_sample_pixels: int = field(default=DEFAULT_MAX_SAMPLE_PIXELS, metadata=about(
        "pixels of all a sample's images together (from their headers, before decoding); more is a counted "
        "sample_too_large problem"))
    max_sample_frames: int = field(default=DEFAULT_MAX_SAMPLE_FRAMES, metadata=about(
        "video frames per sample: the frames kept of its video files plus its frame lists' frames (from headers, "
        "frame lists counted before any frame is opened); more is a counted sample_too_large problem"))
    max_video_bytes: int = field(default=DEFAULT_MAX_VIDEO_BYTES, metadata=about(
        "bytes of a sample's decoded video frames together (frames x height x width x 3, from headers, before "
        "decoding); more is a counted sample_too_large problem"))
    max_sample_bytes: int = field(default=DEFAULT_MAX_SAMPLE_BYTES, metadata=about(
        "bytes of a tar shard sample's members together (declared in the tar headers, checked before any member is "
        "read); more is a counted sample_too_large problem"))
    max_sample_members: int = field(default=DEFAULT_MAX_SAMPLE_MEMBERS, metadata=about(
        "members (files) of one tar shard sample (checked from the tar headers before any member is read); more is "
        "a counted sample_too_large problem"))
    max_cell_bytes: int = field(default=DEFAULT_MAX_CELL_BYTES, metadata=about(
        "bytes of one Parquet / Arrow cell (a row's value in one column, e.g. its list of images); a row group whose "
        "column decodes to more than this a row on average is refused from the footer, a larger cell is a counted "
        "table_too_large problem before the row is read into Python"))
    max_row_group_bytes: int = field(default=DEFAULT_MAX_ROW_GROUP_BYTES, metadata=about(
        "decoded bytes of one Parquet row group (its footer's total_byte_size) or Arrow record batch (its IPC "
        "metadata); larger: its rows are counted table_too_large problems, never decoded"))
    max_decode_ratio: float = field(default=DEFAULT_MAX_DECODE_RATIO, metadata=about(
        "decoded / stored bytes of a Parquet column chunk that decodes to over 16 MiB (from the footer); more: the "
        "row group's rows are counted table_too_large problems, never decoded (a compression bomb)"))
    chat_template: str = field(default="auto", metadata=about(
        "auto (the tokenizer's own template, else the backbone's built-in), tokenizer (require the tokenizer's), or "
        "a built-in name (mmadapt list shows them)"))
    template_kwargs: dict[str, Any] = field(default_factory=dict, metadata=about(
        "passed to the template", example="{enable_thinking: false}"))
    chat_template_mismatch: Mismatch = field(default="error", metadata=about(
        "warn: accept a built-in template that renders differently from the tokenizer's own"))
    video: VideoConfig | dict[str, Any] | None = field(default=None, metadata=about(
        "videos (Qwen3.5 / Qwen3-VL models): frame sampling (fps, num_frames, min_frames, max_frames), pixel bounds "
        "over a video's frames (min_pixels, max_pixels), header-checked limits per video (max_frames_decoded, "
        "max_pixels_per_frame, max_seconds, max_bytes_decoded) and frames_fps; see mmadapt.data.VideoConfig",
        example="{fps: 1, max_frames: 64}"))

    def __post_init__(self) -> None:
        if not isinstance(self.video, VideoConfig | dict | None):
            raise TypeError(f"video must be a mapping such as '{{fps: 1, max_frames: 64}}', got {self.video!r}")
        object.__setattr__(self, "video", VideoConfig.parse(self.video))
        for name, choices in _choices(type(self)).items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {list(choices)}, got {getattr(self, name)!r}")
        if self.chat_template not in MODES and self.chat_template not in TEMPLATES:
            raise ValueError(f"chat_template must be one of {[*MODES, *TEMPLATES.names()]}, got {self.chat_template!r}")
        if not isinstance(self.columns, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in self.columns.items()):
            raise TypeError(f"columns must map mmadapt's column names to the dataset's, such as "
                            f"'{{conversations: conv}}', got {self.columns!r}")
        if not isinstance(self.template_kwargs, dict):
            raise TypeError(f"template_kwargs must be a mapping, got {type(self.template_kwargs).__name__}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        for name in ("max_image_pixels", "max_images", "max_sample_pixels", "max_sample_frames", "max_video_bytes",
                     "max_sample_bytes", "max_sample_members", "max_cell_bytes", "max_row_group_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        ratio = self.max_decode_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio >= 1:
            raise ValueError(f"max_decode_ratio must be a number >= 1, got {ratio!r}")

    @property
    def table_limits(self) -> TableLimits:
        """The Parquet / Arrow limits of these settings."""
        return TableLimits(max_cell_bytes=self.max_cell_bytes, max_row_group_bytes=self.max_row_group_bytes,
                           max_decode_ratio=float(self.max_decode_ratio))

    @classmethod
    def of(cls, config: DataConfig | None = None, **changes: Any) -> DataConfig:
        """The data settings of `config` (a `DataConfig` or a run's `DataSection`) with `changes`."""
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)} if config is not None else {}
        return cls(**{**values, **changes})

    def preprocessing(self) -> dict[str, Any]:
        """The settings that decide how a prompt is rendered and its videos sampled (`PREPROCESSING`), as plain
        JSON values: what a model directory remembers of its training data (`mmadapt.directory.set_data_settings`),
        so that `Processor.for_model` builds inference inputs as training built them. `DataConfig(**settings)` reads
        them back."""
        values = {name: getattr(self, name) for name in PREPROCESSING}
        return {**values, "template_kwargs": dict(self.template_kwargs), "video": self.video.to_dict()}


@dataclass(frozen=True)
class Setting:
    """One data setting as a command line offers it: `kind` is bool, int, float, str or dict (a YAML mapping)."""

    name: str
    kind: type
    default: Any
    choices: tuple[Any, ...] | None
    help: str
    example: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def settings(cls: type = DataConfig) -> tuple[Setting, ...]:
    """The fields of `cls` (a `DataConfig`) as `Setting`s, in declaration order."""
    hints, choices = get_type_hints(cls), _choices(cls)
    return tuple(Setting(f.name, _kind(hints[f.name]), f.default_factory() if f.default is dataclasses.MISSING
                         else f.default, choices.get(f.name), f.metadata.get("help", ""), f.metadata.get("example"))
                 for f in dataclasses.fields(cls))


def _choices(cls: type) -> dict[str, tuple[Any, ...]]:
    return {name: get_args(hint) for name, hint in get_type_hints(cls).items() if get_origin(hint) is Literal}


def _kind(hint: Any) -> type:
    """The command-line type of a hint: a Literal's value type, a mapping as dict, `X | None` as X."""
    if get_origin(hint) is Literal:
        return type(get_args(hint)[0])
    if hint in (bool, int, float, str):
        return hint
    args = [a for a in get_args(hint) if a is not type(None)]
    if hint is dict or get_origin(hint) is dict or any(a is dict or get_origin(a) is dict for a in args):
        return dict
    if len(args) == 1 and args[0] in (bool, int, float, str):
        return args[0]
    raise TypeError(f"data setting of type {hint} has no command-line form: give it one in mmadapt.data.config")
