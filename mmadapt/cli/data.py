"""`mmadapt data check` and `mmadapt data show`: the data pipeline over a dataset, without training.
"""

from __future__ import annotations

import argparse
import sys

from mmadapt.cli.common import add_build_arguments, build_from_args, video_settings


def data_encoder(args: argparse.Namespace) -> object:
    """The sample encoder `data check` / `data show` use: the model (--model DIR, else built from names), its
    tokenizer (--tokenizer, else the model directory's, else mmadapt's character tokenizer) and template options."""
    import yaml

    from mmadapt.data import SampleEncoder, char_tokenizer, load_tokenizer

    if args.model:
        from mmadapt import VisionLanguageModel
        from mmadapt import directory as model_directory

        model = model_directory.structure(VisionLanguageModel, args.model)
    else:
        model = build_from_args(args)
    source = args.tokenizer or args.model
    tokenizer = load_tokenizer(source) if source else char_tokenizer()
    if tokenizer is None:
        raise FileNotFoundError(f"{source} holds no tokenizer files; give --tokenizer DIR")
    kwargs = yaml.safe_load(args.template_kwargs) if args.template_kwargs else {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"--template-kwargs must be a mapping such as '{{enable_thinking: false}}', got {kwargs!r}")
    video = video_settings(args.video)
    return SampleEncoder.for_model(
        model, tokenizer, image_root=args.image_root, allow_outside_root=args.allow_outside_root,
        max_length=args.max_length, truncation=args.truncation,
        insert_missing_placeholder=args.insert_missing_placeholder, chat_template=args.chat_template,
        template_kwargs=kwargs, chat_template_mismatch=args.chat_template_mismatch, video=video)



def describe_encoder(args: argparse.Namespace, encoder: object) -> str:
    model = args.model or f"{args.encoder} + {args.projector} + {args.backbone} (preset {args.preset})"
    own = " (the tokenizer's own)" if encoder.template.name == "tokenizer" else ""
    return (f"{args.data}: {model}, chat template {encoder.template.name!r}{own}, max_length {args.max_length}, "
            f"truncation {args.truncation!r}")



def cmd_data_check(args: argparse.Namespace) -> int:
    """Run the data pipeline over DATA; print the report; exit 1 when too many samples have problems."""
    import json
    import logging

    from mmadapt.data import check_dataset, read_records

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    encoder = data_encoder(args)
    report = check_dataset(read_records(args.data, errors="report"), encoder, progress=sys.stderr.isatty())
    print(describe_encoder(args, encoder))
    print(report.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    if report.bad_fraction > args.max_bad_fraction:
        print(f"FAILED: {100 * report.bad_fraction:.1f}% of samples have problems, more than "
              f"--max-bad-fraction {args.max_bad_fraction}")
        return 1
    return 0



def cmd_data_show(args: argparse.Namespace) -> int:
    """Print the first --n samples of DATA as the model will see them (supervised stretches marked)."""
    import logging

    from mmadapt.data import DataProblem, read_records, show_sample

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    encoder = data_encoder(args)
    colour = {"always": True, "never": False}.get(args.colour, sys.stdout.isatty())
    marks = "green" if colour else "[[ ]]"
    print(f"{describe_encoder(args, encoder)}; supervised tokens in {marks}, images as <image x visual tokens>")
    shown = 0
    for i, record in enumerate(read_records(args.data)):
        if shown == args.n:
            break
        try:
            sample = encoder.encode(record, i)
        except DataProblem as problem:
            print(f"\n-- record {i}: skipped, {problem}")
            continue
        print("\n" + show_sample(encoder, sample, colour=colour))
        shown += 1
    return 0



def add_data_commands(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    check = data.add_parser("check", help="run the data pipeline over a dataset and report problems (no training)")
    show = data.add_parser("show", help="print samples as the model will see them: the chat template's text, "
                           "supervised tokens marked, images as <image x N>, counts")
    for command in (check, show):
        command.add_argument("data", help="a LLaVA or messages dataset (.json or .jsonl)")
        command.add_argument("--image-root", default=None, help="directory image paths are relative to")
        add_build_arguments(command)
        command.add_argument("--model", default=None, help="a model directory (its parts and tokenizer) instead of "
                             "registry names")
        command.add_argument("--tokenizer", default=None, help="a transformers tokenizer directory (default: the "
                             "--model directory's, else mmadapt's character tokenizer, as the demo model uses)")
        command.add_argument("--chat-template", default="auto", help="auto (the tokenizer's own template, else the "
                             "backbone's built-in), tokenizer, or a built-in name (mmadapt list shows them)")
        command.add_argument("--template-kwargs", default=None,
                             help="passed to the template, YAML: e.g. '{enable_thinking: false}'")
        command.add_argument("--chat-template-mismatch", choices=("error", "warn"), default="error",
                             help="warn: accept a built-in that renders differently from the tokenizer's own")
        command.add_argument("--video", default=None, help="video settings, YAML (as data.video in a run): e.g. "
                             "'{fps: 1, max_frames: 64, max_pixels: 1605632}'")
        command.add_argument("--max-length", type=int, default=2048)
        command.add_argument("--truncation", choices=("drop", "raise", "text"), default="drop")
        command.add_argument("--allow-outside-root", action="store_true",
                             help="accept absolute image paths and paths leaving --image-root")
        command.add_argument("--insert-missing-placeholder", action="store_true",
                             help="put <image> before the first user text of samples whose text has none")
    check.add_argument("--json", default=None, help="also write the report as JSON here")
    check.add_argument("--max-bad-fraction", type=float, default=0.05,
                       help="exit 1 when the share of problem samples is above this (default 0.05)")
    check.set_defaults(func=cmd_data_check)
    show.add_argument("--n", type=int, default=3, help="how many samples (default 3)")
    show.add_argument("--colour", choices=("auto", "always", "never"), default="auto",
                      help="green supervised tokens (auto: on a terminal), else [[ ]] brackets")
    show.set_defaults(func=cmd_data_show)

