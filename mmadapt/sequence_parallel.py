"""A model's forward under sequence parallelism: the whole sequence prepared, each rank's shard decoded, the results
combined into what one process returns.

`VisionLanguageModel.forward` hands itself here when it has a `SequenceParallel` (`model.sequence_parallel`, set by
the trainer for `distributed.sequence_parallel: N`). Every rank of the group holds the same batch; each then:

1. pads the rows to a multiple of N tokens (`pad_batch`: padding tokens, mask 0, labels -100, a packed row's padding
   segment extended), which changes no real token's result;
2. runs the model's one input path, `prepare`, on the *whole* sequence: the image spans, the vision side (replicated:
   every rank encodes the sample's pictures; sharded: `mmadapt.sequence_vision` encodes them across the group's ranks
   and hands `prepare` the gathered tokens), the contract, the injection, M-RoPE positions and the packed rows are
   computed exactly as in one process, before any split;
3. takes its shard, tokens [r * n, (r + 1) * n) of every row (`take`): embeddings, positions, DeepStack levels (split
   with the tokens' image mask), and checks the contract on it (`check_shard`): every image position of the shard
   holds its own visual token, the rank named in the error;
4. runs the decoder on the shard with `sequence_parallel=Shards(...)`: attention (`mmadapt.ulysses`) and Gated DeltaNet
   (`mmadapt.backbones.qwen3_5_layers`) exchange heads for tokens around the part that mixes tokens;
5. computes the loss or the head on its shard, with the labels shifted on the whole sequence first (a shard's last
   position predicts the next shard's first token), and combines the shards' results over the group (`combine`):
   sums (a loss over the global normaliser, per-row log-probs) add up, per-position results are gathered.

After the combination every rank of the group holds one process's result, and the computation on it (an objective's
loss) runs identically on each: the combining collectives' backward keeps each rank's own share, so the group's
gradients add up to one process's. The trainer averages gradients over every rank and scales the loss by the world
size as without sequence parallelism, and it reduces counts and logged sums over the data-parallel group only (the
ranks of a group hold the same numbers).

Shapes: B rows, L tokens (padded to a multiple of N), n = L / N, D width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from mmadapt import deepstack
from mmadapt.batch import VisionBatch
from mmadapt.contract import ImageTokenContractError, locate
from mmadapt.heads import (
    Head,
    HeadInputs,
    SequenceLogProbs,
    SequenceLogps,
    TokenLogProbs,
    TokenLogps,
    TokenLosses,
    TokenLossesOutput,
)
from mmadapt.loss import IGNORE_INDEX, causal_lm_loss, next_tokens
from mmadapt.model_io import ModelInputs
from mmadapt.packing import right_padded
from mmadapt.sequence_vision import MODES, encode_sharded, shardable
from mmadapt.ulysses import Shards, check_heads, gather_sequence, sum_replicated

HEADS = (SequenceLogps, TokenLogps, TokenLosses)  # the heads whose results `combine` knows


@dataclass(frozen=True)
class Shard:
    """This rank's part of a prepared batch: `inputs` (the decoder's keyword inputs for tokens [start, end)), `mask`
    (B, n) the shard's image positions, `levels` the DeepStack levels of its image positions."""

    inputs: dict[str, Any]
    mask: torch.Tensor
    features: torch.Tensor | None
    levels: tuple[torch.Tensor, ...]


