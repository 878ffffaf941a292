"""`eval_mode(model)`: eval mode for a block, every submodule's own mode restored after.

The one way code outside the trainer switches a model to eval mode for a measurement (sees, eval, evidence maps,
inference) without changing what the caller had: a model that was training with a frozen, eval-mode encoder comes
back exactly so.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode for the block (yields the model); every submodule's own mode is restored after."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes.items():
            module.training = training
