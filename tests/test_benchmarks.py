"""The benchmark runner still runs (quick shapes; it asserts nothing about speed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def run(script: str, *args: str, timeout: int = 600) -> str:
    """stdout of `python benchmarks/<script> <args>`, run from the benchmarks directory (it must succeed)."""
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          check=True, timeout=timeout, cwd=BENCHMARKS).stdout


@pytest.mark.slow
def test_bench_core_quick_run_prints_its_tables():
    out = run("bench_core.py", "--quick", "--reps", "1", timeout=300)
    assert "| mmadapt locate+scatter |" in out and "| train (fwd+bwd+AdamW) | fp32 |" in out


@pytest.mark.slow
def test_bench_packing_quick_run_prints_its_tables():
    out = run("bench_packing.py", "--quick", timeout=300)
    assert "| llama |" in out and "| qwen3_5 |" in out and "| packed, isolated per sample (mmadapt) |" in out


@pytest.mark.slow
def test_run_all_quick_prints_the_sections_asked_for():
    # sections 4, 7 and 8 are the packing and loss benchmarks' own functions, run by their tests below
    out = run("run_all.py", "--quick", "--sections", "1-3,5,6")
    for section in ("### 1. Training step", "### 2. Injection", "### 3. Contract checks", "### 5. Preprocessing",
                    "### 6. Peak memory"):
        assert section in out
    for section in ("### 4. Packed vs padded", "### 7. Loss without full logits", "### 8. Packed rows"):
        assert section not in out


@pytest.mark.slow
def test_bench_load_quick_run_prints_its_table():
    out = run("bench_load.py", "--quick", "--reps", "1")
    assert "### Loading a saved Qwen3.5-0.8B-shaped random VLM" in out and "2 text layers" in out
    assert "| mmadapt.build_model (qwen3_5_vit + qwen_merger + qwen3_5) |" in out
    assert "| transformers Qwen3_5ForConditionalGeneration.from_pretrained |" in out
    assert "| mmadapt peak RSS <= 1.2x checkpoint bytes |" in out and "max |mmadapt - transformers|" in out


@pytest.mark.slow
def test_bench_loss_quick_run_prints_its_tables():
    out = run("bench_loss.py", "--quick")
    assert "gradients freed before each step, as the trainer does" in out  # the step's peak includes them
    assert "| Qwen3.5-0.8B-shaped (tiny;" in out and "| LLaVA-1.5-shaped (tiny;" in out
    assert "| 2 x 4 samples x 32 tokens | (8, 32) |" in out


@pytest.mark.slow
def test_bench_dpo_quick_run_prints_its_table():
    out = run("bench_dpo.py", "--quick", "--training", "lora", "--steps", "1")
    assert "| LoRA backbone (reference: adapters off) |" in out and "[target <= 1.3x]" in out


@pytest.mark.slow
def test_bench_grpo_quick_run_prints_its_table():
    out = run("bench_grpo.py", "--quick", timeout=300)  # check=True: both layouts gave the same log-probs and gradients
    assert "| variant | beta | vision encodings per step |" in out
    assert "| shared (each picture once) | 0 | 2 (32 tokens) |" in out  # B = 2 pictures, once each
    assert "| per row (trl, verl, EasyR1) | 0 | 4 (64 tokens) |" in out  # once per row: B x G = 4
    assert "| per row (trl, verl, EasyR1) | 0.04 | 8 (128 tokens) |" in out  # and again for the reference


@pytest.mark.slow
def test_bench_rollout_quick_run_prints_its_table():
    out = run("bench_rollout.py", "--quick", timeout=300)
    assert "| prefill once, cache copied G ways (mmadapt) | 2 | 2 |" in out  # B = 2 prompts prefilled, 2 pictures
    assert "| G prefills, each picture once | 2 | 4 |" in out
    assert "| G prefills, a picture per row (HF generate, trl) | 4 | 4 |" in out
    assert out.count("| 100% |") == 3  # the same answers, token for token


@pytest.mark.slow
def test_bench_checkpointing_quick_run_prints_its_table():
    out = run("bench_checkpointing.py", "--quick")
    assert "#### Activation checkpointing: fwd + bwd of 64 tokens" in out
    assert "| Qwen3.5 tiny | 2 |" in out and "| llama tiny | 4 |" in out


@pytest.mark.slow
def test_bench_plan_quick_run_prints_its_table(tmp_path, monkeypatch):
    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path))
    out = run("bench_plan.py", "--quick")
    assert "| config | depth (of real) | micro-batch | predicted MiB | VmHWM MiB, glibc defaults |" in out
    assert "| Qwen3.5-0.8B full | tiny | 2 x 128 tokens" in out


@pytest.mark.slow
def test_bench_plan_long_quick_run_trains_through_mmadapt_train(tmp_path, monkeypatch):
    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path))
    out = run("bench_plan.py", "--long", "--quick")
    assert "| config (long samples, `mmadapt train`) |" in out
    row = next(line for line in out.splitlines() if line.startswith("| LLaMA-width LoRA"))
    assert "| tiny | 2 x 320 tokens" in row and "linear in length" in row
    assert float(row.split("|")[-3].replace(",", "")) > 0  # a VmHWM was read at the trainer's first save


@pytest.mark.slow
def test_bench_plan_examples_quick_plans_every_example_on_its_gpus_without_its_checkpoints(tmp_path, monkeypatch):
    """The examples at their parts' tiny presets (parsing, stages, precision, planning from presets), each on the
    GPUs its header names; the real-width run (`--examples`) also checks docs/training.md's totals within 5%."""
    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path))
    out = run("bench_plan.py", "--examples", "--quick")  # check=True: exit 0, every example fits its GPUs
    for example in sorted(p.name for p in (BENCHMARKS.parent / "examples").glob("*.yaml")):
        row = next(line for line in out.splitlines() if line.startswith(f"| `examples/{example}` |"))
        assert row.endswith("with the margin) |") and ": yes (" in row, row
    assert "| 8 x 80GiB: yes (" in out and "| 1 x 24GiB: yes (" in out  # the QLoRA recipe: one 24 GiB GPU
    assert "# every example fits the GPUs its header names (several: with FSDP2)" in out


