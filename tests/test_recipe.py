"""The LLaVA-1.5 -> Qwen3.5 port (a LLaVA-1.5 codebase with Qwen3.5 and Qwen's ViT swapped in,
whose first port trained without ever seeing its images) as a tested recipe: `mmadapt train` with YAML files.

Every checkpoint is a tiny random model saved by transformers in a temporary directory, standing in
for the real ones: a `CLIPModel` directory (openai/clip-vit-large-patch14-336: text + vision towers)
and a `Qwen3_5ForConditionalGeneration` directory (Qwen/Qwen3.5-0.8B: ViT, merger, LLM with lm_head
tied to the input embeddings, tokenizer, preprocessor_config.json); the untied layout (Qwen3.5-9B)
gets a short stage-1 test of its own. Training data are real handwritten digits
(`mmadapt.demo.digit_records`).

Two variants, one flow (`VARIANTS`):
- `clip`: LLaVA-1.5's tower (pretrained CLIP) + a fresh `mlp2x_gelu` + the Qwen3.5 LLM (pretrained);
- `qwen_vit`: Qwen's own ViT + merger + LLM, all from the same Qwen3.5-VL directory.

Stage 1 (`stages.preset: llava-stage1`) trains the projector alone; stage 2 (`stages.preset: lora`)
starts the projector from stage 1's final checkpoint and adds LoRA to the LLM; the stage-2 model is
rebuilt in Python from its YAML, LoRA merged, saved, reloaded.

Tolerances: frozen weights are compared bitwise (`torch.equal`) with the source checkpoints' tensors;
logits after merging LoRA, saving and reloading are within 1e-5 absolute of the unmerged model's
(fp32; merging changes the rounding of W + BA * alpha / r, nothing else).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import helpers
import pytest
import torch
from conftest import tiny_options
from safetensors.torch import load_file

from mmadapt import VisionLanguageModel
from mmadapt.backbones import BACKBONES
from mmadapt.cli import main
from mmadapt.encoders import ENCODERS
from mmadapt.sharded_checkpoint import state_files
from mmadapt.train import RunConfig, latest_checkpoint, load_checkpoint, merge_lora
from mmadapt.train.run import build_run
from mmadapt.train.stages import apply_stages, lora_modules

ATOL = 1e-5  # fp32 logits, merged + saved + reloaded vs unmerged
VARIANTS = ("clip", "qwen_vit")
# Qwen's tokenizer already holds its chat and image-span tokens: nothing is added, no embedding is resized.
QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CLIP_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)


# ---- the stand-ins for the real checkpoints and data ----------------------------------------------------
def save_qwen_vlm(path: Path, *, tie_word_embeddings: bool) -> Path:
    """A Qwen3.5-VL directory as the hub ships one: weights, config, tokenizer, preprocessor_config.json."""
    from transformers import Qwen2VLImageProcessor, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from mmadapt.data import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.add_tokens(list(QWEN_SPECIALS), special_tokens=True)
    ids = dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"),
                   tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                    "<|vision_end|>"]), strict=True))
    text = tiny_options(BACKBONES, "qwen3_5")
    vision = {k: v for k, v in ENCODERS.get("qwen3_5_vit").options("tiny").items()
              if k not in ("min_pixels", "max_pixels")}  # pixel bounds live in preprocessor_config.json
    assert len(tokenizer) <= text["vocab_size"]
    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=text, vision_config={**vision, "out_hidden_size": text["hidden_size"]},
                           tie_word_embeddings=tie_word_embeddings, **ids)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    # 32 x 32 digits stay 32 x 32: a 4 x 4 patch grid, 4 visual tokens after the 2 x 2 merge.
    Qwen2VLImageProcessor(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16,
                          max_pixels=32 * 32).save_pretrained(path)
    return path


@dataclass
class Sources:
    clip: Path
    qwen: Path
    data: Path


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Sources:
    from transformers import CLIPConfig, CLIPModel

    from mmadapt.demo import digit_records

    clip = tmp_path_factory.mktemp("clip-vit")
    torch.manual_seed(1)
    CLIPModel(CLIPConfig(vision_config=ENCODERS.get("clip").options("tiny"), text_config=CLIP_TEXT,
                         projection_dim=32)).save_pretrained(clip)
    qwen = save_qwen_vlm(tmp_path_factory.mktemp("qwen3_5-vl"), tie_word_embeddings=True)  # as Qwen3.5-0.8B
    data = tmp_path_factory.mktemp("digits")
    digit_records(data, image_size=32)
    return Sources(clip, qwen, data)


# ---- the run configs ------------------------------------------------------------------------------------
def model_section(variant: str, src: Sources, projector_from: Path | None = None) -> dict:
    """`model:` of the YAML: every part a {name, pretrained} mapping, except stage 1's fresh mlp2x_gelu."""
    qwen = str(src.qwen)
    if variant == "clip":
        encoder, projector = {"name": "clip", "pretrained": str(src.clip)}, {"name": "mlp2x_gelu"}
    else:
        encoder, projector = {"name": "qwen3_5_vit", "pretrained": qwen}, {"name": "qwen_merger", "pretrained": qwen}
    if projector_from is not None:
        projector = {"name": projector["name"], "pretrained": str(projector_from)}
    return {"encoder": encoder, "projector": projector, "backbone": {"name": "qwen3_5", "pretrained": qwen}}


