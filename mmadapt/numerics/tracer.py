"""Non-finite tracer: name the first module whose forward output or backward gradient holds NaN/Inf.

Works on any `torch.nn.Module` in eager mode. Inside `with NonFiniteTracer(model) as tracer:` every
module gets forward hooks and its parameters gradient hooks; nothing is registered outside the `with`
block, and every hook (also the per-tensor gradient hooks) is removed on exit, even when the body raises.

Contract, forward: after each module call, the floating tensors of its output (tensors, or nested in
tuples, lists, dicts, `ModelOutput`s and dataclasses) are checked. The first module, in the order
calls *finish*, whose output holds a NaN/Inf is reported. Children finish before their parents, so
the report names the innermost module that produced the values. A tensor is checked once per version
and attributed to the first (innermost) module that returned it: a parent returning its child's
tensor is not reported again. The report carries statistics of the module's inputs; finite inputs
(and finite parameters) mean the non-finite values were produced inside the module, non-finite inputs
mean they came from code outside any submodule (an enclosing module's forward, or the model inputs).

Contract, backward: a gradient hook is put on each module output that requires grad. The first module,
in the order the autograd engine delivers gradients (output side first), whose forward output receives
a gradient holding a NaN/Inf is reported; that is the module closest to the loss where non-finite
gradients appear. The culprit is then one of that output's consumers: the report lists the modules
that took the tensor as an input (`consumers`, in the order they finished forward, so innermost
first). Their own output gradients were finite (else they would have been reported first), so the
non-finite gradient was produced inside the backward of one of them, or by a functional op between
modules when the list is empty (for the last output, e.g. the logits, that includes the loss).
Parameter gradients are checked too, as they arrive (before accumulation into `.grad`), and reported
with `where="parameter <name>"` and `call=None` under the module that owns the parameter.
Module inputs are never wrapped (no full backward hooks): modules may return tuples, dicts or
`ModelOutput`s and be followed by in-place ops, and results, loss and gradients, stay bitwise equal.

Names are `named_modules()` names with wrapper components removed so they match a plain model:
a leading `module.` (DDP/DataParallel) or `base_model.model.` (PEFT), and `_orig_mod`,
`_fsdp_wrapped_module`, `_checkpoint_wrapped_module` anywhere (see `normalize_module_name`; a plain
model whose root child is really called `module` loses that prefix too).

Cost: none when not enabled (no hooks exist). Enabled: per module call, a pre- and a post-forward
Python hook that walk inputs and outputs, and one `isfinite(t).all()` per new floating output tensor,
stacked into one host sync per call; per gradient reaching a module output or a parameter, one
`isfinite(g).all()` and one sync. Statistics are computed only once something is found. With
`stop_at_first` (default) a phase stops checking after its first finding. Activation checkpointing
works (recomputed forwards are hooked again and count as calls). Under `torch.compile`, trace the
uncompiled module: hooks inside compiled regions may not fire.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

logger = logging.getLogger(__name__)

WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
LEADING_WRAPPERS = (("module",), ("base_model", "model"))
_MAX_DEPTH = 8  # how deep outputs/inputs are searched for tensors (containers nest a few levels at most)


def normalize_module_name(name: str) -> str:
    """`named_modules()` name as in the unwrapped model: `module._orig_mod.layers.0` -> `layers.0`."""
    parts = [p for p in name.split(".") if p and p not in WRAPPER_COMPONENTS]
    stripped = True
    while stripped:
        stripped = False
        for prefix in LEADING_WRAPPERS:
            if tuple(parts[: len(prefix)]) == prefix:
                parts, stripped = parts[len(prefix):], True
    return ".".join(parts)


@dataclass(frozen=True)
class NonFiniteReport:
    """One non-finite finding. `input_stats`: forward, one dict per floating input tensor; backward, one
    dict for the incoming gradient. Statistics (min, max, mean_abs, norm) are over finite entries only."""

    phase: str  # "forward" | "backward"
    module: str  # normalised qualified name; "" is the root module
    module_type: str
    call: int | None  # 0-based: which call of this module (in the trace) produced the output; None for parameters
    where: str  # which tensor: "output", "output[0]", "output['logits']", "output.features", "parameter weight"
    shape: tuple[int, ...]
    dtype: str
    nonfinite: int
    nan: int
    total: int
    input_stats: list[dict[str, Any]]
    nonfinite_params: list[str] = field(default_factory=list)  # forward: the module's own params/buffers
    consumers: list[str] = field(default_factory=list)  # backward: modules that took the tensor as input

    @property
    def inputs_finite(self) -> bool:
        """Forward: every input was finite when the call started (in-place modified inputs count as finite
        when they were checked finite as an earlier module's output)."""
        return all(s["nonfinite"] == 0 or s.get("finite_before_call", False) for s in self.input_stats)

    def __str__(self) -> str:
        name = f"{self.module or '<root>'} ({self.module_type})" + ("" if self.call is None else f", call {self.call}")
        counts = (f"{self.shape} {self.dtype}: {self.nonfinite} of {self.total} values non-finite "
                  f"({self.nan} NaN, {self.nonfinite - self.nan} Inf)")
        if self.phase == "forward":
            inputs = "; ".join(_format_stats(s) for s in self.input_stats) or "none"
            text = f"first non-finite forward output: {name}, {self.where} {counts}. "
            if self.nonfinite_params:
                text += f"Non-finite parameters/buffers: {', '.join(self.nonfinite_params)}. "
            if self.inputs_finite:
                return text + f"Inputs finite: {inputs}. The values were produced inside this module."
            return (text + f"Inputs already non-finite: {inputs}. The values came from code outside any submodule "
                    "(the forward of an enclosing module) or from the model inputs.")
        text = (f"first non-finite backward gradient: w.r.t. {self.where} of {name}, {counts}; "
                f"incoming gradient {_format_stats(self.input_stats[0])}. ")
        if self.call is None:
            return text + ("A parameter's gradient is computed in its module's backward from the module's forward "
                           "inputs and output gradient. Non-finite inputs show up as a forward finding (when traced), "
                           "a non-finite output gradient as an earlier backward finding; without either, the gradient "
                           "overflowed in this module's backward.")
        if self.consumers:
            return text + (f"Consumers in forward (innermost first): {', '.join(self.consumers)}. Their output "
                           "gradients were finite, so the non-finite gradient was produced in the backward of one "
                           "of them.")
        return text + ("No traced module consumed this tensor: the non-finite gradient came from functional code "
                       "between modules (or the loss).")


def _format_stats(s: dict[str, Any]) -> str:
    text = f"{s['name']} {s['shape']} {s['dtype']}"
    if s["nonfinite"]:
        text += f" {s['nonfinite']} non-finite"
    if s.get("modified_in_place"):
        text += " (modified in place by this call" + (", finite before)" if s.get("finite_before_call") else ")")
    if s["min"] is None:
        return text + " no finite values"
    return text + f" min={s['min']:.4g} max={s['max']:.4g} mean|x|={s['mean_abs']:.4g} norm={s['norm']:.4g}"


def tensor_stats(t: torch.Tensor, name: str = "") -> dict[str, Any]:
    """Shape, dtype, non-finite/NaN counts and min, max, mean |x|, L2 norm of the finite entries."""
    x = t.detach()
    finite = torch.isfinite(x)
    values = x[finite]
    values = values if values.dtype == torch.float64 else values.float()
    stats: dict[str, Any] = {"name": name, "shape": tuple(x.shape), "dtype": str(x.dtype).removeprefix("torch."),
                             "nonfinite": int(x.numel() - finite.sum()), "nan": int(torch.isnan(x).sum())}
    if values.numel() == 0:
        return {**stats, "min": None, "max": None, "mean_abs": None, "norm": None}
    magnitude = values.abs()
    peak = magnitude.max()
    norm = peak * (magnitude / peak).norm() if peak > 0 else peak  # scaled: squares of large values overflow
    return {**stats, "min": float(values.min()), "max": float(values.max()), "mean_abs": float(magnitude.mean()),
            "norm": float(norm)}


def _walk(obj: Any, path: str | None, depth: int = 0) -> Iterator[tuple[str | None, torch.Tensor]]:
    """(path, tensor) for the floating tensors in `obj`, looking into tuples, lists, dicts and dataclasses.
    `path=None` skips building paths (the per-call hot path)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.device.type != "meta":
            yield path, obj
    elif depth >= _MAX_DEPTH:
        return
    elif isinstance(obj, dict):  # includes transformers' ModelOutput
        for key, value in obj.items():
            yield from _walk(value, None if path is None else f"{path}[{key!r}]", depth + 1)
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _walk(value, None if path is None else f"{path}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name, None), None if path is None else f"{path}.{f.name}", depth + 1)


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version  # inference tensors have no version counter


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    flags = [torch.isfinite(t).all() for t in tensors]
    if len(flags) == 1:
        return bool(flags[0])
    if len({f.device for f in flags}) == 1:
        return bool(torch.stack(flags).all())  # one host sync for the whole call
    return all(bool(f) for f in flags)


def _input_stats(where: str, t: torch.Tensor, entry: dict[int, tuple[int | None, _Output | None]]) -> dict[str, Any]:
    """Stats of one input; flags an input this call modified in place, and whether it was checked finite before."""
    stats = tensor_stats(t, where)
    version, known = entry.get(id(t), (None, None))
    if version is not None and version != _version(t):
        stats["modified_in_place"] = True
        stats["finite_before_call"] = known is not None and known.version == version and known.checked
    return stats


@dataclass(eq=False)
class _Output:
    """What the tracer knows about one module output tensor (at one version)."""

    module: str
    module_type: str
    call: int | None  # None for a parameter
    where: str
    version: int | None
    checked: bool = False  # verified finite in forward at `version`
    consumers: list[str] = field(default_factory=list)


class NonFiniteTracer:
    """Context manager: `with NonFiniteTracer(model) as tracer: loss = model(**batch).loss; loss.backward()`,
    then `tracer.first` (or `first_forward` / `first_backward`, all `NonFiniteReport | None`).

    `forward` / `backward` choose the phases checked; `stop_at_first` stops checking a phase after its first
    finding (later findings are mostly propagation). `events` lists every finding in firing order.
    A tracer can be entered again (not nested); each entry starts a fresh trace.
    """

    def __init__(self, model: nn.Module, *, forward: bool = True, backward: bool = True,
                 stop_at_first: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"NonFiniteTracer traces a torch.nn.Module, got {type(model).__name__}")
        if not (forward or backward):
            raise ValueError("nothing to trace: pass forward=True and/or backward=True")
        self.model = model
        self.forward, self.backward, self.stop_at_first = forward, backward, stop_at_first
        self.events: list[NonFiniteReport] = []
        self.first_forward: NonFiniteReport | None = None
        self.first_backward: NonFiniteReport | None = None
        self._active = False
        self._lock = threading.Lock()
        self._module_handles: list[RemovableHandle] = []
        self._tensor_handles: list[RemovableHandle] = []
        self._prune_at = 1024
        self._outputs: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._calls: dict[int, int] = {}  # by id(module): wrappers share their inner module's normalised name
        self._entries: dict[int, list[dict[int, tuple[int | None, _Output | None]]]] = {}

    @property
    def first(self) -> NonFiniteReport | None:
        """The first forward finding, else the first backward finding, else None."""
        return self.first_forward if self.first_forward is not None else self.first_backward

    def __enter__(self) -> NonFiniteTracer:
        if self._active:
            raise RuntimeError("this NonFiniteTracer is already active; create a second tracer to nest")
        self.events, self.first_forward, self.first_backward = [], None, None
        self._outputs, self._calls, self._entries = WeakIdKeyDictionary(), {}, {}
        self._active = True
        try:
            parameters: set[int] = set()
            for name, module in self.model.named_modules():
                name, module_type = normalize_module_name(name), type(module).__name__
                if self.forward:
                    hook = self._on_call
                    self._module_handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
                hook = partial(self._on_forward, name, module_type)
                self._module_handles.append(module.register_forward_hook(hook, with_kwargs=True))
                if self.backward:
                    self._watch_parameters(name, module_type, module, parameters)
        except BaseException:
            self._remove_hooks()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        self._active = False  # gradient hooks that outlive removal (none should) become no-ops
        for handle in self._module_handles + self._tensor_handles:
            handle.remove()
        self._module_handles, self._tensor_handles = [], []
        self._outputs = WeakIdKeyDictionary()

    # ---- hooks ----------------------------------------------------------------------------------
    def _checking_forward(self) -> bool:
        return self.forward and not (self.stop_at_first and self.first_forward is not None)

    def _on_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Pre-forward: remember each input's version (and what produced it) to tell in-place changes apart."""
        if self._active and self._checking_forward():
            entry = {id(t): (_version(t), self._outputs.get(t)) for _, t in _walk((args, kwargs), None)}
            self._entries.setdefault(id(module), []).append(entry)

    def _on_forward(self, name: str, module_type: str, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any], output: Any) -> None:
        if not self._active:
            return
        call = self._calls[id(module)] = self._calls.get(id(module), -1) + 1
        entries = self._entries.get(id(module))
        entry = entries.pop() if entries else {}
        outputs = list(_walk(output, "output"))
        fresh: list[tuple[torch.Tensor, _Output]] = []
        seen: set[int] = set()
        for where, t in outputs:
            version, known = _version(t), self._outputs.get(t)
            if id(t) not in seen and (known is None or version is None or known.version != version):
                fresh.append((t, _Output(name, module_type, call, where, version)))
            seen.add(id(t))  # the rest were returned twice, or are an inner module's output: attributed there
        if fresh and self._checking_forward():
            if _all_finite([t for t, _ in fresh]):
                for _, record in fresh:
                    record.checked = True
            else:
                self._record(self._forward_report(module, fresh, args, kwargs, entry))
        if self.backward:
            self._watch_gradients(name, fresh, seen, args, kwargs)
        for t, record in fresh:
            self._outputs[t] = record

    def _watch_parameters(self, name: str, module_type: str, module: nn.Module, seen: set[int]) -> None:
        """Gradient hooks on the module's own parameters (a shared parameter is owned by its first module)."""
        for param_name, param in module.named_parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                record = _Output(name, module_type, None, f"parameter {param_name}", None)
                self._module_handles.append(param.register_hook(partial(self._on_gradient, record)))

    def _watch_gradients(self, name: str, fresh: list[tuple[torch.Tensor, _Output]], returned: set[int],
                         args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Hook the gradients of new outputs; register this module as a consumer of the outputs it took as inputs
        (an input modified in place is consumed in its old version; one returned unchanged is not consumed)."""
        for t, record in fresh:
            if t.requires_grad:
                self._tensor_handles.append(t.register_hook(partial(self._on_gradient, record)))
        passed_through = returned - {id(t) for t, _ in fresh}
        for _, t in _walk((args, kwargs), None):
            known = self._outputs.get(t) if t.requires_grad and id(t) not in passed_through else None
            if known is not None:
                known.consumers.append(name)
        if len(self._tensor_handles) > self._prune_at:  # handles of freed graphs point at dead hook dicts
            self._tensor_handles = [h for h in self._tensor_handles if h.hooks_dict_ref() is not None]
            self._prune_at = max(1024, 2 * len(self._tensor_handles))

    def _on_gradient(self, record: _Output, grad: torch.Tensor | None) -> None:
        if not self._active or (self.stop_at_first and self.first_backward is not None):
            return
        if grad is None or not grad.is_floating_point() or bool(torch.isfinite(grad).all()):
            return
        stats = tensor_stats(grad, "grad")
        self._record(NonFiniteReport(
            phase="backward", module=record.module, module_type=record.module_type, call=record.call,
            where=record.where, shape=stats["shape"], dtype=stats["dtype"], nonfinite=stats["nonfinite"],
            nan=stats["nan"], total=grad.numel(), input_stats=[stats], consumers=list(record.consumers)))

    # ---- findings -------------------------------------------------------------------------------
    def _forward_report(self, module: nn.Module, fresh: list[tuple[torch.Tensor, _Output]], args: tuple[Any, ...],
                        kwargs: dict[str, Any], entry: dict[int, tuple[int | None, _Output | None]]) -> NonFiniteReport:
        bad, record = next((t, r) for t, r in fresh if not bool(torch.isfinite(t).all()))
        stats = tensor_stats(bad)
        inputs = [*_walk(args, "args"), *_walk(kwargs, "kwargs")]
        params = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        return NonFiniteReport(
            phase="forward", module=record.module, module_type=record.module_type, call=record.call,
            where=record.where, shape=stats["shape"], dtype=stats["dtype"], nonfinite=stats["nonfinite"],
            nan=stats["nan"], total=bad.numel(), input_stats=[_input_stats(w, t, entry) for w, t in inputs],
            nonfinite_params=[n for n, p in params if p.is_floating_point() and not bool(torch.isfinite(p).all())])

    def _record(self, report: NonFiniteReport) -> None:
        with self._lock:
            self.events.append(report)
            if report.phase == "forward" and self.first_forward is None:
                self.first_forward = report
                logger.info("%s", report)
            elif report.phase == "backward" and self.first_backward is None:
                self.first_backward = report
                logger.info("%s", report)


def find_nonfinite(model: nn.Module, fn: Callable[[], object], *, forward: bool = True, backward: bool = True,
                   stop_at_first: bool = True) -> NonFiniteReport | None:
    """Run `fn()` (e.g. a closure doing forward + backward) under a `NonFiniteTracer`; return its `first`."""
    with NonFiniteTracer(model, forward=forward, backward=backward, stop_at_first=stop_at_first) as tracer:
        fn()
    return tracer.first
