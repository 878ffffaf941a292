"""The GPU check: one command for the first machine with a GPU (issue 21 item 4).

    python benchmarks/gpu_check.py                          # on the GPU machine: about 5 minutes on one H200
    python benchmarks/gpu_check.py --device cpu --quick     # every check's logic on tiny configs, ~1.5 min, 2 cores
    python benchmarks/gpu_check.py --only steps,packing     # a subset (sections: steps, packing, fsdp, sp, speed)

It installs and downloads nothing: every model is built from presets with random weights. It prints one markdown
table (check, configuration, result, tolerance / target, pass) and exits 1 when a check fails.

Sections:
1. steps: one training step (forward + backward: loss and gradients) of every backbone family with a matching
   encoder and projector (tiny presets) on the device in bf16 autocast, against fp32 on the CPU on the same weights
   and batch (`mmadapt.synthetic.synthetic_batch`). Tolerances (bf16 keeps 8 bits of mantissa): loss relative
   difference <= 2e-2; per part (encoder, projector, backbone) gradient relative error
   |g - g_fp32| / |g_fp32| <= 5e-2. MoE routers get random weights (they start at zero) so that tokens really
   take different experts.
2. packing: the same samples as packed rows (`Collator.for_model(model, 0, max_tokens=...)`) and padded, eval mode,
   per-sample logits: max |packed - padded| / max |padded| <= 1e-4 in fp32 and <= 3e-2 under bf16 autocast (the
   varlen kernels run only in bf16 / fp16); isolation: changing the last tokens of one packed sample moves every
   other sample's logits by at most 1e-5 (fp32) / 1e-3 (bf16) relative, while its own logits move. On CUDA one row
   says which varlen kernels are importable (torch's `torch.nn.attention.varlen`, flash-attn, flash-linear-attention
   `fla`, causal-conv1d) and which ones mmadapt's packed layers use (`mmadapt.packing.flash_attention_varlen`,
   `mmadapt.backbones.qwen3_5_layers.varlen_kernels`); mmadapt does not call torch's own varlen attention.
3. fsdp: `torchrun --nproc_per_node 2 -m mmadapt train` with FSDP2 (NCCL on CUDA, gloo on a CPU) against one
   process with the same global batch (batch 2 x grad_accum 2), tiny Qwen3.5, fp32, 3 steps: losses within 1e-4
   relative. Skipped with fewer than 2 GPUs; on a CPU it runs with gloo (about 40 s). `--quick`: the one-process
   run in this process (no start-up of its own).
4. sp: sequence parallelism (`distributed.sequence_parallel: 2`, issue 56): `torchrun --nproc_per_node 2 -m mmadapt
   train` with the 2 ranks sharing each sample (Ulysses all-to-all over NCCL; on CUDA the packed rows' Gated DeltaNet
   takes FLA's and causal-conv1d's varlen kernels when importable) against one process with the same batches, tiny
   Qwen3.5 (Gated DeltaNet + attention), fp32, 3 steps, padded and packed rows: losses within 1e-4 relative. Skipped
   with fewer than 2 GPUs; on a CPU it runs with gloo (about 1 minute).
5. speed: tokens/s, MFU and peak memory of the real `Trainer`'s logged records (4 steps, the median of steps 2-4)
   at Qwen3.5-0.8B and Qwen3.5-2B full depth (ViT + merger + LLM presets `qwen3.5-0.8b` / `qwen3.5-2b`), bf16
   autocast, encoder frozen, projector and LLM full, 4 samples of 2,048 tokens with one image each (the image size
   `mmadapt plan` assumes), with and without packing (rows of 4,096 tokens) and activation checkpointing (`all`),
   next to `mmadapt.train.plan.predict(config, gpus=1)`. Target: the measured peak (CUDA max allocated per step)
   within +-20% of the plan's total without its margin; tokens/s and MFU are reported, not judged. The timed runs
   write no checkpoint. `--quick`: tiny presets, 2 samples of 128 tokens, 3 steps; on a CPU the peak is the
   process's RSS, interpreter included (reported, not judged).

Cannot be checked on a CPU: the CUDA kernels (flash-attn, fla, causal-conv1d), NCCL, MFU, the plan against CUDA's
allocator. `--device cpu` hides CUDA from the Trainer (`CUDA_VISIBLE_DEVICES=""`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch  # CUDA starts at its first use, after --device cpu has hidden it

from mmadapt.train import Trainer

FAMILIES = {  # backbone family: (encoder, projector, backbone)
    "llama": ("clip", "mlp2x_gelu", "llama"),
    "qwen3_5": ("qwen3_5_vit", "qwen_merger", "qwen3_5"),
    "qwen3_5_moe": ("qwen3_5_vit", "qwen_merger", "qwen3_5_moe"),
    "qwen3_vl": ("qwen3_vl_vit", "qwen_merger", "qwen3_vl"),
    "qwen3_vl_moe": ("qwen3_vl_vit", "qwen_merger", "qwen3_vl_moe"),
}
SECTIONS = ("steps", "packing", "fsdp", "sp", "speed")
LOSS_TOL, GRAD_TOL = 2e-2, 5e-2
PACKED_TOL = {"fp32": 1e-4, "bf16": 3e-2}
ISOLATION_TOL = {"fp32": 1e-5, "bf16": 1e-3}
FSDP_TOL = 1e-4
PLAN_TOL = 0.20
IMAGES, TEXT = (1, 0, 2, 1, 0), (9, 14, 5, 30, 3)  # tests/test_packing.py's samples


class Table:
    """The rows of the one table; `failed` when any judged row failed."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str, str]] = []

    def add(self, check: str, config: str, result: str, target: str, ok: bool | None) -> None:
        verdict = "info" if ok is None else ("pass" if ok else "FAIL")
        self.rows.append((check, config, result, target, verdict))
        print(f"  {verdict:4} {check} | {config} | {result}", file=sys.stderr, flush=True)

    @property
    def failed(self) -> bool:
        return any(r[4] == "FAIL" for r in self.rows)

    def markdown(self) -> str:
        lines = ["| check | configuration | result | tolerance / target | pass |", "|---|---|---|---|---|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in self.rows])


def build(names: tuple[str, str, str]) -> Any:
    """A tiny model with random weights; MoE routers random too (they start at zero: every token, same experts)."""

    from mmadapt import VisionLanguageModel

    torch.manual_seed(0)
    model = VisionLanguageModel.from_names(*names, preset="tiny")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def relative(a: Any, b: Any) -> float:
    """|a - b| / |b| (norms), 0 when both are zero."""
    scale = float(b.norm())
    return float((a - b).norm()) / scale if scale else float((a - b).norm())


# ---- 1. a training step in bf16 on the device vs fp32 on the CPU -------------------------------------------------
def loss_and_grads(model: Any, batch: dict, device: Any, bf16: bool) -> tuple[float, dict[str, Any]]:
    """Loss and the flattened gradients per part ({part: (P,) fp32 on the CPU}) of one forward + backward."""

    model = model.to(device).train()
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch).loss
    loss.backward()
    grads: dict[str, list] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads.setdefault(name.split(".")[0], []).append(p.grad.detach().float().flatten().cpu())
    return loss.item(), {part: torch.cat(g) for part, g in grads.items()}


