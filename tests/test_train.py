"""The trainer: config, accumulation == one batch, exact resume, atomic checkpoints, stages, LoRA, HF Trainer.

Tolerances: accumulation vs one batch, gradients within 1e-6 relative (fp32); resume, losses
bitwise equal (CPU, fp32); LoRA merged vs unmerged logits within 1e-5.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_LLAVA, write_jsonl, write_run

from mmadapt import build_model
from mmadapt.data import Collator
from mmadapt.synthetic import synthetic_samples
from mmadapt.train import RunConfig, Trainer, apply_stages, latest_checkpoint, merge_lora
from mmadapt.train.config import LoraSection, StagesSection
from mmadapt.train.stages import lora_modules
from mmadapt.train.steps import accumulate

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
LLAVA = ("clip", "mlp2x_gelu", "llama")


def tiny(names=QWEN, seed=0):
    torch.manual_seed(seed)
    return build_model(*names)


def samples_for(model, n=16, seed=0):
    images = [1, 0, 2, 1][: 4] * (n // 4)
    text = [4 + (7 * k) % 13 for k in range(n)]  # different supervised-token counts per sample
    return synthetic_samples(model, images, text_lengths=text, seed=seed)


def config(tmp_path, *overrides):
    return RunConfig.load(None, [f"train.out={tmp_path}", "train.progress=false", "train.lr=1e-3",
                                 "stages.encoder=full", *overrides])


def run(names, tmp_path, *overrides, model=None):
    model = model or tiny(names)
    trainer = Trainer(model, config(tmp_path, *overrides), samples_for(model), Collator.for_model(model, 0))
    return trainer, trainer.fit()


def losses(summary):
    return [r["loss"] for r in summary["history"]]


# ---- config ---------------------------------------------------------------------------------------
def test_config_overrides_unknown_keys_and_round_trip(tmp_path):
    cfg = RunConfig.load(None, ["train.lr=3e-4", "stages.preset=llava-stage1", "data.packing=true"])
    assert (cfg.train.lr, cfg.stages.modes()["backbone"], cfg.data.packing) == (3e-4, "frozen", True)
    with pytest.raises(ValueError, match=r"unknown config key 'train.lrr'. Did you mean 'train.lr'\?"):
        RunConfig.load(None, ["train.lrr=1"])
    with pytest.raises(ValueError, match="Did you mean 'precision'"):
        RunConfig.from_dict({"precison": {"policy": "fp32"}})
    with pytest.raises(ValueError, match="must be one of"):
        RunConfig.load(None, ["precision.policy=fp16"])
    cfg.save(tmp_path / "c.yaml")
    assert RunConfig.load(tmp_path / "c.yaml") == cfg.resolved()  # saved with its paths absolute


# ---- accumulation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen", "llava"])
def test_gradient_accumulation_equals_one_batch(names, tmp_path):
    """4 micro-batches of 2 == 1 batch of 8: relative gradient difference <= 1e-6 overall, <= 1e-5 per tensor
    whose gradient is at least 1e-4 of the largest one.

    Rows are padded to one width so both runs do the same per-row arithmetic, except the loss's matmuls over
    the supervised positions (mmadapt.loss), whose shapes follow the micro-batch: fp32 rounding at 1e-7, which
    Gated DeltaNet's A_log / dt_bias gradients (1e-5 of the largest, sums that nearly cancel) amplify to 9e-5
    relative (5e-6 with train.full_logits). Those, and tensors that get zero gradient up to rounding (attention
    key biases), are covered by the global check.
    """
    grads = []
    for batch_size, accum in ((8, 1), (2, 4)):
        model = tiny(names)
        samples = samples_for(model)
        collate = Collator.for_model(model, 0, pad_to_multiple_of=max(map(len, samples)))
        trainer = Trainer(model, config(tmp_path, f"data.batch_size={batch_size}", f"train.grad_accum={accum}"),
                          samples, collate)
        batches = trainer.loader(0)
        micro = [next(batches) for _ in range(accum)]
        counts = [int((b["labels"][:, 1:] != -100).sum()) for b in micro]
        accumulate(trainer, trainer.objective, micro)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert len(set(counts)) > 1  # the micro-batches really differ in supervised tokens
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    one, accumulated = grads
    global_norm = torch.stack([g.norm() for g in one.values()]).norm()
    global_diff = torch.stack([(accumulated[n] - g).norm() for n, g in one.items()]).norm()
    assert global_diff <= 1e-6 * global_norm
    largest = max(g.norm() for g in one.values())
    for name, g in one.items():
        if g.norm() >= 1e-4 * largest:
            assert (accumulated[name] - g).norm() <= 1e-5 * g.norm(), name


# ---- resume and atomic checkpoints ------------------------------------------------------------------
@pytest.mark.slow
def test_stop_and_resume_gives_bitwise_equal_losses(tmp_path, monkeypatch):
    _, full = run(QWEN, tmp_path / "full", "train.steps=6", "checkpoint.every=3")

    original = Trainer.save

    def save_then_stop(self, **kwargs):
        original(self, **kwargs)
        if self.step == 3:
            raise KeyboardInterrupt  # the job is stopped right after its step-3 checkpoint

    monkeypatch.setattr(Trainer, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run(QWEN, tmp_path / "cut", "train.steps=6", "checkpoint.every=3")
    monkeypatch.setattr(Trainer, "save", original)
    _, resumed = run(QWEN, tmp_path / "cut", "train.steps=6", "checkpoint.every=3", "checkpoint.resume=true",
                           model=tiny(QWEN, seed=123))  # different init: everything must come from the checkpoint
    assert losses(resumed)[3:] == losses(full)[3:]  # bitwise
    assert losses(resumed)[:3] == losses(full)[:3]  # history restored from the checkpoint
    logged = [json.loads(line)["step"] for line in (tmp_path / "cut" / "log.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]


def test_a_gathered_checkpoint_of_an_earlier_version_resumes_bitwise_and_says_which_format_it_read(tmp_path, caplog):
    """A run written in the gathered format (mmadapt < 0.26, or checkpoint.format: gathered) resumes under the
    sharded default: the losses after its step-2 checkpoint equal the uninterrupted run's bitwise, the log names the
    format read, and the run's later checkpoints are sharded."""
    import shutil

    from mmadapt.sharded_checkpoint import is_sharded

    _, full = run(QWEN, tmp_path / "full", "train.steps=4", "checkpoint.every=2", "checkpoint.format=gathered")
    cut = tmp_path / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "full" / "config.yaml", cut / "config.yaml")
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-0000002", cut / "checkpoints" / "step-0000002")
    assert (cut / "checkpoints" / "step-0000002" / "model.safetensors").is_file()
    with caplog.at_level("INFO", logger="mmadapt.train.trainer"):
        _, resumed = run(QWEN, cut, "train.steps=4", "checkpoint.every=2", "checkpoint.resume=true",
                         model=tiny(QWEN, seed=123))
    assert losses(resumed) == losses(full)
    assert "at step 2 (gathered (one model.safetensors" in caplog.text
    assert is_sharded(latest_checkpoint(cut)) and latest_checkpoint(cut).name == "step-0000004"


