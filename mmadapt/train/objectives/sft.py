"""`train.objective: sft`: next-token cross-entropy on the answers (supervised fine-tuning).

The loss of every micro-batch is a *sum* over its supervised tokens divided by the supervised tokens of the whole
global batch (all micro-batches, all ranks), so accumulation and data parallelism equal one big batch; the model
computes it (`mmadapt.loss`: the supervised positions only, `lm_head` and cross-entropy in chunks) given that count
as `num_items_in_batch`. A micro-batch whose every sample was a problem runs a placeholder (one unsupervised token):
zero loss, and the ranks' collectives stay paired. A variant that changes only the loss of a micro-batch overrides
`loss` (tests/test_objectives.py registers one).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.data import DataLoader

from mmadapt.heads import TokenLosses
from mmadapt.train import distributed as dist_utils
from mmadapt.train.batches import placeholder_batch, supervised_tokens, to_device
from mmadapt.train.objectives.base import Objective, ObjectiveData, Run, StepResult


class SupervisedObjective(Objective):
    """Next-token loss on the supervised (answer) tokens of conversations (`mmadapt.data.VLMDataset`)."""

    def data(self, model: Any, encoder: Any) -> ObjectiveData:
        from mmadapt.data import Collator, VLMDataset, training_set

        d, seed = self.config.data, self.config.train.seed
        collate = Collator.for_model(model, encoder.pad_token_id, max_tokens=d.max_tokens if d.packing else None)
        return ObjectiveData(training_set(d.train, lambda path: VLMDataset(path, encoder), seed, encoder),
                             training_set(d.eval, lambda path: VLMDataset(path, encoder), seed, encoder,
                                          stream_shards=False), collate)

    def loss(self, run: Run, batch: dict[str, Any], total_tokens: int) -> torch.Tensor:
        """One micro-batch's loss: its summed token losses / the global batch's supervised tokens. A mixture's batch
        carries `token_losses` (B, L), which receives each position's loss (`mmadapt.heads.TokenLosses`)."""
        inputs = to_device({k: v for k, v in batch.items() if k != "token_losses"}, run.device)
        if "token_losses" not in batch:
            return run.wrapped(**inputs, num_items_in_batch=total_tokens).loss
        out = run.wrapped(**inputs, num_items_in_batch=total_tokens, head=TokenLosses())
        batch["token_losses"].copy_(out.token_losses)
        return out.loss

    def backward(self, run: Run, micro: list[dict[str, Any]], clock: Any = None) -> StepResult:
        tokens = dist_utils.all_reduce_sum(sum(supervised_tokens(b["labels"]) for b in micro).to(run.device))
        total_tokens = max(int(tokens.item()), 1)
        loss_sum = torch.zeros((), device=run.device)
        names = run.source_names()
        by_source = torch.zeros(2, len(names), dtype=torch.float64)  # summed token losses, supervised tokens
        run.wrapped.train()
        for k, batch in enumerate(micro):
            if batch["input_ids"].shape[0] == 0:  # every sample of it was a problem (counted in the log)
                batch = placeholder_batch(batch, getattr(run.collate_fn, "pad_token_id", 0))
            elif names:  # a mixture: the model fills each position's token loss, summed per source below
                batch = {**batch, "token_losses": torch.zeros(batch["labels"].shape, device=run.device)}
            sync = dist_utils.no_sync(run.wrapped) if k < len(micro) - 1 else nullcontext()
            with sync, run.precision_context():
                loss = self.loss(run, batch, total_tokens)
            (loss * run.dist.world).backward()  # ranks' gradients are averaged; the loss is already global
            if clock is not None:
                clock.backward_done()
            loss_sum += loss.detach().float()
            if "token_losses" in batch:
                by_source += losses_by_source(batch, names)
        logged = {}
        if names:
            by_source = dist_utils.all_reduce_sum(by_source.to(run.device)).cpu()
            logged["sources"] = {name: {"loss": float(by_source[0, j] / by_source[1, j]) if by_source[1, j] else
                                        float("nan"), "tokens": int(by_source[1, j])} for j, name in enumerate(names)}
        return StepResult(float(dist_utils.all_reduce_sum(loss_sum)), total_tokens, logged)

    @torch.no_grad()
    def evaluate(self, run: Run) -> dict[str, float]:
        """`eval_loss`: the mean token loss over the eval set (this process's batches)."""
        loader = DataLoader(run.eval_data, batch_size=run.cfg.data.batch_size, collate_fn=run.collate_fn)
        run.wrapped.eval()
        total, tokens = 0.0, 0
        for batch in loader:
            if batch["input_ids"].shape[0] == 0:
                continue
            with run.precision_context():
                n = int(supervised_tokens(batch["labels"]))
                loss = run.wrapped(**to_device(batch, run.device), num_items_in_batch=max(n, 1)).loss
            total, tokens = total + float(loss) * n, tokens + n
        return {"eval_loss": total / max(tokens, 1)}


def losses_by_source(batch: dict[str, Any], names: list[str]) -> torch.Tensor:
    """(2, sources): the summed token losses and the supervised tokens of each mixture source in one micro-batch,
    from the model's `token_losses` (position t: the loss of predicting labels[t + 1]) and the collator's per-row
    `sources` and `lengths` (a packed row's samples lie one after the other from its start)."""
    losses = batch["token_losses"].detach().double().cpu()
    labels = batch["labels"]
    supervised = torch.nn.functional.pad(labels[:, 1:] != -100, (0, 1), value=False).cpu()
    out = torch.zeros(2, len(names), dtype=torch.float64)
    meta = batch["meta"]
    for r, (row, lengths) in enumerate(zip(meta["sources"], meta["lengths"], strict=True)):
        start = 0
        for name, length in zip(row, lengths, strict=True):
            j = names.index(name)
            out[0, j] += losses[r, start : start + length].sum()
            out[1, j] += supervised[r, start : start + length].sum()
            start += length
    return out
