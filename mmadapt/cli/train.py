"""`mmadapt train`, `mmadapt plan` and `mmadapt export`: a run from its YAML config, its memory plan, its model.
"""

from __future__ import annotations

import argparse
import os
import sys


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
        bad = f", {summary['bad_samples']} of {summary['samples_seen']} samples bad and dropped" if summary[
            "bad_samples"] else ""
        print(f"trained {summary['steps']} steps ({summary['skipped']} skipped{bad}) in {summary['seconds']:.0f} s; "
              f"outputs in {config.train.out}")
        if summary.get("speed"):
            from mmadapt.train.tracking import speed_table

            print(speed_table(summary["speed"]))
    return 0


def add_train_command(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train from a YAML config (torchrun --nproc_per_node N -m mmadapt train)")
    train.add_argument("config", nargs="?", default=None, help="a YAML run config (default: all defaults)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 stages.preset=llava-stage1")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in train.out (= checkpoint.resume=true)")
    train.set_defaults(func=cmd_train)


def cmd_plan(args: argparse.Namespace) -> int:
    """Per-GPU memory of a run's training step before anything loads (`mmadapt.train.plan`)."""
    import json
    import logging

    from mmadapt.train import RunConfig
    from mmadapt.train.plan import parse_size, predict, without_reward_code

    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    memory = parse_size(args.gpu_memory) if args.gpu_memory else None
    host = parse_size(args.host_memory, "--host-memory") if args.host_memory else None
    if args.gpus_per_machine is not None and args.gpus_per_machine < 1:
        raise ValueError(f"--gpus-per-machine must be >= 1, got {args.gpus_per_machine}")
    named = [name.strip() for name in (args.rewards or "").split(",") if name.strip()]
    loaded = RunConfig.load(args.config, args.overrides)
    config, left_out = without_reward_code(loaded, named)
    if left_out:
        print(f"plan: {left_out}", file=sys.stderr)
    disabled = logging.root.manager.disable
    logging.disable(logging.INFO)  # the stages' parameter counts are not the plan's output
    try:
        plan = predict(config, gpus=args.gpus, gpu_memory=memory, device=args.device, host_memory=host,
                       gpus_per_machine=args.gpus_per_machine)
    finally:  # a notebook's or a test's logging is as it was
        logging.disable(disabled)
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.table())
    return 0 if plan.fits is not False else 4


def add_plan_command(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="predict a run's per-GPU memory before it starts: parameters, gradients, "
                                       "optimizer state, activations (measured on a probe), whether it fits")
    plan.add_argument("config", help="the run's YAML config")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, as for `mmadapt train`")
    plan.add_argument("--gpus", type=int, default=1, help="devices the run shards or replicates over (default 1)")
    plan.add_argument("--gpu-memory", default=None, help="memory of one device, e.g. 80GiB: say whether it fits")
    plan.add_argument("--host-memory", default=None,
                      help="host (CPU) memory of one machine, e.g. 1TiB: say whether a checkpoint save fits there")
    plan.add_argument("--gpus-per-machine", type=int, default=None,
                      help="ranks sharing one machine's host memory (default: --gpus, at most 8)")
    plan.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                      help="cuda (default): GPU optimizer kernels and a margin for the CUDA context; cpu: the peak "
                           "above an idle process on this machine")
    plan.add_argument("--json", action="store_true", help="print {fits, per_gpu: {parameters, ..., total}} as JSON")
    plan.add_argument("--rewards", default=None, help="GRPO: the rewards to build, comma-separated (accuracy, format, "
                      "package.module:function: imported, so run); default: grpo.rewards without the code it names, "
                      "which is never imported from a config's say-so")
    plan.set_defaults(func=cmd_plan)


def cmd_export(args: argparse.Namespace) -> int:
    """A run / checkpoint / model directory -> a model directory (LoRA merged, tokenizer included)."""
    from mmadapt.train.export import export

    export(args.src, args.dst, format=args.format, overwrite=args.overwrite, max_shard_size=args.max_shard_size)
    print(f"wrote {args.dst} ({args.format} format): load it with VisionLanguageModel.from_pretrained({args.dst!r})")
    return 0


def add_export_command(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="turn a run directory (its newest checkpoint), a checkpoint or a model "
                            "directory into a model directory")
    export.add_argument("src", help="OUT of `mmadapt train`, OUT/checkpoints/step-N, or a model directory")
    export.add_argument("dst", help="the model directory to write")
    export.add_argument("--format", choices=("mmadapt", "transformers"), default="mmadapt",
                        help="transformers: LlavaForConditionalGeneration / Qwen3_5ForConditionalGeneration layout")
    export.add_argument("--overwrite", action="store_true",
                        help="replace the model directory already at dst (the old one stays until the new one is "
                             "complete); a dst holding anything else is never written into")
    export.add_argument("--max-shard-size", type=shard_size, default="5GB",
                        help="largest weight file (default 5GB; KB, MB, GB, TB); from a sharded checkpoint, about the "
                             "most tensor memory the export holds at once")
    export.set_defaults(func=cmd_export)


def shard_size(text: str) -> str:
    """`--max-shard-size`: a number with KB, MB, GB or TB (as transformers' `max_shard_size`)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        if parse_size_to_int(text) > 0:
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not a size: write a positive number with KB, MB, GB or TB (500MB)")

