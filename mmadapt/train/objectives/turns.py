"""Multi-turn rollouts: the policy answers, calls tools in its chat template's own format, reads their results
(text and images, as `tool` messages rendered by the same template) and answers again, up to `max_turns` answers
and a token budget per trajectory.

`multi_turn_rollout(model, processor, prompts, G, sampling, agent, encode=...)` starts as `rollout` does (each prompt
prefilled once, its cache copied G ways: the first answers of a group share their prefix); each answer that ends
with calls (`ToolTurns.parse`) has them run (`mmadapt.tools.run_call`: a failing, slow or invalid tool is a counted
problem and a tool message saying so, never a crash), its results rendered as the template renders tool messages
and its next generation prompt (`ToolTurns.suffix`), each returned image preprocessed as any image of the run and
placed at its own span. The trajectories that go on are then prefilled again as a whole and answered (each row from
its own seed and turn); pictures are never encoded again: the prompts' come from the step's one encoding, and the
images tools return are encoded once, as they arrive, by `encode` (the objective's: with gradients when the vision
side trains), then shared by the rollout (detached) and the policy's forward.

A trajectory stops at an answer without a call, at `max_turns` answers, when its next tool message would not fit
its budget (`Agent.max_tokens` after the prompt, with `data.max_length` over all), or at an answer cut at the
budget. `Trajectories` holds each row's segments (the policy's tokens and the tool messages' tokens, in order), the
policy's tokens alone as a `Rollouts` (what the loss, its mask and the rollout's log-probs are over), the pool of
pictures (the prompts' images, then every image tools returned) and each row's indices into it.

`scored_trajectories` lays out the rows the policy scores: prompt, then each segment, labels on the policy's tokens
only (a tool message is never trained on, nor counted as an action), the pool of pictures once with `image_index`
saying which of them each row shows, in its order, so the step's one encoding serves every forward.

Shapes: B prompts, G answers per prompt, R = B x G trajectories, I pictures in the pool.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmadapt.data.turns import IMAGE
from mmadapt.encoders import VisualTokens
from mmadapt.loss import IGNORE_INDEX
from mmadapt.sampling import Sampling
from mmadapt.train.objectives.rollout import Encoded, Rollouts, encode_prompts, group_rows, rollout

log = logging.getLogger(__name__)
TURN_SEED = 0x2545F4914F6CDD1D  # mixes a row's seed with its turn (each answer of a trajectory its own draw)


@dataclasses.dataclass(frozen=True)
class Agent:
    """What a multi-turn rollout needs besides the model: the template's tool turns (`ToolTurns`), the tools
    (`mmadapt.tools.Tool`s by name), at most `max_turns` answers per trajectory and `max_tokens` tokens after the
    prompt (policy and tools), each call bounded by `timeout` seconds, each returned image by `max_pixels`, and the
    image processor tool images go through (the run's)."""

    turns: Any
    tools: dict[str, Any]
    image_processor: Any
    max_turns: int = 4
    max_tokens: int = 1024
    timeout: float = 10.0
    max_pixels: int = 1 << 20
    max_images: int = 4


@dataclasses.dataclass
class Trajectories:
    """R trajectories (see the module docstring). `policy`: the policy's tokens of each row, concatenated over its
    answers, as a `Rollouts` (mask, truncation, sampled log-probs); `segments[r]`: [(ids, by the policy)] in order;
    `pixels`: the pool's pixel values and grids (the prompts' images, then the tools'), `pool`: its encoding (with
    graph where the vision side trains), `images[r]`: row r's indices into the pool, in its order; `texts[r]`: its
    last answer's text (what the rewards score); `calls[r]`: the tool calls it made; `problems`: counted tool problems
    by kind; `tool_images[r]`: the PIL images tools returned to it, `history[r]` its messages (a record of the
    trajectory: `agentic.record`)."""

    policy: Rollouts
    segments: list[list[tuple[torch.Tensor, bool]]]
    pixels: dict[str, Any]
    pool: VisualTokens | None
    images: list[list[int]]
    texts: list[str]
    calls: torch.Tensor
    problems: Counter
    tool_images: list[list[Any]]
    history: list[list[dict[str, Any]]] = dataclasses.field(default_factory=list)  # per row, its answers and tool
    # results as messages (`mmadapt.data.samples`' format: an answer's calls as `tool_calls`, `<image>` per image)
    row_problems: list[int] = dataclasses.field(default_factory=list)  # per row, its counted tool problems

    def columns(self) -> dict[str, list[int]]:
        """What the rewards read of each trajectory besides its last answer's text: `tool_calls` (the calls it made
        that could be read) and `tool_problems` (its counted problems: unreadable calls, failing tools, budget)."""
        return {"tool_calls": [int(c) for c in self.calls], "tool_problems": list(self.row_problems)}

    @property
    def num_generations(self) -> int:
        return self.policy.num_generations

    def encoded(self, videos: VisualTokens | None) -> Encoded:
        """The pool (and the prompts' videos) as the step's one encoding of the rows' pictures."""
        return Encoded(self.pool, videos)


def cat_tokens(parts: Sequence[VisualTokens | None]) -> VisualTokens | None:
    """Visual tokens of several encodings, in order, as one (None where every part is None)."""
    kept = [p for p in parts if p is not None]
    if not kept:
        return None
    with torch.enable_grad():  # (inside a rollout's no_grad: the pool keeps each encoding's graph for the loss)
        levels = tuple(torch.cat(level) for level in zip(*(p.levels for p in kept), strict=True)) \
            if kept[0].levels else ()
        return VisualTokens(torch.cat([p.features for p in kept]), torch.cat([p.grids.to(kept[0].grids.device)
                                                                           for p in kept]), kept[0].window, levels)


def turn_seeds(seeds: torch.Tensor | None, turn: int) -> torch.Tensor | None:
    """Each row's seed for its answer `turn` (0: the row's own seed)."""
    return None if seeds is None or turn == 0 else seeds ^ (TURN_SEED * turn & ((1 << 63) - 1))


@torch.no_grad()
def multi_turn_rollout(model: Any, processor: Any, prompts: dict[str, Any], num_generations: int,
                       sampling: Sampling, agent: Agent, *, seeds: torch.Tensor | None = None,
                       encoded: Encoded | None = None, images: Sequence[Sequence[Any]] = (),
                       encode: Callable[[dict[str, Any]], VisualTokens | None] | None = None,
                       blank_tool_images: bool = False,
                       offered: Sequence[Sequence[str]] | None = None) -> Trajectories:
    """G trajectories for each prompt of `prompts` (a `Collator` batch of generation prompts; `images[b]`: prompt b's
    decoded images, which the tools work on); `encoded`: the prompts' pictures (with their graph: the pool keeps it);
    `encode(pixels)` encodes the images tools return (default: the model's `encode_images`; None: the vision side's
    run on no picture); `blank_tool_images`: each returned image replaced by the processor's mean colour (the control
    that asks whether the policy uses what tools show it); `offered[b]`: the tools prompt b offers (default: all the
    agent's; a call of another is an `unknown_tool`). Module docstring."""
    from mmadapt.answering import decoded
    from mmadapt.generation import any_rank_decoding, ranks_step_together

    g, device = num_generations, prompts["input_ids"].device
    encode = encode or (lambda pixels: model.vision_placeholder(device) if pixels is None else model.encode_images(
        pixels["pixel_values"], pixels.get("image_grid_thw")))
    in_step = ranks_step_together(model)  # FSDP2: every rank runs as many turns, encodings and decoding steps
    rows = group_rows(prompts, g)
    if encoded is None:  # the prompts' pictures: the start of the pool every later turn takes its images from
        encoded = encode_prompts(model, prompts)
    first = rollout(model, processor, prompts, g, dataclasses.replace(
        sampling, max_new_tokens=min(sampling.max_new_tokens, agent.max_tokens)), seeds=seeds,
        encoded=encoded.detached() if encoded is not None else None)
    count = first.completions.shape[0]
    valid = rows["attention_mask"].bool()
    prompt_ids = [rows["input_ids"][r][valid[r]] for r in range(count)]
    budget = [min(agent.max_tokens, agent_room(processor, len(p))) for p in prompt_ids]
    pool_pixels = {k: prompts[k] for k in ("pixel_values", "image_grid_thw") if prompts.get(k) is not None}
    pool = encoded.images if encoded is not None else None  # (the tokens of no picture where the vision side ran
    # for prompts without: kept in the pool, and so in the loss's graph)
    row_images = [rows["image_index"][int(offset):int(offset + n)].tolist() for offset, n in zip(
        torch.cumsum(rows["images_per_sample"], 0) - rows["images_per_sample"], rows["images_per_sample"],
        strict=True)] if rows.get("image_index") is not None else [[] for _ in range(count)]
    seen = [list(images[r // g]) if r // g < len(images) else [] for r in range(count)]
    segments: list[list[tuple[torch.Tensor, bool]]] = [[] for _ in range(count)]
    policy_ids: list[list[torch.Tensor]] = [[] for _ in range(count)]
    policy_logps: list[list[torch.Tensor]] = [[] for _ in range(count)]
    texts, calls, problems = [""] * count, torch.zeros(count, dtype=torch.long), Counter()
    tool_images: list[list[Any]] = [[] for _ in range(count)]
    history: list[list[dict[str, Any]]] = [[] for _ in range(count)]
    row_problems = [0] * count
    truncated = torch.zeros(count, dtype=torch.bool)
    answers, live = first, list(range(count))
    for turn in range(agent.max_turns):
        going = []
        for k, r in enumerate(live):
            ids, logps = answers.completions[k][answers.mask[k]], answers.logps[k][answers.mask[k]]
            segments[r].append((ids, True))
            policy_ids[r].append(ids)
            policy_logps[r].append(logps)
            budget[r] -= len(ids)
            texts[r] = decoded(processor, ids.tolist()).text
            truncated[r] = bool(answers.truncated[k])
            history[r].append({"role": "assistant", "content": texts[r]})
            if truncated[r] or turn + 1 == agent.max_turns:
                continue
            tools = agent.tools if offered is None else {n: agent.tools[n] for n in offered[r // g]}
            before = sum(problems.values())
            called = call_tools(agent, tools, processor, ids, seen[r], problems)
            if called is None:
                continue
            parsed, results = called
            row_problems[r] += sum(problems.values()) - before
            if parsed:  # the answer as a record writes it: its text before the calls, the calls themselves
                history[r][-1] = {"role": "assistant", "content": texts[r].split(agent.turns.marker)[0].strip()
                                  if agent.turns.marker else "", "tool_calls": [
                                      {"type": "function", "function": {"name": n, "arguments": a}} for n, a in parsed]}
            calls[r] += len(parsed)
            suffix, shown = tool_message(agent, processor, results, blank_tool_images)
            if len(suffix) > budget[r] - 1:  # no room for the message and one token of an answer
                problems["budget"] += 1
                row_problems[r] += 1
                continue
            history[r] += [{"role": "tool", "content": IMAGE * len(result.images) + result.text}
                           for result in results]
            segments[r].append((suffix, False))
            budget[r] -= len(suffix)
            returned = [image for result in results for image in result.images]
            seen[r] += returned
            tool_images[r] += returned
            going.append((r, shown))
        live = [r for r, _ in going]
        if not (any_rank_decoding(bool(live), device) if in_step else live):
            break
        new = [shown for _, shown in going if shown is not None]
        others = any_rank_decoding(bool(new), device) if in_step else False  # does any rank encode images now?
        if new:
            from mmadapt.data.processors import ProcessedImages

            batch = ProcessedImages.concat(new)
            pixels = {"pixel_values": batch.pixel_values.to(device)}
            if batch.image_grid_thw is not None:
                pixels["image_grid_thw"] = batch.image_grid_thw.to(device)
            start = pool.num_images if pool is not None else 0
            pool, pool_pixels = cat_tokens([pool, encode(pixels)]), concat_pixels(pool_pixels, pixels)
            for r, shown in going:
                if shown is not None:
                    row_images[r] += list(range(start, start + len(shown)))
                    start += len(shown)
        elif others:  # another rank encodes: the vision side's run on no picture, here too, its exact 0 in the pool
            pool = cat_tokens([pool, encode(None)])
        # a rank whose trajectories all ended answers a stand-in (its first row, one token) while others go on
        rows_now = live or [0]
        answers = continue_rows(model, processor, sampling, prompt_ids, segments, row_images, pool, rows_now,
                                [budget[r] if live else 1 for r in rows_now],
                                turn_seeds(seeds[rows_now] if seeds is not None else None, turn + 1), prompts, device)
        if not live:
            answers, live = None, []
    policy = policy_rollouts(policy_ids, policy_logps, truncated, g, processor, device)
    return Trajectories(policy, segments, pool_pixels, pool, row_images, texts, calls, problems, tool_images,
                        history, row_problems)


def agent_room(processor: Any, prompt_length: int) -> int:
    """The tokens `data.max_length` leaves after a prompt."""
    return processor.encoder.config.max_length - prompt_length


def call_tools(agent: Agent, tools: dict[str, Any], processor: Any, ids: torch.Tensor, seen: list[Any],
               problems: Counter) -> tuple[list[Any], list[Any]] | None:
    """The calls an answer ends with and their results (None: it makes none); an answer whose call cannot be read
    gets no call and one result saying why (a counted `bad_call`)."""
    from mmadapt.tools import ToolCall, ToolContext, ToolResult, run_call

    text = processor.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    if agent.turns.marker not in text:
        return None
    try:
        parsed = agent.turns.parse(text)
    except ValueError as e:
        problems["bad_call"] += 1
        return [], [ToolResult(text=f"error: the tool call could not be read: {e}", problem="bad_call")]
    if not parsed:
        return None
    context = ToolContext(images=tuple(seen), max_pixels=agent.max_pixels, max_images=agent.max_images)
    results = []
    for name, arguments in parsed:
        result = run_call(tools, ToolCall(name, arguments), context, timeout=agent.timeout)
        if result.problem:
            problems[result.problem] += 1
        results.append(result)
    return parsed, results


def tool_message(agent: Agent, processor: Any, results: list[Any], blank: bool) -> tuple[torch.Tensor, Any]:
    """The ids of the tool messages for `results` and the next generation prompt (each image's span expanded to its
    tokens), and their images preprocessed (`ProcessedImages`, None without images); `blank`: the images as the
    processor's mean colour (`mmadapt.controls`' blanking)."""
    from mmadapt.data.templates import expand_images
    from mmadapt.data.turns import IMAGE, Turn

    encoder = processor.encoder
    images = [image for result in results for image in result.images]
    shown = encoder.processor(images) if images else None
    if blank and shown is not None:  # `mmadapt.controls.BLANKED`: normalised pixels 0, the mean colour
        shown = dataclasses.replace(shown, pixel_values=torch.zeros_like(shown.pixel_values))
    text = agent.turns.suffix([Turn("tool", IMAGE * len(r.images) + r.text) for r in results])
    ids = encoder.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, _ = expand_images(list(ids), [IGNORE_INDEX] * len(ids), encoder.image_token_id,
                           shown.tokens_per_image if shown is not None else [], "tool message")
    return torch.tensor(ids, dtype=torch.long), shown


def concat_pixels(pool: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The pool's pixel values and grids with `new`'s after them."""
    if not pool:
        return dict(new)
    return {k: torch.cat([pool[k], new[k].to(pool[k].device)]) for k in pool}


def row_tensors(prompt_ids: list[torch.Tensor], segments: list[list[tuple[torch.Tensor, bool]]], rows: list[int],
                pad_token_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows `rows` as right-padded ids, attention mask and labels (the policy's tokens)."""
    pieces = [[(prompt_ids[r], False), *segments[r]] for r in rows]
    width = max(sum(len(ids) for ids, _ in row) for row in pieces)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=device)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long, device=device)
    attention = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for k, row in enumerate(pieces):
        at = 0
        for part, policy in row:
            ids[k, at:at + len(part)] = part.to(device)
            if policy:
                labels[k, at:at + len(part)] = part.to(device)
            at += len(part)
        attention[k, :at] = 1
    return ids, attention, labels


def type_ids(ids: torch.Tensor, processor: Any) -> torch.Tensor:
    """Qwen's `mm_token_type_ids`: 1 at image tokens, 2 at video tokens (the collator's rule)."""
    encoder = processor.encoder
    types = (ids == encoder.image_token_id).long()
    if encoder.video_token_id is not None:
        types += 2 * (ids == encoder.video_token_id).long()
    return types


def continue_rows(model: Any, processor: Any, sampling: Sampling, prompt_ids: list[torch.Tensor],
                  segments: list[list[tuple[torch.Tensor, bool]]], row_images: list[list[int]],
                  pool: VisualTokens | None, live: list[int], budgets: list[int], seeds: torch.Tensor | None,
                  prompts: dict[str, Any], device: Any) -> Rollouts:
    """The next answer of each trajectory in `live`: its whole sequence prefilled (its pictures handed over from the
    pool, never encoded again), sampled as `sampling` says within its budget."""
    from mmadapt.answering import generate_settings

    if prompts.get("pixel_values_videos") is not None:
        raise ValueError("tools after a prompt with videos are not supported yet: give the frames as images")
    pad = processor.encoder.pad_token_id
    ids, attention, _ = row_tensors(prompt_ids, segments, live, pad, device)
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": attention}
    if prompts.get("mm_token_type_ids") is not None:
        inputs["mm_token_type_ids"] = type_ids(ids, processor) * attention
    shown = [row_images[r] for r in live]
    if pool is not None:  # handed over, never encoded again (the tokens of no picture included: no second run)
        inputs["visual"] = pool.take(torch.tensor([i for row in shown for i in row], dtype=torch.long))
        if any(shown):
            inputs["images_per_sample"] = torch.tensor([len(row) for row in shown], device=device)
    length = max(1, min(sampling.max_new_tokens, max(budgets)))
    settings = generate_settings(processor, dataclasses.replace(sampling, max_new_tokens=length))
    scores: list[torch.Tensor] = []
    temperature = sampling.temperature

    def score(step: Any) -> None:
        logits = step.logits.float()
        logits = logits / temperature if temperature > 0 else logits
        scores.append(torch.log_softmax(logits, dim=-1).gather(-1, step.tokens[:, None])[:, 0])

    completions = model.generate(**inputs, **settings, row_seeds=seeds, on_step=score)
    return ended(completions, torch.stack(scores, dim=1), settings, torch.tensor(budgets), 1)


def ended(completions: torch.Tensor, logps: torch.Tensor, settings: dict[str, Any], budgets: torch.Tensor,
          num_generations: int) -> Rollouts:
    """`generate`'s new tokens as `Rollouts`: each row through its first end id, cut at its own budget."""
    ends = torch.tensor(settings["eos_token_id"], dtype=completions.dtype, device=completions.device)
    positions = torch.arange(completions.shape[1], device=completions.device)
    within = positions[None, :] < budgets.to(completions.device)[:, None]
    is_end = torch.isin(completions, ends) & within
    done = is_end.any(dim=1)
    last = torch.where(done, is_end.int().argmax(dim=1),
                       torch.minimum(budgets.to(completions.device), torch.tensor(completions.shape[1])) - 1)
    mask = positions[None, :] <= last[:, None]
    return Rollouts(completions.masked_fill(~mask, settings["pad_token_id"]), mask, ~done, num_generations,
                    logps.masked_fill(~mask, 0.0))


def policy_rollouts(ids: list[list[torch.Tensor]], logps: list[list[torch.Tensor]], truncated: torch.Tensor,
                    num_generations: int, processor: Any, device: Any) -> Rollouts:
    """The policy's tokens of each trajectory, concatenated over its answers, as `Rollouts`."""
    joined = [torch.cat(parts) for parts in ids]
    width = max(len(j) for j in joined)
    pad = processor.encoder.pad_token_id
    completions = torch.full((len(joined), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(joined), width), dtype=torch.bool, device=device)
    scores = torch.zeros((len(joined), width), dtype=torch.float32, device=device)
    for r, (j, parts) in enumerate(zip(joined, logps, strict=True)):
        completions[r, :len(j)], mask[r, :len(j)] = j.to(device), True
        scores[r, :len(j)] = torch.cat(parts).to(device)
    return Rollouts(completions, mask, truncated.to(device), num_generations, scores)


def scored_trajectories(prompts: dict[str, Any], done: Trajectories, pad_token_id: int,
                        processor: Any) -> dict[str, Any]:
    """The R rows the policy scores (module docstring): prompt then segments, labels on the policy's tokens, the pool
    of pictures once with each row's `image_index`."""
    rows = group_rows(prompts, done.num_generations)
    valid = rows["attention_mask"].bool()
    count = valid.shape[0]
    prompt_ids = [rows["input_ids"][r][valid[r]] for r in range(count)]
    device = rows["input_ids"].device
    ids, attention, labels = row_tensors(prompt_ids, done.segments, list(range(count)), pad_token_id, device)
    out = {k: v for k, v in rows.items() if k in ("video_index", "videos_per_sample", "pixel_values_videos",
                                                  "video_grid_thw")}
    out.update({"input_ids": ids, "attention_mask": attention, "labels": labels})
    if rows.get("mm_token_type_ids") is not None:
        out["mm_token_type_ids"] = type_ids(ids, processor) * attention
    if any(done.images):
        out.update(done.pixels)
        out["image_index"] = torch.tensor([i for row in done.images for i in row], dtype=torch.long, device=device)
        out["images_per_sample"] = torch.tensor([len(row) for row in done.images], device=device)
    return out


def check_trajectory_groups(rows: dict[str, Any], prompts: dict[str, Any], done: Trajectories) -> None:
    """Each group's trajectories start from the same prompt (tokens and pictures): `ImageTokenContractError` naming
    the group otherwise."""
    from mmadapt.contract import ImageTokenContractError

    g = done.num_generations
    lengths = prompts["attention_mask"].bool().sum(dim=1)
    first = torch.cumsum(prompts["images_per_sample"], 0) - prompts["images_per_sample"] \
        if prompts.get("images_per_sample") is not None else None
    for b in range(lengths.shape[0]):
        n = int(lengths[b])
        group = range(b * g, b * g + g)
        if any(not torch.equal(rows["input_ids"][r, :n], rows["input_ids"][b * g, :n]) for r in group):
            raise ImageTokenContractError(f"group {b}: its trajectories start from different prompts")
        if first is not None:
            own = list(range(int(first[b]), int(first[b] + prompts["images_per_sample"][b])))
            if any(done.images[r][:len(own)] != own for r in group):
                raise ImageTokenContractError(f"group {b}: its trajectories show different prompt pictures")
