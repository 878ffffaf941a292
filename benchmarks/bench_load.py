"""Loading a saved Qwen3.5-0.8B-shaped VLM: mmadapt's three parts vs transformers' own from_pretrained.

    python benchmarks/bench_load.py [--quick] [--reps N] [--out FILE]

A random Qwen3.5-0.8B-shaped `Qwen3_5ForConditionalGeneration` at its real sizes (vocabulary 248,320,
hidden 1024, 24 text layers, the 12-block vision tower, tied embeddings) is saved once in bfloat16, as
the hub ships it, by a separate process into a temporary directory. Then, alternating, each loader runs
in its own fresh process ("spawn"), `--reps` times:

- mmadapt: `mmadapt.build_model({"name": "qwen3_5_vit", "pretrained": d}, {"name": "qwen_merger", ...},
  {"name": "qwen3_5", ...})`, each part built on the meta device and memory-mapped from the checkpoint;
- transformers: `Qwen3_5ForConditionalGeneration.from_pretrained(d)`.

Seconds: from the call to the loaded model (imports, including transformers' Qwen3.5 modeling module,
happen before the timer, identically in both processes). Peak RSS: VmHWM above the post-import VmRSS
over the load plus one read of every parameter and buffer (so memory-mapped weights are really
resident, for both). Each process then runs an 8-token text-only forward; the logits of the two loaders
must agree (bf16, max |diff| <= 1e-2), so the benchmark also proves the load was right.
Targets: mmadapt's load time <= 1.2x transformers'; mmadapt's peak RSS <= 1.2x the checkpoint's bytes.
`--quick`: 2 text layers (one Gated DeltaNet, one attention) and 2 vision blocks, real widths and
vocabulary; the checkpoint is built in the main process and every load runs in one fresh process, in turn, the
high-water mark reset (`/proc/self/clear_refs`) before each (about 20 s with --reps 1). The full run (real depth,
5 reps) takes about 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import platform
import queue as queue_module
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from run_all import _status_kib

TIME_TARGET, RSS_TARGET = 1.2, 1.2
LOADERS = {
    "mmadapt": "mmadapt.build_model (qwen3_5_vit + qwen_merger + qwen3_5)",
    "transformers": "transformers Qwen3_5ForConditionalGeneration.from_pretrained",
}
TEXT_IDS = [[248045, 872, 198, 9419, 11, 1879, 0, 248046]]  # 8 tokens, no image
LOGIT_TOLERANCE = 1e-2
QUICK_LAYERS = ["linear_attention", "full_attention"]  # both layer kinds of the hybrid stack
QUICK_BLOCKS = 2


# ---- the checkpoint -------------------------------------------------------------------------------
def qwen_config(quick: bool) -> Any:
    """Qwen3.5-0.8B's config from mmadapt's presets (token ids at the top level, as the hub's config.json)."""
    from transformers import Qwen3_5Config

    from mmadapt.backbones import BACKBONES
    from mmadapt.encoders import ENCODERS

    text = BACKBONES.get("qwen3_5").options("qwen3.5-0.8b")
    tokens = {k: text.pop(k) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}
    vision = ENCODERS.get("qwen3_5_vit").options("qwen3.5-0.8b")
    if quick:
        text.update(num_hidden_layers=len(QUICK_LAYERS), layer_types=QUICK_LAYERS)
        vision.update(depth=QUICK_BLOCKS)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True, video_token_id=248057,
                         **tokens)


