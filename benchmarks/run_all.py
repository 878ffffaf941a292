"""Every benchmark in one run: a markdown table of mmadapt vs transformers, measured side by side.

    python benchmarks/run_all.py [--quick] [--sections 1-6] [--out benchmarks/latest.md]

Sections (targets from the issues in brackets; ratios < 1 mean mmadapt is faster):
1. training step (forward + backward + AdamW), mmadapt vs transformers' own model on the same
   weights and batch: one tiny config per family (Qwen3.5, LLaVA-1.5, Qwen3.5-MoE, Qwen3-VL, Qwen3-VL-MoE),
   fp32 and bf16 autocast [<= 1.0x];
2. injection forward + backward vs a plain bool index_put [<= 1.0x];
3. the always-on contract checks as a share of a training step [<= 1%];
4. packed vs padded effective (non-pad) tokens/s, LLaVA-mix-like lengths [>= 1.8x];
5. preprocessing images/s vs transformers' processors, one image per call [>= 1.0x];
6. peak memory (RSS) of a training step, mmadapt vs transformers, each in its own process;
7. the loss without full logits at real vocabularies and widths (`bench_loss.py`) [memory <= 0.5x / 0.7x,
   time <= 0.8x / 0.9x];
8. packed rows of many short samples vs a padding-free batch [<= 1.05x].
Everything runs on the CPU in about 15 minutes on 2 cores (sections 1-6: 2.5 minutes).
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_core import FAMILIES, alternating, bench_injection, pair, step_fn

from mmadapt import VisionLanguageModel
from mmadapt.processor import export_processor


# ---- 1. training step vs transformers -------------------------------------------------------------
def bench_steps(reps: int, families: list[str]) -> list[tuple[str, str, float, float]]:
    rows = []
    for family in families:
        ours, theirs, batch, hf_batch = pair(family)
        for autocast in (False, True):
            t_ours, t_theirs = alternating([step_fn(ours, batch, autocast), step_fn(theirs, hf_batch, autocast)],
                                           reps)
            rows.append((family, "bf16 autocast" if autocast else "fp32", t_ours, t_theirs))
    return rows


# ---- 3. contract-check overhead -------------------------------------------------------------------
def bench_contract(reps: int, families: list[str]) -> list[tuple[str, float, float]]:
    """(config, contract-check ms, training-step ms): the checks timed directly, 50 calls per sample.

    Differencing two noisy step times (checks on vs off) cannot resolve a <1% share on 2 shared cores;
    timing the checks themselves on the same batch can.
    """
    from mmadapt import contract

    rows = []
    for family in families:
        ours, _, batch, _ = pair(family)
        ids, valid = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            spans = contract.locate(ids, ours.tokens.image_token_id)
            visual = ours.encode_images(batch["pixel_values"], batch.get("image_grid_thw"))
            embeds = ours.embed(ids, spans, visual)

        def checks(model=ours, batch=batch, ids=ids, valid=valid, visual=visual, embeds=embeds) -> None:
            for _ in range(50):
                spans = contract.locate(ids, model.tokens.image_token_id)
                model.check_inputs(ids, spans, visual, valid, batch.get("mm_token_type_ids"), None,
                                   batch["images_per_sample"])
                contract.check_injected(embeds, spans, visual.features)

        t_checks, t_step = alternating([checks, step_fn(ours, batch, autocast=False)], reps)
        rows.append((family, t_checks / 50, t_step))
    return rows


# ---- 6. peak memory -------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process. Not ru_maxrss: that survives fork + exec from the parent."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))


def _peak_rss_child(family: str, which: str, hf_dir: str, batch_file: str, queue: multiprocessing.Queue) -> None:
    """Peak RSS above the post-import baseline: load, then 3 training steps (weights, grads, AdamW, activations)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    baseline = _status_kib("VmRSS")
    batch, hf_batch = torch.load(batch_file, weights_only=True)
    if which == "mmadapt":
        model, inputs = VisionLanguageModel.from_pretrained(hf_dir), batch
    else:
        model, inputs = getattr(transformers, FAMILIES[family][1]).from_pretrained(hf_dir), hf_batch
    step = step_fn(model, inputs, autocast=False)
    for _ in range(3):
        step()
    queue.put((_status_kib("VmHWM") - baseline) / 1024)


def bench_memory(families: list[str]) -> list[tuple[str, float, float]]:
    context = multiprocessing.get_context("spawn")
    rows = []
    for family in families:
        ours, _, batch, hf_batch = pair(family)
        with tempfile.TemporaryDirectory() as tmp:
            ours.save_pretrained(tmp, format="transformers", processor_export=export_processor)
            torch.save((batch, hf_batch), f"{tmp}/batch.pt")
            peaks = []
            for which in ("mmadapt", "transformers"):
                queue = context.Queue()
                child = context.Process(target=_peak_rss_child, args=(family, which, tmp, f"{tmp}/batch.pt", queue))
                child.start()
                peaks.append(queue.get(timeout=600))
                child.join()
        rows.append((family, *peaks))
    return rows


