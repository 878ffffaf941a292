"""Sharded (DCP) training checkpoints read back: loaded for inference and exported without a gather.

- `test_a_sharded_checkpoint_loads_as_its_gathered_twin`: `load_trained` (chat, eval, serve, a reference / teacher
  model) reads a sharded checkpoint through `Checkpoint.open` into bitwise the model of its gathered twin; its
  `files` are the state files (provenance).
- `test_export_from_sharded_equals_export_from_gathered` (both formats, LoRA in the run): the same file names, the
  same index, bitwise-equal tensors, and the streaming export never holds more tensor bytes than about one shard.
- `test_export_command_on_a_sharded_checkpoint_directory`: `mmadapt export CHECKPOINT DST` as a user runs it.
- `test_hostile_metadata_is_refused_and_runs_nothing`, `test_a_missing_shard_is_caught_before_loading`: a sharded
  checkpoint that names code in its `.metadata`, or lacks a shard, is refused with an error naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import lora_run, to_sharded
from safetensors import safe_open

from mmadapt.loading import load_trained
from mmadapt.run_directory import RunDirectory

LORA = ["stages.preset=lora", "checkpoint.format=gathered"]


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> tuple[Path, Path]:
    """(gathered run, its sharded twin): a tiny LoRA run's directory, and a copy whose checkpoint is sharded."""
    out = tmp_path_factory.mktemp("twins")
    lora_run(out, LORA)
    gathered, sharded = out / "run", out / "sharded"
    shutil.copytree(gathered, sharded, ignore=shutil.ignore_patterns("model", "adapters"))
    for checkpoint in RunDirectory(sharded).checkpoints(complete=True):
        to_sharded(checkpoint)
    return gathered, sharded


def newest(run: Path) -> Path:
    return RunDirectory(run).checkpoints(complete=True)[-1]


def test_a_sharded_checkpoint_loads_as_its_gathered_twin(twins):
    from mmadapt.weights import Checkpoint

    gathered, sharded = twins
    checkpoint = Checkpoint.open(newest(sharded))
    assert [f.relative_to(checkpoint.path).parts[0] for f in checkpoint.files] == ["state"] * len(checkpoint.files)
    assert any(f.name == ".metadata" for f in checkpoint.files)
    ours, _ = load_trained(newest(sharded))
    theirs, _ = load_trained(newest(gathered))
    assert not any("lora_" in k for k in ours.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