class SequenceParallel:
    """A model's sequence parallelism: `group` (a process group of `size` ranks), `rank` this process's place in it;
    `vision` how the group's ranks run the vision side (`mmadapt.sequence_vision.MODES`: "replicated", every rank
    encodes the batch's pictures; "sharded", they are encoded across the ranks and gathered). Copied models (a frozen
    reference) share it; it holds no tensors."""

    def __init__(self, group: Any, size: int, rank: int, vision: str = "replicated") -> None:
        if vision not in MODES:
            raise ValueError(f"sequence-parallel vision {vision!r}: expected one of {', '.join(MODES)}")
        self.group, self.size, self.rank, self.vision = group, size, rank, vision

    def __deepcopy__(self, memo: dict[int, Any]) -> SequenceParallel:
        return self

    def __repr__(self) -> str:
        return f"SequenceParallel(size={self.size}, rank={self.rank}, vision={self.vision!r})"

    # ---- the forward -----------------------------------------------------------------------------------------------
    def forward(self, model: Any, batch: VisionBatch, labels: torch.Tensor | None, *, head: Head | None,
                return_logits: bool, visual: Any, visual_videos: Any, kwargs: dict[str, Any]) -> Any:
        """`model.forward`'s result, computed with this rank's shard of the sequence (see the module's docstring)."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if head is not None and not isinstance(head, HEADS):
            raise ValueError(f"head {type(head).__name__} has no sequence-parallel combination (the heads that do: "
                             f"{', '.join(h.__name__ for h in HEADS)}). Fix: distributed.sequence_parallel: 1, or "
                             "compute it from one of those heads' results")
        if model.router_aux_loss(kwargs):
            raise ValueError("an MoE router's load-balancing loss (output_router_logits) is not computed under "
                             "sequence parallelism. Fix: output_router_logits: false in the backbone's options, or "
                             "distributed.sequence_parallel: 1")
        length = batch.input_ids.shape[1]
        kwargs = {k: v for k, v in kwargs.items() if k not in ("use_cache", "logits_to_keep", "output_router_logits")}
        num_items = kwargs.pop("num_items_in_batch", None)
        batch, labels = pad_batch(batch, labels, self.size, pad_id=free_token(model))
        if self.vision == "sharded" and visual is None and visual_videos is None and shardable(model, batch):
            visual, visual_videos = encode_sharded(model, batch, self.group, self.size, self.rank)
        inputs = model.prepare(batch, visual=visual, visual_videos=visual_videos)
        shards = self.shards(inputs)
        shard = take(inputs, shards)
        if inputs.checked:
            check_shard(shard, shards)
        del inputs  # the whole sequence's embeddings are freed: a rank keeps its shard's (`take` copies them)
        decoder = model.backbone.get_decoder()
        with probe(model, shard):
            hidden = decoder(**shard.inputs, sequence_parallel=shards, use_cache=False, **kwargs).last_hidden_state
        output = model.backbone.get_output_embeddings()
        if head is None and (labels is None or return_logits or model.full_logits_loss):
            logits = gather_sequence(output(hidden), self.group, self.size, self.rank)[:, :length]
            loss = None if labels is None else model.backbone.loss_function(
                logits, labels[:, :length], model.backbone.config.vocab_size, num_items_in_batch=num_items)
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        top = self.top(hidden, labels, shard, shards, output, num_items, model.full_logits_loss)
        # an exact 0 that depends on the whole decoder: a shard without supervised positions still runs its backward
        # through the exchanges, which the group's other ranks wait for
        anchor = hidden[:1, :1, :1].sum() * 0 if torch.is_grad_enabled() and hidden.requires_grad else None
        if head is None:
            return CausalLMOutputWithPast(loss=self.loss(top, num_items, anchor))
        if isinstance(head, SequenceLogps) and head.reference is not None:
            head = replace(head, reference=(shards_of_supervised(head.reference[0], labels, shards),
                                            head.reference[1]))
        return self.combine(head(top), labels, shards, length, anchor)

    def shards(self, inputs: ModelInputs) -> Shards:
        """The layers' view of the whole sequence (`mmadapt.ulysses.Shards`)."""
        mask = None
        if inputs.packed is None and not right_padded(inputs.valid):  # causal, keys real (a padded query: itself)
            length = inputs.valid.shape[1]
            eye = torch.eye(length, dtype=torch.bool, device=inputs.valid.device)
            causal = torch.ones(length, length, dtype=torch.bool, device=inputs.valid.device).tril()
            mask = (causal & (inputs.valid[:, None, :] | eye))[:, None]
        return Shards(self.group, self.size, self.rank, inputs.valid, inputs.packed, mask)

    def top(self, hidden: torch.Tensor, labels: torch.Tensor | None, shard: Shard, shards: Shards,
            output: Any, num_items: Any, full_logits: bool) -> HeadInputs:
        """The shard's top for a head: one extra position at its end whose label is the next shard's first token, so
        that the heads' shift (position t predicts labels[t + 1]) predicts across the split exactly as in one
        process; the extra position itself predicts nothing."""
        start, end = shards.start, shards.start + shards.shard_length
        if labels is not None:
            labels = F.pad(labels[:, start:end + 1], (0, 1 if end == shards.length else 0), value=IGNORE_INDEX)
            labels = labels.to(hidden.device)
        return HeadInputs(hidden=F.pad(hidden, (0, 0, 0, 1)), labels=labels,
                          output=output, inputs_embeds=F.pad(shard.inputs["inputs_embeds"], (0, 0, 0, 1)),
                          valid=F.pad(shards.mine(shards.valid), (0, 1), value=False),
                          num_items_in_batch=num_items, full_logits=full_logits)

    def loss(self, top: HeadInputs, num_items: Any, anchor: torch.Tensor | None) -> torch.Tensor:
        """The language-model loss: the shards' summed token losses / `num_items` (else / their count)."""
        total = anchored(causal_lm_loss(top.hidden, top.output, top.labels, 1 if num_items is None else num_items,
                                        embeds=top.inputs_embeds), anchor)
        total = sum_replicated(total, self.group)
        if num_items is not None:
            return total
        return total / sum_replicated(top.supervised_mask().sum().to(total), self.group)

    def combine(self, result: Any, labels: torch.Tensor | None, shards: Shards, length: int,
                anchor: torch.Tensor | None = None) -> Any:
        """One process's head result from every rank's: sums added, per-position results gathered (`anchor`: an
        exact 0 added to each differentiable result, so that every rank's backward reaches its decoder)."""
        n = shards.shard_length
        if isinstance(result, SequenceLogProbs):
            states = result.states
            if states is not None:
                states = gather_supervised(states, labels, shards)
            return SequenceLogProbs(logps=sum_replicated(anchored(result.logps, anchor), self.group),
                                    tokens=sum_replicated(result.tokens, self.group),
                                    kl=None if result.kl is None else sum_replicated(result.kl, self.group),
                                    states=states)
        if isinstance(result, TokenLogProbs):  # position t's value sits at t + 1 (its label's index)
            def joined(x: torch.Tensor) -> torch.Tensor:
                full = gather_sequence(x[:, 1:n + 1], self.group, self.size, self.rank)
                return F.pad(full, (1, 0))[:, :length]

            return TokenLogProbs(logps=joined(anchored(result.logps, anchor)),
                                 entropy=None if result.entropy is None else joined(result.entropy))
        if isinstance(result, TokenLossesOutput):
            if result.aux_loss is not None:
                raise ValueError("an auxiliary loss is not combined under sequence parallelism")
            losses = gather_sequence(result.token_losses[:, :n], self.group, self.size, self.rank)[:, :length]
            return TokenLossesOutput(loss=sum_replicated(anchored(result.loss, anchor), self.group),
                                     token_losses=losses)
        raise TypeError(f"no sequence-parallel combination for {type(result).__name__}")


