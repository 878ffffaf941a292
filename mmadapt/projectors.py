"""Projectors: visual tokens at encoder width -> visual tokens at LLM width.

`identity`, `linear`, `mlpNx_gelu` (LLaVA-1.5's `mlp2x_gelu`) act per token; `qwen_merger`
concatenates each 2x2 spatial window (Qwen's PatchMerger) and so changes the token grid.
Layer names match transformers (`linear_1`, `linear_2`; `norm`, `linear_fc1`, `linear_fc2`)
so checkpoints map by prefix alone. Pretrained projectors load from LLaVA's `mm_projector.bin`,
a llava-hf directory, a Qwen3.5-VL / Qwen3-VL directory (`model.visual.merger`, and Qwen3-VL's
`model.visual.deepstack_merger_list`) or an mmadapt model / training checkpoint (`projector.*`);
widths are checked against the encoder and backbone.

DeepStack: built with `levels` = K (the model does so when its encoder emits K feature levels and its
backbone takes them), a projector also holds K projectors of its own kind (`deepstack.{i}`), one per
level, options updated by the class's `level_options` (Qwen3-VL's level mergers normalise after the
window concatenation: `qwen_merger` levels use `postshuffle_norm`). Each level goes through its own.

Shapes: N tokens in, N' = N / m^2 out for a merge of m, D_in encoder width, D_out LLM width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from mmadapt.contract import ImageTokenContractError
from mmadapt.encoders.base import VisualTokens, grid_coords
from mmadapt.options import resolve_preset
from mmadapt.registry import Registry, import_object
from mmadapt.weights import Checkpoint, Rules, hf_config, load_pretrained, wrong_family


class Projector(nn.Module):
    """Base: `forward(VisualTokens) -> VisualTokens`; `output_grids` says the token grid it yields.

    Subclasses implement `project` (one set of tokens, `options` as their keyword arguments); `forward` also
    projects each DeepStack level through its own projector (`deepstack.{i}`, built with `levels`).
    """

    level_options: ClassVar[dict[str, Any]] = {}  # options of the per-level projectors, over the main one's

    def __init__(self, in_dim: int, out_dim: int, options: dict[str, Any], levels: int = 0) -> None:
        super().__init__()
        self.in_dim, self.out_dim, self.options = in_dim, out_dim, options
        self.deepstack = nn.ModuleList(type(self)(in_dim, out_dim, **{**options, **self.level_options})
                                       for _ in range(levels))

    def output_grids(self, grids: torch.Tensor) -> torch.Tensor:
        return grids

    def project(self, visual: VisualTokens) -> VisualTokens:
        raise NotImplementedError

    def forward(self, visual: VisualTokens) -> VisualTokens:
        if len(visual.levels) != len(self.deepstack):
            raise ImageTokenContractError(
                f"the encoder gave {len(visual.levels)} DeepStack feature level(s) but the projector was built with "
                f"{len(self.deepstack)} level projection(s). Fix: build the model from its config (the levels follow "
                "the encoder and backbone), or set deepstack: drop")
        out = self.project(dataclasses.replace(visual, levels=()))
        if not self.deepstack:
            return out
        levels = tuple(level.project(dataclasses.replace(visual, features=features, levels=())).features
                       for level, features in zip(self.deepstack, visual.levels, strict=True))
        return dataclasses.replace(out, levels=levels)

    @classmethod
    def checkpoint_layout(cls, checkpoint: Checkpoint, options: dict[str, Any], what: str) -> tuple[dict, Rules]:
        """(options the checkpoint implies, key rules) for this projector's weights in `checkpoint`."""
        raise ValueError(f"{what} has no weights to load from a checkpoint")

    @classmethod
    def from_pretrained(cls, path: str, in_dim: int, out_dim: int, *, what: str, dtype: Any = None, levels: int = 0,
                        **options: Any) -> Projector:
        checkpoint = Checkpoint.open(path, what=what, weights=["mm_projector.bin"])
        implied, rules = cls.checkpoint_layout(checkpoint, options, what)
        hint = (f"the checkpoint's projector has other widths than encoder width {in_dim} -> backbone width "
                f"{out_dim}: pair it with the encoder and backbone it was trained with")
        return load_pretrained(lambda: cls(in_dim, out_dim, levels=levels, **{**implied, **options}), checkpoint, rules,
                               what=what, dtype=dtype, hint=hint)


def _saved_part(checkpoint: Checkpoint, part: str) -> bool:
    """An mmadapt model directory or training checkpoint: keys are `encoder.*`, `projector.*`, `backbone.*`."""
    return any(k.startswith(f"{part}.") for k in checkpoint.keys())


class IdentityProjector(Projector):
    def __init__(self, in_dim: int, out_dim: int, *, levels: int = 0) -> None:
        if in_dim != out_dim:
            raise ValueError(
                f"identity projector cannot map encoder width {in_dim} to backbone width {out_dim}; "
                "use 'linear' or 'mlp2x_gelu'"
            )
        super().__init__(in_dim, out_dim, {}, levels)

    def project(self, visual: VisualTokens) -> VisualTokens:
        return visual


