"""`mmadapt plan`'s prediction against the measured peak of a real training step, at real widths.

    python benchmarks/bench_plan.py [--quick] [--only NAME ...]
    python benchmarks/bench_plan.py --long [--quick]    # long samples through `mmadapt train` (issue 33)

For each config (real widths and vocabularies, depth cut as the table says), in its own process: the idle process's
RSS (after one step of a tiny model of the same families, so that libraries and kernels are loaded), then the model
built on the CPU with random weights, the run's stages, precision and activation checkpointing, AdamW over the
parameter groups the trainer makes, and two training steps on the plan's longest micro-batch (one image per sample
at the size the plan chose), gradients set to None before each as the trainer does. Measured: `VmHWM` (high-water
mark reset after the model is built, through `/proc/self/clear_refs`) minus the idle RSS. Predicted: `mmadapt plan
--gpus 1 --device cpu` on the same config (its probe runs in the parent). Target (issue 20): within +-15%. Each
config is measured twice: with glibc's default malloc settings and with a fixed mmap threshold (`MMAP` below), which
tells the allocator's retention apart from the plan's error.
`--long`: long samples on attention-heavy backbones, measured as a user would: `mmadapt train` on real files (the
vendored Mistral / Qwen3 tokenizers, PNG images, LLaVA-format records filling 88-95% of `max_length`, so rows are
padded) in a fresh process, VmHWM when the trainer first saves (after its first step) above the RSS of the same
process after importing the libraries; the plan is `mmadapt plan --gpus 1 --device cpu` on the same run.yaml.
`--examples`: every examples/*.yaml planned on the GPUs its header's `mmadapt plan` line names (8 x 80 GiB, or
1 x 24 GiB for the QLoRA recipe; real widths, bf16 autocast, no checkpoint read), its table checked against
docs/training.md's (each total within 5%, else exit 1). The probes at real widths take a few minutes each, which is
why this is a benchmark and not a test.
`--quick` runs tiny configs (smoke run for the test suite; its numbers mean nothing); with `--examples`, each
example's parts at their `tiny` presets: the same parsing, stages, precision and planning from presets, no docs check.
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

MIB = 1024**2
GIB = 1024**3
# glibc's default raises its mmap threshold up to 32 MiB as large blocks are freed, after which freed activations of
# a few MiB stay in the heap (RSS) instead of going back to the OS; a fixed threshold returns every freed tensor of
# 1 MiB or more, so that RSS follows the live tensors (jemalloc / tcmalloc, which PyTorch's CPU guides recommend,
# behave alike)
MMAP = "MALLOC_MMAP_THRESHOLD_=1048576"
QWEN_08B = {"encoder": {"name": "qwen3_5_vit", "preset": "qwen3.5-0.8b", "options": {"depth": 2}},
            "projector": "qwen_merger",
            "backbone": {"name": "qwen3_5", "preset": "qwen3.5-0.8b", "options": {"num_hidden_layers": 4}}}
LLAVA = {"encoder": {"name": "clip", "preset": "vit-l-14-336", "options": {"num_hidden_layers": 2}},
         "projector": "mlp2x_gelu",
         "backbone": {"name": "llama", "preset": "vicuna-7b", "options": {"num_hidden_layers": 1}}}
QWEN3_VL = {"encoder": {"name": "qwen3_vl_vit", "preset": "qwen3-vl-2b",
                        "options": {"depth": 3, "deepstack_visual_indexes": [0, 1, 2]}},
            "projector": "qwen_merger",
            "backbone": {"name": "qwen3_vl", "preset": "qwen3-vl-2b", "options": {"num_hidden_layers": 3}}}
QWEN3_VL_MOE = {"encoder": {"name": "qwen3_vl_vit", "preset": "qwen3-vl-30b-a3b",
                            "options": {"depth": 1, "deepstack_visual_indexes": [0]}},
                "projector": "qwen_merger",
                "backbone": {"name": "qwen3_vl_moe", "preset": "qwen3-vl-30b-a3b", "options": {"num_hidden_layers": 1}}}
DATA = {"max_length": 1024, "batch_size": 1}
CONFIGS = {
    "Qwen3.5-0.8B full": dict(model=QWEN_08B, data=DATA, depth="ViT 2/12, LLM 4/24"),
    "Qwen3.5-0.8B LoRA": dict(model=QWEN_08B, data=DATA, stages={"backbone": "lora"}, depth="ViT 2/12, LLM 4/24"),
    "Qwen3.5-0.8B checkpointing": dict(model={**QWEN_08B, "backbone": {**QWEN_08B["backbone"],
                                                                        "options": {"num_hidden_layers": 8}}},
                                       data={"max_length": 2048, "batch_size": 1},
                                       train={"activation_checkpointing": "all"}, depth="ViT 2/12, LLM 8/24"),
    "Qwen3.5-0.8B packed": dict(model=QWEN_08B, data={"max_length": 512, "batch_size": 4, "packing": True,
                                                     "max_tokens": 1024}, depth="ViT 2/12, LLM 4/24"),
    "LLaVA-1.5-7B stage 1": dict(model=LLAVA, data={"max_length": 1024, "batch_size": 2},
                                 stages={"backbone": "frozen"}, depth="ViT 2/24, LLM 1/32"),
    "Qwen3-VL-2B DeepStack": dict(model=QWEN3_VL, data=DATA, depth="ViT 3/24, LLM 3/28"),
    "Qwen3-VL-30B-A3B MoE, LoRA": dict(model=QWEN3_VL_MOE, data={"max_length": 512, "batch_size": 1},
                                       stages={"backbone": "lora"}, depth="ViT 1/27, LLM 1/48"),
}
# issue 33: long samples on attention-heavy backbones, measured through `mmadapt train` on real files (a real
# tokenizer, PNG images, LLaVA-format records of unequal lengths, so rows are padded): VmHWM when the trainer first
# saves (after one step), above an idle process that imported the same libraries
LLAMA_2048 = {"encoder": {"name": "clip", "preset": "tiny"}, "projector": "mlp2x_gelu",
              "backbone": {"name": "llama", "preset": "vicuna-7b", "options": {
                  "num_hidden_layers": 3, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "intermediate_size": 5504, "vocab_size": 32064}}}
LLAMA_7B = {"encoder": {"name": "clip", "preset": "tiny"}, "projector": "mlp2x_gelu",
            "backbone": {"name": "llama", "preset": "vicuna-7b", "options": {"num_hidden_layers": 1}}}
QWEN3_VL_8B = {"encoder": {"name": "qwen3_vl_vit", "preset": "qwen3-vl-8b",
                           "options": {"depth": 2, "deepstack_visual_indexes": [0, 1]}},
               "projector": "qwen_merger",
               "backbone": {"name": "qwen3_vl", "preset": "qwen3-vl-8b", "options": {"num_hidden_layers": 2}}}
LONG = {
    "LLaMA-width LoRA, checkpointing, 4 x 1024 (issue 33)": dict(
        model=LLAMA_2048, tokenizer="llama2", template="vicuna_v1", image=64,
        data={"max_length": 1024, "batch_size": 4}, stages={"preset": "lora"},
        train={"activation_checkpointing": ["backbone"]}, depth="LLM 3 layers of width 2048"),
    "LLaMA-7B-width full, 2 x 2048": dict(
        model=LLAMA_7B, tokenizer="llama2", template="vicuna_v1", image=64,
        data={"max_length": 2048, "batch_size": 2}, stages={"encoder": "frozen", "projector": "full",
                                                            "backbone": "full"}, depth="LLM 1/32"),
    "Qwen3-VL-8B-width LoRA, 1 x 2048": dict(
        model=QWEN3_VL_8B, tokenizer="qwen3", template="auto", image=896,
        data={"max_length": 2048, "batch_size": 1}, stages={"encoder": "frozen", "projector": "full",
                                                            "backbone": "lora"}, depth="ViT 2/27, LLM 2/36"),
}
QUICK = {"encoder": {"name": "qwen3_5_vit", "preset": "tiny"}, "projector": "qwen_merger",
         "backbone": {"name": "qwen3_5", "preset": "tiny"}}


def run_config(spec: dict, quick: bool):
    from mmadapt.train.config import RunConfig

    data = {"max_length": 128, "batch_size": 2} if quick else spec["data"]
    stages = {"encoder": "frozen", "projector": "full", "backbone": "full", **spec.get("stages", {})}
    return RunConfig.from_dict({"model": QUICK if quick else spec["model"], "data": data,
                                "stages": stages, "train": spec.get("train", {}),
                                **{k: spec[k] for k in ("precision", "quantization") if k in spec}})


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(spec: dict, quick: bool, side: int | None, queue) -> None:
    """In a fresh process: the peak of two training steps above the idle process (MiB)."""
    queue.put(stepped(spec, quick, side)[1])


def stepped(spec: dict, quick: bool, side: int | None) -> tuple:
    """(the model, the peak of two training steps above the idle process in MiB, the file-backed pages the build left
    resident in MiB: weights read from a memory-mapped checkpoint and not copied), in this (fresh) process."""
    from mmadapt.synthetic import synthetic_batch
    from mmadapt.train.optim import enable_activation_checkpointing, parameter_groups
    from mmadapt.train.run import build_model_from
    from mmadapt.train.stages import apply_stages
    from mmadapt.train.trainer import upcast_trainable

    config = run_config(spec, quick)
    warm_up(config)
    idle = _status_kib("VmRSS")
    torch.manual_seed(0)
    idle_files = _status_kib("RssFile")
    model = build_model_from(config)
    apply_stages(model, config.stages, config.lora, config.quantization)
    upcast_trainable(model)
    built_files = _status_kib("RssFile") - idle_files
    if config.train.activation_checkpointing:
        enable_activation_checkpointing(model, config.train.activation_checkpointing)
    model.train()
    optimizer = torch.optim.AdamW(parameter_groups(model, model, lr=1e-5, weight_decay=0.0, lr_by_part={}), lr=1e-5)
    d = config.data
    text = d.max_length - queue_visual(model, side) - 2
    texts = [text - spec.get("spread", 0) * b for b in range(d.batch_size)]  # spread: rows of unequal lengths
    batch = synthetic_batch(model, [1] * d.batch_size, image_sides=None if side is None else [side] * d.batch_size,
                            text_lengths=texts)
    if d.packing:
        from mmadapt.data import Collator
        from mmadapt.synthetic import synthetic_samples

        sides = None if side is None else [side] * d.batch_size
        samples = synthetic_samples(model, [1] * d.batch_size, image_sides=sides, text_lengths=[text] * d.batch_size)
        batch = Collator.for_model(model, 0, max_tokens=d.max_tokens)(samples)
    Path("/proc/self/clear_refs").write_text("5")
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        with config.precision.mode.autocast("cpu"):
            loss = model(**batch).loss
        loss.backward()
        del loss
        optimizer.step()
    return model, (_status_kib("VmHWM") - idle) / 1024, built_files / 1024


def warm_up(config) -> None:
    """One step of the same families at tiny size: libraries, kernels and thread pools load here, before the idle
    RSS is read (on a GPU their counterpart, the CUDA context, is in the plan's margin, not its total)."""
    import gc

    from mmadapt import VisionLanguageModel
    from mmadapt.config import ComponentConfig
    from mmadapt.synthetic import synthetic_batch

    parts = config.model.model_config()
    tiny = {p: ComponentConfig(name=getattr(parts, p).name, preset=None if p == "projector" else "tiny")
            for p in ("encoder", "projector", "backbone")}
    model = VisionLanguageModel.from_names(tiny["encoder"], tiny["projector"], tiny["backbone"])
    model(**synthetic_batch(model, [1])).loss.backward()
    del model
    gc.collect()


def queue_visual(model, side: int | None) -> int:
    from mmadapt.data.processors import processor_for

    processor = processor_for(model)
    return processor.tokens_for_size(side or 0, side or 0)


def write_run(spec: dict, root: Path, quick: bool) -> Path:
    """A run directory: the vendored tokenizer, 16 PNG images, LLaVA-format records whose answers fill the sample to
    between 92% and 99% of `max_length` (so rows are padded), and run.yaml."""
    import json
    import random
    import shutil

    import numpy as np
    import yaml
    from PIL import Image

    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from real_tokenizers import unpacked

    shutil.copytree(unpacked(spec["tokenizer"]), root / "tokenizer", dirs_exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    data = {"max_length": 320, "batch_size": 2} if quick else spec["data"]
    (root / "images").mkdir(parents=True, exist_ok=True)
    words = "the a cat dog image shows red blue green house tree car road sky person table chair window".split()
    rng, records = random.Random(0), []
    for i in range(16):
        side = 64 if quick else spec["image"]
        pixels = (np.random.RandomState(i).rand(side, side, 3) * 255).astype("uint8")
        Image.fromarray(pixels).save(root / "images" / f"{i}.png")
        budget = int(data["max_length"] * rng.uniform(0.92, 0.99)) - (0 if quick else _visual(spec))
        answer = []
        while len(tokenizer(" ".join(answer)).input_ids) < budget - 80:  # the template, the question
            answer += [rng.choice(words) for _ in range(32)]
        records.append({"id": f"s{i}", "image": f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nDescribe the picture in detail."},
            {"from": "gpt", "value": " ".join(answer)}]})
    (root / "train.json").write_text(json.dumps(records))
    stages = spec["stages"]
    tiny = {"encoder": "clip", "projector": "mlp2x_gelu", "backbone": "llama", "preset": "tiny"}
    config = {"model": tiny if quick else spec["model"],
              "data": {"train": str(root / "train.json"), "image_root": str(root / "images"),
                       "tokenizer": str(root / "tokenizer"), "chat_template": spec["template"],
                       **data},
              "stages": stages, "train": {"steps": 1, "out": str(root / "out"), **spec.get("train", {})}}
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _visual(spec: dict) -> int:
    """The visual tokens of the spec's image (its side is a multiple of patch x merge for the Qwen encoders)."""
    if spec["model"]["encoder"]["name"].startswith("qwen"):
        return (spec["image"] // 32) ** 2
    return 16


TRAIN_MEASURE = """
import os, sys
from pathlib import Path
def kib(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1])
import torch, transformers, peft, mmadapt.cli, mmadapt.train.trainer as trainer
idle = kib("VmRSS")
def save(self, **kwargs):
    print("MEASURED", (kib("VmHWM") - idle) / 1024, flush=True)
    os._exit(0)
trainer.Trainer.save = save
sys.exit(mmadapt.cli.main(["train", sys.argv[1]]))
"""


def measure_train(path: Path) -> float:
    """`mmadapt train path` in a fresh process: VmHWM when the trainer first saves, above its idle RSS (MiB)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", TRAIN_MEASURE, str(path)], capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("MEASURED")]
    if not lines:
        raise RuntimeError(f"mmadapt train {path} did not reach its first save:\n{out.stderr[-3000:]}")
    return float(lines[-1].split()[1])


def long_table(quick: bool, only: list[str] | None) -> None:
    import tempfile

    from mmadapt.train.config import RunConfig
    from mmadapt.train.plan import predict

    print("| config (long samples, `mmadapt train`) | depth (of real) | micro-batch | attention (as planned) | "
          "predicted MiB | VmHWM MiB | error |")
    print("|---|---|---|---|---:|---:|---:|")
    names = [n for n in LONG if only is None or n in only][: 1 if quick else None]
    for name in names:
        spec = LONG[name]
        with tempfile.TemporaryDirectory() as root:
            path = write_run(spec, Path(root), quick)
            plan = predict(RunConfig.load(str(path)), gpus=1, device="cpu")
            predicted = plan.per_gpu["total"] / MIB
            measured = measure_train(path)
        attention = plan.attention["backbone"].rsplit("; ", 1)[1]
        print(f"| {name} | {'tiny' if quick else spec['depth']} | {plan.workload.describe()} | {attention} | "
              f"{predicted:,.0f} | {measured:,.0f} | {100 * (predicted / measured - 1):+.1f}% |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--long", action="store_true", help="the long-sample configs through `mmadapt train` "
                        "(issue 33) instead")
    parser.add_argument("--examples", action="store_true", help="plan every examples/*.yaml on the GPUs its header "
                        "names and check the table in docs/training.md instead")
    args = parser.parse_args()
    from mmadapt.train.plan import predict

    if args.examples:
        return examples_table(args.quick)
    if args.long:
        return long_table(args.quick, args.only)

    names = [n for n in CONFIGS if args.only is None or n in args.only][: 1 if args.quick else None]
    print(f"# `mmadapt plan` vs a real training step, fp32, CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads), torch {torch.__version__}")
    print("| config | depth (of real) | micro-batch | predicted MiB | VmHWM MiB, glibc defaults | error | "
          f"VmHWM MiB, {MMAP} | error |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name in names:
        spec = CONFIGS[name]
        plan = predict(run_config(spec, args.quick), gpus=1, device="cpu")
        predicted = plan.per_gpu["total"] / MIB
        row = f"| {name} | {'tiny' if args.quick else spec['depth']} | {plan.workload.describe()} | {predicted:,.0f} "
        for env in ({}, dict([MMAP.split("=")])):
            measured = in_child(spec, args.quick, plan.workload.image_side, env)
            row += f"| {measured:,.0f} | {100 * (predicted / measured - 1):+.1f}% "
        print(row + "|", flush=True)


EXAMPLES = Path(__file__).parent.parent / "examples"
TRAINING_DOCS = Path(__file__).parent.parent / "docs" / "training.md"


def tiny_example(config):
    """The example with each part at its `tiny` preset and no options (its pretrained paths, stages, precision, data
    and sharding kept; a QLoRA base's NF4 blocks small enough for the tiny layers): the quick form's config."""
    from mmadapt.train.config import RunConfig

    spec = config.to_dict()
    for part in ("encoder", "projector", "backbone"):
        value = spec["model"][part]
        named = {"name": value} if isinstance(value, str) else {k: v for k, v in value.items() if k != "options"}
        spec["model"][part] = {**named, "preset": "tiny"} if "preset" in named else named
    if spec["stages"].get("preset") == "qlora" or spec["stages"].get("backbone") == "qlora":
        spec["quantization"]["scaler_block_size"] = 2  # NF4 blocks of 64 x 2 weights: the tiny layers quantise
    return RunConfig.from_dict(spec)


def documented_total(name: str) -> float:
    """docs/training.md's total GiB per GPU for examples/NAME."""
    row = next((line for line in TRAINING_DOCS.read_text().splitlines() if line.startswith(f"| `examples/{name}`")),
               None)
    if row is None:
        raise SystemExit(f"docs/training.md has no row for examples/{name}: add the row this benchmark prints")
    return float(row.split("|")[-3].replace(",", "").split()[0])


def planned_on(path: Path) -> tuple[int, str]:
    """(GPUs, memory of one) of the `mmadapt plan examples/NAME --gpus N --gpu-memory SIZE` line in an example's
    header: the command it documents is the one planned here."""
    for line in path.read_text().splitlines():
        words = line.lstrip("# ").split()
        if words[:3] == ["mmadapt", "plan", f"examples/{path.name}"] and "--gpus" in words and "--gpu-memory" in words:
            return int(words[words.index("--gpus") + 1]), words[words.index("--gpu-memory") + 1]
    raise SystemExit(f"examples/{path.name}: its header has no line '#   mmadapt plan examples/{path.name} --gpus N "
                     "--gpu-memory SIZE' saying what it is planned on")


def example_problems(path: Path, plan, quick: bool) -> list[str]:
    """What is wrong with an example's plan: it must fit on the GPUs its header names (several: with FSDP2), plan
    every absent checkpoint from its part's preset or options (its absent data: no host plan), and (real widths)
    total what docs/training.md says, within 5%."""
    from mmadapt.train.plan import gib

    problems = [] if plan.fits else [f"does not fit {gib(plan.gpu_memory)}"]
    wanted = "fsdp2" if plan.gpus > 1 else "single"
    problems += [] if plan.strategy == wanted else [f"strategy {plan.strategy}, not {wanted}"]
    problems += [f"note {note!r}" for note in plan.notes
                 if not (note.endswith("is not here: planned from preset " + note.rsplit("preset ", 1)[-1])
                         or "planned from its options" in note
                         or note.endswith("is not here: data loading not planned")  # placeholder data paths
                         or note.startswith("sequence parallelism: "))]  # what the plan assumed, not a problem
    if not quick:
        total, documented = plan.per_gpu["total"] / GIB, documented_total(path.name)
        if abs(total / documented - 1) > 0.05:
            problems.append(f"{total:.1f} GiB per GPU, docs/training.md says {documented:.1f}: update its table")
    return problems



def examples_table(quick: bool) -> None:
    """Plan every example on the GPUs its header names and print docs/training.md's table; exit 1 when a plan is not
    as documented."""
    from mmadapt.train.config import RunConfig
    from mmadapt.train.plan import parse_size, predict

    print("| example | stages | micro-batch per GPU | parameters | gradients + AdamW | activations "
          "(checkpointing) | total GiB per GPU | planned on: fits |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    failed = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        config = RunConfig.load(str(path))
        config = tiny_example(config) if quick else config
        gpus, memory = planned_on(path)
        plan = predict(config, gpus=gpus, gpu_memory=parse_size(memory))
        g = plan.per_gpu
        stages = ", ".join(f"{part} {mode}" for part, mode in config.stages.modes().items())
        print(f"| `examples/{path.name}` | {stages} | {plan.workload.describe()} | {g['parameters'] / GIB:.1f} | "
              f"{(g['gradients'] + g['optimizer']) / GIB:.1f} | {g['activations'] / GIB:.1f} "
              f"({'+'.join(plan.checkpointing) or 'off'}) | {g['total'] / GIB:.1f} | {gpus} x {memory}: "
              f"{'yes' if plan.fits else 'no'} ({(g['total'] + plan.margin) / GIB:.1f} with the margin) |", flush=True)
        failed += [f"examples/{path.name}: {problem}" for problem in example_problems(path, plan, quick)]
    if failed:
        raise SystemExit("\n".join(failed))
    print("# every example fits the GPUs its header names (several: with FSDP2)"
          f"{'' if quick else ', as docs/training.md says (5%)'}")


def in_child(spec: dict, quick: bool, side: int | None, env: dict[str, str], target=None) -> Any:
    """`target` (default `measure`) in a fresh process started with `env` added (glibc reads its malloc settings at
    start): what it puts in its queue."""
    import os

    ctx = multiprocessing.get_context("spawn")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        queue = ctx.Queue()
        process = ctx.Process(target=target or measure, args=(spec, quick, side, queue))
        process.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    measured = queue.get()
    process.join()
    return measured

if __name__ == "__main__":
    main()
