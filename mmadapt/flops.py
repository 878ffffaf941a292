"""The FLOPs of one training step of a built model on an actual batch, per part: vision, projector, llm, output.

`step_flops(model, batch)` counts matmul-like work only, the convention of `torch.utils.flop_counter.FlopCounterMode`
(mm, bmm, addmm, baddbmm, convolution, SDPA): norms, activations, softmax, rotary embeddings, routing bookkeeping and
other elementwise work are not counted. One multiply-add is 2 FLOPs.

Forward, per part (counted from the built modules' shapes, so a newly registered family mostly works unchanged):
- every `nn.Linear` (LoRA's adapters included) a token passes: 2 * in * out per row; a convolution (a patch
  embedding, Gated DeltaNet's causal conv): 2 * weight.numel() per output position (groups included);
- an MoE layer's routed experts (a module with `num_experts` and (E, ., .) weights): 2 * (weights of one expert) per
  token and chosen expert, top-k from the router next to it; the router's (E, D) weight: 2 * E * D per token;
- attention scores and values: 4 * n^2 * heads * head_dim per attention layer and attended sequence of n tokens,
  the full n x n square (what SDPA's math kernel computes and what FlopCounterMode counts for every SDPA kernel,
  causal or not; flash kernels skip about half of it for a causal mask, and their backward recomputes the scores,
  which FlopCounterMode counts as 2.5x the forward instead of the 2x counted here).
Rows, from the batch:
- vision: each image's token sequence (fixed-size encoders: grid h * w plus prefix tokens such as CLS; dynamic ones:
  t * h * w patches of `image_grid_thw`); attention per image (sum of n_i^2); a patch embedding per patch; a pooling
  head (SigLIP's `head`, which the tower runs though the features do not use it) over its probe queries;
- projector: its output tokens (the Qwen merger's 2x2-merged ones), for the main tokens and each DeepStack level;
- llm: every position of the (B, L) batch, padding included (the linear layers compute it); attention per row
  (B * L^2) for padded batches, per packed sample (sum of l_i^2, as the varlen kernel) for packed ones
  (`cu_seqlens`; the torch path without flash-attn pads groups of samples to their longest: a little more);
  only `config.layer_types` "full_attention" layers (all layers without `layer_types`).
  Not counted: Gated DeltaNet's recurrence (its chunked form is a few small matmuls per token whose count depends
  on the kernel: the torch fallback pads every sequence to 64-token chunks);
- output: `lm_head` over the supervised positions only when the loss skips the full logits (`mmadapt.loss`), else
  over every position.

Training step = forward + backward. Backward, per part and term: the input gradients (= forward) where the gradient
flows (a part with trainable parameters, or one with a trainable part before it), plus the weight gradients
(= forward) of the matmuls whose weights require grad; attention's input gradients are 2x its forward (both operands
are activations). No input gradient for: the patch embedding (the pixels), a Linear that no trainable parameter
precedes within its part (registration order) when nothing before the part trains (an MLP projector's first layer
behind a frozen encoder; a LoRA-only LLM's first frozen projections), `lm_head` with nothing trainable before it.
So: a trained part costs about 3x its forward, a frozen part the gradient passes through 2x (its attention 3x), a
frozen encoder that nothing before it trains 1x. Layers whose output the loss does not use (a CLIP tower's layers
after `feature_layer`, SigLIP's pooling head) run forward only: 1x.

Shapes: B rows, L tokens per row, I images, n tokens of one attended sequence, D width, E experts.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field
from typing import Any

import torch
from torch import nn

from mmadapt.loss import IGNORE_INDEX
from mmadapt.packing import Segments, as_bool_mask

PARTS = ("vision", "projector", "llm", "output")


@dataclass(frozen=True)
class Work:
    """FLOPs of one forward pass of a part: matmuls with a weight that requires grad (`trainable`) or not
    (`frozen`), weightless attention matmuls (`attention`: both operands are activations), the share of `trainable +
    frozen` whose input takes no gradient (`no_input_grad`: the patch embedding), and work whose result the loss
    does not use (`unused`: encoder layers after the selected feature layer, a pooling head): no backward."""

    trainable: float = 0.0
    frozen: float = 0.0
    attention: float = 0.0
    no_input_grad: float = 0.0
    unused: float = 0.0

    @property
    def forward(self) -> float:
        return self.trainable + self.frozen + self.attention + self.unused

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def as_unused(self) -> Work:
        return Work(unused=self.forward)

    def step(self, flows: bool) -> float:
        """Forward + backward: the input gradients where the gradient flows (a weight matmul's: 1x its forward; an
        attention matmul's: 2x, one per activation operand), the weight gradients where weights train (1x)."""
        inputs = self.trainable + self.frozen - self.no_input_grad + 2 * self.attention
        return self.forward + (inputs if flows else 0.0) + self.trainable


@dataclass(frozen=True)
class StepFlops:
    """One training step's FLOPs per part (`step`), their forward passes (`forward`), and sub-terms (`detail`:
    forward FLOPs of attention and routed experts, for comparisons)."""

    step: dict[str, float]
    forward: dict[str, float]
    detail: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.step.values())

    @property
    def vision_share(self) -> float:
        """The share of the step spent before the LLM: encoder + projector."""
        return (self.step["vision"] + self.step["projector"]) / self.total if self.total else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**self.step, "total": self.total, "vision_share": self.vision_share}


