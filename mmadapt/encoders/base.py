"""What every vision encoder is and returns.

An encoder turns pixels into a packed sequence of visual tokens and says, per image, the
token grid they came from. Fixed-size encoders (CLIP, SigLIP, timm) report the same grid
for every image; dynamic-resolution encoders (Qwen ViT) report one grid per image from
`image_grid_thw`. Projectors and the model read only this contract.

Encoders with DeepStack (Qwen3-VL) also return extra feature *levels*: the hidden states of
some of their blocks, each (N, D) in the same order and grid as the main tokens; each level has
its own projection and is added to the LLM's hidden states at the image positions after one of
its early layers (`VisionLanguageModel`: checked and verified like the main tokens).

Shapes: I images, N visual tokens in all (sum over images of t*h*w), D encoder width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from mmadapt.contract import ImageTokenContractError
from mmadapt.options import resolve_preset
from mmadapt.registry import Registry, import_object
from mmadapt.weights import Checkpoint, Rules

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class VisualTokens:
    """Packed visual tokens: `features` (N, D), `grids` (I, 3) of (t, h, w) in token units.

    `window` is the token order inside each image: 1 means row-major over (t, h, w);
    m > 1 means m x m spatial windows are contiguous (Qwen's merge-window order).
    `levels`: DeepStack feature levels, each shaped, ordered and gridded like `features`.
    """

    features: torch.Tensor
    grids: torch.Tensor
    window: int = 1
    levels: tuple[torch.Tensor, ...] = ()

    @property
    def tokens_per_image(self) -> torch.Tensor:
        return self.grids.prod(-1)

    @property
    def num_images(self) -> int:
        """I, the number of images (or video frames) these tokens are of."""
        return int(self.grids.shape[0])

    def zero(self) -> torch.Tensor:
        """The sum of no token (an exact 0 scalar, whatever the features hold) over tokens of no image
        (`VisionLanguageModel.vision_placeholder`): added to the embeddings, it changes nothing and keeps the vision
        side in the graph, every parameter of it with an exactly-zero gradient."""
        if self.num_images:
            raise ValueError(f"zero() is for the tokens of no image, these are of {self.num_images}")
        return torch.stack([t.float().sum() for t in (self.features, *self.levels)]).sum()

    def take(self, index: torch.Tensor) -> VisualTokens:
        """The tokens of images `index` (K,), in that order (an image may be taken more than once): features, grids
        and levels gathered, so rows that share an image receive the same tokens from one encoding."""
        counts = self.tokens_per_image
        starts = counts.cumsum(0) - counts
        index = index.to(counts.device)
        rows = torch.repeat_interleave(starts[index], counts[index])
        within = torch.arange(rows.numel(), device=rows.device) - torch.repeat_interleave(
            counts[index].cumsum(0) - counts[index], counts[index])
        rows = (rows + within).to(self.features.device)
        return VisualTokens(self.features[rows], self.grids[index], self.window,
                            tuple(level[rows] for level in self.levels))


class VisionEncoder(nn.Module):
    """Base class: `forward(pixel_values, image_grid_thw=None) -> VisualTokens`."""

    dynamic: ClassVar[bool] = False
    output_dim: int
    patch_size: int
    # DeepStack: the blocks whose outputs become extra feature levels (empty: a plain encoder). `emit_levels` is set
    # when the spec builds the encoder (`mmadapt.deepstack.emits`: off when the levels have nowhere to go).
    deepstack_levels: tuple[int, ...] = ()
    emit_levels: bool = True

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__()
        self.options = options

    def check_pixels(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None) -> None:
        raise NotImplementedError

    def enable_activation_checkpointing(self) -> None:
        """Recompute each block's activations in the backward instead of keeping them (non-reentrant): transformers'
        towers through their own switch; a family with another tower overrides this."""
        tower = getattr(self, "tower", None)
        if not getattr(tower, "supports_gradient_checkpointing", False):
            raise ValueError(f"{type(self).__name__} cannot checkpoint its activations: its tower has no switch for it")
        tower.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    def minimal_input(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The smallest valid (pixel_values, image_grid_thw): one black image, for the forward a batch without images
        still runs when every rank must run the same modules (`VisionLanguageModel.runs_vision_for_every_batch`)."""
        raise NotImplementedError(f"{type(self).__name__} defines no minimal_input()")

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> VisualTokens:
        raise NotImplementedError

    @classmethod
    def checkpoint_layout(cls, checkpoint: Checkpoint, what: str) -> tuple[dict[str, Any], Rules, tuple[str, ...]]:
        """(options from the checkpoint, key rules, key prefixes to skip); each family reads its own checkpoints."""
        raise ValueError(f"{what} cannot load pretrained weights: {cls.__name__} defines no checkpoint_layout()")

    @classmethod
    def from_pretrained(cls, path: str, *, what: str, dtype: Any = None, **overrides: Any) -> VisionEncoder:
        """Architecture and weights from `path` (built on the meta device, loaded strictly); `overrides` may
        change non-architecture options such as `feature_layer`."""
        from mmadapt.weights import load_pretrained, merge_options

        checkpoint = Checkpoint.open(path, what=what)
        options, rules, skip = cls.checkpoint_layout(checkpoint, what)
        options = merge_options(options, overrides, what=what, path=checkpoint.path)
        return load_pretrained(lambda: cls(**options), checkpoint, rules, what=what, skip=skip, dtype=dtype)

    def processor_defaults(self) -> dict[str, Any]:
        """Keyword arguments of this encoder's image processor (`mmadapt.data.processors`)."""
        raise NotImplementedError(
            f"{type(self).__name__} declares no image processor; define processor_defaults() returning "
            "FixedSizeProcessor (fixed encoders) or QwenProcessor (dynamic) keyword arguments"
        )


class FixedSizeEncoder(VisionEncoder):
    """An encoder that takes (I, C, S, S) images and yields the same (1, h, w) grid for each."""

    image_size: int
    num_channels: int = 3
    # Preprocessing this encoder was trained with (see `mmadapt.data.processors.FixedSizeProcessor`).
    processor_mean: ClassVar[tuple[float, float, float]] = IMAGENET_MEAN
    processor_std: ClassVar[tuple[float, float, float]] = IMAGENET_STD
    processor_mode: ClassVar[str] = "pad"
    processor_resample: ClassVar[str] = "bicubic"

    @property
    def grid(self) -> tuple[int, int, int]:
        side = self.image_size // self.patch_size
        return (1, side, side)

    def check_pixels(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None) -> None:
        expected = (self.num_channels, self.image_size, self.image_size)
        if pixel_values.ndim == 2:
            raise ImageTokenContractError(
                f"{type(self).__name__} is a fixed-size encoder and expects pixel_values of shape "
                f"(images, {', '.join(map(str, expected))}), but got flattened patches "
                f"{tuple(pixel_values.shape)} (a dynamic-resolution processor's output). "
                "Fix: preprocess with this encoder's own processor (resize/pad to "
                f"{self.image_size} px), or pick a dynamic encoder such as 'qwen3_5_vit'."
            )
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ImageTokenContractError(
                f"{type(self).__name__} expects pixel_values of shape (images, "
                f"{', '.join(map(str, expected))}), got {tuple(pixel_values.shape)}. "
                f"Fix: resize or pad every image to {self.image_size} x {self.image_size}."
            )
        if image_grid_thw is not None:
            bad = (image_grid_thw != torch.tensor(self.grid, device=image_grid_thw.device)).any(-1)
            if bad.any():
                raise ImageTokenContractError(
                    f"image_grid_thw row {int(bad.nonzero()[0])} is "
                    f"{image_grid_thw[bad][0].tolist()}, but this fixed-size encoder always yields "
                    f"{list(self.grid)}. Fix: drop image_grid_thw (fixed encoders do not need it)."
                )

    def minimal_input(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.zeros(1, self.num_channels, self.image_size, self.image_size, device=device), None

    def processor_defaults(self) -> dict[str, Any]:
        return {"image_size": self.image_size, "mean": self.processor_mean, "std": self.processor_std,
                "mode": self.processor_mode, "resample": self.processor_resample}

    def grids_for(self, num_images: int, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.grid], device=device).expand(num_images, 3)


@dataclass(frozen=True, kw_only=True)
class EncoderSpec:
    """A registered encoder: where its class lives and its presets (dicts of options)."""

    name: str
    description: str
    factory: str
    dynamic: bool
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)

    def options(self, preset: str | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        return resolve_preset(self.presets, preset, overrides, kind=f"encoder {self.name!r}")

    def build(self, preset: str | None = "tiny", *, levels: bool = True, **overrides: Any) -> VisionEncoder:
        """A freshly initialised encoder; `levels`: whether it computes its DeepStack levels (if it has any)."""
        return self._checked(import_object(self.factory)(**self.options(preset, overrides)), levels)

    def from_pretrained(self, path: str, *, dtype: Any = None, levels: bool = True, **overrides: Any) -> VisionEncoder:
        """This encoder's architecture and weights from a checkpoint (see the family's `checkpoint_layout`)."""
        factory = import_object(self.factory)
        encoder = factory.from_pretrained(path, what=f"encoder {self.name!r}", dtype=dtype, **overrides)
        return self._checked(encoder, levels)

    def _checked(self, encoder: VisionEncoder, levels: bool) -> VisionEncoder:
        if encoder.dynamic != self.dynamic:
            raise TypeError(f"encoder {self.name!r} registered dynamic={self.dynamic} but built {encoder.dynamic}")
        encoder.emit_levels = levels
        return encoder


ENCODERS: Registry[EncoderSpec] = Registry("encoder")


def grid_coords(grids: torch.Tensor, window: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Image index (N,) and (t, h, w) coordinates (3, N) of every token, in stored order.

    Tokens of image i come in `window` x `window` spatial blocks (row-major over blocks and
    inside each block); window 1 is plain row-major. Vectorised over all images.
    """
    sizes = grids.prod(-1)
    image = torch.repeat_interleave(torch.arange(len(grids), device=grids.device), sizes)
    offsets = torch.cumsum(sizes, 0) - sizes
    local = torch.arange(int(sizes.sum()), device=grids.device) - offsets[image]
    h, w = grids[image, 1], grids[image, 2]
    frame, rest = local // (h * w), local % (h * w)
    block, inner = rest // (window * window), rest % (window * window)
    blocks_per_row = w // window
    rows = (block // blocks_per_row) * window + inner // window
    cols = (block % blocks_per_row) * window + inner % window
    return image, torch.stack([frame, rows, cols])
