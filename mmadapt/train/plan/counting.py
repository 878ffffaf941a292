"""Counting bytes while the probe runs: `SavedBytes` (what autograd saves for the backward, by segment, through
saved-tensor hooks) and `LiveBytes` (a dispatch mode: the peak of tensor storages alive at once); `WideArithmetic` keeps
the probe fast where the CPU has no half-precision arithmetic."""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from mmadapt.train.plan.segments import LOSS, SegmentKey


def plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s data: a wrapper subclass's inner tensors (an NF4 weight's codes and scales,
    whose wrapper has no storage of its own), else `t`."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in plain(getattr(t, name))]


class SavedBytes:
    """Bytes autograd saves for the backward, by the tracked module the forward is in (storages counted once;
    parameters and buffers are not activations); what no tracked module holds counts under `LOSS`. Blocks also count
    the bytes of their first input (what activation checkpointing keeps)."""

    def __init__(self, model: nn.Module, tracked: dict[nn.Module, SegmentKey]) -> None:
        self.skip = {t.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()] for t in plain(p)}
        self.seen: set[int] = set()
        self.bytes: dict[SegmentKey, int] = defaultdict(int)
        self.inputs: dict[SegmentKey, int] = defaultdict(int)
        self.stack = [LOSS]
        self.handles = []
        for module, key in tracked.items():
            self.handles.append(module.register_forward_pre_hook(self._enter(key), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, key: SegmentKey) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.stack.append(key)
            if key.is_block:
                first = next((a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), None)
                if first is not None:
                    self.inputs[key] += first.untyped_storage().nbytes()
        return hook

    def _leave(self, *_: Any) -> None:
        self.stack.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        for inner in plain(t):
            storage = inner.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.skip and ptr not in self.seen and storage.device.type != "meta":
                self.seen.add(ptr)
                self.bytes[self.stack[-1]] += storage.nbytes()
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class LiveBytes(TorchDispatchMode):
    """The peak bytes of tensor storages created inside and alive at once (a storage is counted once, from its
    first op output until it is freed; what existed before entering is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, Any] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {inner.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                  for inner in plain(t)}
        for t in tree_leaves(out):  # a view or an in-place result shares an input's storage: nothing new
            if isinstance(t, torch.Tensor) and not t.is_meta:
                for inner in plain(t):
                    if inner.untyped_storage()._cdata not in inputs:
                        self._track(inner.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = weakref.ref(storage, lambda _, k=key, n=size: self._free(k, n))
        self.current += size
        self.peak = max(self.peak, self.current)

    def _free(self, key: int, size: int) -> None:
        if self.live.pop(key, None) is not None:
            self.current -= size


_aten = torch.ops.aten
_HALF = (torch.bfloat16, torch.float16)
WIDE_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
            _aten.convolution.default, _aten.convolution_backward.default,
            _aten._scaled_dot_product_flash_attention_for_cpu.default,
            _aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


class WideArithmetic(TorchDispatchMode):
    """Matmuls, convolutions and attention on bfloat16 / float16 CPU tensors computed in float32 and rounded to the
    dtypes the op would give (read off its meta kernel): the same shapes, dtypes and storage sizes, so the bytes
    counted are the same. A CPU without bf16 instructions (AVX2 only) runs a bf16 matmul about 200x slower than a
    float32 one, which made the probe of a 7B run take 15 minutes there. The probe measures bytes, not values.
    Enter it outside `LiveBytes`, so the float32 temporaries are not counted (a GPU computes in half precision)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func not in WIDE_OPS or not any(t.dtype in _HALF and t.device.type == "cpu" for t in leaves):
            return func(*args, **kwargs)
        meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        out = func(*tree_map(_widened, args), **tree_map(_widened, kwargs))
        return tree_map(lambda t, m: t.to(m.dtype) if isinstance(t, torch.Tensor) and t.dtype != m.dtype else t,
                        out, meta)


def _to_meta(t: Any) -> Any:
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _widened(t: Any) -> Any:
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in _HALF else t
