"""`mmadapt list`, `check-model`, `demo` and `numerics ...`: the registries, a combination's contract, the demo,
numerics debugging.
"""

from __future__ import annotations

import argparse
import os
import sys

from mmadapt.cli.common import add_build_arguments, build_from_args
from mmadapt.precision import FP32, PRECISIONS, Precision


def cmd_list(args: argparse.Namespace) -> int:
    from mmadapt.backbones import BACKBONES
    from mmadapt.data import TEMPLATES
    from mmadapt.encoders import ENCODERS
    from mmadapt.projectors import PROJECTORS

    for title, registry in (("backbones", BACKBONES), ("encoders", ENCODERS), ("projectors", PROJECTORS),
                            ("chat templates", TEMPLATES)):
        print(f"{title}:")
        for name, spec in registry.items():
            presets = getattr(spec, "presets", None)
            suffix = f"  [presets: {', '.join(presets)}]" if presets else ""
            print(f"  {name:<14} {spec.description}{suffix}")
    return 0


def cmd_check_model(args: argparse.Namespace) -> int:
    """Build a combination, check the image-token contract on a synthetic batch, run forward + backward."""
    import torch

    from mmadapt.contract import check_batch
    from mmadapt.synthetic import synthetic_batch

    torch.manual_seed(0)
    model = build_from_args(args)
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


def cmd_demo(args: argparse.Namespace) -> int:
    """Train a tiny model on handwritten digits; exit 1 unless it clearly reads the images."""
    import logging

    from mmadapt.demo import DEFAULTS, run_demo

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    steps = args.steps or DEFAULTS["steps"]
    print(f"mmadapt demo: {args.encoder} + {args.projector} + {args.backbone} (preset {args.preset}) learns to read "
          f"scikit-learn's handwritten digits ({steps} steps, seed {args.seed}); outputs in {args.out}", flush=True)
    report = run_demo(encoder=args.encoder, projector=args.projector, backbone=args.backbone, preset=args.preset,
                      deepstack=args.deepstack,
                      steps=args.steps, lr=args.lr, batch_size=args.batch_size, margin=args.margin, out=args.out,
                      seed=args.seed, progress=not args.no_progress and sys.stderr.isatty())
    print(report)
    return 0 if report.passed else 1


def add_demo_command(sub: argparse._SubParsersAction) -> None:
    # Defaults of None mean mmadapt.demo.DEFAULTS (not imported here: building the parser stays light).
    demo = sub.add_parser("demo", help="train a tiny model to read handwritten digits (CPU, offline, minutes) and "
                          "check that it uses the images; exit 1 if it does not")
    add_build_arguments(demo)
    demo.add_argument("--steps", type=int, default=None, help="training steps (default 300)")
    demo.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    demo.add_argument("--batch-size", type=int, default=None, help="samples per step (default 32)")
    demo.add_argument("--margin", type=float, default=0.2,
                      help="accuracy with images must beat blanked and shuffled images by this much (default 0.2)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--verbose", action="store_true", help="log the trainer's steps")
    demo.set_defaults(func=cmd_demo)


def cmd_numerics_dump(args: argparse.Namespace) -> int:
    """Dump per-layer statistics of one forward + backward on a synthetic batch (same on every machine)."""
    import torch

    from mmadapt.model import VisionLanguageModel
    from mmadapt.numerics import dump
    from mmadapt.synthetic import synthetic_batch

    torch.manual_seed(args.seed)
    if args.model:
        model = VisionLanguageModel.from_pretrained(args.model)
    else:
        model = build_from_args(args)
    model = model.to(args.device)
    batch = {k: v.to(args.device) for k, v in synthetic_batch(model, args.images, seed=args.seed).items()}
    device_type = torch.device(args.device).type
    with Precision.from_flag(args.autocast).autocast(device_type):
        result = dump(model, batch, args.out, seed=args.seed)
    print(f"{args.out}: {len(result.forward)} forward rows, {len(result.grads)} gradient rows, "
          f"loss {result.meta['loss']}, {os.path.getsize(args.out)} bytes")
    for kind, row in (("forward", result.first_nonfinite_forward()), ("gradient", result.first_nonfinite_grad())):
        if row is not None:
            print(f"first non-finite {kind} row: {row['name']} ({row['nan']} NaN, {row['inf']} Inf)")
    return 0


def cmd_numerics_compare(args: argparse.Namespace) -> int:
    """Compare two dumps; exit 1 when a layer diverges or a layer is on one side only."""
    from mmadapt.numerics import Tolerances, compare

    tolerances = Tolerances(forward=args.forward_rtol, backward=args.backward_rtol, floor=args.floor)
    result = compare(args.a, args.b, tolerances)
    print(result.format())
    if args.json:
        result.save_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        result.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0 if result.ok else 1