@pytest.mark.slow
def test_bench_qlora_quick_measures_a_lora_and_a_qlora_step_and_the_nf4_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path))
    out = run("bench_qlora.py", "--quick")
    lora, qlora = (next(line for line in out.splitlines() if line.startswith(f"| tiny | tiny | {mode} |"))
                   for mode in ("lora", "qlora"))
    assert lora.split("|")[5].strip() == "0" and int(qlora.split("|")[5].replace(",", "")) > 0
    assert 0.5 < float(qlora.split("|")[6].split()[0]) < 0.6  # 4-bit codes + scales (tiny blocks: more scales)
    assert all(float(row.split("|")[8].replace(",", "")) > 0 for row in (lora, qlora))  # a VmHWM was read


@pytest.mark.slow
def test_gpu_check_runs_its_checks_on_the_cpu(tmp_path, monkeypatch):
    """Every section but fsdp: on a CPU it is `torchrun` with gloo over the tiny Qwen3.5 run that
    tests/test_distributed.py::test_fsdp2_and_ddp_equal_one_process already compares with one process (and DDP)."""
    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path))
    out = run("gpu_check.py", "--device", "cpu", "--quick", "--only", "steps,packing,speed", timeout=900)
    assert "| check | configuration | result | tolerance / target | pass |" in out  # check=True: every check passed
    for check in ("| step: loss |", "| step: gradients |", "| packing: packed == padded |", "| packing: isolation |",
                  "| speed |"):
        assert check in out, check
    for backbone in ("llama", "qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"):
        assert f"+{backbone} tiny" in out, backbone
    assert "FAIL" not in out


@pytest.mark.slow
def test_bench_stop_strings_quick_run_prints_its_table():
    out = run("bench_stop_strings.py", "--quick", timeout=300)
    assert "| tokens | stream ms |" in out and "| 2000 |" in out


@pytest.mark.slow
def test_bench_serve_quick_run_prints_its_table():
    out = run("bench_serve.py", "--quick", timeout=600)
    assert "### Generation:" in out and "| mmadapt serve (HTTP, streamed, openai client) |" in out


@pytest.mark.slow
def test_bench_checkpoint_quick_run_prints_a_row_per_format():
    out = run("bench_checkpoint.py", "--quick", "--saves", "2", timeout=300)  # 3 torchruns of 2 ranks on gloo
    assert "#### Checkpoints: rank 0's host memory and the stall per save (2 ranks, FSDP2, fp32, gloo, CPU" in out
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| Qwen3.5 tiny, 2 layers |")]
    assert [r[4] for r in rows] == ["gathered (full state on rank 0)", "sharded (DCP)", "sharded, async (DCP)"]
    for cells in rows:
        stall, complete = float(cells[-2]), float(cells[-1])
        assert 0 < stall <= complete, cells  # a save is complete no sooner than the loop goes on
    assert float(rows[0][-2]) == float(rows[0][-1])  # a gathered save blocks until it is complete
