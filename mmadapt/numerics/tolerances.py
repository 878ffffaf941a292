"""`Tolerances` of a dump comparison (`compare`) and their defaults: forward output norms, backward gradient norms,
the noise floor (`compare`'s docstring says how each is measured).

Declared apart from the comparison so that `mmadapt numerics compare --help` shows the defaults without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD_RTOL = 0.02
BACKWARD_RTOL = 0.15
NOISE_FLOOR = 0.1


@dataclass(frozen=True, kw_only=True)
class Tolerances:
    """Relative-difference tolerances: forward output norms, backward gradient norms."""

    forward: float = FORWARD_RTOL
    backward: float = BACKWARD_RTOL
    floor: float = NOISE_FLOOR  # fraction of the median row's statistic; see `relative_difference`

    def __post_init__(self) -> None:
        if not (self.forward > 0 and self.backward > 0 and self.floor >= 0):
            raise ValueError(f"tolerances must be > 0 (floor >= 0), got forward={self.forward}, "
                             f"backward={self.backward}, floor={self.floor}")

    @classmethod
    def of(cls, rtol: float | Tolerances | None) -> Tolerances:
        if rtol is None:
            return cls()
        if isinstance(rtol, Tolerances):
            return rtol
        return cls(forward=float(rtol), backward=float(rtol))

    def table(self) -> list[str]:
        return ["tolerances (rel diff = |A-B| / max(|A|, |B|, floor x median row); a NaN/Inf count or shape "
                "change is inf):",
                f"  forward   module output L2 norm    rel diff > {self.forward:g}",
                f"  backward  parameter grad L2 norm   rel diff > {self.backward:g}",
                f"  floor     {self.floor:g} x the median row's norm (per direction)"]