KILL_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {tests!r})
import mmadapt.train.checkpoint as ckpt
from test_train import run, QWEN
real_save = torch.save
def dying_save(obj, path, *a, **k):
    if "step-0000004" in str(path):
        os._exit(9)  # killed in the middle of writing the step-4 checkpoint
    return real_save(obj, path, *a, **k)
ckpt.torch.save = dying_save
run(QWEN, {out!r}, "train.steps=6", "checkpoint.every=2")
"""


@pytest.mark.slow
def test_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path):
    out = tmp_path / "run"
    script = KILL_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 9, result.stderr[-2000:]
    assert any(p.name.startswith(".tmp-step-0000004") for p in (out / "checkpoints").iterdir())
    assert latest_checkpoint(out).name == "step-0000002"
    (out / "checkpoints" / "step-0000004").mkdir()  # even a renamed directory without its marker is ignored
    assert latest_checkpoint(out).name == "step-0000002"
    _, resumed = run(QWEN, out, "train.steps=6", "checkpoint.every=2", "checkpoint.resume=true")
    _, full = run(QWEN, tmp_path / "full", "train.steps=6", "checkpoint.every=2")
    assert losses(resumed)[2:] == losses(full)[2:]
    logged = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]  # step 3-4 of the killed run are not logged twice
    assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())  # cleaned up


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_is_skipped_on_resume_naming_the_file(tmp_path, caplog):
    """A truncated shard file in the newest checkpoint: --resume warns and uses the one before it."""
    out = tmp_path / "run"
    run(QWEN, out, "train.steps=4", "checkpoint.every=2")
    newest = latest_checkpoint(out)
    marker = json.loads((newest / "COMPLETE").read_text())
    assert marker["step"] == 4 and set(marker["files"]) == {p.relative_to(newest).as_posix() for p in newest.rglob("*")
                                                            if p.is_file()} - {"COMPLETE"}
    weights = newest / WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert latest_checkpoint(out).name == "step-0000004"  # without verification it looks complete
    with caplog.at_level("WARNING"):
        assert latest_checkpoint(out, verify=True).name == "step-0000002"
    assert "step-0000004" in caplog.text and f"{WEIGHTS} is corrupt" in caplog.text
    _, resumed = run(QWEN, out, "train.steps=4", "checkpoint.every=2", "checkpoint.resume=true")
    _, full = run(QWEN, tmp_path / "full", "train.steps=4", "checkpoint.every=2")
    assert losses(resumed) == losses(full)  # redone from step 2, exactly


WEIGHTS = "state/__0_0.distcp"  # a one-process sharded checkpoint's shard of the model (and optimizer)


def flip_a_byte(path: Path) -> None:
    """Change one byte in the middle of `path` (a weight's value: the file still parses)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_checkpoint_given_directly_is_verified_before_it_is_loaded(tmp_path, caplog):
    """One byte of step 2's weights changed: chat / serve (`load_for_inference`) and export refuse that checkpoint,
    naming the file and what to do; the checkpoint before it still loads, and the run directory loads it with a
    warning."""
    from mmadapt.inference import load_for_inference
    from mmadapt.train.checkpoint import UnverifiedCheckpointError
    from mmadapt.train.export import export, load_trained

    out = tmp_path / "run"
    run(LLAVA, out, "train.steps=2", "checkpoint.every=1", "checkpoint.keep=5", "stages.encoder=frozen")
    newest = out / "checkpoints" / "step-0000002"
    flip_a_byte(newest / WEIGHTS)
    refused = (rf"checkpoint {newest} failed verification: {WEIGHTS} is corrupt .*"
               rf"\({newest}/{WEIGHTS}\)\. mmadapt never loads a checkpoint whose files do not match .*"
               rf"Fix: give the run directory {out} ")
    with pytest.raises(UnverifiedCheckpointError, match=refused):
        load_for_inference(newest)
    with pytest.raises(UnverifiedCheckpointError, match=refused):
        export(newest, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()
    load_trained(out / "checkpoints" / "step-0000001")
    with caplog.at_level("WARNING"):
        assert export(out, tmp_path / "exported").is_dir()  # the run's newest checkpoint that verifies: step 1
    assert f"skipping checkpoint {newest}: {WEIGHTS} is corrupt" in caplog.text


def test_resume_over_checkpoints_that_all_fail_verification_says_so_and_names_them(tmp_path):
    """Every checkpoint corrupt: --resume names each with its failing file (not "already holds checkpoints"), and so
    does exporting the run."""
    from mmadapt.train.checkpoint import UnverifiedCheckpointError
    from mmadapt.train.export import export

    out = tmp_path / "run"
    run(LLAVA, out, "train.steps=2", "checkpoint.every=1", "checkpoint.keep=5", "stages.encoder=frozen")
    for step in (1, 2):
        flip_a_byte(out / "checkpoints" / f"step-000000{step}" / WEIGHTS)
    every = (rf"every checkpoint in {out / 'checkpoints'} failed verification \(step-0000002: {WEIGHTS} is "
             rf"corrupt .*; step-0000001: {WEIGHTS} is corrupt .*\); the first failing file is "
             rf"{out / 'checkpoints' / 'step-0000002' / WEIGHTS}")
    with pytest.raises(UnverifiedCheckpointError, match=rf"^resume: {every}, so there is none to resume from\. Fix: "
                                                        r"restore the failing files .*run without --resume") as error:
        run(LLAVA, out, "train.steps=3", "checkpoint.every=1", "checkpoint.resume=true", "stages.encoder=frozen")
    assert "already holds checkpoints" not in str(error.value)
    with pytest.raises(UnverifiedCheckpointError, match=rf"^{every}\. Fix: "):
        export(out, tmp_path / "exported")


def test_a_failed_checkpoint_write_keeps_the_previous_one_and_says_so(tmp_path, monkeypatch):
    import errno

    import mmadapt.train.checkpoint as ckpt

    out = tmp_path / "run"
    run(QWEN, out, "train.steps=2", "checkpoint.every=1", "checkpoint.keep=5")
    real_save = ckpt.torch.save

    def full_disk(obj, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(ckpt.CheckpointWriteError, match=r"No space left on device.*The previous checkpoint "
                                                        r"step-0000002 is intact. Fix: free disk space"):
        run(QWEN, out, "train.steps=3", "checkpoint.every=1", "checkpoint.resume=true", "checkpoint.keep=5")
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-0000001", "step-0000002"]  # no half-written step 3, no temporary left
    assert ckpt.verify_checkpoint(out / "checkpoints" / "step-0000002") is None


@pytest.mark.parametrize("format", ["sharded", "gathered"])
def test_run_outputs_log_plot_config_and_checkpoint_contents(tmp_path, format):
    run(QWEN, tmp_path, "train.steps=3", f"checkpoint.format={format}")
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and {"loss", "grad_norm", "lr", "tokens"} <= set(lines[0])
    assert (tmp_path / "loss.png").stat().st_size > 1000
    ckpt = latest_checkpoint(tmp_path)
    own = ({"state/.metadata", WEIGHTS, "scheduler.pt", "rng/rank-00000.pt"} if format == "sharded" else
           {"model.safetensors", "optimizer.pt", "rng.pt"})
    assert {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} == own | {
        "trainer_state.json", "config.yaml", "config.json", "COMPLETE"}
    assert json.loads((ckpt / "COMPLETE").read_text()).get("format", "gathered") == format
    assert RunConfig.load(ckpt / "config.yaml") == RunConfig.load(tmp_path / "config.yaml")


@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen", "llava"])
def test_out_model_loads_alone_with_the_final_logits_and_export_equals_it(names, tmp_path):
    """OUT/model (LoRA merged, tokenizer saved) reloads with from_pretrained alone: logits within 1e-5 of the
    trainer's final (unmerged) model; `mmadapt export` of the run equals it tensor for tensor."""
    from transformers import AutoTokenizer

    from mmadapt import VisionLanguageModel
    from mmadapt.cli import main
    from mmadapt.data import char_tokenizer, prepare_tokenizer
    from mmadapt.synthetic import synthetic_batch

    model, tokenizer = tiny(names), char_tokenizer()
    prepare_tokenizer(model, tokenizer)
    cfg = config(tmp_path, "train.steps=2", "stages.preset=lora", "train.lr=1e-2")
    trainer = Trainer(model, cfg, samples_for(model), Collator.for_model(model, 0), tokenizer=tokenizer)
    trainer.fit()
    loaded = VisionLanguageModel.from_pretrained(tmp_path / "model").eval()
    assert not any("lora_" in k for k in loaded.state_dict())
    batch = synthetic_batch(loaded, (1, 2))
    with torch.no_grad():
        assert (model.eval()(**batch).logits - loaded(**batch).logits).abs().max() <= 1e-5
    again = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert again("What is <image>?")["input_ids"] == tokenizer("What is <image>?")["input_ids"]
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert saved["chat_template"] == model.backbone_spec.chat_template and saved["processor"]
    assert main(["export", str(tmp_path), str(tmp_path / "exported")]) == 0
    exported = VisionLanguageModel.from_pretrained(tmp_path / "exported").state_dict()
    assert all(torch.equal(v, exported[k]) for k, v in loaded.state_dict().items())


def test_mmadapt_train_writes_out_model_with_the_final_logits(tmp_path):
    """`mmadapt train` (LoRA, a LLaVA file of real PNGs, the default tokenizer) writes OUT/model; from_pretrained alone
    gives the logits of the trainer's final state (its last checkpoint, rebuilt with LoRA unmerged) within 1e-5."""
    import numpy as np
    from PIL import Image

    from mmadapt import ModelConfig, VisionLanguageModel
    from mmadapt.cli import main
    from mmadapt.synthetic import synthetic_batch
    from mmadapt.train.checkpoint import load_checkpoint

    rng = np.random.default_rng(0)
    records = []
    for k in range(8):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp_path / f"{k}.png")
        records.append({"id": str(k), "image": f"{k}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": f"noise {k}"}]})
    write_run(tmp_path / "run.yaml", model=TINY_LLAVA,
              data={"train": write_jsonl(tmp_path / "train.jsonl", records), "image_root": tmp_path, "batch_size": 4},
              train={"steps": 2, "lr": 1.0e-2, "out": tmp_path / "out", "progress": False},
              stages={"preset": "lora"}, lora={"r": 4})
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    loaded = VisionLanguageModel.from_pretrained(tmp_path / "out" / "model").eval()
    checkpoint = latest_checkpoint(tmp_path / "out")
    final = VisionLanguageModel(ModelConfig.from_dict(json.loads((checkpoint / "config.json").read_text())["mmadapt"]))
    apply_stages(final, RunConfig.load(checkpoint / "config.yaml").stages, LoraSection(r=4, alpha=32))
    final.load_state_dict(load_checkpoint(checkpoint)["model"], strict=True)
    assert lora_modules(final) and not lora_modules(loaded)
    batch = synthetic_batch(loaded, (1, 2))
    with torch.no_grad():
        assert (final.eval()(**batch).logits - loaded(**batch).logits).abs().max() <= 1e-5


