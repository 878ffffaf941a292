"""The `mmadapt` command line: `main`, `--debug`, the one-line error boundary, and every command's one-line
description (`COMMANDS`, what `mmadapt --help` lists).

One module per area (`data`, `train`: train / plan / export, `inference`: chat / eval / sees, `serve`, `explain`,
`tools`: list / check-model / demo / numerics), each a few lines of parsing and printing over a library call; `common`
holds how a command chooses its model. A command's parser is built only when that command is given, and the modules
here import nothing heavy at their top (the library is imported inside the command functions), so `mmadapt --help`,
a command's `--help` and a wrong flag answer without loading torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Collection
from typing import NamedTuple

from mmadapt.cli import data, explain, inference, serve, tools, train


class Command(NamedTuple):
    summary: str  # what `mmadapt --help` says of it: one line, for someone who has not read the docs
    add: Callable[[argparse._SubParsersAction], None]  # adds its full parser (flags, subcommands, its function)


COMMANDS: dict[str, Command] = {
    "demo": Command("train a tiny model to read handwritten digits (CPU, minutes) and check that it uses the images",
                    tools.add_demo_command),
    "list": Command("list the registered encoders, projectors, backbones and chat templates", tools.add_list_command),
    "check-model": Command("build an encoder + projector + backbone and check its image tokens on a synthetic batch",
                           tools.add_check_model_command),
    "data": Command("check a dataset, or show its samples as the model will see them (no training)",
                    data.add_data_commands),
    "train": Command("train a model from a YAML run config (also under torchrun)", train.add_train_command),
    "plan": Command("predict a run's per-GPU memory before it starts, and whether it fits", train.add_plan_command),
    "export": Command("turn a run or a checkpoint into a model directory (mmadapt's or transformers' format)",
                      train.add_export_command),
    "chat": Command("ask a trained model about images and videos", inference.add_chat_command),
    "eval": Command("score a trained model's answers with real, blanked and shuffled images",
                    inference.add_eval_command),
    "sees": Command("check that a trained model's loss depends on its images", inference.add_sees_command),
    "explain": Command("map which parts of an image an answer rests on, and how far to trust the map",
                       explain.add_explain_command),
    "serve": Command("serve a trained model over an OpenAI-compatible HTTP API (and a web page with --ui)",
                     serve.add_serve_command),
    "numerics": Command("debug numerics: per-layer dumps, their comparison, DeepSpeed config checks",
                        tools.add_numerics_commands),
}
"""Every command, in the order `mmadapt --help` lists them."""

DESCRIPTION = ("mmadapt: LLaVA-style vision-language models from registered parts, with checked image tokens. "
               "New here? Run `mmadapt demo`. `mmadapt COMMAND --help` shows a command's settings.")


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; `full` the commands whose whole parser is built (None: all), the others known by
    name and summary only. `main` builds the one command given, or none for `mmadapt --help`: nothing a command's
    flags need is imported for another command."""
    parser = argparse.ArgumentParser(prog="mmadapt", description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, entry in COMMANDS.items():
        if full is None or name in full:
            entry.add(sub)
            added = sub.choices[name]
            added.description = added.description or f"mmadapt {name}: {entry.summary}"
        else:
            sub.add_parser(name, help=entry.summary)
    if full is None:  # the listing says the summaries, whichever help a command's module gives
        for action in sub._choices_actions:
            action.help = COMMANDS[action.dest].summary
    return parser


def command_of(argv: list[str]) -> list[str]:
    """The command `argv` names (its first word that is not an option), when it is one: [name] or []."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return [first] if first in COMMANDS else []


def main(argv: list[str] | None = None) -> int:
    """User errors (a missing file, a bad config value, an unknown name) print one line; `--debug` (anywhere on the
    command line) shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser(command_of(argv))
    args, extra = parser.parse_known_args(argv)
    if extra and args.command in ("chat", "explain") and not any(a.startswith("-") for a in extra):
        # argparse leaves prompt words that follow an option unparsed
        args.prompt = [*args.prompt, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    import yaml

    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, yaml.YAMLError) as e:  # user errors: one line, no traceback
        if debug:
            raise
        message = " ".join(str(e).split())  # one line, whatever the exception's formatting
        print(f"error: {message} (rerun with --debug for the traceback)", file=sys.stderr)
        return 2


__all__ = ["COMMANDS", "Command", "build_parser", "main"]
