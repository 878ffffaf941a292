"""Evidence maps: which parts of the image an answer rests on, and how far to trust the map (`mmadapt explain`).

    result = explain(model, processor, "cat.png", "What animal is this?", method=Occlusion(), out="cat.evidence.png")
    result.answer, result.quadrants, result.map.pixels      # (H, W) over the original image
    result.faithfulness.trusted                             # deletion / insertion beat every random order

Modules: `methods` (`Occlusion`, `Rise`, `Integrated`: how scores are made, one interface), `maps` (`evidence`,
`EvidenceMap`: scores -> a map per image over its token grid and its original pixels), `measure` (`faithfulness`,
`Faithfulness`: RISE's deletion / insertion against random orders), `drawing` (`render`: the PNG), `explanation`
(`explain` -> `Explanation`; `explain_records` for `mmadapt eval --evidence`), `effect` (`image_effect` -> `Effect`:
the answer and its log p with the image blanked or swapped; the page's evidence view), `prompt` (one prompt with its
answer and the forwards every method makes). How the methods work, how to read a map and what was measured:
docs/evidence.md.
"""

from mmadapt.evidence.drawing import render
from mmadapt.evidence.effect import Effect, image_effect
from mmadapt.evidence.explanation import EvidenceReport, Explanation, SampleEvidence, explain, explain_records
from mmadapt.evidence.maps import (
    MIN_EFFECT,
    QUADRANTS,
    RULES,
    EvidenceMap,
    completeness,
    evidence,
    geometry_for,
    quadrant_shares,
    token_maps,
)
from mmadapt.evidence.measure import CURVE_STEPS, RANDOM_ORDERS, Faithfulness, faithfulness
from mmadapt.evidence.methods import (
    DEFAULT_METHOD,
    DEFAULT_SAMPLES,
    DEFAULT_STEPS,
    GRADIENT_X_INPUT,
    MASK_CELLS,
    METHODS,
    OCCLUSION_SIZES,
    Integrated,
    Method,
    Occlusion,
    Rise,
    integrated_scores,
    occlusion_blocks,
    path_points,
    random_masks,
)
from mmadapt.evidence.prompt import Prompt, answer_log_probs, cell_index, masked_objectives

__all__ = [
    "CURVE_STEPS",
    "DEFAULT_METHOD",
    "DEFAULT_SAMPLES",
    "DEFAULT_STEPS",
    "GRADIENT_X_INPUT",
    "MASK_CELLS",
    "METHODS",
    "MIN_EFFECT",
    "OCCLUSION_SIZES",
    "QUADRANTS",
    "RANDOM_ORDERS",
    "RULES",
    "Effect",
    "EvidenceMap",
    "EvidenceReport",
    "Explanation",
    "Faithfulness",
    "Integrated",
    "Method",
    "Occlusion",
    "Prompt",
    "Rise",
    "SampleEvidence",
    "answer_log_probs",
    "cell_index",
    "completeness",
    "evidence",
    "explain",
    "explain_records",
    "faithfulness",
    "geometry_for",
    "image_effect",
    "integrated_scores",
    "masked_objectives",
    "occlusion_blocks",
    "path_points",
    "quadrant_shares",
    "random_masks",
    "render",
    "token_maps",
]
