"""Numerics toolkit: find where NaN/Inf first appear in a model's forward or backward."""

from mmadapt.numerics.tracer import (
    NonFiniteReport,
    NonFiniteTracer,
    find_nonfinite,
    normalize_module_name,
    tensor_stats,
)

__all__ = ["NonFiniteReport", "NonFiniteTracer", "find_nonfinite", "normalize_module_name", "tensor_stats"]
