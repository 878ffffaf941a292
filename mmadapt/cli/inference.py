"""`mmadapt chat`, `mmadapt eval` and `mmadapt sees`: a trained model answers, is scored, and shows whether it sees
(for a file of preference pairs: the preference view; for RL prompts: the reward view).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mmadapt.cli.common import (
    add_data_arguments,
    add_model_arguments,
    add_sampling_arguments,
    data_settings,
    sampling_from,
)
from mmadapt.cli.explain import write_evidence


def cmd_chat(args: argparse.Namespace) -> int:
    """Answer PROMPT and exit, or hold a conversation read from stdin (one user turn per line)."""
    from mmadapt.inference import Chat

    chat = Chat.load(args.model, args.adapters, sampling=sampling_from(args))
    chat.attach(images=args.image, videos=args.video)

    def answer(text: str) -> None:
        chat.ask(text, on_text=lambda piece: print(piece, end="", flush=True))
        print(flush=True)

    if args.prompt:
        answer(" ".join(args.prompt))
        return 0
    for line in sys.stdin:
        line = line.strip()
        if line.startswith("/image "):
            chat.attach(images=[line[len("/image "):].strip()])
        elif line.startswith("/video "):
            chat.attach(videos=[line[len("/video "):].strip()])
        elif line:
            answer(line)
    return 0


def add_chat_command(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="ask a trained model about images and videos (one prompt, or a conversation "
                          "on stdin)")
    add_model_arguments(chat)
    chat.add_argument("prompt", nargs="*", help="the question; none: read turns from stdin (`/image PATH` and "
                      "`/video PATH` attach an image or a video to the next turn)")
    chat.add_argument("--image", action="append", default=[], help="an image for the first turn (repeatable)")
    chat.add_argument("--video", action="append", default=[], help="a video file for the first turn (repeatable; "
                      "Qwen3.5 / Qwen3-VL models; sampled at 2 fps as their processor does)")
    add_sampling_arguments(chat)
    chat.set_defaults(func=cmd_chat)


def _inference_data(args: argparse.Namespace) -> tuple:
    """(model, sample encoder, collator, records) for `eval` / `sees` on the user's own data file."""
    from pathlib import Path

    from mmadapt.data import Collator, SampleEncoder
    from mmadapt.data.samples import read_records
    from mmadapt.inference import load_for_inference
    from mmadapt.processor import trained_settings

    model, tokenizer = load_for_inference(args.model, args.adapters)
    settings = {**trained_settings(model), **data_settings(args)}  # as trained, but for what the flags give
    settings["image_root"] = settings.get("image_root") or str(Path(args.data).parent)
    encoder = SampleEncoder.for_model(model, tokenizer, **settings)
    records = read_records(args.data, errors="report", columns=encoder.config.columns,
                           config=encoder.config)  # a bad line: counted
    if not records:
        raise ValueError(f"{args.data} holds no records")
    return model, encoder, Collator.for_model(model, encoder.pad_token_id), records


# the flags of `eval` / `sees` that only one view reads: the answers' view (conversations) or an objective's
# (`Objective.view_flags`); given to a view that does not read it, a flag is refused, never ignored
VIEW_FLAGS = {"predictions": None, "plot": None, "margin": 0.2, "evidence": 0, "reference": None, "rewards": None,
              "max_new_tokens": None}
ANSWERS_VIEW = {"eval": {"predictions", "plot", "margin", "evidence", "max_new_tokens"}, "sees": set()}


def objective_view(args: argparse.Namespace, model: Any, encoder: Any, records: list) -> Any:
    """The view of the objective that claims the records (`objectives.view_for`: preference pairs, RL prompts, ...),
    or None for conversations (the answers' view); a flag the view does not read is a one-line error."""
    from mmadapt.train.objectives import ViewOptions, view_for

    objective = view_for(records)
    reads = ANSWERS_VIEW[args.command] if objective is None else objective.view_flags
    given = sorted(name for name, default in VIEW_FLAGS.items() if getattr(args, name, default) != default)
    unread = [name for name in given if name not in reads]
    if unread:
        what = "conversations (the answers' view)" if objective is None else (
            f"records of the {objective.section or objective.__name__} objective's view")
        flags = ", ".join("--" + name.replace("_", "-") for name in unread)
        raise ValueError(f"{flags}: not read for {args.data}, which holds {what}; remove "
                         f"{'it' if len(unread) == 1 else 'them'}")
    if objective is None:
        return None
    rewards = [name.strip() for name in args.rewards.split(",") if name.strip()] if args.rewards else None
    options = ViewOptions(args.command, args.model, batch_size=getattr(args, "batch_size", 8),
                          batches=getattr(args, "batches", None) if args.command == "sees" else None,
                          reference=args.reference, max_new_tokens=args.max_new_tokens, rewards=rewards)
    return objective.view(model, encoder, records, options)


