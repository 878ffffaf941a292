"""Evidence maps of models trained on the quadrant task (tests/quadrant_task.py), through the fixed-size encoders
(CLIP, SigLIP, timm) under a LLaMA backbone, and CLIP under a Qwen3.5 backbone (`TESTED_PAIRS`): the default map
finds the quadrant, and integrated gradients is the better token map. Qwen's ViTs are in
tests/test_evidence_qwen_encoders.py (the other xdist worker).
"""

from __future__ import annotations

import pytest
from quadrant_task import TESTED_PAIRS, check_default_map_finds_the_quadrant, corner_models_fixture, quadrant_report

from mmadapt.evidence import Integrated

PAIRS = [(encoder, backbone) for encoder, backbone in TESTED_PAIRS if encoder in ("clip", "siglip", "timm")]


@pytest.fixture(scope="module")
def corner_models(tmp_path_factory):
    return corner_models_fixture(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize(("encoder", "backbone"), PAIRS, ids=[f"{e}-{b}" for e, b in PAIRS])
def test_the_default_map_finds_the_quadrant_through_every_encoder_and_beats_random_deletion(corner_models, encoder,
                                                                                          backbone):
    """See `check_default_map_finds_the_quadrant` for the bounds and the spread they were set from."""
    check_default_map_finds_the_quadrant(corner_models, encoder, backbone)


@pytest.mark.slow
def test_plain_gradient_x_input_is_kept_but_integrated_gradients_is_the_better_token_map(corner_models):
    """steps=1 (one backward) is the plain method; on the same model and images it finds the corner far less
    reliably, which is why the token map integrates over the path from empty tokens (see docs/evidence.md)."""
    root, model, tokenizer, held_out, _ = corner_models("clip", "llama")
    plain = quadrant_report(model, tokenizer, root, held_out[:12], method=Integrated(steps=1), curve_steps=0)
    default = quadrant_report(model, tokenizer, root, held_out[:12], method=Integrated(), curve_steps=0)
    print(f"top-left share: plain gradient x input {plain['top_left']:.3f}, integrated {default['top_left']:.3f}")
    assert default["top_left"] > plain["top_left"] + 0.1
