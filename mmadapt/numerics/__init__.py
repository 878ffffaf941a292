"""Numerics toolkit for any `torch.nn.Module` (a port that went NaN under bf16 ZeRO-2, packed rows
with an integer mask, two accelerators whose gradients parted: its regression tests).

- `NonFiniteTracer` / `find_nonfinite`: the first module whose output or gradient is NaN/Inf;
- `dump` / `load_dump`: per-layer forward statistics and gradient norms of one step, portable JSON (read back
  with a size cap, `MAX_DUMP_BYTES`);
- `compare`: two dumps side by side, naming the first divergent layer forward and backward;
- `packed_vs_padded`: per-sample logit parity of packed and padded batches;
- `lint_deepspeed` / `safe_deepspeed_config`: unsafe DeepSpeed precision settings, and safe configs.
"""

from mmadapt.numerics.compare import Comparison, RowDiff, Tolerances, compare, packed_vs_padded, plot_comparison
from mmadapt.numerics.deepspeed import (
    Finding,
    deepspeed_config_for_run,
    format_findings,
    lint_deepspeed,
    safe_deepspeed_config,
)
from mmadapt.numerics.dump import (
    MAX_DUMP_BYTES,
    Dump,
    DumpTooLargeError,
    dump,
    load_dump,
    normalize_name,
    tensor_summary,
)
from mmadapt.numerics.tracer import (
    NonFiniteReport,
    NonFiniteTracer,
    find_nonfinite,
    normalize_module_name,
    tensor_stats,
)

__all__ = [
    "MAX_DUMP_BYTES", "Comparison", "Dump", "DumpTooLargeError", "Finding", "NonFiniteReport", "NonFiniteTracer",
    "RowDiff", "Tolerances", "compare", "deepspeed_config_for_run", "dump", "find_nonfinite", "format_findings",
    "lint_deepspeed", "load_dump", "normalize_module_name", "normalize_name", "packed_vs_padded", "plot_comparison",
    "safe_deepspeed_config", "tensor_stats", "tensor_summary",
]
