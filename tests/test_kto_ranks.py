"""`train.objective: kto` under torchrun (CPU, gloo): FSDP2 and DDP with 2 processes equal 1 process.

Unpaired records over scikit-image photographs (four pictures, two sizes; prompts of three lengths; every record has
the same completion, labelled desirable or not). The 1-process run takes micro-batches of 2 records with grad_accum
2, the 2-process runs 2 records per rank: the same global batch of 4 rows each step, and the step's KL is the mean of
its 2 micro-batch estimates either way (one gather in `training_rows`). The two layouts split a global batch into
other micro-batches (`GlobalBatchSampler` gives rank r every world-th record: [a, c] and [b, d] where one process
takes [a, b] and [c, d]) and a KL row takes the completion of another row of its micro-batch, so only completions
that are all the same make the KL rows (and z0) the same in both: what is compared here is the machinery (the
gather, the stand-ins, the reference per rank), the KL in play. An eval of
5 records in batches of 2 runs after every step: rank 0 scores 2 batches, rank 1 one and a stand-in (results
dropped) in the second round; both ranks finish (a hang is ended at 300 s and fails: `helpers.run_bounded`). Per
step the loss, rewards, KL, grad norm and eval metrics agree within 1e-5 (the grad norm relative). Cases: LoRA
(`kto`, the reference the model with its adapters off; FSDP2 and DDP) and a fully trained encoder
(`apo_zero_unpaired`, the reference precomputed by every rank's share of the rows; FSDP2).
"""

import json
import os
import sys

import pytest
from helpers import run_bounded
from PIL import Image
from skimage import data as skdata

pytestmark = pytest.mark.slow
PHOTOS = {"astronaut": skdata.astronaut, "coffee": skdata.coffee, "chelsea": skdata.chelsea, "rocket": skdata.rocket}
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "kl", "eval_loss",
        "eval_rewards/chosen", "eval_rewards/rejected", "eval_kl", "eval_logps/rejected")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto-ranks")
    (root / "images").mkdir()
    names = list(PHOTOS)
    for k, (name, load) in enumerate(PHOTOS.items()):
        Image.fromarray(load()).resize((32 + 32 * (k % 2), 32)).save(root / "images" / f"{name}.png")
    records = [{"id": f"k{i}", "images": [f"{names[i % 4]}.png"],
                "prompt": "<image>\nWhat is this?" + " please" * (i % 3),
                "completion": "a photograph", "label": i % 4 != 1} for i in range(16)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (root / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in records[3:8]))
    (root / "base.yaml").write_text(
        f"data: {{train: {root / 'train.jsonl'}, eval: {root / 'eval.jsonl'}, image_root: {root / 'images'}, "
        "max_length: 256, batch_size: 2}\n"
        "train: {steps: 3, lr: 1.0e-2, progress: false, objective: kto, eval_every: 1}\nkto: {beta: 0.5}\n")
    return root


def launch(root, out, *overrides, procs=1):
    launcher = [sys.executable]
    if procs > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    cmd = [*launcher, "-m", "mmadapt", "train", str(root / "base.yaml"), f"train.out={root / out}", *overrides]
    code, stderr = run_bounded(cmd, 300, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert code == 0, (out, code, stderr[-3000:])
    return [json.loads(line) for line in (root / out / "log.jsonl").read_text().splitlines()]


def same(a, b, what):
    assert len(a) == len(b) == 3, what
    for x, y in zip(a, b, strict=True):
        for key in KEYS:
            assert (key in x) == (key in y), (what, key)
            if key in x:
                assert abs(x[key] - y[key]) <= 1e-5, (what, key, [r.get(key) for r in a], [r.get(key) for r in b])
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5 * max(abs(x["grad_norm"]), 1e-3), (what, "grad_norm")


CASES = {"lora": ["stages.backbone=lora", "stages.projector=frozen"],
         "precomputed": ["stages.encoder=full", "kto.loss_type=apo_zero_unpaired"]}


@pytest.mark.parametrize("case", list(CASES))
def test_kto_fsdp2_and_ddp_equal_one_process_with_an_uneven_eval(rows, case):
    one = launch(rows, f"{case}-one", *CASES[case], "train.grad_accum=2")
    assert one[-1]["rows"] == 4 and "eval_rewards/margins" in one[-1] and ("kl" in one[-1]) == (case == "lora")
    if case == "lora":
        assert any(r["kl"] > 0 for r in one)  # the KL term is in play (not clamped away at every step)
    same(one, launch(rows, f"{case}-fsdp", *CASES[case], "distributed.strategy=fsdp", procs=2), "fsdp")
    if case == "lora":
        same(one, launch(rows, f"{case}-ddp", *CASES[case], "distributed.strategy=ddp", procs=2), "ddp")
