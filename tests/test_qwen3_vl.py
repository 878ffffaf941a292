"""Qwen3-VL (`qwen3_vl_vit` + `qwen_merger` + `qwen3_vl` / `qwen3_vl_moe`): DeepStack, parity, checkpoints, training.

Parity with `Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration` (fp32, <= 1e-5: two images of
different sizes, right padding, an int64 mask) including M-RoPE positions; each part loading alone; the
transformers export reloading; the MoE experts as the hub stores them; DeepStack in the contract (levels checked,
their injection verified, `deepstack: drop`); the router's auxiliary loss; LoRA and FSDP2 units; and the
two-accelerator divergence (equal last layers, first layers 50-100% apart) on its own model: a backward-only
perturbation in a middle LLM layer is named by `compare`.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

import mmadapt
from mmadapt import ImageTokenContractError, VisionLanguageModel, deepstack
from mmadapt.backbones import BACKBONES
from mmadapt.encoders import ENCODERS
from mmadapt.processor import export_processor
from mmadapt.synthetic import synthetic_batch

ATOL = 1e-5
SPAN_IDS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=248, vision_end_token_id=249)


def spread_routers(model: torch.nn.Module) -> None:
    """Routers that prefer different experts for different tokens (transformers initialises them to zeros)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)


def hf_model(backbone: str):
    import transformers

    config_class, model_class = {"qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
                                 "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration")}[backbone]
    text = {k: v for k, v in BACKBONES.get(backbone).options("tiny").items() if not k.endswith("token_id")}
    vision = {k: v for k, v in ENCODERS.get("qwen3_vl_vit").options("tiny").items() if not k.endswith("_pixels")}
    config = getattr(transformers, config_class)(text_config=text, vision_config={**vision, "out_hidden_size": 64},
                                                 **SPAN_IDS)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    spread_routers(model)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def hf_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model(request.param).save_pretrained(path)
    return request.param, path


@pytest.fixture(scope="module")
def pair(hf_dir):
    import transformers

    backbone, path = hf_dir
    model_class = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}
    theirs = getattr(transformers, model_class[backbone]).from_pretrained(path)
    return VisionLanguageModel.from_pretrained(path).eval(), theirs.eval()


def two_images_padded(model):
    batch = synthetic_batch(model, (1, 2), image_sides=[32, (48, 64), (64, 32)], text_lengths=[9, 5])
    assert batch["attention_mask"].sum(1).tolist()[0] != batch["attention_mask"].shape[1]  # really padded
    return batch


def hf_inputs(batch, model):
    inputs = {k: v for k, v in batch.items() if k != "images_per_sample"}
    inputs["attention_mask"] = batch["attention_mask"].long()  # transformers' int64 mask
    inputs["mm_token_type_ids"] = (batch["input_ids"] == model.tokens.image_token_id).int()
    return inputs


def tiny(backbone: str = "qwen3_vl", **kwargs) -> VisionLanguageModel:
    torch.manual_seed(0)
    model = mmadapt.build_model("qwen3_vl_vit", "qwen_merger", backbone, **kwargs)
    spread_routers(model)
    return model


# ---- components and presets -----------------------------------------------------------------------------------
def test_the_new_names_are_listed_with_presets(capsys):
    from mmadapt.cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name, presets in {"qwen3_vl_vit": ("qwen3-vl-2b", "qwen3-vl-8b", "qwen3-vl-235b-a22b"),
                          "qwen3_vl": ("qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b", "qwen3-vl-32b"),
                          "qwen3_vl_moe": ("qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b"),
                          "qwen3_5_moe": ("qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b")}.items():
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert all(p in line for p in presets), line


@pytest.mark.parametrize("backbone,preset,vit", [
    ("qwen3_vl", "qwen3-vl-8b", "qwen3-vl-8b"), ("qwen3_vl", "qwen3-vl-2b", "qwen3-vl-2b"),
    ("qwen3_vl_moe", "qwen3-vl-30b-a3b", "qwen3-vl-30b-a3b")])
