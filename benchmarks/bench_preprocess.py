"""Image preprocessing throughput: mmadapt's processors vs transformers', same images, same settings.

    python benchmarks/bench_preprocess.py [--reps 15] [--batch 8] [--threads 1] [--quick]

Prints a markdown table of images/s (median over `--reps` timed runs, the two methods alternating so
that drift in machine load hits both alike) for Qwen3.5's dynamic processor (Qwen2VLImageProcessor with
Qwen3.5's preprocessor_config.json: patch 16, 256^2..4096^2 pixels, mean = std = 0.5) and LLaVA-1.5's
pad-to-square at 336 px (LlavaImageProcessor(do_pad=True)), on real photos from `skimage.data` at
realistic sizes. "1 per call" is the per-sample Dataset use; "batch" passes `--batch` images at once.
The last column checks that both gave the same tensors (max abs diff). Target: speed-up >= 1.0x.
One torch thread by default: PyTorch's DataLoader workers, where preprocessing runs, use one each.
"""

from __future__ import annotations

import argparse
import platform

import torch
from bench_core import alternating
from PIL import Image
from skimage import data

from mmadapt.data.processors import FixedSizeProcessor, ImageProcessor, QwenProcessor

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def photos(count: int) -> list[Image.Image]:
    """Real photos at typical dataset sizes (COCO-like 640 x 480 and friends), cycled to `count`."""
    base = [
        Image.fromarray(data.astronaut()),  # 512 x 512
        Image.fromarray(data.coffee()).resize((640, 427)),
        Image.fromarray(data.chelsea()).resize((480, 640)),
        Image.fromarray(data.rocket()).resize((800, 533)),
    ]
    return [base[i % len(base)] for i in range(count)]


def processors() -> dict[str, tuple[ImageProcessor, object]]:
    from transformers import LlavaImageProcessor, Qwen2VLImageProcessor

    qwen = QwenProcessor()  # defaults: Qwen3.5's processor config
    hf_qwen = Qwen2VLImageProcessor(size={"shortest_edge": qwen.min_pixels, "longest_edge": qwen.max_pixels},
                                    patch_size=16, image_mean=list(qwen.mean), image_std=list(qwen.std))
    llava = FixedSizeProcessor(image_size=336, mean=CLIP_MEAN, std=CLIP_STD, mode="pad", tokens_per_image=576)
    hf_llava = LlavaImageProcessor(do_pad=True, size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    return {"Qwen3.5 dynamic": (qwen, hf_qwen), "LLaVA-1.5 pad 336": (llava, hf_llava)}


def bench(ours: ImageProcessor, theirs: object, images: list[Image.Image], per_call: int, reps: int) -> tuple:
    """(mmadapt images/s, transformers images/s, max abs diff of pixel_values) over `images`."""
    chunks = [images[i : i + per_call] for i in range(0, len(images), per_call)]
    run_ours = lambda: [ours(chunk).pixel_values for chunk in chunks]  # noqa: E731
    run_theirs = lambda: [theirs(chunk, return_tensors="pt")["pixel_values"] for chunk in chunks]  # noqa: E731
    diff = max((a - b).abs().max().item() for a, b in zip(run_ours(), run_theirs(), strict=True))
    t_ours, t_theirs = alternating([run_ours, run_theirs], reps)
    return len(images) / t_ours, len(images) / t_theirs, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8, help="images per call in the batch rows")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 is what each DataLoader worker process runs with")
    parser.add_argument("--quick", action="store_true", help="3 reps, 2-image batches (smoke run)")
    args = parser.parse_args()
    reps, batch = (3, 2) if args.quick else (args.reps, args.batch)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads; "
          f"torch {torch.__version__}, transformers {transformers.__version__}\n")
    print(f"### Image preprocessing, images/s (median of {reps}), real photos 512-800 px\n")
    print("| processor | images per call | mmadapt img/s | transformers img/s | speed-up | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|")
    images = photos(batch)
    for name, (ours, theirs) in processors().items():
        for per_call in (1, batch):
            fast, slow, diff = bench(ours, theirs, images, per_call, reps)
            print(f"| {name} | {per_call} | {fast:.0f} | {slow:.0f} | {fast / slow:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