# ---- report ---------------------------------------------------------------------------------------
def sections_of(text: str) -> set[int]:
    """'1-6' or '1,3,6' (or both: '1-3,6') -> the section numbers."""
    chosen: set[int] = set()
    for piece in text.split(","):
        low, _, high = piece.partition("-")
        chosen.update(range(int(low), int(high or low) + 1))
    if not chosen <= set(range(1, 9)):
        raise argparse.ArgumentTypeError(f"sections are 1 to 8, got {text!r}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small shapes, 1-2 repetitions, two families in sections 1, 3 and 6 (smoke run)")
    parser.add_argument("--sections", default="1-8", type=sections_of, help="which sections, e.g. 1-6 or 1,3,6")
    parser.add_argument("--out", default=None, help="also write the markdown here")
    args = parser.parse_args()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    reps = 2 if args.quick else 7
    families = list(FAMILIES)[:2] if args.quick else list(FAMILIES)  # quick: Qwen3.5- and LLaVA-shaped only
    started = time.perf_counter()
    lines = [f"machine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads; "
             f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}",
             ""]

    if 1 in args.sections:
        lines += ["### 1. Training step (fwd + bwd + AdamW), same weights and batch: mmadapt vs transformers", "",
                  "| config | precision | mmadapt ms | transformers ms | ratio |", "|---|---|---:|---:|---:|"]
        for family, precision, ours, theirs in bench_steps(reps, families):
            lines.append(f"| {family} | {precision} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {ours / theirs:.2f}x |")
    if 2 in args.sections:
        shape = (2, 256, 128, 64) if args.quick else (8, 2048, 1024, 576)
        injection = bench_injection(reps, shape)
        base = injection[0][1]
        lines += ["", f"### 2. Injection fwd + bwd, {shape[0]} x {shape[1]} tokens x {shape[2]} wide, "
                  f"{shape[3]} image tokens/sample", "", "| method | ms | vs bool index_put |", "|---|---:|---:|"]
        lines += [f"| {name} | {t * 1e3:.1f} | {t / base:.2f}x |" for name, t in injection]
    if 3 in args.sections:
        lines += ["", "### 3. Contract checks (on by default) as a share of a training step", "",
                  "| config | checks ms per batch | training step ms | share |", "|---|---:|---:|---:|"]
        for family, checks, step in bench_contract(reps, families):
            lines.append(f"| {family} | {checks * 1e3:.2f} | {step * 1e3:.1f} | {checks / step:.1%} |")
    if 4 in args.sections:
        from bench_packing import bench_pack_vs_pad, llava_mix_lengths, samples_of

        lengths = llava_mix_lengths(4 if args.quick else 16)
        samples, real = samples_of(lengths, 2040), sum(lengths)
        lines += ["", f"### 4. Packed vs padded, fwd + bwd, {len(samples)} samples, LLaVA-mix-like lengths "
                  f"(mean {real / len(lengths):.0f}, max {max(lengths)})", "",
                  "| backbone | padded tok/s | packed tok/s | speed-up |", "|---|---:|---:|---:|"]
        for backbone in ("llama", "qwen3_5"):
            t_pad, t_pack, _, _ = bench_pack_vs_pad(backbone, samples, 1 if args.quick else 2)
            lines.append(f"| {backbone} | {real / t_pad:.0f} | {real / t_pack:.0f} | {t_pad / t_pack:.2f}x |")
    if 5 in args.sections:
        from bench_preprocess import bench, photos, processors

        lines += ["", "### 5. Preprocessing, one image per call (as in a DataLoader worker), real photos", "",
                  "| processor | mmadapt img/s | transformers img/s | speed-up |", "|---|---:|---:|---:|"]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a DataLoader worker's budget
        for name, (ours, theirs) in processors().items():
            result = bench(ours, theirs, photos(4), 1, 3 if args.quick else 15)
            lines.append(f"| {name} | {result[0]:.0f} | {result[1]:.0f} | {result[0] / result[1]:.2f}x |")
        torch.set_num_threads(threads)
    if 6 in args.sections:
        lines += ["", "### 6. Peak memory: RSS above the post-import baseline over load + 3 training steps, "
                  "each model in its own process", "",
                  "| config | mmadapt MiB | transformers MiB | ratio |", "|---|---:|---:|---:|"]
        for family, ours, theirs in bench_memory(families):
            lines.append(f"| {family} | {ours:.0f} | {theirs:.0f} | {ours / max(theirs, 1e-9):.2f}x |")
    if 7 in args.sections:
        from bench_loss import DEFAULT_CONFIGS, bench_vlm_step

        lines += ["", "### 7. Loss without full logits at the real vocabulary and width (depth cut): one training "
                  "step (fwd + bwd + AdamW, fp32, LLaVA-SFT-like batch of 2), each side in its own process", "",
                  "| config (depth cut) | mmadapt s | transformers s | time ratio [target] | "
                  "fwd+bwd peak ratio [target] |", "|---|---:|---:|---:|---:|"]
        for name in DEFAULT_CONFIGS:
            r = bench_vlm_step(name, args.quick, 1 if args.quick else 2)
            ours, theirs = r["mmadapt"], r["transformers"]
            memory_target, time_target = r["targets"]
            lines.append(f"| {name} ({r['depth']}) | {ours['seconds']:.2f} | {theirs['seconds']:.2f} | "
                         f"{ours['seconds'] / theirs['seconds']:.2f}x [<= {time_target}x] | "
                         f"{ours['step_peak_mib'] / max(theirs['step_peak_mib'], 1e-9):.2f}x [<= {memory_target}x] |")
    if 8 in args.sections:
        from bench_loss import bench_many_short, packed_model

        model = packed_model(args.quick)
        lines += ["", "### 8. Packed rows of many short samples vs the same tokens as a padding-free batch "
                  "(fwd + bwd)", "", "| packed rows | padding-free batch | ratio [target <= 1.05x] |", "|---|---|---:|"]
        for per_row, length, rows in ((4, 32, 2),) if args.quick else ((16, 128, 2), (4, 512, 2)):
            packed, plain = bench_many_short(model, per_row, length, rows, 1 if args.quick else 3)
            lines.append(f"| {rows} x {per_row} x {length} | ({rows * per_row}, {length}) | {packed / plain:.2f}x |")
    lines += ["", f"total time {time.perf_counter() - started:.0f} s"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
