"""`train.objective: distill` (alias `gkd`): on-policy distillation end to end on tiny models built here. The
per-token loss equals trl's GKD on the transformers exports' logits; each picture is encoded once per step by the
student and once by the teacher; `mmadapt train` lowers the divergence to a fixed teacher and refuses a teacher with
another tokenizer in one line; torchrun (FSDP2, DDP) equals one process, evals with uneven batches included; `mmadapt
plan` counts the rollout and the teacher."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import run_bounded
from PIL import Image

from mmadapt.train import RunConfig, Trainer
from mmadapt.train.objectives.base import StepTotals
from mmadapt.train.run import build_run

COLOURS = [(220, 30, 30), (30, 30, 220), (30, 200, 30), (200, 200, 30)]
TESTS = str(Path(__file__).parent)


def prompts_file(root: Path, n: int = 4, name: str = "prompts.jsonl") -> Path:
    """`n` prompts with one image each (no `answer`: distillation needs none)."""
    records = []
    for k in range(n):
        Image.new("RGB", (32, 32), COLOURS[k % len(COLOURS)]).save(root / f"{k}.png")
        records.append({"id": f"p{k}", "problem": "<image>Which colour?", "images": [f"{k}.png"]})
    path = root / name
    path.write_text("\n".join(json.dumps(r) for r in records))
    return path


def base_overrides(root: Path, prompts: Path) -> list[str]:
    return [f"data.train={prompts}", f"data.image_root={root}", "data.max_length=128", "train.progress=false",
            "train.log_every=1"]


def teacher_dir(root: Path, prompts: Path, *, sharpen: float = 1.0, tokenizer=None) -> Path:
    """A tiny teacher of the default model (a differently seeded init: train.seed 7), its output layer scaled by
    `sharpen` (a peaked teacher the student can be seen to approach), saved with the run's tokenizer or `tokenizer`."""
    parts = build_run(RunConfig.load(None, [*base_overrides(root, prompts), f"train.out={root / 'build'}",
                                            "train.seed=7"]))
    with torch.no_grad():
        parts.model.backbone.get_output_embeddings().weight.mul_(sharpen)
    out = root / ("teacher" if tokenizer is None else "teacher-other")
    parts.model.save_pretrained(out, tokenizer=tokenizer or parts.tokenizer)
    return out


