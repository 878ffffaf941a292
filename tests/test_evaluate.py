"""`mmadapt eval` and `mmadapt sees` on a user's own data file, with a model trained by `mmadapt train`.

The task: name the colour of a noisy solid-colour image (4 colours), learnable by a tiny model in a few
dozen steps. A trained model must beat blanked and shuffled images; an untrained one must not.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import mmadapt
from mmadapt import evaluate
from mmadapt.cli import main

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
    (root / "run.yaml").write_text(
        "model: {encoder: clip, projector: mlp2x_gelu, backbone: llama, preset: tiny}\n"
        f"data: {{train: {train}, image_root: {root}, batch_size: 16}}\n"
        f"train: {{steps: 150, lr: 3.0e-3, warmup_steps: 5, out: {root / 'out'}, progress: false}}\n"
        "stages: {encoder: full, projector: full, backbone: full}\n")
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
    assert {"accuracy_images", "accuracy_blank", "accuracy_shuffled", "chance", "margin", "passed",
            "verdict"} <= set(report)
    assert report["accuracy_images"] >= 0.9 and report["passed"] and report["chance"] == 0.25
    assert report["max_new_tokens"] >= len("yellow.")  # fits the longest reference (char tokenizer)
    rows = [json.loads(line) for line in (root / "p.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and {"id", "reference", "images", "blank", "shuffled", "exact"} <= set(rows[0])
    assert (root / "r.png").stat().st_size > 1000
    assert [e["id"] for e in report["evidence"]] == ["eval-0", "eval-1"]
    assert all(Path(e["png"]).stat().st_size > 1000 and abs(sum(e["quadrants"].values()) - 1) < 1e-6
               for e in report["evidence"])
    out = capsys.readouterr().out
    assert "PASSED" in out and "contained" in out


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


def test_scoring_ignores_case_whitespace_and_final_punctuation():
    assert evaluate.exact(" Red. ", "red") and evaluate.exact("RED!", "red.") and not evaluate.exact("red car", "red")
    assert evaluate.contained("It is red.", "Red") and not evaluate.contained("green", "red")
    assert evaluate.chance_level(["a", "a", "b", "c"]) == 0.5


@pytest.mark.slow
def test_chat_answers_from_a_run_directory(trained, capsys):
    root, _ = trained
    assert main(["chat", str(root / "out"), "--image", str(root / "eval-2.png"), "What colour is this?"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].rstrip(".") == "blue"  # eval-2 is blue
