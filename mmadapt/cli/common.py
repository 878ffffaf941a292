"""What every command shares: how a command chooses its model (`add_build_arguments`: a combination from registry
names; `add_model_arguments`: a saved model and --adapters), its data settings (`add_data_arguments`: one flag per
`DataConfig` field) and its sampling settings (`add_sampling_arguments`: one flag per shown `Sampling` field), so
every command spells them the same way.
"""

from __future__ import annotations

import argparse
from typing import Any

from mmadapt.config import DEFAULT_PARTS

BUILD_DEFAULTS = {**DEFAULT_PARTS, "preset": "tiny", "deepstack": "use"}


def add_build_arguments(command: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """The parts of a model built from registry names (positional or --encoder/--projector/--backbone), --preset
    and --deepstack; `build_from_args` builds it."""
    for part, default in DEFAULT_PARTS.items():
        if positional:
            command.add_argument(part, nargs="?", default=default)
        else:
            command.add_argument(f"--{part}", default=default)
    command.add_argument("--preset", default=BUILD_DEFAULTS["preset"])
    command.add_argument("--deepstack", choices=("use", "drop"), default=BUILD_DEFAULTS["deepstack"],
                         help="drop: build without the encoder's DeepStack levels")


def build_arguments_given(args: argparse.Namespace) -> list[str]:
    """The `add_build_arguments` flags that name something else than their default."""
    return [f"--{name}" for name, default in BUILD_DEFAULTS.items() if getattr(args, name) != default]


def build_from_args(args: argparse.Namespace) -> object:
    from mmadapt.model import VisionLanguageModel

    return VisionLanguageModel.from_names(args.encoder, args.projector, args.backbone, preset=args.preset,
                                          deepstack=args.deepstack)


def add_model_arguments(command: argparse.ArgumentParser) -> None:
    """MODEL and --adapters, the same for chat, eval, sees and explain."""
    command.add_argument("model", help="a model directory, a run directory (OUT), a checkpoint or OUT/adapters")
    command.add_argument("--adapters", default=None, help="LoRA adapters (an OUT/adapters directory) to merge into "
                         "MODEL, their base model")


def add_data_arguments(command: argparse.ArgumentParser, *, helps: dict[str, str] | None = None) -> None:
    """One flag per data setting (the fields of `mmadapt.data.DataConfig`: `--max-length`, `--truncation`, ...), its
    type, choices and help from the field (`helps` replaces a help where the command means more); a flag not given
    stays out of the namespace, so the field's one default (or a run file's value) holds: `data_settings` reads the
    given ones back."""
    from mmadapt.data.config import settings

    for s in settings():
        text = (helps or {}).get(s.name, s.help)
        if s.kind is dict:
            text += "; a YAML mapping" + (f": e.g. '{s.example}'" if s.example else "")
        elif s.kind is not bool and s.default is not None:
            text += f" (default: {s.default})"
        options = dict(default=argparse.SUPPRESS, help=text.replace("%", "%%"))  # argparse formats help with %
        if s.kind is bool:
            command.add_argument(s.flag, action=argparse.BooleanOptionalAction, **options)
        elif s.kind is dict:
            command.add_argument(s.flag, metavar="YAML", **options)
        else:
            command.add_argument(s.flag, type=s.kind, choices=s.choices, **options)


def data_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The data settings given as flags (`add_data_arguments`), by field name; YAML mappings parsed."""
    import yaml

    from mmadapt.data.config import settings

    given = {}
    for s in settings():
        if not hasattr(args, s.name):
            continue
        value = getattr(args, s.name)
        if s.kind is dict:
            value = yaml.safe_load(value) if value else {}
            if not isinstance(value, dict):
                raise ValueError(f"{s.flag} must be a mapping such as '{s.example}', got {value!r}")
        given[s.name] = value
    return given


def add_sampling_arguments(command: argparse.ArgumentParser) -> None:
    """One flag per sampling setting a person sets (`mmadapt.sampling.sampling_settings`: the `Sampling` fields the
    page shows too: `--max-new-tokens`, `--temperature`, ...), its type, default and help from the field; a flag not
    given stays out of the namespace, so the field's one default holds: `sampling_from` builds the `Sampling`."""
    from mmadapt.sampling import sampling_settings

    for s in sampling_settings():
        command.add_argument(s.flag, type=s.kind, default=argparse.SUPPRESS,
                             help=f"{s.help} (default: {s.default})".replace("%", "%%"))


def sampling_from(args: argparse.Namespace) -> object:
    """The `Sampling` of the flags given (`add_sampling_arguments`); the others keep their defaults."""
    from mmadapt.sampling import Sampling, sampling_settings

    return Sampling(**{s.name: getattr(args, s.name) for s in sampling_settings() if hasattr(args, s.name)})
