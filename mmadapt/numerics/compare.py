"""Compare two numerics dumps; name the first layer, in forward and in backward order, where they part.

`compare(a, b)` matches rows by normalised name (see `mmadapt.numerics.dump`) and computes, per row,
the relative difference of one statistic, `|x_a - x_b| / max(|x_a|, |x_b|, floor * median)`, where
`median` is the median of that statistic over the direction's matched rows:

    direction  rows                                    statistic      default tolerance
    forward    module outputs, in execution order      L2 norm        FORWARD_RTOL  = 0.02
    backward   parameter gradients, output side first  grad L2 norm   BACKWARD_RTOL = 0.15
    both       noise floor, fraction of the median     -              NOISE_FLOOR   = 0.1

A row also diverges (relative difference inf) when its NaN or Inf counts, or its shape, differ.
The first divergent row in each direction is the first one, in that direction's order (taken from `a`),
whose relative difference exceeds the tolerance. Forward order is the order module calls finished;
backward order is the order gradients became final, so the first backward divergence is the layer
closest to the loss where the two runs' gradients part (a Qwen3-VL-8B run on two accelerators: loss and last-layer
gradients within 1%, first-layer gradient norms 50-100% apart).

How the defaults were chosen: fp32 against bf16 autocast (CPU) dumps of the tiny Qwen3.5 VLM
(`qwen3_5_vit` + `qwen_merger` + `qwen3_5`) and the tiny CLIP + LLaMA model, 30 random models and
batches each. Largest forward difference: 0.0011 (Qwen3.5), 0.0014 (LLaMA); largest gradient
difference: 0.061 (Qwen3.5, a vision LayerNorm bias), 0.0055 (LLaMA). Without the floor, gradients
that are tiny or zero in exact arithmetic (Gated DeltaNet `dt_bias`/`A_log`, CLIP's key bias, whose
gradient is mathematically 0) reach 0.4-1.0 from rounding alone; the floor measures them against 10%
of a typical row instead. The defaults leave >10x (forward) and 2.5x (backward) headroom over bf16
rounding, while a gradient scaled by 1.5 (0.33) or the 50-100% first-layer differences of two
accelerators are far above.
Pass `rtol` (one float for both directions, or `Tolerances`) for other pairs: fp32 vs fp32 on two
accelerators can use 1e-3.

Rows present in only one dump are listed (`only_a`, `only_b`); PEFT adapter rows (`lora_A`, ...) on
one side only are listed apart (`adapters_only`) and never compared.

`packed_vs_padded` is the packing parity check (an integer mask used as an index is caught by it):
the same samples padded (one per row) and packed (several per row) must give the same per-sample logits.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from mmadapt.numerics.dump import Dump, is_adapter_name, load_dump
from mmadapt.numerics.tolerances import BACKWARD_RTOL as BACKWARD_RTOL  # the defaults' home: tolerances.py
from mmadapt.numerics.tolerances import FORWARD_RTOL as FORWARD_RTOL
from mmadapt.numerics.tolerances import NOISE_FLOOR as NOISE_FLOOR
from mmadapt.numerics.tolerances import Tolerances


@dataclass(frozen=True)
class RowDiff:
    """One matched row: its statistic on both sides and their relative difference."""

    name: str
    a: float | None
    b: float | None
    rel: float  # inf when NaN/Inf counts or shapes differ
    diverged: bool
    reason: str = ""  # "" | "rel diff" | "nan/inf counts" | "shape"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rel": self.rel if math.isfinite(self.rel) else None}


@dataclass
class Comparison:
    tolerances: Tolerances
    forward: list[RowDiff]  # forward order
    backward: list[RowDiff]  # backward order, output side first
    only_a: list[str] = field(default_factory=list)  # "forward:name" / "grad:name"
    only_b: list[str] = field(default_factory=list)
    adapters_only: list[str] = field(default_factory=list)
    labels: tuple[str, str] = ("A", "B")
    meta: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    notes: list[str] = field(default_factory=list)

    @property
    def first_forward(self) -> str | None:
        return next((r.name for r in self.forward if r.diverged), None)

    @property
    def first_backward(self) -> str | None:
        return next((r.name for r in self.backward if r.diverged), None)

    @property
    def ok(self) -> bool:
        """No divergence in either direction and no one-sided rows."""
        return self.first_forward is None and self.first_backward is None and not (self.only_a or self.only_b)

    def to_dict(self) -> dict[str, Any]:
        return {"first_forward": self.first_forward, "first_backward": self.first_backward,
                "tolerances": asdict(self.tolerances), "labels": list(self.labels),
                "forward": [r.to_dict() for r in self.forward], "backward": [r.to_dict() for r in self.backward],
                "only_a": self.only_a, "only_b": self.only_b, "adapters_only": self.adapters_only,
                "notes": self.notes, "meta": {"a": self.meta[0], "b": self.meta[1]}}

    def save_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    def format(self) -> str:
        """Both tables, the tolerance table, one-sided rows and the verdict."""
        a, b = self.labels
        lines = [f"A = {a} ({_describe(self.meta[0])})", f"B = {b} ({_describe(self.meta[1])})",
                 *self.tolerances.table(), ""]
        lines += _table("forward (execution order)", "output norm", self.forward, self.tolerances.forward)
        lines += _table("backward (output side first)", "grad norm", self.backward, self.tolerances.backward)
        for side, names in ((a, self.only_a), (b, self.only_b)):
            if names:
                lines.append(f"only in {side} ({len(names)}): {', '.join(names)}")
        if self.adapters_only:
            lines.append(f"adapter rows on one side only, not compared ({len(self.adapters_only)})")
        lines += self.notes
        lines.append(f"first forward divergence:  {self.first_forward or 'none'}")
        lines.append(f"first backward divergence: {self.first_backward or 'none'}")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike) -> None:
        """PNG: relative difference per row in both directions, log scale, tolerance lines, first divergences."""
        plot_comparison(self, path)


def compare(a: Dump | Mapping[str, Any] | str | os.PathLike, b: Dump | Mapping[str, Any] | str | os.PathLike,
            rtol: float | Tolerances | None = None) -> Comparison:
    """Compare two dumps (objects, dicts or paths); see the module docstring for the rules."""
    tol = Tolerances.of(rtol)
    da, db = load_dump(a), load_dump(b)
    forward, fa, fb = _match(da.forward, db.forward, "norm", tol.forward, tol.floor)
    backward, ga, gb = _match(da.grads, db.grads, "norm", tol.backward, tol.floor)
    only_a = [f"forward:{n}" for n in fa] + [f"grad:{n}" for n in ga]
    only_b = [f"forward:{n}" for n in fb] + [f"grad:{n}" for n in gb]
    adapters = [n for n in only_a + only_b if is_adapter_name(n.partition(":")[2])]
    only_a = [n for n in only_a if n not in adapters]
    only_b = [n for n in only_b if n not in adapters]
    notes = []
    if "parameter" in (da.grad_order, db.grad_order):
        notes.append("note: a dump without backward order: gradient rows are in parameter order")
    labels = (_label(a, da, "A"), _label(b, db, "B"))
    return Comparison(tol, forward, backward, only_a, only_b, adapters, labels, (da.meta, db.meta), notes)


def _match(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], stat: str, tol: float,
           floor: float) -> tuple[list[RowDiff], list[str], list[str]]:
    """Rows of `a` in order, matched to `b` by name; plus the names only in `a` and only in `b`."""
    by_name = {r["name"]: r for r in rows_b}
    names_a = {r["name"] for r in rows_a}
    pairs = [(r, by_name[r["name"]]) for r in rows_a if r["name"] in by_name]
    scales = [max(abs(x[stat]), abs(y[stat])) for x, y in pairs if x[stat] is not None and y[stat] is not None]
    least = floor * statistics.median(scales) if scales else 0.0
    diffs = [_diff(x, y, stat, tol, least) for x, y in pairs]
    only_a = [r["name"] for r in rows_a if r["name"] not in by_name]
    only_b = [r["name"] for r in rows_b if r["name"] not in names_a]
    return diffs, only_a, only_b


def _diff(ra: dict[str, Any], rb: dict[str, Any], stat: str, tol: float, least: float) -> RowDiff:
    x, y = ra.get(stat), rb.get(stat)
    if (ra["nan"], ra["inf"]) != (rb["nan"], rb["inf"]):
        return RowDiff(ra["name"], x, y, math.inf, True, "nan/inf counts")
    if list(ra["shape"]) != list(rb["shape"]):
        return RowDiff(ra["name"], x, y, math.inf, True, "shape")
    rel = relative_difference(x, y, least)
    return RowDiff(ra["name"], x, y, rel, rel > tol, "rel diff" if rel > tol else "")


def relative_difference(x: float | None, y: float | None, least: float = 0.0) -> float:
    """|x - y| / max(|x|, |y|, least); 0 when both are 0 (or both None), inf when only one side has a value.

    `least` keeps rows far smaller than the rest (bias and gate vectors whose gradients mostly cancel, or
    are zero in exact arithmetic) from turning rounding noise into large relative differences.
    """
    if x is None or y is None:
        return 0.0 if x is y else math.inf
    scale = max(abs(x), abs(y), least)
    return abs(x - y) / scale if scale > 0 else 0.0


def _label(source: Any, dump: Dump, default: str) -> str:
    if isinstance(source, str | os.PathLike):
        return os.path.basename(os.fspath(source))
    return dump.meta.get("hostname", default)


def _describe(meta: Mapping[str, Any]) -> str:
    keys = ("hostname", "device_name", "param_dtypes", "autocast", "torch", "seed", "loss")
    return ", ".join(f"{k}={meta[k]}" for k in keys if meta.get(k) not in (None, [], ""))


def _table(title: str, stat: str, rows: Sequence[RowDiff], tol: float) -> list[str]:
    if not rows:
        return [f"{title}: no matched rows", ""]
    width = max(len(r.name) for r in rows)
    lines = [f"{title}, tolerance {tol:g}:", f"  {'#':>4}  {'name':<{width}}  {stat + ' A':>12}  {stat + ' B':>12}  "
             f"{'rel diff':>9}"]
    for i, r in enumerate(rows):
        mark = f"  <- {r.reason}" if r.diverged else ""
        lines.append(f"  {i:>4}  {r.name:<{width}}  {_num(r.a):>12}  {_num(r.b):>12}  {_num(r.rel):>9}{mark}")
    return [*lines, ""]


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def plot_comparison(comparison: Comparison, path: str | os.PathLike) -> None:
    """Write a PNG (matplotlib's Agg canvas, no pyplot state) of both directions' relative differences."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    panels = (("forward: module output norm (execution order)", comparison.forward, comparison.tolerances.forward,
               comparison.first_forward),
              ("backward: parameter gradient norm (output side first)", comparison.backward,
               comparison.tolerances.backward, comparison.first_backward))
    for ax, (title, rows, tol, first) in zip(fig.subplots(2, 1), panels, strict=True):
        _panel(ax, title, rows, tol, first)
    fig.suptitle(f"{comparison.labels[0]} vs {comparison.labels[1]}")
    fig.savefig(path, dpi=110)


