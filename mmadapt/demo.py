"""`mmadapt demo`: train a tiny model to read handwritten digits, and prove it reads the images.

    report = run_demo(out="runs/demo")          # the default parts (`mmadapt.config.DEFAULT_PARTS`), tiny
    report.evaluation.accuracy["real"], report.evaluation.accuracy["blanked"], report.passed
    print(report)                               # what `mmadapt demo` prints after training; OUT/report.json too

The task ships offline: scikit-learn's 1,797 scanned handwritten digits (8 x 8 px, 16 grey
levels), upscaled to `image_size` px (default 32 = 2 merge windows of the tiny Qwen ViT, and
the tiny CLIP's input size), written as PNG files plus LLaVA-format JSONL under OUT/data,
with a stratified held-out split (`eval_fraction`). Each sample asks "What digit is this?"
and the answer is the digit. The data go through mmadapt's own pipeline (`SampleEncoder`,
`VLMDataset`, `Collator`) and trainer (`Trainer`, every component trained in full: the tiny
models start from random weights).

After training, greedy answers on the held-out split are scored under the three image controls of
`mmadapt.controls` by `mmadapt.evaluate` (what `mmadapt eval` runs): with the real images, with blanked images
(pixel_values zeroed = the processor's mean colour) and with images shuffled across samples (each prompt gets the
next prompt's image). A model that reads the images beats both by a clear margin (`margin`, default 0.2
accuracy points); one that answers from the text alone scores about the same on all three. `sees_images` runs on one
batch before and after training, as the quick check a user can run without training.

OUT receives: data/ (PNGs, train.jsonl, eval.jsonl), report.json, loss.png (the trainer's
loss curve), predictions.png (held-out images with question, answer and predictions),
log.jsonl, config.yaml and checkpoints/ (from the trainer) and a `.mmadapt-demo` marker: a rerun
into the same OUT replaces them; an OUT holding another run's checkpoints is refused.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmadapt.config import DEFAULT_PARTS, DEFAULT_PRESET
from mmadapt.controls import BLANKED, IMAGE_CONTROLS, REAL, SHUFFLED
from mmadapt.run_directory import RunDirectory

if TYPE_CHECKING:
    from mmadapt.evaluate import EvalReport
    from mmadapt.sees import SeesImagesReport

log = logging.getLogger(__name__)

QUESTION = "What digit is this?"
# The default run: held-out accuracy 0.96 with images, 0.10 / 0.09 blanked / shuffled, in 90-105 s of
# wall time on 2 shared CPU cores (`time mmadapt demo`; 75-92 s of it training).
DEFAULTS: dict[str, Any] = {"steps": 300, "lr": 1e-3, "batch_size": 32, "warmup_steps": 20, "image_size": 32}


# ---- data -----------------------------------------------------------------------------------------
def digit_records(directory: str | Path, *, image_size: int = 32, eval_fraction: float = 0.2,
                  seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Write the digits as PNGs (dark ink on white) and LLaVA JSONL under `directory`; (train, eval) records."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for k, (pixels, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        grey = (255 - pixels * (255 / 16)).round().clip(0, 255).astype("uint8")
        name = f"images/digit-{k:04d}.png"
        Image.fromarray(grey, mode="L").resize((image_size, image_size), Image.BILINEAR).save(directory / name)
        records.append({"id": f"digit-{k:04d}", "image": name, "conversations": [
            {"from": "human", "value": f"<image>\n{QUESTION}"}, {"from": "gpt", "value": str(int(label))}]})
    train, held_out = train_test_split(records, test_size=eval_fraction, random_state=seed,
                                       stratify=digits.target)
    for name, part in (("train", train), ("eval", held_out)):
        with open(directory / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    return train, held_out


def answer_of(record: dict[str, Any]) -> str:
    return record["conversations"][-1]["value"]


# ---- figures --------------------------------------------------------------------------------------
def plot_predictions(path: Path, image_root: Path, records: Sequence[dict[str, Any]],
                     predictions: dict[str, list[str]], count: int = 24, columns: int = 8) -> Path:
    """A grid of held-out images titled with answer and predictions (`predictions[control name]`: real / blanked /
    shuffled images)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    count = min(count, len(records))
    rows = -(-count // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(1.6 * columns, 1.9 * rows + 0.6), squeeze=False)
    for k, ax in enumerate(axes.flat):
        ax.axis("off")
        if k >= count:
            continue
        record, answer = records[k], answer_of(records[k])
        ax.imshow(Image.open(image_root / record["image"]), cmap="gray", vmin=0, vmax=255)
        guess = predictions[REAL.name][k]
        ax.set_title(f"answer {answer}  {REAL.name} {guess or '-'}\n{BLANKED.name} "
                     f"{predictions[BLANKED.name][k] or '-'}  {SHUFFLED.name} {predictions[SHUFFLED.name][k] or '-'}",
                     fontsize=8,
                     color="tab:green" if guess == answer else "tab:red")
    fig.suptitle(f"held-out digits; question: {QUESTION!r} (green: correct with the real image)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---- the report -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class DemoReport:
    """A demo run: the held-out evaluation (`EvalReport`, its verdict the demo's), the training that preceded it,
    `sees_images` before and after training, and the files written under `out`.

    `print(report)` gives what `mmadapt demo` prints after training; `to_dict()` is OUT/report.json.
    """

    evaluation: EvalReport
    steps: int
    skipped: int  # training steps skipped (non-finite loss)
    train_seconds: float
    final_loss: float | None
    model: dict[str, str]  # encoder, projector, backbone, preset
    hyperparameters: dict[str, Any]
    train_samples: int
    eval_samples: int
    sees_before: SeesImagesReport
    sees_after: SeesImagesReport
    files: dict[str, str]  # loss_curve, predictions, data, log
    seconds: float
    out: str  # the output directory, as given
    question: str = QUESTION

    @property
    def passed(self) -> bool:
        return self.evaluation.passed

    @property
    def verdict(self) -> str:
        return self.evaluation.verdict

    @property
    def report_file(self) -> str:
        return os.fspath(RunDirectory(self.out).report_file)

    def lines(self) -> list[str]:
        """Training, the held-out accuracy with real / blanked / shuffled images, the files, the verdict."""
        accuracy = self.evaluation.accuracy
        return [f"trained {self.steps} steps on {self.train_samples} digits in {self.train_seconds:.0f} s "
                f"(final loss {self.final_loss:.3f}); total {self.seconds:.0f} s",
                f"held-out answer accuracy ({self.eval_samples} digits, chance {self.evaluation.chance:.3f}):",
                *(f"  {control.label():<16} {accuracy[control.name]:.3f}" for control in IMAGE_CONTROLS),
                f"report {self.report_file}; loss curve {self.files['loss_curve']}; "
                f"predictions {self.files['predictions']}",
                self.verdict]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, Any]:
        """OUT/report.json: accuracy_<control> (real, blanked, shuffled), chance, margin, the training, the sees
        reports, passed, verdict, files, seconds."""
        return {**{f"accuracy_{c.name}": self.evaluation.accuracy[c.name] for c in IMAGE_CONTROLS},
                "chance": self.evaluation.chance, "margin": self.evaluation.margin, "steps": self.steps,
                "skipped": self.skipped, "train_seconds": self.train_seconds, "final_loss": self.final_loss,
                "model": self.model, "hyperparameters": self.hyperparameters, "train_samples": self.train_samples,
                "eval_samples": self.eval_samples, "question": self.question,
                "sees_images_before": self.sees_before.to_dict(), "sees_images_after": self.sees_after.to_dict(),
                "passed": self.passed, "verdict": self.verdict, "files": self.files, "seconds": self.seconds}


# ---- the run --------------------------------------------------------------------------------------
def prepare_out(out: Path) -> None:
    """Make OUT a demo directory; clear a previous demo's trainer outputs, refuse another run's.

    The trainer appends to log.jsonl, and its checkpoint pruning keeps the highest step numbers, so a
    shorter rerun into the same OUT would mix logs and lose its own checkpoint to the older one.
    """
    import shutil

    run = RunDirectory(out)
    marker = run.demo_marker  # marks OUT as a demo directory that a rerun may clear
    previous = [p for p in (run.checkpoints_dir, run.log_file) if p.exists()]
    if previous and not marker.is_file():
        raise ValueError(f"{out} holds another run's outputs ({', '.join(p.name for p in previous)}) and is not "
                         "a demo directory. Fix: choose another --out, or delete that directory first.")
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text("written by mmadapt demo; a rerun replaces checkpoints/, log.jsonl and the reports\n")
    for path in previous:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def run_config(out: Path, *, steps: int, lr: float, batch_size: int, warmup_steps: int, seed: int,
               progress: bool) -> Any:
    from mmadapt.train import RunConfig

    data = RunDirectory(out).data_dir
    overrides = [f"train.steps={steps}", f"train.lr={lr}", f"train.warmup_steps={min(warmup_steps, steps - 1)}",
                 f"data.batch_size={batch_size}", f"train.seed={seed}", f"train.out={out}",
                 f"train.progress={str(progress).lower()}", f"train.log_every={max(steps // 10, 1)}",
                 "stages.encoder=full", "stages.projector=full", "stages.backbone=full",
                 "train.schedule=cosine", "checkpoint.keep=1",
                 # the files the demo trained and evaluated on, recorded with the run (`mmadapt serve --ui` takes
                 # its example questions from data.eval)
                 f"data.train={data / 'train.jsonl'}", f"data.eval={data / 'eval.jsonl'}", f"data.image_root={data}"]
    return RunConfig.load(None, overrides)


def run_demo(*, encoder: str = DEFAULT_PARTS["encoder"], projector: str = DEFAULT_PARTS["projector"],
             backbone: str = DEFAULT_PARTS["backbone"], preset: str = DEFAULT_PRESET, steps: int | None = None,
             lr: float | None = None, batch_size: int | None = None, warmup_steps: int | None = None,
             image_size: int | None = None, margin: float = 0.2, out: str | Path = "runs/demo",
             seed: int = 0, progress: bool = True, deepstack: str = "use") -> DemoReport:
    """Train on the digits, score held-out answers with real / blanked / shuffled images; write OUT; the report.

    `None` hyper-parameters take `DEFAULTS`.
    """
    from mmadapt.data import Collator, SampleEncoder, VLMDataset, char_tokenizer
    from mmadapt.evaluate import evaluate_records
    from mmadapt.model import VisionLanguageModel
    from mmadapt.sees import sees_images
    from mmadapt.train import Trainer

    hp = {**DEFAULTS, **{k: v for k, v in dict(steps=steps, lr=lr, batch_size=batch_size,
                                                 warmup_steps=warmup_steps, image_size=image_size).items()
                         if v is not None}}
    started, given, out = time.perf_counter(), str(out), Path(out)
    run = RunDirectory(out)
    data = run.data_dir
    prepare_out(out)
    torch.manual_seed(seed)
    model = VisionLanguageModel.from_names(encoder, projector, backbone, preset=preset, deepstack=deepstack)
    train_records, eval_records = digit_records(data, image_size=hp["image_size"], seed=seed)
    tokenizer = char_tokenizer()
    sample_encoder = SampleEncoder.for_model(model, tokenizer, image_root=str(data), max_length=1024,
                                             truncation="raise")
    collate = Collator.for_model(model, sample_encoder.pad_token_id)
    train_data = VLMDataset(train_records, sample_encoder)
    eval_data = VLMDataset(eval_records, sample_encoder)
    probe = collate([eval_data[i] for i in range(min(16, len(eval_data)))])
    sees_before = sees_images(model, probe)
    if not sees_before.ok:
        log.warning("before training: the model %s", sees_before.verdict)

    config = run_config(out, steps=hp["steps"], lr=hp["lr"], batch_size=hp["batch_size"],
                        warmup_steps=hp["warmup_steps"], seed=seed, progress=progress)
    summary = Trainer(model, config, train_data, collate, tokenizer=tokenizer).fit()  # OUT/model: chat-ready

    scored = evaluate_records(model, sample_encoder, collate, eval_records, margin=margin, classes=10)
    predictions = {c.name: scored.answers(c.name) for c in IMAGE_CONTROLS}
    sees_after = sees_images(model, probe)
    files = {"loss_curve": str(run.loss_plot), "predictions": str(
        plot_predictions(run.predictions_plot, data, eval_records, predictions)),
        "data": str(data), "log": str(run.log_file)}
    report = DemoReport(
        evaluation=scored, steps=summary["steps"], skipped=summary["skipped"],
        train_seconds=round(summary["seconds"], 2),
        final_loss=summary["history"][-1]["loss"] if summary["history"] else None,
        model={"encoder": encoder, "projector": projector, "backbone": backbone, "preset": preset},
        hyperparameters={**hp, "seed": seed}, train_samples=len(train_records), eval_samples=len(eval_records),
        sees_before=sees_before, sees_after=sees_after, files=files,
        seconds=round(time.perf_counter() - started, 2), out=given)
    run.report_file.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    log.info("%s", report.verdict)
    return report
