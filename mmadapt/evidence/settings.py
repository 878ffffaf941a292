"""The evidence maps' settings and their defaults, declared once: each method's size, the faithfulness curves, the
rules (what `mmadapt explain`'s flags offer).

`methods`, `maps` and `measure` take their defaults from here; kept apart from them (they need torch) so that
`mmadapt explain --help` shows the defaults without loading torch.
"""

from __future__ import annotations

from typing import Final

DEFAULT_STEPS: Final[int] = 32  # integrated gradients: points on the path
DEFAULT_SAMPLES: Final[int] = 128  # rise: random masks (forwards of the whole model)
MASK_CELLS: Final[int] = 8  # occlusion and rise: at most 8 x 8 blocks of token cells per image
OCCLUSION_SIZES: Final[tuple[int, ...]] = (1, 2)  # occlusion: windows of 1 x 1 and 2 x 2 blocks
CURVE_STEPS: Final[int] = 8  # deletion / insertion: points on each curve
RANDOM_ORDERS: Final[int] = 8  # deletion / insertion: random orders the map's order is compared with
RULES: Final[tuple[str, ...]] = ("positive", "absolute")
