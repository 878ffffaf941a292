"""`mmadapt plan run.yaml --gpus N`: the per-GPU memory of a run's training step, known before anything loads.

**Counted** on the meta device (no weight is read: a pretrained part is built from its checkpoint's config, or
from the `preset` it declares when the checkpoint is not here yet): parameters by dtype; fp32 gradients and
AdamW's two fp32 moments for what the stages train (LoRA: the adapters); sharded by the strategy (FSDP2: / N,
plus the unsharded units it gathers; DDP: full, plus its gradient buckets).

**Measured**: activations. A probe (the run's model at its real widths, the first block of each kind of every block
list, a 1,024-row vocabulary, fewer experts where they would pass 4 GiB) runs a training step on the CPU at two
short lengths, with the run's stages, precision and packing. Autograd's saved-tensor hooks give each block's saved
bytes, fitted linearly in tokens (vision blocks: in patches); `LiveBytes` (a dispatch mode counting live tensor
storages) gives the step's peak. The run's step is then a backward sweep over its real depth (saved activations
freed block by block while gradients appear), plus the probe's measured excess over its own sweep (the backward's
temporaries), plus the loss (the supervised rows' gradients and one chunk of logits), for the run's longest
micro-batch: `batch_size` samples of `max_length` tokens (packed: whole rows of `max_tokens`), each with one image
at the processor's largest size that fits - or, for models that take video, one video at `data.video`'s largest
(its `max_frames`, or `num_frames`, at the `max_pixels` budget) when that has more visual tokens (the encoder's
cost extrapolated in patches); or the optimizer step, whichever is higher. Activation checkpointing
keeps only each block's inputs and recomputes one block in the backward. Probe results are cached per shape
(`$MMADAPT_CACHE`, default ~/.cache/mmadapt/plan).

`total` is the predicted peak of one training step per device. On CUDA a margin is added before comparing with
the GPU's memory: the CUDA context and NCCL buffers (1 GiB) and 5% for the caching allocator's fragmentation.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mmadapt.loss import chunk_rows
from mmadapt.train.config import RunConfig

GIB = 1024**3
PROBE_VOCAB = 1024
PROBE_TEXT = (48, 160)  # text tokens of the two probe samples
CONTEXT_BYTES = GIB  # CUDA context + NCCL buffers
FRAGMENTATION = 0.05
PROBE_EXPERT_BYTES = 4 * GIB
PROBE_VERSION = 3


@dataclass
class Workload:
    """The longest micro-batch of a run, as the plan sizes it."""

    rows: int
    tokens: int  # all positions of the micro-batch (rows x row length)
    images: int
    patches_per_image: int
    visual_per_image: int
    supervised: int
    image_side: int | None = None  # dynamic encoders: the square image's side in pixels
    video_frames: int = 0  # > 0: each sample's visual content is a video of these sampled frames (not an image)

    def describe(self) -> str:
        what = f"video(s) of {self.video_frames} frames" if self.video_frames else "image(s)"
        return (f"{self.rows} x {self.tokens // self.rows} tokens, {self.images} {what} of {self.visual_per_image} "
                f"visual tokens ({self.patches_per_image} patches)")


@dataclass
class Segment:
    """One step of the forward pass: its saved activations (fit a + b x), parameter bytes, trained bytes."""

    name: str
    part: str
    acts: tuple[float, float] = (0.0, 0.0)
    inputs: tuple[float, float] = (0.0, 0.0)
    param_bytes: int = 0
    trained_bytes: int = 0


@dataclass
class Plan:
    gpus: int
    device: str
    strategy: str
    workload: Workload
    per_gpu: dict[str, int]
    activations_without_checkpointing: int
    activations_with_checkpointing: int
    checkpointing: list[str]
    parameters_by_dtype: dict[str, int]
    margin: int
    gpu_memory: int | None
    notes: list[str] = field(default_factory=list)
    suggestions: list[tuple[str, int]] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.per_gpu["total"] + self.margin <= self.gpu_memory

    def to_json(self) -> dict[str, Any]:
        return {"fits": self.fits, "per_gpu": dict(self.per_gpu), "margin": self.margin, "gpus": self.gpus,
                "gpu_memory": self.gpu_memory, "device": self.device, "strategy": self.strategy,
                "workload": asdict(self.workload), "parameters_by_dtype": self.parameters_by_dtype,
                "activations": {"without_checkpointing": self.activations_without_checkpointing,
                                "with_checkpointing": self.activations_with_checkpointing},
                "notes": self.notes, "suggestions": [{"change": c, "total": t} for c, t in self.suggestions]}

    def table(self) -> str:
        rows = [("parameters", self.per_gpu["parameters"],
                 ", ".join(f"{d} {gib(b)}" for d, b in self.parameters_by_dtype.items())),
                ("gradients", self.per_gpu["gradients"], "fp32, trained parameters"),
                ("optimizer", self.per_gpu["optimizer"], "AdamW moments (fp32) + its step's temporaries"),
                ("activations", self.per_gpu["activations"],
                 f"checkpointing {'+'.join(self.checkpointing) or 'off'}: "
                 f"off {gib(self.activations_without_checkpointing)}, all {gib(self.activations_with_checkpointing)}"),
                ("loss", self.per_gpu["loss"], "supervised rows' gradients + one chunk of logits"),
                ("sharding", self.per_gpu["sharding"], "FSDP2 unsharded units / DDP buckets"),
                ("total (peak)", self.per_gpu["total"], "one training step, per device")]
        if self.device == "cuda":
            rows.append(("margin", self.margin, "CUDA context 1 GiB + 5% allocator fragmentation"))
        lines = [f"plan: {self.gpus} x {self.device}{'' if self.gpu_memory is None else ' ' + gib(self.gpu_memory)}, "
                 f"{self.strategy}; micro-batch {self.workload.describe()}"]
        lines += [f"  {name:<13} {gib(value):>10}   {what}" for name, value, what in rows]
        if self.fits is not None:
            need = gib(self.per_gpu["total"] + self.margin)
            lines.append(f"fits: {'yes' if self.fits else 'NO'} ({need} needed of {gib(self.gpu_memory)})")
            if not self.fits:
                lines += [f"  would fit: {change} ({gib(total + self.margin)})" for change, total in self.suggestions
                          if total + self.margin <= self.gpu_memory] or ["  none of: " + ", ".join(
                              c for c, _ in self.suggestions)]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def parse_size(text: str) -> int:
    """'80GiB', '80GB' (= GiB, as GPUs are sold), '81920MiB', '1.5TiB' -> bytes."""
    units = {"t": 1024**4, "g": GIB, "m": 1024**2, "k": 1024}
    value = text.strip().lower().removesuffix("b").removesuffix("i")
    if value and value[-1] in units:
        return int(float(value[:-1]) * units[value[-1]])
    raise ValueError(f"--gpu-memory {text!r}: give a size such as 80GiB, 141GB or 24576MiB")


# ---- building the run's model without weights ------------------------------------------------------------------
def planning_model(config: RunConfig) -> tuple[Any, list[str]]:
    """The run's model on the meta device, with its stages applied (LoRA adapters included), and notes."""
    from mmadapt.train.stages import apply_stages
    from mmadapt.train.trainer import upcast_trainable

    model_config, notes = _available_parts(config)
    model = _meta_model(config, model_config)
    lora = config.lora
    apply_stages(model, config.stages.modes(), r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                 targets=lora.targets, router=config.stages.router)
    upcast_trainable(model)
    return model, notes


