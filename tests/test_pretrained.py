"""Parts from checkpoints as the hub ships them: every source loads exactly, strictly, with clear errors.

Each checkpoint is a tiny random model saved by transformers (or written in LLaVA's / Vicuna's /
timm's formats) in a temporary directory. "Equal" means `torch.equal` for weights and for part
outputs on the same input; whole-model logits and loss are compared within 1e-5 (fp32).
"""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch
from conftest import tiny_options
from safetensors.torch import load_file, save_file

import mmadapt
from mmadapt import ImageTokenContractError, VisionLanguageModel
from mmadapt.backbones import BACKBONES
from mmadapt.encoders import ENCODERS
from mmadapt.synthetic import synthetic_batch
from mmadapt.weights import MissingWeightsError, meta_parameters

ATOL = 1e-5
CLIP_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=16, projection_dim=32)


def part(name: str, path, **kwargs) -> dict:
    return {"name": name, "pretrained": str(path), **kwargs}


def assert_same_state(module: torch.nn.Module, reference: dict[str, torch.Tensor], prefix_map: tuple[str, str]):
    """Every tensor of `module` equals the reference's tensor under the mapped name (and none is left on meta)."""
    ours, theirs = prefix_map
    state = module.state_dict()
    assert not meta_parameters(module)
    params = {k for k, _ in module.named_parameters()}
    for key in params:
        assert torch.equal(state[key], reference[theirs + key[len(ours):]]), key


