"""Evidence maps on the quadrant task (tests/quadrant_task.py): methods x encoders x backbones x seeds x threads.

    python benchmarks/bench_evidence.py --pairs clip:llama,qwen3_5_vit:qwen3_5 --seeds 0,1,2 --methods rise,integrated
    OMP_NUM_THREADS=1 python benchmarks/bench_evidence.py ...      # the thread-count spread

Each (encoder, backbone, seed) trains the task's model once (mmadapt's trainer, `train_corner_model`) and explains
`--images` held-out images with every method: one JSON line per (model, method) with the accuracy, the mean
top-left share over the answers that rest on the image (uniform map: 0.25), the faithfulness score (deletion /
insertion against random orders, `mmadapt.evidence.Faithfulness`) and how often deletion beats random.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quadrant_task import PROJECTOR, QUESTION, corner_setup, quadrant_report, train_corner_model

from mmadapt import Processor
from mmadapt.evidence import Integrated, Occlusion, Rise, explain, faithfulness, render


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="clip:llama,clip:qwen3_5,siglip:llama,siglip:qwen3_5,timm:llama,"
                        "timm:qwen3_5,qwen3_5_vit:llama,qwen3_5_vit:qwen3_5,qwen3_vl_vit:llama,qwen3_vl_vit:qwen3_5")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--methods", default="occlusion,integrated,rise")
    parser.add_argument("--images", type=int, default=12)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--curve-steps", type=int, default=8)
    parser.add_argument("--out", default=None, help="append the JSON lines here too")
    parser.add_argument("--save", default=None, metavar="DIR",
                        help="with --render: save the last model (DIR/model) and the drawn image (DIR/corner.png), "
                        "for `mmadapt explain DIR/model --image DIR/corner.png ...`")
    parser.add_argument("--control", action="store_true",
                        help="also score maps of random numbers (the faithfulness a map that knows nothing gets)")
    parser.add_argument("--render", default=None, metavar="PNG",
                        help="draw the default map of the first held-out answer that rests on the image (last pair)")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    methods = {method.name: method for method in (Occlusion(), Integrated(), Rise(samples=args.samples))}
    for pair in args.pairs.split(","):
        encoder, backbone = pair.split(":")
        for seed in map(int, args.seeds.split(",")):
            root = Path(tempfile.mkdtemp(prefix=f"evidence-{encoder}-{backbone}-"))
            size, extra = corner_setup(encoder, backbone)
            model, tokenizer, held_out, seconds = train_corner_model(
                (encoder, PROJECTOR[encoder], backbone), root, size=size, seed=seed, **extra)
            for name in args.methods.split(","):
                method = methods[name]
                report = quadrant_report(model, tokenizer, root, held_out[: args.images], method=method,
                                         curve_steps=args.curve_steps)
                line = {"encoder": encoder, "backbone": backbone, "seed": seed, "threads": threads, "method": name,
                        "train_seconds": round(seconds, 1), **{k: v for k, v in report.items() if k != "effects"}}
                print(json.dumps(line), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(line) + "\n")
            if args.control:
                measured = control(model, tokenizer, root, held_out[: args.images], args.curve_steps, seed)
                scores = [m.score for m in measured]
                line = {"encoder": encoder, "backbone": backbone, "seed": seed, "threads": threads,
                        "method": "random map", "faithfulness": float(np.mean(scores)),
                        "faithfulness_min": float(np.min(scores)), "faithfulness_max": float(np.max(scores)),
                        "trusted": float(np.mean([m.trusted for m in measured])), "maps": len(measured)}
                print(json.dumps(line), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(line) + "\n")
            if args.render:
                record = draw(model, tokenizer, root, held_out, args.render)
                if args.save:
                    model.save_pretrained(Path(args.save) / "model", tokenizer=tokenizer, overwrite=True)
                    shutil.copy(root / record["image"], Path(args.save) / "corner.png")


def control(model, tokenizer, root: Path, records: list[dict], curve_steps: int, seed: int) -> list:
    """The faithfulness (`Faithfulness`) of maps of random numbers, one per record whose answer rests on the pixels:
    what a map that knows nothing scores, and how often it is `trusted` (1 / (orders + 1) expected)."""
    processor, rng, scores = Processor.for_model(model, tokenizer), np.random.default_rng(seed), []
    for record in records:
        result = explain(model, processor, root / record["image"], QUESTION, max_new_tokens=6, curve_steps=0)
        heat = result.map
        if not result.answer_ids:
            continue  # an empty answer: nothing to follow
        noise = dataclasses.replace(heat, tokens=rng.random(heat.tokens.shape))
        inputs = processor(f"<image>\n{QUESTION}", images=[processor.image(root / record["image"])])
        measured = faithfulness(model, inputs, torch.tensor(result.answer_ids), [noise], steps=curve_steps,
                                seed=seed + 1)
        if measured.decisive:
            scores.append(measured)
    return scores


def draw(model, tokenizer, root: Path, records: list[dict], path: str) -> dict:
    """The default map (and its faithfulness) of the first record answered right that rests on the image, as a PNG;
    returns the record."""
    for record in records:
        result = explain(model, Processor.for_model(model, tokenizer), root / record["image"], QUESTION,
                         max_new_tokens=6)
        if result.rests_on_image and result.answer == record["conversations"][1]["value"]:
            render(root / record["image"], result.map, path, prompt=QUESTION, answer=result.answer)
            print(f"# wrote {path}: {record['id']} {result.quadrants}", file=sys.stderr)
            return record
    raise RuntimeError("no held-out answer was right and rested on the image: nothing to draw")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"# {time.perf_counter() - started:.0f} s", file=sys.stderr)
