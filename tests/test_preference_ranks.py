"""`train.objective: dpo` under torchrun (CPU, gloo): FSDP2 and DDP with 2 processes equal 1 process.

Preference pairs over scikit-image photographs (four pictures, two sizes; the chosen answer names the picture, the
rejected one another picture). The 1-process run takes micro-batches of 2 pairs with grad_accum 2, the 2-process
runs 2 pairs per rank: the same global batch of 4 pairs each step. Both references are run: LoRA (the model with its
adapters off, per batch, through the wrapped model; FSDP2 and DDP) and full training (FSDP2; the starting model's
log-probs precomputed by every rank's share of the pairs, gathered, cached in OUT). Per step, the loss, the reward
accuracy and margin and (LoRA) the KL agree within 1e-5; a precomputed run resumed in 1 process from the 2-process
FSDP2 run's checkpoint reads the reference back and continues as the uninterrupted run.
"""

import json
import subprocess
import sys

import pytest
from PIL import Image
from skimage import data as skdata

pytestmark = pytest.mark.slow
PHOTOS = {"astronaut": skdata.astronaut, "coffee": skdata.coffee, "chelsea": skdata.chelsea, "rocket": skdata.rocket}
KEYS = ("loss", "rewards/accuracy", "rewards/margin", "rewards/chosen", "kl")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo-ranks")
    (root / "images").mkdir()
    names = list(PHOTOS)
    for k, (name, load) in enumerate(PHOTOS.items()):
        Image.fromarray(load()).resize((32 + 32 * (k % 2), 32)).save(root / "images" / f"{name}.png")
    records = [{"id": f"p{i}", "images": [f"{names[i % 4]}.png"],
                "prompt": "<image>\nWhat is this?" + " please" * (i % 3),
                "chosen": names[i % 4], "rejected": names[(i + 1 + (i // 4) % 3) % 4]} for i in range(16)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (root / "base.yaml").write_text(
        f"data: {{train: {root / 'train.jsonl'}, image_root: {root / 'images'}, max_length: 256}}\n"
        "train: {steps: 3, lr: 1.0e-3, progress: false, objective: dpo}\ndpo: {beta: 0.5}\n")
    return root


def launch(root, out, *overrides, procs=1, timeout=300):
    launcher = [sys.executable]
    if procs > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    cmd = [*launcher, "-m", "mmadapt", "train", str(root / "base.yaml"), f"train.out={root / out}", *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (root / out / "log.jsonl").read_text().splitlines()]


def same(a, b, what):
    """The logged values equal within 1e-5, but step 1's reward accuracy: the policy is the reference there, every
    reward is 0 up to rounding, and "chosen > rejected" counts which way rounding fell (it differs across CPUs)."""
    assert len(a) == len(b) == 3, what
    for step, (x, y) in enumerate(zip(a, b, strict=True), start=1):
        for key in KEYS:
            assert (key in x) == (key in y), (what, key)
            if key in x and not (step == 1 and key == "rewards/accuracy"):
                assert abs(x[key] - y[key]) <= 1e-5, (what, key, [r.get(key) for r in a], [r.get(key) for r in b])


CASES = {"lora": ["stages.backbone=lora", "stages.projector=frozen"],
         "precomputed": ["stages.encoder=full"]}


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_fsdp2_and_ddp_equal_one_process(pairs, case):
    one = launch(pairs, f"{case}-one", *CASES[case], "data.batch_size=2", "train.grad_accum=2")
    fsdp = launch(pairs, f"{case}-fsdp", *CASES[case], "data.batch_size=2", "distributed.strategy=fsdp",
                  "checkpoint.every=2", procs=2)
    assert one[-1]["pairs"] == 4 and ("kl" in one[-1]) == (case == "lora")
    assert abs(one[0]["rewards/margin"]) <= 1e-5  # step 1: the policy is the reference (other padding: rounding)
    same(one, fsdp, "fsdp")
    if case == "lora":  # DDP with the per-batch reference (the precomputed one runs no reference forward in a step)
        same(one, launch(pairs, f"{case}-ddp", *CASES[case], "data.batch_size=2", "distributed.strategy=ddp",
                         procs=2), "ddp")
    if case == "precomputed":  # the reference is read back, not recomputed from the moved weights
        assert (pairs / f"{case}-fsdp" / "reference_logps.safetensors").is_file()
        resumed = launch(pairs, f"{case}-fsdp", *CASES[case], "data.batch_size=2", "train.grad_accum=2", "--resume")
        same(one, resumed, "resumed")


def bounded_evals(root, eval_file, tag):
    """One process (batch 2) and FSDP2 on 2 processes (batch 1 per rank) evaluating `eval_file` at each of 2 steps,
    each ended at 300 s (`helpers.run_bounded`: a hang fails): their logs."""
    import os

    from helpers import run_bounded

    common = [*CASES["lora"], f"data.eval={eval_file}", "train.eval_every=1", "train.steps=2"]
    runs = {}
    for name, extra in ((f"{tag}-one", ["data.batch_size=2", "train.grad_accum=2"]),
                        (f"{tag}-fsdp", ["data.batch_size=1", "train.grad_accum=2", "distributed.strategy=fsdp"])):
        launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
                                       if name.endswith("fsdp") else [])
        code, stderr = run_bounded([*launcher, "-m", "mmadapt", "train", str(root / "base.yaml"),
                                    f"train.out={root / name}", *common, *extra], 300,
                                   {**os.environ, "OMP_NUM_THREADS": "1"})
        assert code == 0, (name, code, stderr[-3000:])
        runs[name] = [json.loads(line) for line in (root / name / "log.jsonl").read_text().splitlines()]
    return runs[f"{tag}-one"], runs[f"{tag}-fsdp"]


def test_an_eval_with_more_batches_on_one_rank_keeps_fsdp2_in_step_and_equals_one_process(pairs):
    """3 eval pairs, one per batch: rank 0 scores 2 batches, rank 1 one and, in the second round, a stand-in pair
    (results dropped) whose forwards - the policy's and the reference's, the vision side's - gather with rank 0's
    (a placeholder forward without an image did not: gloo's "Connection reset"). Both ranks finish (a hang is ended
    at 300 s and fails) and the eval metrics equal one process within 1e-5."""
    eval_file = pairs / "eval3.jsonl"
    eval_file.write_text("\n".join((pairs / "train.jsonl").read_text().splitlines()[:3]))
    for a, b in zip(*bounded_evals(pairs, eval_file, "eval"), strict=True):
        for key in ("eval_loss", "eval_rewards/margin"):
            assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])


def test_an_eval_with_pictures_on_one_rank_only_keeps_fsdp2_in_step_and_equals_one_process(pairs):
    """2 eval pairs, one per batch: rank 0's shows a picture, rank 1's none. Each eval forward (the policy's and the
    reference's) runs the vision units on rank 0, so rank 1's runs them on no picture (in eval mode too: the old code
    ran nothing there, and the gathers fell out of step). Both finish and equal one process within 1e-5."""
    eval_file = pairs / "eval-mixed.jsonl"
    text_only = {"id": "t0", "images": [], "prompt": "What is this?", "chosen": "coffee", "rejected": "rocket"}
    eval_file.write_text((pairs / "train.jsonl").read_text().splitlines()[0] + "\n" + json.dumps(text_only))
    for a, b in zip(*bounded_evals(pairs, eval_file, "mixed"), strict=True):
        for key in ("eval_loss", "eval_rewards/margin", "eval_logps/chosen"):
            assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
