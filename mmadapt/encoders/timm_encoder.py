"""Any timm model as a fixed-size encoder: features from `forward_features`, prefix tokens dropped.

ViTs give (I, prefix + h*w, D); CNNs give (I, D, h, w), flattened row-major to (I, h*w, D).
Preprocessing comes from timm's own data config (`self.data_config`: input size, mean, std,
interpolation).

Pretrained: a local weights file (`.safetensors` / `.pth` / `.bin`) or a timm hub directory
(config.json with `architecture`), in timm's format or an original one (OpenCLIP, OpenAI CLIP,
DINOv2, ...). Loading goes through timm's own `pretrained_cfg_overlay=dict(file=...)` path, which
runs the model's checkpoint converters (`checkpoint_path` would not), strictly; the classifier head
is dropped after. timm builds and initialises its modules itself, so this is the one family not
built on the meta device. No weights are ever downloaded: a name that points timm at another source
(`hf-hub:...`, `local-dir:...`, a path) is refused (`refuse_other_sources`).
"""

from __future__ import annotations

from typing import Any

import torch

from mmadapt.encoders.base import FixedSizeEncoder, VisualTokens
from mmadapt.weights import Checkpoint, MissingWeightsError, parse_dtype


class TimmEncoder(FixedSizeEncoder):
    def __init__(self, *, model_name: str, tower: Any = None, **model_kwargs: Any) -> None:
        """A fresh timm model, or `tower`: one `create_timm_tower` already loaded (see `from_pretrained`)."""
        import timm

        super().__init__({"model_name": model_name, **model_kwargs})
        if model_name not in timm.list_models():
            raise ValueError(f"timm has no model {model_name!r}; see timm.list_models('*pattern*')")
        self.tower = tower if tower is not None else timm.create_model(model_name, pretrained=False, num_classes=0,
                                                                         **model_kwargs)
        self.data_config = timm.data.resolve_data_config(model=self.tower)
        img_size = getattr(getattr(self.tower, "patch_embed", None), "img_size", None)
        if img_size is not None:  # a ViT built with img_size=... keeps its pretrained cfg's input size
            self.data_config["input_size"] = (self.data_config["input_size"][0], *img_size)
        channels, height, width = self.data_config["input_size"]
        if height != width:
            raise ValueError(f"timm encoder {model_name!r} takes {height}x{width} inputs; only square ones work")
        self.num_channels, self.image_size = channels, height
        self.patch_size = self.tower.feature_info[-1]["reduction"]
        self.num_prefix_tokens = getattr(self.tower, "num_prefix_tokens", 0)
        self.output_dim = self.tower.num_features

    @classmethod
    def from_pretrained(cls, path: str, *, what: str, dtype: Any = None, model_name: str | None = None,
                        **model_kwargs: Any) -> TimmEncoder:
        from mmadapt.weights import Provenance

        checkpoint = Checkpoint.open(path, what=what)
        refuse_other_sources(checkpoint.config, model_name, what, checkpoint.path)
        model_name = model_name or checkpoint.config.get("architecture")
        if not model_name:
            raise ValueError(f"{what}: {checkpoint.path} does not say which timm architecture it holds (no config.json "
                             "with 'architecture'). Fix: set options.model_name, e.g. 'vit_base_patch16_224'.")
        if len(checkpoint.files) != 1:
            raise ValueError(f"{what}: timm loads one weight file; {checkpoint.path} has {len(checkpoint.files)}")
        file = checkpoint.files[0]
        tower = create_timm_tower(model_name, file, what, **model_kwargs)
        tensors = map(checkpoint.tensor, checkpoint.keys())
        file_dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
        tower.to(parse_dtype(dtype) or file_dtype)  # default: the file's dtype
        encoder = cls(model_name=model_name, tower=tower, **model_kwargs)
        encoder.provenance = Provenance(checkpoint)
        return encoder

    def enable_activation_checkpointing(self) -> None:
        """timm's own per-block checkpointing (`set_grad_checkpointing`; non-reentrant by timm's default)."""
        if not hasattr(self.tower, "set_grad_checkpointing"):
            raise ValueError(f"timm model {self.options['model_name']!r} cannot checkpoint its activations")
        self.tower.set_grad_checkpointing(True)

    def processor_defaults(self) -> dict[str, Any]:
        """Mean, std, interpolation from timm's data config; "pad" (prismatic's letterbox) keeps the whole image."""
        interpolation = self.data_config.get("interpolation", "bicubic")
        fixed = interpolation in ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")  # not "random"
        return {**super().processor_defaults(), "mean": tuple(self.data_config["mean"]),
                "std": tuple(self.data_config["std"]), "resample": interpolation if fixed else "bicubic"}

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None) -> VisualTokens:
        self.check_pixels(pixel_values, image_grid_thw)
        features = self.tower.forward_features(pixel_values.to(next(self.tower.parameters()).dtype))
        if features.ndim == 4:  # CNN feature map (I, D, h, w) -> (I, h*w, D)
            features = features.flatten(2).transpose(1, 2)
        else:
            features = features[:, self.num_prefix_tokens :]
        expected = self.grid[1] * self.grid[2]
        assert features.shape[1] == expected, f"timm gave {features.shape[1]} tokens, grid says {expected}"
        grids = self.grids_for(pixel_values.shape[0], pixel_values.device)
        return VisualTokens(features.reshape(-1, features.shape[-1]), grids)


