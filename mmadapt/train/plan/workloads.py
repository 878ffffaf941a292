"""The longest micro-batch of a run, as the plan sizes it: `batch_size` samples of `max_length` tokens, each with
one image at the processor's largest size that fits, or, for models that take video, one video at `data.video`'s
largest when that has more visual tokens; each sample is the objective's `rows_per_sample` rows (`train.objective:
dpo`: `batch_size` pairs, 2 rows each, the pair's image encoded once; the reference's no-grad forward is not counted:
it is freed before the policy's; `grpo`: `batch_size` prompts, G answer rows each, the prompt's image or video encoded
once).

A reward does not change the step's memory: `without_reward_code` leaves out, before the objective is built, a reward
the config names as code (`package.module:function`, which importing would run), unless the caller names it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mmadapt.train.config import RunConfig
from mmadapt.train.objectives import OBJECTIVES, objective_for


@dataclass
class Workload:
    """The longest micro-batch of a run, as the plan sizes it."""

    rows: int
    tokens: int  # all positions of the micro-batch (rows x row length)
    images: int
    patches_per_image: int
    visual_per_image: int
    supervised: int
    image_side: int | None = None  # dynamic encoders: the square image's side in pixels
    video_frames: int = 0  # > 0: each sample's visual content is a video of these sampled frames (not an image)

    def describe(self) -> str:
        what = f"video(s) of {self.video_frames} frames" if self.video_frames else "image(s)"
        return (f"{self.rows} x {self.tokens // self.rows} tokens, {self.images} {what} of {self.visual_per_image} "
                f"visual tokens ({self.patches_per_image} patches)")


def workload(config: RunConfig, model: Any) -> Workload:
    """`batch_size` samples of `max_length` tokens, one image each at the largest size the processor makes that fits
    in a sample (packed: the same samples in whole rows of `max_tokens`)."""
    from mmadapt.data.processors import processor_for

    d = config.data
    processor = processor_for(model)
    if model.encoder.dynamic:
        side = math.isqrt(processor.max_pixels)
        visual = processor.tokens_for_size(side, side)
        while visual > max(d.max_length - 256, d.max_length // 2) and side > processor.patch_size:
            side = int(side * 0.9)
            visual = processor.tokens_for_size(side, side)
        side = processor.target_size(side, side)[0]
        patches = visual * processor.projector_merge**2
    else:
        side = None
        visual = processor.tokens_for_size(0, 0)
        patches = int(torch.tensor(model.encoder.grid).prod())
    frames = 0
    video = video_workload(config, model, processor)
    if video is not None and video[0] > visual:
        visual, frames = video
        patches = visual * processor.projector_merge**2
    tokens = d.batch_size * d.max_length
    rows = d.batch_size
    if d.packing:
        rows = max(1, math.ceil(tokens / d.max_tokens))
        tokens = rows * d.max_tokens
    supervised = d.batch_size * max(d.max_length - visual, 1)
    images = d.batch_size
    objective = objective_for(config)
    per_sample = objective.rows_per_sample  # a preference pair: 2 padded rows (chosen, rejected); GRPO: G answers
    rows, tokens, supervised = per_sample * rows, per_sample * tokens, per_sample * supervised  # the image encoded
    images = per_sample * images if frames and not objective.shares_videos else images  # once; a pair's video per row
    return Workload(rows=rows, tokens=tokens, images=images, patches_per_image=patches, visual_per_image=visual,
                    supervised=supervised, image_side=side, video_frames=frames)


def without_reward_code(config: RunConfig, rewards: list[str] | None = None) -> tuple[RunConfig, str | None]:
    """(`config` for the plan, a line saying what code it left out, or None): the run's objective's `without_code` -
    a plan runs no code a config names unless the command line names it (`rewards`)."""
    return OBJECTIVES.get(config.train.objective).without_code(config, rewards)


def video_workload(config: RunConfig, model: Any, processor: Any) -> tuple[int, int] | None:
    """(visual tokens, sampled frames) of the largest video `data.video` lets through, as the video processor counts
    them (the most frames sampling keeps; frames sized to the `max_pixels` budget); None for models without video."""
    from mmadapt.data.video import VideoConfig

    if not model.encoder.dynamic or model.tokens.video_token_id is None:
        return None
    settings = VideoConfig.parse(config.data.video)
    videos = settings.processor(processor)
    sampling = settings.sampling
    frames = sampling.num_frames if sampling.num_frames is not None else sampling.max_frames
    side = math.isqrt(videos.max_pixels // max(frames, 1)) + 1  # frames large enough to be cut to the budget
    tokens = videos.tokens_for(frames, side, side)
    while tokens > max(config.data.max_length - 256, config.data.max_length // 2) and frames > 1:
        frames = max(1, frames // 2)  # a video that cannot fit max_length is dropped as too_long, never trained on
        tokens = videos.tokens_for(frames, side, side)
    return tokens, frames

