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


def preference_records(records: list) -> bool:
    from mmadapt.data.preference import is_preference_record

    return any(is_preference_record(r) for r in records[:16])


def preference_report(args: argparse.Namespace, model: Any, encoder: Any, records: list,
                      batches: int | None, batch_size: int) -> Any:
    """The preference view (`mmadapt.sees.preference_view`) of a file of preference pairs: margins of chosen over
    rejected with real, blanked and shuffled images (minus `--reference`'s, when given)."""
    from mmadapt.data.preference import PairCollator, PairEncoder, PreferenceDataset
    from mmadapt.inference import load_for_inference
    from mmadapt.sees import preference_view

    dataset = PreferenceDataset(records, PairEncoder(encoder))
    collate = PairCollator.for_model(model, encoder.pad_token_id)
    count = len(dataset) if batches is None else min(len(dataset), batches * batch_size)
    chunks = [collate([dataset[i] for i in range(start, min(start + batch_size, count))])
              for start in range(0, count, batch_size)]
    reference = load_for_inference(args.reference, None)[0] if getattr(args, "reference", None) else None
    return preference_view(model, chunks, reference=reference)


def prompt_records(records: list) -> bool:
    from mmadapt.data.prompts import is_prompt_record

    return any(is_prompt_record(r) for r in records[:16])


def run_rewards(args: argparse.Namespace) -> tuple[list, int]:
    """The rewards and answer length of the reward view: `--rewards` / `--max-new-tokens`, else the GRPO run's
    (`grpo.rewards`, `grpo.max_completion_length` of the config.yaml of the run `--model` belongs to), else
    accuracy and 64 tokens. A reward the run's config names as code (`package.module:function`) is never imported
    from the directory's say-so: only when the command line names it (`--rewards`)."""
    from mmadapt.run_directory import RunDirectory

    rewards, length = None, None
    run = RunDirectory.of(args.model)
    if run is not None and run.config_file.is_file():
        from mmadapt.train.config import RunConfig
        from mmadapt.train.objectives.grpo import GrpoObjective

        settings = GrpoObjective.parse_settings(RunConfig.load(run.config_file, []))
        rewards, length = settings.rewards or None, settings.max_completion_length
    if args.rewards:
        rewards = [name.strip() for name in args.rewards.split(",") if name.strip()]
    elif rewards:
        from mmadapt.train.rewards import REWARDS

        code = [n for n in (r.get("name") if isinstance(r, dict) else r for r in rewards) if n not in REWARDS.names()]
        if code:
            raise ValueError(f"the run's grpo.rewards ({run.config_file}) name code: {code}. mmadapt does not import "
                             "code a directory names; if you trust it, pass it yourself: --rewards "
                             f"{','.join(str(n) for n in code)} (or only built-ins: --rewards accuracy,format)")
    if getattr(args, "max_new_tokens", None):
        length = args.max_new_tokens
    return rewards or ["accuracy"], length or 64


def reward_report(args: argparse.Namespace, model: Any, encoder: Any, records: list, batches: int | None,
                  batch_size: int) -> Any:
    """The reward view (`mmadapt.train.objectives.grpo.view`) of a file of RL prompts: the mean reward of greedy
    answers with real, blanked and shuffled images."""
    from mmadapt.data import Collator
    from mmadapt.data.prompts import PromptCollator, PromptDataset, PromptEncoder
    from mmadapt.train.objectives.grpo.view import AnswerScorer, reward_view
    from mmadapt.train.rewards import reward_specs

    names, length = run_rewards(args)
    specs = reward_specs(names)
    dataset = PromptDataset(records, PromptEncoder(encoder, length))
    count = len(dataset) if batches is None else min(len(dataset), batches * batch_size)
    collate = PromptCollator(Collator.for_model(model, encoder.pad_token_id))
    return reward_view(model, AnswerScorer.for_encoder(encoder, specs, length), [dataset[i] for i in range(count)],
                       collate, batch_size=batch_size)


def cmd_eval(args: argparse.Namespace) -> int:
    """Answers with real / blanked / shuffled images, scored; exit 1 under --require-sees when images do not help.
    A file of preference pairs gets the preference view instead (`preference_report`)."""
    import json

    from mmadapt.evaluate import evaluate_records, plot_report, write_predictions

    model, encoder, collate, records = _inference_data(args)
    if prompt_records(records):
        view = reward_report(args, model, encoder, records, None, 8)
        print(view)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rewards": view.to_dict()}, f, indent=2)
        return 1 if args.require_sees and not view.ok else 0
    if preference_records(records):
        view = preference_report(args, model, encoder, records, None, 8)
        print(view)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"preference": {"pairs": view.pairs, "margin": view.margin, "accuracy": view.accuracy,
                                          "problems": view.problems, "rests_on_images": view.ok}}, f, indent=2)
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
    if prompt_records(records):
        view = reward_report(args, model, encoder, records, args.batches, args.batch_size)
        print(view)
        return 0 if view.ok else 1
    if preference_records(records):
        view = preference_report(args, model, encoder, records, args.batches, args.batch_size)
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
