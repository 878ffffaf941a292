"""Sequence parallelism (`distributed.sequence_parallel`): N ranks share each sample's sequence, equal to one process.

Model level (torchrun, gloo, fp32; tests/sequence_parallel_cases.py): SP = 2 gives one process's loss (<= 1e-6
relative) and gradients (summed over the group, <= 1e-5) for LLaVA (CLIP + Llama; an image span crossing the split
point; an odd length), Qwen3-VL (DeepStack levels, a video and an image) and Qwen3.5 (Gated DeltaNet; packed rows of
text and image samples), with the plain loss and the heads every objective uses. A shard whose visual tokens are
shifted by one position fails the contract, naming the sample and the rank.

Run level (`mmadapt train` under torchrun): SFT with SP = 2 on 2 processes and SP = 2 x DP = 2 on 4 processes, DPO
with SP = 2, each equal to one process step by step with an uneven eval on the way; refusals (GRPO, heads that do
not divide, a world that SP does not divide) are one line before anything is read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import run_bounded

CASES = Path(__file__).with_name("sequence_parallel_cases.py")
MODEL_CASES = ["llava", "llava_odd", "llava:token_losses", "llava:sequence", "llava:token_logps", "llava:sequence_kl",
               "qwen3_vl", "qwen3_vl:sequence", "qwen3_5", "qwen3_5:token_logps"]
SHARDED_VISION = ["llava:vision_sharded", "llava_one:vision_sharded", "llava_shared:vision_sharded",
                  "qwen3_vl:vision_sharded", "qwen3_5:vision_sharded"]  # distributed.sequence_parallel_vision: sharded
MODEL_CASES += SHARDED_VISION


@pytest.fixture(scope="module")
def model_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp_cases")
    code, stderr = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                "2", str(CASES), str(out), *MODEL_CASES, "shifted"], timeout=600)
    assert code == 0, stderr[-3000:]
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}


@pytest.mark.slow
@pytest.mark.parametrize("case", MODEL_CASES)
def test_two_ranks_sharing_each_sequence_equal_one_process(model_results, case):
    result = model_results[case]
    assert "error" not in result, result
    assert result["loss_rel"] <= 1e-6, result
    assert result["grad_max"] <= 1e-5, result
    assert result["extra_max"] <= 1e-5, result  # the reference's kept states and the token KL (sequence_kl)
    if result["kl"] is not None:
        assert result["kl"] > 1e-3, result  # a KL that is really there
    if case.startswith("llava"):
        assert result["crossing"], result  # an image span runs across the split point
    if case == "llava_odd":
        assert result["length"] % 2 == 1, result  # padded to a multiple of 2 inside the forward


@pytest.mark.slow
def test_sharded_vision_encodes_each_picture_once_across_the_group(model_results):
    """Each rank's encoder takes only its pieces: Qwen3-VL's first video cut between the ranks by temporal patches, a
    lone image on one rank while the other runs its vision side on no picture (one placeholder image)."""
    video = model_results["qwen3_vl:vision_sharded"]
    assert [1, True, 0, 2, 1] in video["pieces"] and [0, True, 0, 0, 2] in video["pieces"], video
    assert all(len(rows) == 1 for rows in video["encoded"]), video  # one call of the vision side per rank
    assert sum(rows[0] for rows in video["encoded"]) == 16 + 3 * 24 + 2 * 24, video  # the batch's rows, once
    one = model_results["llava_one:vision_sharded"]
    assert one["pieces"] == [[1, False, 0, 0, 1]] and one["encoded"] == [[1], [1]], one
    for case in ("llava:vision_sharded", "qwen3_5:vision_sharded"):
        ranks = {piece[0] for piece in model_results[case]["pieces"]}
        assert ranks == {0, 1}, model_results[case]


@pytest.mark.slow
def test_a_shard_whose_visual_tokens_are_shifted_fails_the_contract_naming_the_sample_and_the_rank(model_results):
    error = model_results["shifted"]["error"]
    assert error.startswith("ImageTokenContractError: sample ") and "rank 1 of 2" in error, error


def test_heads_that_do_not_divide_are_refused_naming_the_numbers_and_the_sizes_that_work():
    from mmadapt import VisionLanguageModel
    from mmadapt.sequence_parallel import check_model

    model = VisionLanguageModel.from_names("clip", "mlp2x_gelu", {"name": "llama", "preset": "tiny", "options": {
        "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8}})
    with pytest.raises(ValueError) as info:
        check_model(model, 4)
    message = str(info.value)
    assert "sequence_parallel: 4" in message and "6 heads" in message and "3 KV heads" in message, message
    assert "Sizes that work: [3, 6]" in message, message  # 2: 3 KV heads neither divide by 2 nor 2 by them
    check_model(model, 3)  # 6 query heads / 3, one KV head each
    qwen = VisionLanguageModel.from_names("qwen3_5_vit", "qwen_merger", {"name": "qwen3_5", "preset": "tiny",
                                                                          "options": {"linear_num_key_heads": 3,
                                                                                      "linear_num_value_heads": 6}})
    with pytest.raises(ValueError, match="Gated DeltaNet's key's 3 heads"):
        check_model(qwen, 2)


# ---- whole runs ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from PIL import Image
    from test_distributed import PHOTOS

    root = tmp_path_factory.mktemp("sp_runs")
    (root / "images").mkdir()
    for k, (name, load) in enumerate(PHOTOS.items()):
        Image.fromarray(load()).resize((32 + 16 * (k % 2), 32)).save(root / "images" / f"{name}.png")
    records = [{"id": f"s{i}", "image": f"{list(PHOTOS)[i % 4]}.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?" + " please" * (i % 3)},
        {"from": "gpt", "value": list(PHOTOS)[i % 4] + " indeed" * (i % 2)}]} for i in range(16)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (root / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in records[:5]))  # 3 batches of 2: uneven on 2
    pairs = [{"id": f"p{i}", "images": [f"{list(PHOTOS)[i % 4]}.png"],
              "prompt": "<image>\nWhat is this?" + " please" * (i % 3),
              "chosen": list(PHOTOS)[i % 4], "rejected": list(PHOTOS)[(i + 1) % 4] + " maybe" * (i % 2)}
             for i in range(16)]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in pairs))
    unpaired = [{"id": f"k{i}", "images": [f"{list(PHOTOS)[i % 4]}.png"],
                 "prompt": "<image>\nWhat is this?" + " please" * (i % 3),
                 "completion": list(PHOTOS)[i % 4], "label": i % 4 != 1} for i in range(16)]
    (root / "unpaired.jsonl").write_text("\n".join(json.dumps(r) for r in unpaired))
    (root / "base.yaml").write_text(yaml.safe_dump({
        "data": {"train": str(root / "train.jsonl"), "image_root": str(root / "images"), "max_length": 256},
        "train": {"steps": 3, "lr": 1.0e-3, "progress": False, "eval_every": 2},
        "stages": {"encoder": "full"}}))
    return root


def launch(root: Path, out: str, *overrides: str, procs: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if procs > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    cmd = [*launcher, "-m", "mmadapt", "train", str(root / "base.yaml"), f"train.out={root / out}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def records(root: Path, out: str, *overrides: str, procs: int = 1) -> list[dict]:
    result = launch(root, out, *overrides, procs=procs)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (root / out / "log.jsonl").read_text().splitlines()]


def assert_equal_runs(one: list[dict], other: list[dict], keys: tuple[str, ...]) -> None:
    assert len(one) == len(other) == 3
    for a, b in zip(one, other, strict=True):
        for key in keys:
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, one, other)


LLAVA = ["model.encoder=clip", "model.projector=mlp2x_gelu", "model.backbone=llama"]
RUNS = {  # name: (overrides, processes, the one-process reference's overrides); Qwen3.5 unless LLaVA's parts
    "sft sp2 fsdp": (["distributed.sequence_parallel=2", "distributed.strategy=fsdp", "data.batch_size=4"], 2,
                     ["data.batch_size=2", "train.grad_accum=2"]),
    "sft llava sp2 x dp2 fsdp": ([*LLAVA, "distributed.sequence_parallel=2", "distributed.strategy=fsdp",
                                  "data.batch_size=2"], 4, [*LLAVA, "data.batch_size=2", "train.grad_accum=2"]),
    "sft sp2 vision sharded": (["distributed.sequence_parallel=2", "distributed.sequence_parallel_vision=sharded",
                                "data.batch_size=4"], 2, ["data.batch_size=2", "train.grad_accum=2"]),
    "sft sp2 packed ddp": (["distributed.sequence_parallel=2", "distributed.strategy=ddp", "data.packing=true",
                            "data.max_tokens=160", "data.batch_size=4"], 2,
                           ["data.packing=true", "data.max_tokens=160", "data.batch_size=4"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_training_with_sequence_parallelism_equals_one_process_with_an_uneven_eval(dataset, name):
    overrides, procs, reference = RUNS[name]
    tag = name.replace(" ", "-")
    evals = (f"data.eval={dataset / 'eval.jsonl'}",)
    one = records(dataset, f"{tag}-one", *reference, *evals)
    split = records(dataset, tag, *overrides, *evals, procs=procs)
    assert_equal_runs(one, split, ("loss", "eval_loss", "grad_norm"))


PREFERENCE = {  # objective: (its data, the keys compared, its stages)
    "dpo": ("pairs.jsonl", ("loss", "grad_norm", "rewards/margins"), ()),
    # one process takes the same micro-batch of 4 (KTO's KL rows pair the rows of a micro-batch); its reference is
    # the model with the adapters off, so nothing trains fully
    "kto": ("unpaired.jsonl", ("loss", "grad_norm", "kl", "rewards/chosen"), ("stages.projector=frozen",)),
}


@pytest.mark.slow
@pytest.mark.parametrize("objective", list(PREFERENCE))
def test_preference_objectives_with_sequence_parallelism_equal_one_process(dataset, objective):
    data, keys, stages = PREFERENCE[objective]
    common = (*LLAVA, f"train.objective={objective}", f"data.train={dataset / data}", "train.eval_every=0",
              "stages.backbone=lora", "stages.encoder=frozen", *stages, "data.batch_size=4")
    one = records(dataset, f"{objective}-one", *common)
    split = records(dataset, f"{objective}-sp2", *common, "distributed.sequence_parallel=2", procs=2)
    assert_equal_runs(one, split, keys)


@pytest.mark.slow
def test_grpo_and_a_world_sp_does_not_divide_are_refused_in_one_line(dataset):
    result = launch(dataset, "grpo", "train.objective=grpo", "grpo.rewards=[accuracy]",
                    "distributed.sequence_parallel=2")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "train.objective grpo does not run under distributed.sequence_parallel: 2" in last, last
    assert not (dataset / "grpo").exists()  # refused before the run wrote anything
    result = launch(dataset, "world", "distributed.sequence_parallel=2")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "distributed.sequence_parallel: 2 does not divide the 1 processes" in last, last


@pytest.mark.slow
def test_a_run_whose_heads_sp_does_not_divide_stops_when_its_config_loads(dataset):
    result = launch(dataset, "heads", "distributed.sequence_parallel=3")  # tiny Qwen3.5: 4 heads, 2 KV heads
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "sequence_parallel: 3 does not divide the backbone's attention's 4 heads and 2 KV heads" in last, last
    assert "Sizes that work: [2, 4]" in last and not (dataset / "heads").exists(), last


@pytest.mark.slow
def test_the_plan_divides_the_decoders_activations_and_suggests_the_smallest_size_that_fits():
    from test_plan import LONG_LLAMA, run_config

    from mmadapt.train.plan import predict

    def plan(size: int, gpus: int = 4, memory: int | None = None):
        config = run_config({"model": LONG_LLAMA, "data": {"max_length": 4096, "batch_size": 1}})
        config = config.from_dict({**config.to_dict(), "distributed": {"sequence_parallel": size}})
        return predict(config, gpus=gpus, device="cpu", gpu_memory=memory)

    one, two, four = plan(1), plan(2), plan(4)
    assert "exchange" not in one.per_gpu and two.per_gpu["exchange"] == 2 * four.per_gpu["exchange"] > 0
    decoder = [p.activations_without_checkpointing for p in (one, two, four)]
    assert decoder[0] > decoder[1] > decoder[2], decoder  # the decoder's tokens per rank: L, L / 2, L / 4
    assert any("each decoding 1,024 of every row's 4,096 tokens" in note for note in four.notes), four.notes
    # a budget between SP 2's total and SP 1's: SP 2 is the smallest that fits
    memory = (one.per_gpu["total"] + two.per_gpu["total"]) // 2
    suggested = dict(plan(1, memory=memory).suggestions)
    assert suggested["distributed.sequence_parallel: 2"] == two.per_gpu["total"], suggested
    assert "distributed.sequence_parallel: 4" not in suggested, suggested
    with pytest.raises(ValueError, match="sequence_parallel: 3 does not divide --gpus 4"):
        plan(3)
