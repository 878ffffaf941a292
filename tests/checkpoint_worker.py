"""`python -m mmadapt` with each background checkpoint write held (tests/test_checkpoint_ranks.py).

MMADAPT_TEST_HOLD_WRITE=K: a write started at step s finishes only once OUT/log.jsonl holds step s + K (the run went
on K steps while it was in flight); =forever:S: the write of step S never finishes (the process is killed meanwhile).
Every rank holds (each reads the log rank 0 writes), so the background collectives stay paired.
"""

import json
import os
import sys
import time

from mmadapt.cli import main
from mmadapt.train.saving import CheckpointWriter

HOLD = os.environ["MMADAPT_TEST_HOLD_WRITE"]
original = CheckpointWriter._complete_in_background


def logged(out):
    try:
        return [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return []


def held(self, written, stage, saved, start):
    if HOLD.startswith("forever:"):
        while saved.step == int(HOLD.split(":")[1]):
            time.sleep(1)
    else:
        deadline = time.monotonic() + 120
        while saved.step + int(HOLD) not in logged(self.out) and time.monotonic() < deadline:
            time.sleep(0.05)
    return original(self, written, stage, saved, start)


CheckpointWriter._complete_in_background = held
sys.argv[0] = "mmadapt"
sys.exit(main())
