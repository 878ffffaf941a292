"""Sharded checkpoints under torchrun (gloo, CPU, fp32): written by 2 ranks, resumed on 2, 1 and 4; asynchronous saves
that overlap the next steps; a SIGKILL while one is in flight.

Each reference is one uninterrupted run of 6 steps on 2 ranks with a checkpoint every 2 (`checkpoint.keep=3`). A
resume starts from a copy of its OUT holding only the step-2 checkpoint, and its steps 3-6 are compared with the
reference's. The global batch is 4 samples in every run (2 ranks x 2, 1 x 2 x grad_accum 2, 4 x 1). Tolerances:
the same strategy on the same 2 ranks, bitwise; another world size, 1e-5 on the loss and 1e-5 relative on the
gradient norm (the gradients are reduced in another order: fp32 rounding, ~1e-7 measured). The data is
`test_distributed`'s (samples of different lengths, an eval of 3 batches: uneven on every world size).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import run_bounded
from test_distributed import dataset  # noqa: F401  (the fixture)

from mmadapt.sharded_checkpoint import is_sharded
from mmadapt.train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow
BATCH = {1: ["data.batch_size=2", "train.grad_accum=2"], 2: ["data.batch_size=2"], 4: ["data.batch_size=1"]}
RUN = ["train.steps=6", "checkpoint.every=2", "checkpoint.keep=3", "data.eval={root}/eval.jsonl",
       "train.eval_every=3"]
WORKER = Path(__file__).with_name("checkpoint_worker.py")


def command(root: Path, out: str, *overrides: str, procs: int, worker: bool = False) -> list[str]:
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
                                   if procs > 1 else [])
    entry = [str(WORKER)] if worker else ["-m", "mmadapt"]
    run = [r.format(root=root) for r in RUN]
    return [*launcher, *entry, "train", str(root / "base.yaml"), f"train.out={root / out}", *run, *BATCH[procs],
            *overrides]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}


def launch(root: Path, out: str, *overrides: str, procs: int, worker: bool = False, **extra: str) -> list[dict]:
    code, stderr = run_bounded(command(root, out, *overrides, procs=procs, worker=worker), 400, env(**extra))
    assert code is not None, f"{out}: no end after 400 s (ranks out of step?)\n{stderr[-2000:]}"
    assert code == 0, stderr[-3000:]
    return records(root / out)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def from_step_2(root: Path, reference: str, out: str) -> Path:
    """A copy of `reference`'s OUT as it was right after its step-2 checkpoint."""
    source, target = root / reference, root / out
    shutil.rmtree(target, ignore_errors=True)
    (target / "checkpoints").mkdir(parents=True)
    shutil.copy(source / "config.yaml", target / "config.yaml")
    shutil.copytree(source / "checkpoints" / "step-0000002", target / "checkpoints" / "step-0000002")
    return target


def same(reference: list[dict], resumed: list[dict], *, exact: bool, what: str) -> None:
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6], what
    for a, b in zip(reference[2:], resumed[2:], strict=True):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key not in a:
                continue
            if exact:
                assert a[key] == b[key], (what, a["step"], key, a[key], b[key])
            else:
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (what, a["step"], key, a[key], b[key])


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_checkpoint_of_2_ranks_resumes_on_2_bitwise_and_on_1_and_4_within_rounding(dataset, strategy):  # noqa: F811
    reference = launch(dataset, f"{strategy}-2", f"distributed.strategy={strategy}", procs=2)
    step2 = dataset / f"{strategy}-2" / "checkpoints" / "step-0000002"
    assert is_sharded(step2) and json.loads((step2 / "COMPLETE").read_text())["world"] == 2
    assert not (step2 / "model.safetensors").exists()  # no rank gathered the model
    for procs in (2, 1, 4):
        out = from_step_2(dataset, f"{strategy}-2", f"{strategy}-2-on-{procs}")
        resumed = launch(dataset, out.name, f"distributed.strategy={strategy}", "--resume", procs=procs)
        same(reference, resumed, exact=procs == 2, what=f"{strategy}: 2 ranks -> {procs}")


def test_a_resume_whose_steps_would_mean_other_samples_is_refused_in_one_line(dataset):  # noqa: F811
    out = from_step_2(dataset, "fsdp-2", "other-batch") if (dataset / "fsdp-2").exists() else None
    if out is None:
        launch(dataset, "fsdp-2", "distributed.strategy=fsdp", procs=2)
        out = from_step_2(dataset, "fsdp-2", "other-batch")
    result = subprocess.run(command(dataset, out.name, "train.grad_accum=1", "--resume", procs=1),
                            capture_output=True, text=True, timeout=300, env=env())
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "global batch of 4 samples" in last and "this run's is 2" in last, last
    assert "train.grad_accum=2 with data.batch_size 2" in last, last
    assert "Traceback" not in result.stderr


def test_an_asynchronous_save_overlaps_the_next_steps_and_a_sigkill_in_flight_resumes_bitwise(dataset):  # noqa: F811
    """checkpoint.async on 2 FSDP2 ranks. The worker holds each background write until the run has logged two more
    steps (MMADAPT_TEST_HOLD_WRITE=2): steps 3 and 4 are logged while step 2's checkpoint is in flight, and the run's
    numbers equal the synchronous reference's bitwise. Then a run whose step-4 write is held for ever is killed
    (SIGKILL, every process) once step 5 is logged: step 2 is its newest complete checkpoint, and resuming from it
    gives the reference's steps 3-6 bitwise."""
    reference = launch(dataset, "fsdp-2", "distributed.strategy=fsdp", procs=2) if not (
        dataset / "fsdp-2" / "log.jsonl").exists() else records(dataset / "fsdp-2")
    held = launch(dataset, "async", "distributed.strategy=fsdp", "checkpoint.async=true", procs=2, worker=True,
                  MMADAPT_TEST_HOLD_WRITE="2")
    assert [r.get("saving") for r in held] == [None, None, 2, 2, 4, 4], held
    assert [r["loss"] for r in held] == [r["loss"] for r in reference]
    assert is_sharded(dataset / "async" / "checkpoints" / "step-0000006")

    out = dataset / "killed"
    shutil.rmtree(out, ignore_errors=True)
    process = subprocess.Popen(command(dataset, "killed", "distributed.strategy=fsdp", "checkpoint.async=true",
                                       procs=2, worker=True),
                               env=env(MMADAPT_TEST_HOLD_WRITE="forever:4"), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "log.jsonl").exists() and len(records(out)) >= 5):
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
            time.sleep(0.2)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and its workers (torchrun's share its session here)
        subprocess.run(["pkill", "-KILL", "-f", str(out)], check=False)
        process.wait()
    assert latest_checkpoint(out).name == "step-0000002"
    assert any(p.name.startswith(".tmp-step-0000004") for p in (out / "checkpoints").iterdir())
    resumed = launch(dataset, "killed", "distributed.strategy=fsdp", "checkpoint.async=true", "--resume", procs=2)
    same(reference, resumed, exact=True, what="killed while saving asynchronously")
    assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())
