"""Projectors: visual tokens at encoder width -> visual tokens at LLM width.

`identity`, `linear`, `mlpNx_gelu` (LLaVA-1.5's `mlp2x_gelu`) act per token; `qwen_merger`
concatenates each 2x2 spatial window (Qwen's PatchMerger) and so changes the token grid.
Layer names match transformers (`linear_1`, `linear_2`; `norm`, `linear_fc1`, `linear_fc2`)
so checkpoints map by prefix alone.

Shapes: N tokens in, N' = N / m^2 out for a merge of m, D_in encoder width, D_out LLM width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mmadapt.encoders.base import VisualTokens, grid_coords
from mmadapt.options import resolve_preset
from mmadapt.registry import Registry, import_object


class Projector(nn.Module):
    """Base: `forward(VisualTokens) -> VisualTokens`; `output_grids` says the token grid it yields."""

    def __init__(self, in_dim: int, out_dim: int, options: dict[str, Any]) -> None:
        super().__init__()
        self.in_dim, self.out_dim, self.options = in_dim, out_dim, options

    def output_grids(self, grids: torch.Tensor) -> torch.Tensor:
        return grids


class IdentityProjector(Projector):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        if in_dim != out_dim:
            raise ValueError(
                f"identity projector cannot map encoder width {in_dim} to backbone width {out_dim}; "
                "use 'linear' or 'mlp2x_gelu'"
            )
        super().__init__(in_dim, out_dim, {})

    def forward(self, visual: VisualTokens) -> VisualTokens:
        return visual


class MLPProjector(Projector):
    """`depth` linear layers with an activation between them: 1 is `linear`, 2 is LLaVA-1.5's."""

    def __init__(self, in_dim: int, out_dim: int, *, depth: int = 2, act: str = "gelu", bias: bool = True) -> None:
        from transformers.activations import ACT2FN

        if depth < 1:
            raise ValueError(f"MLP projector depth must be >= 1, got {depth}")
        super().__init__(in_dim, out_dim, {"depth": depth, "act": act, "bias": bias})
        self.depth = depth
        for i in range(depth):
            self.add_module(f"linear_{i + 1}", nn.Linear(in_dim if i == 0 else out_dim, out_dim, bias=bias))
        self.act = ACT2FN[act]

    def forward(self, visual: VisualTokens) -> VisualTokens:
        x = visual.features
        for i in range(self.depth):
            x = getattr(self, f"linear_{i + 1}")(self.act(x) if i else x)
        return VisualTokens(x, visual.grids, visual.window)


class QwenMergerProjector(Projector):
    """Qwen's PatchMerger: LayerNorm, concat each m x m window, Linear-GELU-Linear."""

    def __init__(self, in_dim: int, out_dim: int, *, merge_size: int = 2) -> None:
        super().__init__(in_dim, out_dim, {"merge_size": merge_size})
        self.merge_size = merge_size
        hidden = in_dim * merge_size**2
        self.norm = nn.LayerNorm(in_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(hidden, hidden)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(hidden, out_dim)

    def output_grids(self, grids: torch.Tensor) -> torch.Tensor:
        m = self.merge_size
        odd = (grids[:, 1:] % m != 0).any(-1)
        if odd.any():
            i = int(odd.nonzero()[0])
            raise ValueError(
                f"qwen_merger merges {m}x{m} windows but image {i} has token grid {grids[i].tolist()}; "
                f"its height and width must be multiples of {m}"
            )
        return torch.stack([grids[:, 0], grids[:, 1] // m, grids[:, 2] // m], -1)

    def forward(self, visual: VisualTokens) -> VisualTokens:
        out_grids = self.output_grids(visual.grids)
        x = visual.features
        if visual.window != self.merge_size:
            x = x[self._window_order(visual)]
        x = self.norm(x).view(-1, self.in_dim * self.merge_size**2)
        return VisualTokens(self.linear_fc2(self.act_fn(self.linear_fc1(x))), out_grids, window=1)

    def _window_order(self, visual: VisualTokens) -> torch.Tensor:
        """Indices that reorder row-major tokens into merge-window order."""
        if visual.window != 1:
            raise ValueError(f"qwen_merger cannot regroup tokens stored in {visual.window}x{visual.window} windows")
        image, (t, h, w) = grid_coords(visual.grids, self.merge_size)
        sizes = visual.grids.prod(-1)
        grid_h, grid_w = visual.grids[image, 1], visual.grids[image, 2]
        return (torch.cumsum(sizes, 0) - sizes)[image] + (t * grid_h + h) * grid_w + w


@dataclass(frozen=True, kw_only=True)
class ProjectorSpec:
    name: str
    description: str
    factory: str
    defaults: dict[str, Any] = field(default_factory=dict)

    def build(self, in_dim: int, out_dim: int, **options: Any) -> Projector:
        resolved = resolve_preset({"default": self.defaults}, "default", options, kind=f"projector {self.name!r}")
        return import_object(self.factory)(in_dim, out_dim, **resolved)


PROJECTORS: Registry[ProjectorSpec] = Registry("projector")
PROJECTORS.register("identity", ProjectorSpec(
    name="identity", description="no projection; encoder width must equal backbone width",
    factory="mmadapt.projectors:IdentityProjector"))
PROJECTORS.register("linear", ProjectorSpec(
    name="linear", description="one linear layer (LLaVA-1.0)", factory="mmadapt.projectors:MLPProjector",
    defaults={"depth": 1}))
for _depth in (2, 3, 4):
    PROJECTORS.register(f"mlp{_depth}x_gelu", ProjectorSpec(
        name=f"mlp{_depth}x_gelu", description=f"{_depth} linear layers with GELU between"
        + (" (LLaVA-1.5)" if _depth == 2 else ""), factory="mmadapt.projectors:MLPProjector",
        defaults={"depth": _depth}))
PROJECTORS.register("qwen_merger", ProjectorSpec(
    name="qwen_merger", description="Qwen's 2x2 spatial merge + MLP (the Qwen ViT's merger weights)",
    factory="mmadapt.projectors:QwenMergerProjector"))
