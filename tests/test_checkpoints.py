"""Saving and loading: strict keys, clear errors where no transformers equivalent exists, tied embeddings."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mmadapt
from mmadapt import VisionLanguageModel
from mmadapt.processor import export_processor
from mmadapt.synthetic import synthetic_batch


def test_missing_and_unexpected_keys_are_errors_that_list_them(tmp_path):
    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama")
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights.pop("projector.linear_2.bias")
    weights["projector.extra.weight"] = torch.zeros(1)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing keys \['projector.linear_2.bias'\], unexpected keys "
                                         r"\['projector.extra.weight'\]"):
        VisionLanguageModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Missing weights are always an error"):
        VisionLanguageModel.from_pretrained(tmp_path, strict=False)  # the opt-out never leaves a random weight
    weights["projector.linear_2.bias"] = model.state_dict()["projector.linear_2.bias"]
    save_file(weights, tmp_path / "model.safetensors")
    VisionLanguageModel.from_pretrained(tmp_path, strict=False)  # an explicit opt-out ignores unexpected keys


def test_transformers_missing_keys_are_errors(hf_llava_dir, tmp_path):
    for name in ("config.json",):
        (tmp_path / name).write_text((hf_llava_dir / name).read_text())
    weights = load_file(hf_llava_dir / "model.safetensors")
    dropped = next(k for k in weights if "multi_modal_projector" in k)
    weights.pop(dropped)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"projector 'mlp2x_gelu': {tmp_path} lacks 1 of the 4 weights of this part: "
                                         rf"{dropped.rsplit('.', 2)[-2]}\.{dropped.rsplit('.', 1)[-1]}"):
        VisionLanguageModel.from_pretrained(tmp_path)


def test_export_without_a_transformers_equivalent_says_so(tmp_path):
    model = mmadapt.build_model("clip", "mlp2x_gelu", "qwen3_5")
    with pytest.raises(ValueError, match=r"no transformers architecture is equivalent to encoder 'clip' \+ "
                                         r"projector 'mlp2x_gelu' \+ backbone 'qwen3_5'.*format='mmadapt'"):
        model.save_pretrained(tmp_path, format="transformers", processor_export=export_processor)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json not found"):
        VisionLanguageModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert' is neither"):
        VisionLanguageModel.from_pretrained(tmp_path)


def test_tied_embeddings_survive_both_formats(tmp_path):
    config = mmadapt.ModelConfig.from_names("qwen3_5_vit", "qwen_merger", "qwen3_5")
    config.backbone.options = {"tie_word_embeddings": True}
    model = VisionLanguageModel(config).eval()
    batch = synthetic_batch(model, (1, 1))
    for fmt in ("mmadapt", "transformers"):
        model.save_pretrained(tmp_path / fmt, format=fmt, processor_export=export_processor)
        again = VisionLanguageModel.from_pretrained(tmp_path / fmt).eval()
        assert again.backbone.lm_head.weight is again.backbone.model.embed_tokens.weight
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, again(**batch).logits)
