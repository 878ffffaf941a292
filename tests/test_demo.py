"""`mmadapt demo`: the digits data, generation prompts, the three evaluations, the verdict and the CLI exit code."""

from __future__ import annotations

import json

import pytest
import torch

import mmadapt
from mmadapt import Processor, demo, evaluate
from mmadapt.cli import main
from mmadapt.controls import BLANKED, SHUFFLED
from mmadapt.data import SampleEncoder, char_tokenizer
from mmadapt.sees import SeesImagesReport

REPORT_KEYS = {"accuracy_real", "accuracy_blanked", "accuracy_shuffled", "chance", "margin", "passed", "verdict",
               "steps", "seconds", "train_seconds", "sees_images_before", "sees_images_after", "files"}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    train, held_out = demo.digit_records(root, image_size=32, seed=0)
    return root, train, held_out


@pytest.mark.slow
def test_digit_records_are_llava_jsonl_with_png_images_and_a_stratified_split(digits):
    root, train, held_out = digits
    assert len(train) + len(held_out) == 1797 and len(held_out) == 360
    assert not {r["id"] for r in train} & {r["id"] for r in held_out}
    lines = (root / "eval.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == held_out
    record = held_out[0]
    assert record["conversations"][0] == {"from": "human", "value": "<image>\nWhat digit is this?"}
    assert record["conversations"][1]["from"] == "gpt" and record["conversations"][1]["value"] in "0123456789"
    from PIL import Image

    assert Image.open(root / record["image"]).size == (32, 32)
    shares = [sum(demo.answer_of(r) == str(d) for r in held_out) / len(held_out) for d in range(10)]
    assert max(shares) - min(shares) < 0.02  # stratified: every digit about 1/10
    chance = evaluate.chance_level([demo.answer_of(r) for r in held_out], classes=10)
    assert chance == pytest.approx(max(0.1, max(shares)))


@pytest.mark.parametrize("names", [("qwen3_5_vit", "qwen_merger", "qwen3_5"), ("clip", "mlp2x_gelu", "llama")])
def test_encode_prompt_drops_the_answer_and_adds_the_generation_prompt(digits, names):
    root, _, held_out = digits
    model = mmadapt.build_model(*names)
    encoder = SampleEncoder.for_model(model, char_tokenizer(), image_root=str(root))
    full, prompt = encoder.encode(held_out[0], 0), encoder.encode_prompt(held_out[0], 0)
    text = encoder.tokenizer.decode(prompt.input_ids.tolist())
    answer_start = int((full.labels != -100).nonzero()[0])
    assert (prompt.labels == -100).all()
    prefix = full.input_ids[:answer_start]
    assert torch.equal(prompt.input_ids, prefix)  # exactly what preceded the answer in training
    assert text.endswith("<|im_start|>assistant\n" if names[2] == "qwen3_5" else " ASSISTANT:")
    assert torch.equal(prompt.pixel_values, full.pixel_values) and prompt.tokens_per_image == full.tokens_per_image
    assert encoder.tokenizer.convert_tokens_to_ids("<|im_end|>" if names[2] == "qwen3_5" else "</s>") in Processor(
        encoder, None).eos_token_ids  # answers end at the template's end of turn


def test_blanked_and_shuffled_prompts_keep_every_span_and_move_every_image(digits):
    root, _, held_out = digits
    model = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5")
    encoder = SampleEncoder.for_model(model, char_tokenizer(), image_root=str(root))
    prompts = [encoder.encode_prompt(r, i) for i, r in enumerate(held_out[:5])]
    blank, shuffled = BLANKED.samples(prompts), SHUFFLED.samples(prompts)
    for k, p in enumerate(prompts):
        assert not blank[k].pixel_values.any() and torch.equal(blank[k].input_ids, p.input_ids)
        assert torch.equal(shuffled[k].pixel_values, prompts[(k + 1) % 5].pixel_values)
        assert torch.equal(shuffled[k].input_ids, p.input_ids)
        assert torch.equal(shuffled[k].image_grid_thw, p.image_grid_thw)


def test_the_verdict_needs_the_margin_over_both_blank_and_shuffled():
    base, given = {"real": 0.5, "blanked": 0.1, "shuffled": 0.1}, {"chance": 0.1, "margin": 0.2}
    assert evaluate.verdict(base, **given)[0]
    assert not evaluate.verdict({**base, "shuffled": 0.35}, **given)[0]
    assert not evaluate.verdict({**base, "blanked": 0.45}, **given)[0]
    passed, text = evaluate.verdict({**base, "real": 0.12}, **given)
    assert not passed and text.startswith("FAILED") and "margin 0.20" in text


def test_a_rerun_replaces_the_previous_demo_outputs_and_another_runs_directory_is_refused(tmp_path):
    demo.prepare_out(tmp_path / "demo")
    (tmp_path / "demo" / "checkpoints" / "step-0000300").mkdir(parents=True)
    (tmp_path / "demo" / "log.jsonl").write_text("{}\n")
    demo.prepare_out(tmp_path / "demo")  # a shorter rerun must not lose its checkpoint to the old step 300
    assert not (tmp_path / "demo" / "checkpoints").exists() and not (tmp_path / "demo" / "log.jsonl").exists()
    (tmp_path / "train" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="another run's outputs"):
        demo.prepare_out(tmp_path / "train")
    assert main(["demo", "--out", str(tmp_path / "train")]) == 2  # the CLI says why, before any work


@pytest.mark.slow
def test_a_short_demo_run_passes_its_verdict_and_writes_every_output(tmp_path, monkeypatch, capsys):
    """Run as a new user runs it (a relative --out); then served from another directory, the page's examples are the
    run's held-out digits (its config's data paths are absolute), not scikit-image's photographs."""
    out = tmp_path / "runs" / "demo"
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--steps", "100", "--out", "runs/demo", "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert REPORT_KEYS <= set(report)
    assert report["passed"] and report["steps"] == 100
    assert report["accuracy_real"] >= report["accuracy_blanked"] + report["margin"]
    assert report["accuracy_real"] >= report["accuracy_shuffled"] + report["margin"]
    assert report["chance"] == pytest.approx(0.1, abs=0.01)
    assert report["sees_images_before"]["ok"] and report["sees_images_after"]["ok"]
    for name in ("loss.png", "predictions.png", "log.jsonl", "data/train.jsonl", "data/eval.jsonl"):
        assert (out / name).stat().st_size > 0, name
    printed = capsys.readouterr().out
    assert "PASSED" in printed and "real images" in printed and "shuffled images" in printed

    pytest.importorskip("gradio")
    from mmadapt.serve.examples import default_examples

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    held_out = [json.loads(line)["id"] for line in (out / "data" / "eval.jsonl").read_text().splitlines()]
    examples = default_examples(out / "model", elsewhere)
    assert examples and [e.name for e in examples] == held_out[: len(examples)]
    assert {e.question for e in examples} == {demo.QUESTION}


def test_the_cli_exits_non_zero_when_the_model_does_not_read_the_images(monkeypatch, tmp_path, capsys):
    def blind_run(**kwargs):  # what a model that ignores its images scores
        accuracy = {"real": 0.11, "blanked": 0.10, "shuffled": 0.12}
        scored = evaluate.EvalReport(accuracy=accuracy, contained=accuracy, chance=0.10, margin=kwargs["margin"],
                                     samples=360, max_new_tokens=5)
        sees = SeesImagesReport(loss=2.3, loss_blanked=2.3, loss_shuffled=2.3, grad_projector=0.0, grad_encoder=None,
                                images=16, images_shuffled=16)
        return demo.DemoReport(evaluation=scored, steps=kwargs["steps"], skipped=0, train_seconds=1.0, final_loss=1.2,
                               model={}, hyperparameters={}, train_samples=1437, eval_samples=360, sees_before=sees,
                               sees_after=sees, files={"loss_curve": "loss.png", "predictions": "predictions.png"},
                               seconds=2.0, out=str(kwargs["out"]))

    monkeypatch.setattr(demo, "run_demo", blind_run)
    assert main(["demo", "--steps", "1", "--out", str(tmp_path), "--no-progress"]) == 1
    printed = capsys.readouterr().out
    assert "FAILED" in printed and "blanked images   0.100" in printed and f"report {tmp_path}/report.json" in printed
    report = blind_run(margin=0.2, steps=1, out=tmp_path)
    assert REPORT_KEYS <= set(report.to_dict()) and not report.to_dict()["passed"]