def _save_child(directory: str, quick: bool) -> dict[str, Any]:
    """Random weights, built in bf16 on the CPU, saved once (in its own process: the parent stays small)."""
    import transformers
    from transformers import Qwen3_5ForConditionalGeneration

    transformers.utils.logging.disable_progress_bar()
    config = qwen_config(quick)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):  # the init once (not nn's own and then transformers' _init_weights)
        model = Qwen3_5ForConditionalGeneration(config)
    torch.set_default_dtype(torch.float32)
    model.to_empty(device="cpu")
    model.init_weights()  # transformers' initialisation of every weight, then the tying
    model.save_pretrained(directory)
    return {"parameters": sum(p.numel() for p in model.parameters()), "layers": config.text_config.num_hidden_layers,
            "layer_types": sorted(set(config.text_config.layer_types)), "blocks": config.vision_config.depth,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


# ---- one load, in a fresh process -------------------------------------------------------------------
def _load_child(which: str, directory: str, logits_file: str) -> dict[str, Any]:
    import transformers
    import transformers.models.qwen3_5.modeling_qwen3_5  # both loaders import it: before the timer
    from transformers import Qwen3_5ForConditionalGeneration

    import mmadapt
    import mmadapt.backbones.qwen3_5_layers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    gc.collect()
    baseline = _status_kib("VmRSS")
    start = time.perf_counter()
    if which == "mmadapt":
        model = mmadapt.build_model({"name": "qwen3_5_vit", "pretrained": directory},
                                    {"name": "qwen_merger", "pretrained": directory},
                                    {"name": "qwen3_5", "pretrained": directory})
    else:
        model = Qwen3_5ForConditionalGeneration.from_pretrained(directory)
    seconds = time.perf_counter() - start
    with torch.no_grad():  # read every weight once: memory-mapped pages become resident
        checksum = sum(float(t.sum()) for t in (*model.parameters(), *model.buffers()))
    peak = (_status_kib("VmHWM") - baseline) / 1024
    result = {"seconds": seconds, "peak_mib": peak, "checksum": checksum,
              "parameters": sum(p.numel() for p in model.parameters()),
              "dtypes": sorted({str(p.dtype) for p in model.parameters()})}
    provenances = [getattr(getattr(model, part, None), "provenance", None)
                   for part in ("encoder", "projector", "backbone")]
    if which == "mmadapt" and all(provenances):  # when the background SHA-256 of the weights is done
        for provenance in provenances:
            provenance.sha256  # noqa: B018  (waits for the hash)
        result["hashed_s"] = time.perf_counter() - start
    model.eval()
    ids = torch.tensor(TEXT_IDS)
    with torch.no_grad():
        torch.save(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, logits_file)
    return result


def _load_in_turn(jobs: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """_load_child(*job) for each job, in this one process (--quick): before each load after the first, the memory
    the last one freed is handed back and the high-water mark reset (`/proc/self/clear_refs`), so each peak is its
    own."""
    from bench_loss import _reset_peak, _trim_heap

    results = []
    for k, job in enumerate(jobs):
        if k:
            gc.collect()
            _trim_heap()
            if not _reset_peak():
                raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs) to measure loads in one process; "
                                   "run without --quick")
        results.append(_load_child(*job))
    return results


