"""torchrun on CPU (gloo): FSDP2 and DDP with 2 processes equal 1 process with the same global batch.

The 1-process run takes micro-batches of 2 with grad_accum 2; the 2-process runs take 2 per
rank; the global batch (4 samples) is the same set each step. Losses agree within 1e-5, the 1-process
run computing its loss from full logits and the others without them (`mmadapt.loss`).
A checkpoint written by the 2-process FSDP2 run resumes in 1 process.
"""

import json
import subprocess
import sys

import pytest
import torch
from PIL import Image
from skimage import data as skdata

pytestmark = pytest.mark.slow
PHOTOS = {"astronaut": skdata.astronaut, "coffee": skdata.coffee, "chelsea": skdata.chelsea, "rocket": skdata.rocket}


def write_photos(root):
    """scikit-image's four photos in `root/images`, two widths (so the samples' token counts differ)."""
    (root / "images").mkdir()
    for k, (name, load) in enumerate(PHOTOS.items()):
        Image.fromarray(load()).resize((32 + 16 * (k % 2), 32)).save(root / "images" / f"{name}.png")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    write_photos(root)
    records = [{"id": f"s{i}", "image": f"{list(PHOTOS)[i % 4]}.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?" + " please" * (i % 3)},
        {"from": "gpt", "value": list(PHOTOS)[i % 4]}]} for i in range(16)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (root / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in records[:5]))  # 3 batches of 2: uneven on 2
    (root / "base.yaml").write_text(
        f"data: {{train: {root / 'train.jsonl'}, image_root: {root / 'images'}, max_length: 256}}\n"
        "train: {steps: 3, lr: 1.0e-3, progress: false}\nstages: {encoder: full}\n")
    return root


def launch(root, out, *overrides, procs=1, timeout=300):
    launcher = [sys.executable]  # --standalone: a free rendezvous port, so two runs at once never collide
    if procs > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    cmd = [*launcher, "-m", "mmadapt", "train", str(root / "base.yaml"), f"train.out={root / out}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def records(root, out, *overrides, procs=1):
    result = launch(root, out, *overrides, procs=procs)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (root / out / "log.jsonl").read_text().splitlines()]


def train(root, out, *overrides, procs=1):
    return [record["loss"] for record in records(root, out, *overrides, procs=procs)]


def test_fsdp2_and_ddp_equal_one_process(dataset):
    # the 1-process reference computes the loss from full logits (transformers' way); the 2-process runs use
    # mmadapt.loss (supervised positions, chunked): equal losses at steps 2 and 3 need equal gradients before.
    # The eval at step 2 has 3 batches: 2 on rank 0, 1 on rank 1 (which runs a placeholder, or a stand-in under FSDP2)
    evals = (f"data.eval={dataset / 'eval.jsonl'}", "train.eval_every=2")
    one = records(dataset, "one", "data.batch_size=2", "train.grad_accum=2", "train.full_logits=true", *evals)
    fsdp = records(dataset, "fsdp", "data.batch_size=2", "distributed.strategy=fsdp", "checkpoint.every=2", *evals,
                   procs=2)
    ddp = records(dataset, "ddp", "data.batch_size=2", "distributed.strategy=ddp", *evals, procs=2)
    assert len(one) == len(fsdp) == len(ddp) == 3
    for a, b, c in zip(one, fsdp, ddp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["loss"] - c["loss"]) <= 1e-5, (one, fsdp, ddp)
    assert abs(one[1]["eval_loss"] - fsdp[1]["eval_loss"]) <= 1e-5
    assert abs(one[1]["eval_loss"] - ddp[1]["eval_loss"]) <= 1e-5
    one = [r["loss"] for r in one]
    # The sharded run's step-2 checkpoint holds full state dicts: one process resumes from it.
    resumed = train(dataset, "fsdp", "data.batch_size=2", "train.grad_accum=2", "--resume")
    assert abs(resumed[2] - one[2]) <= 1e-5


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """24 records, half of them text-only (an image where i % 4 is 0 or 1): with one sample per rank and seed 0 the
    8 steps give both ranks an image (step 1), one rank an image and the other none (steps 2, 7, 8) and no rank an
    image (steps 3 and 6: the vision side must then get no update, as in one process). LLaVA's 665k mix has ~40k
    text-only samples."""
    root = tmp_path_factory.mktemp("mixed")
    (root / "images").mkdir()
    for k, (name, load) in enumerate(PHOTOS.items()):
        Image.fromarray(load()).resize((32 + 16 * (k % 2), 32)).save(root / "images" / f"{name}.png")
    records = []
    for i in range(24):
        name = list(PHOTOS)[i % 4]
        question = "<image>\nWhat is this?" if i % 4 < 2 else f"Say the word {name}."
        record = {"id": f"s{i}", "conversations": [{"from": "human", "value": question},
                                                   {"from": "gpt", "value": name}]}
        records.append({**record, "image": f"{name}.png"} if i % 4 < 2 else record)
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (root / "base.yaml").write_text(
        f"data: {{train: {root / 'train.jsonl'}, image_root: {root / 'images'}, max_length: 256}}\n"
        "train: {steps: 3, lr: 1.0e-3, progress: false}\nstages: {encoder: full}\n")
    return root