def _panel(ax: Any, title: str, rows: Sequence[RowDiff], tol: float, first: str | None) -> None:
    floor = 1e-9
    finite = [r.rel for r in rows if math.isfinite(r.rel)]
    top = max([*finite, tol, floor]) * 10
    values = [top if not math.isfinite(r.rel) else max(r.rel, floor) for r in rows]
    ax.semilogy(range(len(rows)), values, ".-", lw=0.8, ms=3, label="relative difference")
    bad = [i for i, r in enumerate(rows) if not math.isfinite(r.rel)]
    if bad:
        ax.semilogy(bad, [top] * len(bad), "x", color="red", label="NaN/Inf count or shape differs")
    ax.axhline(tol, color="orange", ls="--", label=f"tolerance {tol:g}")
    if first is not None:
        at = next(i for i, r in enumerate(rows) if r.name == first)
        ax.axvline(at, color="red", lw=0.8)
        ax.annotate(f"first: {first}", (at, tol), xytext=(4, 4), textcoords="offset points", fontsize=8, color="red")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("row")
    ax.set_ylabel(f"rel diff (0 drawn at {floor:g})")
    ax.legend(fontsize=8, loc="lower right")


# ---- packing parity -------------------------------------------------------------------------------
def packed_vs_padded(model: nn.Module, samples: Sequence[Any], pad_token_id: int = 0, *,
                     max_tokens: int | None = None) -> dict[str, float]:
    """Max |logit difference| per sample id between a padded batch and a packed batch of the same samples.

    `samples` are `EncodedSample`s; `max_tokens` (default: all samples in one row) is the packing budget.
    In fp32 a correct model gives <= 1e-5; anything large means packed samples see each other or get
    wrong embeddings/positions (e.g. an integer mask used as an index).
    """
    from mmadapt.data import Collator

    if not samples:
        raise ValueError("packed_vs_padded needs at least one sample")
    budget = max_tokens if max_tokens is not None else sum(len(s) for s in samples)
    with torch.no_grad():
        padded = _per_sample_logits(model, Collator.for_model(model, pad_token_id)(list(samples)))
        packed = _per_sample_logits(model, Collator.for_model(model, pad_token_id, max_tokens=budget)(list(samples)))
    return {sid: float((packed[sid].float() - logits.float()).abs().max()) for sid, logits in padded.items()}


def _per_sample_logits(model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """{sample id: logits over its own tokens}; packed rows are cut at `cu_seqlens`."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits  # logits also in training mode
    width = batch["input_ids"].shape[1]
    bounds = batch["cu_seqlens"].tolist() if "cu_seqlens" in batch else None
    out = {}
    for row, ids in enumerate(batch["meta"]["sample_ids"]):
        if bounds is None:
            lengths = [int(batch["attention_mask"][row].sum())]
        else:
            lengths = [end - start for start, end in itertools.pairwise(bounds)
                       if row * width <= start < (row + 1) * width][: len(ids)]
        at = 0
        for sample_id, n in zip(ids, lengths, strict=True):
            out[sample_id] = logits[row, at : at + n]
            at += n
    return out