def test_a_model_directory_is_sharded_above_the_limit(tmp_path):
    from mmadapt import VisionLanguageModel
    from mmadapt.synthetic import synthetic_batch

    model = tiny(QWEN).eval()
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json")
    batch = synthetic_batch(model, (1, 1))
    with torch.no_grad():
        assert torch.equal(VisionLanguageModel.from_pretrained(tmp_path).eval()(**batch).logits, model(**batch).logits)
    model.save_pretrained(tmp_path, overwrite=True)  # back to one file: the shards of the earlier save are removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


# ---- stages and LoRA ------------------------------------------------------------------------------
def test_stage1_changes_only_the_projector(tmp_path):
    model = tiny(LLAVA)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run(LLAVA, tmp_path, "train.steps=2", "stages.preset=llava-stage1", model=model)
    changed = {k.split(".")[0] for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"projector"}


def test_lora_on_qwen3_5_wraps_exactly_the_declared_modules():
    model = tiny(QWEN)
    declared = set(model.backbone_spec.lora_targets)
    expected = {name for name, m in model.backbone.named_modules()
                if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in declared}
    apply_stages(model, StagesSection(preset="lora"), LoraSection(r=4, alpha=8))
    wrapped = set(lora_modules(model.backbone))
    assert wrapped == expected
    kinds = {name.rsplit(".", 1)[-1] for name in wrapped}
    assert kinds == declared and not {"in_proj_a", "in_proj_b", "lm_head"} & kinds
    assert not lora_modules(model.encoder) and not lora_modules(model.projector)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n or n.startswith("projector.") for n in trainable)


