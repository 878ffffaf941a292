"""QLoRA under torchrun (gloo, CPU, fp32): FSDP2 and DDP with 2 processes equal one process, step by step.

The base is a tiny Qwen3.5 VLM saved as a model directory (`model.pretrained`): every rank reads it straight to NF4
(`quantization.scaler_block_size: 8`, so the tiny layers quantise), FSDP2 shards the NF4 weights, DDP leaves them out
of its broadcast. The work is uneven as in `test_distributed`: samples of different lengths, an eval of 3 batches of 2
(2 on rank 0, 1 on rank 1). The 2-rank runs then resume from their step-2 checkpoint (which holds no 4-bit weight)
and repeat steps 3-4 bitwise. Tolerance: 1e-5 on the loss and the eval loss across world sizes (the gradients are
reduced in another order: fp32 rounding), as `test_distributed`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import PHOTOS, write_photos

import mmadapt
from mmadapt.data import char_tokenizer
from mmadapt.sharded_checkpoint import ModelTensors

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora-ranks")
    write_photos(root)
    records = [{"id": f"s{i}", "image": f"{list(PHOTOS)[i % 4]}.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?" + " please" * (i % 3)},
        {"from": "gpt", "value": list(PHOTOS)[i % 4]}]} for i in range(16)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (root / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in records[:5]))  # 3 batches of 2: uneven on 2
    torch.manual_seed(0)
    mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5").save_pretrained(root / "base",
                                                                                tokenizer=char_tokenizer())
    (root / "base.yaml").write_text(
        f"model: {{pretrained: {root / 'base'}}}\n"
        f"data: {{train: {root / 'train.jsonl'}, eval: {root / 'eval.jsonl'}, image_root: {root / 'images'}, "
        "max_length: 256}\n"
        "train: {steps: 4, lr: 1.0e-2, progress: false, eval_every: 2}\ncheckpoint: {every: 2}\n"
        "stages: {preset: qlora}\nquantization: {scaler_block_size: 8}\nlora: {r: 4, alpha: 8}\n")
    return root


def records(root: Path, out: str, *overrides: str, procs: int = 1) -> list[dict]:
    from helpers import run_bounded
    from test_checkpoint_ranks import env

    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
                                   if procs > 1 else [])
    code, stderr = run_bounded([*launcher, "-m", "mmadapt", "train", str(root / "base.yaml"),
                                f"train.out={root / out}", *overrides], 300, env())
    assert code == 0, stderr[-3000:]
    return [json.loads(line) for line in (root / out / "log.jsonl").read_text().splitlines()]


def test_fsdp2_and_ddp_with_a_4bit_base_equal_one_process_and_resume_bitwise(root):
    one = records(root, "one", "data.batch_size=2", "train.grad_accum=2", "train.full_logits=true")
    runs = {strategy: records(root, strategy, "data.batch_size=2", f"distributed.strategy={strategy}", procs=2)
            for strategy in ("fsdp", "ddp")}
    for strategy, run in runs.items():
        assert [r["step"] for r in run] == [1, 2, 3, 4], strategy
        for a, b in zip(one, run, strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-5, (strategy, one, run)
            if "eval_loss" in a:
                assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5, (strategy, one, run)
        assert one[-1]["loss"] < one[0]["loss"]
        step2 = root / strategy / "checkpoints" / "step-0000002"
        assert not any(k.endswith("_proj.base_layer.weight") and ".mlp." in k for k in ModelTensors(step2).keys())
        # resume from step 2 on the same ranks: steps 3-4 bitwise
        cut = root / f"{strategy}-resumed"
        (cut / "checkpoints").mkdir(parents=True)
        shutil.copy(root / strategy / "config.yaml", cut / "config.yaml")
        shutil.copytree(step2, cut / "checkpoints" / step2.name)
        again = records(root, cut.name, "data.batch_size=2", f"distributed.strategy={strategy}",
                        "checkpoint.resume=true", procs=2)
        assert [(r["loss"], r["grad_norm"]) for r in again[2:]] == [(r["loss"], r["grad_norm"]) for r in run[2:]]
