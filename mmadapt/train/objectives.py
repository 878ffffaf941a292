"""Preference objectives (DPO and its variants) on the supervised-only path, with the reference model they need.

A batch is `mmadapt.data.preference.PairCollator`'s: B chosen rows then B rejected rows, each pair's prompt images
encoded once (`image_index`). One forward of the policy over the 2B rows gives each row's sequence log-prob
(`VisionLanguageModel.forward(sequence_logps=True)`: the hidden states of the answer positions only, `lm_head` and
log-softmax in chunks, no (B, L, V) logits); the losses, per pair (`preference_losses`; pi: the policy's summed
log-probs, ref: the reference's, |y|: the answer's tokens, sigma: the logistic function, eps: `label_smoothing`):

- `sigmoid` (DPO, Rafailov et al. 2023; cDPO's label smoothing): h = (pi_c - ref_c) - (pi_r - ref_r),
  loss = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h);
- `ipo` (Azar et al. 2023, per token as trl and the authors normalise it): h = (pi_c - ref_c) / |y_c| -
  (pi_r - ref_r) / |y_r|, loss = (h - 1 / (2 beta))^2;
- `simpo` (Meng et al. 2024; reference-free): h = beta (pi_c / |y_c| - pi_r / |y_r|) - gamma,
  loss = -(1 - eps) log sigma(h) - eps log sigma(-h);
- `orpo` (Hong et al. 2024; reference-free): with a = pi / |y| (the mean token log-prob) and
  log odds(y) = a - log(1 - exp(a)), loss = -a_c + beta * -log sigma(log odds(y_c) - log odds(y_r)) (beta = the
  paper's lambda).

Rewards (logged): beta (pi - ref) for DPO and IPO, beta pi / |y| for SimPO and ORPO; the margin is chosen - rejected,
the accuracy the share of pairs whose chosen reward is higher; `kl`: the mean over answer tokens of KL(policy ||
reference) over the whole vocabulary (when the reference runs per batch).

The reference (`Reference`) is the model the run starts from, never a second copy of its weights:
- `adapters`: when every trained part is LoRA, the same model with its adapters switched off (peft's LoRA layers'
  `disable_adapters`), run per batch under `torch.no_grad` through the same (DDP / FSDP2) wrapper;
- `precomputed`: otherwise (or when asked), every pair's reference log-probs are computed once before the first step
  by the starting model itself and cached in OUT/reference_logps.safetensors with the checksums of the data and of
  the starting weights; a resumed run reads them back (its weights are no longer the start's).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

LOSS_TYPES = ("sigmoid", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
NOT_INPUTS = ("pairs", "meta")  # batch keys the model does not take


@dataclass(frozen=True)
class PreferenceTerms:
    """Per pair (B,): the loss, the chosen and rejected rewards."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_losses(loss_type: str, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                      reference_chosen: torch.Tensor | None, reference_rejected: torch.Tensor | None,
                      chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, *, beta: float,
                      label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> PreferenceTerms:
    """The per-pair losses of `loss_type` (the module's formulas) from summed sequence log-probs (B,) and answer
    token counts (B,); the reference's log-probs are None for the reference-free losses."""
    eps = label_smoothing
    if loss_type in ("sigmoid", "ipo"):
        if reference_chosen is None or reference_rejected is None:
            raise ValueError(f"loss_type {loss_type!r} needs the reference's log-probs")
        chosen_ratio, rejected_ratio = policy_chosen - reference_chosen, policy_rejected - reference_rejected
        if loss_type == "sigmoid":
            h = beta * (chosen_ratio - rejected_ratio)
            losses = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
        else:
            h = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            losses = (h - 1 / (2 * beta)) ** 2
        return PreferenceTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
    chosen_mean = policy_chosen / chosen_tokens.clamp(min=1)
    rejected_mean = policy_rejected / rejected_tokens.clamp(min=1)
    if loss_type == "simpo":
        h = beta * (chosen_mean - rejected_mean) - simpo_gamma
        losses = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
    elif loss_type == "orpo":
        log_odds = (chosen_mean - rejected_mean) - (log1m_exp(chosen_mean) - log1m_exp(rejected_mean))
        losses = -chosen_mean - beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; known: {list(LOSS_TYPES)}")
    return PreferenceTerms(losses, beta * chosen_mean.detach(), beta * rejected_mean.detach())