def check_steps(table: Table, device: Any) -> None:

    from mmadapt.synthetic import synthetic_batch

    where = f"{device.type} bf16 autocast vs CPU fp32"
    for names in FAMILIES.values():
        model = build(names)
        batch = synthetic_batch(model, (1, 2))
        ref_loss, ref = loss_and_grads(copy.deepcopy(model), batch, torch.device("cpu"), bf16=False)
        loss, grads = loss_and_grads(model, batch, device, bf16=True)
        config = f"{'+'.join(names)} tiny, {where}"
        diff = abs(loss - ref_loss) / abs(ref_loss)
        table.add("step: loss", config, f"rel diff {diff:.1e} ({loss:.4f} vs {ref_loss:.4f})", f"<= {LOSS_TOL:.0e}",
                  diff <= LOSS_TOL)
        errors = {part: relative(grads[part], ref[part]) for part in ref}
        worst = max(errors.values())
        table.add("step: gradients", config, ", ".join(f"{p} {e:.1e}" for p, e in errors.items()),
                  f"each <= {GRAD_TOL:.0e}", worst <= GRAD_TOL and set(grads) == set(ref))
        del model


# ---- 2. packed rows equal padded rows ----------------------------------------------------------------------------
def per_sample_logits(model: Any, batch: dict, device: Any, bf16: bool) -> dict[str, Any]:
    """{sample id: (n, V) fp32 logits over its own tokens} from a padded or packed batch (tests/test_packing.py)."""

    on = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(**on).logits.float().cpu()
    width, out = batch["input_ids"].shape[1], {}
    cu = batch["cu_seqlens"].tolist() if "cu_seqlens" in batch else None
    for r, ids in enumerate(batch["meta"]["sample_ids"]):
        if cu is None:
            lengths = [int(batch["attention_mask"][r].sum())]
        else:
            lengths = [b - a for a, b in itertools.pairwise(cu) if r * width <= a < (r + 1) * width][: len(ids)]
        at = 0
        for sample_id, n in zip(ids, lengths, strict=True):
            out[sample_id] = logits[r, at : at + n]
            at += n
    return out