@pytest.mark.parametrize("names", [QWEN, LLAVA], ids=["qwen", "llava"])
def test_lora_merged_export_equals_unmerged_logits(names, tmp_path):
    model = tiny(names)
    run(names, tmp_path / "run", "train.steps=3", "stages.preset=lora", "lora.r=4", "train.lr=1e-2",
                     model=model)
    assert (tmp_path / "run" / "adapters" / "backbone" / "adapter_model.safetensors").is_file()
    batch = Collator.for_model(model, 0)(samples_for(model, 4, seed=5))
    model.eval()
    with torch.no_grad():
        unmerged = model(**batch).logits
        merge_lora(model)
        assert not lora_modules(model)
        merged = model(**batch).logits
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path / "export")
    from mmadapt import VisionLanguageModel

    with torch.no_grad():
        reloaded = VisionLanguageModel.from_pretrained(tmp_path / "export").eval()(**batch).logits
    torch.testing.assert_close(reloaded, unmerged, rtol=0, atol=1e-5)


# ---- transformers Trainer ---------------------------------------------------------------------------
@pytest.mark.slow
def test_transformers_trainer_runs_with_the_model_and_collator(tmp_path):
    """transformers' Trainer (grad accumulation 2: it passes num_items_in_batch) trains the model through the loss
    without full logits as through the full logits: losses within 1e-5 relative, weights after 3 AdamW steps at
    lr 1e-3 within 1e-4 (the worst is Gated DeltaNet's A_log, whose gradient is 1e-8 of the largest). Its
    evaluation with compute_metrics still gets the logits."""
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments

    runs = []
    for full_logits in (False, True):
        model = tiny(QWEN)
        model.full_logits_loss = full_logits
        seen = []

        def metrics(prediction, seen=seen):
            seen.append(prediction.predictions.shape)
            return {"vocab": float(prediction.predictions.shape[-1])}

        args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, learning_rate=1e-3, report_to=[], use_cpu=True,
                                 remove_unused_columns=False, save_strategy="no", logging_steps=1,
                                 disable_tqdm=True, per_device_eval_batch_size=4)
        trainer = HFTrainer(model=model, args=args, train_dataset=samples_for(model),
                            eval_dataset=samples_for(model, 4), data_collator=Collator.for_model(model, 0),
                            compute_metrics=metrics)
        result = trainer.train()
        assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
        assert trainer.evaluate()["eval_vocab"] == model.backbone.config.vocab_size and seen
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
    (chunked, chunked_state), (full, full_state) = runs
    assert len(chunked) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(chunked, full, strict=True))
    worst = max(((chunked_state[k] - v).abs().max().item(), k) for k, v in full_state.items() if v.is_floating_point())
    assert worst[0] <= 1e-4, worst  # Adam divides near-zero gradients (A_log's) by their own size