class MLPProjector(Projector):
    """`depth` linear layers with an activation between them: 1 is `linear`, 2 is LLaVA-1.5's."""

    def __init__(self, in_dim: int, out_dim: int, *, depth: int = 2, act: str = "gelu", bias: bool = True,
                 levels: int = 0) -> None:
        from transformers.activations import ACT2FN

        if depth < 1:
            raise ValueError(f"MLP projector depth must be >= 1, got {depth}")
        super().__init__(in_dim, out_dim, {"depth": depth, "act": act, "bias": bias}, levels)
        self.depth = depth
        for i in range(depth):
            self.add_module(f"linear_{i + 1}", nn.Linear(in_dim if i == 0 else out_dim, out_dim, bias=bias))
        self.act = ACT2FN[act]

    @classmethod
    def checkpoint_layout(cls, checkpoint: Checkpoint, options: dict[str, Any], what: str) -> tuple[dict, Rules]:
        keys = checkpoint.keys()
        if _saved_part(checkpoint, "projector"):
            return {}, (("projector.", ""),)
        llava = [k for k in keys if k.startswith(("model.mm_projector.", "mm_projector."))]
        if llava:  # LLaVA's nn.Sequential: Linear at 0, 2, 4, ... (GELU between); `linear` is a bare Linear
            layers = sorted({int(k.split(".")[-2]) for k in llava if k.split(".")[-2].isdigit()})
            depth = options.get("depth", 2)
            found = len(layers) or 1
            if found != depth:
                name = "linear" if found == 1 else f"mlp{found}x_gelu"
                raise ValueError(f"{what}: {checkpoint.path} holds a {found}-layer LLaVA projector, but this projector "
                                 f"has {depth}. Fix: use projector {name!r}.")
            prefix = "model.mm_projector." if llava[0].startswith("model.") else "mm_projector."
            if not layers:
                return {}, ((prefix, "linear_1."),)
            return {}, tuple((f"{prefix}{index}.", f"linear_{i + 1}.") for i, index in enumerate(layers))
        if checkpoint.model_type == "llava":
            config = hf_config(checkpoint, what)
            implied = {"act": config.projector_hidden_act, "bias": config.multimodal_projector_bias}
            return implied, (("model.multi_modal_projector.", ""), ("multi_modal_projector.", ""))
        raise wrong_family(what, checkpoint, "LLaVA's mm_projector.bin, a llava-hf directory ('llava') or an "
                           "mmadapt model directory")

    def project(self, visual: VisualTokens) -> VisualTokens:
        x = visual.features
        for i in range(self.depth):
            x = getattr(self, f"linear_{i + 1}")(self.act(x) if i else x)
        return VisualTokens(x, visual.grids, visual.window)


QWEN_VISION_TYPES = ("qwen3_5_vision", "qwen3_5_moe_vision", "qwen3_vl_vision", "qwen3_vl_moe_vision")


class QwenMergerProjector(Projector):
    """Qwen's PatchMerger: LayerNorm, concat each m x m window, Linear-GELU-Linear.

    `postshuffle_norm`: normalise after the concatenation instead (Qwen3-VL's DeepStack level mergers)."""

    level_options: ClassVar[dict[str, Any]] = {"postshuffle_norm": True}

    def __init__(self, in_dim: int, out_dim: int, *, merge_size: int = 2, postshuffle_norm: bool = False,
                 levels: int = 0) -> None:
        super().__init__(in_dim, out_dim, {"merge_size": merge_size, "postshuffle_norm": postshuffle_norm}, levels)
        self.merge_size, self.postshuffle_norm = merge_size, postshuffle_norm
        hidden = in_dim * merge_size**2
        self.norm = nn.LayerNorm(hidden if postshuffle_norm else in_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(hidden, hidden)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(hidden, out_dim)

    @classmethod
    def checkpoint_layout(cls, checkpoint: Checkpoint, options: dict[str, Any], what: str) -> tuple[dict, Rules]:
        if _saved_part(checkpoint, "projector"):
            return {}, (("projector.", ""),)
        vision = getattr(hf_config(checkpoint, what), "vision_config", None) if checkpoint.config else None
        if getattr(vision, "model_type", None) not in QWEN_VISION_TYPES:
            raise wrong_family(what, checkpoint, "a Qwen3.5-VL or Qwen3-VL directory ('qwen3_5', 'qwen3_5_moe', "
                               "'qwen3_vl', 'qwen3_vl_moe') or an mmadapt model directory")
        return {"merge_size": vision.spatial_merge_size}, (("model.visual.merger.", ""),
                                                           ("model.visual.deepstack_merger_list.", "deepstack."))

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

    def project(self, visual: VisualTokens) -> VisualTokens:
        out_grids = self.output_grids(visual.grids)
        x = visual.features
        if visual.window != self.merge_size:
            x = x[self._window_order(visual)]
        hidden = self.in_dim * self.merge_size**2
        x = self.norm(x.view(-1, hidden)) if self.postshuffle_norm else self.norm(x).view(-1, hidden)
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

    def build(self, in_dim: int, out_dim: int, *, levels: int = 0, **options: Any) -> Projector:
        """A freshly initialised projector; `levels` DeepStack level projections besides the main one."""
        resolved = resolve_preset({"default": self.defaults}, "default", options, kind=f"projector {self.name!r}")
        return import_object(self.factory)(in_dim, out_dim, levels=levels, **resolved)

    def from_pretrained(self, path: str, in_dim: int, out_dim: int, *, dtype: Any = None, levels: int = 0,
                        **options: Any) -> Projector:
        """This projector with weights from `path`; registered defaults (e.g. depth) updated by `options`."""
        resolved = resolve_preset({"default": self.defaults}, "default", options, kind=f"projector {self.name!r}")
        return import_object(self.factory).from_pretrained(path, in_dim, out_dim, what=f"projector {self.name!r}",
                                                           dtype=dtype, levels=levels, **resolved)


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
    name="qwen_merger", description="Qwen's 2x2 spatial merge + MLP (the Qwen ViTs' merger, and Qwen3-VL's DeepStack "
    "level mergers)",
    factory="mmadapt.projectors:QwenMergerProjector"))
