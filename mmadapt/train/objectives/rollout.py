"""Rollouts for online RL: each prompt of a batch answered G times by the policy, and the rows the policy then scores.

`rollout(model, processor, prompts, G, sampling)` answers a `Collator` batch of B generation prompts
(`mmadapt.data.prompts`) with mmadapt's own `generate`: each prompt is prefilled once, with each of its pictures
encoded once (or handed in, `encode_prompts`), and its cache copied G ways (`generate(repeats=G)`); the B x G answers
(a group's rows side by side: row r answers prompt r // G) are sampled as `sampling` says (`mmadapt.sampling.Sampling`:
temperature, nucleus, `max_new_tokens`), the vision placeholders and span tokens never generated (`generate` bans
them). The rest of `generate`'s settings are answering's (`mmadapt.answering.generate_settings`): the end ids
`Processor.eos_token_ids` and the processor's pad id, so a rollout's answer ends where `answer_prompts`' would, and
its text (`answer_texts`) is what answering returns for its ids (`mmadapt.answering.decoded`). `Rollouts` holds the
completions (R = B x G rows, T tokens, `pad` after the end), which tokens belong to each answer (its end token
included) and which answers were cut at `max_new_tokens` without an end.

`scored_rows(prompts, rollouts)` lays out what the policy, the old policy and the reference score: per row its
prompt's tokens then its completion, right-padded, the completion tokens as labels (nothing else supervised), the
prompt's images and videos once for its G rows (`image_index`, `video_index`), Qwen's `mm_token_type_ids` extended
with text. The same layout serves every forward of a step, so their visual spans are the same by construction;
`check_groups` verifies it from the ids (each group's rows hold identical prompt spans and pictures). `Encoded` (the
prompts' pictures encoded once) gives every forward of the step its rows' visual tokens (`Encoded.for_rows`); a batch
without pictures has its vision side's run on no picture there too, where every rank must run it (a sharded vision
side), so that the ranks' vision units run at the same point of the step whatever their prompts hold.

Shapes: B prompts, G answers per prompt, R = B x G rows, L prompt tokens, T completion tokens, I images, V videos.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from mmadapt.encoders import VisualTokens
from mmadapt.loss import IGNORE_INDEX
from mmadapt.sampling import Sampling

if TYPE_CHECKING:
    from mmadapt.processor import Processor


@dataclasses.dataclass
class Rollouts:
    """R = B x G answers: `completions` (R, T) ids, `pad` after each answer's end; `mask` (R, T) bool, the answer's
    tokens (its end token included); `truncated` (R,) bool, cut at `max_new_tokens` with no end token;
    `num_generations` G (row r answers prompt r // G); `logps` (R, T) fp32, the log-prob of each sampled token as the
    rollout saw it, under softmax(logits / temperature) over the whole vocabulary (what the training forward scores:
    no suppression, no nucleus; 0 past the end), or None."""

    completions: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor
    num_generations: int
    logps: torch.Tensor | None = None

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)


def group_rows(prompts: dict[str, Any], num_generations: int) -> dict[str, Any]:
    """The prompt batch's inputs for its B x G rows: the per-row tensors repeated (a group side by side), the
    pictures kept once, with `image_index` saying which of them each row's images are."""
    g = num_generations
    if g < 1:
        raise ValueError(f"num_generations must be >= 1, got {g}")
    rows = {k: prompts[k].repeat_interleave(g, dim=0) for k in ("input_ids", "attention_mask", "mm_token_type_ids")
            if prompts.get(k) is not None}
    if prompts.get("pixel_values") is not None:
        per_prompt = images_per_prompt(prompts)
        starts = torch.cumsum(per_prompt, 0) - per_prompt
        rows["image_index"] = torch.cat([torch.arange(int(s), int(s + n)) for s, n in zip(starts, per_prompt,
                                                                                           strict=True)
                                         for _ in range(g)]).to(prompts["input_ids"].device)
        rows["images_per_sample"] = per_prompt.repeat_interleave(g)
        rows["pixel_values"] = prompts["pixel_values"]
        if prompts.get("image_grid_thw") is not None:
            rows["image_grid_thw"] = prompts["image_grid_thw"]
    if prompts.get("pixel_values_videos") is not None:
        videos = prompts["videos_per_sample"].cpu()
        if prompts.get("video_grid_thw") is None:
            raise ValueError("videos in a rollout need video_grid_thw (Qwen's video processor)")
        starts = torch.cumsum(videos, 0) - videos
        rows["video_index"] = torch.cat([torch.arange(int(s), int(s + n)) for s, n in zip(starts, videos, strict=True)
                                         for _ in range(g)]).to(prompts["input_ids"].device)
        rows["videos_per_sample"] = videos.repeat_interleave(g).to(prompts["input_ids"].device)
        rows["pixel_values_videos"], rows["video_grid_thw"] = prompts["pixel_values_videos"], prompts["video_grid_thw"]
    return rows


@dataclasses.dataclass
class Encoded:
    """A prompt batch's pictures encoded once (`encode_prompts`): `images` one entry per image, `videos` one per video
    (its (t, h, w) grid), in the batch's order; None where it has none (`images` the tokens of no image where the
    vision side ran for a batch without pictures)."""

    images: VisualTokens | None
    videos: VisualTokens | None

    def detached(self) -> Encoded:
        """Without their graph (the rollout's and a reference's view of the step's one encoding)."""
        def cut(v: VisualTokens | None) -> VisualTokens | None:
            return None if v is None else dataclasses.replace(v, features=v.features.detach(),
                                                              levels=tuple(x.detach() for x in v.levels))
        return Encoded(cut(self.images), cut(self.videos))

    def for_rows(self, rows: dict[str, Any]) -> dict[str, VisualTokens]:
        """`forward` / `generate`'s `visual` and `visual_videos` for `rows`: through their `image_index` /
        `video_index` (`group_rows`), else the prompts' own."""
        out = {}
        for key, tokens, index in (("visual", self.images, "image_index"),
                                   ("visual_videos", self.videos, "video_index")):
            if tokens is not None:
                out[key] = tokens.take(rows[index]) if rows.get(index) is not None else tokens
        return out


def encode_prompts(model: Any, prompts: dict[str, Any]) -> Encoded | None:
    """Each picture of a prompt batch through the vision side once (images and videos in one call, as `forward`
    encodes them). Without pictures: where every rank runs the vision side for every batch
    (`runs_vision_for_every_batch`: sharded, or trained under DDP), its run on no picture (`vision_placeholder`), here,
    where a rank with pictures encodes them - the rollout and forwards it is handed to run no second one and add
    its exact 0, keeping the vision side in the loss's graph - else None (nothing runs). Runs in the model's mode and
    the caller's grad mode."""
    from mmadapt.frames import split

    images, videos = prompts.get("pixel_values"), prompts.get("pixel_values_videos")
    if images is None and videos is None:
        if not model.runs_vision_for_every_batch():
            return None
        return Encoded(model.vision_placeholder(prompts["input_ids"].device), None)
    if videos is None:
        return Encoded(model.encode_images(images, prompts.get("image_grid_thw")), None)
    grids = prompts["video_grid_thw"]
    if images is None:
        return Encoded(None, model.encode_images(videos, grids))
    image_grids = prompts["image_grid_thw"]
    both = model.encode_images(torch.cat([images, videos.to(images.dtype)]),
                               torch.cat([image_grids, grids.to(image_grids.device)]))
    return Encoded(*split(both, len(image_grids)))


INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw", "images_per_sample",
          "pixel_values_videos", "video_grid_thw", "videos_per_sample")  # what `generate` takes of a prompt batch


