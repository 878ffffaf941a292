"""`mmadapt explain` (and `eval --evidence`): where an answer rests on its image, and how far to trust the map.

Parsing and printing only: `mmadapt.evidence.explain` and `explain_records` do the work and format their lines.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from mmadapt.cli.common import add_model_arguments


def write_evidence(args: argparse.Namespace, model: object, encoder: Any, records: list) -> list[dict]:
    """Evidence maps of the first `--evidence` single-image records, as PNGs in `--evidence-dir`; prints a line per
    map and the mean faithfulness, returns the maps' summaries (the eval report's "evidence")."""
    from mmadapt.evidence import explain_records
    from mmadapt.processor import Processor

    processor = Processor.for_model(model, encoder.tokenizer)
    report = explain_records(model, processor, records, args.evidence_dir, limit=args.evidence,
                             image_root=encoder.config.image_root, on_result=lambda item: print(item.line()))
    for line in report.lines():
        print(line)
    return report.summary()


def method_from(args: argparse.Namespace) -> Any:
    """--method NAME and that method's own flag (--windows, --samples or --steps) -> the method object."""
    return _method_table()[args.method](args)


def _method_table() -> dict[str, Callable[[argparse.Namespace], Any]]:
    """The one place method names are read: --method NAME -> how to build it from its flag; the first is the default
    (the library's `DEFAULT_METHOD`). The methods (torch) are imported when one is built, not for `--help`."""
    from mmadapt import evidence

    return {"occlusion": lambda args: evidence.Occlusion(windows=args.windows),
            "rise": lambda args: evidence.Rise(samples=args.samples),
            "integrated": lambda args: evidence.Integrated(steps=args.steps)}


def cmd_explain(args: argparse.Namespace) -> int:
    """Answer PROMPT about --image, write the evidence map as a PNG, print the answer, the shares and the file."""
    import json
    from pathlib import Path

    from mmadapt.evidence import explain
    from mmadapt.inference import load_for_inference
    from mmadapt.processor import Processor

    prompt = " ".join(args.prompt).strip()
    if not prompt:
        raise ValueError("give a PROMPT, e.g. mmadapt explain MODEL --image cat.png What animal is this?")
    if not os.path.isfile(args.image):
        raise FileNotFoundError(f"--image {args.image} is not a file")
    method = method_from(args)
    out = args.out or f"{Path(args.image).stem}.evidence.png"
    model, tokenizer = load_for_inference(args.model, args.adapters)
    processor = Processor.for_model(model, tokenizer)
    result = explain(model, processor, args.image, prompt, method=method, rule=args.rule,
                     max_new_tokens=args.max_new_tokens, out=out, curve_steps=args.curve_steps,
                     batch_size=args.batch_size, seed=args.seed)
    print(result.answer)
    for line in result.lines():
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(result.summary(), indent=2) + "\n")
        print(f"wrote {args.json}")
    print(f"wrote {result.png}")
    return 0


def _sizes(text: str) -> tuple[int, ...]:
    """--windows 1,2 -> (1, 2), checked by `Occlusion`."""
    from mmadapt.evidence import Occlusion

    try:
        return Occlusion(windows=tuple(int(part) for part in text.split(","))).windows
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--windows {text!r}: give a comma-separated list of window sides, each "
                                         f">= 1, e.g. 1,2 ({error})") from None


def add_explain_command(sub: argparse._SubParsersAction) -> None:
    from mmadapt.evidence.settings import CURVE_STEPS, DEFAULT_SAMPLES, DEFAULT_STEPS, OCCLUSION_SIZES, RULES

    windows, samples, steps, methods = OCCLUSION_SIZES, DEFAULT_SAMPLES, DEFAULT_STEPS, list(_method_table())
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
    explain_.add_argument("--method", choices=methods, default=methods[0],
                          help="occlusion (default): windows of token cells set to the mean colour at the pixels, the "
                          "whole encoder inside the map; rise: random masks at the pixels; integrated: integrated "
                          "gradients at the visual tokens (where the LLM reads)")
    explain_.add_argument("--windows", type=_sizes, default=windows, metavar="1,2",
                          help=f"occlusion: window sides in token cells (default {','.join(map(str, windows))})")
    explain_.add_argument("--samples", type=int, default=samples, help=f"rise: random masks (default {samples})")
    explain_.add_argument("--steps", type=int, default=steps, help="integrated: points on the path from empty "
                          f"visual tokens to the image's (default {steps}); 1 = plain gradient x input")
    explain_.add_argument("--curve-steps", type=int, default=CURVE_STEPS,
                          help=f"faithfulness: points on the deletion / insertion curves (default {CURVE_STEPS}); "
                          "0 skips the measurement")
    explain_.add_argument("--batch-size", type=int, default=16, help="prompts per forward (default 16)")
    explain_.add_argument("--seed", type=int, default=0, help="random masks and orders (default 0)")
    explain_.add_argument("--json", default=None, help="also write the answer and the map's summary here")
    explain_.set_defaults(func=cmd_explain)
