"""The probe: the run's model at its real widths, cut to the first block of each kind of every block list, with a
1,024-row vocabulary (and fewer experts where they would pass 4 GiB), runs a training step on the CPU at three short
lengths with the run's stages (a QLoRA base's layers in NF4, dequantised in each forward and backward as in the run),
precision and packing, measuring each segment's saved bytes, the blocks' input bytes
and the step's peak. Results are cached per shape (`$MMADAPT_CACHE`, default ~/.cache/mmadapt/plan) as JSON, whose
segments are keyed by `SegmentKey` text."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmadapt.train.config import RunConfig
from mmadapt.train.plan.counting import LiveBytes, SavedBytes, WideArithmetic
from mmadapt.train.plan.model import (
    available_parts,
    block_kinds,
    block_lists,
    materialise,
    own_parameters,
    planning_model_for_probe,
    trained_as_in_run,
)
from mmadapt.train.plan.report import GIB
from mmadapt.train.plan.segments import HEAD, PARTS, SegmentKey, gradient_bytes, parameter_bytes

PROBE_VOCAB = 1024
PROBE_TEXT = (48, 160, 384)  # text tokens of the probe samples: three lengths, so a quadratic term shows
PROBE_SIDES = (4, 8, 12)  # dynamic encoders: the probe images' sides, in steps of patch x merge
PROBE_EXPERT_BYTES = 4 * GIB
PROBE_VERSION = 4


class _ModuloEmbedding(nn.Module):
    """The probe's input embedding: any token id, `PROBE_VOCAB` rows (activations do not depend on the vocabulary)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(PROBE_VOCAB, dim, dtype=dtype).normal_(0, 0.02))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids % PROBE_VOCAB, self.weight)


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


def tracked(model: Any) -> dict[nn.Module, SegmentKey]:
    """encoder / projector / backbone, and every block of their block lists (its kind and index)."""
    out = {getattr(model, part): SegmentKey(part) for part in PARTS}
    for name, blocks in block_lists(model).items():
        part = name.split(".", 1)[0]
        for i, (block, kind) in enumerate(zip(blocks, block_kinds(model, name, blocks), strict=True)):
            out[block] = SegmentKey(part, kind, i)
    return out


def _probe_batch(model: Any, text: int, side: int | None, packed: bool) -> dict[str, torch.Tensor]:
    """One sample with one image; packed runs: two half-length samples packed into one row (the run's kernels)."""
    from mmadapt.data import Collator
    from mmadapt.synthetic import synthetic_batch, synthetic_samples

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
    """Measure the probe at three lengths: saved bytes per tracked module, block inputs, the step's dynamic peak."""
    torch.manual_seed(0)
    model = trained_as_in_run(probe_model(config), config)
    model.train()
    step = model.encoder.patch_size * getattr(model.projector, "merge_size", 1) * getattr(model.encoder,
                                                                                          "merge_size", 1)
    sides = [step * k if model.encoder.dynamic else None for k in PROBE_SIDES]
    autocast = config.precision.mode.autocast("cpu")
    points = []
    for text, side in zip(PROBE_TEXT, sides, strict=True):
        batch = _probe_batch(model, text, side, config.data.packing)
        model.zero_grad(set_to_none=True)
        saved = SavedBytes(model, tracked(model))
        with WideArithmetic(), LiveBytes() as live:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), autocast:
                loss = model(**batch).loss
            saved.close()
            loss.backward()
            del loss
        model.zero_grad(set_to_none=True)
        grids = batch.get("image_grid_thw")
        patches = (int(grids.prod(-1).sum()) if grids is not None
                   else int(torch.tensor(model.encoder.grid).prod()) * len(batch["pixel_values"]))
        images = len(grids) if grids is not None else len(batch["pixel_values"])
        points.append({"tokens": int(batch["input_ids"].numel()), "rows": int(batch["input_ids"].shape[0]),
                       "patches": patches, "images": images,
                       "supervised": int((batch["labels"] >= 0).sum()), "saved": as_json(saved.bytes),
                       "inputs": as_json(saved.inputs), "dynamic": live.peak})
    return {"points": points, "segments": _probe_segments(model)}


def _probe_segments(model: Any) -> dict[str, dict[str, int]]:
    """Parameter and trained bytes of the probe's tracked modules (for its own sweep)."""
    out = {}
    for module, key in tracked(model).items():
        params = list(module.parameters()) if key.is_block else own_parameters(model, module)
        out[str(key)] = {"params": parameter_bytes(params), "trained": gradient_bytes(params)}
    head = [model.backbone.get_output_embeddings().weight]
    out[str(HEAD)] = {"params": parameter_bytes(head), "trained": gradient_bytes(head)}
    return out


def as_json(counts: dict[SegmentKey, int]) -> dict[str, int]:
    return {str(key): value for key, value in counts.items()}


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
    model_config, _ = available_parts(config)
    shape = {"model": model_config.to_dict() if model_config is not None else config.model.pretrained,
             "stages": config.stages.modes(), "router": config.stages.router, "lora": asdict(config.lora),
             "precision": config.precision.mode.name, "packed": config.data.packing, "torch": torch.__version__,
             "version": PROBE_VERSION, "text": PROBE_TEXT, "sides": PROBE_SIDES,
             # a QLoRA base's NF4 layers dequantise in each forward: which layers, by their blocks
             **({"quantization": asdict(config.quantization)} if config.stages.modes()["backbone"] == "qlora" else {})}
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:24]
