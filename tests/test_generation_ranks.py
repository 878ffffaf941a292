"""Generation under torchrun (CPU, gloo) with uneven work: ranks whose answers end at different steps, and an eval
with more batches on one rank than the other. Under FSDP2 every decoding step gathers parameters with the other ranks,
so the ranks agree on when decoding ends (`mmadapt.generation.any_rank_decoding`) and on the number of eval rounds
(`mmadapt.train.batches.eval_rounds`); the runs finish and equal one process.

The model is a tiny Qwen3.5 made to answer by construction (`helpers.answer_table`): every block's output projection
is zero, so the hidden state at a position is its token's embedding and the model is a table of next tokens. After
the prompt it samples the end (0.2), "A" (0.3) or "B" (0.5); "A" is followed by the end, "B" by "B" for ever. Each
answer samples from its own seed (the run's seed, the step, the prompt's id, its place in its group), so the prompt
ids below were chosen for what their answers are at steps 1 and 2: both answers to SHORT end within 2 tokens, both
answers to LONG run to `max_completion_length` (24). Each rank holds one of the two prompts per step: one rank is
done after 1-2 steps while the other decodes 24.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import answer_table, run_bounded
from PIL import Image

pytestmark = pytest.mark.slow
SHORT, LONG = "q19", "q7"  # found by sampling each id's two answers at steps 1 and 2 (module docstring)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The constructed model's directory, its prompts (SHORT, LONG) and eval prompts (3: more batches on rank 0 than
    on rank 1 at one per batch), and the run's base config."""
    from mmadapt.train import RunConfig
    from mmadapt.train.objectives.grpo.view import AnswerScorer
    from mmadapt.train.rewards import reward_specs
    from mmadapt.train.run import build_run

    root = tmp_path_factory.mktemp("generation-ranks")
    Image.new("RGB", (32, 32), (200, 30, 30)).save(root / "0.png")

    def prompts(name, ids):
        path = root / name
        path.write_text("\n".join(json.dumps({"id": i, "problem": "<image>Go?", "answer": "A", "images": ["0.png"]})
                                  for i in ids))
        return path

    train, held = prompts("train.jsonl", [SHORT, LONG]), prompts("eval.jsonl", [SHORT, LONG, "q3"])
    bad = json.dumps({"id": "bad", "problem": "<image>Go?", "answer": "A", "images": ["missing.png"]})
    (root / "with-bad.jsonl").write_text(train.read_text().splitlines()[0] + "\n" + bad)  # SHORT, a counted problem
    cfg = RunConfig.load(None, [f"train.out={root / 'build'}", "train.objective=grpo", "grpo.rewards=[accuracy]",
                                f"data.train={train}", f"data.image_root={root}", "data.max_length=128",
                                f"grpo.max_completion_length={MAX_TOKENS}"])
    torch.manual_seed(0)
    parts = build_run(cfg)
    ends = AnswerScorer.for_encoder(parts.encoder, reward_specs(["accuracy"]), MAX_TOKENS).eos_token_ids
    start = int(parts.train_data[0].sample.input_ids[-1])  # the template's last prompt token
    answer_table(parts.model, start, ends[-1], *parts.tokenizer.convert_tokens_to_ids(["A", "B"]))
    parts.model.save_pretrained(root / "model", tokenizer=parts.tokenizer)
    (root / "base.yaml").write_text(
        f"model: {{pretrained: {root / 'model'}}}\n"
        f"data: {{train: {train}, eval: {held}, image_root: {root}, max_length: 128}}\n"
        "train: {steps: 2, lr: 1.0e-3, progress: false, log_every: 1, eval_every: 1, objective: grpo}\n"
        f"grpo: {{num_generations: 2, max_completion_length: {MAX_TOKENS}, rewards: [accuracy, 'test_grpo:length']}}\n")
    return root