def cmd_eval(args: argparse.Namespace) -> int:
    """Answers with real / blanked / shuffled images, scored; exit 1 under --require-sees when images do not help.
    A file of records an objective claims (preference pairs, RL prompts, ...) gets its view (`objective_view`)."""
    import json

    from mmadapt.evaluate import evaluate_records, plot_report, write_predictions

    model, encoder, collate, records = _inference_data(args)
    view = objective_view(args, model, encoder, records)
    if view is not None:
        print(view)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(view.to_dict(), f, indent=2)
        return 1 if args.require_sees and not view.ok else 0
    report = evaluate_records(model, encoder, collate, records, margin=args.margin,
                              max_new_tokens=args.max_new_tokens, progress=sys.stderr.isatty())
    print(report)
    if args.predictions:
        write_predictions(report, args.predictions)
    if args.plot:
        plot_report(report, args.plot)
    written = report.to_dict()
    if args.evidence:
        written["evidence"] = write_evidence(args, model, encoder, records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(written, f, indent=2)
    return 1 if args.require_sees and not report.passed else 0


def cmd_sees(args: argparse.Namespace) -> int:
    """The loss-based check (`sees_images`) on a few batches of the user's data: a table and an exit code."""
    from mmadapt.sees import sees_records

    model, encoder, collate, records = _inference_data(args)
    view = objective_view(args, model, encoder, records)
    if view is not None:
        print(view)
        return 0 if view.ok else 1
    report = sees_records(model, encoder, collate, records, batches=args.batches, batch_size=args.batch_size,
                          source=args.data)
    print(report)
    return 0 if report.ok else 1


def add_data_file_command(sub: argparse._SubParsersAction, name: str, helptext: str) -> argparse.ArgumentParser:
    """A command over a model and the user's data file (`eval`, `sees`): the arguments they share."""
    command = sub.add_parser(name, help=helptext)
    add_model_arguments(command)
    command.add_argument("data", help="a LLaVA or messages .json / .jsonl file (preference pairs: the preference "
                         "view; RL prompts with answers, as GRPO trains on: the reward view)")
    command.add_argument("--reference", default=None, help="preference pairs: the model training started from (its "
                         "margins are subtracted: the DPO reward margin / beta)")
    command.add_argument("--rewards", default=None, help="RL prompts: the rewards to score answers with, comma-"
                         "separated (accuracy, format, package.module:function; default: the GRPO run's "
                         "grpo.rewards, else accuracy)")
    add_data_arguments(command, helps={"image_root": "directory image and video paths are relative to (default: "
                                       "the data file's directory)"})
    return command


def add_eval_command(sub: argparse._SubParsersAction) -> None:
    command = add_data_file_command(sub, "eval", "answer held-out questions with real, blanked and shuffled images; "
                                    "score them")
    command.set_defaults(func=cmd_eval)
    command.add_argument("--json", default=None, help="write the report here")
    command.add_argument("--predictions", default=None, help="per-sample answers (.jsonl)")
    command.add_argument("--plot", default=None, help="a bar chart of the accuracies (.png)")
    command.add_argument("--margin", type=float, default=0.2)
    command.add_argument("--max-new-tokens", type=int, default=None,
                         help="default: enough for the longest reference answer")
    command.add_argument("--require-sees", action="store_true",
                         help="exit 1 unless images beat blanked and shuffled ones by the margin")
    command.add_argument("--evidence", type=int, default=0, metavar="K",
                         help="draw evidence maps (mmadapt explain) of the first K single-image samples")
    command.add_argument("--evidence-dir", default="evidence", help="where the maps go (default: evidence/)")


def add_sees_command(sub: argparse._SubParsersAction) -> None:
    command = add_data_file_command(sub, "sees", "does the answer loss on your data depend on the images? "
                                    "(no generation)")
    command.set_defaults(func=cmd_sees)
    command.add_argument("--batches", type=int, default=4)
    command.add_argument("--batch-size", type=int, default=8)
    command.add_argument("--max-new-tokens", type=int, default=None, help="RL prompts: the answers' length "
                         "(default: the GRPO run's grpo.max_completion_length, else 64)")
