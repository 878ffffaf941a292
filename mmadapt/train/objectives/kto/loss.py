"""KTO's arithmetic (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization",
arXiv 2402.01306), as trl 1.16's `KTOTrainer` computes it: per-row losses from summed sequence log-probs, the KL
estimate, and which completion each prompt's KL row borrows.

Records are unpaired: each row is a prompt x with one completion y labelled desirable (thumbs-up) or undesirable.
With pi / ref the policy's / reference's summed log-probs of y given x (B,), r = pi - ref (the implied reward before
beta), sigma the logistic function and z0 the KL estimate below:

- `kto` (the paper's Eq. 7, trl's default): desirable rows lose w_d (1 - sigma(beta (r - z0))), undesirable rows
  w_u (1 - sigma(beta (z0 - r)));
- `apo_zero_unpaired` (D'Oosterlinck et al. 2024, "Anchored Preference Optimization", arXiv 2408.06266, unpaired
  Eq. 7): desirable rows lose w_d (1 - sigma(beta r)), undesirable rows w_u sigma(beta r); no KL term.

w_d / w_u are `desirable_weight` / `undesirable_weight` (the paper's lambda_D / lambda_U: with unequal counts,
trl advises w_d n_D / (w_u n_U) in [1, 4/3]). trl's loss is the mean of the weighted per-row losses over the rows,
desirable and undesirable alike; the rewards it logs are beta r per row (detached).

The KL estimate z0 (only `kto`): the reference point is KL(pi || ref), estimated from "KL rows": each prompt x_i
paired with another row's completion y_j (`kl_partners`), z0 = mean_i [pi(y_j | x_i) - ref(y_j | x_i)]. trl detaches
it (no gradient flows through z0), takes each process's mean over its KL rows, averages those means across processes
(`accelerator.gather_for_metrics(kl).mean()`: every process weighs equally, whatever its row count) and clamps the
result at 0. Here `kl_estimate` is one process's mean (detached); `kl_over_processes` averages those means (every
process calls it once per micro-batch, with its mean or with None when it has no KL rows, e.g. a placeholder batch:
such a process counts for nothing, where trl has no such case) and `kto_losses` clamps the result at 0. On one
process `kl_over_processes(kl_estimate(...))` is the estimate itself.

Shapes: B rows; every tensor here is (B,) or a scalar.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclass(frozen=True)
class KtoTerms:
    """`losses` (B,) in the batch's row order, already weighted (the step's loss is their mean, or their sum over
    the global batch divided by its rows); `chosen_rewards` / `rejected_rewards`: beta r of the desirable /
    undesirable rows in batch order (detached); `kl`: the z0 used (a detached scalar, 0 for `apo_zero_unpaired`)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    kl: torch.Tensor


def kl_estimate(policy_kl_logps: torch.Tensor, reference_kl_logps: torch.Tensor) -> torch.Tensor:
    """One process's KL estimate: the mean over its KL rows (B,) of policy - reference, detached (a scalar). Average
    it across processes (`kl_over_processes`) before `kto_losses`."""
    if policy_kl_logps.shape != reference_kl_logps.shape or policy_kl_logps.dim() != 1:
        raise ValueError(f"the KL rows' log-probs must be two (B,) tensors; got {tuple(policy_kl_logps.shape)} and "
                         f"{tuple(reference_kl_logps.shape)}")
    if not len(policy_kl_logps):
        raise ValueError("no KL rows to estimate the KL from: a process without rows passes None to "
                         "kl_over_processes instead")
    return (policy_kl_logps - reference_kl_logps).mean().detach()


