"""`mmadapt eval` and `mmadapt sees` on a user's own data file, with a model trained by `mmadapt train`.

The task: name the colour of a noisy solid-colour image (4 colours), learnable by a tiny model in a few
dozen steps. A trained model must beat blanked and shuffled images; an untrained one must not.

Videos (mechanics, untrained model, synthetic samples and a stand-in sample encoder): `predict` passes the videos
to `generate`, the blanked / shuffled / reversed controls change only the pixels they should, and a report of
prompts with videos adds the reversed control while an image-only report keeps its keys.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import TINY_LLAVA, write_run
from PIL import Image

import mmadapt
from mmadapt import evaluate
from mmadapt.cli import main
from mmadapt.controls import BLANKED, REVERSED, SHUFFLED
from mmadapt.data import Collator
from mmadapt.synthetic import synthetic_samples, synthetic_video_samples

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}


def write_colours(root, n: int, name: str, seed: int) -> str:
    rng = np.random.default_rng(seed)
    records = []
    for k in range(n):
        colour = list(COLOURS)[k % len(COLOURS)]
        pixels = np.clip(np.array(COLOURS[colour]) + rng.normal(0, 25, (32, 32, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / f"{name}-{k}.png")
        records.append({"id": f"{name}-{k}", "image": f"{name}-{k}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is this?"}, {"from": "gpt", "value": f"{colour}."}]})
    path = root / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("colours")
    train, held_out = write_colours(root, 96, "train", 0), write_colours(root, 24, "eval", 1)
    write_run(root / "run.yaml", model=TINY_LLAVA, data={"train": train, "image_root": root, "batch_size": 16},
              train={"steps": 150, "lr": 3.0e-3, "warmup_steps": 5, "out": root / "out", "progress": False},
              stages={"encoder": "full", "projector": "full", "backbone": "full"})
    assert main(["train", str(root / "run.yaml")]) == 0
    return root, held_out


@pytest.mark.slow
def test_eval_reports_three_ways_and_the_trained_model_passes(trained, capsys):
    root, held_out = trained
    args = ["eval", str(root / "out"), held_out, "--json", str(root / "r.json"), "--predictions",
            str(root / "p.jsonl"), "--plot", str(root / "r.png"), "--require-sees", "--evidence", "2",
            "--evidence-dir", str(root / "maps")]
    assert main(args) == 0
    report = json.loads((root / "r.json").read_text())
    assert {"accuracy_real", "accuracy_blanked", "accuracy_shuffled", "chance", "margin", "passed",
            "verdict"} <= set(report)
    assert report["accuracy_real"] >= 0.9 and report["passed"] and report["chance"] == 0.25
    assert report["max_new_tokens"] >= len("yellow.")  # fits the longest reference (char tokenizer)
    rows = [json.loads(line) for line in (root / "p.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and {"id", "reference", "real", "blanked", "shuffled", "exact"} <= set(rows[0])
    assert (root / "r.png").stat().st_size > 1000
    assert [e["id"] for e in report["evidence"]] == ["eval-0", "eval-1"]
    assert all(Path(e["png"]).stat().st_size > 1000 and abs(sum(e["quadrants"].values()) - 1) < 1e-6
               for e in report["evidence"])
    assert all(isinstance(e["faithfulness"], float) and e["random_orders"] == 8
               and e["trusted"] == (e["pixel_effect"] >= 0.1 and e["wins"] == 8) for e in report["evidence"])
    out = capsys.readouterr().out
    assert "PASSED" in out and "contained" in out
    maps = [line for line in out.splitlines() if line.startswith("evidence map of ")]
    assert [m.split(":")[0] for m in maps] == ["evidence map of eval-0", "evidence map of eval-1"]
    assert all(f"(faithfulness {e['faithfulness']:+.2f}, beats {e['wins']} of 8 random orders" in m
               for e, m in zip(report["evidence"], maps, strict=True))
    resting = [e for e in report["evidence"] if e["pixel_effect"] >= 0.1]
    assert any(line.startswith("evidence: mean faithfulness ") for line in out.splitlines()) == bool(resting)


@pytest.mark.slow
def test_eval_of_an_untrained_model_fails_under_require_sees(trained, tmp_path, capsys):
    root, held_out = trained
    torch.manual_seed(0)
    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama")
    from mmadapt.data import char_tokenizer, prepare_tokenizer

    tokenizer = char_tokenizer()
    prepare_tokenizer(model, tokenizer)
    model.save_pretrained(tmp_path / "untrained", tokenizer=tokenizer)
    assert main(["eval", str(tmp_path / "untrained"), held_out, "--image-root", str(root), "--require-sees"]) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.slow
def test_sees_prints_a_table_and_an_exit_code(trained, capsys):
    root, held_out = trained
    assert main(["sees", str(root / "out" / "model"), held_out, "--batches", "2", "--batch-size", "6"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].split()[:4] == ["batch", "loss", "blanked", "shuffled"] and len(lines) == 4
    assert "the model sees its images on 2 batch(es)" in lines[-1]
    # the same records as Parquet with the images embedded, and as WebDataset shards: the same table
    import datasets

    from mmadapt.data.stream import write_shards

    records = [json.loads(line) for line in Path(held_out).read_text().splitlines()]
    blobs = [(root / r["image"]).read_bytes() for r in records]
    (root / "parquet").mkdir(exist_ok=True)
    cells = [{**r, "image": {"bytes": b, "path": None}} for r, b in zip(records, blobs, strict=True)]
    table = datasets.Dataset.from_list(cells).cast_column("image", datasets.Image())
    table.to_parquet(str(root / "parquet" / "eval.parquet"))
    write_shards(root / "shards", [{"__key__": r["id"], "png": b, "json": json.dumps(
        {k: v for k, v in r.items() if k != "image"}).encode()} for r, b in zip(records, blobs, strict=True)], 12)
    for source in (root / "parquet" / "eval.parquet", root / "shards"):
        assert main(["sees", str(root / "out" / "model"), str(source), "--batches", "2", "--batch-size", "6"]) == 0
        assert capsys.readouterr().out.replace(str(source), "DATA") == out.replace(held_out, "DATA"), source


def test_scoring_ignores_case_whitespace_and_final_punctuation():
    assert evaluate.exact(" Red. ", "red") and evaluate.exact("RED!", "red.") and not evaluate.exact("red car", "red")
    assert evaluate.contained("It is red.", "Red") and not evaluate.contained("green", "red")
    assert evaluate.chance_level(["a", "a", "b", "c"]) == 0.5


@pytest.mark.slow
def test_chat_answers_from_a_run_directory(trained, capsys):
    root, _ = trained
    assert main(["chat", str(root / "out"), "--image", str(root / "eval-2.png"), "What colour is this?"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].rstrip(".") == "blue"  # eval-2 is blue


# ---- videos (mechanics) ----------------------------------------------------------------------------------
END = 7


class Encoder:
    """Stands in for `SampleEncoder` in `evaluate_records`: prompt i is the i-th prepared sample; tokens decode to
    their ids, and token END ends a turn."""

    pad_token_id = 0
    image_token_id = video_token_id = None  # not counted here

    def __init__(self, samples):
        self.samples = samples
        self.tokenizer = SimpleNamespace(convert_tokens_to_ids=lambda token: END, eos_token_id=None,
                                         decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
        self.template = SimpleNamespace(end_of_turn=lambda tokenizer: "<end>")

    def encode_prompt(self, record, index):
        return self.samples[index]


def records_for(samples):
    return [{"id": s.id, "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "1"}]}
            for s in samples]


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    return mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5").eval()


def video_prompts(model):
    """Four prompts: two with one 4-frame video each (one grid), one with a 2-frame video (t = 1) and an image,
    one with an image only."""
    return synthetic_video_samples(model, (("video",), ("video",), ("video", "image"), ("image",)),
                                   video_shapes=((4, 32, 48), (4, 32, 48), (2, 32, 32)),
                                   image_sides=(32, 32), text_lengths=(3, 3, 3, 3), seed=2)


def test_predict_passes_videos_to_generate(qwen, monkeypatch):
    prompts = video_prompts(qwen)
    collate = Collator.for_model(qwen, pad_token_id=0)
    seen = []
    generate = qwen.generate
    monkeypatch.setattr(qwen, "generate", lambda *a, **kw: seen.append(kw) or generate(*a, **kw))
    answers = evaluate.predict(qwen, Encoder(prompts), collate, prompts, max_new_tokens=3)
    assert len(answers) == 4
    assert seen[0]["video_grid_thw"].tolist() == [[2, 4, 6], [2, 4, 6], [1, 4, 4]]
    assert seen[0]["videos_per_sample"].tolist() == [1, 1, 1, 0]
    assert seen[0]["pixel_values_videos"].shape[0] == 2 * 2 * 24 + 16


def test_blanked_shuffled_and_reversed_videos(qwen):
    prompts = video_prompts(qwen)
    blank = BLANKED.samples(prompts)
    assert all(b.pixel_values_videos is None or not b.pixel_values_videos.any() for b in blank)
    assert all(b.pixel_values is None or not b.pixel_values.any() for b in blank)
    moved = SHUFFLED.samples(prompts)
    # the two 4-frame videos trade places; the 2-frame one has no partner; images move among equal grids
    assert torch.equal(moved[0].pixel_values_videos, prompts[1].pixel_values_videos)
    assert torch.equal(moved[1].pixel_values_videos, prompts[0].pixel_values_videos)
    assert torch.equal(moved[2].pixel_values_videos, prompts[2].pixel_values_videos)
    assert torch.equal(moved[2].pixel_values, prompts[3].pixel_values)
    assert moved[3].pixel_values_videos is None and torch.equal(moved[3].pixel_values, prompts[2].pixel_values)
    reordered = REVERSED.samples(prompts)
    first = prompts[0].pixel_values_videos
    assert torch.equal(reordered[0].pixel_values_videos, torch.cat([first[24:], first[:24]]))
    assert torch.equal(reordered[2].pixel_values_videos, prompts[2].pixel_values_videos)  # t == 1: nothing to reorder
    assert reordered[3] is prompts[3]
    assert all(len(a) == len(b) for a, b in zip(reordered, prompts, strict=True))


def test_a_report_with_videos_adds_the_reversed_control(qwen):
    prompts = video_prompts(qwen)
    collate = Collator.for_model(qwen, pad_token_id=0)
    report = evaluate.evaluate_records(qwen, Encoder(prompts), collate, records_for(prompts), max_new_tokens=2)
    assert report.variants == ("real", "blanked", "shuffled", "reversed") == evaluate.VIDEO_VARIANTS
    assert {"reversed"} <= set(report.accuracy) & set(report.contained)
    assert {"accuracy_reversed", "contained_reversed"} <= set(report.to_dict())
    assert {"reversed"} <= set(report.predictions[0]) and "reversed" in report.predictions[0]["exact"]
    assert "frames reversed" in report.verdict


def test_an_image_only_report_keeps_its_keys(qwen):
    prompts = [dataclasses.replace(s, labels=torch.full_like(s.labels, -100))
               for s in synthetic_samples(qwen, (1, 1), image_sides=[32, 32], seed=1)]
    collate = Collator.for_model(qwen, pad_token_id=0)
    report = evaluate.evaluate_records(qwen, Encoder(prompts), collate, records_for(prompts), max_new_tokens=2)
    assert report.variants == evaluate.VARIANTS
    assert not any("reversed" in key for key in report.to_dict()) and set(report.predictions[0]) == {
        "id", "reference", "real", "blanked", "shuffled", "exact"}
    assert "real images beat the better of blanked images / shuffled images" in report.verdict


def test_the_video_verdict_needs_real_inputs_to_beat_frames_reversed():
    base = {"real": 0.95, "blanked": 0.5, "shuffled": 0.5, "reversed": 0.1}
    given = {"chance": 0.5, "margin": 0.2}
    assert evaluate.verdict(base, **given)[0]
    passed, text = evaluate.verdict({**base, "reversed": 0.9}, **given)
    assert not passed and "frames reversed 0.900" in text and "FAILED" in text
    assert not evaluate.verdict({**base, "blanked": 0.8}, **given)[0]
    image_only = {k: v for k, v in base.items() if k != "reversed"}
    assert evaluate.verdict(image_only, **given)[0] and "frames" not in evaluate.verdict(image_only, **given)[1]


def test_the_report_prints_the_eval_table_and_writes_the_json_keys(tmp_path):
    report = evaluate.EvalReport(accuracy={"real": 0.95, "blanked": 0.25, "shuffled": 0.5, "reversed": 0.125},
                                 contained={"real": 1.0, "blanked": 0.25, "shuffled": 0.5, "reversed": 0.25},
                                 chance=0.25, margin=0.2, samples=8, max_new_tokens=6,
                                 skipped_samples=({"id": "x", "problem": "bad"},),
                                 predictions=({"id": "a", "reference": "red", "real": "red", "blanked": "blue",
                                               "shuffled": "red", "reversed": "green",
                                               "exact": {"real": True, "blanked": False, "shuffled": True,
                                                         "reversed": False}},))
    passed, text = evaluate.verdict(report.accuracy, chance=0.25, margin=0.2)
    assert (report.passed, report.verdict) == (passed, text) and passed and report.skipped == 1
    assert str(report).splitlines() == [
        "8 samples (1 skipped), up to 6 new tokens",
        "with            exact  contained",
        "real            0.950      1.000",
        "blanked         0.250      0.250",
        "shuffled        0.500      0.500",
        "reversed        0.125      0.250",
        "chance          0.250",
        text]
    assert list(report.to_dict()) == [
        "accuracy_real", "contained_real", "accuracy_blanked", "contained_blanked", "accuracy_shuffled",
        "contained_shuffled", "accuracy_reversed", "contained_reversed", "chance", "margin", "samples",
        "skipped", "skipped_samples", "max_new_tokens", "passed", "verdict"]
    assert report.to_dict()["accuracy_reversed"] == 0.125 and report.answers("blanked") == ["blue"]
    evaluate.write_predictions(report, tmp_path / "p.jsonl")
    assert [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()] == list(report.predictions)