def launch(root, out, *overrides, procs=1, timeout=300):
    """`mmadapt train` (under torchrun with `procs` > 1), ended whole at `timeout` seconds (`helpers.run_bounded`):
    a hang fails the test instead of holding CI."""
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                    str(procs)] if procs > 1 else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    code, stderr = run_bounded([*launcher, "-m", "mmadapt", "train", str(root / "base.yaml"),
                                f"train.out={root / out}", *overrides], timeout, env)
    assert code is not None, f"{out}: no end after {timeout} s (ranks out of step?)\n{stderr[-2000:]}"
    assert code == 0, stderr[-3000:]
    return [json.loads(line) for line in (root / out / "log.jsonl").read_text().splitlines()]


def test_a_rank_whose_micro_batch_holds_only_bad_records_answers_a_stand_in_and_equals_one_process(root):
    """Under FSDP2 the other rank's encoding, rollout and forward gather parameters with this one's, so a rank whose
    micro-batch is all counted problems answers a stand-in (the first good prompt) whose rows count for nothing.
    Prompts SHORT and one with a missing image, one per rank: both strategies finish (FSDP2 waited for ever before)
    and equal one process (1e-5; the gradient norm relative), the problem counted once per step."""
    one = launch(root, "bad-one", "data.batch_size=2", f"data.train={root / 'with-bad.jsonl'}")
    assert all(record["problems"] == 1 and record["completion_length/max"] <= 2 for record in one), one
    for strategy in ("fsdp", "ddp"):
        two = launch(root, f"bad-{strategy}", "data.batch_size=1", f"distributed.strategy={strategy}",
                     f"data.train={root / 'with-bad.jsonl'}", procs=2)
        assert len(one) == len(two) == 2
        for a, b in zip(one, two, strict=True):
            for key in ("loss", "reward", "tokens", "problems", "completion_length/mean", "eval_reward"):
                assert abs(a[key] - b[key]) <= 1e-5, (strategy, key, a[key], b[key])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * max(a["grad_norm"], 1e-8), (strategy, a, b)


def test_grpo_with_answers_ending_at_different_steps_on_each_rank_equals_one_process(root):
    """2 processes (FSDP2, DDP), one prompt each: SHORT's answers end within 2 tokens, LONG's run to 24, so at every
    step one rank is done after 1-2 decoding steps while the other decodes 24; and each eval (every step) answers 3
    prompts one per batch, 2 batches on rank 0, 1 on rank 1. Both finish, and their losses, rewards, answer lengths
    and evals equal one process's within 1e-5 (the gradient norm relative), as the torchrun GRPO test in
    tests/test_grpo.py compares them."""
    one = launch(root, "one", "data.batch_size=2")
    for record in one:  # the work is uneven as meant: one group ends at once, the other is cut at 24 tokens
        assert record["completion_length/max"] == MAX_TOKENS and record["completion_length/truncated"] == 0.5, record
        assert record["completion_length/mean"] <= (2 * 2 + 2 * MAX_TOKENS) / 4, record
        assert math.isfinite(record["eval_reward"]), record
    for strategy in ("fsdp", "ddp"):
        two = launch(root, strategy, "data.batch_size=1", f"distributed.strategy={strategy}", procs=2)
        assert len(one) == len(two) == 2
        for a, b in zip(one, two, strict=True):
            for key in ("loss", "reward", "rewards/test_grpo:length/mean", "reward_std", "completion_length/mean",
                        "completion_length/max", "eval_reward", "eval_reward_blanked"):
                assert abs(a[key] - b[key]) <= 1e-5, (strategy, key, a[key], b[key])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (strategy, a, b)


GENERATE_SCRIPT = '''
import json, sys
import torch
import mmadapt
from mmadapt.generation import ranks_step_together
from mmadapt.train import distributed as dist_utils

ctx = dist_utils.init()
torch.manual_seed(0)
model = mmadapt.build_model("clip", "mlp2x_gelu", "llama").eval()  # the same weights on both ranks
prompt = torch.tensor([[5 + ctx.rank, 6, 7, 8]])
max_new = 2 if ctx.rank == 0 else 12  # rank 0 is done after 2 tokens, rank 1 decodes 12
scores = []


def answer(on_step=None):
    return model.generate(prompt, max_new_tokens=max_new, temperature=1.0, row_seeds=torch.tensor([ctx.rank]),
                          logprobs=0, on_step=on_step)


alone = answer()
dist_utils.wrap(model, ctx, "fsdp", "fp32")
with torch.no_grad():  # FSDP2 sets itself up in the root's first forward (as a run does); each block then gathers
    model(input_ids=prompt)  # its parameters in every forward and frees them after
model.unshard()  # the root's own parameters (embeddings, head): generate is not the root's forward
sharded = answer(lambda step: scores.append(step.logprobs))
with open(sys.argv[1].format(rank=ctx.rank), "w") as f:
    json.dump({"agrees": ranks_step_together(model), "alone": alone.tolist(), "sharded": sharded.tolist(),
               "steps": len(scores)}, f)
'''