def step_flops(model: Any, batch: dict[str, Any]) -> StepFlops:
    """FLOPs of `model(**batch).loss.backward()` in training mode, per part (see the module docstring)."""
    if batch.get("labels") is None:
        raise ValueError("a training step needs labels; the batch has none")
    trains = [trainable(model.encoder), trainable(model.projector), trainable(model.backbone.get_decoder())]
    flows = {"vision": trains[0], "projector": any(trains[:2]), "llm": any(trains), "output": any(trains)}
    work = {"vision": Work(), "projector": Work()}
    detail: dict[str, float] = {}
    if batch.get("pixel_values") is not None:
        work["vision"], detail["vision.attention"] = vision_work(model.encoder, batch)
        work["projector"] = projector_work(model, batch, fixed_input=not trains[0])
    work["llm"], detail["llm.attention"], detail["llm.routed_experts"] = llm_work(model, batch,
                                                                                 fixed_input=not any(trains[:2]))
    work["output"] = linear_work(model.backbone.get_output_embeddings(), output_rows(model, batch["labels"]))
    return StepFlops({p: work[p].step(flows[p]) for p in PARTS}, {p: work[p].forward for p in PARTS}, detail)


def trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _split(flops: float, weight: torch.Tensor) -> Work:
    return Work(trainable=flops) if weight.requires_grad else Work(frozen=flops)


def linear_work(module: nn.Module, rows: int, *, skip: tuple[nn.Module, ...] = (), fixed_input: bool = False) -> Work:
    """Every `nn.Linear` in `module` (outside `skip`) applied to `rows` rows. `fixed_input`: `module`'s input needs no
    gradient (nothing before it trains), so neither does a Linear's before the first trainable parameter (in
    registration order, e.g. an MLP projector's first layer when the encoder is frozen)."""
    skipped = {id(m) for s in skip for m in s.modules()}
    total, seen = Work(), False
    for m in module.modules():
        if id(m) in skipped:
            continue
        if isinstance(m, nn.Linear):
            flops = 2.0 * m.in_features * m.out_features * rows
            total = total + _split(flops, m.weight) + Work(no_input_grad=flops if fixed_input and not seen else 0.0)
        seen = seen or any(p.requires_grad for p in m.parameters(recurse=False))
    return total


def conv_work(module: nn.Module, positions: int, *, input_grad: bool = True) -> Work:
    """Every convolution in `module`, `positions` output positions each: 2 * weight.numel() per position."""
    total = Work()
    for m in module.modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            flops = 2.0 * m.weight.numel() * positions
            total = total + _split(flops, m.weight) + Work(no_input_grad=0.0 if input_grad else flops)
    return total


def attention_layers(module: nn.Module) -> int:
    """Self-attention modules in `module`: classes named `...Attention` (not a pooling head's nn.MultiheadAttention)."""
    return sum(type(m).__name__.endswith("Attention") and not isinstance(m, nn.MultiheadAttention)
               for m in module.modules())


def vision_work(encoder: nn.Module, batch: dict[str, Any]) -> tuple[Work, float]:
    """The encoder's forward on the batch's images, and its attention part."""
    grids = batch.get("image_grid_thw")
    if grids is not None:  # dynamic resolution: each image's t * h * w patches form its sequence
        patches = [int(n) for n in grids.prod(-1).tolist()]
        sequences = patches
    else:
        _, h, w = encoder.grid
        images = batch["pixel_values"].shape[0]
        prefix = getattr(encoder, "num_prefix_tokens", int(getattr(encoder, "has_cls", False)))
        patches, sequences = [h * w] * images, [h * w + prefix] * images
    heads = [m for m in encoder.modules() if hasattr(m, "probe")]  # pooling heads (SigLIP's)
    after = unused_layers(encoder)
    per_layer = 4.0 * encoder.output_dim * sum(n * n for n in sequences)
    live = (linear_work(encoder, sum(sequences), skip=(*heads, *after))
            + conv_work(encoder, sum(patches), input_grad=False)
            + Work(attention=per_layer * (attention_layers(encoder) - sum(map(attention_layers, after)))))
    unused = Work()
    for layer in after:
        unused = unused + linear_work(layer, sum(sequences)) + Work(attention=per_layer * attention_layers(layer))
    for head in heads:
        unused = unused + pooling_head_work(head, sequences)
    return live + unused.as_unused(), per_layer * attention_layers(encoder)


