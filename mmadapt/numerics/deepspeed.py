"""DeepSpeed config lint (unsafe bf16 precision, keys DeepSpeed does not read where written) and safe configs.

`lint_deepspeed(config)` takes a DeepSpeed JSON config (dict or path) and returns `Finding`s, each with
a severity ("error" or "warning"), the dotted key path, what is wrong and why, and the fix. It never
imports deepspeed: the schema knowledge is encoded here, from DeepSpeed's own readers
(deepspeedai/DeepSpeed, `deepspeed/runtime/`):

- `bf16` {enabled, immediate_grad_update, check_grad_overflow, bf16_master_weights_and_grads,
  bf16_optimizer_states}: `precision_config.get_bfloat16_config` -> `DeepSpeedBF16Config`. The legacy
  name `bfloat16` is read only when `bf16` is absent.
- `fp16` {enabled, auto_cast, loss_scale, initial_scale_power, loss_scale_window, hysteresis,
  consecutive_hysteresis, min_loss_scale, fp16_master_weights_and_grads}: `get_float16_config`.
- `communication_data_type` (top level): `config.get_communication_data_type`. When unset,
  `engine.communication_data_type` falls back to the model dtype: bf16 gradients are all-reduced /
  reduce-scattered in bf16 (8 mantissa bits).
- `data_types.grad_accum_dtype`: `config.get_data_types_params` in `DeepSpeedConfig.__init__`. When
  unset, `engine.get_data_types` uses the model dtype; ZeRO's optimizers (`zero/stage_1_and_2.py`,
  `zero/stage3.py`) keep a separate fp32 accumulation buffer only when it differs from bf16.
- `zero_optimization` {stage, overlap_comm, reduce_bucket_size, ...}: `zero/config.DeepSpeedZeroConfig`.
- `gradient_clipping`, `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`, ...: top level.

Sections parsed by pydantic models (`config_utils.DeepSpeedConfigModel`: `bf16`, `fp16`,
`zero_optimization`) forbid unknown keys, so a misplaced key there stops DeepSpeed at start-up, and they
drop "auto" values, which only transformers' Trainer / Accelerate integration fills in. Top-level keys
and `data_types` are read one by one with `dict.get`, so a misplaced key there is silently ignored: a
top-level `grad_accum_dtype` does nothing (the setting that, placed right, stopped a Qwen3.5 port's bf16 ZeRO-2 run
from going NaN in its last decoder layers).

`safe_deepspeed_config(stage)` / `deepspeed_config_for_run(run, stage)` write ZeRO-2/3 configs with
fp32 gradient reduction and accumulation and bf16 overflow checks; they lint clean.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Severity = Literal["error", "warning"]

# Where DeepSpeed reads each key it knows, as a dotted path (see the module docstring for the readers).
READ_AT: dict[str, str] = {
    **{k: k for k in ("communication_data_type", "seq_parallel_communication_data_type", "gradient_clipping",
                      "prescale_gradients", "gradient_predivide_factor", "train_batch_size",
                      "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")},
    "grad_accum_dtype": "data_types.grad_accum_dtype",
    **{k: f"bf16.{k}" for k in ("check_grad_overflow", "immediate_grad_update", "bf16_master_weights_and_grads",
                                "bf16_optimizer_states")},
    **{k: f"fp16.{k}" for k in ("auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                                "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")},
    **{k: f"zero_optimization.{k}" for k in (
        "stage", "overlap_comm", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
        "allgather_partitions", "allgather_bucket_size", "round_robin_gradients", "offload_optimizer",
        "offload_param", "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save")},
}
PYDANTIC_SECTIONS = frozenset({"bf16", "bfloat16", "fp16", "zero_optimization"})  # extra="forbid", drop "auto"
SCANNED_SECTIONS = (*sorted(PYDANTIC_SECTIONS), "data_types")
DTYPES = ("fp32", "bf16", "fp16")
LEGACY_SECTIONS = {"bf16": "bfloat16"}  # a section's older name, read when the current one is absent


@dataclass(frozen=True)
class Finding:
    severity: Severity
    key: str  # dotted path in the config, e.g. "bf16.check_grad_overflow"
    message: str  # what is wrong and what it does to training
    fix: str

    def __str__(self) -> str:
        return f"{self.severity.upper():<7} {self.key}: {self.message}\n        fix: {self.fix}"


def lint_deepspeed(config: Mapping[str, Any] | str | os.PathLike) -> list[Finding]:
    """Findings for a DeepSpeed config (a dict or a JSON file), errors first."""
    cfg = _load(config)
    findings = [*_misplaced_keys(cfg), *_precision_modes(cfg)]
    if _bf16_may_be_on(cfg):
        findings += _bf16_reduction(cfg)
    return sorted(findings, key=lambda f: f.severity != "error")


def format_findings(findings: list[Finding], source: str = "config") -> str:
    errors = sum(f.severity == "error" for f in findings)
    lines = [str(f) for f in findings]
    lines.append(f"{source}: {errors} error(s), {len(findings) - errors} warning(s)" if findings else
                 f"{source}: no findings (bf16 reduction and accumulation in fp32, keys where DeepSpeed reads them)")
    return "\n".join(lines)


# ---- checks --------------------------------------------------------------------------------------
def _misplaced_keys(cfg: Mapping[str, Any]) -> list[Finding]:
    found = [(key, key) for key in cfg]
    for section in SCANNED_SECTIONS:
        if isinstance(cfg.get(section), Mapping):
            found += [(f"{section}.{key}", key) for key in cfg[section]]
    findings = []
    for path, key in found:
        expected = READ_AT.get(key)
        if expected is None or path == expected or path == expected.replace("bf16.", "bfloat16.", 1):
            continue
        findings.append(Finding("error", path, f"DeepSpeed reads `{key}` at `{expected}`, not here; "
                                f"{_consequence(path)}", f"move it: {_snippet(expected, _value_at(cfg, path))}"))
    return findings


def _consequence(path: str) -> str:
    section = path.partition(".")[0] if "." in path else None
    if section in PYDANTIC_SECTIONS:
        return (f"`{section}` is a pydantic model that forbids unknown keys, so DeepSpeed refuses to start "
                "(releases before the pydantic configs ignored the key)")
    return "DeepSpeed ignores keys it does not look for, so this setting silently has no effect"


def _precision_modes(cfg: Mapping[str, Any]) -> list[Finding]:
    findings = []
    if "bf16" in cfg and "bfloat16" in cfg:
        findings.append(Finding("warning", "bfloat16", "both `bf16` and its legacy name `bfloat16` are present; "
                                "DeepSpeed reads only `bf16` and ignores `bfloat16`", "delete the `bfloat16` section"))
    modes = {name: _enabled(cfg, name) for name in ("bf16", "fp16")}
    for name, value in modes.items():
        if value not in (True, False, "auto"):
            findings.append(Finding("error", f"{name}.enabled", f"must be true, false or \"auto\", got {value!r}",
                                    f'"{name}": {{"enabled": true}} (or false)'))
    if modes["bf16"] is True and modes["fp16"] is True:
        findings.append(Finding("error", "fp16.enabled", "fp16 and bf16 are both enabled; DeepSpeed refuses the "
                                "combination (an assertion in DeepSpeedConfig)",
                                'keep bf16 and set "fp16": {"enabled": false}'))
    auto = [f"{name}.enabled" for name, value in modes.items() if value == "auto"]
    if auto:
        findings.append(Finding("warning", auto[0], f"{' and '.join(auto)} = \"auto\": the precision is decided "
                                "outside this file (transformers' Trainer fills \"auto\" from --bf16/--fp16; plain "
                                "deepspeed.initialize drops \"auto\" and leaves the section disabled). This lint "
                                "assumes bf16 may be on", 'write the mode you train with: "bf16": {"enabled": true}, '
                                '"fp16": {"enabled": false}'))
    return findings


def _bf16_reduction(cfg: Mapping[str, Any]) -> list[Finding]:
    """bf16 is (or may be) on: gradients must be reduced and accumulated in fp32, and overflows must be caught."""
    findings = []
    comm = cfg.get("communication_data_type")
    if not _is_dtype(comm, "fp32"):
        what = ("unset, so DeepSpeed reduces gradients in the model dtype, bf16" if comm is None else
                f"{comm!r}: gradients are reduced in that dtype" if _is_dtype(comm, *DTYPES) else
                f"{comm!r} is not one of {DTYPES}: DeepSpeed raises ValueError at start-up")
        findings.append(Finding("error", "communication_data_type", f"{what}. Summing many ranks' bf16 gradients "
                                "(8 mantissa bits) loses small contributions and can overflow to inf/NaN: the NaNs "
                                "of a Qwen3.5 port under ZeRO-2 + bf16",
                                '"communication_data_type": "fp32" at the top level'))
    types = cfg.get("data_types")
    accum = types.get("grad_accum_dtype") if isinstance(types, Mapping) else None
    if not _is_dtype(accum, "fp32"):
        what = ("unset, so gradients are accumulated in the model dtype, bf16" if accum is None else
                f"{accum!r}: gradients are accumulated in that dtype" if _is_dtype(accum, *DTYPES) else
                f"{accum!r} is not one of {DTYPES}: DeepSpeed rejects it at start-up")
        ignored = " (the top-level `grad_accum_dtype` is not read)" if "grad_accum_dtype" in cfg else ""
        findings.append(Finding("error", "data_types.grad_accum_dtype", f"{what}{ignored}. Adding micro-batch "
                                "gradients into a bf16 buffer drops the low bits of every addition",
                                '"data_types": {"grad_accum_dtype": "fp32"}'))
    section = cfg.get("bf16") if "bf16" in cfg else cfg.get("bfloat16")
    if not (isinstance(section, Mapping) and section.get("check_grad_overflow") is True):
        findings.append(Finding("warning", "bf16.check_grad_overflow", "not enabled: a step whose gradients "
                                "overflowed to inf/NaN is applied to the weights instead of skipped, and the NaN "
                                "spreads through the model", '"bf16": {"enabled": true, "check_grad_overflow": true} '
                                "(a DeepSpeed release whose DeepSpeedBF16Config has this field)"))
    return findings


# ---- helpers -------------------------------------------------------------------------------------
def _enabled(cfg: Mapping[str, Any], name: str) -> Any:
    section = cfg.get(name) if name in cfg else cfg.get(LEGACY_SECTIONS.get(name, name))
    return section.get("enabled", False) if isinstance(section, Mapping) else False


def _bf16_may_be_on(cfg: Mapping[str, Any]) -> bool:
    return _enabled(cfg, "bf16") in (True, "auto")


def _is_dtype(value: Any, *names: str) -> bool:
    return isinstance(value, str) and value.lower() in names


def _value_at(cfg: Mapping[str, Any], path: str) -> Any:
    value: Any = cfg
    for part in path.split("."):
        value = value[part]
    return value


def _snippet(path: str, value: Any) -> str:
    *sections, key = path.split(".")
    text = f"{json.dumps(key)}: {json.dumps(value)}"
    for section in reversed(sections):
        text = f"{json.dumps(section)}: {{{text}}}"
    return text


def _load(config: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    try:
        with open(config) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read DeepSpeed config {os.fspath(config)}: {e.strerror}. "
                         "Fix: check the path.") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config {os.fspath(config)} is not valid JSON: {e}. Fix: DeepSpeed configs are "
                         "plain JSON (no comments, no trailing commas).") from None
    if not isinstance(data, dict):
        raise ValueError(f"DeepSpeed config {os.fspath(config)} holds a JSON {type(data).__name__}, not an object")
    return data


# ---- safe configs --------------------------------------------------------------------------------
def safe_deepspeed_config(stage: int, *, micro_batch: int | str = "auto", grad_accum: int | str = "auto",
                          gradient_clipping: float | None = 1.0, bf16: bool = True) -> dict[str, Any]:
    """A ZeRO-2 or ZeRO-3 config: bf16 compute, fp32 gradient reduction and accumulation, overflow checks.

    `micro_batch` / `grad_accum` "auto" suit transformers' Trainer; pass numbers for `deepspeed.initialize`.
    """
    if stage not in (2, 3):
        raise ValueError(f"stage must be 2 or 3, got {stage!r}. Fix: --stage 2 (gradients and optimizer state "
                         "sharded) or --stage 3 (parameters sharded too).")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "bf16": {"enabled": True, "check_grad_overflow": True} if bf16 else {"enabled": False},
        "fp16": {"enabled": False},
        "communication_data_type": "fp32",  # read at top level (runtime/config.py)
        "data_types": {"grad_accum_dtype": "fp32"},  # read under data_types (runtime/config.py)
        "zero_optimization": _zero_section(stage),
    }
    if gradient_clipping is not None:
        config["gradient_clipping"] = gradient_clipping
    return config


def deepspeed_config_for_run(run: Any, stage: int) -> dict[str, Any]:
    """`safe_deepspeed_config` with a `RunConfig`'s micro-batch, accumulation, clipping and precision policy."""
    import torch

    return safe_deepspeed_config(stage, micro_batch=run.data.batch_size, grad_accum=run.train.grad_accum,
                                 gradient_clipping=run.train.clip_grad_norm,
                                 bf16=run.precision.mode.compute_dtype is torch.bfloat16)


def _zero_section(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": 500_000_000}
    if stage == 2:
        return {**zero, "reduce_scatter": True, "allgather_partitions": True, "allgather_bucket_size": 500_000_000}
    return {**zero, "sub_group_size": 1_000_000_000, "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_param_persistence_threshold": 100_000, "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000, "stage3_gather_16bit_weights_on_model_save": True}