def anchored(x: torch.Tensor, anchor: torch.Tensor | None) -> torch.Tensor:
    """`x` + `anchor` (an exact 0 in the decoder's graph), or `x` without one."""
    return x if anchor is None else x + anchor.to(x.dtype)


# ---- the batch: padded to a multiple of the group's size ------------------------------------------------------------
def free_token(model: Any) -> int:
    """A token id that is no span token (the padding's: it must not read as an image position)."""
    taken = set(model.tokens.ids())
    return next(i for i in range(len(taken) + 1) if i not in taken)


def pad_batch(batch: VisionBatch, labels: torch.Tensor | None, multiple: int,
              pad_id: int = 0) -> tuple[VisionBatch, torch.Tensor | None]:
    """`batch` (and `labels`) with every row right-padded to a multiple of `multiple` tokens: padding tokens
    (`pad_id`), attention mask 0, labels -100, token types 0, positions 0, and in packed rows the row's padding
    segment extended (or added). Right padding reaches no real token of a causal model: nothing changes."""
    length = batch.input_ids.shape[1]
    extra = -length % multiple
    if not extra:
        return batch, labels
    mask = batch.attention_mask if batch.attention_mask is not None else torch.ones_like(batch.input_ids)
    changes: dict[str, Any] = {"input_ids": F.pad(batch.input_ids, (0, extra), value=pad_id),
                               "attention_mask": F.pad(mask, (0, extra), value=0)}
    if batch.mm_token_type_ids is not None:
        changes["mm_token_type_ids"] = F.pad(batch.mm_token_type_ids, (0, extra), value=0)
    if batch.position_ids is not None:
        changes["position_ids"] = F.pad(batch.position_ids, (0, extra), value=0)
    if batch.cu_seqlens is not None:
        changes["cu_seqlens"] = padded_cu_seqlens(batch.cu_seqlens, mask != 0, length + extra)
    if labels is not None:
        labels = F.pad(labels, (0, extra), value=IGNORE_INDEX)
    return batch.replace(**changes), labels


