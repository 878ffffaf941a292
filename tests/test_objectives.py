"""Objectives as registered parts: a toy objective registered in a few lines trains with `Trainer`, an objective's
state goes into the checkpoints and comes back on resume, and the registry of `train.objective` is exact and loud.

The toy objective is each sample's mean token loss averaged over the global batch's samples (SFT averages over
tokens): its step-1 loss equals that mean computed by hand on the first global batch with the starting weights
(fp32, 1e-5), differs from SFT's token mean there, and falls by more than 20% over 6 steps on those 4 samples.
"""

import copy
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from mmadapt import build_model
from mmadapt.data import Collator
from mmadapt.registry import UnknownComponentError
from mmadapt.synthetic import synthetic_samples
from mmadapt.train import GlobalBatchSampler, RunConfig, Trainer, latest_checkpoint
from mmadapt.train.batches import to_device
from mmadapt.train.objectives import OBJECTIVES, PreferenceObjective, SupervisedObjective, objective_for

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")


class PerSampleMean(SupervisedObjective):
    """Each sample's mean token loss, averaged over the global batch's samples."""

    def loss(self, run, batch, total_tokens):
        inputs = to_device(batch, run.device)
        labels = inputs.pop("labels")[:, 1:]
        logits = run.wrapped(**inputs).logits[:, :-1].float()
        per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        per_sample = per_token.sum(1) / (labels != -100).sum(1).clamp(min=1)
        return per_sample.sum() / (run.cfg.data.batch_size * run.cfg.train.grad_accum * run.dist.world)


class CountingRows(SupervisedObjective):
    """SFT that counts the rows it was given before each step: state kept across steps, as an online objective's."""

    rows = 0

    def training_rows(self, run, micro):
        self.rows += sum(int(b["input_ids"].shape[0]) for b in micro)
        return micro

    def state_dict(self):
        return {"rows": self.rows}

    def load_state_dict(self, state):
        self.rows = state["rows"]


@pytest.fixture
def registered():
    OBJECTIVES.register("per_sample_mean", PerSampleMean)
    OBJECTIVES.register("counting_rows", CountingRows)
    yield
    OBJECTIVES.unregister("per_sample_mean")
    OBJECTIVES.unregister("counting_rows")


def tiny():
    torch.manual_seed(0)
    return build_model(*QWEN)