def test_the_published_presets_build_on_the_meta_device_with_their_shapes(backbone, preset, vit):
    """Real widths and depths, no memory: the configs validate (M-RoPE split) and the parts fit together."""
    from mmadapt.weights import empty_weights

    with empty_weights():
        model = mmadapt.build_model({"name": "qwen3_vl_vit", "preset": vit}, "qwen_merger",
                                    {"name": backbone, "preset": preset})
    config = model.backbone.config
    assert model.levels == 3 and model.projector.out_dim == config.hidden_size
    assert config.vocab_size == 151936 and config.rope_parameters["mrope_section"] == [24, 20, 20]
    assert model.tokens.image_token_id == 151655
    if backbone == "qwen3_vl_moe":
        assert tuple(model.backbone.model.layers[0].mlp.experts.gate_up_proj.shape) == (128, 2 * 768, 2048)


def test_a_wrong_mrope_split_is_refused_at_build():
    with pytest.raises(ValueError, match=r"mrope_section \[24, 20, 20\] .* head_dim 16 / 2 = 8"):
        BACKBONES.get("qwen3_vl").build("tiny", rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                     mrope_section=[24, 20, 20]))


# ---- parity and checkpoints -------------------------------------------------------------------------------------
def test_logits_loss_and_positions_equal_transformers(pair):
    ours, theirs = pair
    assert ours.levels == 3 and ours.encoder.deepstack_levels == (0, 1, 2)
    # the same kernels: attention through SDPA, experts through transformers' default (grouped_mm), not eager loops
    assert ours.backbone.config._experts_implementation == theirs.config.text_config._experts_implementation
    batch = two_images_padded(ours)
    inputs = hf_inputs(batch, ours)
    with torch.no_grad():
        got, expected = ours(**batch), theirs(**inputs)
        mask = batch["attention_mask"]
        assert (got.logits - expected.logits)[mask].abs().max() <= ATOL
        assert abs(got.loss.item() - expected.loss.item()) <= ATOL
        positions, _ = theirs.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                   image_grid_thw=batch["image_grid_thw"],
                                                   attention_mask=inputs["attention_mask"])
        from mmadapt.contract import locate

        spans = locate(batch["input_ids"], ours.tokens.image_token_id)
        visual = ours.encode_images(batch["pixel_values"], batch["image_grid_thw"])
        assert torch.equal(ours.positions(mask, spans, visual)[:, mask], positions[:, mask])
        # DeepStack matters: the same model with its levels zeroed answers otherwise
        zeroed = {**deepstack.backbone_inputs(spans, visual),
                  "deepstack_visual_embeds": [torch.zeros_like(level) for level in visual.levels]}
        without = ours.backbone(inputs_embeds=ours.embed(batch["input_ids"], spans, visual), attention_mask=mask,
                                position_ids=ours.positions(mask, spans, visual), **zeroed).logits
    assert (without - got.logits)[mask].abs().max() > 1e-3


def test_greedy_generation_equals_transformers_generate(pair):
    """Decoding with a cache: the prompt's DeepStack levels and M-RoPE positions, then text positions after the
    image's (transformers' rope deltas), token for token."""
    ours, theirs = pair
    batch = synthetic_batch(ours, (2,), image_sides=[(48, 64), 32], text_lengths=[7], seed=5)
    inputs = {k: v for k, v in hf_inputs(batch, ours).items() if k != "labels"}
    theirs.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = theirs.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = ours.generate(batch["input_ids"], batch["attention_mask"], batch["pixel_values"],
                            batch["image_grid_thw"], max_new_tokens=8)
    assert torch.equal(got, expected[:, batch["input_ids"].shape[1]:])