def unused_layers(encoder: nn.Module) -> list[nn.Module]:
    """The tower's layers after the hidden state the encoder returns (`feature_layer`: LLaVA's -2 skips the last)."""
    index = getattr(encoder, "feature_layer", None)
    lists = [m for m in encoder.modules() if isinstance(m, nn.ModuleList)]
    if index is None or not lists:
        return []
    layers = max(lists, key=len)
    return list(layers)[index % (len(layers) + 1):]  # hidden_states[k] is layer k's output (0: the embeddings)


def pooling_head_work(head: nn.Module, sequences: list[int]) -> Work:
    """An attention-pooling head: probe queries (q per image) over the image's n tokens, then its MLP on the queries."""
    q = head.probe.shape[1]
    total = Work()
    for m in head.modules():
        if isinstance(m, nn.MultiheadAttention):
            width = m.embed_dim
            projections = 2.0 * width * width * sum(q + 2 * n for n in sequences)  # q rows -> Q; n rows -> K, V
            total = total + _split(projections, m.in_proj_weight) + Work(attention=4.0 * width * q * sum(sequences))
    return total + linear_work(head, q * len(sequences))


def projector_work(model: Any, batch: dict[str, Any], *, fixed_input: bool) -> Work:
    """The projector on its output tokens: the main projection and each DeepStack level's (`deepstack.{i}`)."""
    grids = batch.get("image_grid_thw")
    if grids is None:
        grids = torch.tensor([model.encoder.grid] * batch["pixel_values"].shape[0])
    rows = int(model.projector.output_grids(grids).prod(-1).sum())
    levels = tuple(getattr(model.projector, "deepstack", ()))
    total = linear_work(model.projector, rows, skip=levels, fixed_input=fixed_input)
    for level in levels:
        total = total + linear_work(level, rows, fixed_input=fixed_input)
    return total


def llm_work(model: Any, batch: dict[str, Any], *, fixed_input: bool) -> tuple[Work, float, float]:
    """The decoder layers' forward (every position), its attention part and its routed-expert part."""
    decoder, config = model.backbone.get_decoder(), model.backbone.config
    rows, length = batch["input_ids"].shape
    tokens = rows * length
    routers = [m for m in decoder.modules() if hasattr(m, "top_k") and getattr(m, "weight", None) is not None]
    experts = [m for m in decoder.modules() if hasattr(m, "num_experts") and any(
        p.ndim == 3 for p in m.parameters(recurse=False))]
    work = linear_work(decoder, tokens, fixed_input=fixed_input) + conv_work(decoder, tokens)
    for router in routers:
        work = work + _split(2.0 * router.weight.numel() * tokens, router.weight)
    top_k = routers[0].top_k if routers else getattr(config, "num_experts_per_tok", 0)
    routed = Work()
    for m in experts:
        for p in m.parameters(recurse=False):
            if p.ndim == 3:
                routed = routed + _split(2.0 * p[0].numel() * top_k * tokens, p)
    layer_types = getattr(config, "layer_types", None)
    full = layer_types.count("full_attention") if layer_types else config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 4.0 * config.num_attention_heads * head_dim * full * sum(n * n for n in sequence_lengths(batch))
    return work + routed + Work(attention=attention), attention, routed.forward


def sequence_lengths(batch: dict[str, Any]) -> list[int]:
    """The attended sequences of the LLM: each packed sample (`cu_seqlens`), else each padded row."""
    rows, length = batch["input_ids"].shape
    if batch.get("cu_seqlens") is None:
        return [length] * rows
    valid = as_bool_mask(batch.get("attention_mask"), batch["input_ids"])
    return [end - start for _, start, end in Segments.from_cu_seqlens(batch["cu_seqlens"], valid).bounds]


def output_rows(model: Any, labels: torch.Tensor) -> int:
    """Positions `lm_head` runs on: the supervised ones (`mmadapt.loss.supervised`), or all with full logits."""
    if model.full_logits_loss or not model.loss_without_logits():
        return labels.numel()
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