# ---- (a) the loss equals trl's GKD ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny LLaVA student and a differently seeded teacher with the real Llama-2 tokenizer, exported to
    transformers (what trl trains)."""
    from real_tokenizers import real_tokenizer

    import mmadapt
    from mmadapt import Processor
    from mmadapt.processor import export_processor

    tokenizer, paths = real_tokenizer("llama2"), []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = mmadapt.build_model("clip", "mlp2x_gelu", "llama").eval()
        with torch.no_grad():  # logits far from uniform, so the divergences are not all ~0
            model.backbone.get_output_embeddings().weight.mul_(4)
        processor = Processor.for_model(model, tokenizer)
        path = tmp_path_factory.mktemp(f"export-{seed}")
        model.save_pretrained(path, format="transformers", processor_export=export_processor,
                              tokenizer=processor.tokenizer)
        paths.append(path)
    return paths


@pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")
@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.5, 0.7)])
def test_the_per_token_loss_equals_trls_gkd_on_the_transformers_models_logits(exported, beta, temperature):
    """Two rows (a prompt then a completion, right-padded): the objective's `micro_loss` with the step's totals =
    the rows' completion tokens equals trl's `GKDTrainer.generalized_jsd_loss` on the transformers models' shifted
    logits with labels (its batchmean over the kept labels: the mean over the completion tokens), fp32, 1e-5."""
    pytest.importorskip("trl")
    from transformers import AutoModelForImageTextToText
    from trl.experimental.gkd import GKDTrainer

    from mmadapt.train.objectives.distill import DistillObjective
    from mmadapt.train.objectives.distill.teacher import load_teacher

    student, _ = load_teacher(str(exported[0]))  # mmadapt's model of the student's export
    cfg = RunConfig.load(None, ["train.objective=distill", f"distill.teacher={exported[1]}", f"distill.beta={beta}",
                                f"distill.loss_temperature={temperature}", "distill.chunk_size=3"])
    objective = DistillObjective(cfg)
    objective.setup(student)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 30000, (2, 12), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0  # row 1: 9 tokens, right-padded
    labels = ids.clone()
    labels[:, :6] = -100  # prompts of 6 tokens; completions of 6 and 3
    labels[attention == 0] = -100
    batch = {"input_ids": ids, "attention_mask": attention, "labels": labels,
             "rollout": {"student": None, "teacher": None}}
    n = int((labels[:, 1:] != -100).sum())
    terms = objective.micro_loss(SimpleNamespace(wrapped=student), batch, StepTotals(units=n, tokens=n,
                                                                                       micro_batches=1))
    with torch.no_grad():
        theirs = [AutoModelForImageTextToText.from_pretrained(p).eval()(input_ids=ids, attention_mask=attention).logits
                  for p in exported]
    expected = GKDTrainer.generalized_jsd_loss(theirs[0][:, :-1], theirs[1][:, :-1], labels[:, 1:], beta=beta,
                                               temperature=temperature)
    assert float(expected) > 1e-3
    assert abs(float(terms.loss) - float(expected)) <= 1e-5, (float(terms.loss), float(expected))
    assert abs(float(terms.sums["divergence"]) / n - float(expected)) <= 1e-5


# ---- (b) one encoding per picture per step, by each model ----------------------------------------------------------
@pytest.mark.parametrize("g", [2, 3])
def test_each_picture_is_encoded_once_per_step_by_the_student_and_once_by_the_teacher(tmp_path, g):
    """A hook on each model's vision tower over one step of 2 micro-batches of 2 prompts (one image each; G answers
    each: rollout, the teacher's scoring of the G rows, the student's forward and backward): the student's tower runs
    once per micro-batch on its 2 images, and so does the teacher's."""
    prompts = prompts_file(tmp_path)
    teacher = teacher_dir(tmp_path, prompts)
    cfg = RunConfig.load(None, [*base_overrides(tmp_path, prompts), f"train.out={tmp_path / 'out'}",
                                "train.objective=distill", f"distill.teacher={teacher}", "data.batch_size=2",
                                "train.grad_accum=2", f"distill.num_generations={g}",
                                "distill.max_completion_length=4", "train.steps=1"])
    parts = build_run(cfg)
    trainer = Trainer(parts.model, cfg, parts.train_data, parts.collate)
    seen = {"student": [], "teacher": []}

    def counter(name):
        return lambda module, args, output: seen[name].append(int(args[1].shape[0]))

    hooks = [parts.model.encoder.register_forward_hook(counter("student")),
             trainer.objective.teacher.encoder.register_forward_hook(counter("teacher"))]
    try:
        history = trainer.fit()["history"]
    finally:
        for hook in hooks:
            hook.remove()
    assert seen == {"student": [2, 2], "teacher": [2, 2]}, seen
    assert math.isfinite(history[0]["loss"]) and history[0]["completion_length/mean"] >= 1


# ---- (c) mmadapt train ---------------------------------------------------------------------------------------------
def train_command(root: Path, out: str, *overrides: str, procs: int = 1, timeout: float = 300) -> tuple[int, str]:
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                    str(procs)] if procs > 1 else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    code, stderr = run_bounded([*launcher, "-m", "mmadapt", "train", str(root / "base.yaml"),
                                f"train.out={root / out}", *overrides], timeout, env)
    assert code is not None, f"{out}: no end after {timeout} s (ranks out of step?)\n{stderr[-2000:]}"
    return code, stderr