def write_run(path: Path, model: dict, src: Sources, out: Path, stages: dict, **extra) -> Path:
    """A run YAML; `data.tokenizer` is left out: it defaults to the pretrained backbone's directory."""
    return helpers.write_run(path, model=model,
                             data={"train": src.data / "train.jsonl", "image_root": src.data, "batch_size": 4},
                             train={"steps": 3, "lr": 1e-3, "out": out, "progress": False, "log_every": 1},
                             stages=stages, **extra)


def train(config: Path) -> Path:
    """`mmadapt train CONFIG` (in process); the final checkpoint directory."""
    assert main(["train", str(config)]) == 0, "mmadapt train failed (its error is in the captured stderr)"
    out = Path(RunConfig.load(config).train.out)
    steps = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in steps)
    return latest_checkpoint(out)


@dataclass
class Stage:
    variant: str
    src: Sources
    config: Path
    checkpoint: Path


@pytest.fixture(scope="module", params=VARIANTS)
def stage1(request, sources, tmp_path_factory) -> Stage:
    root = tmp_path_factory.mktemp(f"{request.param}-stage1")
    config = write_run(root / "stage1.yaml", model_section(request.param, sources), sources, root / "out",
                       {"preset": "llava-stage1"})
    return Stage(request.param, sources, config, train(config))


@pytest.fixture(scope="module")
def stage2(stage1, tmp_path_factory) -> Stage:
    root = tmp_path_factory.mktemp(f"{stage1.variant}-stage2")
    model = model_section(stage1.variant, stage1.src, projector_from=stage1.checkpoint)
    config = write_run(root / "stage2.yaml", model, stage1.src, root / "out", {"preset": "lora"},
                       lora={"r": 4, "alpha": 8})
    return Stage(stage1.variant, stage1.src, config, train(config))


# ---- frozen means bitwise equal to the source checkpoint ------------------------------------------------
def source_key(key: str, variant: str) -> str:
    """The source checkpoint's name of one encoder / backbone / (Qwen) projector tensor of ours."""
    part, _, rest = key.partition(".")
    if part == "encoder":
        rest = rest.removeprefix("tower.")
        return "vision_model." + rest.removeprefix("vision_model.") if variant == "clip" else "model.visual." + rest
    if part == "projector":
        return "model.visual.merger." + rest
    rest = rest.replace(".base_layer.", ".")  # a LoRA-wrapped layer keeps its base weight under base_layer
    return "model.language_model." + rest.removeprefix("model.") if rest.startswith("model.") else rest


def checkpoint_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A training checkpoint's weights under every name, tied ones included (stored once, restored as aliases)."""
    return load_checkpoint(checkpoint)["model"]


