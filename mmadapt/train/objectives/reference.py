"""The reference a preference objective compares the policy with: the model the run starts from, never a second
copy of its weights.

- `adapters`: when every trained part is LoRA, the same model with its adapters switched off (peft's LoRA layers'
  `disable_adapters`), run per batch under `torch.no_grad` through the same (DDP / FSDP2) wrapper;
- `precomputed`: otherwise (or when asked), every pair's reference log-probs are computed once before the first step
  by the starting model itself (`compute_table`) and cached in OUT/reference_logps.safetensors (`ReferenceTable`)
  with the checksums of the data and of the starting weights; a resumed run reads them back (its weights are no
  longer the start's).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mmadapt.heads import SequenceLogps
from mmadapt.run_directory import RunDirectory
from mmadapt.train.batches import inputs_of, to_device

REFERENCE_FREE = ("simpo", "orpo")  # loss types without a reference


def lora_layers(model: torch.nn.Module) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The model as it was before LoRA: every LoRA layer's adapters off (peft's `disable_adapters` flag, which its
    forward reads; `requires_grad` untouched), restored after."""
    layers = lora_layers(model)
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, state in zip(layers, before, strict=True):
            layer._disable_adapters = state


def reference_kind(requested: str, loss_type: str, modes: dict[str, str], model: torch.nn.Module) -> str | None:
    """How the run gets its reference: None (a reference-free loss), "adapters" or "precomputed"."""
    if loss_type in REFERENCE_FREE:
        return None
    trained_fully = [part for part, mode in modes.items() if mode == "full"]
    if requested == "adapters":
        if trained_fully:
            raise ValueError(f"dpo.reference: adapters needs every trained part to be LoRA, but {trained_fully} "
                             "train fully (the LoRA-disabled model would not be the starting model). Fix: "
                             "dpo.reference: precomputed (or auto), or freeze / LoRA those parts")
        if not lora_layers(model):
            raise ValueError("dpo.reference: adapters needs LoRA layers (stages: lora)")
        return "adapters"
    if requested == "precomputed" or trained_fully:
        return "precomputed"
    return "adapters"


def model_checksum(model: torch.nn.Module) -> str:
    """SHA-256 over the model's state (names, shapes, dtypes and bytes): which weights a reference was computed by."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def data_checksum(records: Any, settings: dict[str, Any]) -> str:
    """SHA-256 over a data set's records (as read; a line that did not parse, by its problem) and the settings that
    render them."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for record in records or ():
        digest.update(json.dumps(record, sort_keys=True, default=str).encode())
    return digest.hexdigest()


class ReferenceTable:
    """Precomputed reference log-probs: per set ("train", "eval") a (N, 2) fp32 tensor (chosen, rejected) by the
    dataset's index (NaN for a pair that could not be encoded), with the checksums they were made under."""

    def __init__(self, tables: dict[str, torch.Tensor], checksums: dict[str, str]) -> None:
        self.tables, self.checksums = tables, checksums

    def lookup(self, name: str, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.tables[name][torch.tensor(index, dtype=torch.long)]
        missing = [i for i, row in zip(index, rows, strict=True) if bool(torch.isnan(row).any())]
        if missing:
            raise RuntimeError(f"the precomputed reference has no log-probs for pair(s) {missing[:5]} of the {name} "
                               "set (they could not be encoded when it was computed, yet they were now): the data "
                               "changed under the run. Delete the run's reference log-probs file and restart, or "
                               "restore the data")
        return rows[:, 0], rows[:, 1]

    def save(self, out: Path) -> None:
        import os

        from mmadapt.atomic import fsync_path, save_safetensors

        path = RunDirectory(out).reference_file
        staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # written whole, renamed: a reader sees old or new
        save_safetensors({k: v.contiguous() for k, v in self.tables.items()}, staged,
                         metadata={k: str(v) for k, v in self.checksums.items()})
        fsync_path(staged)
        os.replace(staged, path)
        fsync_path(out)

    @classmethod
    def load(cls, out: Path) -> ReferenceTable | None:
        from safetensors import safe_open

        path = RunDirectory(out).reference_file
        if not path.is_file():
            return None
        with safe_open(str(path), "pt") as f:
            return cls({k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {}))


@torch.no_grad()
def compute_table(wrapped: Any, dataset: Any, collate: Any, *, batch_size: int, rank: int, world: int,
                  device: torch.device, precision: Any, gather: Any) -> torch.Tensor:
    """(N, 2) reference log-probs of every pair of `dataset`, each rank computing every world-th pair (the same
    number of batches on every rank, so sharded models stay in step), gathered on every rank."""
    n = len(dataset)
    mine = list(range(rank, n, world))
    per_rank = -(-n // world)
    batches = -(-per_rank // batch_size) if per_rank else 0
    found: dict[int, tuple[float, float]] = {}
    wrapped.eval()
    for b in range(batches):
        index = mine[b * batch_size : (b + 1) * batch_size]
        batch = collate([dataset[i] for i in index])
        pair_index = batch["meta"].get("pair_index", [])
        if not pair_index:  # nothing to score here: a placeholder forward keeps the ranks in step
            batch = _placeholder(collate)
        with precision():
            out = wrapped(**to_device(inputs_of(batch), device), head=SequenceLogps())
        if pair_index:
            chosen, rejected = out.logps.float().cpu().chunk(2)
            found.update({i: (float(c), float(r)) for i, c, r in zip(pair_index, chosen, rejected, strict=True)})
    table = torch.full((n, 2), float("nan"))
    for part in gather(found):
        for i, (c, r) in part.items():
            table[i, 0], table[i, 1] = c, r
    return table


def _placeholder(collate: Any) -> dict[str, Any]:
    pad = torch.full((1, 2), collate.pad_token_id, dtype=torch.long)
    return {"input_ids": pad, "attention_mask": torch.ones(1, 2, dtype=torch.bool),
            "labels": torch.tensor([[-100, pad[0, 1].item()]]), "images_per_sample": torch.zeros(1, dtype=torch.long)}
