"""Numerics dumps: per-layer forward and gradient statistics of one step, in a small portable file.

`dump(model, inputs, path)` runs `model(**inputs)`, backpropagates the loss and records, for any
`torch.nn.Module` in eager mode:

- `forward`: one row per floating output tensor of every module call, in the order calls finish
  (children before their parents). A row holds the L2 norm, mean, abs max (all over finite entries),
  NaN and Inf counts, shape and dtype. A module called several times gets one row per call: `name`,
  `name#1`, `name#2`. A module returning several tensors gets one row per tensor: `name:0`,
  `name:logits`. A tensor is recorded once, under the first (innermost) module that returned it, so a
  parent or a wrapper that passes its child's output through adds no row.
- `grads`: one row per parameter that received a gradient (norm, abs max, NaN/Inf counts), in the
  order the gradients became final during backward, output side first (a parameter used twice, such
  as a tied embedding, is placed at its last accumulation).
- `meta`: device, parameter dtypes, autocast dtype, torch and transformers versions, seed, loss,
  hostname, time.

Names are normalised (`normalize_name`) so dumps from wrapped models match plain ones: DDP/DeepSpeed
`module.`, PEFT `base_model.model.`, `_orig_mod`, FSDP and checkpoint wrappers, and LoRA's
`.base_layer` (the LoRA layer's output row stands for the plain layer's). Modules called again while
backward runs (activation-checkpoint recomputation) are not recorded, so checkpointed and plain runs
produce the same rows. Under `torch.compile`, dump the uncompiled module: hooks inside compiled regions
may not fire.

The file is JSON (gzipped when the path ends in `.gz`): statistics only, no tensors, so a dump of a
large model is a few hundred kB and can be attached to an issue. `load_dump` reads it back (at most
`MAX_DUMP_BYTES` of JSON after decompression, checked while reading; `DumpTooLargeError` beyond). The
model's `.grad`s are restored to what they were before the call.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import platform
import re
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from mmadapt.numerics.tracer import _walk, normalize_module_name

logger = logging.getLogger(__name__)

FORMAT = "mmadapt.numerics.dump"
VERSION = 1
ADAPTER_COMPONENTS = frozenset({"base_layer"})  # PEFT LoRA: the wrapped original layer
# PEFT's adapter-only sub-modules and parameters; they have no counterpart in the plain model.
ADAPTER_PARTS = re.compile(r"(^|\.)(lora_[A-Za-z_]+|hada_[\w]+|lokr_[\w]+|ia3_l)(\.|$)")
_SIGNIFICANT = 7  # digits kept per statistic: ample for relative differences, keeps the file small
# The most JSON text `load_dump` reads (after decompression): a real dump is a few hundred kB (about 1 kB per module
# and parameter), so this fits models far beyond today's, and a crafted gzip file never expands past it.
MAX_DUMP_BYTES = 64 << 20


class DumpTooLargeError(ValueError):
    """A numerics dump holds more JSON text than `load_dump`'s `max_bytes`."""


def normalize_name(name: str) -> str:
    """`normalize_module_name`, also dropping PEFT LoRA's `.base_layer`: `base_model.model.fc.base_layer.weight` ->
    `fc.weight`."""
    return normalize_module_name(".".join(p for p in name.split(".") if p not in ADAPTER_COMPONENTS))


def is_adapter_name(name: str) -> bool:
    """True for PEFT adapter modules/parameters (`lora_A`, `lora_B`, ...), which a plain model does not have."""
    return ADAPTER_PARTS.search(name) is not None


@dataclass
class Dump:
    """What `dump` recorded. `forward` and `grads` are lists of row dicts (see the module docstring)."""

    meta: dict[str, Any]
    forward: list[dict[str, Any]] = field(default_factory=list)
    grads: list[dict[str, Any]] = field(default_factory=list)

    @property
    def grad_order(self) -> str:
        """Order of `grads`: "backward" (as gradients became final) or "parameter" (`named_parameters` order)."""
        return self.meta.get("grad_order", "parameter")

    def first_nonfinite_forward(self) -> dict[str, Any] | None:
        """The first forward row with a NaN/Inf, in execution order."""
        return next((r for r in self.forward if r["nan"] or r["inf"]), None)

    def first_nonfinite_grad(self) -> dict[str, Any] | None:
        """The first gradient row with a NaN/Inf, in backward order (output side first)."""
        return next((r for r in self.grads if r["nan"] or r["inf"]), None)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "meta": self.meta, "forward": self.forward, "grads": self.grads}

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON; gzipped when `path` ends in `.gz`."""
        text = json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":"))
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        opener = gzip.open if os.fspath(path).endswith(".gz") else open
        with opener(path, "wt", encoding="utf-8") as f:
            f.write(text)


def dump(model: nn.Module, inputs: Any, path: str | os.PathLike | None = None, *, seed: int | None = None) -> Dump:
    """Run forward + backward of `model` on `inputs`, record per-layer statistics, write them to `path` (if given).

    `inputs`: a mapping (called as `model(**inputs)`), a tuple/list (`model(*inputs)`) or one tensor.
    The loss is the output's `loss` attribute or key, or the output itself when it is a scalar tensor.
    `seed` seeds torch's generators first (dropout), and is recorded. Autocast active around the call is
    recorded in `meta["autocast"]`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"dump needs a torch.nn.Module, got {type(model).__name__}")
    if seed is not None:
        torch.manual_seed(seed)
    saved = {id(p): p.grad for p in model.parameters()}
    for p in model.parameters():
        p.grad = None
    recorder = _Recorder(model)
    try:
        with recorder:
            loss = _loss_of(_call(model, inputs))
            recorder.backward_started = True
            loss.backward()
        result = Dump(meta=_meta(model, loss, seed), forward=recorder.rows, grads=_grad_rows(model, recorder.order))
    finally:
        for p in model.parameters():
            p.grad = saved.get(id(p))
    if path is not None:
        result.save(path)
        logger.info("numerics dump: %d forward rows, %d gradient rows -> %s", len(result.forward),
                    len(result.grads), os.fspath(path))
    return result