def kl_over_processes(local: torch.Tensor | None, all_reduce: Callable[[torch.Tensor], object] | None = None, *,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """trl's average of the processes' KL estimates (a detached fp32 scalar): `local` is this process's `kl_estimate`
    or None (no KL rows: it counts for nothing); `all_reduce` sums a tensor in place across the processes
    (`torch.distributed.all_reduce`), every process calling it once; None: one process. 0 when no process has rows;
    `device`: where the sum travels when `local` is None (the other processes' device)."""
    if local is None:
        pair = torch.zeros(2, device=device)
    else:
        pair = torch.stack([local.detach().float().reshape(()), torch.ones((), device=local.device)])
    if all_reduce is not None:
        all_reduce(pair)
    return pair[0] / pair[1].clamp(min=1)


def kto_losses(loss_type: str, policy_logps: torch.Tensor, reference_logps: torch.Tensor, desirable: torch.Tensor,
               kl: torch.Tensor | None, *, beta: float, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0) -> KtoTerms:
    """The per-row terms of `loss_type` (the module's formulas) from summed sequence log-probs (B,), the rows'
    labels (B,) bool (True: desirable) and, for `kto`, the KL estimate averaged across processes (a scalar; clamped
    at 0 and detached here); `apo_zero_unpaired` takes `kl=None`."""
    check_rows(policy_logps, reference_logps, desirable)
    z0 = reference_point(loss_type, kl, policy_logps)
    ratio = policy_logps - reference_logps
    if loss_type == "kto":
        desirable_losses = 1 - F.sigmoid(beta * (ratio - z0))
        undesirable_losses = 1 - F.sigmoid(beta * (z0 - ratio))
    else:
        desirable_losses = 1 - F.sigmoid(beta * ratio)
        undesirable_losses = F.sigmoid(beta * ratio)
    losses = torch.where(desirable, desirable_weight * desirable_losses, undesirable_weight * undesirable_losses)
    rewards = beta * ratio.detach()
    return KtoTerms(losses, rewards[desirable], rewards[~desirable], z0)


def reference_point(loss_type: str, kl: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """z0: the KL estimate clamped at 0 and detached for `kto`; 0 for `apo_zero_unpaired` (which takes none)."""
    if loss_type == "kto":
        if kl is None:
            raise ValueError("loss_type 'kto' needs the KL estimate (kl_estimate over the KL rows, averaged across "
                             "processes); got kl=None")
        if kl.numel() != 1:
            raise ValueError(f"the KL estimate must be a scalar (one mean over the KL rows); got shape "
                             f"{tuple(kl.shape)}")
        return kl.detach().reshape(()).clamp(min=0).to(like)
    if loss_type == "apo_zero_unpaired":
        if kl is not None:
            raise ValueError("loss_type 'apo_zero_unpaired' has no KL term; pass kl=None (and skip the KL rows' "
                             "forwards: trl does not run them for this loss)")
        return like.new_zeros(())
    raise ValueError(f"unknown KTO loss_type {loss_type!r}; known: {list(LOSS_TYPES)}")


def check_rows(policy_logps: torch.Tensor, reference_logps: torch.Tensor, desirable: torch.Tensor) -> None:
    shapes = {"policy_logps": policy_logps.shape, "reference_logps": reference_logps.shape,
              "desirable": desirable.shape}
    if len(set(shapes.values())) != 1 or policy_logps.dim() != 1:
        raise ValueError(f"KTO takes one value per row, all (B,); got {({k: tuple(v) for k, v in shapes.items()})}")
    if desirable.dtype != torch.bool:
        raise TypeError(f"desirable must be a bool tensor (True: a desirable row); got {desirable.dtype}")


def kl_partners(num_rows: int, batch_size: int) -> torch.Tensor:
    """Which row's completion each row's KL row takes (num_rows,) long: trl rotates the completions by one within
    each consecutive group of `batch_size` rows (`per_device_train_batch_size`; the last group may be shorter),
    (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}), so the KL rows use the same completions as the rows, each with
    another prompt. A group of one row pairs it with itself (trl's last short group does the same)."""
    if batch_size < 2:
        raise ValueError(f"KTO's KL rows need at least 2 rows per batch (the KL row of a batch of one is its own "
                         f"row); got batch_size={batch_size}. Raise the per-device batch size")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0; got {num_rows}")
    index = torch.arange(num_rows)
    start = index - index % batch_size
    size = (num_rows - start).clamp(max=batch_size)
    return start + (index - start - 1) % size