def assert_frozen_parts_unchanged(state: dict[str, torch.Tensor], variant: str, src: Sources) -> None:
    """Every encoder and LLM tensor equals its source tensor bitwise, and every source tensor is accounted for."""
    llm = load_file(src.qwen / "model.safetensors")
    if "lm_head.weight" not in llm:  # tied (Qwen3.5-0.8B): the file holds embed_tokens only; lm_head *is* it
        assert json.loads((src.qwen / "config.json").read_text())["tie_word_embeddings"]
        llm["lm_head.weight"] = llm["model.language_model.embed_tokens.weight"]
    tower = load_file(src.clip / "model.safetensors") if variant == "clip" else llm
    tower_prefix = "vision_model." if variant == "clip" else "model.visual."
    expected = {
        "encoder": {k for k in tower if k.startswith(tower_prefix) and not k.startswith("model.visual.merger.")},
        "backbone": {k for k in llm if k.startswith(("model.language_model.", "lm_head."))},
    }
    for part, source in (("encoder", tower), ("backbone", llm)):
        ours = {source_key(k, variant): k for k in state if k.startswith(f"{part}.") and "lora_" not in k}
        assert set(ours) == expected[part], f"{part}: keys differ from the source checkpoint's"
        changed = [k for theirs, k in ours.items() if not torch.equal(state[k], source[theirs])]
        assert not changed, f"{part}: {len(changed)} frozen tensors changed, e.g. {changed[:3]}"


@pytest.mark.slow
def test_stage1_trains_the_projector_alone_and_leaves_tower_and_llm_bitwise_unchanged(stage1):
    state = checkpoint_state(stage1.checkpoint)
    assert_frozen_parts_unchanged(state, stage1.variant, stage1.src)

    # The projector's starting point: the run rebuilt from the same YAML and seed (fresh mlp2x_gelu or Qwen's merger).
    parts = build_run(RunConfig.load(stage1.config))
    initial = parts.model.projector.state_dict()
    if stage1.variant == "qwen_vit":
        merger = load_file(stage1.src.qwen / "model.safetensors")
        assert all(torch.equal(v, merger[source_key(f"projector.{k}", "qwen_vit")]) for k, v in initial.items())
    trained = {k.removeprefix("projector."): v for k, v in state.items() if k.startswith("projector.")}
    assert set(trained) == set(initial)
    assert [k for k, v in trained.items() if torch.equal(v, initial[k])] == []  # every projector tensor moved

    # The backbone's tokenizer was used as is: no token added, no embedding row added, span ids as configured.
    from transformers import AutoTokenizer

    assert len(parts.tokenizer) == len(AutoTokenizer.from_pretrained(stage1.src.qwen))
    vlm = json.loads((stage1.src.qwen / "config.json").read_text())
    assert parts.model.backbone.get_input_embeddings().num_embeddings == vlm["text_config"]["vocab_size"]
    assert (parts.model.tokens.image_token_id, parts.model.tokens.vision_start_token_id) == (
        vlm["image_token_id"], vlm["vision_start_token_id"])


def assert_tied(model: VisionLanguageModel) -> None:
    """lm_head and the input embeddings are one tensor, as in the source (not two copies that drift apart)."""
    lm = model.backbone
    assert lm.config.tie_word_embeddings and lm.lm_head.weight is lm.get_input_embeddings().weight


@pytest.fixture(scope="module")
def exported(stage2, tmp_path_factory) -> dict:
    """Stage 2 rebuilt from its YAML, its final checkpoint loaded strictly, LoRA merged, saved, reloaded."""
    config = RunConfig.load(stage2.config)
    parts = build_run(config)
    model = parts.model
    apply_stages(model, config.stages, config.lora)
    batch = parts.collate([parts.train_data[i] for i in range(4)])
    model.eval()
    projector_at_start = {k: v.clone() for k, v in model.projector.state_dict().items()}
    with torch.no_grad():
        at_start = model(**batch).logits  # stage-1 projector, LoRA B = 0: the LLM as it was
    state = checkpoint_state(stage2.checkpoint)
    model.load_state_dict(state, strict=True)
    assert_tied(model)
    with torch.no_grad():
        unmerged = model(**batch).logits
        merge_lora(model)
        assert not lora_modules(model)
        merged = model(**batch).logits
        directory = tmp_path_factory.mktemp(f"{stage2.variant}-export")
        model.save_pretrained(directory)
        reloaded = VisionLanguageModel.from_pretrained(directory).eval()
        assert_tied(reloaded)
        reloaded_logits = reloaded(**batch).logits
    return {"stage": stage2, "state": state, "projector_at_start": projector_at_start, "at_start": at_start,
            "unmerged": unmerged, "merged": merged, "reloaded": reloaded_logits,
            "model": reloaded, "directory": directory}


