"""`mmadapt` command line: list components, check a combination, check a dataset."""

from __future__ import annotations

import argparse
import os
import sys


def cmd_list(args: argparse.Namespace) -> int:
    from mmadapt import BACKBONES, ENCODERS, PROJECTORS

    for title, registry in (("backbones", BACKBONES), ("encoders", ENCODERS), ("projectors", PROJECTORS)):
        print(f"{title}:")
        for name, spec in registry.items():
            presets = getattr(spec, "presets", None)
            suffix = f"  [presets: {', '.join(presets)}]" if presets else ""
            print(f"  {name:<14} {spec.description}{suffix}")
    return 0


def cmd_check_model(args: argparse.Namespace) -> int:
    """Build a combination, check the image-token contract on a synthetic batch, run forward + backward."""
    import torch

    from mmadapt import build_model
    from mmadapt.contract import check_batch
    from mmadapt.testing import synthetic_batch

    torch.manual_seed(0)
    model = build_model(args.encoder, args.projector, args.backbone, preset=args.preset)
    batch = synthetic_batch(model, (1, 2))
    report = check_batch(model, batch)
    print(f"{args.encoder} + {args.projector} + {args.backbone} (preset {args.preset})")
    print(report)
    if not report.ok:
        return 1
    loss = model(**batch).loss
    loss.backward()
    grads = [p.grad for p in model.projector.parameters() if p.grad is not None]
    norm = float(torch.stack([g.norm() for g in grads]).norm()) if grads else float("nan")
    print(f"loss {loss.item():.4f}; projector gradient norm {norm:.4g}")
    return 0 if torch.isfinite(loss) else 1


def cmd_data_check(args: argparse.Namespace) -> int:
    """Run the data pipeline over DATA; print the report; exit 1 when too many samples have problems."""
    import json
    import logging

    from mmadapt import build_model
    from mmadapt.data import SampleEncoder, char_tokenizer, check_dataset, read_records

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    model = build_model(args.encoder, args.projector, args.backbone, preset=args.preset)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = char_tokenizer()
    encoder = SampleEncoder.for_model(
        model, tokenizer, image_root=args.image_root, allow_outside_root=args.allow_outside_root,
        max_length=args.max_length, truncation=args.truncation,
        insert_missing_placeholder=args.insert_missing_placeholder,
    )
    report = check_dataset(read_records(args.data, errors="report"), encoder, progress=sys.stderr.isatty())
    print(f"{args.data}: {args.encoder} + {args.projector} + {args.backbone} (preset {args.preset}), "
          f"max_length {args.max_length}, truncation {args.truncation!r}")
    print(report.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    if report.bad_fraction > args.max_bad_fraction:
        print(f"FAILED: {100 * report.bad_fraction:.1f}% of samples have problems, more than "
              f"--max-bad-fraction {args.max_bad_fraction}")
        return 1
    return 0


def add_data_commands(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    check = data.add_parser("check", help="run the data pipeline over a dataset and report problems (no training)")
    check.add_argument("data", help="a LLaVA or messages dataset (.json or .jsonl)")
    check.add_argument("--image-root", default=None, help="directory image paths are relative to")
    check.add_argument("--json", default=None, help="also write the report as JSON here")
    check.add_argument("--max-bad-fraction", type=float, default=0.05,
                       help="exit 1 when the share of problem samples is above this (default 0.05)")
    check.add_argument("--encoder", default="qwen3_5_vit")
    check.add_argument("--projector", default="qwen_merger")
    check.add_argument("--backbone", default="qwen3_5")
    check.add_argument("--preset", default="tiny")
    check.add_argument("--tokenizer", default=None, help="a transformers tokenizer directory (default: mmadapt's "
                       "character tokenizer, as the demo model uses)")
    check.add_argument("--max-length", type=int, default=2048)
    check.add_argument("--truncation", choices=("drop", "raise", "text"), default="drop")
    check.add_argument("--allow-outside-root", action="store_true",
                       help="accept absolute image paths and paths leaving --image-root")
    check.add_argument("--insert-missing-placeholder", action="store_true",
                       help="put <image> before the first user text of samples whose text has none")
    check.set_defaults(func=cmd_data_check)


def cmd_train(args: argparse.Namespace) -> int:
    """Train from a YAML config with dotted overrides; works under torchrun."""
    import logging

    from mmadapt.train import NonFiniteError, RunConfig
    from mmadapt.train.run import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.config is not None and "=" in args.config and not os.path.exists(args.config):
        args.overrides, args.config = [args.config, *args.overrides], None  # overrides only, no file
    config = RunConfig.load(args.config, [*args.overrides, *(["checkpoint.resume=true"] if args.resume else [])])
    try:
        summary = run(config)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"trained {summary['steps']} steps ({summary['skipped']} skipped) in {summary['seconds']:.0f} s; "
              f"outputs in {config.train.out}")
    return 0


def add_train_command(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train from a YAML config (torchrun --nproc_per_node N -m mmadapt train)")
    train.add_argument("config", nargs="?", default=None, help="a YAML run config (default: all defaults)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 stages.preset=llava-stage1")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in train.out (same as checkpoint.resume=true)")
    train.set_defaults(func=cmd_train)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmadapt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="registered backbones, encoders and projectors").set_defaults(func=cmd_list)
    check = sub.add_parser("check-model", help="build a combination and check its image-token contract")
    check.add_argument("encoder", nargs="?", default="qwen3_5_vit")
    check.add_argument("projector", nargs="?", default="qwen_merger")
    check.add_argument("backbone", nargs="?", default="qwen3_5")
    check.add_argument("--preset", default="tiny")
    check.set_defaults(func=cmd_check_model)
    add_data_commands(sub)
    add_train_command(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
