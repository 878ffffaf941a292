"""What every command shares: how a command chooses its model (`add_build_arguments`: a combination from registry
names; `add_model_arguments`: a saved model and --adapters), so every command spells it the same way.
"""

from __future__ import annotations

import argparse

DEFAULT_PARTS = {"encoder": "qwen3_5_vit", "projector": "qwen_merger", "backbone": "qwen3_5"}

def add_build_arguments(command: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """The parts of a model built from registry names (positional or --encoder/--projector/--backbone), --preset
    and --deepstack; `build_from_args` builds it."""
    for part, default in DEFAULT_PARTS.items():
        if positional:
            command.add_argument(part, nargs="?", default=default)
        else:
            command.add_argument(f"--{part}", default=default)
    command.add_argument("--preset", default="tiny")
    command.add_argument("--deepstack", choices=("use", "drop"), default="use",
                         help="drop: build without the encoder's DeepStack levels")



def build_from_args(args: argparse.Namespace) -> object:
    from mmadapt import build_model

    return build_model(args.encoder, args.projector, args.backbone, preset=args.preset, deepstack=args.deepstack)



def add_model_arguments(command: argparse.ArgumentParser) -> None:
    """MODEL and --adapters, the same for chat, eval, sees and explain."""
    command.add_argument("model", help="a model directory, a run directory (OUT), a checkpoint or OUT/adapters")
    command.add_argument("--adapters", default=None, help="LoRA adapters (an OUT/adapters directory) to merge into "
                         "MODEL, their base model")



def video_settings(text: str | None) -> dict:
    """`--video '{fps: 1, max_frames: 64}'` (YAML) as the data.video settings."""
    import yaml

    video = yaml.safe_load(text) if text else {}
    if not isinstance(video, dict):
        raise ValueError(f"--video must be a mapping such as '{{fps: 1, max_frames: 64}}', got {video!r}")
    return video

