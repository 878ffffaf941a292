"""`mmadapt data check` and `mmadapt data show`: the data pipeline over a dataset, without training.

    mmadapt data check DATA [RUN.yaml] [data.KEY=VALUE ...] [--flags]

The data settings are `mmadapt.data.DataConfig`'s: a run file's `data` section (and its dotted overrides), then
one flag per field (`--max-length`, `--allow-outside-root`, ...). The model is `--model DIR`, else the run file's
(on the meta device: no weights are read), else built from registry names; the tokenizer is `--tokenizer`, else
`data.tokenizer`, else the `--model` directory's, else the run's pretrained model's, else mmadapt's character one.
`data check` fails above `--max-bad-fraction`, else the run file's `data.max_bad_fraction`, else 0.05.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mmadapt.cli.common import (
    add_build_arguments,
    add_data_arguments,
    build_arguments_given,
    build_from_args,
    data_settings,
)


def run_config(args: argparse.Namespace) -> tuple[Any, bool]:
    """The run config of the RUN positionals (a run file and/or `section.key=value` overrides), and whether it
    names the model (a run file, or a `model.` override)."""
    from mmadapt.train.config import RunConfig

    files = [a for a in args.run if "=" not in a]
    overrides = [a for a in args.run if "=" in a]
    if len(files) > 1:
        raise ValueError(f"one run file at most, got {files}; settings look like data.key=value")
    config = RunConfig.load(files[0] if files else None, overrides)
    return config, bool(files) or any(o.startswith("model.") for o in overrides)


def data_model(args: argparse.Namespace, run: Any, run_model: bool) -> Any:
    """--model DIR (its structure), else the run's model (on the meta device), else the one built from names."""
    from mmadapt import directory as model_directory
    from mmadapt.model import VisionLanguageModel
    from mmadapt.train.run import model_structure

    if args.model:
        return model_directory.structure(VisionLanguageModel, args.model)
    if not run_model:
        return build_from_args(args)
    given = build_arguments_given(args)
    if given:
        raise ValueError(f"{', '.join(given)} and the run's model section both name a model: give one of them")
    return model_structure(run)


def data_tokenizer(args: argparse.Namespace, run: Any, run_model: bool) -> Any:
    from mmadapt.data.tokenizer import tokenizer_for
    from mmadapt.train.run import tokenizer_source

    source = args.tokenizer or run.data.tokenizer or args.model or (tokenizer_source(run) if run_model else None)
    return tokenizer_for(source or None)


def data_encoder(args: argparse.Namespace, run: Any, run_model: bool) -> Any:
    """The sample encoder `data check` / `data show` use: the model, its tokenizer and the data settings (see the
    module docstring)."""
    from mmadapt.data import DataConfig, SampleEncoder

    config = DataConfig.of(run.data, **data_settings(args))  # a bad setting fails before any model is built
    model, tokenizer = data_model(args, run, run_model), data_tokenizer(args, run, run_model)
    return SampleEncoder.for_model(model, tokenizer, config=config)


def describe_encoder(args: argparse.Namespace, encoder: Any, run_model: bool) -> str:
    files = [a for a in args.run if "=" not in a]
    model = args.model or (f"the model of {files[0] if files else 'the model.* settings'}" if run_model else
                           f"{args.encoder} + {args.projector} + {args.backbone} (preset {args.preset})")
    how = [*(["the tokenizer's own"] if encoder.template.name == "tokenizer" else []),
           *([encoder.image_mode] if encoder.image_mode else [])]
    own = f" ({'; '.join(how)})" if how else ""
    return (f"{args.data}: {model}, chat template {encoder.template.name!r}{own}, max_length "
            f"{encoder.config.max_length}, truncation {encoder.config.truncation!r}")


def bad_fraction_limit(args: argparse.Namespace, run: Any) -> tuple[float, str]:
    """The share of problem samples above which `data check` fails, and the setting that said so."""
    if args.max_bad_fraction is not None:
        return args.max_bad_fraction, "--max-bad-fraction"
    if any("=" not in a for a in args.run):
        return run.data.max_bad_fraction, "data.max_bad_fraction"
    return 0.05, "--max-bad-fraction"