def log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurately on both sides of -log 2."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


# ---- the reference ---------------------------------------------------------------------------------------------------
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


def inputs_of(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k not in NOT_INPUTS}


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


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

    FILE = "reference_logps.safetensors"

    def __init__(self, tables: dict[str, torch.Tensor], checksums: dict[str, str]) -> None:
        self.tables, self.checksums = tables, checksums

    def lookup(self, name: str, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.tables[name][torch.tensor(index, dtype=torch.long)]
        missing = [i for i, row in zip(index, rows, strict=True) if bool(torch.isnan(row).any())]
        if missing:
            raise RuntimeError(f"the precomputed reference has no log-probs for pair(s) {missing[:5]} of the {name} "
                               "set (they could not be encoded when it was computed, yet they were now): the data "
                               f"changed under the run. Delete {self.FILE} and restart, or restore the data")
        return rows[:, 0], rows[:, 1]

    def save(self, out: Path) -> None:
        import os

        from mmadapt.atomic import fsync_path, save_safetensors

        staged = out / f".{self.FILE}.{os.getpid()}.tmp"  # written whole, then renamed: a reader sees old or new
        save_safetensors({k: v.contiguous() for k, v in self.tables.items()}, staged,
                         metadata={k: str(v) for k, v in self.checksums.items()})
        fsync_path(staged)
        os.replace(staged, out / self.FILE)
        fsync_path(out)

    @classmethod
    def load(cls, out: Path) -> ReferenceTable | None:
        from safetensors import safe_open

        path = out / cls.FILE
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
            out = wrapped(**to_device(inputs_of(batch), device), sequence_logps=True)
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


def check_pairs(batch: dict[str, Any], image_token_id: int | None) -> None:
    """The contract on both rows of every pair of a `PairCollator` batch (rows b and B + b): the same image spans (the
    same positions in the prompt both rows share) and, when the pair shares its images, the same encoded images
    (`image_index`), so both rows receive the same visual tokens. `ImageTokenContractError` naming the pair."""
    from mmadapt.contract import ImageTokenContractError, locate

    pairs, meta = int(batch.get("pairs", 0)), batch.get("meta", {})
    if not pairs or image_token_id is None:
        return
    spans = locate(batch["input_ids"], image_token_id)
    per_row = [[] for _ in range(2 * pairs)]
    for row, start, length in zip(spans.sample.tolist(), spans.start.tolist(), spans.length.tolist(), strict=True):
        per_row[row].append((start, length))
    index = batch.get("image_index")
    counts = [len(spans_of) for spans_of in per_row]
    offsets = [sum(counts[:r]) for r in range(2 * pairs)]
    shared = meta.get("shared", [True] * pairs)
    for b in range(pairs):
        chosen, rejected = per_row[b], per_row[pairs + b]
        same_images = index is None or index[offsets[b] : offsets[b] + counts[b]].tolist() == index[
            offsets[pairs + b] : offsets[pairs + b] + counts[pairs + b]].tolist()
        if chosen != rejected or (shared[b] and not same_images):
            pair = meta.get("pair_ids", [b] * pairs)[b]
            raise ImageTokenContractError(
                f"pair {pair!r} (rows {b} and {pairs + b}): the chosen row has image spans {chosen} (start, tokens), "
                f"the rejected row {rejected}" + ("" if same_images else ", reading other encoded images") + ". Both "
                "answers must follow the same prompt with the same images. Fix: build pair batches with "
                "mmadapt.data.preference.PairCollator")


# ---- the objective the trainer runs ----------------------------------------------------------------------------------
STATS = ("loss", "chosen_reward", "rejected_reward", "correct", "chosen_logps", "rejected_logps", "kl", "kl_tokens")


class PreferenceObjective:
    """What the trainer runs for `train.objective: dpo`: per micro-batch, the reference's log-probs (per batch with
    the adapters off, from the precomputed table, or none), one policy forward over both rows, the per-pair terms,
    and the sums the step logs."""

    def __init__(self, settings: Any, model: torch.nn.Module, reference: str | None,
                 table: ReferenceTable | None = None) -> None:
        self.settings, self.model, self.reference, self.table = settings, model, reference, table

    def reference_logps(self, wrapped: Any, inputs: dict[str, Any], batch: dict[str, Any], split: str,
                        keep_states: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
        """(chosen (B,), rejected (B,), the reference's answer states or None)."""
        if self.reference is None:
            return None, None, None
        if self.reference == "precomputed":
            if self.table is None:
                raise RuntimeError("the precomputed reference was not computed (PreferenceObjective.table)")
            chosen, rejected = self.table.lookup(split, batch["meta"]["pair_index"])
            device = inputs["input_ids"].device
            return chosen.to(device), rejected.to(device), None
        was_training = wrapped.training
        with torch.no_grad(), adapters_disabled(self.model):
            wrapped.eval()  # the reference runs as an evaluated model: no dropout
            out = wrapped(**inputs, sequence_logps=True, keep_states=keep_states)
        wrapped.train(was_training)
        chosen, rejected = out.logps.chunk(2)
        return chosen, rejected, out.states

    def reference_head(self) -> Any:
        head = self.model.backbone.get_output_embeddings()

        def logits(states: torch.Tensor) -> torch.Tensor:
            with adapters_disabled(head):
                return head(states)

        return logits

    def terms(self, wrapped: Any, batch: dict[str, Any], device: torch.device, split: str = "train"
              ) -> tuple[PreferenceTerms, dict[str, float]]:
        """One micro-batch of B pairs: the per-pair terms (differentiable when grad is on) and the sums to log."""
        s = self.settings
        if self.model.config.check_contract:
            check_pairs(batch, self.model.tokens.image_token_id)
        inputs = to_device(inputs_of(batch), device)
        ref_chosen, ref_rejected, ref_states = self.reference_logps(wrapped, inputs, batch, split,
                                                                    keep_states=self.reference == "adapters")
        reference = (ref_states, self.reference_head()) if ref_states is not None else None
        out = wrapped(**inputs, sequence_logps=True, reference=reference)
        chosen, rejected = out.logps.chunk(2)
        chosen_tokens, rejected_tokens = out.tokens.chunk(2)
        terms = preference_losses(s.loss_type, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens,
                                  rejected_tokens, beta=s.beta, label_smoothing=s.label_smoothing,
                                  simpo_gamma=s.simpo_gamma)
        stats = {"loss": float(terms.losses.detach().sum()), "chosen_reward": float(terms.chosen_rewards.sum()),
                 "rejected_reward": float(terms.rejected_rewards.sum()),
                 "correct": float((terms.chosen_rewards > terms.rejected_rewards).sum()),
                 "chosen_logps": float(chosen.detach().sum()), "rejected_logps": float(rejected.detach().sum()),
                 "kl": float(out.kl.sum()) if out.kl is not None else 0.0,
                 "kl_tokens": float(out.tokens.sum()) if out.kl is not None else 0.0}
        return terms, stats

    @staticmethod
    def summary(sums: dict[str, float], pairs: int, prefix: str = "") -> dict[str, float]:
        """The logged means of a step's (or an evaluation's) sums over `pairs` pairs."""
        n = max(pairs, 1)
        out = {f"{prefix}loss": sums["loss"] / n, f"{prefix}rewards/chosen": sums["chosen_reward"] / n,
               f"{prefix}rewards/rejected": sums["rejected_reward"] / n,
               f"{prefix}rewards/margin": (sums["chosen_reward"] - sums["rejected_reward"]) / n,
               f"{prefix}rewards/accuracy": sums["correct"] / n, f"{prefix}logps/chosen": sums["chosen_logps"] / n,
               f"{prefix}logps/rejected": sums["rejected_logps"] / n}
        if sums["kl_tokens"]:
            out[f"{prefix}kl"] = sums["kl"] / sums["kl_tokens"]
        return out
