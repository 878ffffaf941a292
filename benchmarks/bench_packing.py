"""Packing benchmarks: packed vs padded throughput, and the cost of per-sample Gated DeltaNet isolation.

    python benchmarks/bench_packing.py [--reps 3] [--samples 16] [--quick]

Samples follow a LLaVA-mix-665k-like length mix (about 2/3 with one 576-token image span
plus a short text, 1/3 longer text-only conversations; max 2048 tokens), shuffled as a data
loader would give them. Padded: batches of 8 padded to their longest sample. Packed: the
same samples in rows of at most 2048 tokens (`Collator(max_tokens=2048)`). Effective
tokens/s counts real (non-padding) tokens through forward + backward. Image spans are plain
tokens here: the vision tower's cost is the same either way.

Targets (issue 3): packed >= 1.8x padded effective tokens/s; per-sample Gated DeltaNet
isolation <= 1.15x the same model without isolation on the same packed tokens.
`--quick`: 4 samples at 1/8 of their lengths, 1 repetition (smoke run; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import platform

import torch
from bench_core import alternating

from mmadapt import ModelConfig, VisionLanguageModel
from mmadapt.data import Collator, EncodedSample

MAX_TOKENS, IMAGE_TOKENS, BATCH = 2048, 576, 8
QUICK_SHRINK = 8  # --quick: the samples' lengths divided by this
SHAPES = {  # moderate widths so matmuls, not Python, dominate, as in real models
    "llama": dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, image_token_id=2047),
    "qwen3_5": dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                    linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                    image_token_id=2047, vision_start_token_id=2045, vision_end_token_id=2046, video_token_id=2044,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                         mrope_section=[4, 2, 2], mrope_interleaved=True)),
}


def llava_mix_lengths(count: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths = []
    for _ in range(count):
        if torch.rand(1, generator=g) < 2 / 3:  # image + short instruction / answer
            text = torch.empty(1).log_normal_(4.6, 0.7, generator=g)
            lengths.append(IMAGE_TOKENS + int(text))
        else:  # text-only conversation
            lengths.append(int(torch.empty(1).log_normal_(5.7, 0.9, generator=g)))
    return [max(16, min(n, MAX_TOKENS)) for n in lengths]


def samples_of(lengths: list[int], vocab: int) -> list[EncodedSample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for k, n in enumerate(lengths):
        ids = torch.randint(10, vocab - 8, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 2] = -100
        out.append(EncodedSample(id=str(k), input_ids=ids, labels=labels))
    return out


def build(backbone: str) -> VisionLanguageModel:
    torch.manual_seed(0)
    config = ModelConfig.from_names("clip", "mlp2x_gelu", backbone)
    config.backbone.options = SHAPES[backbone]
    return VisionLanguageModel(config)


def train_pass(model: VisionLanguageModel, batches: list[dict]) -> None:
    for batch in batches:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)


def bench_pack_vs_pad(backbone: str, samples: list[EncodedSample], reps: int) -> tuple[float, float, int, int]:
    model = build(backbone)
    pad = Collator.for_model(model, pad_token_id=0)
    pack = Collator.for_model(model, pad_token_id=0, max_tokens=MAX_TOKENS)
    padded = [pad(samples[i : i + BATCH]) for i in range(0, len(samples), BATCH)]
    packed = [pack(samples)]
    slots_padded = sum(b["input_ids"].numel() for b in padded)
    slots_packed = sum(b["input_ids"].numel() for b in packed)
    t_pad, t_pack = alternating([lambda: train_pass(model, padded), lambda: train_pass(model, packed)], reps)
    return t_pad, t_pack, slots_padded, slots_packed


def bench_isolation(samples: list[EncodedSample], reps: int) -> tuple[float, float, float]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from mmadapt.backbones.qwen3_5_layers import PerSampleGatedDeltaNet

    model = build("qwen3_5")
    packed = [Collator.for_model(model, pad_token_id=0, max_tokens=MAX_TOKENS)(samples)]
    alone = [Collator.for_model(model, pad_token_id=0)([s]) for s in samples]
    layers = [m for m in model.modules() if isinstance(m, Qwen3_5GatedDeltaNet)]

    def leaky() -> None:  # transformers' layer straight across the row: same tokens, no isolation
        for m in layers:
            m.__class__ = Qwen3_5GatedDeltaNet
        try:
            train_pass(model, packed)
        finally:
            for m in layers:
                m.__class__ = PerSampleGatedDeltaNet

    return tuple(alternating([lambda: train_pass(model, packed), leaky, lambda: train_pass(model, alone)], reps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--quick", action="store_true",
                        help=f"4 samples at 1/{QUICK_SHRINK} of their lengths, 1 rep (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.reps = 4, 1
    import transformers

    transformers.utils.logging.set_verbosity_error()
    lengths = llava_mix_lengths(args.samples)
    if args.quick:
        lengths = [max(16, n // QUICK_SHRINK) for n in lengths]
    samples = samples_of(lengths, 2040)
    real = sum(lengths)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"{len(samples)} samples, {real} real tokens, lengths {min(lengths)}..{max(lengths)} "
          f"(mean {real / len(lengths):.0f}); padded batches of {BATCH}, packed rows <= {MAX_TOKENS} tokens\n")
    print("### Packed vs padded, forward + backward, effective (non-pad) tokens/s\n")
    print("| backbone | padded tok/s | packed tok/s | speed-up | pad share padded | pad share packed |")
    print("|---|---:|---:|---:|---:|---:|")
    for backbone in ("llama", "qwen3_5"):
        t_pad, t_pack, slots_pad, slots_pack = bench_pack_vs_pad(backbone, samples, args.reps)
        print(f"| {backbone} | {real / t_pad:.0f} | {real / t_pack:.0f} | {t_pad / t_pack:.2f}x | "
              f"{1 - real / slots_pad:.0%} | {1 - real / slots_pack:.0%} |")
    isolated, leaky, alone = bench_isolation(samples, args.reps)
    print("\n### Qwen3.5 per-sample Gated DeltaNet isolation, forward + backward on the same tokens\n")
    print("| variant | ms | isolated vs this |\n|---|---:|---:|")
    print(f"| packed, isolated per sample (mmadapt) | {isolated * 1e3:.0f} | 1.00x |")
    print(f"| packed, no isolation (transformers' layer; leaks) | {leaky * 1e3:.0f} | {isolated / leaky:.2f}x |")
    print(f"| unpacked, one sample per forward | {alone * 1e3:.0f} | {isolated / alone:.2f}x |")


if __name__ == "__main__":
    main()