def _child_main(target: Any, args: tuple, queue: multiprocessing.Queue) -> None:
    try:
        queue.put(("ok", target(*args)))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def in_child(target: Any, *args: Any, timeout: float = 900) -> Any:
    """target(*args) in a fresh "spawn" process; its result, or its traceback raised here."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child_main, args=(target, args, queue))
    child.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, value = queue.get(timeout=5)
            break
        except queue_module.Empty:
            if not child.is_alive() or time.monotonic() > deadline:
                child.kill()
                raise RuntimeError(f"{target.__name__}{args}: its process exited with code {child.exitcode} "
                                   "and no result (killed for memory?) or ran past the timeout") from None
    child.join()
    if status != "ok":
        raise RuntimeError(f"{target.__name__}{args} failed in its process:\n{value}")
    return value


def bench_load(directory: Path, reps: int, together: bool = False) -> dict[str, list[dict[str, Any]]]:
    """`reps` loads per loader, each in a fresh process (`together`: all in one, peaks reset between them), the order
    alternating from one repetition to the next."""
    for file in directory.glob("*.safetensors"):  # the page cache holds the file for both alike
        with open(file, "rb") as f:
            while f.read(1 << 26):
                pass
    runs: dict[str, list[dict[str, Any]]] = {which: [] for which in LOADERS}
    jobs = [(which, str(directory), str(directory / f"logits_{which}_{rep}.pt")) for rep in range(reps)
            for which in (list(LOADERS) if rep % 2 == 0 else list(LOADERS)[::-1])]
    results = in_child(_load_in_turn, jobs) if together else [in_child(_load_child, *job) for job in jobs]
    for (which, _, logits), result in zip(jobs, results, strict=True):
        runs[which].append({**result, "logits": Path(logits)})
    return runs


def check_same_model(runs: dict[str, list[dict[str, Any]]]) -> float:
    """Both loaders: bf16, the same parameters and the same logits. Returns the max |logit diff|."""
    for which, results in runs.items():
        for result in results:
            if result["dtypes"] != ["torch.bfloat16"]:
                raise AssertionError(f"{which} loaded {result['dtypes']}, expected the checkpoint's bfloat16")
    ours, theirs = runs["mmadapt"][0], runs["transformers"][0]
    if ours["parameters"] != theirs["parameters"]:
        raise AssertionError(f"mmadapt has {ours['parameters']} parameters, transformers {theirs['parameters']}")
    reference = torch.load(theirs["logits"], weights_only=True).float()
    diff = 0.0
    for result in (*runs["mmadapt"], *runs["transformers"]):
        diff = max(diff, (torch.load(result["logits"], weights_only=True).float() - reference).abs().max().item())
    if diff > LOGIT_TOLERANCE:
        raise AssertionError(f"mmadapt's and transformers' logits differ by {diff:.3g} > {LOGIT_TOLERANCE}")
    return diff


# ---- report ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 text layers and 2 vision blocks (smoke run)")
    parser.add_argument("--reps", type=int, default=5, help="loads per loader, each in a fresh process")
    parser.add_argument("--out", default=None, help="also write the markdown here")
    args = parser.parse_args(argv)
    import transformers

    started = time.perf_counter()
    lines = [f"machine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads; "
             f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}",
             ""]
    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        directory = Path(tmp)
        # --quick: the checkpoint built here and every load in one process (the start-ups dominate a smoke run)
        saved = _save_child(tmp, True) if args.quick else in_child(_save_child, tmp, False)
        gc.collect()
        save_s = time.perf_counter() - started
        weights = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        runs = bench_load(directory, args.reps, together=args.quick)
        diff = check_same_model(runs)

    seconds = {which: statistics.median(r["seconds"] for r in results) for which, results in runs.items()}
    peaks = {which: max(r["peak_mib"] for r in results) for which, results in runs.items()}
    ratio = {which: peaks[which] * 2**20 / weights for which in runs}
    depth = (f"{saved['layers']} text layers ({' + '.join(saved['layer_types'])}), {saved['blocks']} vision blocks")
    depth += " (--quick: reduced depth)" if args.quick else " (the real depth)"
    where = "one fresh process for all loads, peaks reset between them" if args.quick else \
        "fresh process(es) per loader"
    lines += [f"### Loading a saved Qwen3.5-0.8B-shaped random VLM: vocabulary 248,320, hidden 1024, {depth}; "
              f"{saved['parameters'] / 1e6:.1f} M parameters, {saved['dtypes'][0].removeprefix('torch.')}, "
              f"checkpoint {weights / 2**20:.0f} MiB ({weights:,} bytes); {args.reps} load(s) per loader, {where}, "
              "alternating", "",
              "| loader | seconds (median) | peak RSS MiB | RSS / checkpoint bytes |", "|---|---:|---:|---:|"]
    for which, label in LOADERS.items():
        lines.append(f"| {label} | {seconds[which]:.2f} | {peaks[which]:.0f} | {ratio[which]:.2f}x |")
    time_ratio = seconds["mmadapt"] / seconds["transformers"]
    lines.append(f"| ratio mmadapt / transformers | {time_ratio:.2f}x | "
                 f"{peaks['mmadapt'] / peaks['transformers']:.2f}x | |")
    met = {True: "met", False: "NOT met"}
    hashed = [r["hashed_s"] for r in runs["mmadapt"] if "hashed_s" in r]
    lines += ["", "| target | value | |", "|---|---:|---|",
              f"| mmadapt load time <= {TIME_TARGET}x transformers' | {time_ratio:.2f}x | "
              f"{met[time_ratio <= TIME_TARGET]} |",
              f"| mmadapt peak RSS <= {RSS_TARGET}x checkpoint bytes | {ratio['mmadapt']:.2f}x | "
              f"{met[ratio['mmadapt'] <= RSS_TARGET]} |", "",
              "Seconds: from the call to the loaded model, imports excluded. Peak RSS: VmHWM above the post-import "
              "VmRSS over the load and one read of every weight (max over the processes).",
              f"Both loaded {', '.join(runs['mmadapt'][0]['dtypes'])} (the checkpoint's dtype), "
              f"{runs['mmadapt'][0]['parameters'] / 1e6:.1f} M parameters each; logits of an 8-token text-only "
              f"input: max |mmadapt - transformers| = {diff:.3g} (tolerance {LOGIT_TOLERANCE}).",
              *([f"mmadapt's background SHA-256 of the weight files (provenance) had finished by "
                 f"{statistics.median(hashed):.2f} s after the call (median; not in the load time)."]
                if hashed else []),
              "", f"total time {time.perf_counter() - started:.0f} s (building and saving the checkpoint: "
              f"{save_s:.0f} s)"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