def padded_cu_seqlens(cu_seqlens: torch.Tensor, valid: torch.Tensor, new_length: int) -> torch.Tensor:
    """`cu_seqlens` for the same rows right-padded to `new_length`: a row's padding segment grows, or one is added."""
    rows, length = valid.shape
    cu = cu_seqlens.long().tolist()
    out = [0]
    for r in range(rows):
        ends = [c - r * length for c in cu if r * length < c <= (r + 1) * length]
        last_start = ends[-2] if len(ends) > 1 else 0
        if bool(valid[r, last_start:].any()):  # the row ends with a sample: a padding segment of its own
            ends.append(new_length)
        else:
            ends[-1] = new_length
        out += [r * new_length + e for e in ends]
    return torch.tensor(out, dtype=cu_seqlens.dtype, device=cu_seqlens.device)


# ---- the shard ----------------------------------------------------------------------------------------------------
def take(inputs: ModelInputs, shards: Shards) -> Shard:
    """This rank's tokens of the prepared whole sequence: the decoder's inputs, and what `check_shard` compares."""
    mask = shards.mine(inputs.spans.mask)
    held = held_tokens(inputs.spans.mask, shards)
    visual = inputs.visual
    features = None if visual is None else visual.features[held]
    levels = () if visual is None else tuple(level[held] for level in visual.levels)
    decoder_inputs: dict[str, Any] = {"inputs_embeds": shards.mine(inputs.inputs_embeds).clone(),
                                      "position_ids": shards.mine(inputs.position_ids, dim=-1),
                                      "attention_mask": _no_mask(inputs.attention_mask)}
    if levels:
        decoder_inputs.update(visual_pos_masks=mask, deepstack_visual_embeds=list(levels))
    return Shard(decoder_inputs, mask, features, levels)


def _no_mask(attention_mask: Any) -> Any:
    """The decoder's own attention-mask argument: none (the layers take the whole sequence's from `Shards`), a hybrid
    model's one per layer type."""
    return dict.fromkeys(attention_mask, None) if isinstance(attention_mask, dict) else None


def held_tokens(image_mask: torch.Tensor, shards: Shards) -> torch.Tensor:
    """(N,) bool over the visual tokens (row-major image positions, their order in `VisualTokens.features`): those
    at positions this rank holds."""
    where = image_mask.nonzero()[:, 1]
    return (where >= shards.start) & (where < shards.start + shards.shard_length)