@pytest.mark.slow
def test_stage2_lora_export_reloads_with_the_same_logits(exported):
    """Merged and reloaded logits within 1e-5 (fp32) of the unmerged ones; the tower is still the source's."""
    stage, state = exported["stage"], exported["state"]
    lora_b = [v for k, v in state.items() if "lora_B" in k]
    assert lora_b and any(bool(v.abs().max() > 0) for v in lora_b), "LoRA did not train: the merge would be a no-op"
    assert all(k.startswith("backbone.") for k in state if "lora_" in k)
    assert_frozen_parts_unchanged(state, stage.variant, stage.src)  # LoRA's base weights included
    stage1 = checkpoint_state(Path(RunConfig.load(stage.config).model.model_config().projector.pretrained))
    assert all(torch.equal(v, stage1[f"projector.{k}"]) for k, v in exported["projector_at_start"].items())
    # Training moved the logits far beyond the tolerance, so agreeing within it below is not vacuous.
    assert (exported["unmerged"] - exported["at_start"]).abs().max() > 100 * ATOL
    torch.testing.assert_close(exported["merged"], exported["unmerged"], rtol=0, atol=ATOL)
    torch.testing.assert_close(exported["reloaded"], exported["unmerged"], rtol=0, atol=ATOL)
    reloaded = {f"encoder.{k}": v for k, v in exported["model"].encoder.state_dict().items()}
    assert_frozen_parts_unchanged({**reloaded, **{k: v for k, v in state.items() if k.startswith("backbone.")}},
                                  stage.variant, stage.src)


def sha256(directory: Path, files: list[str]) -> str:
    """hashlib's SHA-256 over the weight files, in order (what `source.sha256` must equal)."""
    digest = hashlib.sha256()
    for name in files:
        digest.update((directory / name).read_bytes())
    return digest.hexdigest()


@pytest.mark.slow
def test_the_saved_config_records_where_each_pretrained_part_came_from(exported):
    stage = exported["stage"]
    saved = json.loads((exported["directory"] / "config.json").read_text())["mmadapt"]
    stage1_checkpoint = Path(RunConfig.load(stage.config).model.model_config().projector.pretrained)
    expected = {"encoder": stage.src.clip if stage.variant == "clip" else stage.src.qwen,
                "projector": stage1_checkpoint, "backbone": stage.src.qwen}
    for part, directory in expected.items():
        source = saved[part]["source"]
        assert Path(source["path"]) == directory.resolve(), part
        # the stage-1 run's checkpoint is sharded (its state files); the hub-style parts' directories one safetensors
        assert source["files"] == (state_files(directory) if part == "projector" else ["model.safetensors"]), part
        assert source["sha256"] == sha256(directory, source["files"]), part


@pytest.mark.slow
def test_stage1_on_an_untied_checkpoint_as_qwen3_5_9b_ships(sources, tmp_path):
    """Qwen3.5-9B has its own lm_head (tie_word_embeddings: false): it too stays bitwise the source's."""
    src = Sources(sources.clip, save_qwen_vlm(tmp_path / "untied", tie_word_embeddings=False), sources.data)
    assert "lm_head.weight" in load_file(src.qwen / "model.safetensors")
    config = write_run(tmp_path / "stage1.yaml", model_section("qwen_vit", src), src, tmp_path / "out",
                       {"preset": "llava-stage1"})
    state = checkpoint_state(train(config))
    assert not torch.equal(state["backbone.lm_head.weight"], state["backbone.model.embed_tokens.weight"])
    assert_frozen_parts_unchanged(state, "qwen_vit", src)