def load_dump(path_or_dict: str | os.PathLike | Mapping[str, Any] | Dump, *,
              max_bytes: int = MAX_DUMP_BYTES) -> Dump:
    """Read a dump written by `dump` (plain or gzipped JSON; detected from the content, not the name).

    At most `max_bytes` of JSON text (`MAX_DUMP_BYTES`, 64 MiB, by default; after decompression), read in chunks and
    checked while reading: a larger file raises `DumpTooLargeError` before it is expanded in memory.
    """
    if isinstance(path_or_dict, Dump):
        return path_or_dict
    data = path_or_dict if isinstance(path_or_dict, Mapping) else _read_json(path_or_dict, max_bytes)
    where = "the dict" if isinstance(path_or_dict, Mapping) else os.fspath(path_or_dict)
    if data.get("format") != FORMAT or "forward" not in data or "grads" not in data:
        raise ValueError(f"{where} is not a numerics dump (expected format {FORMAT!r} with 'forward' and 'grads'). "
                         "Fix: write it with mmadapt.numerics.dump(model, inputs, path).")
    if data.get("version", 0) > VERSION:
        raise ValueError(f"{where} is dump format version {data['version']}; this mmadapt reads up to {VERSION}. "
                         "Fix: upgrade mmadapt on this machine.")
    return Dump(meta=dict(data.get("meta", {})), forward=list(data["forward"]), grads=list(data["grads"]))


# ---- recording -----------------------------------------------------------------------------------
class _Recorder:
    """Forward hooks on every module and post-accumulate-grad hooks on every parameter, removed on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.rows: list[dict[str, Any]] = []
        self.order: dict[str, None] = {}  # parameter names, re-inserted at each accumulation: last one wins
        self.backward_started = False
        self._calls: dict[str, int] = {}
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> version already recorded
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> _Recorder:
        try:
            for raw, module in self.model.named_modules():
                if raw.split(".")[-1] not in ADAPTER_COMPONENTS:  # LoRA's base_layer: its parent's row stands for it
                    hook = partial(self._on_forward, normalize_name(raw), type(module).__name__)
                    self._handles.append(module.register_forward_hook(hook))
            for raw, param in self.model.named_parameters():
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(partial(self._on_grad, raw)))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_forward(self, name: str, module_type: str, module: nn.Module, args: Any, output: Any) -> None:
        if self.backward_started:
            return  # recomputation under activation checkpointing
        fresh = []
        for where, t in _walk(output, "output"):
            version = None if t.is_inference() else t._version
            if self._seen.get(t, "unseen") != version:
                self._seen[t] = version
                fresh.append((where, t))
        if not fresh:
            return
        call = self._calls[name] = self._calls.get(name, -1) + 1
        base = (name or "<root>") + (f"#{call}" if call else "")
        single = len(fresh) == 1 and fresh[0][0] == "output"
        for where, t in fresh:
            key = base if single else f"{base}:{_component_path(where)}"
            self.rows.append({"name": key, "module": name, "type": module_type, "call": call,
                              "output": where, **tensor_summary(t)})

    def _on_grad(self, name: str, param: torch.Tensor) -> None:
        self.order.pop(name, None)
        self.order[name] = None


def _component_path(where: str) -> str:
    """`output[0]['logits'].features` -> `0.logits.features`."""
    parts = re.findall(r"\[(?:'([^']*)'|\"([^\"]*)\"|(-?\d+))\]|\.(\w+)", where.removeprefix("output"))
    return ".".join(next(p for p in groups if p) for groups in parts) or "output"


def tensor_summary(t: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype, NaN/Inf counts and L2 norm, mean, abs max over the finite entries (one host sync)."""
    x = t.detach()
    finite = torch.isfinite(x)
    values = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    peak = values.abs().amax() if x.numel() else torch.zeros((), device=x.device)
    stats = torch.stack([finite.sum().double(), torch.isnan(x).sum().double(),
                         torch.linalg.vector_norm(values, dtype=torch.float64), values.sum(dtype=torch.float64),
                         peak.double()]).tolist()  # one host sync
    count, nan, norm, total, absmax = stats
    has_values = count > 0
    return {"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch."), "numel": x.numel(),
            "nan": int(nan), "inf": int(x.numel() - count - nan),
            "norm": _round(norm) if has_values else None, "mean": _round(total / count) if has_values else None,
            "absmax": _round(absmax) if has_values else None}