def test_each_part_loads_alone_and_the_transformers_export_reloads(pair, hf_dir, tmp_path):
    ours, theirs = pair
    backbone, path = hf_dir
    encoder = ENCODERS.get("qwen3_vl_vit").from_pretrained(str(path))
    projector = mmadapt.PROJECTORS.get("qwen_merger").from_pretrained(str(path), 64, 64, levels=3)
    lm, tokens = BACKBONES.get(backbone).from_pretrained(str(path))
    for part, alone in (("encoder", encoder), ("projector", projector), ("backbone", lm)):
        whole = getattr(ours, part).state_dict()
        assert alone.state_dict().keys() == whole.keys(), part
        assert all(torch.equal(v, whole[k]) for k, v in alone.state_dict().items()), part
    assert tokens == ours.tokens and encoder.deepstack_levels == (0, 1, 2)
    # the encoder's levels through the projector's level mergers are transformers' DeepStack features
    batch = two_images_padded(ours)
    with torch.no_grad():
        visual = ours.encode_images(batch["pixel_values"], batch["image_grid_thw"])
        reference = theirs.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
    assert torch.equal(visual.features, reference.pooler_output)
    assert all(torch.equal(a, b) for a, b in zip(visual.levels, reference.deepstack_features, strict=True))

    ours.save_pretrained(tmp_path / "hf", format="transformers", processor_export=export_processor)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == backbone
    again = VisionLanguageModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, ours(**batch).logits)
    ours.save_pretrained(tmp_path / "mmadapt")
    mine = VisionLanguageModel.from_pretrained(tmp_path / "mmadapt").eval()
    assert mine.levels == 3 and mine.config.deepstack == "use"


def test_moe_experts_as_the_hub_stores_them_load_transposed(tmp_path):
    """The hub's Qwen3-VL-MoE files hold experts as (E, hidden, 2 x intermediate) and (E, intermediate, hidden);
    transformers transposes them at load, and so does the backbone: both models give the same logits."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    hf_model("qwen3_vl_moe").save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    experts = [k for k in weights if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert experts
    for key in experts:
        weights[key] = weights[key].transpose(1, 2).contiguous()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert tuple(weights[experts[0]].shape) in ((4, 64, 32), (4, 16, 64))  # the hub's layout, not the module's
    ours = VisionLanguageModel.from_pretrained(tmp_path).eval()
    theirs = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path).eval()
    batch = two_images_padded(ours)
    with torch.no_grad():
        got, expected = ours(**batch), theirs(**hf_inputs(batch, ours))
    assert (got.logits - expected.logits)[batch["attention_mask"]].abs().max() <= ATOL


# ---- DeepStack in the contract ----------------------------------------------------------------------------------
def test_each_level_is_checked_like_the_main_tokens():
    model = tiny()
    batch = synthetic_batch(model, (1, 2))
    level = model.projector.deepstack[1]
    real = level.project
    level.project = lambda visual: (lambda out: type(out)(out.features[1:], out.grids, out.window))(real(visual))
    try:
        with pytest.raises(ImageTokenContractError, match=r"^sample 0: DeepStack level 1 has shape .*Fix:"):
            model(**batch)
        assert not mmadapt.check_batch(model, batch).ok
    finally:
        del level.project
    assert mmadapt.check_batch(model, batch).ok


@pytest.mark.parametrize("skipped", [(0, 1, 2), (2,)])
def test_a_backbone_that_skips_a_level_is_caught(skipped, monkeypatch):
    """A backbone that ignores deepstack_visual_embeds (or some of them) trains and answers, silently worse; the
    probe on the declared layers notices, in forward and in generate."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

    model = tiny().eval()
    batch = synthetic_batch(model, (1, 2))
    real = Qwen3VLTextModel._deepstack_process
    calls = iter(range(100))

    def skipping(self, hidden_states, visual_pos_masks, visual_embeds):
        return hidden_states if next(calls) % 3 in skipped else real(self, hidden_states, visual_pos_masks,
                                                                     visual_embeds)

    monkeypatch.setattr(Qwen3VLTextModel, "_deepstack_process", skipping)
    first = min(skipped)
    with pytest.raises(ImageTokenContractError, match=rf"^sample 0: DeepStack level {first} was not added .* after "
                                                      rf"decoder layer {first} \(levels not added: \[{first}"):
        model(**batch)
    calls = iter(range(100))
    prompt = {k: batch[k][:1] for k in ("input_ids", "attention_mask")}
    pixels = batch["pixel_values"][: int(batch["image_grid_thw"][0].prod())]
    with pytest.raises(ImageTokenContractError, match=rf"DeepStack level {first} was not added"):
        model.generate(**prompt, pixel_values=pixels, image_grid_thw=batch["image_grid_thw"][:1], max_new_tokens=2)
    monkeypatch.setattr(Qwen3VLTextModel, "_deepstack_process", real)
    model(**batch)  # a backbone that adds every level passes


