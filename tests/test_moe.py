"""Qwen3.5-MoE (`qwen3_5_moe`): transformers' `Qwen3_5MoeForCausalLM` as the backbone.

Parity with `Qwen3_5MoeForConditionalGeneration` (fp32, <= 1e-5: two images of different sizes, right padding,
an int64 mask), its parts loading alone, export and reload, packing (packed == padded per sample, isolation),
the router's auxiliary loss (what it counts, with padding and packing), and LoRA on the experts (never the
router).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import mmadapt
from mmadapt import VisionLanguageModel
from mmadapt.backbones import BACKBONES
from mmadapt.data import Collator
from mmadapt.encoders import ENCODERS
from mmadapt.processor import export_processor
from mmadapt.synthetic import synthetic_batch, synthetic_samples

ATOL = 1e-5
NAMES = ("qwen3_5_vit", "qwen_merger", "qwen3_5_moe")


@pytest.fixture(scope="module")
def hf_moe_dir(tmp_path_factory):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(0)
    text = {k: v for k, v in BACKBONES.get("qwen3_5_moe").options("tiny").items()
            if k not in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}
    vision = ENCODERS.get("qwen3_5_vit").options("tiny")
    config = Qwen3_5MoeConfig(text_config=text, vision_config={**vision, "out_hidden_size": text["hidden_size"]},
                              image_token_id=250, video_token_id=251, vision_start_token_id=248,
                              vision_end_token_id=249)
    model = Qwen3_5MoeForConditionalGeneration(config)
    with torch.no_grad():  # a router that prefers different experts for different tokens (its init is zeros)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("hf_qwen3_5_moe")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair(hf_moe_dir):
    from transformers import Qwen3_5MoeForConditionalGeneration

    return VisionLanguageModel.from_pretrained(hf_moe_dir).eval(), \
        Qwen3_5MoeForConditionalGeneration.from_pretrained(hf_moe_dir).eval()


def hf_inputs(batch, model):
    inputs = {k: v for k, v in batch.items() if k != "images_per_sample"}
    inputs["attention_mask"] = batch["attention_mask"].long()
    inputs["mm_token_type_ids"] = (batch["input_ids"] == model.tokens.image_token_id).int()
    return inputs


def test_registration_is_qwen3_5s_spec_with_another_class_in_a_few_lines():
    from mmadapt.backbones import qwen3_5_moe

    source = inspect.getsource(qwen3_5_moe)
    registration = source[source.index("BACKBONES.register("):]
    assert registration.count("\n") <= 15
    spec = BACKBONES.get("qwen3_5_moe")
    assert spec.positions == "mrope" and spec.hybrid.isolate is not None and spec.hybrid.layer_masks
    assert {"tiny", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b"} <= set(spec.presets)


def test_logits_loss_and_positions_equal_transformers(pair):
    ours, theirs = pair
    assert (ours.config.encoder.name, ours.config.projector.name, ours.config.backbone.name) == NAMES
    batch = synthetic_batch(ours, (1, 2), image_sides=[32, (48, 64), (64, 32)], text_lengths=[9, 5])
    assert batch["attention_mask"].sum(1).tolist()[0] != batch["attention_mask"].shape[1]  # really padded
    inputs = hf_inputs(batch, ours)
    with torch.no_grad():
        got, expected = ours(**batch), theirs(**inputs)
    mask = batch["attention_mask"]
    assert (got.logits - expected.logits)[mask].abs().max() <= ATOL
    assert abs(got.loss.item() - expected.loss.item()) <= ATOL
    routed = {int(i) for layer in theirs.model.language_model.layers for i in layer.mlp.gate(
        torch.randn(64, 64)).__getitem__(2).flatten()}
    assert len(routed) > 1  # the router really picks different experts


def test_its_parts_load_alone_and_the_transformers_export_reloads(pair, hf_moe_dir, tmp_path):
    ours, _ = pair
    backbone = mmadapt.build_model(NAMES[0], NAMES[1], {"name": "qwen3_5_moe", "pretrained": str(hf_moe_dir)})
    for k, v in ours.backbone.state_dict().items():
        assert torch.equal(v, backbone.backbone.state_dict()[k]), k
    ours.save_pretrained(tmp_path / "hf", format="transformers", processor_export=export_processor)
    import json

    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    again = VisionLanguageModel.from_pretrained(tmp_path / "hf").eval()
    batch = synthetic_batch(ours, (1, 1), seed=3)
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, ours(**batch).logits)


def test_packed_equals_padded_and_samples_are_isolated():
    torch.manual_seed(0)
    model = mmadapt.build_model(*NAMES).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    samples = synthetic_samples(model, (1, 0, 2, 1), text_lengths=[9, 14, 5, 20], seed=1)
    packed_batch = Collator.for_model(model, 0, max_tokens=max(map(len, samples)) + 16)(samples)
    assert packed_batch["input_ids"].shape[0] < len(samples)
    from mmadapt.numerics.compare import packed_vs_padded

    diffs = packed_vs_padded(model, samples, max_tokens=max(map(len, samples)) + 16)
    assert max(diffs.values()) <= ATOL, diffs
    assert {type(m).__name__ for m in model.modules() if "GatedDeltaNet" in type(m).__name__} == {
        "PerSampleQwen3_5MoeGatedDeltaNet"}


def test_lora_wraps_attention_the_shared_expert_and_the_experts_never_the_router():
    from mmadapt.train import apply_stages
    from mmadapt.train.config import LoraSection, StagesSection
    from mmadapt.train.stages import lora_modules

    torch.manual_seed(0)
    model = mmadapt.build_model(*NAMES)
    apply_stages(model, StagesSection(preset="lora"), LoraSection(r=4, alpha=8))
    wrapped = set(lora_modules(model.backbone))
    suffixes = {name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1] if "experts" in name or "shared" in name
                else name.rsplit(".", 1)[-1] for name in wrapped}
    assert {"q_proj", "in_proj_qkv", "out_proj", "shared_expert.gate_proj", "shared_expert.down_proj"} <= suffixes
    assert any(name.endswith("mlp.experts") for name in wrapped)  # the 3-D expert tensors, by peft's ParamWrapper
    assert not any(name.endswith("mlp.gate") or "shared_expert_gate" in name for name in wrapped)
    trainable = [n for n, p in model.backbone.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any(".mlp.gate." in n and "lora_" not in n for n in trainable)  # the router stays frozen
    batch = synthetic_batch(model, (1, 1), seed=4)
    model(**batch).loss.backward()
    experts = [p for n, p in model.backbone.named_parameters() if "experts" in n and "lora_" in n]
    assert experts and any(p.grad is not None and p.grad.abs().sum() > 0 for p in experts)
    full = mmadapt.build_model(*NAMES)  # a fully trained backbone keeps its routers (stages.router: full trains them)
    apply_stages(full, StagesSection(encoder="frozen", projector="full", backbone="full"))
    routers = {n: p.requires_grad for n, p in full.backbone.named_parameters() if n.endswith("mlp.gate.weight")}
    assert len(routers) == 4 and not any(routers.values())
    assert all(p.requires_grad for n, p in full.backbone.named_parameters() if "shared_expert_gate" in n)


def test_the_router_loss_counts_real_tokens_only_equals_transformers_and_is_unchanged_by_packing(pair):
    check_router_loss(*pair)


def check_router_loss(ours, theirs):
    """output_router_logits: transformers' load-balancing loss over the real tokens. Padded: equal to
    transformers' (int64 mask) on both loss paths; packed: equal to the padded value (the loss averages routing
    statistics over all real tokens of the batch, so how they sit in rows does not matter); padding excluded.
    Shared with the Qwen3-VL-MoE tests."""
    batch = synthetic_batch(ours, (1, 2), image_sides=[32, (48, 64), (64, 32)], text_lengths=[9, 5])
    with torch.no_grad():
        expected = theirs(**hf_inputs(batch, ours), output_router_logits=True)
        full = ours(**batch, output_router_logits=True)
        ours.train()
        chunked = ours(**batch, output_router_logits=True)
        ours.eval()
        no_mask = theirs(**{**hf_inputs(batch, ours), "attention_mask": None}, output_router_logits=True)
    assert abs(full.aux_loss.item() - expected.aux_loss.item()) <= ATOL
    assert abs(full.loss.item() - expected.loss.item()) <= ATOL and chunked.logits is None
    assert abs(chunked.loss.item() - expected.loss.item()) <= ATOL
    assert abs(no_mask.aux_loss.item() - expected.aux_loss.item()) > 1e-4  # counting padding changes it
    samples = synthetic_samples(ours, (1, 0, 2, 1), text_lengths=[9, 14, 5, 20], seed=1)
    padded = Collator.for_model(ours, 0)(samples)
    packed = Collator.for_model(ours, 0, max_tokens=max(map(len, samples)) + 16)(samples)
    assert packed["input_ids"].shape[0] < len(samples)
    with torch.no_grad():
        a, b = (ours(**x, output_router_logits=True) for x in (padded, packed))
    assert abs(a.aux_loss.item() - b.aux_loss.item()) <= 1e-6 and abs(a.loss.item() - b.loss.item()) <= ATOL


def test_fsdp2_shards_each_decoder_layer_of_the_moe_backbone():
    from mmadapt.train.distributed import blocks_to_shard

    model = mmadapt.build_model(*NAMES)
    blocks = blocks_to_shard(model)
    layers = list(model.backbone.model.layers)
    assert all(any(layer is b for b in blocks) for layer in layers) and len(layers) == 4
    assert any(type(b).__name__ == "Qwen3_5MoeDecoderLayer" for b in blocks)
