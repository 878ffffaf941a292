"""`mmadapt explain` (and `eval --evidence`): where an answer rests on its image, and how far to trust the map.
"""

from __future__ import annotations

import argparse
import os

from mmadapt.cli.common import add_model_arguments


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

