"""Sharded (DCP) training checkpoints read back: loaded for inference and exported without a gather.

The twins: the same tiny LoRA run (same seed) trained twice, its checkpoints written gathered
(`checkpoint.format: gathered`) and sharded (the default).

- `test_a_sharded_checkpoint_loads_as_its_gathered_twin`: `load_for_inference` (chat, eval, serve, a reference /
  teacher model) reads a sharded checkpoint through `Checkpoint.open` into bitwise the model of its gathered twin; its
  `files` are the state files (provenance).
- `test_export_from_sharded_equals_export_from_gathered` (and `test_transformers_...`; LoRA in the run): the same
  file names, the same index, bitwise-equal tensors (the runs' own OUT/model too), and the streaming export never
  holds more tensor bytes than about one file's.
- `test_export_command_on_a_sharded_checkpoint_directory`: `mmadapt export CHECKPOINT DST` as a user runs it.
- `test_tied_embeddings_export_from_sharded`: the same with a tied backbone (both names in the state, or one; one in
  the files).
- `test_streamed_export_peak_memory_stays_below_the_model` (slow): a process's peak memory while exporting a ~460 MiB
  checkpoint (both formats) grows by under half the model; loading it whole grows it by more than the model.
- `test_hostile_metadata_is_refused_and_runs_nothing`, `test_a_missing_shard_is_caught_before_loading`,
  `test_a_state_without_a_models_tensor_is_refused_before_writing`: a sharded checkpoint that names code in its
  `.metadata`, lacks a shard or lacks a tensor is refused with an error naming it, before anything is written.
- `test_a_full_disk_during_a_sharded_export_keeps_the_previous_model` (both formats): the target intact, nothing left.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import lora_run, rehash
from safetensors import safe_open

from mmadapt import ModelConfig
from mmadapt.loading import load_for_inference, load_trained
from mmadapt.run_directory import RunDirectory
from mmadapt.sharded_checkpoint import is_sharded

LORA = ["stages.preset=lora", "checkpoint.format=gathered"]


def make_twins(out: Path, config: ModelConfig | None = None) -> tuple[Path, Path]:
    """(gathered run, sharded run): the same tiny 3-step LoRA run (same seed, same weights) twice, its checkpoints
    written gathered (`checkpoint.format: gathered`, mmadapt < 0.26's format) and sharded (the default)."""
    lora_run(out / "gathered", LORA, config=config)
    lora_run(out / "sharded", ["stages.preset=lora"], config=config)
    gathered, sharded = out / "gathered" / "run", out / "sharded" / "run"
    assert not (newest(gathered) / "state").exists() and is_sharded(newest(sharded))
    return gathered, sharded


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> tuple[Path, Path]:
    return make_twins(tmp_path_factory.mktemp("twins"))


def newest(run: Path) -> Path:
    return RunDirectory(run).checkpoints(complete=True)[-1]


def test_a_sharded_checkpoint_loads_as_its_gathered_twin(twins, monkeypatch):
    from mmadapt import weights
    from mmadapt.weights import Checkpoint

    monkeypatch.setattr(weights, "SHARDED_BATCH_BYTES", 20_000)  # many batches (and a batch of one big tensor)
    gathered, sharded = twins
    checkpoint = Checkpoint.open(newest(sharded))
    assert [f.relative_to(checkpoint.path).parts[0] for f in checkpoint.files] == ["state"] * len(checkpoint.files)
    assert any(f.name == ".metadata" for f in checkpoint.files)
    ours, _ = load_for_inference(newest(sharded))
    theirs, _ = load_trained(newest(gathered))
    assert not any("lora_" in k for k in ours.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


def same_directories(ours: Path, theirs: Path, *, ignore: tuple[str, ...] = ()) -> None:
    """The same file names, the same bytes for every file but weights (bitwise-equal tensors, the same safetensors
    metadata) and `ignore`d ones."""
    names = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*") if p.is_file())
    assert sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*") if p.is_file()) == names
    for name in names:
        if name in ignore:
            continue
        if not name.endswith(".safetensors"):
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
            continue
        with safe_open(str(ours / name), framework="pt") as a, safe_open(str(theirs / name), framework="pt") as b:
            assert a.metadata() == b.metadata(), name
            assert list(a.keys()) == list(b.keys()), name
            for key in b.keys():
                x, y = a.get_tensor(key), b.get_tensor(key)
                assert x.dtype == y.dtype and torch.equal(x, y), f"{name}: {key}"


def test_export_from_sharded_equals_export_from_gathered(twins, tmp_path):
    from mmadapt.loading import TrainedWith
    from mmadapt.train.export import export
    from mmadapt.train.sharded_export import export_sharded

    gathered, sharded = twins
    export(gathered, tmp_path / "gathered", max_shard_size="200KB")
    checkpoint = newest(sharded)
    done = export_sharded(checkpoint, tmp_path / "streamed", TrainedWith.read(checkpoint),
                          tokenizer=load_trained(checkpoint)[1], max_shard_size="200KB")
    assert len(done.files) > 3 and "model.safetensors.index.json" in done.files  # the model spans several files
    same_directories(tmp_path / "streamed", tmp_path / "gathered")
    assert done.model_bytes == sum(p.stat().st_size for p in (tmp_path / "gathered").glob("model-*.safetensors")) - sum(
        8 + int.from_bytes((p.read_bytes()[:8]), "little") for p in (tmp_path / "gathered").glob("model-*.safetensors"))
    # one file's tensors (<= 200 KB, plus the LoRA factors of its modules) at a time, never the model's 800 KB
    assert done.peak_bytes < 300_000 < done.model_bytes, done
    export(sharded, tmp_path / "run-export", max_shard_size="200KB")  # a run whose newest checkpoint is sharded
    same_directories(tmp_path / "run-export", tmp_path / "gathered")
    same_directories(sharded / "model", gathered / "model")  # each run's OUT/model, the trainer's own export


def test_transformers_export_from_sharded_equals_export_from_gathered(twins, tmp_path):
    from mmadapt.train.export import export

    sharded = twins[1]
    for name, run in zip(("gathered", "sharded"), twins, strict=True):
        export(newest(run), tmp_path / name, format="transformers", max_shard_size="200KB")
    assert (tmp_path / "gathered" / "model.safetensors.index.json").is_file()
    same_directories(tmp_path / "sharded", tmp_path / "gathered", ignore=("mmadapt_export.json",))
    ours, theirs = (json.loads((tmp_path / d / "mmadapt_export.json").read_text()) for d in ("sharded", "gathered"))
    assert ours["loaded_from"]["path"] == str(newest(sharded).resolve())
    assert ours["loaded_from"]["files"][0].startswith("state/")  # the checksum of the state files read
    assert {k: v for k, v in ours.items() if k != "loaded_from"} == {k: v for k, v in theirs.items()
                                                                     if k != "loaded_from"}


def test_tied_embeddings_export_from_sharded(tmp_path):
    """A LoRA run of a backbone with tied embeddings: the streamed export stores them once, under the same name and
    alias as the gathered one, and loads tied; the transformers export equals the gathered one's too."""
    from torch.distributed.checkpoint import save

    from mmadapt import VisionLanguageModel
    from mmadapt.sharded_checkpoint import ModelTensors
    from mmadapt.train.export import export

    config = ModelConfig.from_names("qwen3_5_vit", "qwen_merger", "qwen3_5")
    config.backbone.options = {"tie_word_embeddings": True}
    gathered, sharded = make_twins(tmp_path, config)
    tied = {"backbone.lm_head.weight", "backbone.model.embed_tokens.weight"}
    assert tied <= set(ModelTensors(newest(sharded)).keys())  # the trainer's state holds both names
    for name, run in (("gathered", gathered), ("sharded", sharded)):
        export(run, tmp_path / f"{name}-export", max_shard_size="200KB")
    same_directories(tmp_path / "sharded-export", tmp_path / "gathered-export")
    index = json.loads((tmp_path / "sharded-export" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["aliases"] == {"backbone.lm_head.weight": "backbone.model.embed_tokens.weight"}
    model = VisionLanguageModel.from_pretrained(tmp_path / "sharded-export")
    assert model.backbone.lm_head.weight is model.backbone.model.embed_tokens.weight
    for name, run in (("gathered", gathered), ("sharded", sharded)):
        export(newest(run), tmp_path / f"{name}-hf", format="transformers", max_shard_size="200KB")
    same_directories(tmp_path / "sharded-hf", tmp_path / "gathered-hf", ignore=("mmadapt_export.json",))
    one_name = tmp_path / "one" / "checkpoints" / newest(sharded).name  # a state holding the tied tensor once
    shutil.copytree(newest(sharded), one_name, ignore=shutil.ignore_patterns("state"))
    tensors = ModelTensors(newest(sharded))
    save({"model": tensors.read(k for k in tensors.keys() if k != "backbone.model.embed_tokens.weight")},
         checkpoint_id=one_name / "state", no_dist=True)
    export(rehash(one_name), tmp_path / "one-export", max_shard_size="200KB")
    same_directories(tmp_path / "one-export", tmp_path / "gathered-export")


def test_export_command_on_a_sharded_checkpoint_directory(twins, tmp_path):
    """`mmadapt export CHECKPOINT DST` as a user runs it: a process of its own, in a fresh directory."""
    from mmadapt.train.export import export

    gathered, sharded = twins
    export(newest(gathered), tmp_path / "gathered", max_shard_size="300KB")
    work = tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, "-m", "mmadapt", "export", str(newest(sharded)), "exported", "--max-shard-size", "300KB"]
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote exported" in done.stdout
    same_directories(work / "exported", tmp_path / "gathered")
    bad = subprocess.run([*cmd[:-1], "300 bytes"], cwd=work, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'300 bytes' is not a size" in bad.stderr


def test_hostile_metadata_is_refused_and_runs_nothing(twins, tmp_path):
    """A `.metadata` that names a function (here `os.system`, which would create a file) is refused before anything
    of it is built, even when the checkpoint's marker was rewritten to match it."""
    from mmadapt.sharded_checkpoint import UnsafeCheckpointError
    from mmadapt.train.export import export

    checkpoint = tmp_path / "checkpoints" / newest(twins[1]).name
    shutil.copytree(newest(twins[1]), checkpoint)
    ran = tmp_path / "code-ran"

    class Hostile:
        def __reduce__(self):
            return os.system, (f"touch {ran}",)

    (checkpoint / "state" / ".metadata").write_bytes(pickle.dumps(Hostile()))
    rehash(checkpoint)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata asks for (posix|os)\.system"):
        load_trained(checkpoint)
    with pytest.raises(UnsafeCheckpointError, match="not part of a checkpoint's metadata"):
        export(checkpoint, tmp_path / "exported")
    assert not ran.exists() and not (tmp_path / "exported").exists()
    pickle.loads((checkpoint / "state" / ".metadata").read_bytes())  # DCP's own reader would have run it
    assert ran.exists()


def test_metadata_that_points_outside_the_checkpoint_is_refused(twins, tmp_path):
    """A `.metadata` whose shard name is `../secret` (DCP joins it to the state directory) is refused before any file
    is opened, even with the marker rewritten to match."""
    from mmadapt.sharded_checkpoint import UnsafeCheckpointError, reader

    checkpoint = tmp_path / "checkpoints" / newest(twins[1]).name
    shutil.copytree(newest(twins[1]), checkpoint)
    metadata = reader(checkpoint).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.distcp"
    (checkpoint / "state" / ".metadata").write_bytes(pickle.dumps(metadata))
    rehash(checkpoint)
    with pytest.raises(UnsafeCheckpointError, match=r"points at '\.\./\.\./secret\.distcp', which is not a file name"):
        load_trained(checkpoint)


def test_a_missing_shard_is_caught_before_loading(twins, tmp_path):
    from mmadapt.loading import UnverifiedCheckpointError
    from mmadapt.train.export import export

    checkpoint = tmp_path / "checkpoints" / newest(twins[1]).name
    shutil.copytree(newest(twins[1]), checkpoint)
    shard = next((checkpoint / "state").glob("*.distcp"))
    shard.unlink()
    expected = f"{shard.relative_to(checkpoint).as_posix()} is missing"
    with pytest.raises(UnverifiedCheckpointError, match=expected):
        load_trained(checkpoint)
    with pytest.raises(UnverifiedCheckpointError, match=expected):
        export(checkpoint, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


MEASURE = """
import json, re, sys, threading, time
from pathlib import Path
import peft, safetensors.torch, torch, torch.distributed.checkpoint, transformers  # imported before the baseline
from mmadapt.loading import load_trained
from mmadapt.processor import export_processor
from mmadapt.train.export import export

def kib(field):
    return int(re.search(field + r":\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1))

def sample(peak, done):  # the process's own (anonymous) memory, every 2 ms: a file's pages mapped are not in it
    while not done.is_set():
        peak[0] = max(peak[0], kib("RssAnon"))
        time.sleep(0.002)

src, dst, how = sys.argv[1:4]
rss, anon = kib("VmRSS"), kib("RssAnon")
peak, done = [anon], threading.Event()
sampler = threading.Thread(target=sample, args=(peak, done))
Path("/proc/self/clear_refs").write_text("5")  # VmHWM, the peak resident memory, counts from here
sampler.start()
if how == "whole":
    load_trained(src, verify=False)[0].save_pretrained(dst, max_shard_size="50MB")
else:
    export(src, dst, format=how, max_shard_size="50MB", verify=False)
done.set()
sampler.join()
print(json.dumps({"resident": (kib("VmHWM") - rss) * 1024, "own": (peak[0] - anon) * 1024}))
"""


def wide_sharded_checkpoint(out: Path) -> tuple[Path, int]:
    """A LoRA run's sharded checkpoint of a ~460 MiB model (a LLaVA with a 1024-wide, 8-layer Llama; no tensor over
    35 MB), written directly (no training: memory is what is measured); returns it and the model's bytes."""
    import yaml
    from torch.distributed.checkpoint import save

    from mmadapt import VisionLanguageModel
    from mmadapt.directory import write_model_files
    from mmadapt.lora import LoraSection, add_lora

    checkpoint = out / "checkpoints" / "step-0000001"
    config = ModelConfig.from_names("clip", "mlp2x_gelu", "llama")
    config.backbone.options = {"vocab_size": 8000, "hidden_size": 1024, "intermediate_size": 2816,
                               "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8}
    model = VisionLanguageModel(config)
    add_lora(model, "backbone", LoraSection(r=4))
    save({"model": model.state_dict()}, checkpoint_id=checkpoint / "state", no_dist=True)
    write_model_files(model, checkpoint)
    (checkpoint / "config.yaml").write_text(yaml.safe_dump({"stages": {"preset": "lora"}, "lora": {"r": 4}}))
    (checkpoint / "COMPLETE").write_text(json.dumps({"step": 1, "format": "sharded", "files": {}}))
    size = sum(v.nbytes for k, v in model.state_dict().items() if "lora_" not in k)
    return rehash(checkpoint), size


@pytest.mark.slow
def test_streamed_export_peak_memory_stays_below_the_model(tmp_path):
    """A process exporting a ~460 MiB sharded checkpoint with 50 MB files: in mmadapt's format its peak resident
    memory (VmHWM, reset before the export) grows by under half the model (one file's tensors and safetensors'
    serialised copy of them); in transformers' format its own memory (anonymous, sampled) does (the model is
    memory-mapped from the staged directory: the pages are the files'). Loading the model whole and saving it,
    measured the same ways, grows both by more than the model: the measures see a whole model."""
    checkpoint, size = wide_sharded_checkpoint(tmp_path / "run")
    grew = {}
    for how in ("mmadapt", "transformers", "whole"):
        done = subprocess.run([sys.executable, "-c", MEASURE, str(checkpoint), str(tmp_path / how), how],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        grew[how] = json.loads(done.stdout.strip().splitlines()[-1])
    assert grew["mmadapt"]["resident"] < size / 2 < size < grew["whole"]["resident"], (grew, size)
    assert grew["transformers"]["own"] < size / 2 < size < grew["whole"]["own"], (grew, size)
    same_directories(tmp_path / "mmadapt", tmp_path / "whole")


@pytest.mark.parametrize("damage", ["lora", "plain"])
def test_a_state_without_a_models_tensor_is_refused_before_writing(twins, tmp_path, damage):
    """A sharded checkpoint whose state lacks one of its model's tensors (a LoRA factor, a plain weight), its marker
    rewritten to match: the export names the tensor and writes nothing; loading it names it too."""
    from torch.distributed.checkpoint import save

    from mmadapt.sharded_checkpoint import ModelTensors
    from mmadapt.train.export import export
    from mmadapt.weights import MissingWeightsError

    checkpoint = tmp_path / "checkpoints" / newest(twins[1]).name
    shutil.copytree(newest(twins[1]), checkpoint, ignore=shutil.ignore_patterns("state"))
    tensors = ModelTensors(newest(twins[1]))
    dropped = next(k for k in tensors.keys() if ("lora_B" in k) == (damage == "lora") and k.endswith(".weight"))
    save({"model": tensors.read(k for k in tensors.keys() if k != dropped)}, checkpoint_id=checkpoint / "state",
         no_dist=True)
    rehash(checkpoint)
    with pytest.raises(MissingWeightsError, match=re.escape(f"lacks 1 of its model's tensors: ['{dropped}']")):
        export(checkpoint, tmp_path / "exported")
    assert not (tmp_path / "exported").exists() and [p.name for p in tmp_path.iterdir()] == ["checkpoints"]
    with pytest.raises(MissingWeightsError, match="lacks 1 of the"):
        load_trained(checkpoint)


@pytest.mark.parametrize("fmt", ["mmadapt", "transformers"])
def test_a_full_disk_during_a_sharded_export_keeps_the_previous_model(twins, tmp_path, fmt):
    """A write that fails (files limited to 100 KB, as a full disk fails it) while exporting a sharded checkpoint over
    a model directory: a `CheckpointWriteError`, the model that was there intact, no staging or temporary directory
    left."""
    import resource
    import signal

    from mmadapt.atomic import CheckpointWriteError
    from mmadapt.train.export import export

    target = tmp_path / "model"
    export(newest(twins[0]), target, format=fmt)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(CheckpointWriteError) as failure:
            export(newest(twins[1]), target, format=fmt, overwrite=True, max_shard_size="200KB")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    message = str(failure.value)
    assert ("The model directory that was there is intact" if fmt == "mmadapt" else
            f"could not export {newest(twins[1])} to {target}: the staging directory") in message
    assert "File too large" in message
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
