"""GRPO with tools (`grpo.tools`): the agent a run's settings make, a micro-batch's trajectories laid out for the loss,
and the eval's controls over them.

`agent_for(settings, encoder, tools)` probes the run's chat template at start (`ToolTurns.of`: its call format, and a
refusal, naming the template and the fix, when it would drop the image of a tool message), and bounds every tool
image by `grpo.tool_max_pixels` (default: the processor's own `max_pixels`, as many pixels as it keeps of any
image) and `data.max_image_pixels`.

`trajectory_rows` answers a micro-batch with `multi_turn_rollout` and lays out its rows (`scored_trajectories`): the
rollout's policy tokens are the `Rollouts` the loss and its mask are over, tool messages are never labelled, and
the step's one encoding (`Encoded`) holds the prompts' pictures and every image the tools returned, in the pool's
order.

`tool_controls` is the eval with tools: one greedy trajectory per prompt with its real images, with every image
blanked (the prompt's and those tools return), and with the images tools return blanked (the prompt's kept): a
policy that learned to look again scores lower when what it is shown is blank. Also the tool calls per trajectory.
(Shuffled images are not run with tools: a tool would crop the prompt's own image, not the shuffled one.)
"""

from __future__ import annotations

from typing import Any

import torch

from mmadapt.train.objectives.rollout import Encoded
from mmadapt.train.objectives.turns import (
    Agent,
    Trajectories,
    check_trajectory_groups,
    multi_turn_rollout,
    scored_trajectories,
)

TOOL_CONTROLS = ("real", "blanked", "tool_images_blanked")


def processor_pixels(processor: Any) -> int:
    """The most pixels an image processor keeps of an image (Qwen's `max_pixels`; a fixed-size one's square)."""
    if getattr(processor, "max_pixels", None):
        return int(processor.max_pixels)
    size = getattr(processor, "image_size", None)
    return int(size) ** 2 if size else 1 << 20


def agent_for(settings: Any, encoder: Any, tools: tuple[Any, ...]) -> Agent:
    """The run's agent (module docstring); `ChatTemplateError` at start for a template without tools, or one that
    drops tool images."""
    from mmadapt.data.tool_turns import ToolTurns

    pixels = min(settings.tool_max_pixels or processor_pixels(encoder.processor), encoder.config.max_image_pixels)
    return Agent(ToolTurns.of(encoder), {t.name: t for t in tools}, encoder.processor, max_turns=settings.max_turns,
                 max_tokens=settings.max_trajectory_length or encoder.config.max_length, timeout=settings.tool_timeout,
                 max_pixels=pixels, max_images=settings.tool_max_images)


def answer(model: Any, processor: Any, batch: dict[str, Any], num_generations: int, sampling: Any, agent: Agent, *,
           seeds: torch.Tensor | None = None, pictures: Encoded | None = None, encode: Any = None,
           blank: bool = False) -> Trajectories:
    """The trajectories of a prompt batch, each prompt offered its own tools (the batch's `tools`)."""
    images = batch.get("images") or [() for _ in range(batch["input_ids"].shape[0])]
    return multi_turn_rollout(model, processor, batch, num_generations, sampling, agent, seeds=seeds,
                              encoded=pictures, images=images, encode=encode, blank_tool_images=blank,
                              offered=batch.get("tools"))


def trajectory_rows(batch: dict[str, Any], done: Trajectories, pictures: Encoded | None, pad_token_id: int,
                    processor: Any) -> tuple[dict[str, Any], Encoded | None, dict[str, Any]]:
    """The rows the policy scores, the step's one encoding of their pictures (with graph), and the pictures'
    inputs for encoding them again (`num_iterations` > 1 with a trained vision side)."""
    rows = scored_trajectories(batch, done, pad_token_id, processor)
    check_trajectory_groups(rows, batch, done)
    videos = pictures.videos if pictures is not None else None
    if done.pool is not None:
        encoded = Encoded(done.pool, videos)
    else:
        encoded = pictures
    again = {"input_ids": batch["input_ids"], **done.pixels,
             **{k: batch[k] for k in ("pixel_values_videos", "video_grid_thw") if batch.get(k) is not None}}
    return rows, encoded, again


def logged(done: Trajectories) -> dict[str, float]:
    """What a step logs of its trajectories: answers and tool calls per trajectory, tool problems per trajectory by
    kind."""
    count = len(done.segments)
    answers = sum(sum(1 for _, policy in row if policy) for row in done.segments) / count
    out = {"tools/calls": float(done.calls.float().mean()), "tools/answers": answers}
    out.update({f"tools/problems/{kind}": n / count for kind, n in sorted(done.problems.items())})
    return out


@torch.no_grad()
def tool_controls(model: Any, scorer: Any, agent: Agent, batch: dict[str, Any],
                  keep: Any = None) -> dict[str, list[float]]:
    """{control: the total rewards of one greedy trajectory per prompt} for `TOOL_CONTROLS`, and "tool_calls";
    `keep(done, totals)` receives the real images' trajectories and rewards (`record`)."""
    out: dict[str, list[float]] = {}
    for control in TOOL_CONTROLS:
        shown = dict(batch)
        if control == "blanked" and batch.get("pixel_values") is not None:
            shown["pixel_values"] = torch.zeros_like(batch["pixel_values"])
        done = answer(model, scorer.processor, shown, 1, scorer.sampling, agent, blank=control != "real")
        totals = scorer.score(done.texts, batch, 1, done.columns()).total
        out[control] = [t for t in totals if t == t]
        if control == "real":
            out["tool_calls"] = done.calls.float().tolist()
            if keep is not None:
                keep(done, totals)
    return out


def record(target: Any, batch: dict[str, Any], done: Trajectories, totals: list[float], limit: int) -> int:
    """Up to `limit` trajectories of `batch` written to the directory `target` (atomically, replacing it): one
    record each in the messages format (the prompt's turns, each answer with its calls as `tool_calls`, each tool
    result with `<image>` per image), the prompt's and the tools' images as PNG files beside them, its reward and its
    prompt's columns; `mmadapt data show TARGET/trajectories.jsonl --image-root TARGET` renders them as the model saw
    them, and SFT trains on them. Returns how many were written."""
    import io
    import json

    from mmadapt.atomic import StagedDirectory

    g, written = done.num_generations, []
    with StagedDirectory(target, what="recorded trajectories", overwrite=True,
                         recognise=lambda path: (path / "trajectories.jsonl").is_file()) as stage:
        for r in range(min(limit, len(done.segments))):
            b, names = r // g, []
            for k, image in enumerate([*batch["images"][b], *done.tool_images[r]]):
                buffer = io.BytesIO()
                image.save(buffer, "PNG")
                names.append(stage.write_bytes(f"{r}-{k}.png", buffer.getvalue()).name)
            sample = batch["meta"]["sample_ids"][b]
            sample = sample[0] if isinstance(sample, list | tuple) else sample
            messages = [{"role": t.role, "content": t.text} for t in batch["turns"][b]] + done.history[r]
            written.append({**batch["columns"][b], "id": f"{sample}/{r % g}", "images": names, "messages": messages,
                            "reward": totals[r], "tool_calls": int(done.calls[r])})
        stage.write_bytes("trajectories.jsonl", "\n".join(json.dumps(x, ensure_ascii=False) for x in written).encode())
    return len(written)
