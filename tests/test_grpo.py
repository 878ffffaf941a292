"""`train.objective: grpo` end to end on a tiny Qwen3.5: prompts with images and answers, G answers per prompt, the
rewards and advantages, the clipped loss, and what a step logs; the settings refuse what they cannot do."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

from mmadapt.heads import TokenLogps
from mmadapt.train import RunConfig, Trainer
from mmadapt.train.objectives.grpo.view import AnswerScorer
from mmadapt.train.rewards import reward_specs
from mmadapt.train.run import build_run
from mmadapt.train.steps import evaluate

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}


def length(completions, **columns):
    """A reward that differs between a random model's answers (accuracy is 0 for all of them): their length."""
    return [len(c) / 10 for c in completions]


def prompts_file(root, n: int = 8):
    records = []
    for k in range(n):
        name = list(COLOURS)[k % 2]
        Image.new("RGB", (32, 32), COLOURS[name]).save(root / f"{k}.png")
        records.append({"id": f"p{k}", "problem": "<image>Which colour?", "answer": name, "images": [f"{k}.png"]})
    path = root / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    return path


def config(tmp_path, *overrides):
    path = prompts_file(tmp_path)
    return RunConfig.load(None, [f"train.out={tmp_path / 'out'}", "train.progress=false", "train.objective=grpo",
                                 "grpo.rewards=[accuracy, {name: format, weight: 0.1}, 'test_grpo:length']",
                                 f"data.train={path}",
                                 f"data.eval={path}", f"data.image_root={tmp_path}", "data.batch_size=2",
                                 "data.max_length=128", "grpo.num_generations=3", "grpo.max_completion_length=6",
                                 "train.steps=2", "train.log_every=1", *overrides])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_a_grpo_run_samples_scores_and_steps_logging_what_trl_logs(tmp_path, loss_type):
    cfg = config(tmp_path, f"grpo.loss_type={loss_type}", "train.grad_accum=2")
    parts = build_run(cfg)
    trainer = Trainer(parts.model, cfg, parts.train_data, parts.collate, eval_data=parts.eval_data)
    before = {n: p.detach().clone() for n, p in parts.model.named_parameters() if p.requires_grad}
    history = trainer.fit()["history"]
    assert len(history) == 2
    for record in history:
        assert math.isfinite(record["loss"]) or record["zero_std_groups"] == 1.0
        for key in ("reward", "rewards/accuracy/mean", "rewards/format/mean", "reward_std", "zero_std_groups",
                    "completion_length/mean", "completion_length/max", "clip_ratio/region_mean", "rollout_s",
                    "entropy", "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"):
            assert key in record, (key, sorted(record))
        assert 0 < record["entropy"] <= math.log(256)  # nats, at most uniform over the char vocabulary
        assert record["sampling/sampling_logp_difference/max"] <= 1e-4  # the rollout saw what the forward sees
        assert 1 <= record["completion_length/mean"] <= 6 and record["completion_length/max"] <= 6
        assert record["zero_std_groups"] < 1 and math.isfinite(record["loss"])
    moved = [n for n, p in parts.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved, "no parameter moved in two steps"
    rewards = evaluate(trainer, trainer.objective)
    assert set(rewards) == {"eval_reward", "eval_reward_blanked", "eval_reward_shuffled"}
    assert all(math.isfinite(v) for v in rewards.values())


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo"])  # grpo's on-policy loss is 0 (the advantages' mean)
def test_the_logged_loss_is_the_steps_however_it_is_accumulated(tmp_path, loss_type):
    """A step's logged loss is the loss of its whole batch: 2 prompts in one micro-batch, or 1 in each of 2 (dapo's
    micro-batch losses are already shares of the step's token mean; the others' are means, averaged). Answers of
    1, 2 and 12 tokens (`helpers.answer_table`) make the on-policy loss non-zero (-sum A_i |o_i| over the step's
    tokens for dapo, over rows x max_completion_length for dr_grpo). Measured equal within 1e-7; bound 1e-6."""
    from helpers import answer_table

    losses = []
    for k, shape in enumerate((("data.batch_size=2",), ("data.batch_size=1", "train.grad_accum=2"))):
        cfg = config(tmp_path, f"train.out={tmp_path / f'out-{k}'}", f"grpo.loss_type={loss_type}", "train.steps=1",
                     "grpo.max_completion_length=12", "grpo.num_generations=4", *shape)
        parts = build_run(cfg)
        ends = AnswerScorer.for_encoder(parts.encoder, reward_specs(["accuracy"]), 12).eos_token_ids
        answer_table(parts.model, int(parts.train_data[0].sample.input_ids[-1]), ends[-1],
                     *parts.tokenizer.convert_tokens_to_ids(["A", "B"]))
        losses.append(Trainer(parts.model, cfg, parts.train_data, parts.collate).fit()["history"][0]["loss"])
    assert abs(losses[0]) > 1e-3 and abs(losses[0] - losses[1]) <= 1e-6, losses


@pytest.mark.parametrize("overrides, words", [
    (["grpo.num_generations=1"], "num_generations must be >= 2"),
    (["grpo.num_iterations=2", "checkpoint.every=3"], "a multiple of 2"),
    (["grpo.num_iterations=0"], "num_iterations must be >= 1"),
    (["grpo.temperature=0"], "grpo.temperature must be > 0"),  # Sampling's own checks, named as the section names them
    (["grpo.top_p=1.5"], "grpo.top_p must be in (0, 1], got 1.5"),
    (["grpo.max_completion_length=0"], "grpo.max_completion_length must be >= 1, got 0"),
    (["grpo.beta=0.04"], "needs a reference"),
    (["grpo.beta=0.04", "stages.backbone=lora"], "but ['projector'] train fully"),
    (["grpo.rewards=[]"], "needs grpo.rewards"),
    (["grpo.rewards=[nonsense]"], "accuracy"),
])
def test_what_grpo_cannot_do_is_refused_naming_the_setting(tmp_path, overrides, words):
    with pytest.raises((ValueError, KeyError)) as refused:
        cfg = config(tmp_path, *overrides)
        parts = build_run(cfg)
        Trainer(parts.model, cfg, parts.train_data, parts.collate)
    assert words in str(refused.value)


def test_num_iterations_reuses_a_rollout_for_that_many_steps_clipped_against_its_log_probs(tmp_path):
    """grpo.num_iterations 2 (trl's mu) over 4 steps: 2 rollouts, each from the next loader batch (the batches a
    1-iteration run trains on first); the second step of each scores the same answers with the moved policy against
    the log-probs the policy had at the rollout (<= 1e-6 of a forward then: the first step's, kept); the rollout's
    rewards are logged at its first step. A resume from the checkpoint between rollouts equals the whole run."""
    import shutil

    from mmadapt.train.batches import GlobalBatchSampler
    from mmadapt.train.checkpoint import latest_checkpoint
    from mmadapt.train.objectives.rollout import completion_logps

    overrides = ["grpo.num_iterations=2", "train.steps=4", "train.lr=0.05", "checkpoint.every=2",
                 "stages.backbone=full"]
    cfg = config(tmp_path, *overrides)
    parts = build_run(cfg)
    trainer = Trainer(parts.model, cfg, parts.train_data, parts.collate)
    rolled, seen, steps = [], [], []
    rows, terms = trainer.objective.training_rows, trainer.objective.terms

    def recording(run, micro):
        seen.append([ids for b in micro for ids in b["meta"]["sample_ids"]])
        out = rows(run, micro)
        for batch in out:  # the policy's log-probs at the rollout, from a forward of their own
            with torch.no_grad():
                logps = run.model(**{k: v for k, v in batch.items() if k not in ("meta", "rollout", "logged",
                                                                                  "encoded")},
                                  head=TokenLogps(run.objective.settings.temperature)).logps
            rolled.append(completion_logps(logps, batch["labels"], batch["rollout"]["rollouts"]))
        return out

    def scoring(run, batch, steps_, total, iteration=0):
        result = terms(run, batch, steps_, total, iteration)
        steps.append((run.step, iteration, batch["rollout"].get("old")))
        return result

    trainer.objective.training_rows, trainer.objective.terms = recording, scoring
    summary = trainer.fit()
    history = summary["history"]
    assert summary["samples_seen"] == 4  # 2 rollouts of 2 prompts, each counted once
    order = GlobalBatchSampler(8, micro_batch=2, seed=cfg.train.seed)
    assert seen == [[[f"p{i}"] for i in order.indices(step)[0]] for step in (0, 1)]
    assert [(step, it) for step, it, _ in steps] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    for (_, _, old), at_rollout in zip(steps[1::2], rolled, strict=True):
        assert torch.allclose(old, at_rollout, atol=1e-6, rtol=0)
    assert ["reward" in r for r in history] == [True, False, True, False]
    assert all(math.isfinite(r["loss"]) for r in history)
    assert abs(history[0]["loss"]) < 1e-6 and history[0]["clip_ratio/region_mean"] == 0  # on policy: ratio 1
    assert history[1]["clip_ratio/region_mean"] > 0  # the moved policy, clipped against the rollout's log-probs
    shutil.rmtree(latest_checkpoint(tmp_path / "out"))  # back to step 2, between the rollouts
    again = config(tmp_path, *overrides, "checkpoint.resume=true")
    parts = build_run(again)
    resumed = Trainer(parts.model, again, parts.train_data, parts.collate).fit()["history"]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # steps 1-2 from the checkpoint's history
    for a, b in zip(history[2:], resumed[2:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]


def test_sees_on_prompts_prints_the_reward_view_with_the_runs_rewards(tmp_path, capsys):
    """`mmadapt sees MODEL prompts.jsonl`: greedy answers scored with real, blanked and shuffled images (the rewards
    and answer length of the GRPO run the model comes from, or --rewards; a reward the run names as code only when
    the command line names it); `mmadapt eval --json` writes it."""
    from mmadapt.cli import main

    config(tmp_path, "train.steps=1", "grpo.rewards=['test_grpo:length']").save(tmp_path / "run.yaml")
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    prompts = str(tmp_path / "prompts.jsonl")
    view = ["sees", str(tmp_path / "out" / "model"), prompts, "--batches", "1", "--batch-size", "4"]
    assert main(view) == 2  # the run's config names code: never imported on a directory's say-so
    refused = capsys.readouterr().err
    assert refused.count("\n") == 1 and "name code: ['test_grpo:length']" in refused
    assert "--rewards test_grpo:length" in refused
    code = main([*view, "--rewards", "test_grpo:length"])  # the user names it: imported
    captured = capsys.readouterr()
    shown = captured.out
    assert code != 2, captured.err
    assert "reward view: 4 prompts" in shown and "blanked" in shown and "shuffled" in shown, shown
    assert code in (0, 1) and ("rests on the images" in shown) == (code == 0)
    real = float(next(line.split()[1] for line in shown.splitlines() if line.startswith("real")))
    assert 0 < real <= 0.6  # length / 10 of answers of at most 6 tokens (grpo.max_completion_length of the run)
    assert main(["eval", str(tmp_path / "out" / "model"), prompts, "--rewards", "accuracy,format",
                 "--json", str(tmp_path / "view.json")]) in (0, 1)
    view = json.loads((tmp_path / "view.json").read_text())["rewards"]
    assert view["prompts"] == 8 and set(view["reward"]) == {"real", "blanked", "shuffled"}
    assert all(0 <= v <= 1.1 for v in view["reward"].values()) and view["moved"] == 8


@pytest.mark.slow  # two launches, one of them torchrun with 2 processes
def test_ddp_and_fsdp2_with_two_processes_equal_one_process(tmp_path):
    """Each answer samples from its own seed, so 2 ranks draw what 1 process draws; groups stay on their rank; the
    rewards, the answers' lengths and the gradient norm (the loss itself is ~0 on policy: the advantages' mean; its
    gradient is not) agree within 1e-5, relative for the gradient norm, so step 2 starts from the same weights.
    The projector trains (the default stages), and in a last pair the whole vision side."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = prompts_file(tmp_path)
    (tmp_path / "base.yaml").write_text(
        f"data: {{train: {path}, image_root: {tmp_path}, max_length: 128}}\n"
        "train: {steps: 2, lr: 1.0e-3, progress: false, log_every: 1, objective: grpo}\n"
        "grpo: {num_generations: 2, max_completion_length: 5, rewards: [accuracy, 'test_grpo:length']}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}

    def launch(out, *overrides, procs=1):
        launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                        str(procs)] if procs > 1 else [])
        result = subprocess.run([*launcher, "-m", "mmadapt", "train", str(tmp_path / "base.yaml"),
                                 f"train.out={tmp_path / out}", *overrides], capture_output=True, text=True,
                                timeout=300, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        return [json.loads(line) for line in (tmp_path / out / "log.jsonl").read_text().splitlines()]

    one = launch("one", "data.batch_size=2")
    for strategy in ("ddp", "fsdp"):
        two = launch(strategy, "data.batch_size=1", f"distributed.strategy={strategy}", procs=2)
        same(one, two)
    # the whole vision side trained: under FSDP2 its units (blocks, encoder, projector) gather and reduce their own
    # parameters outside the root's forward, so the step's one encoding serves the rollout and the policy there too
    vision = ("stages.encoder=full",)
    same(launch("one-vision", "data.batch_size=2", *vision),
         launch("fsdp-vision", "data.batch_size=1", "distributed.strategy=fsdp", *vision, procs=2))


def same(one, two):
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "reward", "rewards/test_grpo:length/mean", "reward_std", "completion_length/mean",
                    "clip_ratio/region_mean"):
            assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a["grad_norm"], b["grad_norm"])


QUESTION = "<image>Which colour? Answer A or B."


@pytest.mark.slow  # 40 SFT steps, then 60 GRPO steps (about 12 s)
def test_grpo_learns_to_answer_from_the_image_and_the_reward_rests_on_it(tmp_path, capsys):
    """SFT first teaches the answer's form on labels drawn at random (A or B whatever the colour: a policy at chance);
    GRPO with the accuracy reward alone then teaches the colour (reddish: A, bluish: B; 48 training prompts, 16 held
    out). Held-out greedy reward: 0.5 before GRPO, 1.0 after; with blanked images 0.5 (one letter for the mean
    colour), with another prompt's image 0.0 (the held-out prompts alternate colours, shuffling swaps them).

    Measured over seeds 0, 1, 2 x OMP_NUM_THREADS 1, 2 (6 runs): start 0.5 in every run; end 1.0, blanked 0.5,
    shuffled 0.0 in every run. Bounds: end >= 0.9 and at least 0.3 above the start, blanked within 0.2 of chance."""
    import random

    rng = random.Random(100)
    sft, train, held = [], [], []
    for k in range(64):
        answer = "AB"[k % 2]
        strong, weak = rng.randint(150, 250), (rng.randint(0, 60), rng.randint(0, 60))
        Image.new("RGB", (32, 32), (strong, *weak) if answer == "A" else (*weak, strong)).save(tmp_path / f"{k}.png")
        sft.append({"id": f"s{k}", "image": f"{k}.png", "conversations": [
            {"from": "human", "value": QUESTION}, {"from": "gpt", "value": rng.choice("AB")}]})
        (train if k < 48 else held).append({"id": f"p{k}", "problem": QUESTION, "answer": answer,
                                            "images": [f"{k}.png"]})
    for name, records in (("sft", sft), ("train", train), ("held", held)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    common = [f"data.image_root={tmp_path}", "train.progress=false", "data.max_length=96", "train.log_every=1000",
              "train.schedule=constant"]
    first = RunConfig.load(None, [*common, f"train.out={tmp_path / 'sft'}", f"data.train={tmp_path / 'sft.jsonl'}",
                                  "train.steps=40", "data.batch_size=8", "train.lr=1e-3"])
    parts = build_run(first)
    Trainer(parts.model, first, parts.train_data, parts.collate).fit()
    then = RunConfig.load(None, [*common, f"train.out={tmp_path / 'grpo'}", f"data.train={tmp_path / 'train.jsonl'}",
                                 f"data.eval={tmp_path / 'held.jsonl'}", "train.objective=grpo",
                                 "grpo.rewards=[accuracy]", "train.steps=60", "data.batch_size=4", "train.lr=1e-3",
                                 "grpo.num_generations=4", "grpo.max_completion_length=1", "grpo.loss_type=grpo"])
    parts = build_run(then, model=parts.model)
    trainer = Trainer(parts.model, then, parts.train_data, parts.collate, eval_data=parts.eval_data,
                      tokenizer=parts.tokenizer)
    trainer.objective.prepare(trainer)
    start = evaluate(trainer, trainer.objective)
    trainer.fit()
    end = evaluate(trainer, trainer.objective)
    assert start["eval_reward"] <= 0.6, start
    assert end["eval_reward"] >= 0.9 and end["eval_reward"] - start["eval_reward"] >= 0.3, (start, end)
    assert abs(end["eval_reward_blanked"] - 0.5) <= 0.2 and end["eval_reward_shuffled"] <= 0.5, end
    # `mmadapt sees` on the run's model and the held-out prompts: the same view, its rewards from the run's config
    from mmadapt.cli import main

    code = main(["sees", str(tmp_path / "grpo" / "model"), str(tmp_path / "held.jsonl"), "--image-root",
                 str(tmp_path)])
    captured = capsys.readouterr()
    shown = captured.out
    assert code == 0 and "the reward rests on the images" in shown, (shown, captured.err)
    rows = {line.split()[0]: float(line.split()[1]) for line in shown.splitlines()
            if line.split() and line.split()[0] in ("real", "blanked", "shuffled")}
    assert rows == pytest.approx({"real": end["eval_reward"], "blanked": end["eval_reward_blanked"],
                                  "shuffled": end["eval_reward_shuffled"]}, abs=1e-3), (rows, end)


@pytest.mark.parametrize("stages", [("grpo.beta=0.04", "stages.backbone=lora", "stages.projector=frozen"),
                                    ("stages.encoder=full",)], ids=["LoRA + reference", "vision trained"])
@pytest.mark.parametrize("g", [2, 4])
def test_each_picture_is_encoded_once_per_step_for_the_rollout_the_reference_and_the_policy(tmp_path, g, stages):
    """A hook on the vision tower over a whole step (grad_accum 2; rollout, the reference with beta > 0 and the
    policy's forward and backward; or the whole vision side trained, its encoding's graph kept for the backward),
    prompts with no picture, one or two images, a video, an image and a video mixed: one encoding per picture (image
    or video)."""
    from mmadapt.synthetic import moving_square, write_video

    write_video(tmp_path / "left.mp4", moving_square(8, 32, 48, direction=(0, -1), start=(8, 40)), fps=8)
    records = []
    for k in range(8):
        pictures = [f"{k}.png", f"{k}b.png"][: k % 3]  # 0, 1 or 2 pictures
        for name in pictures:
            Image.new("RGB", (32, 32 + 32 * (k % 2)), COLOURS["red" if k % 2 else "blue"]).save(tmp_path / name)
        videos = ["left.mp4"] if k in (2, 3, 5) else []  # a video alone, with one image, with two
        records.append({"id": f"q{k}", "problem": "<image>" * len(pictures) + "<video>" * len(videos)
                        + "Which colour?", "answer": "red", "images": pictures, "videos": videos})
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    cfg = RunConfig.load(None, [f"train.out={tmp_path / 'out'}", "train.progress=false", "train.objective=grpo",
                                "grpo.rewards=['test_grpo:length']", f"data.train={path}",
                                f"data.image_root={tmp_path}", "data.batch_size=3", "train.grad_accum=2",
                                "data.max_length=256", "data.video.fps=4", "data.video.max_pixels=32768",
                                f"grpo.num_generations={g}", "grpo.max_completion_length=4", *stages,
                                "train.steps=1"])
    parts = build_run(cfg)
    trainer = Trainer(parts.model, cfg, parts.train_data, parts.collate)
    seen, shown = {"calls": 0, "pictures": 0}, []

    def count(module, args, output):
        seen["calls"] += 1
        seen["pictures"] += int(args[1].shape[0])

    rows = trainer.objective.training_rows

    def recording(run, micro):
        shown.extend(sum(int(b[k].sum()) for k in ("images_per_sample", "videos_per_sample") if b.get(k) is not None)
                     for b in micro if b["input_ids"].shape[0])
        return rows(run, micro)

    trainer.objective.training_rows = recording
    hook = parts.model.encoder.register_forward_hook(count)
    try:
        history = trainer.fit()["history"]
    finally:
        hook.remove()
    with_pictures = [n for n in shown if n]
    assert seen == {"calls": len(with_pictures), "pictures": sum(shown)}, (seen, shown)
    assert ("kl" in history[0]) == ("grpo.beta=0.04" in stages) and math.isfinite(history[0]["loss"])


@pytest.mark.parametrize("stages", [(), ("stages.encoder=full", "grpo.num_iterations=2")],
                         ids=["projector trained", "vision trained, 2 iterations"])
@pytest.mark.parametrize("every_batch", [True, False], ids=["ranks kept in step", "one process"])
def test_the_vision_side_runs_once_per_micro_batch_with_or_without_pictures(tmp_path, monkeypatch, stages,
                                                                           every_batch):
    """Where every rank must run the vision side for every batch (`runs_vision_for_every_batch`, forced here as under
    FSDP2), a micro-batch without pictures runs it once per step as one with pictures does (its run on no picture at
    the point where the other encodes: no second run in the rollout or the forward), and that run reaches the loss
    (a gradient arrives at the projector's output, as for the picture); each eval prompt runs it once per image
    control (real, blanked, shuffled), pictures or not. In one process (not forced) only pictures run it.
    Two prompts, one with an image and one text-only, one per micro-batch (grad_accum 2), 2 steps, then the eval."""
    Image.new("RGB", (32, 32), COLOURS["red"]).save(tmp_path / "0.png")
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"id": "m0", "problem": "<image>Which colour?", "answer": "red", "images": ["0.png"]},
        {"id": "m1", "problem": "Which colour is red?", "answer": "red", "images": []})))
    cfg = RunConfig.load(None, [f"train.out={tmp_path / 'out'}", "train.progress=false", "train.objective=grpo",
                                "grpo.rewards=['test_grpo:length']", f"data.train={path}", f"data.eval={path}",
                                f"data.image_root={tmp_path}", "data.batch_size=1", "train.grad_accum=2",
                                "data.max_length=128", "grpo.num_generations=2", "grpo.max_completion_length=4",
                                "train.steps=2", *stages])
    parts = build_run(cfg)
    trainer = Trainer(parts.model, cfg, parts.train_data, parts.collate, eval_data=parts.eval_data)
    if every_batch:
        monkeypatch.setattr(parts.model, "runs_vision_for_every_batch", lambda: True)
    phase = ["train"]
    runs, gradients = {"train": 0, "rollout": 0, "eval": 0}, {"train": 0, "rollout": 0, "eval": 0}

    def ran(module, args, output):
        runs[phase[0]] += 1

    def reached(module, args, output):
        if output.features.requires_grad:
            output.features.register_hook(lambda grad, at=phase[0]: gradients.__setitem__(at, gradients[at] + 1))

    eval_batch = trainer.objective.eval_batch

    def evaluating(*args):
        phase[0] = "eval"
        try:
            return eval_batch(*args)
        finally:
            phase[0] = "train"

    trainer.objective.eval_batch = evaluating
    generate = parts.model.generate

    def generating(*args, **kwargs):  # a training step's rollout: its pictures (or no picture) were encoded before
        was, phase[0] = phase[0], "rollout" if phase[0] == "train" else phase[0]
        try:
            return generate(*args, **kwargs)
        finally:
            phase[0] = was

    monkeypatch.setattr(parts.model, "generate", generating)
    hooks = [parts.model.encoder.register_forward_hook(ran), parts.model.projector.register_forward_hook(reached)]
    try:
        history = trainer.fit()["history"]
    finally:
        for hook in hooks:
            hook.remove()
    micro_batches = (2 if every_batch else 1) * len(history)  # one run per micro-batch per step (text-only: forced)
    assert runs == {"train": micro_batches, "rollout": 0, "eval": 3 * (2 if every_batch else 1)}, runs
    assert gradients == {"train": micro_batches, "rollout": 0, "eval": 0}, gradients
    assert all(math.isfinite(record["loss"]) for record in history), history


def test_the_rewards_of_a_config_before_0_24_are_read_as_grpo_rewards(caplog):
    """GRPO's settings and rewards are its own section (`grpo:`, parsed by `GrpoSettings`); a run file of before
    0.24 (`train.rewards`) is read once, at the boundary, with a warning; both at once is refused."""
    from mmadapt.train.objectives import objective_for

    with caplog.at_level("WARNING"):
        cfg = RunConfig.load(None, ["train.objective=grpo", "train.rewards=[accuracy]"])
    assert "train.rewards is now grpo.rewards" in caplog.text
    assert cfg.sections["grpo"] == {"rewards": ["accuracy"]} and "rewards" not in cfg.to_dict()["train"]
    objective = objective_for(cfg)
    assert objective.settings.rewards == ["accuracy"]
    saved = objective.config.to_dict()["grpo"]  # the run saves its section resolved: every default written out
    assert saved["rewards"] == ["accuracy"] and saved["num_generations"] == 8 and saved["loss_type"] == "dapo"
    assert RunConfig.from_dict(objective.config.to_dict()).sections["grpo"] == saved
    with pytest.raises(ValueError, match=r"both train\.rewards and grpo\.rewards"):
        RunConfig.load(None, ["train.rewards=[accuracy]", "grpo.rewards=[format]"])


def test_grpos_sampling_is_a_sampling_with_its_defaults():
    """`grpo.temperature`, `grpo.top_p` and `grpo.max_completion_length` (trl's names) are the rollout's `Sampling`,
    its defaults `Sampling`'s but for the temperature (trl's 1.0); the evals answer greedily at the same length."""
    from mmadapt.sampling import Sampling
    from mmadapt.train.objectives.grpo.settings import GrpoSettings

    defaults = GrpoSettings()
    assert defaults.sampling == Sampling(max_new_tokens=Sampling().max_new_tokens, temperature=1.0)
    assert defaults.greedy == Sampling()
    chosen = GrpoSettings(max_completion_length=64, temperature=0.7, top_p=0.9)
    assert chosen.sampling == Sampling(max_new_tokens=64, temperature=0.7, top_p=0.9)
    assert chosen.greedy == Sampling(max_new_tokens=64)
