"""Decoding with images: `VisionLanguageModel.generate` (from `GenerateMixin`) and the choice of each step's token.

`generate` runs the model's one input path (`prepare`) once for the prompt (the prefill keeps the logits of the last
position only), then one backbone step per new token on the KV cache. Each step's token is chosen by `next_token`: the
placeholder tokens (`placeholder_ids`) are never generated (`suppressed`), an optional repetition penalty
(`penalize_repetition` over `seen_tokens`) comes next, then greedy choice or a sample from the top-p nucleus.
`token_logprobs` gives a step's log-probs as the model predicts them, and `GenerationStep` carries a step to the
caller (`on_step`: streaming, stop strings, cancelled requests). Under FSDP2 the ranks agree on when decoding ends
(`ranks_step_together`, `any_rank_decoding`): a rank whose answers ended steps on with padding until every rank's
have, since each step's forward gathers parameters with the other ranks.

Shapes: B batch, L tokens, T new tokens, V vocabulary, K alternatives or suppressed ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import distributed as dist

from mmadapt.backbones import SpanTokens
from mmadapt.batch import VisionBatch
from mmadapt.packing import as_bool_mask


@dataclass(frozen=True)
class GenerationStep:
    """One step of `generate`, as `on_step` receives it (B rows, K alternatives). A row that had already finished
    holds `pad_token_id` and log-probs of no meaning. The log-probs (float32) are those of the model's distribution
    (`token_logprobs`), present when `generate` was given `logprobs`."""

    index: int  # 0 for the first new token
    tokens: torch.Tensor  # (B,) the chosen tokens
    logprobs: torch.Tensor | None = None  # (B,) the chosen tokens' log-probs
    top_ids: torch.Tensor | None = None  # (B, K) the K most likely tokens, most likely first
    top_logprobs: torch.Tensor | None = None  # (B, K) their log-probs
    logits: torch.Tensor | None = None  # (B, V) the step's logits as the model gives them (before any suppression,
    # penalty, temperature or nucleus): for a caller that scores the step its own way (an RL rollout's log-probs)


class GenerateMixin:
    """`generate` for `VisionLanguageModel` (its `prepare`, `tokens`, `backbone` and `uses_mrope`); mmadapt's own,
    not transformers' `GenerationMixin`."""

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                 max_new_tokens: int = 32, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int = 0, *, temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None, on_token: Callable[[torch.Tensor], None] | None = None,
                 images_per_sample: torch.Tensor | None = None,
                 mm_token_type_ids: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                 video_grid_thw: torch.Tensor | None = None,
                 videos_per_sample: torch.Tensor | None = None, repetition_penalty: float = 1.0,
                 logprobs: int | None = None,
                 on_step: Callable[[GenerationStep], Any] | None = None,
                 image_index: torch.Tensor | None = None, video_index: torch.Tensor | None = None,
                 row_seeds: torch.Tensor | None = None,
                 visual: Any = None, visual_videos: Any = None, repeats: int = 1) -> torch.Tensor:
        """Decoding with images: greedy (`temperature` 0, the default) or sampled (temperature, nucleus `top_p`,
        `generator` for reproducibility). Returns only the new tokens (B, T), `pad_token_id` after EOS;
        `on_token(tokens (B,))` is called as each step's tokens are chosen (streaming).

        The placeholder tokens (`placeholder_ids(self.tokens)`: image / video pads, vision start / end) are never
        generated: their logits are -inf before greedy or sampled choice, so an answer never holds visual input.
        Rows may be padded on either side: they are left-aligned internally.

        `repetition_penalty` (transformers' `RepetitionPenaltyLogitsProcessor`; 1.0 = off): the logit of every token
        already in the row (its prompt's tokens, padding excluded, and those generated so far) is divided by it when
        positive and multiplied by it when negative, before the greedy or sampled choice.
        `on_step(step)` gets each step as a `GenerationStep` (the tokens and, with `logprobs=K`, their log-probs and
        the K most likely alternatives: see `token_logprobs`); it may end rows early by returning True (all rows) or
        a (B,) bool tensor (the rows to end; a stop string, a cancelled request): those rows are done, as after EOS.
        `image_index` (rows sharing encoded images, `VisionBatch`): each picture of `pixel_values` is encoded once
        for every row that shows it (`video_index`: each video likewise). `row_seeds` (B,) int64: each row samples
        from its own seed (`row_sample`), so a row's answer does not depend on the rows beside it - on which rank,
        in which batch, or after a resume it is generated (`generator` is then not used). `visual` / `visual_videos`:
        the rows' images / videos already encoded (`VisualTokens`, as `forward` takes them, the tokens of no image
        included): the vision side does not run for them. Where every rank must run the vision side
        (`runs_vision_for_every_batch`: a sharded one), the prefill of rows without pictures runs it on no picture.

        `repeats` R (an RL group's G answers to one prompt): each of the B prompt rows is answered R times. Its prompt
        is prefilled once and the cache copied R ways (`Cache.reorder_cache`: attention keys and values, Gated
        DeltaNet conv and recurrent states alike); the result has B x R rows, a row's R answers side by side (row r
        answers prompt r // R), and `row_seeds` then has B x R entries.

        Under FSDP2 (a multi-process run whose model is sharded: `ranks_step_together`) the ranks agree at each step
        on whether any of them still decodes (`any_rank_decoding`: one all-reduce of a flag), and a rank whose rows
        are all done keeps stepping, its rows fed padding, until none does: every block's parameter gather then pairs
        with the other ranks'. Those extra steps add nothing to its outputs (no token, no `on_token` / `on_step`).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        batch = VisionBatch.of(locals())  # the arguments that are inputs, by VisionBatch's fields
        valid = as_bool_mask(attention_mask, input_ids)
        order = torch.argsort(valid.int(), dim=1, stable=True)  # padding first, tokens in order
        input_ids, valid = input_ids.gather(1, order), valid.gather(1, order)
        types = None if mm_token_type_ids is None else mm_token_type_ids.gather(1, order)
        inputs = self.prepare(batch.replace(input_ids=input_ids, attention_mask=valid, mm_token_type_ids=types),
                              visual=visual, visual_videos=visual_videos)
        next_position = inputs.position_ids.amax(dim=(0, 2) if self.uses_mrope else 1) + 1
        with inputs.verified(self.backbone):  # the prefill: logits of the last position only (V x D per token)
            out = self.backbone(**inputs.backbone_kwargs(), use_cache=True, logits_to_keep=1)
        if repeats != 1:
            out, input_ids, valid, next_position = repeated(out, repeats, input_ids, valid, next_position)
        if row_seeds is not None and len(row_seeds) != input_ids.shape[0]:
            raise ValueError(f"row_seeds has {len(row_seeds)} entries for {input_ids.shape[0]} answers "
                             f"({input_ids.shape[0] // repeats} prompts x repeats {repeats})")
        eos = torch.tensor([] if eos_token_id is None else eos_token_id, device=input_ids.device).flatten()
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        suppress = torch.tensor(placeholder_ids(self.tokens), dtype=torch.long, device=input_ids.device)
        in_step = ranks_step_together(self)  # FSDP2: every step's forward gathers parameters with the other ranks
        seen = None  # (B, V) the tokens each row holds, for the repetition penalty
        new_tokens = []
        for step in range(max_new_tokens):
            logits = out.logits[:, -1]
            if repetition_penalty != 1.0 and seen is None:
                seen = seen_tokens(input_ids, valid, logits.shape[-1])  # the prompt's tokens
            token = next_token(logits, temperature, top_p, generator, suppress=suppress,
                               repetition_penalty=repetition_penalty, seen=seen,
                               row_seeds=None if row_seeds is None else row_seeds * 1_000_003 + step
                               ).masked_fill(done, pad_token_id)
            new_tokens.append(token)
            if on_token is not None:
                on_token(token)
            if on_step is not None:
                scores = token_logprobs(logits, token, logprobs, suppress=suppress) if logprobs is not None else None
                stop = on_step(GenerationStep(step, token, *(scores or (None, None, None)), logits=logits))
                if stop is not None:
                    done |= torch.as_tensor(stop, dtype=torch.bool, device=done.device).expand_as(done)
            if seen is not None:
                seen[torch.arange(len(token), device=token.device), token.clamp(max=seen.shape[1] - 1)] = True
            done |= torch.isin(token, eos)
            more = not bool(done.all()) and step < max_new_tokens - 1  # no forward for a token that is never used
            others = any_rank_decoding(more, done.device) if in_step else more
            if not more:
                break
            out, valid, next_position = self.decode_step(token, out, valid, next_position)
        while in_step and others:  # this rank is done, another is not: its forwards pair with theirs, outputs unused
            out, valid, next_position = self.decode_step(torch.full_like(token, pad_token_id), out, valid,
                                                         next_position)
            others = any_rank_decoding(False, done.device)
        return torch.stack(new_tokens, dim=1)

    def decode_step(self, token: torch.Tensor, out: Any, valid: torch.Tensor,
                    next_position: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One backbone step on the cache for each row's `token` (B,): its output, the mask and the next positions."""
        valid = torch.cat([valid, valid.new_ones(valid.shape[0], 1)], dim=1)
        step_positions = next_position[:, None]
        if self.uses_mrope:
            step_positions = step_positions.unsqueeze(0).expand(3, -1, -1)
        out = self.backbone(inputs_embeds=self.backbone.get_input_embeddings()(token[:, None]),
                            attention_mask=valid, position_ids=step_positions, cache=out.cache, use_cache=True)
        return out, valid, next_position + 1


