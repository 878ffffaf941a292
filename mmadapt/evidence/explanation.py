"""One call: answer a question about an image, map the answer's evidence and measure the map (`mmadapt explain`).

    result = explain(model, processor, "cat.png", "What animal is this?", out="cat.evidence.png")
    result.answer, result.quadrants, result.map.pixels          # (H, W) over the original image
    print("\n".join(result.lines()))                            # what `mmadapt explain` prints

Contract: `explain` answers greedily (`mmadapt.answering.answer_prompts`, as `mmadapt chat` answers; a question with
its image is the parts [image, text], as everywhere), explains that answer with its `method` (default
`Occlusion()`), measures the map's faithfulness (`curve_steps` 0 skips it), draws it when `out` is given and returns
an `Explanation` that formats itself (`lines()`, `summary()`). `explain_records` does it for the single-image
records of an eval file (`mmadapt eval --evidence`): one `SampleEvidence` per map, gathered in an `EvidenceReport`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmadapt.answering import PromptInputs, answer_prompts
from mmadapt.data.geometry import Box
from mmadapt.evidence.drawing import render
from mmadapt.evidence.maps import MIN_EFFECT, EvidenceMap, completeness, evidence
from mmadapt.evidence.measure import CURVE_STEPS, Faithfulness, faithfulness
from mmadapt.evidence.methods import DEFAULT_METHOD, Method
from mmadapt.evidence.prompt import observed
from mmadapt.sampling import Sampling

EVIDENCE_INDEX = "index.json"  # beside the maps of `explain_records`: record id -> picture


@dataclass(frozen=True)
class Explanation:
    """An answer and its evidence: `answer` (text), `answer_ids` (without the end token), `map` (`EvidenceMap`,
    with its `faithfulness` when measured), `png` (the picture when drawn), the `prompt` and the `image` path
    (None for an in-memory image)."""

    answer: str
    answer_ids: tuple[int, ...]
    map: EvidenceMap
    png: Path | None = None
    prompt: str | None = None
    image: str | None = None

    @property
    def faithfulness(self) -> Faithfulness | None:
        return self.map.faithfulness

    @property
    def quadrants(self) -> dict[str, float]:
        return self.map.quadrants()

    @property
    def peak(self) -> tuple[int, int]:
        return self.map.peak()

    @property
    def peak_box(self) -> Box:
        return self.map.cell_box(*self.peak)

    @property
    def outside(self) -> float | None:
        return self.map.outside

    @property
    def completeness(self) -> float | None:
        return completeness([self.map])

    @property
    def image_effect(self) -> float | None:
        return self.map.image_effect

    @property
    def rests_on_image(self) -> bool:
        return self.map.rests_on_image

    def lines(self) -> list[str]:
        """What `mmadapt explain` prints under the answer: the method and where the evidence lies, the image effect
        against the method's own baseline, and the map's faithfulness (deletion / insertion) when measured."""
        heat, box, done = self.map, self.peak_box, self.completeness
        shares = ", ".join(f"{k.replace('_', '-')} {v:.1%}" for k, v in self.quadrants.items())
        lines = [f"evidence ({heat.rule} part, {heat.method.describe()}): {shares}; peak token {list(self.peak)} at "
                 f"x {box[0]:.0f}-{box[2]:.0f}, y {box[1]:.0f}-{box[3]:.0f}"
                 + ("" if done is None else f"; completeness {done:.2f}")]
        lines.append(f"image effect: log p(answer) is {self.image_effect:+.2f} nats with the image than with "
                     f"{heat.method.baseline_wording}"
                     + ("" if self.rests_on_image else
                        f" - below {MIN_EFFECT}: the model gives this answer about as readily without the image, so "
                        "the map has no evidence to show (it is noise)"))
        if self.faithfulness is not None:
            lines.append(self.faithfulness.line())
        return lines

    def summary(self) -> dict[str, Any]:
        """JSON-ready (`mmadapt explain --json`): the prompt, the image, the answer, the picture and the map's
        summary (`EvidenceMap.summary`, with the faithfulness)."""
        return {"prompt": self.prompt, "image": self.image, "answer": self.answer,
                "answer_ids": list(self.answer_ids), "png": None if self.png is None else str(self.png),
                "completeness": self.completeness, **self.map.summary()}


def explain(model: Any, processor: Any, image: Any, prompt: str | Sequence[Mapping[str, Any]], *,
            method: Method = DEFAULT_METHOD, rule: str = "positive", max_new_tokens: int = 32,
            out: str | os.PathLike | None = None, curve_steps: int = CURVE_STEPS, batch_size: int = 16, seed: int = 0,
            answer_ids: Sequence[int] | torch.Tensor | None = None,
            progress: Callable[[str, int, int], None] | None = None) -> Explanation:
    """Answer `prompt` about `image` greedily, map the answer's evidence onto the image and measure the map.

    `processor`: `mmadapt.Processor` of the model; `image`: a PIL image or a path (loaded like training data:
    EXIF rotation, RGB); `prompt`: one user turn, `<image>` where the image goes (default: before the text), or a
    whole conversation as `Processor` takes it (messages ending with the user's turn, `<image>` once in them).
    `answer_ids`: the answer to explain (e.g. a sampled one a chat showed, up to its end token), instead of the
    greedy one. `method`, `rule`, `batch_size`, `seed`: see `evidence`; `curve_steps`: points on the deletion and
    insertion curves (`faithfulness`; 0 skips the measurement); `out`: where to draw the map (PNG). `progress(stage,
    done, total)` hears each batch of forwards (stage "map", then "faithfulness"; what it raises stops the work).
    Cost in forwards of the whole model, default settings: occlusion 1 + windows (25 on a 4 x 4 grid, at most 114
    an image), rise 129, integrated 32 forwards + backwards; faithfulness 128. An empty answer (the end token
    first) is explained through that end token.
    """
    if curve_steps < 0 or curve_steps == 1:
        raise ValueError(f"curve_steps {curve_steps}: give at least 2 points on the deletion / insertion curves "
                         "(--curve-steps), or 0 to skip the faithfulness measurement")
    if not isinstance(method, Method):
        raise TypeError(f"unknown method {method!r}: give a method object, e.g. Occlusion(windows=(1, 2)), "
                        "Rise(samples=128) or Integrated(steps=32) from mmadapt.evidence")
    picture = processor.image(image)
    if isinstance(prompt, str):
        # the record's own text when it places the image ("<image>\n..." as trained), else the parts [image, text]
        question, text = prompt.replace("<image>", "").strip(), prompt if "<image>" in prompt else f"<image>{prompt}"
    else:
        text = list(prompt)
        question = next((str(m.get("content", "")) for m in reversed(text) if m.get("role") == "user"), "")
    prompted = PromptInputs.of(model, processor, processor(text, images=[picture]))
    inputs = prompted.inputs
    if answer_ids is None:  # the greedy answer, as `mmadapt chat` gives it
        (answer,) = answer_prompts(model, processor, prompted, sampling=Sampling(max_new_tokens=max_new_tokens))
        answer_ids, target = _until_end(torch.tensor(answer.token_ids, dtype=torch.long), processor.eos_token_ids)
    else:
        answer_ids, target = _until_end(torch.as_tensor(answer_ids, dtype=torch.long).flatten().cpu(),
                                        processor.eos_token_ids)
        if not target.numel():
            raise ValueError("answer_ids is empty: give the answer's ids (with its end token for an empty answer)")

    def stage(name: str) -> Callable[[int, int], None]:
        return lambda done, total: progress(name, done, total) if progress is not None else None

    with observed(stage("map")):
        (heat,) = evidence(model, inputs, target, method=method, images=[picture],
                           image_processor=processor.encoder.processor, rule=rule, batch_size=batch_size, seed=seed)
    if curve_steps:
        with observed(stage("faithfulness")):
            measured = faithfulness(model, inputs, target, [heat], steps=curve_steps, batch_size=batch_size, seed=seed)
        heat = dataclasses.replace(heat, faithfulness=measured)
    answer = processor.decode(answer_ids)
    png = None if out is None else render(picture, heat, out, prompt=question, answer=answer)
    return Explanation(answer, tuple(answer_ids.tolist()), heat, png, question,
                       os.fspath(image) if isinstance(image, (str, os.PathLike)) else None)


def _until_end(generated: torch.Tensor, ends: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the answer's ids before its first end token, the ids to explain: those, or the end token when empty)."""
    stop = next((k for k, token in enumerate(generated.tolist()) if token in ends), len(generated))
    return generated[:stop], generated[:stop] if stop else generated[:1]


# ---- many records: `mmadapt eval --evidence` ---------------------------------------------------------------------
@dataclass(frozen=True)
class SampleEvidence:
    """The explanation of one record's answer (`id`: the record's), measured (its map has `faithfulness`)."""

    id: str
    explanation: Explanation

    def line(self) -> str:
        """One line: where the picture is, the faithfulness and whether to trust the map."""
        measured = self.explanation.faithfulness
        note = ("" if measured.trusted else ", does NOT beat every random order" if measured.decisive
                else ", the answer barely depends on the pixels")
        return (f"evidence map of {self.id}: {self.explanation.png} (faithfulness {measured.score:+.2f}, beats "
                f"{measured.wins} of {measured.orders} random orders{note})")

    def summary(self) -> dict[str, Any]:
        result, measured = self.explanation, self.explanation.faithfulness
        return {"id": self.id, "answer": result.answer, "png": None if result.png is None else str(result.png),
                "quadrants": result.quadrants, "image_effect": result.image_effect,
                "rests_on_image": result.rests_on_image, "faithfulness": measured.score,
                "trusted": measured.trusted, "wins": measured.wins, "random_orders": measured.orders,
                "pixel_effect": measured.pixel_effect}


@dataclass(frozen=True)
class EvidenceReport:
    """The maps of an eval file's records (`explain_records`); `lines()`: the mean faithfulness over the maps
    whose answer rests on the pixels (nothing when none does)."""

    items: tuple[SampleEvidence, ...]

    def lines(self) -> list[str]:
        scored = [item.explanation.faithfulness for item in self.items if item.explanation.faithfulness.decisive]
        if not scored:
            return []
        return [f"evidence: mean faithfulness {sum(m.score for m in scored) / len(scored):+.2f} over the "
                f"{len(scored)} map(s) whose answer rests on the pixels (0 = a random map); "
                f"{sum(not m.trusted for m in scored)} do not beat every random order"]

    def summary(self) -> list[dict[str, Any]]:
        return [item.summary() for item in self.items]


def explain_records(model: Any, processor: Any, records: Sequence[Any], out: str | os.PathLike, *, limit: int,
                    image_root: str | os.PathLike | None = None,
                    on_result: Callable[[SampleEvidence], None] | None = None) -> EvidenceReport:
    """Explain the first `limit` records that have one image and one question (LLaVA or messages records, images
    under `image_root`), drawing each map as `out/NNN.png` (a counter: file names are never built from data) and
    listing them in `out/index.json` (`EVIDENCE_INDEX`: each map's record id, picture and summary, rewritten after
    each map); `on_result` sees each as it is done."""
    from mmadapt.data.samples import IMAGE, parse_record

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    items: list[SampleEvidence] = []
    for i, record in enumerate(records):
        if len(items) == limit:
            break
        sample = parse_record(record, i, image_root)
        users = [t for t in sample.turns if t.role == "user"]
        if len(sample.images) != 1 or len(users) != 1:
            continue  # maps are drawn for one image and one question
        prompt = users[0].text if IMAGE in users[0].text else f"{IMAGE}{users[0].text}"  # as `mmadapt eval` asks it
        result = explain(model, processor, sample.images[0], prompt, out=out / f"{len(items):03d}.png")
        items.append(SampleEvidence(sample.id, result))
        write_index(out, items)
        if on_result is not None:
            on_result(items[-1])
    return EvidenceReport(tuple(items))


def write_index(out: Path, items: Sequence[SampleEvidence]) -> Path:
    """`out/index.json`: the maps drawn so far (`SampleEvidence.summary`: id, png, ...), replaced atomically."""
    path = out / EVIDENCE_INDEX
    temporary = path.with_name(f".{EVIDENCE_INDEX}.tmp")
    temporary.write_text(json.dumps([item.summary() for item in items], indent=2) + "\n")
    os.replace(temporary, path)
    return path
