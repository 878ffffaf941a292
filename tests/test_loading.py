"""`mmadapt.loading`: one loader for what training and `mmadapt export` leave (a model directory, a transformers export,
a run, a LoRA checkpoint, a base model + adapters), below training in the layers; the commands that only answer
(`serve`, `chat`) import nothing of training, run as a user runs them (a fresh process)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import lora_run

from mmadapt.loading import TrainedWith, load_for_inference, load_trained
from mmadapt.synthetic import synthetic_batch
from mmadapt.train.checkpoint import latest_checkpoint
from mmadapt.train.export import export

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 3-step run whose backbone trains LoRA (so its checkpoints hold LoRA layers and its adapters stand alone)."""
    out = tmp_path_factory.mktemp("loading")
    lora_run(out, ["stages.encoder=frozen", "stages.projector=frozen", "stages.backbone=lora"])
    return out / "run"


def test_every_source_loads_the_same_model(run, tmp_path):
    """OUT/model, the run, its LoRA checkpoint (layers rebuilt from `TrainedWith`, merged), its transformers export and
    the base model + OUT/adapters give OUT/model's logits."""
    export(run, tmp_path / "hf", format="transformers")
    checkpoint = latest_checkpoint(run)
    assert TrainedWith.read(checkpoint).stages.modes()["backbone"] == "lora"
    expected = load_for_inference(run / "model")[0].eval()
    batch = synthetic_batch(expected, [1, 2], text_lengths=[7, 5], seed=1)
    with torch.no_grad():
        reference = expected(**batch).logits
        for name, source in {"run": (run,), "checkpoint": (checkpoint,), "transformers export": (tmp_path / "hf",),
                             "base + adapters": (run.parent / "base", run / "adapters")}.items():
            model, tokenizer = load_for_inference(*source)
            assert tokenizer is not None, name
            torch.testing.assert_close(model.eval()(**batch).logits, reference, rtol=0, atol=1e-5, msg=name)


def test_a_checkpoints_unknown_run_setting_is_named_with_the_closest_key(run, tmp_path):
    """A checkpoint whose config.yaml's lora section holds a key mmadapt does not know: the run config's own error
    (closest key, the valid ones), not a crash inside peft."""
    copy = shutil.copytree(latest_checkpoint(run), tmp_path / "step")
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["lora"]["alhpa"] = config["lora"].pop("alpha")
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=r"unknown config key 'lora\.alhpa'\. Did you mean 'lora\.alpha'\?"):
        load_trained(copy, verify=False)


def test_serve_and_chat_import_nothing_of_training(run, tmp_path):
    """The API built over a run (`mmadapt serve`'s app, `load_app`) and `mmadapt chat` over a LoRA checkpoint, in one
    fresh process: no module of mmadapt.train is imported (the trainer, the objectives, nor the package itself)."""
    code = "\n".join([
        "import sys",
        "from mmadapt.cli import main",
        "from mmadapt.serve import ServeSettings, load_app",
        f"app = load_app({str(run)!r}, settings=ServeSettings(name='tiny'))",
        "app.state.service.close()",
        f"assert main(['chat', {str(latest_checkpoint(run))!r}, '--max-new-tokens', '2', 'Hi']) == 0",
        "print('TRAINING', sorted(m for m in sys.modules if m == 'mmadapt.train' or m.startswith('mmadapt.train.')))",
        "print('LOADING', 'mmadapt.loading' in sys.modules, 'mmadapt.lora' in sys.modules)",
    ])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TRAINING []" in done.stdout and "LOADING True True" in done.stdout, done.stdout[-2000:]
