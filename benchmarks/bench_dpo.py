"""A DPO step's memory and time against an SFT step on the same prompts and answers, at real width and vocabulary.

    python benchmarks/bench_dpo.py [--quick] [--steps 2] [--config NAME] [--training both|lora|full]

One training step (forward + backward + AdamW, fp32, CPU) of `train.objective: dpo` (`mmadapt.train.objectives`:
the reference's log-probs, one policy forward over the chosen and rejected rows, the sigmoid loss) against one SFT
step (`mmadapt.loss`: the chunked cross-entropy) over the same rows: B pairs, each a prompt with one image, a chosen
and a rejected answer; SFT trains on the 2B rows prompt + chosen and prompt + rejected (each row with its image, as
an SFT data set holds them), DPO on the same 2B rows with each pair's image encoded once (`PairCollator`).
Two trainings:
- LoRA on the backbone (projector and encoder frozen): the reference is the same model with its adapters off, run per
  batch under no_grad (no second copy of the weights: the resident memory after building the objective is shown);
- full backbone and projector: the reference's log-probs precomputed (the table), so the step runs the policy only.
Each side runs in its own process: build, one warm-up step (AdamW state), then the measured steps. "fwd + bwd peak":
`VmHWM` over the forward and backward (reset through /proc/self/clear_refs) minus the RSS before it (weights, AdamW
state; gradients freed, as the trainer's `zero_grad(set_to_none=True)`), as bench_loss.py measures it.
Target (issue 35): DPO step peak <= 1.3x the SFT step's. Configs are cut in depth, real width and vocabulary:
- Qwen3.5-0.8B-shaped: ViT 768 wide (2 of 12 blocks), text model 1024 wide, 248,320 vocabulary, tied, 2 of 24 layers
  (1 Gated DeltaNet + 1 gated attention); 512 x 512 images (256 visual tokens); 2 pairs, 30-60 prompt tokens,
  20-40 answer tokens.
`--quick` shrinks everything (smoke run for the test suite; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch

from mmadapt.heads import SequenceLogps

sys.path.insert(0, str(Path(__file__).parent))

from bench_loss import _reset_peak, _status_kib, _trim_heap, build

CONFIGS = {
    "Qwen3.5-0.8B-shaped, 2 layers, 512 px": dict(
        names=("qwen3_5_vit", "qwen_merger", "qwen3_5"), preset="qwen3.5-0.8b", encoder_options={"depth": 2},
        backbone_options={"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
        image_sides=[(512, 512)], depth="ViT 2/12 blocks, LLM 2/24 layers"),
}
TRAININGS = {"LoRA backbone (reference: adapters off)": ("lora", "adapters"),
             "full backbone + projector (reference: precomputed)": ("full", "precomputed")}
PROMPTS, CHOSEN, REJECTED = [34, 57], [26, 38], [31, 22]


def pairs_for(model, config: dict, quick: bool) -> list:
    """B `EncodedPair`s: prompt (one image) + chosen, prompt + rejected."""
    from mmadapt.data.preference import EncodedPair
    from mmadapt.synthetic import synthetic_samples

    sides = None if quick else config["image_sides"] * len(PROMPTS)
    prompts = synthetic_samples(model, (1,) * len(PROMPTS), image_sides=sides, text_lengths=PROMPTS, seed=1)
    generator = torch.Generator().manual_seed(2)
    vocab = model.backbone.config.vocab_size
    special = torch.tensor(model.tokens.ids())
    out = []
    for b, prompt in enumerate(prompts):
        rows = []
        for answer in (CHOSEN[b], REJECTED[b]):
            tokens = torch.randint(0, min(vocab, 1000), (answer,), generator=generator)
            tokens[torch.isin(tokens, special)] = 7  # never an image-span token
            ids = torch.cat([prompt.input_ids, tokens])
            labels = torch.cat([torch.full_like(prompt.input_ids, -100), tokens])
            rows.append(type(prompt)(id=f"pair{b}", input_ids=ids, labels=labels, pixel_values=prompt.pixel_values,
                                     image_grid_thw=prompt.image_grid_thw, tokens_per_image=prompt.tokens_per_image))
        rows[1] = type(rows[1])(**{**rows[1].__dict__, "pixel_values": None, "image_grid_thw": None})
        out.append(EncodedPair(f"pair{b}", rows[0], rows[1], shared=True, index=b))
    return out


def _child(objective: str, training: str, config_name: str, quick: bool, steps: int,
           queue: multiprocessing.Queue) -> None:
    import dataclasses

    from mmadapt.data import Collator
    from mmadapt.data.preference import PairCollator
    from mmadapt.train.batches import inputs_of
    from mmadapt.train.config import RunConfig
    from mmadapt.train.objectives import PairScorer, ReferenceTable
    from mmadapt.train.objectives.dpo.settings import DpoSettings
    from mmadapt.train.stages import apply_stages

    config = CONFIGS[config_name]
    model = build(config, quick)
    pairs = pairs_for(model, config, quick)
    stages, reference = TRAININGS[training]
    overrides = (["stages.backbone=lora", "stages.projector=frozen"] if stages == "lora"
                 else ["stages.backbone=full", "stages.projector=full"])
    apply_stages(model, RunConfig.load(None, overrides).stages)
    model.train()
    if objective == "sft":
        rejected = [dataclasses.replace(p.rejected, pixel_values=p.chosen.pixel_values,
                                        image_grid_thw=p.chosen.image_grid_thw) for p in pairs]
        batch = Collator.for_model(model, 0)([p.chosen for p in pairs] + rejected)
    else:
        batch = PairCollator.for_model(model, 0)(pairs)
    _trim_heap()
    resident_model = _status_kib("VmRSS")
    dpo = None
    if objective == "dpo":
        table = None
        if reference == "precomputed":
            with torch.no_grad():
                logps = model(**inputs_of(batch), head=SequenceLogps()).logps
            table = ReferenceTable({"train": torch.stack(logps.chunk(2), dim=1)}, {})
        dpo = PairScorer(DpoSettings(), model, reference, table)
    _trim_heap()
    reference_cost = _status_kib("VmRSS") - resident_model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        _trim_heap()
        before = _status_kib("VmRSS")
        _reset_peak()
        if dpo is None:
            loss = model(**inputs_of(batch)).loss
        else:
            loss = dpo.terms(model, batch, torch.device("cpu"))[0].losses.mean()
        loss.backward()
        peak = _status_kib("VmHWM") - before
        optimizer.step()
        return peak

    step()
    peaks, times = [], []
    for _ in range(steps):
        started = time.perf_counter()
        peaks.append(step())
        times.append(time.perf_counter() - started)
    grids = batch.get("image_grid_thw")
    queue.put({"peak_mib": max(peaks) / 1024, "seconds": statistics.median(times),
               "reference_mib": reference_cost / 1024, "rows": int(batch["input_ids"].shape[0]),
               "tokens": int(batch["attention_mask"].sum()),
               "images": int((grids if grids is not None else batch["pixel_values"]).shape[0])})


def measure(objective: str, training: str, config: str, quick: bool, steps: int) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(objective, training, config, quick, steps, queue))
    process.start()
    while True:
        try:
            result = queue.get(timeout=5)
            break
        except Exception:  # queue.Empty: still working, unless the process died
            if not process.is_alive():
                raise RuntimeError(f"the {objective} measurement process failed (exit code {process.exitcode})"
                                   ) from None
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--config", default=next(iter(CONFIGS)), choices=list(CONFIGS))
    parser.add_argument("--training", default="both", choices=["both", "lora", "full"])
    args = parser.parse_args()
    config = CONFIGS[args.config]
    print(f"## DPO step vs SFT step, same prompts and answers ({args.config}: {config['depth']}; fp32, CPU"
          f"{'; QUICK: tiny model, numbers mean nothing' if args.quick else ''})\n")
    print("| training | SFT peak MiB | DPO peak MiB | peak ratio [target <= 1.3x] | SFT s | DPO s | time ratio | "
          "reference's resident MiB | rows (images: SFT / DPO) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for training in TRAININGS:
        if args.training != "both" and TRAININGS[training][0] != args.training:
            continue
        sft = measure("sft", training, args.config, args.quick, args.steps)
        dpo = measure("dpo", training, args.config, args.quick, args.steps)
        ratio = dpo["peak_mib"] / max(sft["peak_mib"], 1e-9)
        print(f"| {training} | {sft['peak_mib']:.0f} | {dpo['peak_mib']:.0f} | {ratio:.2f}x | "
              f"{sft['seconds']:.2f} | {dpo['seconds']:.2f} | {dpo['seconds'] / sft['seconds']:.2f}x | "
              f"{dpo['reference_mib']:.0f} | {dpo['rows']} ({sft['images']} / {dpo['images']}) |", flush=True)


if __name__ == "__main__":
    main()
