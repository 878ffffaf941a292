"""Numerics toolkit for any `torch.nn.Module` (a port that went NaN under bf16 ZeRO-2, packed rows
with an integer mask, two accelerators whose gradients parted: its regression tests).

- `NonFiniteTracer` / `find_nonfinite`: the first module whose output or gradient is NaN/Inf;
- `dump` / `load_dump`: per-layer forward statistics and gradient norms of one step, portable JSON (read back
  with a size cap, `MAX_DUMP_BYTES`);
- `compare`: two dumps side by side, naming the first divergent layer forward and backward;
- `packed_vs_padded`: per-sample logit parity of packed and padded batches;
- `lint_deepspeed` / `safe_deepspeed_config`: unsafe DeepSpeed precision settings, and safe configs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmadapt.lazy import lazy_names

if TYPE_CHECKING:
    from mmadapt.numerics.compare import Comparison, RowDiff, compare, packed_vs_padded, plot_comparison
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
    from mmadapt.numerics.tolerances import Tolerances
    from mmadapt.numerics.tracer import (
        NonFiniteReport,
        NonFiniteTracer,
        find_nonfinite,
        normalize_module_name,
        tensor_stats,
    )

EXPORTS: dict[str, str] = {
    "Comparison": "mmadapt.numerics.compare",
    "RowDiff": "mmadapt.numerics.compare",
    "Tolerances": "mmadapt.numerics.tolerances",
    "compare": "mmadapt.numerics.compare",
    "packed_vs_padded": "mmadapt.numerics.compare",
    "plot_comparison": "mmadapt.numerics.compare",
    "Finding": "mmadapt.numerics.deepspeed",
    "deepspeed_config_for_run": "mmadapt.numerics.deepspeed",
    "format_findings": "mmadapt.numerics.deepspeed",
    "lint_deepspeed": "mmadapt.numerics.deepspeed",
    "safe_deepspeed_config": "mmadapt.numerics.deepspeed",
    "MAX_DUMP_BYTES": "mmadapt.numerics.dump",
    "Dump": "mmadapt.numerics.dump",
    "DumpTooLargeError": "mmadapt.numerics.dump",
    "dump": "mmadapt.numerics.dump",
    "load_dump": "mmadapt.numerics.dump",
    "normalize_name": "mmadapt.numerics.dump",
    "tensor_summary": "mmadapt.numerics.dump",
    "NonFiniteReport": "mmadapt.numerics.tracer",
    "NonFiniteTracer": "mmadapt.numerics.tracer",
    "find_nonfinite": "mmadapt.numerics.tracer",
    "normalize_module_name": "mmadapt.numerics.tracer",
    "tensor_stats": "mmadapt.numerics.tracer",
}
"""Each public name -> the module that defines it, imported when the name is first read (`mmadapt.lazy`)."""
__getattr__, __dir__ = lazy_names(__name__, EXPORTS)

__all__ = [
    "MAX_DUMP_BYTES", "Comparison", "Dump", "DumpTooLargeError", "Finding", "NonFiniteReport", "NonFiniteTracer",
    "RowDiff", "Tolerances", "compare", "deepspeed_config_for_run", "dump", "find_nonfinite", "format_findings",
    "lint_deepspeed", "load_dump", "normalize_module_name", "normalize_name", "packed_vs_padded", "plot_comparison",
    "safe_deepspeed_config", "tensor_stats", "tensor_summary",
]
