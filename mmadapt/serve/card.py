"""A served model's card: what it is made of, where its weights came from, how it reads a prompt, how it scored.

`ModelCard.read(src, model, processor)` gathers, for the page's "Model card" tab (`card.markdown()`) and as JSON
(`card.to_dict()`):
- components: each part's registered name, preset, parameter count and the checkpoint it started from (path and
  SHA-256 as its config recorded them);
- provenance: the files the weights were read from now (`mmadapt.directory.source_record`: path, SHA-256) and,
  for a run, its checkpoints (step, complete or not);
- the chat template and its `template_kwargs` (the data settings the model was trained with), and the exact text
  the model reads for a question with one image (its placeholder run shortened);
- the run's final eval numbers when the directory has them: the last value of each `eval_*` / `lmms/*` metric in
  `OUT/log.jsonl` (with its step) and the accuracies of `OUT/report.json` (`mmadapt demo`, or `mmadapt eval
  --json` saved there).
Everything is read from files the operator pointed the server at; none is executed, and a file that cannot be read
is a line on the card saying so, never an error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mmadapt.directory import source_record
from mmadapt.run_directory import RunDirectory, is_complete, step_of

log = logging.getLogger(__name__)

PARTS = ("encoder", "projector", "backbone")
MAX_LOG_BYTES = 64 * 1024 * 1024  # a log.jsonl beyond this is read from its last 64 MiB only


@dataclass(frozen=True)
class ModelCard:
    name: str
    source: str
    components: list[dict[str, Any]]
    weights: dict[str, Any] | None
    checkpoints: list[dict[str, Any]]
    chat_template: str
    template_kwargs: dict[str, Any]
    example_prompt: str
    evaluation: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, src: str | Path | None, model: Any, processor: Any, *, name: str = "mmadapt") -> ModelCard:
        """The card of `model` (loaded from `src`, a model / run / checkpoint directory, or None for a model built
        in code) and its `processor` (`mmadapt.Processor`)."""
        notes: list[str] = []
        config = model.resolved_config().to_dict()
        run = RunDirectory.of(src) if src is not None else None
        presets = run_presets(run, notes) if run is not None else {}
        components = [component(part, {**config[part], "preset": config[part].get("preset") or presets.get(part)},
                                getattr(model, part)) for part in PARTS]
        settings = processor.encoder.config
        return cls(name=name, source="built in code" if src is None else str(Path(src).resolve()),
                   components=components, weights=source_record(model),
                   checkpoints=checkpoints(run) if run is not None else [],
                   chat_template=template_name(settings.chat_template, processor.encoder.template),
                   template_kwargs=dict(settings.template_kwargs or {}),
                   example_prompt=example_prompt(processor, notes),
                   evaluation=evaluation(run, notes) if run is not None else {}, notes=notes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def markdown(self) -> str:
        """The card as Markdown (the page's "Model card" tab)."""
        rows = "\n".join(f"| {c['part']} | `{c['name']}`" + (f" ({c['preset']})" if c["preset"] else "")
                         + f" | {c['parameters']:,} | {c['started_from']} |" for c in self.components)
        lines = [f"### {self.name}", f"Loaded from `{self.source}`.", "",
                 "| part | component | parameters | started from |", "|---|---|---:|---|", rows, "",
                 "#### Provenance"]
        if self.weights is None:
            lines.append("- weights: built in code (no files)")
        elif self.weights.get("sha256"):
            lines.append(f"- weights read from `{self.weights['path']}`, SHA-256 `{self.weights['sha256']}`")
        else:
            lines.append(f"- weights read from `{self.weights['path']}` ({self.weights.get('note', 'no checksum')})")
        for checkpoint in self.checkpoints:
            lines.append(f"- checkpoint `{checkpoint['name']}` (step {checkpoint['step']}"
                         + ("" if checkpoint["complete"] else ", incomplete: not loadable") + ")")
        kwargs = json.dumps(self.template_kwargs) if self.template_kwargs else "none"
        lines += ["", "#### Chat template", f"- template `{self.chat_template}`, template kwargs: `{kwargs}`",
                  "- what the model reads for a 64 x 64 image and a question:", "", "```text",
                  self.example_prompt.strip(), "```"]
        if self.evaluation:
            lines += ["", "#### Final evaluation"]
            for source, numbers in self.evaluation.items():
                shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in numbers.items())
                lines.append(f"- {source}: {shown}")
        if self.notes:
            lines += ["", *[f"> {note}" for note in self.notes]]
        return "\n".join(lines) + "\n"


