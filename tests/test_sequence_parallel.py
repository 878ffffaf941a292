"""Sequence parallelism (`distributed.sequence_parallel`): N ranks share each sample's sequence, equal to one process.

Model level (torchrun, gloo, fp32; tests/sequence_parallel_cases.py): SP = 2 gives one process's loss (<= 1e-6
relative) and gradients (summed over the group, <= 1e-5) for LLaVA (CLIP + Llama; an image span crossing the split
point; an odd length), Qwen3-VL (DeepStack levels, a video and an image) and Qwen3.5 (Gated DeltaNet; packed rows of
text and image samples), with the plain loss and the heads every objective uses. A shard whose visual tokens are
shifted by one position fails the contract, naming the sample and the rank.

Whole runs: tests/test_sequence_parallel_runs.py. The plan of an SP run divides the decoder's activations and names
the smallest size that fits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
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
