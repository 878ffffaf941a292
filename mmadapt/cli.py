"""`mmadapt` command line: list the registered components, check a component combination."""

from __future__ import annotations

import argparse
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
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