def check_shard(shard: Shard, shards: Shards) -> None:
    """The contract on this rank's shard: every image position it holds receives its own visual token (the one the
    whole sequence's injection put there), so a split that shifts or cuts a span is caught on the rank it hits."""
    if shard.features is None or not shard.features.numel():
        return
    embeds = shard.inputs["inputs_embeds"]
    held = embeds[shard.mask]
    same = (held == shard.features.to(held.dtype)).all(-1)
    if bool(same.all()):
        return
    k = int((~same).nonzero()[0])
    row, position = (int(v) for v in shard.mask.nonzero()[k])
    raise ImageTokenContractError(
        f"sample {row}: sequence-parallel rank {shards.rank} of {shards.size} holds tokens [{shards.start}, "
        f"{shards.start + shards.shard_length}), and its image position {shards.start + position} does not hold that "
        f"position's visual token. Likely cause: the sequence was split at other positions than the image mask (a "
        f"shifted or reordered shard). Fix: split the prepared inputs with mmadapt.sequence_parallel.take")


def probe(model: Any, shard: Shard) -> Any:
    """The DeepStack check (levels added after their decoder layers) on this rank's image positions."""
    if not shard.levels or not model.config.check_contract:
        import contextlib

        return contextlib.nullcontext()
    spans = locate(shard.mask.long(), 1)
    return deepstack.probe(model.backbone, spans, _Levels(shard.levels))


@dataclass(frozen=True)
class _Levels:
    """The shard's DeepStack levels, as `deepstack.probe` reads visual tokens."""

    levels: tuple[torch.Tensor, ...]


# ---- supervised positions: the shard's and the whole sequence's ---------------------------------------------------
def _supervised_positions(labels: torch.Tensor, shards: Shards) -> torch.Tensor:
    """(N,) bool over the whole sequence's supervised positions (row-major, `HeadInputs.supervised`'s order): this
    rank's."""
    where = next_tokens(labels)[1].nonzero()[:, 1]
    return (where >= shards.start) & (where < shards.start + shards.shard_length)


def shards_of_supervised(states: torch.Tensor, labels: torch.Tensor, shards: Shards) -> torch.Tensor:
    """This rank's rows of (N, D) states of the whole sequence's supervised positions."""
    return states[_supervised_positions(labels, shards).to(states.device)]


def gather_supervised(states: torch.Tensor, labels: torch.Tensor, shards: Shards) -> torch.Tensor:
    """(N, D) the whole sequence's supervised states (detached) from every rank's (its positions' rows)."""
    import torch.distributed as dist

    mine = _supervised_positions(labels, shards).to(states.device)
    counts = [int(v) for v in sum_all(torch.nn.functional.one_hot(
        torch.tensor(shards.rank), shards.size).to(states.device) * int(mine.sum()), shards.group).tolist()]
    width = max(counts)
    padded = F.pad(states.detach(), (0, 0, 0, width - states.shape[0]))
    parts = [torch.empty_like(padded) for _ in range(shards.size)]
    dist.all_gather(parts, padded, group=shards.group)
    out = states.new_zeros(mine.shape[0], states.shape[1])
    owner = torch.zeros(mine.shape[0], dtype=torch.long, device=states.device)
    for r in range(shards.size):
        lo, hi = r * shards.shard_length, (r + 1) * shards.shard_length
        where = next_tokens(labels)[1].nonzero()[:, 1].to(states.device)
        owner[(where >= lo) & (where < hi)] = r
    for r in range(shards.size):
        out[owner == r] = parts[r][:counts[r]]
    return out


def sum_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def check_model(model: Any, size: int) -> None:
    """Refuse a model that `size` ranks cannot share a sequence of: attention heads (query and KV), Gated DeltaNet's
    key and value heads that do not divide by it, or an attention implementation without the exchange."""
    from mmadapt.packing import VARLEN

    config = model.backbone.config
    implementation = config._attn_implementation
    if implementation != VARLEN:
        raise ValueError(f"distributed.sequence_parallel: {size} needs the backbone's SDPA attention (mmadapt's "
                         f"{VARLEN!r}); it uses {implementation!r}. Fix: attn_implementation: sdpa in its options")
    check_heads("the backbone's attention", config.num_attention_heads, size,
                kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    if "linear_attention" in (getattr(config, "layer_types", None) or ()):
        check_heads("Gated DeltaNet's key", config.linear_num_key_heads, size)
        check_heads("Gated DeltaNet's value", config.linear_num_value_heads, size)