def cmd_numerics_lint_deepspeed(args: argparse.Namespace) -> int:
    """Lint a DeepSpeed JSON config; exit 1 when any finding is an error."""
    from mmadapt.numerics import format_findings, lint_deepspeed

    findings = lint_deepspeed(args.file)
    print(format_findings(findings, args.file))
    return 1 if any(f.severity == "error" for f in findings) else 0


def cmd_numerics_deepspeed_config(args: argparse.Namespace) -> int:
    """Write a safe ZeRO-2/3 config (for a run config when given) to --out or stdout."""
    import json

    from mmadapt.numerics import deepspeed_config_for_run, lint_deepspeed, safe_deepspeed_config

    if args.config is not None or args.overrides:
        from mmadapt.train import RunConfig

        config = deepspeed_config_for_run(RunConfig.load(args.config, args.overrides), args.stage)
    else:
        config = safe_deepspeed_config(args.stage)
    assert not lint_deepspeed(config), "the generated DeepSpeed config must lint clean"
    text = json.dumps(config, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out} (ZeRO-{args.stage}; lints clean)")
    else:
        print(text)
    return 0


def add_numerics_commands(sub: argparse._SubParsersAction) -> None:
    from mmadapt.numerics.tolerances import BACKWARD_RTOL, FORWARD_RTOL, NOISE_FLOOR

    numerics = sub.add_parser("numerics", help="numerics debugging: dumps, comparisons, DeepSpeed config lint")
    commands = numerics.add_subparsers(dest="numerics_command", required=True)
    dump = commands.add_parser("dump", help="dump per-layer forward/gradient statistics of one step on a "
                               "synthetic batch (run on each machine, then compare)")
    dump.add_argument("out", help="output file (.json, or .json.gz to gzip)")
    dump.add_argument("--model", default=None, help="a saved model directory (default: build from registry names)")
    add_build_arguments(dump)
    dump.add_argument("--images", type=int, nargs="+", default=[1, 2], help="images per sample (default 1 2)")
    dump.add_argument("--seed", type=int, default=0, help="seeds the weights (registry builds) and the batch")
    dump.add_argument("--device", default="cpu")
    dump.add_argument("--autocast", choices=[p.flag for p in PRECISIONS], default=FP32.flag)
    dump.set_defaults(func=cmd_numerics_dump)

    comp = commands.add_parser("compare", help="compare two dumps; name the first divergent layer forward and "
                               "backward (exit 1 when a layer diverges or is in one dump only)")
    comp.add_argument("a")
    comp.add_argument("b")
    comp.add_argument("--json", default=None, help="write first_forward, first_backward and the rows here")
    comp.add_argument("--plot", default=None, help="write a PNG of the relative differences here")
    comp.add_argument("--forward-rtol", type=float, default=FORWARD_RTOL,
                      help=f"forward output-norm tolerance (default {FORWARD_RTOL}, bf16 vs fp32)")
    comp.add_argument("--backward-rtol", type=float, default=BACKWARD_RTOL,
                      help=f"gradient-norm tolerance (default {BACKWARD_RTOL}, bf16 vs fp32)")
    comp.add_argument("--floor", type=float, default=NOISE_FLOOR,
                      help=f"noise floor as a fraction of the median row (default {NOISE_FLOOR})")
    comp.set_defaults(func=cmd_numerics_compare)

    lint = commands.add_parser("lint-deepspeed", help="check a DeepSpeed JSON config for unsafe bf16 settings "
                               "and misplaced keys (exit 1 on errors)")
    lint.add_argument("file")
    lint.set_defaults(func=cmd_numerics_lint_deepspeed)

    ds = commands.add_parser("deepspeed-config", help="write a safe ZeRO-2/3 DeepSpeed config (fp32 reduction and "
                             "accumulation, bf16 overflow checks)")
    ds.add_argument("--stage", type=int, choices=(2, 3), required=True)
    ds.add_argument("--out", default=None, help="output file (default: print)")
    ds.add_argument("--config", default=None, help="an mmadapt run YAML: take batch size, grad_accum, clipping "
                    "and precision from it")
    ds.add_argument("overrides", nargs="*", help="dotted run-config overrides, e.g. train.grad_accum=4")
    ds.set_defaults(func=cmd_numerics_deepspeed_config)


def add_list_command(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("list", help="registered backbones, encoders and projectors").set_defaults(func=cmd_list)


def add_check_model_command(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser("check-model", help="build a combination and check its image-token contract")
    add_build_arguments(check, positional=True)
    check.set_defaults(func=cmd_check_model)