def kernels_row(table: Table, device: Any) -> None:
    """Which varlen kernels are importable here, and which mmadapt's packed layers pick (detection only)."""

    from mmadapt.backbones.qwen3_5_layers import varlen_kernels
    from mmadapt.packing import flash_attention_varlen

    def present(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            return False

    found = {"torch.nn.attention.varlen": present("torch.nn.attention.varlen"), "flash_attn": present("flash_attn"),
             "fla": present("fla"), "causal_conv1d": present("causal_conv1d")}
    probe = torch.zeros(1, device=device)
    attention = "flash-attn varlen" if device.type == "cuda" and flash_attention_varlen() is not None else \
        "SDPA per group (regrouped)"
    deltanet = "fla + causal-conv1d varlen" if varlen_kernels(probe) is not None else "per group (regrouped)"
    result = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in found.items())
    table.add("packing: kernels", f"{device.type}, torch {torch.__version__}",
              f"importable: {result}; mmadapt uses: attention {attention} (bf16), Gated DeltaNet {deltanet}",
              "reported", None)


def check_packing(table: Table, device: Any) -> None:
    from mmadapt.data import Collator
    from mmadapt.synthetic import synthetic_samples

    kernels_row(table, device)
    for names in FAMILIES.values():
        model = build(names).to(device).eval()
        samples = synthetic_samples(model, IMAGES, text_lengths=TEXT, seed=1)
        pad = Collator.for_model(model, 0)
        pack = Collator.for_model(model, 0, max_tokens=max(map(len, samples)) + 16)
        packed_batch = pack(samples)
        changed = synthetic_samples(model, IMAGES, text_lengths=TEXT, seed=1)
        victim = next(s for s in changed if s.num_images)
        victim.input_ids = victim.input_ids.clone()
        victim.input_ids[-3:] = (victim.input_ids[-3:] + 7) % 200
        rows = f"{len(samples)} samples in {packed_batch['input_ids'].shape[0]} rows"
        for precision in ("fp32", "bf16"):
            bf16 = precision == "bf16"
            padded = per_sample_logits(model, pad(samples), device, bf16)
            packed = per_sample_logits(model, packed_batch, device, bf16)
            after = per_sample_logits(model, pack(changed), device, bf16)
            scale = max(float(t.abs().max()) for t in padded.values())
            diff = max(float((packed[s] - padded[s]).abs().max()) for s in padded) / scale
            config = f"{'+'.join(names)} tiny, {device.type} {precision}, {rows}"
            table.add("packing: packed == padded", config, f"max rel diff {diff:.1e}",
                      f"<= {PACKED_TOL[precision]:.0e}", diff <= PACKED_TOL[precision])
            moved = {s: float((after[s] - packed[s]).abs().max()) / scale for s in packed}
            others = max(v for s, v in moved.items() if s != victim.id)
            table.add("packing: isolation", config, f"others moved {others:.1e}, changed sample {moved[victim.id]:.1e}",
                      f"others <= {ISOLATION_TOL[precision]:.0e}, changed > 1e-3",
                      others <= ISOLATION_TOL[precision] and moved[victim.id] > 1e-3)
        del model


# ---- 3. FSDP2 with 2 processes vs 1 -------------------------------------------------------------------------------
def fsdp_dataset(root: Path) -> Path:
    """16 records with random images (no download) and the run's base config; returns the config's path."""
    import numpy as np
    from PIL import Image

    (root / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for k in range(4):
        Image.fromarray(rng.integers(0, 255, (32, 32 + 16 * (k % 2), 3), dtype=np.uint8)).save(
            root / "images" / f"{k}.png")
    records = [{"id": f"s{i}", "image": f"{i % 4}.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?" + " please" * (i % 3)},
        {"from": "gpt", "value": f"picture {i % 4}"}]} for i in range(16)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    config = root / "base.yaml"
    config.write_text(f"data: {{train: {root / 'train.jsonl'}, image_root: {root / 'images'}, max_length: 256}}\n"
                      "train: {steps: 3, lr: 1.0e-3, progress: false}\nstages: {encoder: full}\n")
    return config