EIGHT = "train.steps=8"  # reaches the steps where no rank has an image (3 and 6)
MIXED = {  # (overrides, strategies run with 2 processes)
    "encoder full": ([EIGHT, "train.weight_decay=0.1"], ("fsdp", "ddp")),
    "encoder frozen": ([EIGHT, "stages.encoder=frozen", "stages.projector=full"], ("fsdp", "ddp")),
    "LoRA": ([EIGHT, "stages.encoder=lora", "stages.backbone=lora"], ("fsdp", "ddp")),
    # Qwen3-VL-MoE: DeepStack levels added after layers 0-2, verified by the contract's hooks on FSDP2-sharded
    # layers; routed experts sharded along the expert dimension
    "DeepStack + MoE": (["model.encoder=qwen3_vl_vit", "model.backbone=qwen3_vl_moe", "stages.router=full"],
                        ("fsdp",)),
    # activation checkpointing inside FSDP2's units (each decoder layer / vision block recomputed in the backward)
    "checkpointing": (["train.activation_checkpointing=all"], ("fsdp",)),
    # the output layer tied to the input embedding: one (V, D) gradient buffer (mmadapt.loss.TiedEmbedding) under
    # DDP; FSDP2's sharded weight takes the embedding's usual backward
    "tied embeddings": (["model.backbone={name: qwen3_5, preset: tiny, options: {tie_word_embeddings: true}}"],
                        ("fsdp", "ddp")),
}


@pytest.mark.parametrize("case", list(MIXED))
def test_mixed_text_only_and_image_batches_keep_every_rank_in_step(mixed, case):
    """FSDP2 died in the first step where one rank had an image and the other none (its all-gathers no longer
    paired: gloo's "Connection reset by peer"); every rank now runs the vision side, and 2 processes equal one.
    From the first step where no rank had an image the losses left one process's (7.9e-4 at step 5): the
    placeholder's zero gradients gave AdamW a step (momentum, weight decay) that one process does not take."""
    overrides, strategies = MIXED[case]
    tag = case.replace(" ", "-").replace("+", "")
    steps = 8 if EIGHT in overrides else 3
    reference = records(mixed, f"{tag}-one", *overrides, "data.batch_size=1", "train.grad_accum=2")
    one = [r["loss"] for r in reference]
    if steps == 8:  # the data gives steps with no image anywhere, and steps with images after them
        no_image = [r["step"] for r in reference if r["images_per_s"] == 0]
        assert no_image and max(no_image) < steps, no_image
    for strategy in strategies:
        two = train(mixed, f"{tag}-{strategy}", *overrides, "data.batch_size=1", f"distributed.strategy={strategy}",
                    procs=2)
        assert len(one) == len(two) == steps
        for a, b in zip(one, two, strict=True):
            assert abs(a - b) <= 1e-5, (case, strategy, one, two)
        if "stages.backbone=lora" in overrides:  # the adapters saved from the sharded run are the same weights
            from safetensors.torch import load_file

            for part in ("encoder", "backbone"):
                ours, theirs = (load_file(mixed / run / "adapters" / part / "adapter_model.safetensors")
                                for run in (f"{tag}-one", f"{tag}-{strategy}"))
                assert ours.keys() == theirs.keys() and ours
                assert all(torch.allclose(ours[k], theirs[k], atol=1e-5) for k in ours)


@pytest.fixture(scope="module")
def mixed_video(tmp_path_factory):
    """Records cycling through a video, an image + a video, an image, and text only: with one sample per rank the
    ranks hold different mixes in most steps (the vision side must still run once per forward on every rank)."""
    from mmadapt.synthetic import moving_square, write_video

    root = tmp_path_factory.mktemp("mixed-video")
    (root / "media").mkdir()
    for k, (name, load) in enumerate(PHOTOS.items()):
        Image.fromarray(load()).resize((32 + 16 * (k % 2), 32)).save(root / "media" / f"{name}.png")
    for k, direction in enumerate(((0, 1), (0, -1), (1, 0), (-1, 0))):
        write_video(root / "media" / f"clip{k}.mp4", moving_square(4 + 2 * k, 32, 32 + 16 * (k % 2),
                                                                   direction=direction), fps=4)
    records = []
    for i in range(24):
        name, kind = list(PHOTOS)[i % 4], i % 4
        question = {0: "<video>\nWhere to?", 1: "<image><video>\nBoth?", 2: "<image>\nWhat is this?",
                    3: f"Say the word {name}."}[kind]
        record = {"id": f"s{i}", "conversations": [{"from": "human", "value": question},
                                                   {"from": "gpt", "value": name}]}
        if kind in (1, 2):
            record["image"] = f"{name}.png"
        if kind in (0, 1):
            record["videos"] = [f"clip{i % 4}.mp4"]
        records.append(record)
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (root / "base.yaml").write_text(
        f"data: {{train: {root / 'train.jsonl'}, image_root: {root / 'media'}, max_length: 512,\n"
        "       video: {fps: 4, min_pixels: 256, max_pixels: 16384}}\n"
        "train: {steps: 3, lr: 1.0e-3, progress: false}\nstages: {encoder: full}\n")
    return root


