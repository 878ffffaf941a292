"""The trainer's step and evaluation, written once for every objective: an objective says what a micro-batch's loss
and an eval batch's sums are (`mmadapt.train.objectives.Objective`), these say how they add up over micro-batches and
ranks.

`accumulate`: the gradients of one global batch. Before the first micro-batch, one all-reduce gives the step's
totals (the objective's `units`: its normaliser, the supervised tokens); then each micro-batch runs in the run's
precision, under `no_sync` but the last (DDP reduces once per step), its loss (already a share of the global batch's,
`Objective.micro_loss`) scaled by the world size before the backward (the ranks' gradients are averaged); a
micro-batch without rows (every sample of it a counted problem) runs a placeholder forward and backward instead (zero
loss, zero gradient), so every rank runs as many forwards and backwards and their collectives stay paired. After the
last, one all-reduce adds the losses and the objective's sums over the ranks.

`evaluate`: every rank runs as many eval rounds (`batches.eval_rounds`: batch k of the set is rank k % world's, in
round k // world); the objective sees the model itself as `run.wrapped` (`Evaluating`: never DDP's forward, whose
buffer broadcast would pair the ranks for nothing). In a round where a rank has no rows it does nothing or, under
FSDP2, scores a stand-in (the eval set's first usable item, its sums dropped), since there the other ranks' forwards
(the vision units, `generate`) gather parameters with its own. One all-reduce adds the sums.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch

from mmadapt.train import distributed as dist_utils
from mmadapt.train.batches import eval_rounds, first_usable, placeholder_forward, usable
from mmadapt.train.objectives.base import Objective, Run, StepResult, StepTotals


def accumulate(run: Run, objective: Objective, micro: list[dict[str, Any]], clock: Any = None) -> StepResult:
    """The gradients of one global batch (`grad_accum` micro-batches on each rank) and its logged result;
    `clock.backward_done()` after each micro-batch's backward."""
    counts = torch.tensor([[objective.units(b), objective.tokens(b)] if objective.has_rows(b) else [0, 0]
                           for b in micro], dtype=torch.float64).sum(0)
    units, tokens = (int(v) for v in dist_utils.all_reduce_sum(counts.to(run.device), run.dist.data_group).tolist())
    totals = StepTotals(units, tokens, len(micro) * run.dist.data_world)
    names = objective.stat_names(run)
    summed = torch.zeros(1 + len(names), dtype=torch.float64, device=run.device)  # the loss, the sums: on the
    # device, no sync per micro-batch
    run.wrapped.train()
    for k, batch in enumerate(micro):
        sync = dist_utils.no_sync(run.wrapped) if k < len(micro) - 1 else nullcontext()
        with sync:
            if objective.has_rows(batch):
                with run.precision_context():
                    terms = objective.micro_loss(run, batch, totals)
                loss, values = terms.loss, terms.sums
            else:
                loss, values = placeholder_forward(run, batch), {}
            (loss * run.dist.world).backward()  # the ranks' gradients are averaged; the loss is already global
        if clock is not None:
            clock.backward_done()
        summed += torch.stack([torch.as_tensor(value, dtype=torch.float64, device=run.device)
                               for value in (loss.detach(), *(values.get(key, 0.0) for key in names))])
    loss_sum, *sums = dist_utils.all_reduce_sum(summed, run.dist.data_group).tolist()
    return objective.step_result(run, micro, loss_sum, dict(zip(names, sums, strict=True)), totals)


@torch.no_grad()
def evaluate(run: Run, objective: Objective) -> dict[str, float]:
    """The objective's eval metrics on `run.eval_data`, every rank scoring its share in as many rounds as the others."""
    names = objective.eval_stat_names(run)
    sums = dict.fromkeys(names, 0.0)
    stand_in: tuple[list[Any], dict[str, Any]] | None = None
    run = Evaluating(run)
    run.wrapped.eval()
    with run.precision_context(), objective.evaluating(run):
        for items in eval_items(run.eval_data, run.cfg.data.batch_size, run.dist.data_rank,
                                     run.dist.data_world):
            good = [item for item in items if usable(item)]
            batch = run.collate_fn(good) if good else None
            if batch is None or not objective.has_rows(batch):  # nothing of its own in this round
                if dist_utils.is_fsdp(run.wrapped):
                    stand_in = stand_in or first_rows(run, objective)
                    if stand_in is not None:
                        objective.eval_batch(run, *stand_in)  # its sums dropped
                continue
            for key, value in objective.eval_batch(run, good, batch).items():
                sums[key] += value
    reduced = dist_utils.all_reduce_sum(torch.tensor([sums[k] for k in names] or [0.0], dtype=torch.float64,
                                                     device=run.device), run.dist.data_group).tolist()
    return objective.eval_metrics(run, dict(zip(names, reduced, strict=False)))


class Evaluating:
    """The run as an evaluation sees it: `wrapped` is the model itself (under FSDP2 the same module, its hooks
    gathering the parameters; under DDP the module DDP wraps)."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def __getattr__(self, name: str) -> Any:
        return getattr(self.run, name)

    @property
    def wrapped(self) -> Any:
        return self.run.model


def eval_items(data: Any, batch_size: int, rank: int, world: int) -> Iterator[list[Any]]:
    """This rank's eval batches as lists of items, one per round (`eval_rounds`; an empty list where it has none).
    A dataset without indexing (a stream) is read whole by every rank, which keeps its every world-th batch."""
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        for index in eval_rounds(len(data), batch_size, rank, world):
            yield [data[i] for i in index]
        return
    group: list[list[Any]] = [[]]
    for item in data:
        if len(group[-1]) == batch_size:
            if len(group) == world:
                yield group[rank]
                group = []
            group.append([])
        group[-1].append(item)
    if group[0]:
        yield group[rank] if rank < len(group) else []


def first_rows(run: Run, objective: Objective) -> tuple[list[Any], dict[str, Any]] | None:
    """The eval set's first usable item and its collated batch (a stand-in), or None when no item has rows."""
    data = run.eval_data
    found = first_usable(data) if hasattr(data, "__getitem__") else next(([x] for x in data if usable(x)), [])
    if not found:
        return None
    batch = run.collate_fn(found)
    return (found, batch) if objective.has_rows(batch) else None
