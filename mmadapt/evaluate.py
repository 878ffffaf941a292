"""Evaluation that proves a model reads its images: answers with real, blanked and shuffled images.

    report = evaluate_records(model, encoder, collate, records)    # `mmadapt eval MODEL DATA` prints it
    report["accuracy_images"], report["accuracy_blank"], report["accuracy_shuffled"], report["passed"]

Greedy answers to each record's question (its last assistant turn is the reference) are scored per
sample by normalised exact match (case, surrounding whitespace and final punctuation ignored;
`accuracy_*`) and by "reference contained in the answer" (`contained_*`), each three ways: with the
real images, with blanked images (pixel_values zeroed = the processor's mean colour: same size,
grid and token count, no content) and with images shuffled across samples (each sample gets the
next sample's image of the same grid, so its span still fits). The verdict: images must beat the
better of blanked / shuffled by `margin` accuracy points. `chance` is the best constant answer's
accuracy (the majority reference's share). `max_new_tokens` defaults to fit the longest reference.
The digits demo (`mmadapt demo`) reports through this same code.
"""

from __future__ import annotations

import dataclasses
import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

DEFAULT_MARGIN = 0.2
EVAL_BATCH = 64
VARIANTS = ("images", "blank", "shuffled")


def reference_of(record: dict[str, Any]) -> str:
    """The last assistant turn of a LLaVA (`conversations`) or messages record."""
    if "conversations" in record:
        return str(record["conversations"][-1]["value"])
    content = record["messages"][-1]["content"]
    if isinstance(content, list):
        content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def normalise(text: str) -> str:
    return text.strip().rstrip(string.punctuation + " ").strip().lower()


def exact(prediction: str, reference: str) -> bool:
    return normalise(prediction) == normalise(reference)


def contained(prediction: str, reference: str) -> bool:
    return normalise(reference) in normalise(prediction)


def chance_level(references: Sequence[str], classes: int | None = None) -> float:
    """Accuracy of the best constant answer: the majority reference's share (at least 1 / classes if given)."""
    norm = [normalise(r) for r in references]
    majority = max(norm.count(a) for a in set(norm)) / len(norm)
    return max(1 / classes, majority) if classes else majority


def end_token_ids(encoder: Any) -> list[int]:
    """The token that ends an assistant turn (`<|im_end|>`, `</s>`): generation stops there."""
    return [encoder.tokenizer.convert_tokens_to_ids(encoder.template.end_of_turn(encoder.tokenizer))]


def blanked(samples: Sequence[Any]) -> list[Any]:
    """Each image replaced by the processor's mean colour (normalised pixels = 0); token counts unchanged."""
    return [dataclasses.replace(s, pixel_values=None if s.pixel_values is None else torch.zeros_like(s.pixel_values))
            for s in samples]


def shuffled(samples: Sequence[Any]) -> list[Any]:
    """Each sample gets the image of the next sample with the same grid (cyclic), so its span still fits.

    A sample whose grid no other sample shares keeps its image."""
    def key(s: Any) -> tuple:
        grid = () if s.image_grid_thw is None else tuple(s.image_grid_thw.flatten().tolist())
        return tuple(s.tokens_per_image), grid

    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(key(s), []).append(i)
    out = list(samples)
    for members in groups.values():
        for k, i in enumerate(members):
            donor = samples[members[(k + 1) % len(members)]]
            out[i] = dataclasses.replace(samples[i], pixel_values=donor.pixel_values,
                                         image_grid_thw=donor.image_grid_thw)
    return out


def answer_budget(encoder: Any, references: Sequence[str], slack: int = 4) -> int:
    """New tokens enough for the longest reference answer (plus its end token and a little slack)."""
    lengths = [len(encoder.tokenizer(r, add_special_tokens=False)["input_ids"]) for r in references]
    return max(lengths, default=0) + slack


@torch.no_grad()
def predict(model: Any, encoder: Any, collate: Any, prompts: Sequence[Any], max_new_tokens: int,
            progress: Any = None) -> list[str]:
    """Greedy answers to generation prompts, in batches; text up to the end-of-turn token, stripped."""
    ends = end_token_ids(encoder)
    answers: list[str] = []
    was_training = model.training
    model.eval()
    for start in range(0, len(prompts), EVAL_BATCH):
        batch = collate(prompts[start : start + EVAL_BATCH])
        new = model.generate(batch["input_ids"], batch["attention_mask"], batch.get("pixel_values"),
                             batch.get("image_grid_thw"), max_new_tokens=max_new_tokens, eos_token_id=ends,
                             pad_token_id=encoder.pad_token_id)
        for row in new.tolist():
            cut = next((k for k, t in enumerate(row) if t in ends), len(row))
            answers.append(encoder.tokenizer.decode(row[:cut], skip_special_tokens=True).strip())
        if progress is not None:
            progress.update(len(new))
    model.train(was_training)
    return answers