def refuse_other_sources(config: dict[str, Any], model_name: str | None, what: str, path: Any) -> None:
    """A local checkpoint names a timm registry architecture, never another source: `hf-hub:org/name` or
    `local-dir:/path` (timm would fetch those weights while the provenance hashes the local file), nor a path or a
    hub repo id; checked in `options.model_name` and config.json's `architecture`, `model_name` and
    `pretrained_cfg`."""
    pretrained_cfg = config.get("pretrained_cfg")
    named = {"options.model_name": model_name, "architecture": config.get("architecture"),
             "model_name": config.get("model_name"),
             **({f"pretrained_cfg.{k}": v for k, v in pretrained_cfg.items()} if isinstance(pretrained_cfg, dict)
                else {"pretrained_cfg": pretrained_cfg})}
    for field, value in named.items():
        if not isinstance(value, str):
            continue
        names_source = field in ("options.model_name", "architecture", "model_name") and any(c in value for c in ":/\\")
        if names_source or value.startswith(TIMM_SOURCES):
            raise ValueError(f"{what}: {path} names {field} {value!r}, another source of weights than the local file "
                             "(timm would fetch it); mmadapt loads only the weights in the checkpoint it is given. "
                             "Fix: name the timm architecture itself (e.g. 'vit_base_patch16_224') in config.json or "
                             "options.model_name, with the weights saved in the checkpoint")


def create_timm_tower(model_name: str, file: Any, what: str, **model_kwargs: Any) -> Any:
    """timm's own pretrained path on a local file, strict; the head is loaded if the file has one, then dropped.

    First with the pretrained config's classifier (files that carry a head load strictly), then headless
    (`num_classes=0` in the overlay too, so timm keeps its strict check); either way timm runs the
    model's checkpoint converters.
    """
    import timm

    errors = []
    for overlay in ({"file": str(file)}, {"file": str(file), "num_classes": 0}):
        kwargs = dict(model_kwargs) if "num_classes" not in overlay else {**model_kwargs, "num_classes": 0}
        try:
            tower = timm.create_model(model_name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
        except RuntimeError as e:  # timm's strict load_state_dict: missing / unexpected / mis-shaped keys
            errors.append(" ".join(str(e).split())[:500])
            continue
        tower.reset_classifier(0)
        return tower
    raise MissingWeightsError(f"{what}: {file} does not fit timm model {model_name!r} (with or without its classifier "
                              f"head): {errors[-1]}")


TIMM_SOURCES = ("hf-hub:", "local-dir:", "timm:", "http:", "https:", "file:")  # what timm reads as another source
TIMM_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(model_name="vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2),
    "vit-b-16-224": dict(model_name="vit_base_patch16_224"),
    "convnext-tiny": dict(model_name="convnext_tiny"),
}