# ---- non-finite guard ------------------------------------------------------------------------------
def plant_nan(model, name, when):
    """A forward hook on module `name` that returns NaN output when `when()` is true."""
    def hook(module, args, output):
        return output * float("nan") if when() else output
    return model.get_submodule(name).register_forward_hook(hook)


def test_a_nan_step_is_skipped_counted_and_training_goes_on(tmp_path, caplog):
    model = tiny(QWEN)
    calls = {"n": 0}

    def second_step():
        calls["n"] += 1
        return calls["n"] == 2  # the only micro-batch of step 2

    plant_nan(model, "backbone.model.layers.1.mlp.down_proj", second_step)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, summary = run(QWEN, tmp_path, "train.steps=4", model=model)
    assert summary["skipped"] == 1 and summary["history"][1].get("skipped")
    assert "step 2: non-finite loss; step skipped" in caplog.text
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the other steps trained


def test_consecutive_nan_steps_stop_the_run_naming_the_module(tmp_path):
    from mmadapt.train import NonFiniteError

    model = tiny(QWEN)
    plant_nan(model, "backbone.model.layers.2.mlp.down_proj", lambda: True)
    with pytest.raises(NonFiniteError, match=r"backbone\.model\.layers\.2\.mlp\.down_proj") as info:
        run(QWEN, tmp_path, "train.steps=10", "train.max_consecutive_skips=3", model=model)
    assert info.value.report.module == "backbone.model.layers.2.mlp.down_proj"
    assert info.value.report.phase == "forward" and info.value.report.inputs_finite
    assert "3 consecutive non-finite steps" in (tmp_path / "nonfinite.txt").read_text()


