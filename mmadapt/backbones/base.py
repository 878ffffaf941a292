"""What a backbone registration declares: the facts the glue needs and nothing more.

A backbone is a transformers causal LM used as is (`model.backbone` *is* the
`...ForCausalLM`), plus: its position scheme (1-D RoPE or M-RoPE), its image-span tokens
and their ids, its chat template and its default LoRA targets. Presets are dicts of
transformers config fields plus the three mmadapt token-id fields.

`from_pretrained(path)` works for every registered backbone with no code of its own: a directory
of the causal LM itself (`model_type == hf_model_type`, e.g. Vicuna's `LlamaForCausalLM`, sharded
`.bin` files included), a VLM directory whose `text_config` is that model type (llava-hf,
Qwen3.5-VL: the language model and `lm_head`, both key layouts transformers has used), or an
mmadapt model directory; a pre-quantised bitsandbytes 4-bit one (`*-bnb-4bit`) keeps its 4-bit layers
(`mmadapt.bnb`). Span token ids come from the VLM config when it has them. Tied embeddings
follow the top-level `tie_word_embeddings` of a VLM config (text configs often lack it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from mmadapt import bnb
from mmadapt.options import hf_options, resolve_preset
from mmadapt.quantize import nf4_targets
from mmadapt.registry import Registry, import_object
from mmadapt.weights import Checkpoint, Rules

# Key layouts of a causal LM inside VLM checkpoints: transformers 5 (`model.language_model.`) and the
# older layout the hub still ships (llava-hf: `language_model.model.`, `language_model.lm_head.`).
VLM_TEXT_RULES: Rules = (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
LM_RULES: Rules = (("model.language_model.", "model."), ("", ""))

TOKEN_FIELDS = ("image_token_id", "vision_start_token_id", "vision_end_token_id", "video_token_id")


@dataclass(frozen=True)
class SpanTokens:
    """Ids of the image placeholder and, for Qwen-style spans, the tokens around it."""

    image_token_id: int | None  # None: not known yet (a text LLM's checkpoint); images then fail loudly
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    video_token_id: int | None = None  # the video placeholder (Qwen's <|video_pad|>); None: the backbone has none

    def ids(self) -> list[int]:
        """Every span token id declared (placeholders, vision start / end), sorted: the ids a model must never
        generate, since an answer holding one would be read as visual input."""
        return sorted({getattr(self, f.name) for f in fields(self)} - {None})


@dataclass(frozen=True, kw_only=True)
class MoE:
    """A mixture-of-experts backbone's facts: its experts, its routers and their load-balancing loss.

    `expert_parameters`: 3-D expert tensors (nn.Parameters, not modules) that LoRA targets (peft's
    `target_parameters`). `router_parameters`: parameter-name suffixes of the routers: never LoRA targets, and
    frozen when the backbone trains fully unless the run asks for them (`stages.router: full`): routing learnt in
    pretraining is kept by default. `balance_loss`: "module:function" of transformers' load-balancing loss
    (`load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)`), added to the training loss x
    `router_aux_loss_coef` when the backbone outputs router logits (`mmadapt.loss.router_balance_loss`).
    `weight_layouts`: expert tensors that checkpoints may store in another layout (`mmadapt.weights.Fused`: one by
    one; `Transposed`: Qwen3-VL-MoE's hub layout), converted at load.
    """

    expert_parameters: tuple[str, ...] = ()
    router_parameters: tuple[str, ...] = ()
    balance_loss: str
    weight_layouts: tuple[Any, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Hybrid:
    """A stack with stateful layers beside attention (Qwen3.5's Gated DeltaNet): how packed rows stay isolated.

    `isolate(lm)` makes the stateful layers restart at sample boundaries (called once at build); `layer_masks`:
    the model takes one attention mask per layer type ({"full_attention": ..., "linear_attention": ...}).
    """

    isolate: Callable[[Any], None]
    layer_masks: bool = True


@dataclass(frozen=True, kw_only=True)
class BackboneSpec:
    """A registered LLM backbone: a transformers causal LM and the facts the glue needs (see the module docstring).

    Optional facts come in groups, so a plain backbone's registration stays short: `deepstack` (the model takes
    `visual_pos_masks` (B, L) and `deepstack_visual_embeds`, a list of K (N, D) levels, and adds level i at the image
    positions after decoder layer i: Qwen3-VL), `moe` (`MoE`) and `hybrid` (`Hybrid`).
    """

    name: str
    description: str
    model_class: str
    config_class: str
    hf_model_type: str
    positions: Literal["1d", "mrope"] = "1d"
    image_token: str = "<image>"
    video_token: str | None = None
    vision_start_token: str | None = None
    vision_end_token: str | None = None
    chat_template: str = "vicuna_v1"
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # linear layers a QLoRA base keeps in their precision (module name suffixes; `mmadapt.quantize`)
    keep_precision: tuple[str, ...] = ("lm_head",)
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    validate: Callable[[Any], None] | None = None
    deepstack: bool = False
    moe: MoE | None = None
    hybrid: Hybrid | None = None

    @property
    def image_text(self) -> str:
        """How an image is written in a chat's text: the image token inside the vision start / end tokens when the
        backbone brackets images (Qwen's `<|vision_start|><|image_pad|><|vision_end|>`), else the image token alone
        (LLaVA's `<image>`). A text LLM's own template gets images as this text (`JinjaTemplate.image_mode`)."""
        return f"{self.vision_start_token or ''}{self.image_token}{self.vision_end_token or ''}"

    @property
    def weight_layouts(self) -> tuple[Any, ...]:
        return self.moe.weight_layouts if self.moe is not None else ()

    def __post_init__(self) -> None:
        if self.positions not in ("1d", "mrope"):
            raise ValueError(f"backbone {self.name!r}: positions must be '1d' or 'mrope', got {self.positions!r}")
        if (self.vision_start_token is None) != (self.vision_end_token is None):
            raise ValueError(f"backbone {self.name!r}: give both vision_start_token and vision_end_token, or neither")

    def options(self, preset: str | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        return resolve_preset(self.presets, preset, overrides, kind=f"backbone {self.name!r}")

    def build_config(self, options: dict[str, Any]) -> tuple[Any, SpanTokens]:
        options = dict(options)
        tokens = SpanTokens(**{k: options.pop(k, None) for k in TOKEN_FIELDS})
        if self.vision_start_token and tokens.image_token_id is not None and tokens.vision_start_token_id is None:
            raise ValueError(f"backbone {self.name!r} brackets images with {self.vision_start_token}/"
                             f"{self.vision_end_token}: set vision_start_token_id and vision_end_token_id")
        config = import_object(self.config_class)(**options)
        if self.validate is not None:
            self.validate(config)
        return config, tokens

    def build(self, preset: str | None = "tiny", **overrides: Any) -> tuple[Any, SpanTokens]:
        """A freshly initialised transformers causal LM and its span token ids."""
        config, tokens = self.build_config(self.options(preset, overrides))
        return import_object(self.model_class)(config), tokens

    def from_pretrained(self, path: str, *, dtype: Any = None, **overrides: Any) -> tuple[Any, SpanTokens]:
        """The causal LM and span token ids from a checkpoint, built on the meta device and loaded strictly."""
        from mmadapt.weights import load_pretrained, merge_options

        what = f"backbone {self.name!r}"
        checkpoint = Checkpoint.open(path, what=what)
        options, rules = self.checkpoint_layout(checkpoint, what)
        config, tokens = self.build_config(merge_options(options, overrides, what=what, path=checkpoint.path))
        build = lambda: import_object(self.model_class)(config)  # noqa: E731
        if bnb.is_bnb_4bit(checkpoint):  # a pre-quantised (*-bnb-4bit) checkpoint: its layers stay 4-bit
            return bnb.load_4bit(build, checkpoint, rules, what=what, dtype=dtype, tied=tied_keys,
                                 layouts=self.weight_layouts), tokens
        lm = load_pretrained(build, checkpoint, rules, what=what, dtype=dtype, tied=tied_keys,
                             layouts=self.weight_layouts, quantize=nf4_targets(self.keep_precision))
        return lm, tokens

    def checkpoint_layout(self, checkpoint: Checkpoint, what: str) -> tuple[dict[str, Any], Rules]:
        """(options: the LM config plus span token ids, key rules) for this backbone inside `checkpoint`."""
        from mmadapt.weights import hf_config, mmadapt_part, wrong_family

        if checkpoint.model_type == "mmadapt":
            return mmadapt_part(checkpoint, "backbone", self.name, what)
        expected = f"{self.hf_model_type!r} or a VLM whose text_config is {self.hf_model_type!r}"
        if not checkpoint.config:
            raise wrong_family(what, checkpoint, expected)
        config = hf_config(checkpoint, what)
        if config.model_type == self.hf_model_type:
            return hf_options(config), LM_RULES
        text = getattr(config, "text_config", None)
        if getattr(text, "model_type", None) != self.hf_model_type:
            raise wrong_family(what, checkpoint, expected)
        options = hf_options(text)
        if "tie_word_embeddings" in checkpoint.config:  # the VLM's flag decides; text configs often lack it
            options["tie_word_embeddings"] = bool(checkpoint.config["tie_word_embeddings"])
        legacy = {"image_token_id": checkpoint.config.get("image_token_index")}
        for key in TOKEN_FIELDS:
            value = checkpoint.config.get(key, legacy.get(key))
            if value is not None:
                options[key] = value
        return options, VLM_TEXT_RULES

    def saved_options(self, lm: Any, tokens: SpanTokens) -> dict[str, Any]:
        """Options that rebuild exactly this backbone, with no preset."""
        return {**hf_options(lm.config), **{k: getattr(tokens, k) for k in TOKEN_FIELDS}}


def tied_keys(lm: Any) -> dict[str, str]:
    """{key: key it is tied to} of a causal LM's tied embeddings, both ways (either may be the one stored)."""
    if not getattr(lm.config, "tie_word_embeddings", False):
        return {}
    pairs = getattr(lm, "_tied_weights_keys", None) or {}
    return {a: b for k, v in pairs.items() for a, b in ((k, v), (v, k))}


BACKBONES: Registry[BackboneSpec] = Registry("backbone")