def data_sources(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(name, path or stream pattern) of each source DATA names: a data file or dataset, or a run file (its
    data.train: one path, each source of a mixture, or a stream's shards), which is then also the run file."""
    from mmadapt.data.mixture import parse_sources
    from mmadapt.data.stream import stream_source
    from mmadapt.train.config import RunConfig

    if not str(args.data).endswith((".yaml", ".yml")):
        return [(str(args.data), args.data)]
    args.run = [args.data, *args.run]
    train = RunConfig.load(args.data).resolved().data.train
    if train is None:
        raise ValueError(f"{args.data} sets no data.train: give a data file, or a run file that names one")
    stream = stream_source(train)
    if stream is not None:
        return [(stream["stream"], stream["stream"])]
    return [(source.name, source.path) for source in parse_sources(train)]


def chosen_indices(args: argparse.Namespace, size: int) -> range | list[int] | None:
    """--limit N: the first N records; --sample N: N records drawn at random (seeded by --seed), in file order."""
    import random

    if args.limit is not None and args.sample is not None:
        raise ValueError("give --limit (the first N records) or --sample (N at random), not both")
    if args.limit is not None:
        return range(min(args.limit, size))
    if args.sample is not None:
        return sorted(random.Random(args.seed).sample(range(size), min(args.sample, size)))
    return None


def cmd_data_check(args: argparse.Namespace) -> int:
    """Run the data pipeline over DATA (each source of a run file's mixture apart); print the report; exit 1 when
    too many samples have problems."""
    import json
    import logging
    import os

    from mmadapt.data import check_dataset, read_records
    from mmadapt.data.report import DataReport

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    sources = data_sources(args)
    run, run_model = run_config(args)
    encoder = data_encoder(args, run, run_model)
    workers = args.workers if args.workers is not None else min(4, os.cpu_count() or 1)
    reports = {}
    for name, path in sources:
        records = read_records(path, errors="report", columns=encoder.config.columns,
                               limits=encoder.config.table_limits)
        reports[name] = check_dataset(records, encoder, progress=sys.stderr.isatty(), workers=workers,
                                      indices=chosen_indices(args, len(records)))
    print(describe_encoder(args, encoder, run_model))
    total = DataReport(total=sum(r.total for r in reports.values()))
    for name, report in reports.items():
        total.merge(report)
        if len(reports) > 1:
            print(f"\n== source {name}")
        print(report.format())
    if len(reports) > 1:
        print(f"\n== all {len(reports)} sources\n{total.format()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**total.to_dict(), **({"sources": {name: r.to_dict() for name, r in reports.items()}}
                                             if len(reports) > 1 else {})}, f, indent=2)
    limit, name = bad_fraction_limit(args, run)
    if total.bad_fraction > limit:
        print(f"FAILED: {100 * total.bad_fraction:.1f}% of samples have problems, more than {name} {limit}")
        return 1
    return 0


def cmd_data_show(args: argparse.Namespace) -> int:
    """Print the first --n samples of DATA as the model will see them (supervised stretches marked)."""
    import logging

    from mmadapt.data import read_records

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    sources = data_sources(args)
    run, run_model = run_config(args)
    encoder = data_encoder(args, run, run_model)
    colour = {"always": True, "never": False}.get(args.colour, sys.stdout.isatty())
    marks = "green" if colour else "[[ ]]"
    print(f"{describe_encoder(args, encoder, run_model)}; supervised tokens in {marks}, images as <image x visual "
          "tokens>")
    shown = 0
    for _, path in sources:
        records = read_records(path, errors="report", columns=encoder.config.columns,
                               limits=encoder.config.table_limits)
        chosen = chosen_indices(args, len(records))
        shown += show_records(encoder, records, chosen if chosen is not None else range(len(records)),
                              args.n - shown, colour)
    return 0


def show_records(encoder: Any, records: Any, indices: Any, n: int, colour: bool) -> int:
    """Print up to n of `records` (at `indices`) as the model sees them; returns how many were shown."""
    from mmadapt.data import DataProblem, show_sample
    from mmadapt.data.preference import PairEncoder, is_preference_record
    from mmadapt.data.report import show_pair

    shown = 0
    for i in indices:  # a bad line: shown as skipped
        if shown >= n:
            break
        record = records[i]
        try:
            if is_preference_record(record):
                print("\n" + show_pair(encoder, PairEncoder(encoder).encode(record, i), colour=colour))
                shown += 1
                continue
            sample = encoder.encode(record, i)
        except DataProblem as problem:
            print(f"\n-- record {i}: skipped, {problem}")
            continue
        print("\n" + show_sample(encoder, sample, colour=colour))
        shown += 1
    return shown


def add_data_commands(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    check = data.add_parser("check", help="run the data pipeline over a dataset and report problems (no training)")
    show = data.add_parser("show", help="print samples as the model will see them: the chat template's text, "
                           "supervised tokens marked, images as <image x N>, counts")
    for command in (check, show):
        command.add_argument("data", help="a LLaVA or messages dataset, or preference pairs (trl, LLaMA-Factory, "
                             "ms-swift), .json or .jsonl; a Parquet / Arrow dataset, hub:OWNER/NAME[/SUBSET][@SPLIT] "
                             "(the local hub cache) or WebDataset .tar shards; or a run file: its data.train, each "
                             "source of a mixture reported apart")
        command.add_argument("run", nargs="*", metavar="RUN", help="right after DATA: a run file (its model, tokenizer "
                             "and data section) and/or its settings as section.key=value (e.g. data.max_length=4096)")
        add_build_arguments(command)
        command.add_argument("--model", default=None, help="a model directory (its parts and tokenizer) instead of "
                             "registry names")
        command.add_argument("--tokenizer", default=None, help="a transformers tokenizer directory (default: "
                             "data.tokenizer, else the --model directory's, else the run's pretrained model's, else "
                             "mmadapt's character tokenizer, as the demo model uses)")
        add_data_arguments(command)
    for command in (check, show):
        command.add_argument("--limit", type=int, default=None, help="only the first N records (a quick look)")
        command.add_argument("--sample", type=int, default=None, help="N records drawn at random (--seed)")
        command.add_argument("--seed", type=int, default=0, help="the seed of --sample (default 0)")
    check.add_argument("--workers", type=int, default=None, help="processes checking records in parallel (default: "
                       "the CPU count, at most 4)")
    check.add_argument("--json", default=None, help="also write the report as JSON here")
    check.add_argument("--max-bad-fraction", type=float, default=None, help="exit 1 when the share of problem "
                       "samples is above this (default: the run file's data.max_bad_fraction, else 0.05)")
    check.set_defaults(func=cmd_data_check)
    show.add_argument("--n", type=int, default=3, help="how many samples (default 3)")
    show.add_argument("--colour", choices=("auto", "always", "never"), default="auto",
                      help="green supervised tokens (auto: on a terminal), else [[ ]] brackets")
    show.set_defaults(func=cmd_data_show)

