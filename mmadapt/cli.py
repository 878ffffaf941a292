"""`mmadapt` command line: list components, check a combination or a dataset, train, export, chat, eval, sees,
explain, run the demo, debug numerics.

Two helpers declare how a command chooses its model, so every command spells it the same way:
`add_build_arguments` (a combination from registry names: encoder, projector, backbone, --preset, --deepstack)
and `add_model_arguments` (a saved model: MODEL and --adapters).
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_PARTS = {"encoder": "qwen3_5_vit", "projector": "qwen_merger", "backbone": "qwen3_5"}


def add_build_arguments(command: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """The parts of a model built from registry names (positional or --encoder/--projector/--backbone), --preset
    and --deepstack; `build_from_args` builds it."""
    for part, default in DEFAULT_PARTS.items():
        if positional:
            command.add_argument(part, nargs="?", default=default)
        else:
            command.add_argument(f"--{part}", default=default)
    command.add_argument("--preset", default="tiny")
    command.add_argument("--deepstack", choices=("use", "drop"), default="use",
                         help="drop: build without the encoder's DeepStack levels")


def build_from_args(args: argparse.Namespace) -> object:
    from mmadapt import build_model

    return build_model(args.encoder, args.projector, args.backbone, preset=args.preset, deepstack=args.deepstack)


def add_model_arguments(command: argparse.ArgumentParser) -> None:
    """MODEL and --adapters, the same for chat, eval, sees and explain."""
    command.add_argument("model", help="a model directory, a run directory (OUT), a checkpoint or OUT/adapters")
    command.add_argument("--adapters", default=None, help="LoRA adapters (an OUT/adapters directory) to merge into "
                         "MODEL, their base model")


def cmd_list(args: argparse.Namespace) -> int:
    from mmadapt import BACKBONES, ENCODERS, PROJECTORS
    from mmadapt.data import TEMPLATES

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
    from mmadapt.testing import synthetic_batch

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


def video_settings(text: str | None) -> dict:
    """`--video '{fps: 1, max_frames: 64}'` (YAML) as the data.video settings."""
    import yaml

    video = yaml.safe_load(text) if text else {}
    if not isinstance(video, dict):
        raise ValueError(f"--video must be a mapping such as '{{fps: 1, max_frames: 64}}', got {video!r}")
    return video


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
    from mmadapt.train.plan import parse_size, predict

    logging.disable(logging.INFO)  # the stages' parameter counts are not the plan's output
    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    memory = parse_size(args.gpu_memory) if args.gpu_memory else None
    config = RunConfig.load(args.config, args.overrides)
    plan = predict(config, gpus=args.gpus, gpu_memory=memory, device=args.device)
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.table())
    return 0 if plan.fits is not False else 4


def add_plan_command(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="predict a run's per-GPU memory before it starts: parameters, gradients, "
                                       "optimizer state, activations (measured on a probe), whether it fits")
    plan.add_argument("config", help="the run's YAML config")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, as for `mmadapt train`")
    plan.add_argument("--gpus", type=int, default=1, help="devices the run shards or replicates over (default 1)")
    plan.add_argument("--gpu-memory", default=None, help="memory of one device, e.g. 80GiB: say whether it fits")
    plan.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                      help="cuda (default): GPU optimizer kernels and a margin for the CUDA context; cpu: the peak "
                           "above an idle process on this machine")
    plan.add_argument("--json", action="store_true", help="print {fits, per_gpu: {parameters, ..., total}} as JSON")
    plan.set_defaults(func=cmd_plan)


def cmd_export(args: argparse.Namespace) -> int:
    """A run / checkpoint / model directory -> a model directory (LoRA merged, tokenizer included)."""
    from mmadapt.inference import export

    export(args.src, args.dst, format=args.format)
    print(f"wrote {args.dst} ({args.format} format): load it with VisionLanguageModel.from_pretrained({args.dst!r})")
    return 0


def add_export_command(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="turn a run directory (its newest checkpoint), a checkpoint or a model "
                            "directory into a model directory")
    export.add_argument("src", help="OUT of `mmadapt train`, OUT/checkpoints/step-N, or a model directory")
    export.add_argument("dst", help="the model directory to write")
    export.add_argument("--format", choices=("mmadapt", "transformers"), default="mmadapt",
                        help="transformers: LlavaForConditionalGeneration / Qwen3_5ForConditionalGeneration layout")
    export.set_defaults(func=cmd_export)


def cmd_chat(args: argparse.Namespace) -> int:
    """Answer PROMPT and exit, or hold a conversation read from stdin (one user turn per line)."""
    import torch

    from mmadapt import Processor
    from mmadapt.inference import load_for_inference

    model, tokenizer = load_for_inference(args.model, args.adapters)
    processor = Processor.for_model(model, tokenizer)
    generator = torch.Generator().manual_seed(args.seed)
    messages: list[dict] = []
    pending, pending_videos = list(args.image), list(args.video)

    def answer(text: str) -> str:
        nonlocal pending, pending_videos
        placeholders = ("" if "<video>" in text else "<video>\n" * len(pending_videos)) + (
            "" if "<image>" in text else "<image>\n" * len(pending))
        messages.append({"role": "user", "content": placeholders + text})
        images = [img for m in messages for img in m.get("images", [])] + pending
        videos = [video for m in messages for video in m.get("videos", [])] + pending_videos
        messages[-1]["images"], messages[-1]["videos"], pending, pending_videos = pending, pending_videos, [], []
        inputs = processor([{"role": m["role"], "content": m["content"]} for m in messages], images=images,
                           videos=videos)
        printed, ids = "", []

        def stream(token: torch.Tensor) -> None:
            nonlocal printed
            ids.append(int(token[0]))
            text_so_far = processor.decode(ids)
            print(text_so_far[len(printed):], end="", flush=True)
            printed = text_so_far

        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, eos_token_id=processor.eos_token_ids,
                             pad_token_id=processor.encoder.pad_token_id, temperature=args.temperature,
                             top_p=args.top_p, generator=generator, on_token=stream)
        reply = processor.decode(out[0])
        print(reply[len(printed):], flush=True)
        messages.append({"role": "assistant", "content": reply})
        return reply

    if args.prompt:
        answer(" ".join(args.prompt))
        return 0
    for line in sys.stdin:
        line = line.strip()
        if line.startswith("/image "):
            pending.append(line[len("/image "):].strip())
        elif line.startswith("/video "):
            pending_videos.append(line[len("/video "):].strip())
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
    chat.add_argument("--max-new-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--seed", type=int, default=0)
    chat.set_defaults(func=cmd_chat)


def _inference_data(args: argparse.Namespace) -> tuple:
    """(model, sample encoder, collator, records) for `eval` / `sees` on the user's own data file."""
    from pathlib import Path

    from mmadapt.data import Collator, SampleEncoder
    from mmadapt.data.samples import read_records
    from mmadapt.inference import load_for_inference

    model, tokenizer = load_for_inference(args.model, args.adapters)
    root = args.image_root or str(Path(args.data).parent)
    encoder = SampleEncoder.for_model(model, tokenizer, image_root=root, max_length=args.max_length,
                                      video=video_settings(args.video))
    records = read_records(args.data)
    if not records:
        raise ValueError(f"{args.data} holds no records")
    return model, encoder, Collator.for_model(model, encoder.pad_token_id), records