def samples_for(model, n=16):
    return synthetic_samples(model, [1, 0, 2, 1] * (n // 4), text_lengths=[4 + (7 * k) % 13 for k in range(n)])


def config(tmp_path, *overrides):
    return RunConfig.load(None, [f"train.out={tmp_path}", "train.progress=false", "train.lr=1e-3",
                                 "stages.encoder=full", "data.batch_size=2", "train.grad_accum=2", *overrides])


@pytest.mark.slow  # trains 6 steps
def test_a_toy_objective_registered_in_a_few_lines_trains_with_the_trainer(registered, tmp_path):
    model = tiny()
    samples, collate = samples_for(model, 4), Collator.for_model(model, 0)  # every step: the same 4 samples
    start = copy.deepcopy(model)
    trainer = Trainer(model, config(tmp_path, "train.objective=per_sample_mean", "train.steps=6"), samples, collate)
    assert isinstance(trainer.objective, PerSampleMean)
    sampler = GlobalBatchSampler(len(samples), micro_batch=2, grad_accum=2)
    first = [collate([samples[i] for i in index]) for index in sampler.indices(0)]
    rows, token_loss, tokens = [], 0.0, 0
    with torch.no_grad():
        for batch in first:
            labels = batch["labels"][:, 1:]
            logits = start.train()(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
            per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
            rows += (per_token.sum(1) / (labels != -100).sum(1)).tolist()
            token_loss, tokens = token_loss + float(per_token.sum()), tokens + int((labels != -100).sum())
    history = trainer.fit()["history"]
    assert history[0]["loss"] == pytest.approx(sum(rows) / len(rows), abs=1e-5)
    assert abs(history[0]["loss"] - token_loss / tokens) > 1e-3  # not SFT's token mean
    assert history[-1]["loss"] < 0.8 * history[0]["loss"]


@pytest.mark.slow  # trains 3 steps, then resumes
def test_an_objectives_state_is_saved_with_the_checkpoint_and_restored_on_resume(registered, tmp_path):
    model = tiny()
    samples, collate = samples_for(model), Collator.for_model(model, 0)
    overrides = ("train.objective=counting_rows", "train.steps=3", "checkpoint.every=2")
    trainer = Trainer(model, config(tmp_path, *overrides), samples, collate)
    trainer.fit()
    assert trainer.objective.rows == 3 * 4  # 4 rows a step (2 micro-batches of 2)
    saved = json.loads((tmp_path / "checkpoints" / "step-0000002" / "trainer_state.json").read_text())
    assert saved["objective"] == {"rows": 8}
    shutil.rmtree(latest_checkpoint(tmp_path))  # back to step 2
    resumed = Trainer(tiny(), config(tmp_path, *overrides, "checkpoint.resume=true"), samples, collate)
    assert resumed.step == 2 and resumed.objective.rows == 8
    resumed.fit()
    assert resumed.objective.rows == 12


def test_objectives_are_found_by_exact_name_and_say_which_exist():
    assert isinstance(objective_for(RunConfig.load(None, [])), SupervisedObjective)
    assert isinstance(objective_for(RunConfig.load(None, ["train.objective=dpo"])), PreferenceObjective)
    assert PreferenceObjective.rows_per_sample == 2 and PreferenceObjective.section == "dpo"
    known = ", ".join(OBJECTIVES.names())  # dpo, grpo, sft, and any a test or docs example registered in this process
    assert {"dpo", "grpo", "sft"} <= set(OBJECTIVES.names())
    with pytest.raises(UnknownComponentError, match=rf"unknown objective 'ppo'; known: {known}"):
        objective_for(RunConfig.load(None, ["train.objective=ppo"]))
    with pytest.raises(UnknownComponentError, match=f"known: {known}"):
        objective_for(RunConfig.load(None, ["train.objective=DPO"]))  # exact names only
    with pytest.raises(ValueError, match="'sft' is already registered"):
        OBJECTIVES.register("sft", PerSampleMean)
    assert OBJECTIVES.get("sft") is SupervisedObjective


def test_a_checkpoint_holding_another_objectives_state_is_refused():
    objective = objective_for(RunConfig.load(None, []))
    objective.load_state_dict({})  # SFT keeps nothing: an empty state is its own
    with pytest.raises(ValueError, match=r"keeps no state .*\['rows'\].*train.objective"):
        objective.load_state_dict({"rows": 8})


# ---- the trainer owns the step ---------------------------------------------------------------------------------------
def test_no_objective_writes_its_own_accumulation_or_keeps_ranks_in_step():
    """Keeping ranks paired is the trainer's (`mmadapt.train.steps`): no objective module runs a backward, a no_sync,
    an all-reduce or eval rounds of its own, and no registered objective overrides the trainer's loop."""
    import inspect
    import pathlib

    import mmadapt.train.objectives as package

    for path in sorted(pathlib.Path(package.__file__).parent.rglob("*.py")):
        source = path.read_text()
        for written in (".backward(", "no_sync(", "all_reduce_sum(", "eval_rounds(", "placeholder_batch("):
            assert written not in source, f"{path.name} calls {written}: the trainer's (mmadapt.train.steps)"
    ours = {name for name in OBJECTIVES.names() if OBJECTIVES.get(name).__module__.startswith("mmadapt.")}
    assert ours == set(BUILT_IN), "a registered objective is missing from BUILT_IN (and its test)"
    for name in BUILT_IN:
        cls = OBJECTIVES.get(name)
        assert not hasattr(cls, "backward") and not hasattr(cls, "evaluate"), name
        assert "micro_loss" in {n for klass in inspect.getmro(cls)[:-2] for n in vars(klass)}, name


BUILT_IN = ("sft", "dpo", "kto", "grpo", "distill", "gkd")  # every registered objective (gkd: distill's alias)


@pytest.mark.slow  # one step and one eval of each objective
@pytest.mark.parametrize("name", BUILT_IN)
def test_every_objective_steps_and_evaluates_through_the_trainers_one_accumulation(tmp_path, monkeypatch, name):
    from test_grpo import config as grpo_config
    from test_preference import colour_pairs

    import mmadapt.train.trainer as trainer_module
    from mmadapt.train.run import build_run

    calls = {"accumulate": 0, "evaluate": 0, "micro_loss": 0, "eval_batch": 0}

    def counted(function, key):
        def call(*args, **kwargs):
            calls[key] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(trainer_module, "accumulate", counted(trainer_module.accumulate, "accumulate"))
    monkeypatch.setattr(trainer_module, "evaluate", counted(trainer_module.evaluate, "evaluate"))
    common = ["train.steps=1", "train.eval_every=1", "train.grad_accum=2", "data.batch_size=2"]
    if name == "grpo":
        cfg = grpo_config(tmp_path, *common)
    elif name in ("distill", "gkd"):
        from test_distill import base_overrides, prompts_file, teacher_dir

        prompts = prompts_file(tmp_path, 8)
        cfg = RunConfig.load(None, [*base_overrides(tmp_path, prompts), f"train.out={tmp_path / 'out'}",
                                    f"train.objective={name}", f"distill.teacher={teacher_dir(tmp_path, prompts)}",
                                    f"data.eval={prompts}", "distill.max_completion_length=4", *common])
    else:
        path = colour_pairs(tmp_path, "train", 8, 0)
        records = sft_records(path) if name == "sft" else path  # kto reads pairs as unpaired rows
        lora = ["stages.backbone=lora", "stages.projector=frozen"] if name == "kto" else []  # its KL needs the
        cfg = RunConfig.load(None, [f"train.out={tmp_path / 'out'}", "train.progress=false",  # reference per batch
                                    f"train.objective={name}", f"data.train={records}", f"data.eval={records}",
                                    f"data.image_root={tmp_path}", *common, *lora])
    parts = build_run(cfg)
    trainer = Trainer(parts.model, cfg, parts.train_data, parts.collate, eval_data=parts.eval_data)
    monkeypatch.setattr(trainer.objective, "micro_loss", counted(trainer.objective.micro_loss, "micro_loss"))
    monkeypatch.setattr(trainer.objective, "eval_batch", counted(trainer.objective.eval_batch, "eval_batch"))
    summary = trainer.fit()
    eval_batches = -(-len(parts.eval_data) // 2)
    assert calls == {"accumulate": 1, "evaluate": 1, "micro_loss": 2, "eval_batch": eval_batches}, calls
    assert math.isfinite(summary["history"][0]["loss"])


def sft_records(pairs_path):
    """The chosen answers of a file of pairs, as LLaVA conversations (SFT records)."""
    out = pairs_path.with_name("sft.jsonl")
    rows = [json.loads(line) for line in pairs_path.read_text().splitlines()]
    out.write_text("\n".join(json.dumps({"id": str(k), "image": row["images"][0], "conversations": [
        {"from": "human", "value": row["prompt"][0]["content"]},
        {"from": "gpt", "value": row["chosen"][0]["content"]}]}) for k, row in enumerate(rows)))
    return out


# ---- eval / sees ask the registry which objective's view a file of records gets --------------------------------------
def test_eval_and_sees_take_the_view_of_the_objective_that_claims_the_records_and_refuse_flags_it_does_not_read(
        tmp_path, capsys):
    """Pairs get DPO's view, RL prompts GRPO's, conversations the answers' view (`objectives.view_for`); a flag the
    chosen view does not read (`--predictions` on prompts, `--reference` on conversations, `--rewards` on pairs) is
    one line naming it and the file, exit 2, before anything is computed."""
    from test_grpo import prompts_file
    from test_preference import colour_pairs

    from mmadapt.cli import main
    from mmadapt.data import char_tokenizer, prepare_tokenizer
    from mmadapt.train.objectives import GrpoObjective, PreferenceObjective, view_for

    pairs = colour_pairs(tmp_path, "pairs", 4, 0)
    prompts = prompts_file(tmp_path, 4)
    conversations = sft_records(pairs)
    read = {path: [json.loads(line) for line in path.read_text().splitlines()] for path in (pairs, prompts,
                                                                                             conversations)}
    assert view_for(read[pairs]) is PreferenceObjective and view_for(read[prompts]) is GrpoObjective
    assert view_for(read[conversations]) is None
    torch.manual_seed(0)
    model, tokenizer = build_model("clip", "mlp2x_gelu", "llama"), char_tokenizer()
    prepare_tokenizer(model, tokenizer)
    model.save_pretrained(tmp_path / "model", tokenizer=tokenizer)
    for command, path, flag in [("eval", prompts, ["--predictions", str(tmp_path / "p.jsonl")]),
                                ("eval", conversations, ["--reference", str(tmp_path / "model")]),
                                ("sees", pairs, ["--rewards", "accuracy"]),
                                ("sees", conversations, ["--max-new-tokens", "4"])]:
        capsys.readouterr()
        assert main([command, str(tmp_path / "model"), str(path), "--image-root", str(tmp_path), *flag]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag[0] in err and str(path) in err and "remove it" in err, err
    assert main(["sees", str(tmp_path / "model"), str(pairs), "--image-root", str(tmp_path), "--batches", "1",
                 "--batch-size", "2"]) in (0, 1)
    assert "preference view: 2 pairs" in capsys.readouterr().out