def test_mixed_image_video_and_text_only_batches_keep_every_rank_in_step(mixed_video):
    """One rank with a video and an image, the other with text only or a video only: FSDP2's all-gathers stay paired
    (one vision forward per step on every rank), and 2 processes equal one."""
    one = train(mixed_video, "one", "data.batch_size=1", "train.grad_accum=2")
    for strategy in ("fsdp", "ddp"):
        two = train(mixed_video, strategy, "data.batch_size=1", f"distributed.strategy={strategy}", procs=2)
        assert len(one) == len(two) == 3
        for a, b in zip(one, two, strict=True):
            assert abs(a - b) <= 1e-5, (strategy, one, two)


RANK_SCRIPT = '''
import os, sys
from mmadapt.cli import main
from mmadapt.train.trainer import Trainer

rank = int(os.environ.get("RANK", "0"))
fail = os.environ.get("FAIL_AT")  # "RANK:STEP": that rank raises in that step
if fail:
    fail_rank, fail_step = (int(v) for v in fail.split(":"))
    train_step = Trainer.train_step

    def failing(self, micro, clock=None):
        if self.dist.rank == fail_rank and self.step + 1 == fail_step:
            raise ValueError(f"rank {fail_rank} cannot go on at step {fail_step}")
        return train_step(self, micro, clock)

    Trainer.train_step = failing
sys.exit(main([a.replace("{rank}", str(rank)) for a in sys.argv[1:]]))
'''


def launch_ranks(root, *args, env=None, timeout=240):
    """`mmadapt ARGS` under torchrun with 2 processes, `{rank}` in ARGS replaced by each process's rank."""
    import os
    import time

    script = root / "ranks.py"
    script.write_text(RANK_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), *args]
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return result, time.perf_counter() - started


def test_a_rank_that_raises_ends_both_processes_promptly_with_its_message(mixed):
    """Rank 1 raises in step 2 while rank 0 goes on to the step's collectives: both processes end as soon as the
    launch allows (the collectives' timeout is 30 minutes), and the output names rank 1 and its error."""
    result, seconds = launch_ranks(mixed, "train", str(mixed / "base.yaml"), f"train.out={mixed / 'fails'}",
                                   "train.steps=4", "data.batch_size=1", env={"FAIL_AT": "1:2"})
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "rank 1 cannot go on at step 2" in output and "rank 1 of 2 failed" in output, output[-3000:]
    assert seconds < 180, seconds  # a start and a step (tens of seconds), never the collectives' 30-minute wait


def test_resume_with_different_checkpoints_per_rank_is_refused_on_every_rank(mixed):
    """A node-local OUT: rank 1's newest checkpoint is older than rank 0's. Rank 0 chooses, rank 1 does not hold
    that checkpoint: both ranks stop with one message. With the same checkpoint on both, they resume it together."""
    import shutil

    common = [str(mixed / "base.yaml"), "data.batch_size=1", "checkpoint.every=2"]
    one = train(mixed, "local-0", *common[1:], "train.grad_accum=2", "train.steps=4")
    shutil.copytree(mixed / "local-0", mixed / "local-1")
    shutil.rmtree(mixed / "local-1" / "checkpoints" / "step-0000004")
    refused, _ = launch_ranks(mixed, "train", *common, "train.out=" + str(mixed / "local-{rank}"), "train.steps=6",
                              "--resume")
    assert refused.returncode != 0
    assert "rank(s) [1] do not hold that checkpoint" in refused.stdout + refused.stderr, refused.stderr[-3000:]
    shutil.rmtree(mixed / "local-1")
    shutil.copytree(mixed / "local-0", mixed / "local-1")
    agreed, _ = launch_ranks(mixed, "train", *common, "train.out=" + str(mixed / "local-{rank}"), "train.steps=6",
                             "--resume")
    assert agreed.returncode == 0, agreed.stderr[-3000:]
    resumed = [json.loads(line) for line in (mixed / "local-0" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed[:4]] == one