def cmd_eval(args: argparse.Namespace) -> int:
    """Answers with real / blanked / shuffled images, scored; exit 1 under --require-sees when images do not help."""
    import json

    from mmadapt.evaluate import evaluate_records, plot_report, variants_of, write_predictions

    model, encoder, collate, records = _inference_data(args)
    report = evaluate_records(model, encoder, collate, records, margin=args.margin,
                              max_new_tokens=args.max_new_tokens, progress=sys.stderr.isatty())
    print(f"{report['samples']} samples ({report['skipped']} skipped), up to {report['max_new_tokens']} new tokens")
    print(f"{'with':<13} {'exact':>7} {'contained':>10}")
    for name in variants_of(report):  # + time_shuffled (frames reversed) when the prompts have videos
        print(f"{name:<13} {report[f'accuracy_{name}']:>7.3f} {report[f'contained_{name}']:>10.3f}")
    print(f"{'chance':<13} {report['chance']:>7.3f}")
    print(report["verdict"])
    if args.predictions:
        write_predictions(report, args.predictions)
    if args.plot:
        plot_report(report, args.plot)
    if args.evidence:
        report["evidence"] = write_evidence(args, model, encoder, records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in report.items() if k != "predictions"}, f, indent=2)
    return 1 if args.require_sees and not report["passed"] else 0