def _round(value: float) -> float | None:
    return float(f"{value:.{_SIGNIFICANT}g}") if math.isfinite(value) else None


def _grad_rows(model: nn.Module, order: dict[str, None]) -> list[dict[str, Any]]:
    params = dict(model.named_parameters())
    names = [n for n in order if params[n].grad is not None]
    names += [n for n, p in params.items() if p.grad is not None and n not in order]  # hooks unsupported (none yet)
    rows = []
    for raw in names:
        summary = tensor_summary(params[raw].grad)
        rows.append({"name": normalize_name(raw), "shape": summary["shape"], "dtype": summary["dtype"],
                     "norm": summary["norm"], "absmax": summary["absmax"], "nan": summary["nan"],
                     "inf": summary["inf"]})
    return rows


# ---- inputs, loss, metadata ----------------------------------------------------------------------
def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    return model(inputs)


def _loss_of(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None and isinstance(output, torch.Tensor) and output.numel() == 1:
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise TypeError(f"dump: the model returned {type(output).__name__} without a scalar floating `loss` "
                        "(attribute or key), and is not a scalar tensor itself. Fix: include `labels` in the "
                        "inputs, or wrap the model so that forward returns the loss.")
    if not loss.requires_grad:
        raise ValueError("dump: the loss does not require grad, so there is no backward to record. Fix: call "
                         "dump outside torch.no_grad()/inference_mode and leave some parameters trainable.")
    return loss


def _meta(model: nn.Module, loss: torch.Tensor, seed: int | None) -> dict[str, Any]:
    params = list(model.parameters())
    device = params[0].device if params else loss.device
    return {
        "created": datetime.now(UTC).isoformat(timespec="seconds"), "hostname": socket.gethostname(),
        "device": str(device), "device_name": _device_name(device),
        "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
        "autocast": _autocast(device), "training": model.training, "seed": seed,
        "model": type(model).__name__, "parameters": sum(p.numel() for p in params),
        "loss": _round(value) if math.isfinite(value := float(loss.detach().float())) else str(value),
        "torch": torch.__version__, "transformers": _version_of("transformers"), "python": platform.python_version(),
        "grad_order": "backward",
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _autocast(device: torch.device) -> str | None:
    kind = device.type if device.type in ("cuda", "cpu", "xpu", "mps") else "cpu"
    if not torch.is_autocast_enabled(kind):
        return None
    return str(torch.get_autocast_dtype(kind)).removeprefix("torch.")


def _version_of(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _read_json(path: str | os.PathLike, max_bytes: int = MAX_DUMP_BYTES) -> dict[str, Any]:
    """The JSON object in `path`, plain or gzipped, read in chunks: at most `max_bytes` of JSON text (after
    decompression), checked while reading, so a small crafted file never expands in memory."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            raw = _read_capped(gzip.GzipFile(fileobj=f, mode="rb") if gzipped else f, max_bytes, where)
    except OSError as e:  # gzip.BadGzipFile included
        raise ValueError(f"cannot read numerics dump {where}: {e.strerror or e}. Fix: check the path, or write the "
                         "dump again with mmadapt.numerics.dump.") from None
    except (EOFError, zlib.error) as e:
        raise ValueError(f"numerics dump {where} is a truncated or corrupt gzip stream ({e}). Fix: write the dump "
                         "again with mmadapt.numerics.dump.") from None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{where} is not JSON ({type(e).__name__}: {str(e)[:200]}). Fix: pass a file written by "
                         "mmadapt.numerics.dump.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{os.fspath(path)} holds a JSON {type(data).__name__}, not a numerics dump")
    return data


def _read_capped(stream: Any, max_bytes: int, where: str) -> bytes:
    """`stream` read in 1 MiB chunks; a `DumpTooLargeError` as soon as it holds more than `max_bytes`."""
    chunks, total = [], 0
    while chunk := stream.read(min(1 << 20, max_bytes + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise DumpTooLargeError(f"numerics dump {where} holds more than {max_bytes} bytes of JSON (after "
                                    "decompression): a real dump is a few hundred kB, so this is not one (or a crafted "
                                    "file). Fix: pass a file written by mmadapt.numerics.dump, or raise the limit with "
                                    "load_dump(path, max_bytes=...)")
    return b"".join(chunks)