def write_base(root: Path, prompts: Path, teacher: Path, *lines: str, eval_prompts: Path | None = None) -> None:
    evals = f", eval: {eval_prompts}" if eval_prompts else ""
    (root / "base.yaml").write_text(
        f"data: {{train: {prompts}{evals}, image_root: {root}, max_length: 128}}\n"
        f"distill: {{teacher: {teacher}, num_generations: 2, max_completion_length: 5}}\n" + "\n".join(lines) + "\n")


@pytest.mark.slow  # 12 steps in a fresh process (~35 s)
def test_mmadapt_train_lowers_the_divergence_to_a_fixed_teacher(tmp_path):
    """`mmadapt train` (train.objective distill, the backbone trained, 12 steps, lr 3e-3): finite losses, and the
    divergence to a peaked teacher (a differently seeded tiny model, its logits scaled x 8) falls (the last 3 steps'
    mean below 0.9 x the first 3's)."""
    prompts = prompts_file(tmp_path)
    teacher = teacher_dir(tmp_path, prompts, sharpen=8.0)
    write_base(tmp_path, prompts, teacher, "train: {steps: 12, lr: 3.0e-3, progress: false, log_every: 1, "
               "objective: distill}", "stages: {backbone: full}")
    code, stderr = train_command(tmp_path, "out", "data.batch_size=2")
    assert code == 0, stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert len(log) == 12 and all(math.isfinite(r["loss"]) for r in log), log
    first, last = (sum(r["divergence"] for r in part) / 3 for part in (log[:3], log[-3:]))
    assert last < 0.9 * first, [r["divergence"] for r in log]  # measured: 0.785 -> 0.667
    assert all(k in log[0] for k in ("rollout_s", "completion_length/mean", "completion_length/max"))


def test_mmadapt_train_refuses_a_teacher_with_another_tokenizer_in_one_line(tmp_path):
    """A teacher saved with another tokenizer (one special token added; the same model) is refused by `mmadapt train`
    (through trl's alias `gkd`) before any step: exit 2, one line naming both sources, no traceback."""
    from mmadapt.data import char_tokenizer

    prompts = prompts_file(tmp_path)
    write_base(tmp_path, prompts, tmp_path / "unused", "train: {progress: false}")
    other = char_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<teacher-only>"]})
    refused = teacher_dir(tmp_path, prompts, tokenizer=other)
    code, stderr = train_command(tmp_path, "refused", "train.objective=gkd", f"distill.teacher={refused}",
                                 "train.steps=1")
    lines = [line for line in stderr.splitlines() if line.startswith("error")]
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert len(lines) == 1 and str(refused) in lines[0] and "another tokenizer" in lines[0], lines