def write_evidence(args: argparse.Namespace, model: object, encoder: object, records: list) -> list[dict]:
    """Evidence maps of the first `--evidence` single-image records, as PNGs in `--evidence-dir`."""
    from pathlib import Path

    from mmadapt import Processor
    from mmadapt.data.samples import IMAGE, parse_record
    from mmadapt.evidence import MIN_EFFECT, explain

    processor, out, written = Processor.for_model(model, encoder.tokenizer), Path(args.evidence_dir), []
    out.mkdir(parents=True, exist_ok=True)
    for i, record in enumerate(records):
        sample = parse_record(record, i, encoder.config.image_root)
        users = [t for t in sample.turns if t.role == "user"]
        if len(sample.images) != 1 or len(users) != 1:
            continue  # maps are drawn for one image and one question
        prompt = users[0].text.replace(f"{IMAGE}\n", "").replace(IMAGE, "").strip()
        result = explain(model, processor, sample.images[0], prompt, out=out / f"{len(written):03d}-{sample.id}.png")
        measured = result["deletion_insertion"]
        written.append({"id": sample.id, "answer": result["answer"], "png": result["png"],
                        "quadrants": result["quadrants"], "image_effect": result["image_effect"],
                        "rests_on_image": result["rests_on_image"], "faithfulness": result["faithfulness"],
                        "trusted": measured.trusted, "wins": measured.wins, "random_orders": measured.orders,
                        "pixel_effect": measured.pixel_effect})
        note = ("" if measured.trusted else ", does NOT beat every random order" if measured.decisive
                else ", the answer barely depends on the pixels")
        print(f"evidence map of {sample.id}: {result['png']} (faithfulness {measured.score:+.2f}, beats "
              f"{measured.wins} of {measured.orders} random orders{note})")
        if len(written) == args.evidence:
            break
    scored = [w for w in written if w["pixel_effect"] >= MIN_EFFECT]
    if scored:
        print(f"evidence: mean faithfulness {sum(w['faithfulness'] for w in scored) / len(scored):+.2f} over the "
              f"{len(scored)} map(s) whose answer rests on the pixels (0 = a random map); "
              f"{sum(not w['trusted'] for w in scored)} do not beat every random order")
    return written


def cmd_sees(args: argparse.Namespace) -> int:
    """The loss-based check (`sees_images`) on a few batches of the user's data: a table and an exit code."""
    from mmadapt.data import DataProblem
    from mmadapt.sees import sees_images

    model, encoder, collate, records = _inference_data(args)
    samples = []
    for i, record in enumerate(records):
        try:
            samples.append(encoder.encode(record, i))
        except DataProblem as problem:
            if problem.fatal:
                raise
        if len(samples) == args.batches * args.batch_size:
            break
    if not samples:
        raise ValueError(f"none of the records of {args.data} could be encoded (see `mmadapt data check`)")
    reports = [sees_images(model, collate(samples[b : b + args.batch_size]))
               for b in range(0, len(samples), args.batch_size)]
    videos = any(r.videos for r in reports)
    columns = [("loss", "loss"), ("blanked", "loss_blank"), ("shuffled", "loss_shuffled")]
    if videos:  # the video columns: blanked videos, frames reversed in time, another sample's video
        columns += [("v blank", "loss_blank_videos"), ("reversed", "loss_time_shuffled"),
                    ("v other", "loss_shuffled_videos")]
    print(f"{'batch':>5} " + " ".join(f"{title:>8}" for title, _ in columns) + f" {'grad proj':>10}  verdict")
    for b, report in enumerate(reports):
        values = [getattr(report, key) for _, key in columns]
        cells = " ".join("     n/a" if v is None else f"{v:>8.4f}" for v in values)
        print(f"{b:>5} {cells} {report.grad_projector:>10.3g}  {report.verdict}")
    ok = all(r.ok for r in reports)
    seen = "images and videos" if videos and any(r.images for r in reports) else "videos" if videos else "images"
    print(f"the model {'sees' if ok else 'does NOT see'} its {seen} on {len(reports)} batch(es) of {args.data}")
    return 0 if ok else 1


def add_eval_commands(sub: argparse._SubParsersAction) -> None:
    for name, func, helptext in (
            ("eval", cmd_eval, "answer held-out questions with real, blanked and shuffled images; score them"),
            ("sees", cmd_sees, "does the answer loss on your data depend on the images? (no generation)")):
        command = sub.add_parser(name, help=helptext)
        add_model_arguments(command)
        command.add_argument("data", help="a LLaVA or messages .json / .jsonl file")
        command.add_argument("--image-root", default=None, help="image paths are relative to this (default: the "
                             "data file's directory)")
        command.add_argument("--max-length", type=int, default=4096)
        command.add_argument("--video", default=None, help="video settings, YAML (as data.video in a run): e.g. "
                             "'{fps: 1, max_frames: 64}'")
        command.set_defaults(func=func)
        if name == "eval":
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
        else:
            command.add_argument("--batches", type=int, default=4)
            command.add_argument("--batch-size", type=int, default=8)


