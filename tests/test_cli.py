"""The `mmadapt` console script."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import write_jsonl, write_run

from mmadapt import BACKBONES, ENCODERS, PROJECTORS
from mmadapt.cli import main


def test_list_prints_every_component(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for registry in (BACKBONES, ENCODERS, PROJECTORS):
        for name, spec in registry.items():
            assert name in out and spec.description in out


def test_check_model_reports_ok(capsys):
    assert main(["check-model", "clip", "mlp2x_gelu", "qwen3_5"]) == 0
    out = capsys.readouterr().out
    assert "contract: OK" in out and "projector gradient norm" in out


def test_unknown_name_is_a_clean_error(capsys):
    assert main(["check-model", "clip", "mlp", "llama"]) == 2
    assert "known: identity" in capsys.readouterr().err


@pytest.mark.slow
def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "mmadapt", "list"], capture_output=True, text=True, check=True)
    assert "qwen3_5_vit" in out.stdout


def test_train_with_a_missing_pretrained_part_is_one_line(tmp_path, capsys):
    write_run(tmp_path / "run.yaml", model={"backbone": {"name": "llama", "pretrained": f"{tmp_path}/vicuna"}},
              data={"train": write_jsonl(tmp_path / "train.jsonl", [])}, train={"out": tmp_path / "out"})
    assert main(["train", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: backbone 'llama': pretrained path {tmp_path}/vicuna does not exist (rerun with --debug " \
                  "for the traceback)"
    with pytest.raises(FileNotFoundError):
        main(["train", str(tmp_path / "run.yaml"), "--debug"])


@pytest.mark.parametrize(("yaml_text", "expected"), [
    ("data: {train: DIR/missing.jsonl}\n", "missing.jsonl"),
    ("data: {train: DIR/train.jsonl}\ntrain: {lr: fast}\n", "train.lr must be a number"),
    ("data: {train: DIR/train.jsonl}\nmodel: {encoder: clipp}\n", "unknown encoder 'clipp'; known: clip"),
    ("data: {train: DIR/train.jsonl\n", "while parsing"),
], ids=["missing-data-file", "bad-value", "unknown-name", "bad-yaml"])
def test_every_train_user_error_is_one_line(yaml_text, expected, tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "run.yaml").write_text(yaml_text.replace("DIR", str(tmp_path)))
    assert main(["train", str(tmp_path / "run.yaml"), f"train.out={tmp_path}/out"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
