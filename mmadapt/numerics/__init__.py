"""Numerics toolkit: find where NaN/Inf first appear in a model's forward or backward."""

from mmadapt.numerics.compare import Comparison, RowDiff, Tolerances, compare, packed_vs_padded, plot_comparison
from mmadapt.numerics.deepspeed import (
    Finding,
    deepspeed_config_for_run,
    format_findings,
    lint_deepspeed,
    safe_deepspeed_config,
)
from mmadapt.numerics.dump import Dump, dump, load_dump, normalize_name, tensor_summary
from mmadapt.numerics.tracer import (
    NonFiniteReport,
    NonFiniteTracer,
    find_nonfinite,
    normalize_module_name,
    tensor_stats,
)

__all__ = [
    "Comparison", "Dump", "Finding", "NonFiniteReport", "NonFiniteTracer", "RowDiff", "Tolerances", "compare",
    "deepspeed_config_for_run", "dump", "find_nonfinite", "format_findings", "lint_deepspeed", "load_dump",
    "normalize_module_name", "normalize_name", "packed_vs_padded", "plot_comparison", "safe_deepspeed_config",
    "tensor_stats", "tensor_summary",
]