def evidence_lines(result: dict) -> list[str]:
    """What `mmadapt explain` (and `eval --evidence`) print about one map: the method and where the evidence lies,
    the image effect against the method's own baseline, and the map's faithfulness (deletion / insertion)."""
    from mmadapt.evidence import MIN_EFFECT

    heat = result["map"]
    method = {"occlusion": f"occlusion of token-cell windows {'+'.join(f'{w}x{w}' for w in heat.windows)} at the "
                           "pixels",
              "rise": f"RISE, {heat.samples} random masks at the pixels",
              "integrated": "gradient x input at the visual tokens" if heat.steps == 1
              else f"integrated gradients at the visual tokens, {heat.steps} steps"}[heat.method]
    box = result["peak_box"]
    lines = [f"evidence ({heat.rule} part, {method}): " + ", ".join(
        f"{k.replace('_', '-')} {v:.1%}" for k, v in result["quadrants"].items())
        + f"; peak token {list(result['peak'])} at x {box[0]:.0f}-{box[2]:.0f}, y {box[1]:.0f}-{box[3]:.0f}"
        + ("" if result["completeness"] is None else f"; completeness {result['completeness']:.2f}")]
    baseline = "empty visual tokens" if heat.method == "integrated" else "the image at the mean colour"
    effect = result["image_effect"]
    lines.append(f"image effect: log p(answer) is {effect:+.2f} nats with the image than with {baseline}"
                 + ("" if result["rests_on_image"] else
                    f" - below {MIN_EFFECT}: the model gives this answer about as readily without the image, so the "
                    "map has no evidence to show (it is noise)"))
    measured = result["deletion_insertion"]
    if measured is not None:
        verdict = ("the image's pixels barely move this answer, so the curves are flat and say nothing about the map"
                   if not measured.decisive else "the map beats every random order" if measured.trusted else
                   "the map does NOT beat every random order: do not trust it")
        lines.append(f"faithfulness {measured.score:+.2f} (0 = a random map; beats {measured.wins} of "
                     f"{measured.orders} random orders; deletion AUC {measured.deletion:.2f} vs "
                     f"{measured.deletion_random_mean:.2f} random, insertion AUC {measured.insertion:.2f} vs "
                     f"{measured.insertion_random_mean:.2f}): {verdict}")
    return lines


def cmd_explain(args: argparse.Namespace) -> int:
    """Answer PROMPT about --image, write the evidence map as a PNG, print the answer, the shares and the file."""
    import json
    from pathlib import Path

    from mmadapt import Processor
    from mmadapt.evidence import explain
    from mmadapt.inference import load_for_inference

    prompt = " ".join(args.prompt).strip()
    if not prompt:
        raise ValueError("give a PROMPT, e.g. mmadapt explain MODEL --image cat.png What animal is this?")
    if not os.path.isfile(args.image):
        raise FileNotFoundError(f"--image {args.image} is not a file")
    out = args.out or f"{Path(args.image).stem}.evidence.png"
    model, tokenizer = load_for_inference(args.model, args.adapters)
    processor = Processor.for_model(model, tokenizer)
    result = explain(model, processor, args.image, prompt, max_new_tokens=args.max_new_tokens, out=out,
                     rule=args.rule, method=args.method, steps=args.steps, samples=args.samples,
                     windows=args.windows, curve_steps=args.curve_steps, batch_size=args.batch_size, seed=args.seed)
    print(result["answer"])
    for line in evidence_lines(result):
        print(line)
    if args.json:
        summary = {"prompt": prompt, "image": args.image, "answer": result["answer"],
                   "answer_ids": result["answer_ids"], "png": result["png"], "completeness": result["completeness"],
                   **result["map"].summary()}
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.json}")
    print(f"wrote {result['png']}")
    return 0


