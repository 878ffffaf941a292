"""`mmadapt plan` for QLoRA (`stages.backbone: qlora`): the backbone's NF4 weights counted as torchao stores them
(codes, block scales, the scales' scales), everything else as for LoRA; the probe runs with the NF4 layers, so the
dequantised weight each of them makes in the forward and the backward is measured; and `stages.backbone: qlora` is
suggested when it makes a run fit.

QLoRA needs a backbone read from a checkpoint, so a tiny model is saved and planned from its directory; its NF4
layers are tiny, so `quantization.scaler_block_size: 2` (NF4 blocks of 64 x 2 weights) lets them quantise.
"""

from __future__ import annotations

import pytest
import torch
from test_plan import QWEN, built, measured_peak, unique_bytes

from mmadapt.data.tokenizer import char_tokenizer
from mmadapt.quantize import is_nf4
from mmadapt.train.config import RunConfig
from mmadapt.train.plan import gib, predict
from mmadapt.train.plan.report import cuda_margin

SMALL_BLOCKS = {"scaler_block_size": 2}
LLAVA = {"encoder": "clip", "projector": "mlp2x_gelu", "backbone": "llama"}


@pytest.fixture(autouse=True)
def probe_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path_factory.getbasetemp() / "mmadapt-cache"))


@pytest.fixture(scope="module", params=["qwen3_5", "llava"])
def saved(request, tmp_path_factory) -> str:
    """A tiny model saved as a checkpoint (QLoRA quantises a backbone read from one)."""
    from mmadapt.model import VisionLanguageModel
    from mmadapt.train.config import ModelSection

    parts = QWEN if request.param == "qwen3_5" else LLAVA
    torch.manual_seed(0)
    model = VisionLanguageModel(ModelSection(**parts).model_config())
    path = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(path, tokenizer=char_tokenizer())
    return str(path)


def config_of(path: str, backbone: str, **sections) -> RunConfig:
    return RunConfig.from_dict({"model": {"pretrained": path}, "data": {"max_length": 128, "batch_size": 2},
                                "stages": {"encoder": "frozen", "projector": "full", "backbone": backbone},
                                "quantization": SMALL_BLOCKS, **sections})


def nf4_bytes(model) -> tuple[int, int]:
    """(weights stored in NF4, the bytes their storages hold), measured on the quantised model."""
    four_bit = [p for p in model.parameters() if is_nf4(p)]
    return sum(p.numel() for p in four_bit), unique_bytes(four_bit)


def test_a_qlora_plan_counts_the_nf4_bytes_the_quantised_model_holds(saved):
    config = config_of(saved, "qlora")
    plan = predict(config, gpus=1, device="cpu")
    model = built(config)
    trained = [p for p in model.parameters() if p.requires_grad]
    weights, stored = nf4_bytes(model)
    assert weights > 0 and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad and
                               n.startswith("backbone"))
    # exact: the plan quantises its meta weights with torchao too (sizes only); tolerance 0 bytes
    assert plan.quantized.parameters == weights and plan.quantized.bytes == stored
    assert plan.parameters_by_dtype["nf4"] == stored
    assert plan.per_gpu["parameters"] == unique_bytes(model.parameters())
    assert plan.per_gpu["gradients"] == unique_bytes(trained)  # the adapters (and the projector), fp32
    # 0.5 byte + an int8 scale per 64 + an fp32 scale per 128, per weight; per tensor its mean and 16-entry table
    tensors = sum(is_nf4(p) for p in model.parameters())
    per_weight = config.quantization.bytes_per_weight(4)
    assert stored == pytest.approx(weights * per_weight + tensors * 17 * 4, abs=1)
    lora = predict(config_of(saved, "lora"), gpus=1, device="cpu")
    assert lora.per_gpu["gradients"] == plan.per_gpu["gradients"]
    assert lora.per_gpu["parameters"] - plan.per_gpu["parameters"] == 4 * weights - stored
    # a QLoRA checkpoint leaves the 4-bit weights out (its source holds them): the save's host memory too
    assert lora.saving.model - plan.saving.model == 4 * weights
    assert "4-bit (NF4, QLoRA)" in plan.table() and plan.to_json()["quantized"]["parameters"] == weights


@pytest.mark.slow
def test_a_qlora_plan_is_the_measured_tensor_peak_of_a_qlora_step(saved):
    config = config_of(saved, "qlora")
    plan = predict(config, gpus=1, device="cpu")
    measured = measured_peak(config, plan)
    assert plan.per_gpu["total"] == pytest.approx(measured, rel=0.15), (plan.table(), measured)


def test_fsdp2_shards_nf4_weights_as_other_parameters(saved):
    one = predict(config_of(saved, "qlora"), gpus=1, device="cpu")
    two = predict(config_of(saved, "qlora", distributed={"strategy": "fsdp"}), gpus=2, device="cpu")
    assert two.per_gpu["parameters"] == one.per_gpu["parameters"] // 2
    assert two.parameters_by_dtype == one.parameters_by_dtype  # the whole model's, by how it is stored


def test_fsdp2_gathers_a_unit_s_nf4_weights_as_stored_and_the_rest_in_the_compute_dtype():
    from mmadapt.precision import BF16_AUTOCAST
    from mmadapt.train.plan.predict import _sharding_bytes
    from mmadapt.train.plan.segments import Segment, SegmentKey

    block = Segment(key=SegmentKey("backbone", "block", 0), param_bytes=1000 + 400, four_bit_bytes=400,
                    trained_bytes=64)
    root = Segment(key=SegmentKey("backbone"), param_bytes=800)
    # two blocks gathered at a time (bf16: half the fp32 bytes; NF4 as is), the root, a unit's gradients
    assert _sharding_bytes("fsdp2", [root, block], 0, BF16_AUTOCAST) == 2 * (500 + 400) + 400 + 64


def test_qlora_is_suggested_and_said_to_fit_when_it_is_what_fits(saved):
    config = config_of(saved, "lora")
    lora, qlora = (predict(config_of(saved, mode), gpus=1).per_gpu["total"] for mode in ("lora", "qlora"))
    assert qlora < lora
    need = qlora + cuda_margin(qlora)  # on CUDA a change fits with its own margin (1 GiB + 5% of its total)
    plan = predict(config, gpus=1, gpu_memory=need)
    assert plan.fits is False and ("stages.backbone: qlora", qlora) in plan.suggestions
    assert f"would fit: stages.backbone: qlora ({gib(need)})" in plan.table()
    assert not predict(config, gpus=1, gpu_memory=need - 1).table().count("would fit: stages.backbone: qlora")
    # random init: nothing to quantise from, so not suggested
    fresh = RunConfig.from_dict({"model": QWEN, "data": {"max_length": 128, "batch_size": 2},
                                 "stages": {"backbone": "lora"}})
    assert not any("qlora" in c for c, _ in predict(fresh, gpus=1, device="cpu", gpu_memory=1).suggestions)
