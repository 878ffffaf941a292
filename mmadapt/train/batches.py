"""Micro-batches as the trainer and its objectives use them: which samples each rank takes at each step, and the
small operations on a collated batch (to the device, the model's inputs, its supervised tokens, a placeholder).

`GlobalBatchSampler` makes the data order a pure function of (seed, step), so a resumed run continues exactly and a
step means the same global batch on every world size. A placeholder batch (one unsupervised pad token) is what a rank
runs when its micro-batch holds nothing (every sample of it was bad): its forward and backward keep the collectives of
the ranks paired and add zero loss and zero gradient. `eval_rounds` gives every rank as many eval rounds, so that
an eval whose batches do not divide among the ranks keeps their forwards paired the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

NOT_INPUTS = ("pairs", "meta", "columns", "rollout", "logged")  # batch keys the model does not take


class GlobalBatchSampler(Sampler[list[int]]):
    """Micro-batches of sample indices for this rank, from `start_step` on, forever.

    Step s takes global batch s of the seed's permutation of the epoch (tail dropped); rank r
    gets its every world-th sample, cut into `grad_accum` micro-batches of `micro_batch`.
    `epoch_indices`: index i of epoch e is given as `e * num_samples + i`, for a dataset whose samples differ from
    epoch to epoch (`mmadapt.data.Mixture`).
    """

    def __init__(self, num_samples: int, *, micro_batch: int, grad_accum: int = 1, seed: int = 0, rank: int = 0,
                 world: int = 1, start_step: int = 0, shuffle: bool = True, epoch_indices: bool = False) -> None:
        self.global_batch = micro_batch * grad_accum * world
        if num_samples < self.global_batch:
            raise ValueError(f"{num_samples} training samples cannot fill one global batch of {self.global_batch} "
                             f"(batch_size {micro_batch} x grad_accum {grad_accum} x {world} ranks)")
        self.num_samples, self.micro_batch, self.grad_accum = num_samples, micro_batch, grad_accum
        self.seed, self.rank, self.world, self.start_step, self.shuffle = seed, rank, world, start_step, shuffle
        self.epoch_indices = epoch_indices
        self.steps_per_epoch = num_samples // self.global_batch
        self._epoch: int | None = None
        self._order = torch.empty(0, dtype=torch.long)

    def indices(self, step: int) -> list[list[int]]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._epoch != epoch:  # the epoch's permutation, drawn once (8 bytes a sample), not at every step
            self._epoch, self._order = epoch, (
                torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
                if self.shuffle else torch.arange(self.num_samples))
        order = self._order if not self.epoch_indices else self._order + epoch * self.num_samples
        mine = order[k * self.global_batch : (k + 1) * self.global_batch][self.rank :: self.world].tolist()
        return [mine[m * self.micro_batch : (m + 1) * self.micro_batch] for m in range(self.grad_accum)]

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            yield from self.indices(step)
            step += 1


def eval_rounds(count: int, batch_size: int, rank: int, world: int) -> list[range]:
    """This rank's share of an eval set of `count` items in batches of `batch_size`, as rounds: batch k of the set is
    rank k % world's, in round k // world, and every rank has as many rounds as the rank with the most batches - an
    empty range in a round where it has none (the last round, when the batches do not divide among the ranks).
    Under FSDP2 every forward (and every `generate`) gathers parameters with the other ranks: an eval that runs one
    of each per round (a placeholder where its range is empty) keeps them paired, however the set divides."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    starts = range(0, count, batch_size)
    rounds = -(-len(starts) // world)
    mine = [k * world + rank for k in range(rounds)]
    return [range(starts[k], min(starts[k] + batch_size, count)) if k < len(starts) else range(0) for k in mine]


def usable(item: Any) -> bool:
    """Whether a dataset's item is a sample to use (a bad record is a counted `DataProblem`)."""
    from mmadapt.data.problems import DataProblem

    return not isinstance(item, DataProblem)


def first_usable(data: Any) -> list[Any]:
    """[the first usable item of map-style `data`] (a stand-in for a rank with nothing of its own to run under FSDP2,
    its results dropped), or [] when none is (then no rank has anything to run)."""
    return next(([item] for item in (data[i] for i in range(len(data))) if usable(item)), [])


def supervised_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry loss after the causal shift (transformers drops the first label of each row)."""
    return (labels[..., 1:] != -100).sum()


def placeholder_batch(batch: dict[str, Any], pad_token_id: int = 0) -> dict[str, Any]:
    """One unsupervised pad token: keeps every rank's forward/backward (and collectives) in step, adds 0 loss."""
    pad = torch.full((1, 1), pad_token_id, dtype=torch.long)
    return {"input_ids": pad, "attention_mask": torch.ones(1, 1, dtype=torch.bool),
            "labels": torch.full((1, 1), -100), "images_per_sample": torch.zeros(1, dtype=torch.long),
            "meta": batch.get("meta", {})}


def placeholder_forward(run: Any, batch: dict[str, Any] | None = None) -> torch.Tensor:
    """The loss (0) of a placeholder batch through `run.wrapped` in `run`'s precision: what a rank runs where it has no
    rows, so that its forward (and backward) pair with the other ranks' collectives."""
    placeholder = placeholder_batch(batch or {}, getattr(run.collate_fn, "pad_token_id", 0))
    with run.precision_context():
        return run.wrapped(**to_device(placeholder, run.device), num_items_in_batch=1).loss


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors on `device` (non-blocking); other values as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def inputs_of(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch without the keys the model does not take (`NOT_INPUTS`)."""
    return {k: v for k, v in batch.items() if k not in NOT_INPUTS}