def _sizes(text: str) -> tuple[int, ...]:
    """--windows 1,2 -> (1, 2)."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of window sides, e.g. 1,2") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"window sides must be >= 1, got {text!r}")
    return sizes


def add_explain_command(sub: argparse._SubParsersAction) -> None:
    from mmadapt.evidence import (
        CURVE_STEPS,
        DEFAULT_METHOD,
        DEFAULT_SAMPLES,
        DEFAULT_STEPS,
        METHODS,
        OCCLUSION_SIZES,
        RULES,
    )

    explain_ = sub.add_parser("explain", help="answer a question about an image, map which parts of the image the "
                              "answer rests on (PNG) and measure how faithful the map is")
    add_model_arguments(explain_)
    explain_.add_argument("prompt", nargs="*", help="the question (words are joined); <image> marks where the image "
                          "goes (default: before the question)")
    explain_.add_argument("--image", required=True, help="the image file")
    explain_.add_argument("--out", default=None,
                          help="the PNG to write (default: IMAGE_STEM.evidence.png in the current directory)")
    explain_.add_argument("--max-new-tokens", type=int, default=32)
    explain_.add_argument("--rule", choices=RULES, default="positive",
                          help="positive: tokens that support the answer (default); absolute: any influence")
    explain_.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
                          help="occlusion (default): windows of token cells set to the mean colour at the pixels, the "
                          "whole encoder inside the map; rise: random masks at the pixels; integrated: integrated "
                          "gradients at the visual tokens (where the LLM reads)")
    explain_.add_argument("--windows", type=_sizes, default=OCCLUSION_SIZES, metavar="1,2",
                          help="occlusion: window sides in token cells (default "
                          f"{','.join(map(str, OCCLUSION_SIZES))})")
    explain_.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                          help=f"rise: random masks (default {DEFAULT_SAMPLES})")
    explain_.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="integrated: points on the path from empty "
                          f"visual tokens to the image's (default {DEFAULT_STEPS}); 1 = plain gradient x input")
    explain_.add_argument("--curve-steps", type=int, default=CURVE_STEPS,
                          help=f"faithfulness: points on the deletion / insertion curves (default {CURVE_STEPS}); "
                          "0 skips the measurement")
    explain_.add_argument("--batch-size", type=int, default=16, help="prompts per forward (default 16)")
    explain_.add_argument("--seed", type=int, default=0, help="random masks and orders (default 0)")
    explain_.add_argument("--json", default=None, help="also write the answer and the map's summary here")
    explain_.set_defaults(func=cmd_explain)


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
    print(f"trained {report['steps']} steps on {report['train_samples']} digits in {report['train_seconds']:.0f} s "
          f"(final loss {report['final_loss']:.3f}); total {report['seconds']:.0f} s")
    print(f"held-out answer accuracy ({report['eval_samples']} digits, chance {report['chance']:.3f}):")
    for name, key in (("real images", "accuracy_images"), ("blanked images", "accuracy_blank"),
                      ("shuffled images", "accuracy_shuffled")):
        print(f"  {name:<16} {report[key]:.3f}")
    files = report["files"]
    print(f"report {os.path.join(args.out, 'report.json')}; loss curve {files['loss_curve']}; "
          f"predictions {files['predictions']}")
    print(report["verdict"])
    return 0 if report["passed"] else 1


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
    import contextlib

    import torch

    from mmadapt import VisionLanguageModel
    from mmadapt.numerics import dump
    from mmadapt.testing import synthetic_batch

    torch.manual_seed(args.seed)
    if args.model:
        model = VisionLanguageModel.from_pretrained(args.model)
    else:
        model = build_from_args(args)
    model = model.to(args.device)
    batch = {k: v.to(args.device) for k, v in synthetic_batch(model, args.images, seed=args.seed).items()}
    device_type = torch.device(args.device).type
    autocast = (torch.autocast(device_type, dtype=torch.bfloat16) if args.autocast == "bf16"
                else contextlib.nullcontext())
    with autocast:
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
    from mmadapt.numerics.compare import BACKWARD_RTOL, FORWARD_RTOL, NOISE_FLOOR

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
    dump.add_argument("--autocast", choices=("none", "bf16"), default="none")
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


def main(argv: list[str] | None = None) -> int:
    """User errors (a missing file, a bad config value, an unknown name) print one line; `--debug` (anywhere on the
    command line) shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = argparse.ArgumentParser(prog="mmadapt", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="registered backbones, encoders and projectors").set_defaults(func=cmd_list)
    check = sub.add_parser("check-model", help="build a combination and check its image-token contract")
    add_build_arguments(check, positional=True)
    check.set_defaults(func=cmd_check_model)
    add_data_commands(sub)
    add_train_command(sub)
    add_plan_command(sub)
    add_export_command(sub)
    add_chat_command(sub)
    add_eval_commands(sub)
    add_explain_command(sub)
    add_numerics_commands(sub)
    add_demo_command(sub)
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


if __name__ == "__main__":
    sys.exit(main())
