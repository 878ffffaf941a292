"""`train.objective: sft`: next-token cross-entropy on the answers (supervised fine-tuning).

The loss of every micro-batch is a *sum* over its supervised tokens divided by the supervised tokens of the whole
global batch (all micro-batches, all ranks), so accumulation and data parallelism equal one big batch; the model
computes it (`mmadapt.loss`: the supervised positions only, `lm_head` and cross-entropy in chunks) given that count
as `num_items_in_batch`; the trainer adds them up (`mmadapt.train.steps`). A variant that changes only the loss of
a micro-batch overrides `loss` (tests/test_objectives.py registers one).
"""

from __future__ import annotations

from typing import Any

import torch

from mmadapt.heads import TokenLosses
from mmadapt.train.batches import to_device
from mmadapt.train.objectives.base import Objective, ObjectiveData, Run, StepResult, StepTotals, Terms


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
        """One micro-batch's loss: its summed token losses / the global batch's supervised tokens."""
        return run.wrapped(**to_device(batch, run.device), num_items_in_batch=total_tokens).loss

    def micro_loss(self, run: Run, batch: dict[str, Any], totals: StepTotals) -> Terms:
        names = run.source_names()
        if not names:
            return Terms(self.loss(run, batch, totals.per_unit))
        # a mixture: the loss with each position's token loss (`mmadapt.heads.TokenLosses`), summed per source
        out = run.wrapped(**to_device(batch, run.device), num_items_in_batch=totals.per_unit, head=TokenLosses())
        by_source = losses_by_source({**batch, "token_losses": out.token_losses}, names)
        return Terms(out.loss, {f"{kind}/{name}": float(by_source[k, j]) for j, name in enumerate(names)
                                for k, kind in enumerate(("loss", "tokens"))})

    def stat_names(self, run: Run) -> tuple[str, ...]:
        return tuple(f"{kind}/{name}" for name in run.source_names() for kind in ("loss", "tokens"))

    def step_result(self, run: Run, micro: list[dict[str, Any]], loss: float, sums: dict[str, float],
                    totals: StepTotals) -> StepResult:
        """The step's mean token loss and, for a mixture, each source's (`sources`)."""
        logged = {}
        if names := run.source_names():
            logged["sources"] = {name: {"loss": sums[f"loss/{name}"] / sums[f"tokens/{name}"]
                                        if sums[f"tokens/{name}"] else float("nan"),
                                        "tokens": int(sums[f"tokens/{name}"])} for name in names}
        return StepResult(loss, totals.per_unit, logged)

    def eval_stat_names(self, run: Run) -> tuple[str, ...]:
        return ("loss", "tokens")

    def eval_batch(self, run: Run, items: list[Any], batch: dict[str, Any]) -> dict[str, float]:
        """The batch's summed token losses and supervised tokens (the model in eval mode: transformers' loss)."""
        n = self.tokens(batch)
        loss = run.wrapped(**to_device(batch, run.device), num_items_in_batch=max(n, 1)).loss
        return {"loss": float(loss) * n, "tokens": n}

    def eval_metrics(self, run: Run, sums: dict[str, float]) -> dict[str, float]:
        """`eval_loss`: the mean token loss over the eval set (every rank's share)."""
        return {"eval_loss": sums["loss"] / max(sums["tokens"], 1)}


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
