"""Evidence maps of models trained on the quadrant task (tests/quadrant_task.py), through Qwen's ViTs (qwen3_5_vit,
qwen3_vl_vit: dynamic resolution, 2 x 2 merge windows) under a LLaMA backbone (`TESTED_PAIRS`): the default map
finds the quadrant. The fixed-size encoders are in tests/test_evidence_fixed_encoders.py (the other xdist worker).
"""

from __future__ import annotations

import pytest
from quadrant_task import TESTED_PAIRS, check_default_map_finds_the_quadrant, corner_models_fixture

PAIRS = [(encoder, backbone) for encoder, backbone in TESTED_PAIRS if encoder in ("qwen3_5_vit", "qwen3_vl_vit")]


@pytest.fixture(scope="module")
def corner_models(tmp_path_factory):
    return corner_models_fixture(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize(("encoder", "backbone"), PAIRS, ids=[f"{e}-{b}" for e, b in PAIRS])
def test_the_default_map_finds_the_quadrant_through_every_encoder_and_beats_random_deletion(corner_models, encoder,
                                                                                          backbone):
    """See `check_default_map_finds_the_quadrant` for the bounds and the spread they were set from."""
    check_default_map_finds_the_quadrant(corner_models, encoder, backbone)