def test_a_deepstack_encoder_with_a_plain_backbone_needs_deepstack_drop(caplog):
    with pytest.raises(ValueError, match=r"emits 3 DeepStack feature levels \(blocks \[0, 1, 2\]\), but backbone "
                                         r"'qwen3_5' cannot take them.*deepstack: drop"):
        mmadapt.build_model("qwen3_vl_vit", "qwen_merger", "qwen3_5")
    with caplog.at_level(logging.WARNING, logger="mmadapt.deepstack"):
        model = mmadapt.build_model("qwen3_vl_vit", "qwen_merger", "qwen3_5", deepstack="drop")
    assert sum("deepstack: drop" in r.message for r in caplog.records) == 1
    assert model.levels == 0 and not model.encoder.emit_levels and not len(model.projector.deepstack)
    batch = synthetic_batch(model, (1, 2))
    assert model.encode_images(batch["pixel_values"], batch["image_grid_thw"]).levels == ()
    assert torch.isfinite(model(**batch).loss)
    dropped = tiny(deepstack="drop")  # a DeepStack backbone may be asked to run without them too
    assert dropped.levels == 0 and torch.isfinite(dropped(**synthetic_batch(dropped, (1, 2))).loss)
    from mmadapt.train.config import RunConfig

    run = RunConfig.from_dict({"model": {"encoder": "qwen3_vl_vit", "backbone": "qwen3_5", "deepstack": "drop"}})
    assert run.model.model_config().deepstack == "drop"
    with pytest.raises(ValueError, match=r"model.deepstack applies to a model built from parts"):
        RunConfig.from_dict({"model": {"pretrained": "some/dir", "deepstack": "drop"}})


def test_a_deepstack_backbone_with_a_plain_encoder_runs_without_levels(caplog):
    with caplog.at_level(logging.INFO, logger="mmadapt.deepstack"):
        model = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_vl")
    assert sum("emits none: it runs without them" in r.message for r in caplog.records) == 1
    assert model.levels == 0
    assert torch.isfinite(model(**synthetic_batch(model, (1, 2))).loss)


def test_more_levels_than_layers_is_a_build_error():
    with pytest.raises(ValueError, match=r"3 DeepStack levels, added after decoder layers 0..2, but backbone "
                                         r"'qwen3_vl' has 2 layers"):
        mmadapt.build_model("qwen3_vl_vit", "qwen_merger", {"name": "qwen3_vl", "options": {"num_hidden_layers": 2}})


def test_integrated_gradients_stay_complete_with_deepstack_levels():
    """The evidence map scales the levels with the main tokens: the scores still sum to log p(answer) - log p(answer |
    empty visual tokens), which the main tokens alone would not."""
    from mmadapt.evidence import Integrated, evidence

    model = tiny().eval()
    batch = synthetic_batch(model, (1,), image_sides=[(32, 48)], text_lengths=[6])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")}
    (result,) = evidence(model, inputs, torch.tensor([5, 7]), method=Integrated(steps=128), batch_size=64)
    delta = result.objective - result.baseline_objective
    assert abs(delta) > 1e-3 and result.scores.sum() == pytest.approx(delta, rel=0.02, abs=1e-5)


