"""Sequence parallelism in whole runs (`mmadapt train` under torchrun), each equal to one process step by step.

SFT with SP = 2 on 2 processes (FSDP2; packed rows under DDP; the vision side sharded) and SP = 2 x DP = 2 on 4
processes, with an uneven eval on the way (3 eval batches over the data-parallel groups); DPO and KTO with SP = 2;
refusals (GRPO, heads that do not divide, a world that SP does not divide) in one line before anything is written.
The model-level equalities are tests/test_sequence_parallel.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from test_distributed import PHOTOS, write_photos

    root = tmp_path_factory.mktemp("sp_runs")
    write_photos(root)
    records = [{"id": f"s{i}", "image": f"{list(PHOTOS)[i % 4]}.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?" + " please" * (i % 3)},
        {"from": "gpt", "value": list(PHOTOS)[i % 4] + " indeed" * (i % 2)}]} for i in range(16)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (root / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in records[:5]))  # 3 batches of 2: uneven on 2
    pairs = [{"id": f"p{i}", "images": [f"{list(PHOTOS)[i % 4]}.png"],
              "prompt": "<image>\nWhat is this?" + " please" * (i % 3),
              "chosen": list(PHOTOS)[i % 4], "rejected": list(PHOTOS)[(i + 1) % 4] + " maybe" * (i % 2)}
             for i in range(16)]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in pairs))
    unpaired = [{"id": f"k{i}", "images": [f"{list(PHOTOS)[i % 4]}.png"],
                 "prompt": "<image>\nWhat is this?" + " please" * (i % 3),
                 "completion": list(PHOTOS)[i % 4], "label": i % 4 != 1} for i in range(16)]
    (root / "unpaired.jsonl").write_text("\n".join(json.dumps(r) for r in unpaired))
    (root / "base.yaml").write_text(yaml.safe_dump({
        "data": {"train": str(root / "train.jsonl"), "image_root": str(root / "images"), "max_length": 256},
        "train": {"steps": 3, "lr": 1.0e-3, "progress": False, "eval_every": 2},
        "stages": {"encoder": "full"}}))
    return root


def launch(root: Path, out: str, *overrides: str, procs: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if procs > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    cmd = [*launcher, "-m", "mmadapt", "train", str(root / "base.yaml"), f"train.out={root / out}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def records(root: Path, out: str, *overrides: str, procs: int = 1) -> list[dict]:
    result = launch(root, out, *overrides, procs=procs)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (root / out / "log.jsonl").read_text().splitlines()]


def assert_equal_runs(one: list[dict], other: list[dict], keys: tuple[str, ...]) -> None:
    assert len(one) == len(other) == 3
    for a, b in zip(one, other, strict=True):
        for key in keys:
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, one, other)


LLAVA = ["model.encoder=clip", "model.projector=mlp2x_gelu", "model.backbone=llama"]
RUNS = {  # name: (overrides, processes, the one-process reference's overrides); Qwen3.5 unless LLaVA's parts
    "sft sp2 fsdp": (["distributed.sequence_parallel=2", "distributed.strategy=fsdp", "data.batch_size=4"], 2,
                     ["data.batch_size=2", "train.grad_accum=2"]),
    "sft llava sp2 x dp2 fsdp": ([*LLAVA, "distributed.sequence_parallel=2", "distributed.strategy=fsdp",
                                  "data.batch_size=2"], 4, [*LLAVA, "data.batch_size=2", "train.grad_accum=2"]),
    "sft sp2 vision sharded": (["distributed.sequence_parallel=2", "distributed.sequence_parallel_vision=sharded",
                                "data.batch_size=4"], 2, ["data.batch_size=2", "train.grad_accum=2"]),
    "sft sp2 packed ddp": (["distributed.sequence_parallel=2", "distributed.strategy=ddp", "data.packing=true",
                            "data.max_tokens=160", "data.batch_size=4"], 2,
                           ["data.packing=true", "data.max_tokens=160", "data.batch_size=4"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_training_with_sequence_parallelism_equals_one_process_with_an_uneven_eval(dataset, name):
    overrides, procs, reference = RUNS[name]
    tag = name.replace(" ", "-")
    evals = (f"data.eval={dataset / 'eval.jsonl'}",)
    one = records(dataset, f"{tag}-one", *reference, *evals)
    split = records(dataset, tag, *overrides, *evals, procs=procs)
    assert_equal_runs(one, split, ("loss", "eval_loss", "grad_norm"))


PREFERENCE = {  # objective: (its data, the keys compared, its stages)
    "dpo": ("pairs.jsonl", ("loss", "grad_norm", "rewards/margins"), ()),
    # one process takes the same micro-batch of 4 (KTO's KL rows pair the rows of a micro-batch); its reference is
    # the model with the adapters off, so nothing trains fully
    "kto": ("unpaired.jsonl", ("loss", "grad_norm", "kl", "rewards/chosen"), ("stages.projector=frozen",)),
}


@pytest.mark.slow
@pytest.mark.parametrize("objective", list(PREFERENCE))
def test_preference_objectives_with_sequence_parallelism_equal_one_process(dataset, objective):
    data, keys, stages = PREFERENCE[objective]
    common = (*LLAVA, f"train.objective={objective}", f"data.train={dataset / data}", "train.eval_every=0",
              "stages.backbone=lora", "stages.encoder=frozen", *stages, "data.batch_size=4")
    one = records(dataset, f"{objective}-one", *common)
    split = records(dataset, f"{objective}-sp2", *common, "distributed.sequence_parallel=2", procs=2)
    assert_equal_runs(one, split, keys)


@pytest.mark.slow
def test_grpo_and_a_world_sp_does_not_divide_are_refused_in_one_line(dataset):
    result = launch(dataset, "grpo", "train.objective=grpo", "grpo.rewards=[accuracy]",
                    "distributed.sequence_parallel=2")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "train.objective grpo does not run under distributed.sequence_parallel: 2" in last, last
    assert not (dataset / "grpo").exists()  # refused before the run wrote anything
    result = launch(dataset, "world", "distributed.sequence_parallel=2")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "distributed.sequence_parallel: 2 does not divide the 1 processes" in last, last


@pytest.mark.slow
def test_a_run_whose_heads_sp_does_not_divide_stops_when_its_config_loads(dataset):
    result = launch(dataset, "heads", "distributed.sequence_parallel=3")  # tiny Qwen3.5: 4 heads, 2 KV heads
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "sequence_parallel: 3 does not divide the backbone's attention's 4 heads and 2 KV heads" in last, last
    assert "Sizes that work: [2, 4]" in last and not (dataset / "heads").exists(), last