def verdict(report: dict[str, Any]) -> tuple[bool, str]:
    """Passed when accuracy with real images beats blanked and shuffled images by >= the margin."""
    best_without = max(report["accuracy_blank"], report["accuracy_shuffled"])
    gap = report["accuracy_images"] - best_without
    passed = gap >= report["margin"]
    text = (f"{'PASSED' if passed else 'FAILED'}: accuracy with images {report['accuracy_images']:.3f}, blanked "
            f"{report['accuracy_blank']:.3f}, shuffled {report['accuracy_shuffled']:.3f} (chance "
            f"{report['chance']:.3f}); images beat the better of blanked/shuffled by {gap:+.3f}, "
            f"{'>=' if passed else '<'} the margin {report['margin']:.2f}: the model "
            f"{'reads' if passed else 'does not clearly read'} the images")
    return passed, text


def evaluate_records(model: Any, encoder: Any, collate: Any, records: Sequence[dict[str, Any]], *,
                     margin: float = DEFAULT_MARGIN, max_new_tokens: int | None = None, classes: int | None = None,
                     progress: bool = False) -> dict[str, Any]:
    """The three-way evaluation of `records` (see module docstring): report dict plus per-sample `predictions`.

    Records that cannot be encoded (a `DataProblem`) are skipped and counted in `skipped`."""
    from mmadapt.data import DataProblem

    prompts, kept, skipped = [], [], []
    for i, record in enumerate(records):
        try:
            prompts.append(encoder.encode_prompt(record, i))
            kept.append(record)
        except DataProblem as problem:
            if problem.fatal:
                raise
            skipped.append(problem.to_dict())
    if not prompts:
        raise ValueError(f"none of the {len(records)} records can be evaluated: {skipped[:3]}")
    references = [reference_of(r) for r in kept]
    budget = max_new_tokens or answer_budget(encoder, references)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=3 * len(prompts), desc="eval (images, blanked, shuffled)", unit="answer")
    variants = {"images": prompts, "blank": blanked(prompts), "shuffled": shuffled(prompts)}
    answers = {name: predict(model, encoder, collate, variant, budget, bar) for name, variant in variants.items()}
    if bar is not None:
        bar.close()
    report: dict[str, Any] = {}
    for name in VARIANTS:
        report[f"accuracy_{name}"] = sum(map(exact, answers[name], references)) / len(references)
        report[f"contained_{name}"] = sum(map(contained, answers[name], references)) / len(references)
    report.update(chance=chance_level(references, classes), margin=margin, samples=len(kept),
                  skipped=len(skipped), skipped_samples=skipped, max_new_tokens=budget)
    report["passed"], report["verdict"] = verdict(report)
    report["predictions"] = [
        {"id": p.id, "reference": ref, **{name: answers[name][k] for name in VARIANTS},
         "exact": {name: exact(answers[name][k], ref) for name in VARIANTS}}
        for k, (p, ref) in enumerate(zip(prompts, references, strict=True))]
    return report


def write_predictions(report: dict[str, Any], path: str | Path) -> None:
    with open(path, "w") as f:
        for row in report["predictions"]:
            f.write(json.dumps(row) + "\n")


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """Bar chart: exact and contained accuracy with real / blanked / shuffled images, chance and the margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(VARIANTS))
    ax.bar([x - 0.2 for x in xs], [report[f"accuracy_{v}"] for v in VARIANTS], 0.4, label="exact match")
    ax.bar([x + 0.2 for x in xs], [report[f"contained_{v}"] for v in VARIANTS], 0.4, label="reference contained")
    ax.axhline(report["chance"], color="gray", linestyle="--", label=f"chance {report['chance']:.2f}")
    ax.set_xticks(list(xs), ["real images", "blanked", "shuffled"])
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title(("PASSED" if report["passed"] else "FAILED") + f" (margin {report['margin']:.2f}, "
                 f"{report['samples']} samples)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