# ---- packing and training ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("hf_dir", ["qwen3_vl_moe"], indirect=True)
def test_the_router_loss_counts_real_tokens_only_equals_transformers_and_is_unchanged_by_packing(pair):
    from test_moe import check_router_loss

    check_router_loss(*pair)


def test_lora_wraps_attention_and_the_experts_and_the_router_stays_frozen():
    from mmadapt.train import apply_stages
    from mmadapt.train.config import LoraSection, StagesSection
    from mmadapt.train.stages import lora_modules

    model = tiny("qwen3_vl_moe")
    apply_stages(model, StagesSection(preset="lora"), LoraSection(r=4, alpha=8))
    wrapped = set(lora_modules(model.backbone))
    assert {name.rsplit(".", 1)[-1] for name in wrapped} >= {"q_proj", "k_proj", "v_proj", "o_proj", "experts"}
    assert not any(name.endswith("mlp.gate") for name in wrapped)
    trainable = [n for n, p in model.backbone.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    model(**synthetic_batch(model, (1, 1), seed=4)).loss.backward()
    experts = [p for n, p in model.backbone.named_parameters() if "experts" in n and "lora_" in n]
    assert experts and any(p.grad is not None and p.grad.abs().sum() > 0 for p in experts)

    for preset in ("llava-stage1", "llava-stage2"):
        model = tiny("qwen3_vl_moe")
        apply_stages(model, StagesSection(preset=preset))
        routers = [p for n, p in model.backbone.named_parameters() if n.endswith("mlp.gate.weight")]
        assert len(routers) == 4 and not any(p.requires_grad for p in routers), preset
        assert any(p.requires_grad for p in model.backbone.parameters()) == (preset == "llava-stage2")
    model = tiny("qwen3_vl_moe")
    apply_stages(model, StagesSection(preset="llava-stage2", router="full"))
    assert all(p.requires_grad for n, p in model.backbone.named_parameters() if n.endswith("mlp.gate.weight"))


@pytest.mark.parametrize("backbone", ["qwen3_vl", "qwen3_vl_moe"])
def test_fsdp2_shards_each_decoder_layer_and_vision_block(backbone):
    from mmadapt.train.distributed import blocks_to_shard

    model = tiny(backbone)
    blocks = blocks_to_shard(model)
    for layers in (model.backbone.model.layers, model.encoder.tower.blocks):
        assert all(any(layer is b for b in blocks) for layer in layers)
    kind = "Qwen3VLMoeTextDecoderLayer" if backbone == "qwen3_vl_moe" else "Qwen3VLTextDecoderLayer"
    assert sum(type(b).__name__ == kind for b in blocks) == 4


# ---- two accelerators parting, on its own model ----------------------------------------------------------------------
def test_story3_a_backward_only_perturbation_in_a_middle_layer_is_named(tmp_path):
    """Dumps of two runs of a tiny Qwen3-VL-8B-shaped stack (DeepStack into layers 0-2): the second scales the
    gradient flowing out of LLM layer 3 of 6 (forward unchanged, as a faulty accelerator's backward would)."""

    torch.manual_seed(0)
    deeper = {"name": "qwen3_vl", "options": {"num_hidden_layers": 6}}
    model = mmadapt.build_model("qwen3_vl_vit", "qwen_merger", deeper)
    batch = synthetic_batch(model, (1, 2))

    from test_numerics import compare_with_backward_scaled_after

    result = compare_with_backward_scaled_after(model, model.backbone.model.layers[3], batch, tmp_path)
    assert result.first_forward is None and all(r.rel == 0 for r in result.forward)
    assert result.first_backward is not None and result.first_backward.startswith("backbone.model.layers.3.")
    names = [r.name for r in result.backward]
    before = result.backward[: names.index(result.first_backward)]
    assert before and all(r.rel == 0 for r in before)  # lm_head, final norm, layers 5 and 4: untouched
    assert any(r.name.startswith("projector.deepstack.") and r.rel > 0.15 for r in result.backward)
