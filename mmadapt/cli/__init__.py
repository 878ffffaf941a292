"""`mmadapt` command line: list components, check a combination or a dataset, train, export, chat, eval, sees,
explain, run the demo, debug numerics.

One module per area (`data`, `train`: train / plan / export, `inference`: chat / eval / sees, `explain`, `tools`:
list / check-model / demo / numerics), each a few lines of parsing and printing over a library call; `common` holds
how a command chooses its model. This module holds `main`, `--debug` and the one-line error boundary.
"""

from __future__ import annotations

import argparse
import sys

from mmadapt.cli import data, explain, inference, serve, tools, train


def build_parser() -> argparse.ArgumentParser:
    """Every command, one module per area: data, train / plan / export, chat / eval / sees, explain, tools."""
    parser = argparse.ArgumentParser(prog="mmadapt", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    sub = parser.add_subparsers(dest="command", required=True)
    tools.add_tool_commands(sub)
    data.add_data_commands(sub)
    train.add_train_command(sub)
    train.add_plan_command(sub)
    train.add_export_command(sub)
    inference.add_chat_command(sub)
    inference.add_eval_command(sub)
    inference.add_sees_command(sub)
    serve.add_serve_command(sub)
    explain.add_explain_command(sub)
    tools.add_numerics_commands(sub)
    tools.add_demo_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """User errors (a missing file, a bad config value, an unknown name) print one line; `--debug` (anywhere on the
    command line) shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
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


__all__ = ["build_parser", "main"]