def write_bin_shards(state: dict[str, torch.Tensor], directory, shards: int = 2) -> None:
    """Vicuna's layout: pytorch_model-0000k-of-0000n.bin + pytorch_model.bin.index.json."""
    keys = sorted(state)
    weight_map = {}
    for k in range(shards):
        name = f"pytorch_model-{k + 1:05d}-of-{shards:05d}.bin"
        chunk = keys[k::shards]
        torch.save({key: state[key].clone() for key in chunk}, directory / name)
        weight_map.update(dict.fromkeys(chunk, name))
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ---- checkpoints ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clip_dirs(tmp_path_factory):
    """CLIPModel (text + vision, as openai/clip-vit-large-patch14-336 ships) and CLIPVisionModel directories."""
    from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(1)
    vision = ENCODERS.get("clip").options("tiny")
    full = tmp_path_factory.mktemp("clip_full")
    CLIPModel(CLIPConfig(vision_config=vision, text_config=CLIP_TEXT, projection_dim=32)).save_pretrained(full)
    alone = tmp_path_factory.mktemp("clip_vision")
    CLIPVisionModel(CLIPVisionConfig(**vision)).save_pretrained(alone)
    sharded = tmp_path_factory.mktemp("clip_sharded")
    CLIPModel.from_pretrained(full).save_pretrained(sharded, max_shard_size="60KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    return full, alone, sharded


@pytest.fixture(scope="module")
def siglip_dirs(tmp_path_factory):
    from transformers import SiglipConfig, SiglipModel, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(2)
    vision = ENCODERS.get("siglip").options("tiny")
    full = tmp_path_factory.mktemp("siglip_full")
    text = {k: v for k, v in CLIP_TEXT.items() if k != "projection_dim"}
    SiglipModel(SiglipConfig(vision_config=vision, text_config=text)).save_pretrained(full)
    alone = tmp_path_factory.mktemp("siglip_vision")
    SiglipVisionModel(SiglipVisionConfig(**vision)).save_pretrained(alone)
    return full, alone


@pytest.fixture(scope="module")
def qwen_tied_bf16_dir(tmp_path_factory):
    """A Qwen3.5-VL directory as the hub ships the small ones: bf16, tie_word_embeddings only at the top level,
    no lm_head in the file, sharded safetensors (*.index.json), a preprocessor_config.json."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(3)
    text = tiny_options(BACKBONES, "qwen3_5")
    vision = {**ENCODERS.get("qwen3_5_vit").options("tiny"), "out_hidden_size": text["hidden_size"]}
    vision = {k: v for k, v in vision.items() if k not in ("min_pixels", "max_pixels")}
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
                           vision_start_token_id=248, vision_end_token_id=249, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("qwen_tied")
    Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="100KB")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"].pop("tie_word_embeddings", None)  # the measured trap: only the top level says "tied"
    (path / "config.json").write_text(json.dumps(raw))
    (path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 1024,
                                                                        "longest_edge": 65536}}))
    assert (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="module")
def qwen_text_dir(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(4)
    path = tmp_path_factory.mktemp("qwen_text")
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**tiny_options(BACKBONES, "qwen3_5"))).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vicuna_dir(tmp_path_factory):
    """LlamaForCausalLM as lmsys/vicuna-7b-v1.5 ships it: .bin shards and an index, no image token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("vicuna")
    lm = LlamaForCausalLM(LlamaConfig(**tiny_options(BACKBONES, "llama")))
    lm.config.save_pretrained(path)
    write_bin_shards(lm.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def llava_layouts(hf_llava_dir, tmp_path_factory):
    """One llava-hf checkpoint in the three key layouts in use: as transformers 5 saves it, as the hub ships
    llava-hf/llava-1.5-7b-hf (`vision_tower.vision_model.*`), and transformers' runtime names."""
    layouts = {"saved": (), "hub": (("vision_tower.", "vision_tower.vision_model."),),
               "runtime": (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                           ("vision_tower.", "model.vision_tower."),
                           ("multi_modal_projector.", "model.multi_modal_projector."))}
    saved = load_file(hf_llava_dir / "model.safetensors")
    paths = {}
    for name, renames in layouts.items():
        path = paths[name] = tmp_path_factory.mktemp(f"llava_{name}")
        (path / "config.json").write_text((hf_llava_dir / "config.json").read_text())
        state = {}
        for key, value in saved.items():
            old, new = next((r for r in renames if key.startswith(r[0])), ("", ""))
            state[new + key[len(old):]] = value
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return paths


@pytest.fixture(scope="module")
def mm_projector_files(tmp_path_factory):
    """LLaVA's stage-1 outputs: mm_projector.bin for mlp2x_gelu (Sequential 0, 2) and for linear."""
    torch.manual_seed(6)
    path = tmp_path_factory.mktemp("mm_projector")
    mlp = {"model.mm_projector.0.weight": torch.randn(64, 64), "model.mm_projector.0.bias": torch.randn(64),
           "model.mm_projector.2.weight": torch.randn(64, 64), "model.mm_projector.2.bias": torch.randn(64)}
    (path / "mlp").mkdir()
    torch.save(mlp, path / "mlp" / "mm_projector.bin")
    (path / "mlp" / "config.json").write_text(json.dumps({"model_type": "llava_llama", "mm_projector_type":
                                                          "mlp2x_gelu"}))  # LLaVA's own training config
    linear = {"model.mm_projector.weight": torch.randn(64, 64), "model.mm_projector.bias": torch.randn(64)}
    torch.save(linear, path / "linear.bin")
    return path / "mlp", path / "linear.bin", mlp, linear


# ---- whole VLMs as three parts equal transformers -----------------------------------------------------------
def hf_inputs(batch: dict, image_token_id: int, mrope: bool) -> dict:
    inputs = {k: v for k, v in batch.items() if k != "images_per_sample"}
    inputs["attention_mask"] = batch["attention_mask"].long()  # as transformers' tokenizers return it
    if mrope:
        inputs["mm_token_type_ids"] = (batch["input_ids"] == image_token_id).int()
    return inputs


def test_qwen_vlm_directory_as_three_parts_equals_transformers(hf_qwen_dir):
    from transformers import Qwen3_5ForConditionalGeneration

    ours = mmadapt.build_model(part("qwen3_5_vit", hf_qwen_dir), part("qwen_merger", hf_qwen_dir),
                               part("qwen3_5", hf_qwen_dir)).eval()
    theirs = Qwen3_5ForConditionalGeneration.from_pretrained(hf_qwen_dir).eval()
    # two images of different sizes in sample 1, right padding, int64 mask on both sides
    batch = synthetic_batch(ours, (1, 2), image_sides=[32, (48, 64), (64, 32)], text_lengths=[9, 5])
    inputs = hf_inputs(batch, 250, mrope=True)
    assert not batch["attention_mask"].all()
    with torch.no_grad():
        a, b = ours(**inputs), theirs(**inputs)
    assert (a.logits - b.logits)[batch["attention_mask"]].abs().max() <= ATOL
    assert abs(a.loss.item() - b.loss.item()) <= ATOL


@pytest.mark.parametrize("layout", ["saved", "hub", "runtime"])
def test_llava_directory_as_three_parts_equals_transformers(layout, llava_layouts, hf_llava_dir):
    from transformers import LlavaForConditionalGeneration

    path = llava_layouts[layout]
    ours = mmadapt.build_model(part("clip", path), part("mlp2x_gelu", path), part("llama", path)).eval()
    theirs = LlavaForConditionalGeneration.from_pretrained(hf_llava_dir).eval()
    batch = synthetic_batch(ours, (1, 2), text_lengths=[9, 4])
    inputs = hf_inputs(batch, 255, mrope=False)
    with torch.no_grad():
        a, b = ours(**inputs), theirs(**inputs)
    assert (a.logits - b.logits)[batch["attention_mask"]].abs().max() <= ATOL
    assert abs(a.loss.item() - b.loss.item()) <= ATOL


# ---- each source: weights equal, outputs equal --------------------------------------------------------------
@pytest.mark.parametrize(("family", "which"), [("clip", 0), ("clip", 1), ("clip", 2), ("siglip", 0), ("siglip", 1)],
                         ids=["CLIPModel", "CLIPVisionModel", "CLIPModel-sharded", "SiglipModel", "SiglipVisionModel"])
def test_clip_and_siglip_directories(family, which, request):
    import transformers

    path = request.getfixturevalue(f"{family}_dirs")[which]
    encoder = ENCODERS.get(family).from_pretrained(str(path)).eval()
    cls = getattr(transformers, "CLIPVisionModel" if family == "clip" else "SiglipVisionModel")
    reference = cls.from_pretrained(path).eval()
    assert_same_state(encoder, reference.state_dict(), ("tower.", ""))
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        hidden = reference(pixels, output_hidden_states=True).hidden_states[-2]
        expected = hidden[:, 1:] if family == "clip" else hidden  # LLaVA's features: layer -2, CLS dropped
        assert torch.equal(encoder(pixels).features, expected.reshape(-1, expected.shape[-1]))


def test_a_clip_option_that_is_not_architecture_still_applies(clip_dirs):
    encoder = ENCODERS.get("clip").from_pretrained(str(clip_dirs[0]), feature_layer=-1, drop_cls=False)
    assert encoder.feature_layer == -1 and not encoder.drop_cls


def test_llava_directory_gives_its_tower_with_llava_feature_settings(hf_llava_dir):
    from transformers import LlavaForConditionalGeneration

    encoder = ENCODERS.get("clip").from_pretrained(str(hf_llava_dir))
    reference = LlavaForConditionalGeneration.from_pretrained(hf_llava_dir).model.vision_tower
    assert_same_state(encoder, reference.state_dict(), ("tower.", ""))
    assert (encoder.feature_layer, encoder.drop_cls) == (-2, True)


def test_qwen_vit_and_merger_from_a_vlm_directory(qwen_tied_bf16_dir):
    from transformers import Qwen3_5ForConditionalGeneration

    encoder = ENCODERS.get("qwen3_5_vit").from_pretrained(str(qwen_tied_bf16_dir))
    projector = mmadapt.PROJECTORS.get("qwen_merger").from_pretrained(str(qwen_tied_bf16_dir), 64, 64)
    reference = Qwen3_5ForConditionalGeneration.from_pretrained(qwen_tied_bf16_dir).model.visual.eval()
    state = reference.state_dict()
    assert_same_state(encoder, state, ("tower.", ""))
    assert_same_state(projector, state, ("", "merger."))
    assert encoder.tower.dtype == torch.bfloat16  # default dtype: the checkpoint's
    assert (encoder.min_pixels, encoder.max_pixels) == (1024, 65536)  # from preprocessor_config.json
    grid = torch.tensor([[1, 4, 6], [1, 8, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), encoder.patch_dim)
    with torch.no_grad():
        expected = reference(pixels.to(torch.bfloat16), grid_thw=grid)
        visual = encoder(pixels, grid)
        assert torch.equal(visual.features, expected.last_hidden_state)
        assert torch.equal(projector(visual).features, expected.pooler_output)


def test_a_requested_dtype_converts_at_load(qwen_tied_bf16_dir):
    encoder = ENCODERS.get("qwen3_5_vit").from_pretrained(str(qwen_tied_bf16_dir), dtype="float32")
    reference = load_file(next(qwen_tied_bf16_dir.glob("model-*.safetensors")))
    key = next(k for k in reference if k.startswith("model.visual.blocks.0."))
    assert encoder.tower.dtype == torch.float32
    assert torch.equal(encoder.state_dict()["tower." + key[len("model.visual."):]], reference[key].float())


@pytest.mark.parametrize("source", ["vlm_tied_bf16", "text_only"])
def test_qwen3_5_backbone_from_a_vlm_or_a_text_directory(source, qwen_tied_bf16_dir, qwen_text_dir):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    path = qwen_tied_bf16_dir if source == "vlm_tied_bf16" else qwen_text_dir
    lm, tokens = BACKBONES.get("qwen3_5").from_pretrained(str(path))
    if source == "vlm_tied_bf16":
        reference = Qwen3_5ForConditionalGeneration.from_pretrained(path)
        ref_state = {k.replace("model.language_model.", "model."): v for k, v in reference.state_dict().items()
                     if not k.startswith("model.visual.")}
        assert tokens.image_token_id == 250 and tokens.vision_start_token_id == 248  # from the VLM config
        assert lm.lm_head.weight is lm.model.embed_tokens.weight  # tied, not random
    else:
        reference = Qwen3_5ForCausalLM.from_pretrained(path)
        ref_state = reference.state_dict()
        assert tokens.image_token_id is None  # a text LLM's checkpoint has none; a tokenizer gives it
    assert_same_state(lm, ref_state, ("", ""))
    ids = torch.randint(0, 240, (2, 7))
    with torch.no_grad():
        expected = (reference.model.language_model(input_ids=ids).last_hidden_state if source == "vlm_tied_bf16"
                    else reference.model(input_ids=ids).last_hidden_state)
        assert torch.equal(lm.model(input_ids=ids).last_hidden_state, expected)


def test_vicuna_bin_shards_and_llava_language_model(vicuna_dir, hf_llava_dir):
    from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

    lm, tokens = BACKBONES.get("llama").from_pretrained(str(vicuna_dir))
    reference = LlamaForCausalLM.from_pretrained(vicuna_dir)
    assert_same_state(lm, reference.state_dict(), ("", ""))
    assert tokens.image_token_id is None
    ids = torch.randint(0, 250, (2, 6))
    with torch.no_grad():
        assert torch.equal(lm(input_ids=ids).logits, reference(input_ids=ids).logits)
    lm, tokens = BACKBONES.get("llama").from_pretrained(str(hf_llava_dir))
    llava = LlavaForConditionalGeneration.from_pretrained(hf_llava_dir)
    ref_state = {k.replace("model.language_model.", "model."): v for k, v in llava.state_dict().items()}
    assert_same_state(lm, ref_state, ("", ""))
    assert tokens.image_token_id == 255


def test_projectors_from_mm_projector_bin_and_llava_hf(mm_projector_files, hf_llava_dir):
    from transformers import LlavaForConditionalGeneration

    mlp_dir, linear_file, mlp, linear = mm_projector_files
    projector = mmadapt.PROJECTORS.get("mlp2x_gelu").from_pretrained(str(mlp_dir), 64, 64)
    assert torch.equal(projector.linear_1.weight, mlp["model.mm_projector.0.weight"])
    assert torch.equal(projector.linear_2.bias, mlp["model.mm_projector.2.bias"])
    x = torch.randn(5, 64)
    expected = torch.nn.functional.gelu(x @ mlp["model.mm_projector.0.weight"].T + mlp["model.mm_projector.0.bias"])
    expected = expected @ mlp["model.mm_projector.2.weight"].T + mlp["model.mm_projector.2.bias"]
    grids = torch.tensor([[1, 1, 5]])
    assert torch.allclose(projector(mmadapt.VisualTokens(x, grids)).features, expected, atol=1e-6)
    single = mmadapt.PROJECTORS.get("linear").from_pretrained(str(linear_file), 64, 64)
    assert torch.equal(single.linear_1.weight, linear["model.mm_projector.weight"])
    legacy = linear_file.with_name("legacy.bin")  # torch < 1.6's format: cannot be memory-mapped
    torch.save(linear, legacy, _use_new_zipfile_serialization=False)
    single = mmadapt.PROJECTORS.get("linear").from_pretrained(str(legacy), 64, 64)
    assert torch.equal(single.linear_1.bias, linear["model.mm_projector.bias"])
    hf = mmadapt.PROJECTORS.get("mlp2x_gelu").from_pretrained(str(hf_llava_dir), 64, 64)
    reference = LlavaForConditionalGeneration.from_pretrained(hf_llava_dir).model.multi_modal_projector
    assert_same_state(hf, reference.state_dict(), ("", ""))
    with torch.no_grad():
        assert torch.equal(hf(mmadapt.VisualTokens(x, grids)).features, reference(x))


@pytest.fixture(scope="module")
def timm_files(tmp_path_factory):
    """A timm-format safetensors file, and the same weights in OpenCLIP's format (`visual.trunk.` + text tower)."""
    import timm

    torch.manual_seed(7)
    kwargs = {k: v for k, v in ENCODERS.get("timm").options("tiny").items() if k != "model_name"}
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, **kwargs).eval()
    path = tmp_path_factory.mktemp("timm")
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path / "model.safetensors")
    open_clip = {f"visual.trunk.{k}": v for k, v in reference.state_dict().items() if not k.startswith("head.")}
    open_clip["text.token_embedding.weight"] = torch.randn(10, 8)
    torch.save(open_clip, path / "open_clip_pytorch_model.bin")
    return path / "model.safetensors", path / "open_clip_pytorch_model.bin", reference


@pytest.mark.parametrize("which", [0, 1], ids=["timm-format", "open_clip-format"])
def test_timm_from_a_local_file_runs_timms_converters(which, timm_files):
    import timm

    file, reference = timm_files[which], timm_files[2]
    options = {k: v for k, v in ENCODERS.get("timm").options("tiny").items()}
    encoder = ENCODERS.get("timm").from_pretrained(str(file), **options)
    ref_state = {k: v for k, v in reference.state_dict().items() if not k.startswith("head.")}
    assert_same_state(encoder, ref_state, ("tower.", ""))
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(encoder(pixels).features, reference.forward_features(pixels)[:, 1:].reshape(-1, 64))
    if which == 1:  # timm's checkpoint_path route does not convert: what mmadapt avoids
        plain = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0,
                                  **{k: v for k, v in options.items() if k != "model_name"})
        with pytest.raises(RuntimeError):
            timm.models.load_checkpoint(plain, str(file), strict=True)