def train_losses(config: Path, out: Path, *overrides: str, procs: int = 1, here: bool = False) -> list[float]:
    """The losses `mmadapt train` logs, run in `procs` processes (torchrun), or in this process (`here`, procs 1:
    --quick spares a start-up; its output goes to stderr)."""
    args = ["train", str(config), f"train.out={out}", *overrides]
    if here and procs == 1:
        from mmadapt.cli import main as mmadapt_main

        with contextlib.redirect_stdout(sys.stderr):
            code = mmadapt_main(args)
        if code:
            raise RuntimeError(f"mmadapt {' '.join(args)} exited with {code} (its output is above)")
    else:
        launcher = [sys.executable]  # --standalone: a free rendezvous port, so two runs at once never collide
        if procs > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
        result = subprocess.run([*launcher, "-m", "mmadapt", *args], capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(result.stderr[-2000:])
    return [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]


def check_fsdp(table: Table, device: Any, quick: bool = False) -> None:

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    backend = "NCCL" if device.type == "cuda" else "gloo"
    config = f"tiny qwen3_5_vit+qwen_merger+qwen3_5, FSDP2 over {backend}, 2 procs x batch 2 vs 1 proc x 2 x accum 2"
    if device.type == "cuda" and gpus < 2:
        table.add("fsdp: 2 processes == 1", config, f"skipped: {gpus} GPU", f"losses within {FSDP_TOL:.0e} rel", None)
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = fsdp_dataset(Path(tmp))
        try:
            one = train_losses(base, Path(tmp) / "one", "data.batch_size=2", "train.grad_accum=2", here=quick)
            two = train_losses(base, Path(tmp) / "fsdp", "data.batch_size=2", "distributed.strategy=fsdp", procs=2)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            table.add("fsdp: 2 processes == 1", config, f"run failed: {str(error)[-300:]!r}", "runs", False)
            return
    diff = max(abs(a - b) / abs(a) for a, b in zip(one, two, strict=True)) if len(one) == len(two) else float("inf")
    table.add("fsdp: 2 processes == 1", config, f"max rel diff {diff:.1e}; losses {', '.join(f'{x:.4f}' for x in two)}",
              f"<= {FSDP_TOL:.0e}", diff <= FSDP_TOL)


def check_sequence_parallel(table: Table, device: Any, quick: bool = False) -> None:
    """2 ranks sharing each sample (SP = 2) against one process, padded and packed rows."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    backend = "NCCL" if device.type == "cuda" else "gloo"
    for rows, packing in (("padded", ()), ("packed", ("data.packing=true", "data.max_tokens=192"))):
        config = (f"tiny qwen3_5_vit+qwen_merger+qwen3_5, SP 2 over {backend} ({rows} rows), 2 procs sharing each "
                  "batch of 4 vs 1 proc x batch 4")
        if device.type == "cuda" and gpus < 2:
            table.add("sp: 2 ranks sharing each sample == 1", config, f"skipped: {gpus} GPU",
                      f"losses within {FSDP_TOL:.0e} rel", None)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            base = fsdp_dataset(Path(tmp))
            try:
                one = train_losses(base, Path(tmp) / "one", "data.batch_size=4", *packing, here=quick)
                two = train_losses(base, Path(tmp) / "sp", "data.batch_size=4", "distributed.sequence_parallel=2",
                                   *packing, procs=2)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                table.add("sp: 2 ranks sharing each sample == 1", config, f"run failed: {str(error)[-300:]!r}", "runs",
                          False)
                continue
        diff = (max(abs(a - b) / abs(a) for a, b in zip(one, two, strict=True)) if len(one) == len(two)
                else float("inf"))
        table.add("sp: 2 ranks sharing each sample == 1", config,
                  f"max rel diff {diff:.1e}; losses {', '.join(f'{x:.4f}' for x in two)}", f"<= {FSDP_TOL:.0e}",
                  diff <= FSDP_TOL)


# ---- 5. speed at real sizes: the Trainer's records next to the plan -----------------------------------------------
def run_config(preset: str, packing: bool, checkpointing: bool, quick: bool, out: str) -> Any:
    from mmadapt.train.config import RunConfig

    data = {"max_length": 128, "batch_size": 2} if quick else {"max_length": 2048, "batch_size": 4}
    data.update(packing=packing, max_tokens=2 * data["max_length"])
    model = {"encoder": {"name": "qwen3_5_vit", "preset": preset}, "projector": "qwen_merger",
             "backbone": {"name": "qwen3_5", "preset": preset}, "preset": None}
    train = {"steps": 3 if quick else 4, "progress": False, "out": out, "log_every": 1,
             "activation_checkpointing": "all" if checkpointing else []}
    return RunConfig.from_dict({"model": model, "data": data, "train": train,
                                "precision": {"policy": "bf16-autocast"}})


def measure_speed(config: Any, base: Any, device: Any) -> tuple[dict[str, float], Any]:
    """Medians over steps 2.. of the Trainer's records for a copy of `base`, and the plan's prediction."""
    from mmadapt.data import Collator
    from mmadapt.synthetic import synthetic_samples
    from mmadapt.train.plan import predict

    plan = predict(config, gpus=1, device=device.type)
    work, d = plan.workload, config.data
    model = copy.deepcopy(base)  # the Trainer freezes parts and wraps layers for checkpointing: a fresh copy each
    side = [work.image_side] * d.batch_size if work.image_side else None
    text = d.max_length - work.visual_per_image - 4  # 2 tokens before the image, its start and end tokens
    samples = synthetic_samples(model, [1] * d.batch_size, image_sides=side, text_lengths=[text] * d.batch_size)
    collate = Collator.for_model(model, 0, max_tokens=d.max_tokens if d.packing else None)
    history = QuietTrainer(model, config, samples * config.train.steps, collate).fit()["history"][1:]
    median = {k: statistics.median(r[k] for r in history) for k in ("tokens_per_s", "peak_memory_mib")}
    if all("mfu" in r for r in history):
        median["mfu"] = statistics.median(r["mfu"] for r in history)
    median["step_s"] = statistics.median(r["time"]["step"] for r in history)
    return median, plan


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class QuietTrainer(Trainer):
    """The timed runs write no checkpoint and no model directory (a 2B checkpoint outlasts its steps)."""

    def save(self, **kwargs: Any) -> None:
        return None

    def export_model(self, checkpoint: Path | None) -> None:
        return None


def check_speed(table: Table, device: Any, quick: bool) -> None:
    from mmadapt.train.run import build_model_from

    presets = {"tiny": "tiny"} if quick else {"Qwen3.5-0.8B full depth": "qwen3.5-0.8b",
                                              "Qwen3.5-2B full depth": "qwen3.5-2b"}
    for label, preset in presets.items():
        torch.manual_seed(0)
        base = build_model_from(run_config(preset, False, False, quick, "unused"))  # once: a 2B init takes a while
        for packing in (False, True):
            for checkpointing in (False, True):
                with tempfile.TemporaryDirectory() as out:
                    config = run_config(preset, packing, checkpointing, quick, out)
                    speed_row(table, device, label, config, base)
                free_memory()
        del base
        free_memory()


def speed_row(table: Table, device: Any, label: str, config: Any, base: Any) -> None:
    packing, checkpointing = config.data.packing, bool(config.train.activation_checkpointing)
    try:
        measured, plan = measure_speed(config, base, device)
    except Exception as error:  # a failed configuration (out of memory) is a row, not the end of the check
        table.add("speed", f"{label}, packing {packing}, checkpointing {checkpointing}",
                  f"failed: {type(error).__name__}: {str(error)[:200]}", "runs", False)
        return
    predicted = plan.per_gpu["total"] / 2**20
    error = measured["peak_memory_mib"] / predicted - 1
    mfu = f"{100 * measured['mfu']:.1f}%" if "mfu" in measured else "n/a"
    config_text = (f"{label}, bf16 autocast, {plan.workload.describe()}, "
                   f"packing {'on' if packing else 'off'}, checkpointing {'all' if checkpointing else 'none'}")
    result = (f"{measured['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, step {measured['step_s']:.2f} s, "
              f"peak {measured['peak_memory_mib']:,.0f} MiB vs plan {predicted:,.0f} MiB ({100 * error:+.0f}%)")
    judged = device.type == "cuda"
    table.add("speed", config_text, result, f"peak within +-{100 * PLAN_TOL:.0f}% of plan" if judged else
              "reported (CPU: RSS, not judged)", abs(error) <= PLAN_TOL if judged else None)


# ---- main ----------------------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny configs (the speed section too)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    args = parser.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.only) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cpu":  # the Trainer takes CUDA when it sees it: hide it
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu --quick for the CPU smoke run", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    table, started = Table(), time.perf_counter()
    if "steps" in args.only:
        check_steps(table, device)
    if "packing" in args.only:
        check_packing(table, device)
    if "fsdp" in args.only:
        check_fsdp(table, device, args.quick)
    if "sp" in args.only:
        check_sequence_parallel(table, device, args.quick)
    if "speed" in args.only:
        check_speed(table, device, args.quick)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"machine: {name}; torch {torch.__version__}; {time.perf_counter() - started:.0f} s\n")
    print(table.markdown())
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