# ---- stage 2 as QLoRA: the LLM in 4 bits while it trains, exported merged into the hub checkpoint's weights ----------
@pytest.fixture(scope="module")
def qlora_stage2(stage1, tmp_path_factory) -> Stage:
    root = tmp_path_factory.mktemp(f"{stage1.variant}-qlora")
    model = model_section(stage1.variant, stage1.src, projector_from=stage1.checkpoint)
    config = write_run(root / "stage2.yaml", model, stage1.src, root / "out", {"preset": "qlora"},
                       lora={"r": 4, "alpha": 8}, quantization={"scaler_block_size": 8})
    return Stage(stage1.variant, stage1.src, config, train(config))


@pytest.mark.slow
def test_stage2_qlora_exports_the_adapters_merged_into_the_hub_checkpoints_weights(qlora_stage2, tmp_path):
    """The run read the LLM from the Qwen3.5 directory straight to NF4: its checkpoints hold every tensor but the NF4
    ones, and every kept one bitwise the source's; the transformers export holds source + B @ A x alpha / r (1e-6) for
    each NF4 layer and (Qwen's ViT + merger: an architecture transformers has) loads in transformers with logits equal
    to mmadapt's merged model (1e-5); CLIP + mlp2x_gelu + Qwen3.5 exports in mmadapt's format."""
    from test_commands import transformers_export_equals_mmadapt

    from mmadapt.lora import LoraSection
    from mmadapt.quantize import QuantizationSection, nf4_layout

    stage = qlora_stage2
    state = checkpoint_state(stage.checkpoint)
    record = json.loads((stage.checkpoint / "config.json").read_text())["quantized_base"]
    assert Path(record["source"]) == stage.src.qwen.resolve() and record["format"] == "nf4"
    llm = load_file(stage.src.qwen / "model.safetensors")
    llm.setdefault("lm_head.weight", llm["model.language_model.embed_tokens.weight"])  # tied, as Qwen3.5-0.8B
    lm, _ = BACKBONES.get("qwen3_5").build("tiny")
    layout = nf4_layout(lm, BACKBONES.get("qwen3_5").keep_precision, QuantizationSection(scaler_block_size=8))
    assert set(record["keys"]) == {f"backbone.{k}" for k in layout.quantized}
    assert {v for v in record["keys"].values()} == {source_key(k, stage.variant) for k in record["keys"]}
    assert not any(k.replace(".base_layer", "") in record["keys"] for k in state)  # no 4-bit weight stored
    kept = {k: v for k, v in state.items() if k.startswith("backbone.") and "lora_" not in k}
    assert kept and all(torch.equal(v, llm[source_key(k, stage.variant)]) for k, v in kept.items())

    out = Path(RunConfig.load(stage.config).train.out)
    export = tmp_path / "exported"  # transformers' format where an architecture is equivalent (Qwen's ViT + merger)
    hf = stage.variant == "qwen_vit"
    assert main(["export", str(out), str(export), "--format", "transformers" if hf else "mmadapt"]) == 0
    exported = load_file(export / "model.safetensors")
    if not hf:  # mmadapt's names
        exported = {source_key(k, stage.variant): v for k, v in exported.items() if k.startswith("backbone.")}
    scale = LoraSection(r=4, alpha=8).alpha / 4
    for key, source in record["keys"].items():
        module = key.removesuffix(".weight")
        delta = state[f"{module}.lora_B.default.weight"] @ state[f"{module}.lora_A.default.weight"] * scale
        assert delta.abs().max() > 1e-4, key  # LoRA trained: the merge is not a no-op
        torch.testing.assert_close(exported[source], llm[source] + delta, rtol=0, atol=1e-6)
    if hf:
        transformers_export_equals_mmadapt(export, out / "model", next(stage.src.data.rglob("*.png")))