def test_generate_on_fsdp2_ranks_whose_answers_end_at_different_steps_answers_as_one_process(tmp_path):
    """`generate` itself, as any caller runs it on a model sharded by FSDP2: rank 0 answers 2 tokens, rank 1 answers
    12; both finish, each rank's answer is token for token the unsharded model's, and its `on_step` saw its own steps
    only (the extra steps that keep rank 0 in step with rank 1 add nothing)."""
    script = tmp_path / "generate.py"
    script.write_text(GENERATE_SCRIPT)
    code, stderr = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                str(script), str(tmp_path / "rank-{rank}.json")], 180,
                               {**os.environ, "OMP_NUM_THREADS": "1"})
    assert code is not None, f"generate under FSDP2: no end after 180 s (ranks out of step?)\n{stderr[-2000:]}"
    assert code == 0, stderr[-3000:]
    for rank, tokens in ((0, 2), (1, 12)):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result["agrees"] and result["sharded"] == result["alone"], result
        assert len(result["sharded"][0]) == result["steps"] == tokens, result


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A tiny random model's run config (`test_grpo`'s) over two prompts, one with an image and one text-only, for
    training and eval: at batch size 1 on 2 ranks each step and each eval round gives one rank a picture and the
    other none."""
    root = tmp_path_factory.mktemp("mixed-pictures")
    Image.new("RGB", (32, 32), (200, 30, 30)).save(root / "0.png")
    prompts = root / "mixed.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in (
        {"id": "m0", "problem": "<image>Which colour?", "answer": "red", "images": ["0.png"]},
        {"id": "m1", "problem": "Which colour is red?", "answer": "red", "images": []})))
    (root / "base.yaml").write_text(
        f"data: {{train: {prompts}, eval: {prompts}, image_root: {root}, max_length: 128}}\n"
        "train: {steps: 2, lr: 1.0e-3, progress: false, log_every: 1, eval_every: 1, objective: grpo}\n"
        "grpo: {num_generations: 2, max_completion_length: 5, rewards: [accuracy, 'test_grpo:length']}\n")
    return root


@pytest.mark.parametrize("strategy, stages", [("fsdp", ()), ("fsdp", ("stages.encoder=full",)),
                                              ("ddp", ("stages.encoder=full",))],
                         ids=["fsdp", "fsdp vision trained", "ddp vision trained"])
def test_grpo_with_pictures_on_one_rank_only_equals_one_process(mixed, strategy, stages):
    """2 processes, one prompt each: one rank's prompt has an image, the other's none, at every step and in every eval
    round (real, blanked, shuffled). Under FSDP2 the vision units gather in every forward, so the text-only rank runs
    the vision side on no picture where the other encodes its image (before the rollout, in each eval prefill), and
    not again in its forward; DDP with the vision side trained reduces its gradients in the backward. Each run
    finishes (the old code fell out of step under FSDP2: a hang or a broken connection, ended by `run_bounded`) and
    its losses, rewards, answer lengths and evals equal one process's within 1e-5 (the gradient norm relative)."""
    tag = "-".join((strategy, *stages))
    one = launch(mixed, f"one-{tag}", "data.batch_size=2", *stages)
    two = launch(mixed, f"two-{tag}", "data.batch_size=1", f"distributed.strategy={strategy}", *stages, procs=2)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "reward", "rewards/test_grpo:length/mean", "reward_std", "completion_length/mean",
                    "eval_reward", "eval_reward_blanked", "eval_reward_shuffled"):
            assert abs(a[key] - b[key]) <= 1e-5, (strategy, stages, key, a[key], b[key])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (strategy, stages, a, b)