# ---- failures: clear messages, nothing random left behind ---------------------------------------------------
def test_missing_weights_name_the_directory_the_keys_and_the_count(clip_dirs, tmp_path):
    full = clip_dirs[0]
    (tmp_path / "config.json").write_text((full / "config.json").read_text())
    state = load_file(full / "model.safetensors")
    dropped = sorted(k for k in state if k.startswith("vision_model.encoder.layers.1."))
    save_file({k: v for k, v in state.items() if k not in dropped}, tmp_path / "model.safetensors")
    with pytest.raises(MissingWeightsError, match=rf"{tmp_path} lacks {len(dropped)} of the \d+ weights of this "
                                                  rf"part: tower\.encoder\.layers\.1\..*\(and "
                                                  rf"{len(dropped) - 5} more\)"):
        ENCODERS.get("clip").from_pretrained(str(tmp_path))


def test_a_directory_of_another_family_names_both_model_types(hf_qwen_dir, clip_dirs):
    with pytest.raises(ValueError, match=r"model_type 'qwen3_5' \(text_config 'qwen3_5_text'\), expected 'clip'"):
        ENCODERS.get("clip").from_pretrained(str(hf_qwen_dir))
    with pytest.raises(ValueError, match=r"model_type 'clip'.*expected 'llama' or a VLM whose text_config is 'llama'"):
        BACKBONES.get("llama").from_pretrained(str(clip_dirs[0]))
    with pytest.raises(ValueError, match=r"expected a Qwen3\.5-VL directory"):
        ENCODERS.get("qwen3_5_vit").from_pretrained(str(clip_dirs[0]))
    with pytest.raises(ValueError, match=r"expected LLaVA's mm_projector\.bin"):
        mmadapt.PROJECTORS.get("mlp2x_gelu").from_pretrained(str(hf_qwen_dir), 64, 64)


