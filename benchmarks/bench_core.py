"""Core benchmarks: image-token injection and one training step, mmadapt vs transformers, same run.

    python benchmarks/bench_core.py [--reps 5] [--quick]

Prints markdown tables. Ratios < 1 mean mmadapt is faster. Targets (issue 2): injection no
slower than a plain bool `index_put`; a training step <= 1.0x transformers' Qwen3_5ForConditionalGeneration.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import torch

from mmadapt import VisionLanguageModel, contract
from mmadapt.processor import export_processor
from mmadapt.synthetic import synthetic_batch


# ---- injection ------------------------------------------------------------------------------
def injection_inputs(batch: int, length: int, width: int, image_tokens: int, image_id: int = 7):
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(8, 1000, (batch, length), generator=g)
    input_ids[:, 5 : 5 + image_tokens] = image_id
    embeds = torch.randn(batch, length, width, generator=g, requires_grad=True)
    features = torch.randn(batch * image_tokens, width, generator=g, requires_grad=True)
    return input_ids, embeds, features, image_id


def inject_mmadapt(input_ids, embeds, features, image_id):
    spans = contract.locate(input_ids, image_id)
    return contract.scatter(embeds, spans, features)


def inject_index_put(input_ids, embeds, features, image_id):
    return embeds.index_put((input_ids == image_id,), features)


def inject_masked_scatter(input_ids, embeds, features, image_id):
    mask = (input_ids == image_id).unsqueeze(-1).expand_as(embeds)
    return embeds.masked_scatter(mask, features)


def inject_llava_loop(input_ids, embeds, features, image_id):
    """LLaVA's `prepare_inputs_labels_for_multimodal` pattern: split text around each image, concat, stack."""
    rows, used = [], 0
    for b in range(input_ids.shape[0]):
        positions = (input_ids[b] == image_id).nonzero().flatten().tolist()
        start, end = positions[0], positions[-1] + 1
        n = end - start
        rows.append(torch.cat([embeds[b, :start], features[used : used + n], embeds[b, end:]]))
        used += n
    return torch.stack(rows)


def bench_injection(reps: int, shape: tuple[int, int, int, int]) -> list[tuple[str, float]]:
    inputs = injection_inputs(*shape)
    grad = torch.randn(shape[0], shape[1], shape[2])
    methods = [("bool index_put (baseline)", inject_index_put), ("mmadapt locate+scatter", inject_mmadapt),
               ("masked_scatter (transformers)", inject_masked_scatter), ("LLaVA per-sample loop", inject_llava_loop)]

    def step(fn):
        return lambda: fn(*inputs).backward(grad)

    return list(zip([name for name, _ in methods], alternating([step(fn) for _, fn in methods], reps), strict=True))


# ---- training step ----------------------------------------------------------------------------
FAMILIES = {
    "Qwen3.5-shaped": (("qwen3_5_vit", "qwen_merger", "qwen3_5"), "Qwen3_5ForConditionalGeneration"),
    "LLaVA-1.5-shaped": (("clip", "mlp2x_gelu", "llama"), "LlavaForConditionalGeneration"),
    "Qwen3.5-MoE-shaped": (("qwen3_5_vit", "qwen_merger", "qwen3_5_moe"), "Qwen3_5MoeForConditionalGeneration"),
    "Qwen3-VL-shaped": (("qwen3_vl_vit", "qwen_merger", "qwen3_vl"), "Qwen3VLForConditionalGeneration"),
    "Qwen3-VL-MoE-shaped": (("qwen3_vl_vit", "qwen_merger", "qwen3_vl_moe"), "Qwen3VLMoeForConditionalGeneration"),
}


def pair(family: str) -> tuple[VisionLanguageModel, torch.nn.Module, dict, dict]:
    """mmadapt's tiny model, transformers' model with the same weights, and the same 8-sample batch for each."""
    import transformers

    names, hf_class = FAMILIES[family]
    torch.manual_seed(0)
    ours = VisionLanguageModel.from_names(*names, preset="tiny")
    with torch.no_grad():  # MoE routers that prefer different experts per token: transformers initialises them to
        for name, p in ours.named_parameters():  # zeros, where ties make each step's routing (and cost) arbitrary
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        ours.save_pretrained(tmp, format="transformers", processor_export=export_processor)
        theirs = getattr(transformers, hf_class).from_pretrained(tmp)
    if ours.encoder.dynamic:
        batch = synthetic_batch(ours, (2, 1, 1, 2, 1, 1, 2, 1), image_sides=[64, (64, 96), 96, 64, 32, (96, 64), 64,
                                                                               96, 64, (32, 64), 64],
                                text_lengths=[48] * 8)
    else:
        batch = synthetic_batch(ours, (1,) * 8, text_lengths=[48] * 8)
    hf_batch = {k: v for k, v in batch.items() if k != "images_per_sample"}
    hf_batch["attention_mask"] = batch["attention_mask"].long()  # transformers' convention
    if ours.uses_mrope:
        hf_batch["mm_token_type_ids"] = (batch["input_ids"] == ours.tokens.image_token_id).int()
    return ours, theirs, batch, hf_batch


def step_fn(model: torch.nn.Module, inputs: dict, autocast: bool, train: bool = True):
    """One step: forward + backward + AdamW, or a no-grad forward."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(train):
            loss = model(**inputs).loss
        if train:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return step


def bench_model_step(reps: int, autocast: bool, train: bool) -> list[float]:
    """Median seconds of one step on the Qwen3.5-shaped pair: mmadapt, transformers."""
    ours, theirs, batch, hf_batch = pair("Qwen3.5-shaped")
    return alternating([step_fn(ours, batch, autocast, train), step_fn(theirs, hf_batch, autocast, train)], reps)


def alternating(fns, reps: int) -> list[float]:
    """Median time of each fn, run in turns so that drift in machine load hits all of them alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, record in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            record.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small injection shape (smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    shape = (2, 256, 128, 64) if args.quick else (16, 2048, 1024, 576)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads; "
          f"torch {torch.__version__}, transformers {transformers.__version__}\n")
    rows = bench_injection(args.reps, shape)
    base = rows[0][1]
    print(f"### Injection forward+backward, {shape[0]} x {shape[1]} x {shape[2]}, {shape[3]} image tokens/sample\n")
    print("| method | ms | vs bool index_put |\n|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / base:.2f}x |")
    print("\n### Tiny Qwen3.5-VL, 8 samples, same weights and batch: mmadapt vs Qwen3_5ForConditionalGeneration\n")
    print("| step | precision | mmadapt ms | transformers ms | ratio |\n|---|---|---:|---:|---:|")
    for train in (True, False):
        for autocast in (False, True):
            ours, theirs = bench_model_step(args.reps, autocast, train)
            label = "bf16 autocast" if autocast else "fp32"
            kind = "train (fwd+bwd+AdamW)" if train else "forward (no grad)"
            print(f"| {kind} | {label} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {ours / theirs:.2f}x |")

if __name__ == "__main__":
    main()