def _available_parts(config: RunConfig) -> tuple[Any, list[str]]:
    if config.model.pretrained:
        if not Path(config.model.pretrained).exists():
            raise FileNotFoundError(f"model.pretrained {config.model.pretrained} does not exist: plan needs its "
                                    "config.json (no weights are read)")
        return None, []
    model_config, notes = config.model.model_config(), []
    for part in ("encoder", "projector", "backbone"):
        c = getattr(model_config, part)
        if c.pretrained and not Path(c.pretrained).exists():
            if c.preset is None and part != "projector":
                raise FileNotFoundError(
                    f"model.{part}.pretrained {c.pretrained} is not here, and model.{part} declares no preset: give "
                    f"the preset of its architecture (model.{part}.preset) so that the run can be planned before the "
                    "download, or plan where the checkpoint is")
            notes.append(f"model.{part}.pretrained {c.pretrained} is not here: planned from "
                         f"{'preset ' + repr(c.preset) if c.preset else 'its options'}")
            setattr(model_config, part, replace(c, pretrained=None))
    return model_config, notes


# ---- the workload -----------------------------------------------------------------------------------------------
def workload(config: RunConfig, model: Any) -> Workload:
    """`batch_size` samples of `max_length` tokens, one image each at the largest size the processor makes that fits
    in a sample (packed: the same samples in whole rows of `max_tokens`)."""
    from mmadapt.data.processors import processor_for

    d = config.data
    processor = processor_for(model)
    if model.encoder.dynamic:
        side = math.isqrt(processor.max_pixels)
        visual = processor.tokens_for_size(side, side)
        while visual > max(d.max_length - 256, d.max_length // 2) and side > processor.patch_size:
            side = int(side * 0.9)
            visual = processor.tokens_for_size(side, side)
        side = processor.target_size(side, side)[0]
        patches = visual * processor.projector_merge**2
    else:
        side = None
        visual = processor.tokens_for_size(0, 0)
        patches = int(torch.tensor(model.encoder.grid).prod())
    frames = 0
    video = video_workload(config, model, processor)
    if video is not None and video[0] > visual:
        visual, frames = video
        patches = visual * processor.projector_merge**2
    tokens = d.batch_size * d.max_length
    rows = d.batch_size
    if d.packing:
        rows = max(1, math.ceil(tokens / d.max_tokens))
        tokens = rows * d.max_tokens
    supervised = d.batch_size * max(d.max_length - visual, 1)
    return Workload(rows=rows, tokens=tokens, images=d.batch_size, patches_per_image=patches, visual_per_image=visual,
                    supervised=supervised, image_side=side, video_frames=frames)


def video_workload(config: RunConfig, model: Any, processor: Any) -> tuple[int, int] | None:
    """(visual tokens, sampled frames) of the largest video `data.video` lets through, as the video processor counts
    them (the most frames sampling keeps; frames sized to the `max_pixels` budget); None for models without video."""
    from mmadapt.data.video import VideoConfig

    if not model.encoder.dynamic or model.tokens.video_token_id is None:
        return None
    settings = VideoConfig.parse(config.data.video)
    videos = settings.processor(processor)
    frames = settings.num_frames if settings.num_frames is not None else settings.max_frames
    side = math.isqrt(videos.max_pixels // max(frames, 1)) + 1  # frames large enough to be cut to the budget
    tokens = videos.tokens_for(frames, side, side)
    while tokens > max(config.data.max_length - 256, config.data.max_length // 2) and frames > 1:
        frames = max(1, frames // 2)  # a video that cannot fit max_length is dropped as too_long, never trained on
        tokens = videos.tokens_for(frames, side, side)
    return tokens, frames


# ---- the probe --------------------------------------------------------------------------------------------------
class _ModuloEmbedding(nn.Module):
    """The probe's input embedding: any token id, `PROBE_VOCAB` rows (activations do not depend on the vocabulary)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(PROBE_VOCAB, dim, dtype=dtype).normal_(0, 0.02))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids % PROBE_VOCAB, self.weight)


def block_lists(model: Any) -> dict[str, nn.ModuleList]:
    from mmadapt.train.distributed import BLOCK_LISTS

    lists = {}
    for part in ("encoder", "backbone"):
        for name, module in getattr(model, part).named_modules():
            if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_LISTS and len(module):
                lists[f"{part}.{name}"] = module
    return lists


def block_kinds(model: Any, key: str, blocks: nn.ModuleList) -> list[str]:
    """The kind of every block of a list: the backbone's `layer_types` where it declares them, else one kind."""
    types = getattr(model.backbone.config, "layer_types", None) if key.startswith("backbone") else None
    if types and len(types) >= len(blocks):
        return [str(t) for t in types[: len(blocks)]]
    return ["block"] * len(blocks)


def _probe_depth(model: Any, key: str, kinds: list[str]) -> int:
    seen, keep = set(), 0
    for i, kind in enumerate(kinds):
        if kind not in seen:
            seen.add(kind)
            keep = i + 1
    levels = model.levels if key.startswith("backbone") else len(getattr(model.encoder, "deepstack_levels", ()))
    return max(keep, levels, 2 if key.startswith("encoder") else 1)


def probe_model(config: RunConfig) -> Any:
    """The run's model at its real widths, cut to the first blocks of each kind, on the CPU with random weights."""
    model, _ = planning_model_for_probe(config)
    for key, blocks in block_lists(model).items():
        keep = _probe_depth(model, key, block_kinds(model, key, blocks))
        del blocks[keep:]
        if key.startswith("backbone"):
            model.backbone.config.num_hidden_layers = keep
            if getattr(model.backbone.config, "layer_types", None):
                model.backbone.config.layer_types = model.backbone.config.layer_types[:keep]
    levels = getattr(model.encoder, "deepstack_levels", ())
    if levels:
        model.encoder.deepstack_levels = tuple(range(len(levels)))
        model.encoder.tower.deepstack_visual_indexes = list(range(len(levels)))
    _fewer_experts(model.backbone)
    width = model.backbone.config.hidden_size
    embedding = model.backbone.get_input_embeddings()
    model.backbone.set_input_embeddings(_ModuloEmbedding(width, embedding.weight.dtype))
    model.backbone.set_output_embeddings(nn.Linear(width, PROBE_VOCAB, bias=False, dtype=embedding.weight.dtype))
    materialise(model)
    return model


def _fewer_experts(backbone: nn.Module) -> None:
    """MoE layers whose experts would take more than `PROBE_EXPERT_BYTES` keep the first experts that fit (at least
    2 x top-k): a token's activations depend on the experts it is routed to, not on how many there are (the router's
    (tokens, experts) logits aside)."""
    moe = [m for m in backbone.modules() if isinstance(getattr(m, "num_experts", None), int)]
    total = sum(p.numel() * p.element_size() for m in moe for p in m.parameters(recurse=False))
    experts = max((m.num_experts for m in moe), default=0)
    if total <= PROBE_EXPERT_BYTES or not experts:
        return
    top_k = max((getattr(m, "top_k", 1) for m in moe), default=1)
    keep = max(2 * top_k, int(experts * PROBE_EXPERT_BYTES / total))
    for module in moe:
        for name, p in list(module.named_parameters(recurse=False)):
            if p.shape[0] == module.num_experts:
                setattr(module, name, nn.Parameter(p[:keep], requires_grad=p.requires_grad))
        module.num_experts = keep
    backbone.config.num_experts = keep


def planning_model_for_probe(config: RunConfig) -> tuple[Any, list[str]]:
    """The run's model on the meta device before its stages (the probe applies them once materialised)."""

    model_config, notes = _available_parts(config)
    return _meta_model(config, model_config), notes


def _meta_model(config: RunConfig, model_config: Any) -> Any:
    """Built on the meta device; a part loaded from a checkpoint takes its `dtype` (as its loaded weights would;
    without one, the checkpoint's `torch_dtype` when its config names it, else fp32)."""
    from mmadapt import VisionLanguageModel
    from mmadapt.weights import architecture_only, parse_dtype

    with architecture_only():
        if model_config is None:
            return VisionLanguageModel.from_pretrained(config.model.pretrained)
        model = VisionLanguageModel(model_config)
    model.tie_weights()
    declared = config.model.model_config()
    for part in ("encoder", "projector", "backbone"):
        c = getattr(declared, part)
        dtype = parse_dtype(c.dtype) if c.pretrained else None
        if c.pretrained and dtype is None and Path(c.pretrained, "config.json").is_file():
            saved = json.loads(Path(c.pretrained, "config.json").read_text())
            named = saved.get("torch_dtype") or saved.get("dtype") or (saved.get("text_config") or {}).get("dtype")
            dtype = parse_dtype(named) if isinstance(named, str) and named != "auto" else None
        if dtype is not None:
            getattr(model, part).to(dtype)
    return model


def materialise(module: nn.Module) -> None:
    """Meta parameters become CPU tensors of small random values (tied parameters stay tied)."""
    done: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                data = torch.empty(p.shape, dtype=p.dtype)
                data.normal_(0, 0.02) if data.is_floating_point() else data.zero_()
                done[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            sub._parameters[name] = done[id(p)]


class _Saved:
    """Bytes autograd saves for the backward, by the tracked module the forward is in (storages counted once;
    parameters and buffers are not activations)."""

    def __init__(self, model: nn.Module, tracked: dict[nn.Module, str]) -> None:
        self.skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = defaultdict(int)
        self.inputs: dict[str, int] = defaultdict(int)
        self.stack = ["loss"]
        self.handles = []
        for module, name in tracked.items():
            self.handles.append(module.register_forward_pre_hook(self._enter(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.stack.append(name)
            if ".block" in name or name.startswith("backbone.layer"):
                first = next((a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), None)
                if first is not None:
                    self.inputs[name] += first.untyped_storage().nbytes()
        return hook

    def _leave(self, *_: Any) -> None:
        self.stack.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip and ptr not in self.seen and storage.device.type != "meta":
            self.seen.add(ptr)
            self.bytes[self.stack[-1]] += storage.nbytes()
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _tracked(model: Any) -> dict[nn.Module, str]:
    """encoder / projector / backbone, and every block as '<part>.<kind>.<i>'."""
    tracked = {model.encoder: "encoder", model.projector: "projector", model.backbone: "backbone"}
    for key, blocks in block_lists(model).items():
        part = key.split(".", 1)[0]
        for i, (block, kind) in enumerate(zip(blocks, block_kinds(model, key, blocks), strict=True)):
            tracked[block] = f"{part}.{'block' if part == 'encoder' else 'layer'}:{kind}:{i}"
    return tracked


def _probe_batch(model: Any, text: int, side: int | None, packed: bool) -> dict[str, torch.Tensor]:
    """One sample with one image; packed runs: two half-length samples packed into one row (the run's kernels)."""
    from mmadapt.data import Collator
    from mmadapt.testing import synthetic_batch, synthetic_samples

    if packed:
        samples = synthetic_samples(model, [1, 1], image_sides=None if side is None else [side, side],
                                    text_lengths=[text // 2] * 2)
        batch = Collator.for_model(model, 0, max_tokens=sum(len(s.input_ids) for s in samples))(samples)
    else:
        batch = synthetic_batch(model, [1], image_sides=None if side is None else [side], text_lengths=[text])
    labels = batch["labels"]
    batch["labels"] = torch.where(labels >= 0, labels % PROBE_VOCAB, labels)
    return batch


def run_probe(config: RunConfig) -> dict[str, Any]:
    """Measure the probe at two lengths: saved bytes per tracked module, block inputs, the step's dynamic peak."""
    from mmadapt.train.stages import apply_stages
    from mmadapt.train.trainer import upcast_trainable

    torch.manual_seed(0)
    model = probe_model(config)
    lora = config.lora
    apply_stages(model, config.stages.modes(), r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                 targets=lora.targets, router=config.stages.router)
    upcast_trainable(model)
    model.train()
    step = model.encoder.patch_size * getattr(model.projector, "merge_size", 1) * getattr(model.encoder,
                                                                                          "merge_size", 1)
    sides = (step * 4, step * 8) if model.encoder.dynamic else (None, None)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if config.precision.policy == "bf16-autocast"
                else nullcontext())
    points = []
    for text, side in zip(PROBE_TEXT, sides, strict=True):
        batch = _probe_batch(model, text, side, config.data.packing)
        model.zero_grad(set_to_none=True)
        saved = _Saved(model, _tracked(model))
        with LiveBytes() as live:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), autocast:
                loss = model(**batch).loss
            saved.close()
            loss.backward()
            del loss
        model.zero_grad(set_to_none=True)
        grids = batch.get("image_grid_thw")
        patches = (int(grids.prod(-1).sum()) if grids is not None
                   else int(torch.tensor(model.encoder.grid).prod()) * len(batch["pixel_values"]))
        points.append({"tokens": int(batch["input_ids"].numel()), "patches": patches,
                       "supervised": int((batch["labels"] >= 0).sum()), "saved": dict(saved.bytes),
                       "inputs": dict(saved.inputs), "dynamic": live.peak})
    return {"points": points, "segments": _probe_segments(model)}


class LiveBytes(TorchDispatchMode):
    """The peak bytes of tensor storages created inside and alive at once (a storage is counted once, from its
    first op output until it is freed; what existed before entering is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, Any] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):  # a view or an in-place result shares an input's storage: nothing new
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage()._cdata not in inputs:
                self._track(t.untyped_storage())
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


def _probe_segments(model: Any) -> dict[str, dict[str, int]]:
    """Parameter and trained bytes of the probe's tracked modules (for its own sweep)."""
    out = {}
    for module, name in _tracked(model).items():
        params = list(module.parameters()) if "." in name else _own_parameters(model, module)
        out[name] = {"params": sum(p.numel() * p.element_size() for p in params),
                     "trained": sum(p.numel() * 4 for p in params if p.requires_grad)}
    head = model.backbone.get_output_embeddings().weight
    out["head"] = {"params": head.numel() * head.element_size(), "trained": head.numel() * 4 * head.requires_grad}
    return out


def _own_parameters(model: Any, module: nn.Module) -> list[nn.Parameter]:
    """A part's parameters outside its blocks (and, for the backbone, outside its output layer)."""
    inside = {id(p) for blocks in block_lists(model).values() for p in blocks.parameters()}
    head = model.backbone.get_output_embeddings()
    inside |= {id(p) for p in head.parameters()} if module is model.backbone else set()
    return [p for p in module.parameters() if id(p) not in inside]


def _probe_path(config: RunConfig) -> Path:
    root = Path(os.environ.get("MMADAPT_CACHE", Path.home() / ".cache" / "mmadapt")) / "plan"
    return root / f"{probe_key(config)}.json"


def cached_probe_or_none(config: RunConfig) -> dict[str, Any] | None:
    """The config's probe when it is cached, else None (nothing measured)."""
    path = _probe_path(config)
    return json.loads(path.read_text()) if path.is_file() else None


def cached_probe(config: RunConfig) -> dict[str, Any]:
    """The config's probe: from the cache, else measured and cached."""
    cached = cached_probe_or_none(config)
    if cached is not None:
        return cached
    result = run_probe(config)
    path = _probe_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def probe_key(config: RunConfig) -> str:
    model_config, _ = _available_parts(config)
    shape = {"model": model_config.to_dict() if model_config is not None else config.model.pretrained,
             "stages": config.stages.modes(), "router": config.stages.router, "lora": asdict(config.lora),
             "precision": config.precision.policy, "packed": config.data.packing, "torch": torch.__version__,
             "version": PROBE_VERSION,
             "text": PROBE_TEXT}
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:24]


# ---- the prediction ---------------------------------------------------------------------------------------------
def _fit(points: list[dict[str, Any]], x: str, value: Any) -> tuple[float, float]:
    """a + b x through the two probe points (b >= 0); through the origin when both have the same x (a fixed-size
    encoder's images: its bytes are per image)."""
    (x0, y0), (x1, y1) = ((p[x], value(p)) for p in points)
    if x1 == x0:
        return 0.0, (y0 + y1) / 2 / max(x0, 1)
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return y0 - slope * x0, slope


def _segments(model: Any, probe: dict[str, Any]) -> list[Segment]:
    """The run's forward as segments (encoder rest, each encoder block, projector, backbone rest, each layer,
    the output layer) with the probe's fitted activations and the full model's parameter bytes."""
    points = probe["points"]

    def fitted(name: str, x: str, what: str = "saved") -> tuple[float, float]:
        return _fit(points, x, lambda p: p[what].get(name, 0))

    def by_kind(part: str, x: str) -> dict[str, tuple[str, tuple[float, float], tuple[float, float]]]:
        kinds = {}
        for name in points[0]["saved"] | points[0]["inputs"]:
            if name.startswith(part + ".") and name.count(":") == 2:
                kind = name.split(":")[1]
                kinds.setdefault(kind, (name, fitted(name, x), fitted(name, x, "inputs")))
        return kinds

    segments = []
    x_of = {"encoder": "patches", "backbone": "tokens"}
    for part in ("encoder", "projector", "backbone"):
        x = x_of.get(part, "patches")
        own = sum(p.numel() * p.element_size() for p in _own_parameters(model, getattr(model, part)))
        own_trained = sum(p.numel() * 4 for p in _own_parameters(model, getattr(model, part)) if p.requires_grad)
        segments.append(Segment(name=part, part=part, acts=fitted(part, x), param_bytes=own,
                                trained_bytes=own_trained))
        if part == "projector":
            continue
        kinds = by_kind(part, x)
        for key, blocks in block_lists(model).items():
            if not key.startswith(part):
                continue
            for block, kind in zip(blocks, block_kinds(model, key, blocks), strict=True):
                _, acts, inputs = kinds.get(kind, ("", (0.0, 0.0), (0.0, 0.0)))
                segments.append(Segment(
                    name=f"{part}:{kind}", part=part, acts=acts, inputs=inputs,
                    param_bytes=sum(p.numel() * p.element_size() for p in block.parameters()),
                    trained_bytes=sum(p.numel() * 4 for p in block.parameters() if p.requires_grad)))
    head = model.backbone.get_output_embeddings().weight
    segments.append(Segment(name="head", part="backbone", param_bytes=head.numel() * head.element_size(),
                            trained_bytes=head.numel() * 4 * head.requires_grad))
    return segments


def _at(fit: tuple[float, float], x: float) -> float:
    return max(fit[0] + fit[1] * x, 0.0)


def _sweep(segments: list[Segment], load: dict[str, float], checkpointed: set[str],
           shard: int = 1) -> tuple[float, float]:
    """(peak of saved activations + gradients over the backward, saved activations at the end of the forward);
    gradients are sharded / `shard` (FSDP2 reduce-scatters each unit's as its backward ends)."""
    acts = []
    for s in segments:
        x = load[s.part]
        full = _at(s.acts, x)
        kept = min(_at(s.inputs, x), full)  # a block that saves nothing (frozen, no gradient through it) keeps nothing
        acts.append(kept if s.part in checkpointed and ":" in s.name else full)
    total_acts = sum(acts)
    peak, grads = 0.0, 0.0
    alive = total_acts
    for s, a in zip(reversed(segments), reversed(acts), strict=True):  # the backward, last segment first
        grads += s.trained_bytes / shard
        peak = max(peak, alive + grads)
        alive -= a
    return peak, total_acts


def predict(config: RunConfig, *, gpus: int = 1, gpu_memory: int | None = None, device: str = "cuda",
            probe: dict[str, Any] | None = None) -> Plan:

    from mmadapt.train.optim import checkpointed_parts

    model, notes = planning_model(config)
    probe = probe if probe is not None else cached_probe(config)
    work = workload(config, model)
    strategy = "single" if gpus == 1 else ("ddp" if config.distributed.strategy == "ddp" else "fsdp2")
    segments = _segments(model, probe)
    checkpointed = set(checkpointed_parts(config.train.activation_checkpointing))
    load = {"encoder": work.images * work.patches_per_image, "projector": work.images * work.patches_per_image,
            "backbone": work.tokens}
    shard = gpus if strategy == "fsdp2" else 1
    sweep, acts = _sweep(segments, load, checkpointed, shard)
    _, acts_off = _sweep(segments, load, set(), shard)
    _, acts_all = _sweep(segments, load, {"encoder", "backbone"}, shard)
    transient = _at(_transient(probe, config.precision.policy), work.tokens)
    recompute = max((_at(s.acts, load[s.part]) for s in segments if s.part in checkpointed), default=0.0)

    params = list(_unique_parameters(model))
    by_dtype: dict[str, int] = defaultdict(int)
    for p in params:
        by_dtype[str(p.dtype).removeprefix("torch.")] += p.numel() * p.element_size()
    trained = [p for p in params if p.requires_grad]
    trained_bytes = sum(p.numel() * 4 for p in trained)
    width = model.backbone.config.hidden_size
    hidden_bytes = 2 if config.precision.policy == "bf16-autocast" else 4
    vocab = model.backbone.get_output_embeddings().weight.shape[0]
    # the supervised rows' gradients (kept from the forward to the backward) and the chunk of logits
    loss = work.supervised * width * hidden_bytes + _chunk_bytes(work.supervised, vocab, config.precision.policy)
    parameters = sum(by_dtype.values()) // shard
    gradients = trained_bytes // shard
    optimizer_state = 2 * trained_bytes // shard
    step_temp = _optimizer_temporaries(trained, device) // shard
    sharding = _sharding_bytes(strategy, segments, trained_bytes, config.precision.policy)
    # the step's peak: the backward sweep (gradients appear as the saved activations go) with its temporaries and
    # the loss, or the optimizer step (every gradient + its temporaries); parameters and moments are there throughout
    backward = sweep + transient + recompute + loss
    total = int(parameters + optimizer_state + sharding + max(backward, gradients + step_temp))
    per_gpu = {"parameters": parameters, "gradients": gradients, "optimizer": optimizer_state + step_temp,
               "activations": int(acts + transient + recompute), "loss": int(loss), "sharding": sharding,
               "total": total}
    margin = int(CONTEXT_BYTES + FRAGMENTATION * total) if device == "cuda" else 0
    plan = Plan(gpus=gpus, device=device, strategy=strategy, workload=work, per_gpu=per_gpu,
                activations_without_checkpointing=int(acts_off), activations_with_checkpointing=int(acts_all),
                checkpointing=sorted(checkpointed), parameters_by_dtype=dict(by_dtype), margin=margin,
                gpu_memory=gpu_memory, notes=notes)
    if plan.fits is False:
        plan.suggestions = suggestions(config, gpus=gpus, device=device, probe=probe)
    return plan


def _sharding_bytes(strategy: str, segments: list[Segment], trained_bytes: int, precision: str) -> int:
    """FSDP2: the root unit (everything outside the blocks) stays unsharded through the step, two block units are
    gathered at a time (the current one and the prefetched next), and one unit's gradients are unsharded before
    their reduce-scatter; in the compute dtype. DDP: its gradient buckets, one more copy of the gradients."""
    if strategy == "ddp":
        return trained_bytes
    if strategy != "fsdp2":
        return 0
    compute = 0.5 if precision == "bf16-autocast" else 1.0
    units = [s for s in segments if ":" in s.name]
    biggest = max((s.param_bytes for s in units), default=0)
    root = sum(s.param_bytes for s in segments if ":" not in s.name)
    return int((2 * biggest + root) * compute + max((s.trained_bytes for s in units), default=0))


def _chunk_bytes(rows: int, vocab: int, precision: str) -> int:
    """The chunked loss's logits alive at once: one fp32 chunk (fp32), or the bf16 logits, their fp32 copy and the
    bf16 gradient (autocast)."""
    return min(rows, chunk_rows(vocab)) * vocab * (8 if precision == "bf16-autocast" else 4)


def _transient(probe: dict[str, Any], precision: str) -> tuple[float, float]:
    """The probe's measured dynamic peak minus its own sweep and loss, fitted in tokens: the backward's
    temporaries (of one block at a time, so counted once)."""
    excess = []
    segments = _probe_sweep_segments(probe)
    for point in probe["points"]:
        load = {"encoder": point["patches"], "projector": point["patches"], "backbone": point["tokens"]}
        exact = [replace(s, acts=(float(point["saved"].get(s.name, 0)), 0.0)) for s in segments]
        sweep, _ = _sweep(exact, load, set())
        loss = point["saved"].get("loss", 0) + _chunk_bytes(point["supervised"], PROBE_VOCAB, precision)
        excess.append({"tokens": point["tokens"], "excess": max(point["dynamic"] - sweep - loss, 0)})
    return _fit(excess, "tokens", lambda p: p["excess"])


def _probe_sweep_segments(probe: dict[str, Any]) -> list[Segment]:
    """The probe's tracked modules in forward order: encoder, its blocks, projector, backbone, its layers, head."""
    order = {"encoder": 0, "projector": 1, "backbone": 2}

    def position(name: str) -> tuple[int, int, int]:
        part = "backbone" if name == "head" else name.split(".", 1)[0]
        if name == "head":
            return order[part], 2, 0
        return order[part], int(name != part), int(name.rsplit(":", 1)[-1]) if name.count(":") == 2 else 0

    names = sorted(probe["segments"], key=position)
    return [Segment(name=n, part="backbone" if n == "head" else n.split(".", 1)[0],
                    param_bytes=probe["segments"][n]["params"], trained_bytes=probe["segments"][n]["trained"])
            for n in names]


def _unique_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def _optimizer_temporaries(trained: list[nn.Parameter], device: str) -> int:
    """AdamW's step: on CUDA the foreach implementation makes one fp32 temporary the size of all trained tensors;
    on the CPU it goes tensor by tensor (two temporaries of the largest)."""
    if not trained:
        return 0
    if device == "cuda":
        return sum(p.numel() * 4 for p in trained)
    return 2 * max(p.numel() * 4 for p in trained)


def suggestions(config: RunConfig, *, gpus: int, device: str, probe: dict[str, Any]) -> list[tuple[str, int]]:
    """The usual changes that make a run fit, each planned alone: (change, its total per GPU)."""
    base, modes = config.to_dict(), config.stages.modes()
    candidates = [(f"data.max_length: {config.data.max_length // 2}",
                   {"data": {"max_length": config.data.max_length // 2}})]
    if config.train.activation_checkpointing != "all":
        candidates.insert(0, ("train.activation_checkpointing: all", {"train": {"activation_checkpointing": "all"}}))
    if modes.get("backbone") == "full":
        candidates.append(("stages.backbone: lora", {"stages": {"preset": None, **modes, "backbone": "lora"}}))
    changes = []
    for change, update in candidates:
        same_probe = "stages" not in update  # other stages save other activations: a probe of their own
        plan = predict(RunConfig.from_dict(_merge(base, update)), gpus=gpus, device=device,
                       probe=probe if same_probe else None)
        changes.append((change, plan.per_gpu["total"]))
    if config.distributed.strategy != "ddp":  # DDP replicates: more GPUs do not lower its memory
        changes.append((f"--gpus {gpus * 2}", predict(config, gpus=gpus * 2, device=device, probe=probe).per_gpu[
            "total"]))
    return changes


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out