def test_a_micro_batch_of_only_bad_samples_does_not_stop_training(tmp_path):
    from mmadapt.data import DataProblem

    model = tiny(QWEN)
    good = samples_for(model, 8)
    bad = [DataProblem("missing_image", "no such file", sample_id=f"bad{k}") for k in range(8)]
    trainer = Trainer(model, config(tmp_path, "train.steps=4", "data.batch_size=4", "train.grad_accum=2",
                                    "data.max_bad_fraction=0.6"), good + bad, Collator.for_model(model, 0))
    collate = Collator.for_model(model, 0)
    result = accumulate(trainer, trainer.objective, [collate(bad[:4]), collate(good[:4])])  # an all-bad micro-batch,
    assert math.isfinite(result.loss)  # then a good one
    assert result.tokens == int(collate(good[:4])["labels"][:, 1:].ne(-100).sum())
    model.zero_grad()
    summary = trainer.fit()
    assert summary["skipped"] == 0 and all(math.isfinite(r["loss"]) for r in summary["history"])
    assert sum(r["problems"] for r in summary["history"]) == summary["bad_samples"] > 0
    assert summary["samples_seen"] == 4 * 8


def test_a_run_whose_samples_are_mostly_bad_stops_with_one_line_naming_the_first(tmp_path, capsys):
    """Images that do not resolve (relative paths, data.image_root unset, another working directory): every sample
    is dropped, so the run stops at step 1 instead of training on nothing; the CLI says it in one line."""
    import numpy as np
    from PIL import Image

    from mmadapt.cli import main

    (tmp_path / "data").mkdir()
    records = []
    for k in range(8):
        Image.fromarray(np.full((32, 32, 3), 30 * k, dtype=np.uint8)).save(tmp_path / "data" / f"{k}.png")
        records.append({"id": f"s{k}", "image": f"{k}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "grey"}]})
    train = write_jsonl(tmp_path / "data" / "train.jsonl", records)
    write_run(tmp_path / "run.yaml", model=TINY_LLAVA, data={"train": train, "batch_size": 4},
              train={"steps": 3, "out": tmp_path / "out", "progress": False})
    assert main(["train", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stopping at step 1: 4 of the 4 samples seen were bad (4 missing_image)" in err
    assert "sample 's" in err and "data.image_root" in err and "mmadapt data check" in err
    assert not (tmp_path / "out" / "model").exists()
    write_run(tmp_path / "run.yaml", model=TINY_LLAVA,
              data={"train": train, "batch_size": 4, "image_root": tmp_path / "data"},
              train={"steps": 3, "out": tmp_path / "out", "progress": False})
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    assert "bad" not in capsys.readouterr().out


def test_a_fresh_run_refuses_an_out_directory_holding_another_run(tmp_path):
    run(QWEN, tmp_path, "train.steps=2")
    with pytest.raises(ValueError, match=r"already holds checkpoints of an earlier run \(step-0000002\).*--resume"):
        run(QWEN, tmp_path, "train.steps=3")


# ---- optimizer settings of real recipes ----------------------------------------------------------------------------
@pytest.mark.slow
def test_learning_rates_by_part_and_no_weight_decay_on_biases_and_norms(tmp_path):
    from transformers.trainer_pt_utils import get_parameter_names

    model = tiny(QWEN)
    cfg = config(tmp_path, "train.weight_decay=0.1", "train.lr_by_part={projector: 2.0e-5, encoder: 2.0e-6}")
    trainer = Trainer(model, cfg, samples_for(model), Collator.for_model(model, 0))
    where = {id(p): g for g in trainer.optimizer.param_groups for p in g["params"]}
    # transformers' Trainer's own rule for what decays (Trainer.get_decay_parameter_names)
    decays = set(get_parameter_names(model, [torch.nn.LayerNorm], [r"bias", r"layernorm", r"rmsnorm",
                                                                   r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]))
    rates = {"encoder": 2e-6, "projector": 2e-5, "backbone": 1e-3}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert len(where) == len(trainable) and any(n not in decays for n, _ in trainable)
    for name, p in trainable:
        group = where[id(p)]
        assert group["lr"] == rates[name.split(".")[0]], name
        assert group["weight_decay"] == (0.1 if name in decays else 0.0), name
    assert all(n.endswith("bias") or "norm" in n for n, _ in trainable if n not in decays)
    summary = trainer.fit()
    first = summary["history"][0]
    assert first["lr_by_part"]["projector"] / first["lr"] == pytest.approx(2e-5 / 1e-3)


def test_epochs_and_warmup_ratio(tmp_path):
    model = tiny(QWEN)
    cfg = config(tmp_path, "train.epochs=1.5", "data.batch_size=4", "train.warmup_ratio=0.34",
                 "train.schedule=linear")
    trainer = Trainer(model, cfg, samples_for(model), Collator.for_model(model, 0))  # 16 samples: 4 steps an epoch
    assert (trainer.total_steps, trainer.warmup_steps) == (6, 3)  # ceil(1.5 x 4), ceil(0.34 x 6)
    history = trainer.fit()["history"]
    assert len(history) == 6
    assert [r["lr"] for r in history] == pytest.approx([0.0, 1e-3 / 3, 2e-3 / 3, 1e-3, 2e-3 / 3, 1e-3 / 3])
    with pytest.raises(ValueError, match="not both"):
        config(tmp_path, "train.warmup_ratio=0.1", "train.warmup_steps=3")
    with pytest.raises(ValueError, match=r"unknown parts \['vision'\]"):
        config(tmp_path, "train.lr_by_part={vision: 1.0e-5}")



def test_a_zero_learning_rate_trains_nothing_and_logs_zero(tmp_path):
    """train.lr=0 (a dry run of the loop: the weights must not move) logs its rates as 0 (it divided by zero)."""
    model = tiny(QWEN)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = config(tmp_path, "train.lr=0", "train.steps=2", "train.warmup_steps=1")
    history = Trainer(model, cfg, samples_for(model), Collator.for_model(model, 0)).fit()["history"]
    assert [r["lr"] for r in history] == [0.0, 0.0]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())

@pytest.mark.slow
def test_resume_is_bitwise_with_rates_by_part_weight_decay_epochs_and_warmup_ratio(tmp_path, monkeypatch):
    settings = ("train.epochs=1.5", "data.batch_size=4", "train.warmup_ratio=0.2", "train.weight_decay=0.05",
                "train.lr_by_part={projector: 3.0e-3, encoder: 1.0e-4}", "checkpoint.every=3")
    _, full = run(QWEN, tmp_path / "full", *settings)
    original = Trainer.save

    def save_then_stop(self, **kwargs):
        original(self, **kwargs)
        if self.step == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run(QWEN, tmp_path / "cut", *settings)
    monkeypatch.setattr(Trainer, "save", original)
    _, resumed = run(QWEN, tmp_path / "cut", *settings, "checkpoint.resume=true", model=tiny(QWEN, seed=123))
    assert len(losses(full)) == 6 and losses(resumed) == losses(full)  # bitwise