def template_name(setting: str, template: Any) -> str:
    """The template the processor renders with, and the setting that chose it when that differs."""
    name = str(getattr(template, "name", template))
    return name if setting == name else f"{name} (chat_template: {setting})"


def component(part: str, config: dict[str, Any], module: Any) -> dict[str, Any]:
    """One part's row: its name, preset, parameter count and the checkpoint it started from."""
    pretrained, source = config.get("pretrained"), config.get("source") or {}
    digest = source.get("sha256") if isinstance(source, dict) else None
    started = "random initialisation" if not pretrained else f"`{pretrained}`" + (
        f" (SHA-256 `{digest[:16]}…`)" if digest else "")
    return {"part": part, "name": config.get("name"), "preset": config.get("preset"),
            "parameters": sum(p.numel() for p in module.parameters()), "started_from": started,
            "pretrained": pretrained, "sha256": digest}


def run_presets(run: RunDirectory, notes: list[str]) -> dict[str, str]:
    """{part: preset} as the run's config named them (a saved model keeps the options a preset expanded to, not its
    name): `model.preset` for the encoder and the backbone, a part's own `preset` first."""
    import yaml

    from mmadapt.train.config import RunConfig

    if not run.config_file.is_file():
        return {}
    try:
        section = RunConfig.load(run.config_file).model
    except (OSError, ValueError, TypeError, yaml.YAMLError) as e:
        notes.append(f"{run.config_file} could not be read: {e}")
        return {}
    found = {}
    for part in PARTS:
        given = getattr(section, part)
        own = given.get("preset") if isinstance(given, dict) else None
        shared = section.preset if part != "projector" and not (isinstance(given, dict)
                                                               and given.get("pretrained")) else None
        if isinstance(own or shared, str):
            found[part] = own or shared
    return found


def checkpoints(run: RunDirectory) -> list[dict[str, Any]]:
    """The run's checkpoints, oldest first: name, step and whether it is complete (its marker written)."""
    return [{"name": path.name, "step": step_of(path), "complete": is_complete(path)} for path in run.checkpoints()]


def example_prompt(processor: Any, notes: list[str]) -> str:
    """The text of a one-image question as the model reads it (special tokens written out, placeholder runs
    shortened to `<token> x N`)."""
    from PIL import Image

    try:
        inputs = processor([{"role": "user", "content": "<image>\nWhat is in the picture?"}],
                           images=[Image.new("RGB", (64, 64), (128, 128, 128))])
    except (ValueError, TypeError) as e:
        notes.append(f"the example prompt could not be rendered: {e}")
        return "(not rendered)"
    ids = inputs["input_ids"][0][inputs["attention_mask"][0].bool()].tolist()
    special = {processor.encoder.image_token_id, processor.encoder.video_token_id} - {None}
    pieces: list[str] = []
    k = 0
    while k < len(ids):
        run = 1
        while ids[k] in special and k + run < len(ids) and ids[k + run] == ids[k]:
            run += 1
        text = processor.tokenizer.decode(ids[k : k + run] if run == 1 else [ids[k]], skip_special_tokens=False)
        pieces.append(text if run == 1 else f"{text} x {run}")
        k += run
    return "".join(pieces)


def evaluation(run: RunDirectory, notes: list[str]) -> dict[str, dict[str, Any]]:
    """{where: {metric: value}}: the last eval metrics of `log.jsonl` and the accuracies of `report.json`."""
    from mmadapt.controls import IMAGE_CONTROLS, current_key

    found: dict[str, dict[str, Any]] = {}
    log_file = run.log_file
    if log_file.is_file():
        last: dict[str, Any] = {}
        with log_file.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - MAX_LOG_BYTES))
            for line in f.read().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a partial first line (read from the middle), or a line being written
                if not isinstance(record, dict):
                    continue
                metrics = {k: v for k, v in record.items() if (k.startswith("eval_") or k.startswith("lmms/"))
                           and isinstance(v, (int, float))}
                if metrics:
                    last.update({**metrics, "step": record.get("step")})
        if last:
            found[f"{log_file.name}, step {last.pop('step')}"] = last
    report = run.report_file
    if report.is_file():
        try:
            data = json.loads(report.read_text())
            # keys in the image controls' vocabulary, an older version's report too (accuracy_blank -> _blanked)
            numbers = {current_key(k): v for k, v in data.items() if k.startswith("accuracy") or k == "chance"}
            if numbers:
                controls = " / ".join(c.name for c in IMAGE_CONTROLS)
                found[f"{report.name} (held-out answers: {controls} images)"] = numbers
        except (OSError, ValueError) as e:
            notes.append(f"{report} could not be read: {e}")
    return found
