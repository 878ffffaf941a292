"""QLoRA against LoRA at real widths, reduced depth: the measured peak of a training step, `mmadapt plan`'s
prediction for both, and the NF4 storage per quantised parameter, measured.

    python benchmarks/bench_qlora.py [--quick] [--only NAME ...]

For each model (real widths and vocabularies, depth cut as the table says): a random model saved in bf16 as a
checkpoint (QLoRA quantises a backbone read from one: `stages.backbone: qlora` loads its large linear layers
straight to NF4), then for `lora` and `qlora` (encoder frozen, projector full, bf16 autocast, 2 x 1,024 tokens with
one image each), in a fresh process with a fixed mmap threshold (`bench_plan.MMAP`: RSS follows the live tensors):
the model read from that checkpoint with the run's stages, AdamW, two training steps; measured `VmHWM` above the idle
process (`bench_plan.stepped`), predicted `mmadapt plan --gpus 1 --device cpu` (its probe runs here, with the NF4
layers: their dequantised weights in each forward and backward are measured, not assumed). NF4 storage: the bytes
of every NF4 weight's storages (4-bit codes, int8 block scales, the scales' scales, its mean and 16-entry table)
over its weights, and that over bf16's 2 bytes. Target (issue 58): each prediction within 15%.
`--quick` runs the tiny presets with NF4 blocks of 64 x 2 weights (smoke run for the test suite; its numbers mean
nothing).
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_plan import MIB, MMAP, in_child, run_config, stepped

QWEN_4B = {"encoder": {"name": "qwen3_5_vit", "preset": "qwen3.5-4b", "options": {"depth": 1}},
           "projector": "qwen_merger",
           "backbone": {"name": "qwen3_5", "preset": "qwen3.5-4b", "options": {"num_hidden_layers": 4}}}
LLAVA_7B = {"encoder": {"name": "clip", "preset": "vit-l-14-336", "options": {"num_hidden_layers": 1}},
            "projector": "mlp2x_gelu",
            "backbone": {"name": "llama", "preset": "vicuna-7b", "options": {"num_hidden_layers": 2}}}
MODELS = {
    "Qwen3.5-4B": dict(model=QWEN_4B, depth="ViT 1/24, LLM 4/32 (3 Gated DeltaNet + 1 attention)"),
    "LLaVA-1.5-7B (Vicuna-7B)": dict(model=LLAVA_7B, depth="ViT 1/24, LLM 2/32"),
}
QUICK = {"encoder": {"name": "qwen3_5_vit", "preset": "tiny"}, "projector": "qwen_merger",
         "backbone": {"name": "qwen3_5", "preset": "tiny"}}
DATA = {"max_length": 1024, "batch_size": 2}


def save_checkpoint(parts: dict, path: Path) -> None:
    """A random model of `parts` saved in bf16 at `path` (run in a child: the parent stays small)."""
    from mmadapt.data.tokenizer import char_tokenizer
    from mmadapt.model import VisionLanguageModel
    from mmadapt.train.config import ModelSection

    torch.manual_seed(0)
    model = VisionLanguageModel(ModelSection(**parts).model_config()).to(torch.bfloat16)
    model.save_pretrained(path, tokenizer=char_tokenizer())


def _save_child(spec: dict, quick: bool, side: Any, queue) -> None:
    save_checkpoint(spec["parts"], Path(spec["path"]))
    queue.put(None)


def measured_with_nf4(spec: dict, quick: bool, side: int | None, queue) -> None:
    """In a fresh process: (the peak of two training steps above the idle process in MiB, the checkpoint's pages the
    build left resident in MiB, NF4 weights, their bytes)."""
    from mmadapt.quantize import is_nf4

    model, peak, mapped = stepped(spec, quick, side)
    weights, storages = 0, {}
    for p in model.parameters():
        if is_nf4(p):
            weights += p.numel()
            names, _ = p.__tensor_flatten__()
            storages.update({getattr(p, n).untyped_storage().data_ptr(): getattr(p, n).untyped_storage().nbytes()
                             for n in names})
    queue.put((peak, mapped, weights, sum(storages.values())))


def spec_for(path: Path, parts: dict, mode: str, quick: bool) -> dict:
    """The run: each part read from the saved checkpoint (the vision tower and the LLM in bf16)."""
    model = {p: {"name": parts[p] if isinstance(parts[p], str) else parts[p]["name"], "pretrained": str(path),
                 **({"dtype": "bfloat16"} if p != "projector" else {})} for p in ("encoder", "projector", "backbone")}
    return dict(model=model, data={"max_length": 128, "batch_size": 2} if quick else DATA,
                stages={"encoder": "frozen", "projector": "full", "backbone": mode},
                precision={"policy": "bf16-autocast"}, quantization={"scaler_block_size": 2} if quick else {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    from mmadapt.train.plan import predict

    names = ["tiny"] if args.quick else [n for n in MODELS if args.only is None or n in args.only]
    env = dict([MMAP.split("=")])
    print(f"# QLoRA vs LoRA, bf16 base, bf16 autocast, CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads), torch {torch.__version__}, {MMAP}")
    print("| model | depth (of real) | backbone | micro-batch | weights in NF4 | NF4 bytes per weight (of bf16's 2) | "
          "predicted MiB | VmHWM MiB | error | source pages mapped MiB | VmHWM less those | error |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        parts, depth = (QUICK, "tiny") if args.quick else (MODELS[name]["model"], MODELS[name]["depth"])
        with tempfile.TemporaryDirectory() as root:
            path = Path(root) / "model"
            in_child({"parts": parts, "path": str(path)}, args.quick, None, {}, target=_save_child)
            for mode in ("lora", "qlora"):
                spec = spec_for(path, parts, mode, args.quick)
                plan = predict(run_config(spec, False), gpus=1, device="cpu")
                peak, mapped, weights, stored = in_child(spec, False, plan.workload.image_side, env,
                                                         target=measured_with_nf4)
                predicted = plan.per_gpu["total"] / MIB
                per_weight = f"{stored / weights:.4f} ({stored / weights / 2:.1%})" if weights else "-"
                print(f"| {name} | {depth} | {mode} | {plan.workload.describe()} | {weights:,} | {per_weight} | "
                      f"{predicted:,.0f} | {peak:,.0f} | {100 * (predicted / peak - 1):+.1f}% | {mapped:,.0f} | "
                      f"{peak - mapped:,.0f} | {100 * (predicted / (peak - mapped) - 1):+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
