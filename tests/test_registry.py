"""Registries: exact names, loud duplicates and unknowns, lazy heavy imports; a new backbone in a few lines."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import mmadapt
from mmadapt import BACKBONES, PROJECTORS, Registry, UnknownComponentError


def test_unknown_name_lists_known_ones():
    with pytest.raises(UnknownComponentError, match=r"unknown projector 'mlp'; known: identity, linear, mlp2x_gelu"):
        PROJECTORS.get("mlp")


def test_names_are_exact_not_prefixes():
    registry = Registry("thing")
    registry.register("mlp", object())
    with pytest.raises(UnknownComponentError):
        registry.get("mof_mlp")
    with pytest.raises(UnknownComponentError):
        registry.get("ml")


def test_duplicate_name_raises():
    registry = Registry("thing")
    registry.register("a", 1)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a", 2)


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match=r"unknown preset 'huge'.*qwen3.5-0.8b.*tiny"):
        BACKBONES.get("qwen3_5").build("huge")


@pytest.mark.slow
def test_import_is_light():
    code = "import sys, mmadapt; print(any(m.startswith(('timm', 'transformers.models.')) for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_wrong_mrope_section_is_refused():
    # head_dim 32 x partial 0.5 / 2 = 8 frequencies, but the section splits only 4
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}
    with pytest.raises(ValueError, match=r"mrope_section \[2, 1, 1\] sums to 4.*Fix mrope_section to sum to 8"):
        BACKBONES.get("qwen3_5").build("tiny", rope_parameters=rope)


def test_presets_match_published_sizes():
    """Real presets build configs (no weights) with the published widths."""
    config, tokens = BACKBONES.get("qwen3_5").build_config(BACKBONES.get("qwen3_5").options("qwen3.5-0.8b"))
    assert (config.hidden_size, config.num_hidden_layers, config.tie_word_embeddings) == (1024, 24, True)
    assert tokens.image_token_id == 248056
    options = mmadapt.ENCODERS.get("clip").options("vit-l-14-336")
    assert (options["image_size"], options["patch_size"], options["hidden_size"]) == (336, 14, 1024)


def test_register_a_backbone_in_a_few_lines(tmp_path):
    # --- the example of README.md and docs/extending.md (tests/test_docs.py runs them as written): 12 lines ---
    from mmadapt import BACKBONES, BackboneSpec

    BACKBONES.register("qwen3", BackboneSpec(
        name="qwen3", description="Qwen3 dense LLM",
        model_class="transformers:Qwen3ForCausalLM", config_class="transformers:Qwen3Config",
        hf_model_type="qwen3", chat_template="chatml", image_token="<|image_pad|>",
        presets={"tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, image_token_id=250)},
    ))
    # --- end of example ---
    try:
        from mmadapt.synthetic import synthetic_batch

        model = mmadapt.build_model("siglip", "mlp2x_gelu", "qwen3")
        batch = synthetic_batch(model, (1, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss) and model.projector.linear_1.weight.grad.abs().sum() > 0
        # ... and it receives pretrained weights with no code of its own (a Qwen3ForCausalLM directory)
        from transformers import Qwen3Config, Qwen3ForCausalLM

        options = {k: v for k, v in BACKBONES.get("qwen3").options("tiny").items() if k != "image_token_id"}
        reference = Qwen3ForCausalLM(Qwen3Config(**options))
        reference.save_pretrained(tmp_path)
        model = mmadapt.build_model("siglip", "mlp2x_gelu", {"name": "qwen3", "pretrained": str(tmp_path),
                                                            "options": {"image_token_id": 250}})
        assert all(torch.equal(v, reference.state_dict()[k]) for k, v in model.backbone.state_dict().items())
        assert torch.isfinite(model(**synthetic_batch(model, (1, 2))).loss)
    finally:
        BACKBONES.unregister("qwen3")