# ---- (d) torchrun --------------------------------------------------------------------------------------------------
@pytest.mark.slow  # six launches, four of them torchrun with 2 processes
def test_ddp_and_fsdp2_with_two_processes_equal_one_process_with_uneven_evals(tmp_path):
    """2 steps of 2 prompts, G 2, an eval at each step over 3 eval prompts one per batch (2 batches on rank 0, 1 on
    rank 1): the losses, divergences, answer lengths and evals of 2 processes (FSDP2, DDP; one prompt each) equal one
    process's within 1e-5, the gradient norm within 1e-5 relative; so do they when one rank's prompt is a bad
    record."""
    prompts = prompts_file(tmp_path)
    held = prompts_file(tmp_path, 3, "eval.jsonl")
    teacher = teacher_dir(tmp_path, prompts, sharpen=8.0)
    write_base(tmp_path, prompts, teacher, "train: {steps: 2, lr: 1.0e-2, progress: false, log_every: 1, "
               "eval_every: 1, objective: distill}", eval_prompts=held)

    def launch(out, *overrides, procs=1):
        code, stderr = train_command(tmp_path, out, *overrides, procs=procs)
        assert code == 0, stderr[-3000:]
        return [json.loads(line) for line in (tmp_path / out / "log.jsonl").read_text().splitlines()]

    one = launch("one", "data.batch_size=2")
    assert all(math.isfinite(r["eval_loss"]) and r["divergence"] > 1e-4 for r in one), one
    for strategy in ("fsdp", "ddp"):
        same(one, launch(strategy, "data.batch_size=1", f"distributed.strategy={strategy}", procs=2), strategy,
             ("loss", "divergence", "tokens", "completion_length/mean", "eval_loss", "eval_completion_length"))
    # a rank whose micro-batch is one bad record (a missing image, counted): under FSDP2 it answers a stand-in whose
    # rows count for nothing (its encoding, rollout and forward paired with the other rank's), under DDP nothing
    bad = json.dumps({"id": "bad", "problem": "<image>Which colour?", "images": ["missing.png"]})
    (tmp_path / "with-bad.jsonl").write_text(prompts.read_text().splitlines()[0] + "\n" + bad)
    with_bad = f"data.train={tmp_path / 'with-bad.jsonl'}"
    one = launch("bad-one", "data.batch_size=2", with_bad)
    assert all(r["problems"] == 1 for r in one), one
    for strategy in ("fsdp", "ddp"):
        same(one, launch(f"bad-{strategy}", "data.batch_size=1", f"distributed.strategy={strategy}", with_bad,
                         procs=2), strategy, ("loss", "divergence", "tokens", "problems", "completion_length/mean"))


def same(one: list[dict], two: list[dict], strategy: str, keys: tuple[str, ...]) -> None:
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        for key in keys:
            assert abs(a[key] - b[key]) <= 1e-5, (strategy, key, a[key], b[key])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (strategy, a, b)


# ---- 6: mmadapt plan -----------------------------------------------------------------------------------------------
def test_a_distill_run_is_planned_with_its_rollout_and_the_teacher_on_every_gpu(tmp_path, monkeypatch):
    """`mmadapt plan` of a distill run: the teacher's weights (its parameters x the compute dtype's bytes, the same on
    1 and 4 GPUs: replicated) and the rollout (G rows per prompt) counted beside the student's."""
    from mmadapt.generation import generation_bytes
    from mmadapt.model import VisionLanguageModel
    from mmadapt.train.plan.predict import predict

    prompts = prompts_file(tmp_path)
    teacher = teacher_dir(tmp_path, prompts)
    cfg = RunConfig.load(None, [*base_overrides(tmp_path, prompts), "train.objective=distill",
                                f"train.out={tmp_path / 'out'}", f"distill.teacher={teacher}",
                                "distill.num_generations=4", "data.batch_size=2"])
    plan = predict(cfg, gpus=1, device="cpu")
    count = sum(p.numel() for p in VisionLanguageModel.from_pretrained(teacher).parameters())
    assert plan.per_gpu["teacher"] == 4 * count
    model = build_run(cfg).model
    assert plan.per_gpu["rollout"] == generation_bytes(model, 2, 4, 128, 4)  # between steps; the teacher throughout:
    from mmadapt.train.objectives import DistillObjective

    monkeypatch.setattr(DistillObjective, "resident_memory", lambda self, model, precision: {})
    assert plan.per_gpu["total"] - predict(cfg, gpus=1, device="cpu").per_gpu["total"] == 4 * count  # at every moment
    monkeypatch.undo()
    assert predict(cfg, gpus=4, device="cpu").per_gpu["teacher"] == plan.per_gpu["teacher"]
    from mmadapt.cli import main

    run_file = tmp_path / "run.yaml"
    run_file.write_text(f"data: {{train: {prompts}, image_root: {tmp_path}}}\ntrain: {{objective: distill}}\n"
                        f"distill: {{teacher: {teacher}}}\n")
    assert main(["plan", str(run_file), "--gpu-memory", "1TiB"]) == 0