def test_a_missing_path_and_a_directory_without_weights_say_so(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"backbone 'llama': pretrained path {tmp_path}/nope does not exist"):
        mmadapt.build_model("clip", "mlp2x_gelu", part("llama", tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"no weights in .*looked for model.safetensors.index.json"):
        ENCODERS.get("clip").from_pretrained(str(tmp_path))


def test_preset_with_pretrained_and_contradicting_architecture_options_are_errors(clip_dirs, mm_projector_files):
    declared = mmadapt.build_model({"name": "clip", "preset": "tiny", "pretrained": str(clip_dirs[0])}, "mlp2x_gelu",
                                   "llama")  # a preset with pretrained declares the checkpoint's architecture
    assert declared.config.encoder.preset == "tiny" and declared.config.encoder.pretrained == str(clip_dirs[0])
    with pytest.raises(ValueError, match=r"does not have the architecture of preset 'vit-l-14-336': .*\(preset: "):
        mmadapt.build_model({"name": "clip", "preset": "vit-l-14-336", "pretrained": str(clip_dirs[0])},
                            "mlp2x_gelu", "llama")
    with pytest.raises(ValueError, match=r"options hidden_size=128 \(checkpoint: 64\) contradict"):
        ENCODERS.get("clip").from_pretrained(str(clip_dirs[0]), hidden_size=128)
    with pytest.raises(MissingWeightsError, match=r"encoder width 32 -> backbone width 64"):
        mmadapt.PROJECTORS.get("mlp2x_gelu").from_pretrained(str(mm_projector_files[0]), 32, 64)
    with pytest.raises(ValueError, match=r"holds a 2-layer LLaVA projector, but this projector has 1.*'mlp2x_gelu'"):
        mmadapt.PROJECTORS.get("linear").from_pretrained(str(mm_projector_files[0]), 64, 64)


# ---- mixed parts, dtypes, provenance, tokenizer, YAML ---------------------------------------------------
def test_mixed_clip_fresh_projector_qwen_llm_keeps_weights_and_trains_a_step(clip_dirs, qwen_tied_bf16_dir,
                                                                            tmp_path):
    from mmadapt.data import Collator
    from mmadapt.synthetic import synthetic_samples
    from mmadapt.train import RunConfig, Trainer, latest_checkpoint, load_checkpoint

    model = mmadapt.build_model(part("clip", clip_dirs[0]), "mlp2x_gelu", part("qwen3_5", qwen_tied_bf16_dir))
    assert model.backbone.dtype == torch.bfloat16 and model.projector.linear_1.weight.dtype == torch.float32
    llm_before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    projector_before = {k: v.clone() for k, v in model.projector.state_dict().items()}
    cfg = RunConfig.load(None, [f"train.out={tmp_path}", "train.steps=1", "data.batch_size=2", "train.lr=1e-2",
                                "stages.preset=llava-stage1", "train.progress=false", "train.warmup_steps=0"])
    samples = synthetic_samples(model, (1, 1, 2, 0))
    result = Trainer(model, cfg, samples, Collator.for_model(model, 0)).fit()
    assert result["steps"] == 1 and all(torch.isfinite(torch.tensor(h["loss"])) for h in result["history"])
    assert all(torch.equal(v, llm_before[k]) for k, v in model.backbone.state_dict().items())  # frozen bf16 LLM
    assert any(not torch.equal(v, projector_before[k]) for k, v in model.projector.state_dict().items())
    saved = load_checkpoint(latest_checkpoint(tmp_path))["model"]  # tied embeddings stored once, restored as two
    assert torch.equal(saved["backbone.lm_head.weight"], saved["backbone.model.embed_tokens.weight"])


def test_saved_config_records_each_parts_source_and_hash(clip_dirs, hf_qwen_dir, tmp_path):
    model = mmadapt.build_model(part("clip", clip_dirs[0]), "mlp2x_gelu", part("qwen3_5", hf_qwen_dir))
    model.save_pretrained(tmp_path / "a")
    saved = json.loads((tmp_path / "a" / "config.json").read_text())["mmadapt"]
    for name, directory in (("encoder", clip_dirs[0]), ("backbone", hf_qwen_dir)):
        source = saved[name]["source"]
        digest = hashlib.sha256()
        for file in source["files"]:
            digest.update((directory / file).read_bytes())
        assert source["path"] == str(directory.resolve()) and source["sha256"] == digest.hexdigest()
        assert saved[name]["pretrained"] is None and saved[name]["preset"] is None  # reloads from this directory
    assert saved["projector"]["source"] is None  # fresh
    again = VisionLanguageModel.from_pretrained(tmp_path / "a")
    again.save_pretrained(tmp_path / "b")  # the record survives a reload and a second save
    assert json.loads((tmp_path / "b" / "config.json").read_text())["mmadapt"]["encoder"]["source"] == \
        saved["encoder"]["source"]


def test_a_backbone_without_an_image_token_fails_loudly_until_a_tokenizer_gives_one(clip_dirs, vicuna_dir):
    from mmadapt.data import char_tokenizer, prepare_tokenizer

    model = mmadapt.build_model(part("clip", clip_dirs[0]), "mlp2x_gelu", part("llama", vicuna_dir))
    pixels = torch.randn(1, 3, 32, 32)
    ids = torch.randint(0, 200, (1, 20))
    with pytest.raises(ImageTokenContractError, match=r"backbone 'llama' has no image token id.*prepare_tokenizer"):
        model(input_ids=ids, pixel_values=pixels)
    model(input_ids=ids)  # text alone is fine
    tokenizer = char_tokenizer()
    prepare_tokenizer(model, tokenizer)
    assert model.tokens.image_token_id == tokenizer.convert_tokens_to_ids("<image>")
    batch = synthetic_batch(model, (1,))
    assert torch.isfinite(model(**batch).loss)


def test_vicuna_tokenizer_gets_image_token_rows_at_the_mean(vicuna_dir, clip_dirs, tmp_path, caplog):
    """A Vicuna tokenizer fills the vocabulary (as the real one does, 32000 of 32000): <image> is added, both
    matrices grow by one row initialised to the mean of the existing rows, and it is logged."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mmadapt.data import prepare_tokenizer

    vocab = {f"t{i}": i for i in range(256)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", eos_token="t1", bos_token="t2")
    model = mmadapt.build_model(part("clip", clip_dirs[0]), "mlp2x_gelu", part("llama", vicuna_dir))
    embed, head = (model.backbone.get_input_embeddings().weight.detach().clone(),
                   model.backbone.lm_head.weight.detach().clone())
    with caplog.at_level(logging.INFO, logger="mmadapt"):
        prepare_tokenizer(model, tokenizer)
    grown = len(tokenizer)
    assert grown > 256 and f"vocabulary 256 -> {grown} tokens" in caplog.text
    assert torch.allclose(model.backbone.get_input_embeddings().weight[256:], embed.mean(0).expand(grown - 256, -1))
    assert torch.allclose(model.backbone.lm_head.weight[256:], head.mean(0).expand(grown - 256, -1))
    assert model.tokens.image_token_id == tokenizer.convert_tokens_to_ids("<image>") >= 256


def test_run_yaml_takes_names_or_part_mappings_and_finds_the_backbones_tokenizer(clip_dirs, qwen_tied_bf16_dir,
                                                                                 tmp_path, caplog):
    from mmadapt.data import char_tokenizer
    from mmadapt.train import RunConfig
    from mmadapt.train.run import build_model_from, tokenizer_source

    yaml_text = (f"model:\n  encoder: {{name: clip, pretrained: {clip_dirs[0]}, options: {{feature_layer: -1}}}}\n"
                 f"  projector: mlp2x_gelu\n  backbone:\n    name: qwen3_5\n    pretrained: {qwen_tied_bf16_dir}\n"
                 f"    dtype: float32\n")
    (tmp_path / "run.yaml").write_text(yaml_text)
    cfg = RunConfig.load(tmp_path / "run.yaml")
    model = build_model_from(cfg)
    assert model.encoder.feature_layer == -1 and model.backbone.dtype == torch.float32
    with caplog.at_level(logging.WARNING):
        assert tokenizer_source(cfg) is None
    assert "has no tokenizer files" in caplog.text
    char_tokenizer().save_pretrained(tmp_path / "with_tokenizer")
    for name in ("config.json",):
        (tmp_path / "with_tokenizer" / name).write_text((qwen_tied_bf16_dir / name).read_text())
    cfg = RunConfig.load(tmp_path / "run.yaml", [f"model.backbone.pretrained={tmp_path / 'with_tokenizer'}"])
    assert tokenizer_source(cfg) == str(tmp_path / "with_tokenizer")
    assert RunConfig.load(None, ["model.encoder=siglip"]).model.model_config().encoder.preset == "tiny"  # names work
    with pytest.raises(ValueError, match=r"model.encoder: unknown keys \['pretraind'\]"):
        RunConfig.load(None, ["model.encoder={name: clip, pretraind: x}"])
    with pytest.raises(ValueError, match=r"model\.pretrained loads one whole model"):
        RunConfig.load(None, ["model.pretrained=x", f"model.encoder={{name: clip, pretrained: {clip_dirs[0]}}}"])
