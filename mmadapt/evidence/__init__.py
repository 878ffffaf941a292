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

from __future__ import annotations

from typing import TYPE_CHECKING

from mmadapt.lazy import lazy_names

if TYPE_CHECKING:
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

EXPORTS: dict[str, str] = {
    "render": "mmadapt.evidence.drawing",
    "Effect": "mmadapt.evidence.effect",
    "image_effect": "mmadapt.evidence.effect",
    "EvidenceReport": "mmadapt.evidence.explanation",
    "Explanation": "mmadapt.evidence.explanation",
    "SampleEvidence": "mmadapt.evidence.explanation",
    "explain": "mmadapt.evidence.explanation",
    "explain_records": "mmadapt.evidence.explanation",
    "MIN_EFFECT": "mmadapt.evidence.maps",
    "QUADRANTS": "mmadapt.evidence.maps",
    "RULES": "mmadapt.evidence.maps",
    "EvidenceMap": "mmadapt.evidence.maps",
    "completeness": "mmadapt.evidence.maps",
    "evidence": "mmadapt.evidence.maps",
    "geometry_for": "mmadapt.evidence.maps",
    "quadrant_shares": "mmadapt.evidence.maps",
    "token_maps": "mmadapt.evidence.maps",
    "CURVE_STEPS": "mmadapt.evidence.measure",
    "RANDOM_ORDERS": "mmadapt.evidence.measure",
    "Faithfulness": "mmadapt.evidence.measure",
    "faithfulness": "mmadapt.evidence.measure",
    "DEFAULT_METHOD": "mmadapt.evidence.methods",
    "DEFAULT_SAMPLES": "mmadapt.evidence.methods",
    "DEFAULT_STEPS": "mmadapt.evidence.methods",
    "GRADIENT_X_INPUT": "mmadapt.evidence.methods",
    "MASK_CELLS": "mmadapt.evidence.methods",
    "METHODS": "mmadapt.evidence.methods",
    "OCCLUSION_SIZES": "mmadapt.evidence.methods",
    "Integrated": "mmadapt.evidence.methods",
    "Method": "mmadapt.evidence.methods",
    "Occlusion": "mmadapt.evidence.methods",
    "Rise": "mmadapt.evidence.methods",
    "integrated_scores": "mmadapt.evidence.methods",
    "occlusion_blocks": "mmadapt.evidence.methods",
    "path_points": "mmadapt.evidence.methods",
    "random_masks": "mmadapt.evidence.methods",
    "Prompt": "mmadapt.evidence.prompt",
    "answer_log_probs": "mmadapt.evidence.prompt",
    "cell_index": "mmadapt.evidence.prompt",
    "masked_objectives": "mmadapt.evidence.prompt",
}
"""Each public name -> the module that defines it, imported when the name is first read (`mmadapt.lazy`)."""
__getattr__, __dir__ = lazy_names(__name__, EXPORTS)

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
