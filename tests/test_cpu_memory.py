"""A CPU training process gives freed activations back to the OS (mmadapt.train.cpu_memory): glibc's rising mmap
threshold otherwise keeps freed blocks of up to 32 MiB in the heap, and a training step's memory doubled (issue 33)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from helpers import TINY_LLAVA

from mmadapt import build_model
from mmadapt.data import Collator
from mmadapt.synthetic import synthetic_samples
from mmadapt.train import RunConfig, Trainer
from mmadapt.train.cpu_memory import return_freed_memory

# a 24 MiB block mapped and freed (glibc raises its threshold to 24 MiB), then forty 20 MiB tensors freed among
# small ones that stay: what a training step does with its activations
SCENARIO = """
import sys
from pathlib import Path
import torch
from mmadapt.train.cpu_memory import return_freed_memory

def rss_mib():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) // 1024

if sys.argv[1] == "fixed":
    assert return_freed_memory() is not None
base = rss_mib()
t = torch.ones(6 << 20)
del t
keep, big = [], []
for _ in range(40):
    big.append(torch.ones(5 << 20))
    keep.append(torch.ones(16 << 10))
del big
print(rss_mib() - base)
"""


def retained_mib(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", SCENARIO, mode], capture_output=True, text=True, check=True, env=env)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
@pytest.mark.slow  # two Python processes, each importing torch and allocating 800 MiB
def test_freed_activations_go_back_to_the_os():
    assert retained_mib("default") > 400  # glibc's defaults keep the freed 800 MiB in the heap
    assert retained_mib("fixed") < 100


def test_a_users_own_allocator_settings_are_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert return_freed_memory() is None
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert return_freed_memory() is None


def test_a_cpu_trainer_fixes_the_threshold(tmp_path, monkeypatch):
    from mmadapt.train import trainer as trainer_module

    calls = []
    monkeypatch.setattr(trainer_module, "return_freed_memory", lambda: calls.append("cpu") or "logged")
    config = RunConfig.from_dict({"model": TINY_LLAVA, "train": {"steps": 1, "out": str(tmp_path / "out")}})
    model = build_model("clip", "mlp2x_gelu", "llama", preset="tiny")
    Trainer(model, config, synthetic_samples(model, [1, 1]), Collator.for_model(model, 0))
    assert calls == ["cpu"]