def images_per_prompt(prompts: dict[str, Any]) -> torch.Tensor:
    """(B,) the pictures of each prompt row (the collator's `images_per_sample`, else one per image span)."""
    if prompts.get("images_per_sample") is not None:
        return prompts["images_per_sample"].cpu()
    raise ValueError("a rollout batch with images needs images_per_sample (mmadapt's Collator gives it)")


def row_seeds(seed: int, step: int, sample_ids: list[str], num_generations: int) -> torch.Tensor:
    """(B x G,) int64: the sampling seed of each answer, from the run's seed, the step, its prompt's id and its place
    in the group alone, so an answer is the same on any rank, in any batch, and after a resume."""
    import hashlib

    def one(sample_id: str, k: int) -> int:
        digest = hashlib.blake2b(f"{seed}:{step}:{sample_id}:{k}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    return torch.tensor([one(i, k) for i in sample_ids for k in range(num_generations)], dtype=torch.int64)


def check_sampling(sampling: Sampling) -> None:
    """A rollout samples what training scores (softmax(logits / temperature) of the model's own logits) and ends at
    end tokens only: `ValueError` for the `Sampling` settings it cannot honour."""
    refused = [f"repetition_penalty {sampling.repetition_penalty} (the training forward scores without it)"
               if sampling.repetition_penalty != 1.0 else "",
               f"stop strings {list(sampling.stop)} (an answer ends at an end token)" if sampling.stop else "",
               f"logprobs {sampling.logprobs} (the rollout keeps its sampled tokens' own)"
               if sampling.logprobs is not None else ""]
    if any(refused):
        raise ValueError("a rollout cannot sample with " + "; ".join(r for r in refused if r)
                         + ": leave them at their defaults")


@torch.no_grad()
def rollout(model: Any, processor: Processor, prompts: dict[str, Any], num_generations: int, sampling: Sampling, *,
            generator: torch.Generator | None = None, seeds: torch.Tensor | None = None,
            encoded: Encoded | None = None) -> Rollouts:
    """G answers to each prompt of `prompts` (a `Collator` batch of generation prompts), sampled by `model` as
    `sampling` says (`check_sampling`), ended and padded as `processor` answers (`generate_settings`): each prompt
    prefilled once and its cache copied G ways (`generate(repeats=G)`); with `seeds` (B x G,) each answer from its own
    seed (`row_seeds`), else from `generator` (`sampling.seed` is not read); `encoded`: the prompts' pictures already
    encoded (`encode_prompts`), else encoded here, once each."""
    from mmadapt.answering import generate_settings

    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    check_sampling(sampling)
    settings = generate_settings(processor, sampling)
    inputs = {k: v for k, v in prompts.items() if k in INPUTS and v is not None}
    given = encoded.for_rows(prompts) if encoded is not None else {}
    scores: list[torch.Tensor] = []
    temperature = sampling.temperature

    def score(step: Any) -> None:  # the sampled token's log-prob as training scores it (temperature 0: as 1)
        logits = step.logits.float()
        logits = logits / temperature if temperature > 0 else logits
        scores.append(torch.log_softmax(logits, dim=-1).gather(-1, step.tokens[:, None])[:, 0])

    completions = model.generate(**inputs, **given, **settings, generator=generator, row_seeds=seeds,
                                 repeats=num_generations, on_step=score)
    pad_token_id = settings["pad_token_id"]
    ends = torch.tensor(settings["eos_token_id"], dtype=completions.dtype, device=completions.device)
    is_end = torch.isin(completions, ends)
    ended = is_end.any(dim=1)
    first_end = torch.where(ended, is_end.int().argmax(dim=1), completions.shape[1] - 1)
    positions = torch.arange(completions.shape[1], device=completions.device)
    mask = positions[None, :] <= first_end[:, None]
    logps = torch.stack(scores, dim=1).masked_fill(~mask, 0.0)
    return Rollouts(completions.masked_fill(~mask, pad_token_id), mask, ~ended, num_generations, logps)


def answer_texts(processor: Processor, rollouts: Rollouts) -> list[str]:
    """Each answer's text: what `answer_prompts` returns for its ids (`mmadapt.answering.decoded`: special tokens
    skipped, whitespace stripped, cut at its end token)."""
    from mmadapt.answering import decoded

    return [decoded(processor, ids[m].tolist()).text
            for ids, m in zip(rollouts.completions, rollouts.mask, strict=True)]


def scored_rows(prompts: dict[str, Any], rollouts: Rollouts, pad_token_id: int) -> dict[str, Any]:
    """The B x G rows the policy scores: each row's prompt tokens, then its completion, right-padded; `labels` the
    completion tokens (IGNORE elsewhere); the prompt's pictures once per group (`image_index`, `video_index`)."""
    rows = group_rows(prompts, rollouts.num_generations)
    valid = rows["attention_mask"].bool()
    lengths = valid.sum(dim=1) + rollouts.lengths
    width = int(lengths.max())
    count = rows["input_ids"].shape[0]
    device = rows["input_ids"].device
    input_ids = torch.full((count, width), pad_token_id, dtype=rows["input_ids"].dtype, device=device)
    labels = torch.full((count, width), IGNORE_INDEX, dtype=torch.long, device=device)
    attention = torch.zeros((count, width), dtype=torch.long, device=device)
    types = None if rows.get("mm_token_type_ids") is None else torch.zeros((count, width), dtype=torch.long,
                                                                            device=device)
    for r in range(count):
        prompt = rows["input_ids"][r][valid[r]]
        answer = rollouts.completions[r][rollouts.mask[r]]
        n, m = len(prompt), len(answer)
        input_ids[r, :n], input_ids[r, n:n + m] = prompt, answer
        labels[r, n:n + m] = answer
        attention[r, :n + m] = 1
        if types is not None:
            types[r, :n] = rows["mm_token_type_ids"][r][valid[r]]
    out = {**{k: v for k, v in rows.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")},
           "input_ids": input_ids, "attention_mask": attention, "labels": labels}
    if types is not None:
        out["mm_token_type_ids"] = types
    return out


def completion_logps(row_logps: torch.Tensor, labels: torch.Tensor, rollouts: Rollouts) -> torch.Tensor:
    """(R, L) per-token log-probs of `scored_rows` (`forward(head=TokenLogps()).logps`) -> (R, T), aligned with
    `rollouts.completions` (0 past each answer's end)."""
    out = row_logps.new_zeros(rollouts.completions.shape)
    for r in range(labels.shape[0]):
        picked = row_logps[r][labels[r] != IGNORE_INDEX]
        out[r, :len(picked)] = picked
    return out


def check_groups(rows: dict[str, Any], num_generations: int, image_token_id: int | None) -> None:
    """Each group's rows hold identical prompt spans (the same image-token positions) and the same pictures:
    `ImageTokenContractError` naming the group otherwise."""
    from mmadapt.contract import ImageTokenContractError

    if image_token_id is None:
        return
    ids, g = rows["input_ids"], num_generations
    prompt_part = rows["labels"] == IGNORE_INDEX
    spans = (ids == image_token_id) & prompt_part
    for start in range(0, ids.shape[0], g):
        group = range(start, start + g)
        if any(not torch.equal(spans[start], spans[r]) for r in group):
            raise ImageTokenContractError(f"group {start // g}: its rows' image spans differ; every answer of a group "
                                          "must see the same prompt")
        for index, per_row, kind in (("image_index", "images_per_sample", "pictures"),
                                     ("video_index", "videos_per_sample", "videos")):
            if rows.get(index) is None or rows.get(per_row) is None:
                continue
            counts = rows[per_row]
            offsets = torch.cumsum(counts, 0) - counts
            shown = [rows[index][int(offsets[r]):int(offsets[r] + counts[r])] for r in group]
            if any(not torch.equal(shown[0], other) for other in shown[1:]):
                raise ImageTokenContractError(f"group {start // g}: its rows show different {kind}")