def ranks_step_together(model: torch.nn.Module) -> bool:
    """Whether every rank must run as many decoding steps as the others: in a multi-process run whose model is
    sharded by FSDP2, each decoder block's forward all-gathers its parameters with the other ranks, so a rank that
    stopped while another still decodes leaves that one waiting in its gather (a hang). DDP and one process run no
    collective in a forward without gradients."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def any_rank_decoding(decoding: bool, device: torch.device) -> bool:
    """Whether any rank still decodes (this rank's `decoding` among them): one all-reduce (MAX) of a flag, the
    step's agreement on whether to go on."""
    flag = torch.tensor([int(decoding)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def repeated(out: Any, repeats: int, *rows: torch.Tensor) -> tuple[Any, ...]:
    """A prefill's output for B prompts -> for B x `repeats` answers: the last logits, the cache (keys and values,
    linear-attention conv and recurrent states: transformers' `reorder_cache`, as its beam search copies beams) and
    each per-row tensor of `rows` ((B, ...) or the (B, ...)-last M-RoPE positions) repeated, a prompt's copies side
    by side."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    index = torch.arange(out.logits.shape[0], device=out.logits.device).repeat_interleave(repeats)
    out.cache.reorder_cache(index)
    out.logits = out.logits.index_select(0, index)
    return (out, *(t.index_select(0, index.to(t.device)) for t in rows))


def placeholder_ids(tokens: SpanTokens) -> list[int]:
    """The ids a model must never generate: every span token `tokens` declares (`SpanTokens.ids`)."""
    return tokens.ids()


def next_token(logits: torch.Tensor, temperature: float, top_p: float,
               generator: torch.Generator | None = None, *, suppress: torch.Tensor | None = None,
               repetition_penalty: float = 1.0, seen: torch.Tensor | None = None,
               row_seeds: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) tokens: argmax for temperature 0, else a sample from the top-p nucleus; the ids in
    `suppress` (K,) are never chosen (their logits are -inf first); with a `repetition_penalty` other than 1, the
    logits of the tokens marked in `seen` (B, V) bool are penalised first (`penalize_repetition`)."""
    logits = suppressed(logits, suppress)
    if repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("repetition_penalty needs seen: the (B, V) mask of the tokens already in each row")
        logits = penalize_repetition(logits, seen, repetition_penalty)
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, index = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keeps at least the most likely token
        probs = torch.zeros_like(probs).scatter(-1, index, sorted_probs.masked_fill(outside, 0.0))
    if row_seeds is not None:
        return row_sample(probs, row_seeds)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def row_sample(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """(B, V) probabilities -> (B,) tokens, row b drawn from its own `seeds[b]` (int64) alone: the Gumbel-max trick,
    argmax(log p + g) with g = -log(-log u) ~ Gumbel(0, 1), the uniforms u a hash of (seed, token id) (SplitMix64's
    finaliser: every (seed, id) pair its own well-mixed 53 bits). A draw from `probs` like `torch.multinomial`'s, but
    the same for a row whatever rows are beside it and on any device."""
    ids = torch.arange(probs.shape[-1], device=probs.device, dtype=torch.int64)
    u = uniform_hash(seeds.to(probs.device, torch.int64)[:, None] * GOLDEN + ids[None, :])
    gumbel = -torch.log(-torch.log(u))
    return (torch.log(probs.double()) + gumbel).argmax(dim=-1)


def uniform_hash(x: torch.Tensor) -> torch.Tensor:
    """int64 -> float64 uniforms in (0, 1): SplitMix64's finaliser (int64 arithmetic wraps as uint64's does), the
    top 53 bits, offset by half a step so neither 0 nor 1 occurs."""
    x = x + GOLDEN
    x = (x ^ _shift(x, 30)) * MIX_1
    x = (x ^ _shift(x, 27)) * MIX_2
    x = x ^ _shift(x, 31)
    top = _shift(x, 11)  # 53 bits, non-negative
    return (top.double() + 0.5) / float(1 << 53)


def _signed(constant: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


GOLDEN, MIX_1, MIX_2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 (uint64's >>): torch's >> on int64 is arithmetic (it keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def suppressed(logits: torch.Tensor, suppress: torch.Tensor | None) -> torch.Tensor:
    """(B, V) logits with the ids in `suppress` (K,) at -inf (ids beyond V ignored); `logits` itself if none."""
    if suppress is None or not suppress.numel():
        return logits
    return logits.index_fill(-1, suppress[suppress < logits.shape[-1]], float("-inf"))


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' `RepetitionPenaltyLogitsProcessor` over a (B, V) bool mask of seen tokens: a seen token's
    logit is divided by `penalty` when positive and multiplied by it when not (so > 1 discourages repeats)."""
    if penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {penalty}")
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def seen_tokens(input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, V) bool: the ids each row holds at its valid positions (padding is not a token the row has seen)."""
    seen = torch.zeros(input_ids.shape[0], vocab_size, dtype=torch.bool, device=input_ids.device)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None].expand_as(input_ids)
    keep = valid & (input_ids >= 0) & (input_ids < vocab_size)
    seen[rows[keep], input_ids[keep]] = True
    return seen


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int, *,
                   suppress: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-probs of `tokens` (B,) and the `top` most likely tokens under the model's distribution at this step:
    log_softmax (float32) of the (B, V) `logits` with the ids that can never be generated (`suppress`) removed -
    before any repetition penalty, temperature or nucleus, so they state what the model predicts whatever the
    sampling settings (vLLM's default, "raw" log-probs; with greedy decoding the sampled distribution would be a
    point mass). Returns ((B,), (B, top) ids, (B, top) log-probs), the alternatives most likely first."""
    logprobs = torch.log_softmax(suppressed(logits, suppress).float(), dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None].clamp(max=logprobs.shape[-1] - 1))[:, 0]
    top_logprobs, top_ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
    return chosen, top_ids, top_logprobs


# ---- its memory (`mmadapt plan`) -------------------------------------------------------------------------------------
def text_config(model: Any) -> Any:
    """The backbone's text config (a VLM config's `text_config`, else its own)."""
    config = model.backbone.config
    return getattr(config, "text_config", None) or config


def cache_bytes(model: Any, rows: int, length: int, dtype_bytes: int) -> int:
    """The generation cache of `rows` rows of `length` tokens, counted from the backbone's config as transformers'
    cache layers hold it: keys and values (rows x KV heads x length x head_dim each) for each attention layer; for
    each Gated DeltaNet layer (Qwen3.5's `linear_attention`) its conv state (rows x conv channels x kernel, in the
    compute dtype) and its recurrent state (rows x value heads x key dim x value dim, fp32)."""
    c = text_config(model)
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    total = 0
    for kind in types:
        if kind == "linear_attention":
            keys = c.linear_num_key_heads * c.linear_key_head_dim
            values = c.linear_num_value_heads * c.linear_value_head_dim
            total += rows * (2 * keys + values) * c.linear_conv_kernel_dim * dtype_bytes
            total += rows * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        else:
            window = getattr(c, "sliding_window", None) if kind == "sliding_attention" else None
            total += 2 * rows * c.num_key_value_heads * min(length, window or length) * head_dim * dtype_bytes
    return total


def generation_bytes(model: Any, prompts: int, answers: int, length: int, dtype_bytes: int) -> int:
    """The memory of answering `prompts` prompts `answers` times each up to `length` tokens (`generate` with the prompt
    prefilled once, its cache copied per answer) beyond the resident weights: the cache of the prompts x answers rows
    (`cache_bytes`), each step's last logits (fp32, rows x V), and one prefill layer's working set for the prompts
    (hidden states, attention projections and the MLP's intermediate: counted, not probed)."""
    c, rows = text_config(model), prompts * answers
    vocab = model.backbone.get_output_embeddings().weight.shape[0]
    prefill = prompts * length * (4 * c.hidden_size + 3 * c.intermediate_size) * dtype_bytes
    return cache_bytes(model, rows, length, dtype_bytes) + rows * vocab * 4 + prefill
