"""The vision side of a sequence-parallel forward divided across the group (`distributed.sequence_parallel_vision:
sharded`): the batch's pictures encoded across the N ranks and gathered in order, so the vision tower's activations
divide by N like the decoder's.

The batch's pictures are cut into units, in the order one encoding of them holds their tokens (images first, then
videos, as `mmadapt.frames.encode_together` concatenates them): each image is one unit, each temporal patch of a
video is one. `assign` gives every rank a contiguous run of units, balanced by patches (a unit goes to the rank whose
share of the batch's patches holds its middle); a rank's consecutive temporal patches of one video become one piece,
a sub-video of t_r temporal patches with grid (t_r, h, w). The Qwen ViTs (qwen3_5_vit, qwen3_vl_vit) attend within
each temporal patch (`cu_seqlens` per frame) and take their position embeddings and 2-D rotary positions from (h, w)
alone, and the merger merges spatial windows, so a video encoded in temporal pieces gives exactly its whole encoding's
tokens (tests/test_sequence_vision.py); a fixed-size encoder (CLIP, SigLIP) has images only, each one unit.

Every rank encodes its pieces in one call of the vision side (`VisionLanguageModel.encode_images`); a rank with no
piece runs it on no picture (`vision_placeholder`) and adds that exact 0 to the gathered tokens, so every rank runs the
encoder once per forward (FSDP2's parameter gathers pair) and its vision backward runs (DDP's gradient reduction
pairs). `gather_rows` then joins every rank's tokens (features and DeepStack levels) in rank order, which is the
units' order: an all-gather padded to the longest share. Its backward sums the group's gradients for the gathered
tokens and keeps this rank's rows (a reduce-scatter): `prepare` runs on the whole sequence on every rank, but each
rank decodes only its shard, so the gradient a rank's loss share gives a visual token is only that shard's part; a
rank's pieces then get every shard's part once, and the group's vision gradients add up to one process's.

The result is what `prepare` takes as ready tokens: `visual` one entry per image of the rows, `visual_videos` one per
video of the rows (rows sharing pictures through `image_index` / `video_index` take theirs from the one encoding).

Shapes: I images, V videos, U units, P pieces, N visual tokens, D LLM width, K DeepStack levels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmadapt import contract, frames
from mmadapt.batch import VisionBatch
from mmadapt.contract import ImageTokenContractError as ContractError
from mmadapt.encoders import VisualTokens

MODES = ("replicated", "sharded")  # distributed.sequence_parallel_vision


@dataclass(frozen=True)
class Piece:
    """What one rank encodes of one picture: image `index` (`video` False; `first` 0, `frames` its t), or temporal
    patches [first, first + frames) of video `index`; `rows` its pixel rows (a fixed-size encoder: its image)."""

    rank: int
    video: bool
    index: int
    first: int
    frames: int
    rows: slice


def shardable(model: Any, batch: VisionBatch) -> bool:
    """Whether the batch's pictures can be cut as `assign` cuts them: pixels the encoder takes, whose rows their grids
    account for, with the placeholder tokens that receive them. Else the replicated path runs and its checks name what
    is wrong, on every rank alike (a rank failing alone on its pieces would leave the others waiting in the gather)."""
    images, videos = batch.pixel_values, batch.pixel_values_videos
    if images is None and videos is None:
        return False
    if (images is not None and model.tokens.image_token_id is None) or (
            videos is not None and (model.tokens.video_token_id is None or not model.encoder.dynamic)):
        return False
    try:
        for pixels, grids in ((images, batch.image_grid_thw), (videos, batch.video_grid_thw)):
            if pixels is not None:
                model.encoder.check_pixels(pixels, grids)
    except ContractError:
        return False
    return True


def units(model: Any, batch: VisionBatch) -> list[tuple[bool, int, int, int, int]]:
    """The batch's units in encoding order: (video, index, frame, first pixel row, patches)."""
    out: list[tuple[bool, int, int, int, int]] = []
    if batch.pixel_values is not None:
        if not model.encoder.dynamic:
            return [(False, i, 0, i, 1) for i in range(batch.pixel_values.shape[0])]
        row = 0
        for i, (t, h, w) in enumerate(batch.image_grid_thw.tolist()):
            out.append((False, i, 0, row, t * h * w))
            row += t * h * w
    if batch.pixel_values_videos is not None:
        row = 0
        for v, (t, h, w) in enumerate(batch.video_grid_thw.tolist()):
            out += [(True, v, f, row + f * h * w, h * w) for f in range(t)]
            row += t * h * w
    return out


def assign(model: Any, batch: VisionBatch, size: int) -> list[Piece]:
    """Every rank's pieces, in encoding order (ranks ascending): contiguous runs of units balanced by patches, a
    rank's consecutive temporal patches of one video joined into one sub-video."""
    found = units(model, batch)
    total = max(1, sum(u[-1] for u in found))
    pieces: list[Piece] = []
    done = 0
    for video, index, frame, row, patches in found:
        rank = min(size - 1, int((2 * done + patches) * size // (2 * total)))  # the rank holding its middle
        done += patches
        last = pieces[-1] if pieces else None
        if video and last is not None and last.video and last.rank == rank and last.index == index:
            pieces[-1] = Piece(rank, True, index, last.first, last.frames + 1, slice(last.rows.start, row + patches))
        else:
            pieces.append(Piece(rank, video, index, frame, 1, slice(row, row + patches)))
    return pieces


def encode_mine(model: Any, batch: VisionBatch, pieces: list[Piece]) -> VisualTokens:
    """This rank's pieces through the vision side in one call (images, then sub-videos); no piece: its run on no
    picture (`vision_placeholder`, no token kept), always - one small image, it gives the gather this rank's token
    width and dtype too."""
    if not pieces:
        return model.vision_placeholder(batch.input_ids.device)
    dtype = (batch.pixel_values if batch.pixel_values is not None else batch.pixel_values_videos).dtype
    pixels, grids = [], []
    for piece in pieces:
        source = batch.pixel_values_videos if piece.video else batch.pixel_values
        pixels.append(source[piece.rows].to(dtype))
        source_grids = batch.video_grid_thw if piece.video else batch.image_grid_thw
        if source_grids is not None:
            grid = source_grids[piece.index].clone()
            if piece.video:  # a sub-video: its temporal patches only
                grid[0] = piece.frames
            grids.append(grid)
    return model.encode_images(torch.cat(pixels), torch.stack(grids) if grids else None)


def encode_sharded(model: Any, batch: VisionBatch, group: Any, size: int,
                   rank: int) -> tuple[VisualTokens | None, VisualTokens | None]:
    """(`visual`, `visual_videos`) for `prepare`: the batch's pictures encoded across the group (see the module's
    docstring), the rows' images and videos in row order."""
    pieces = assign(model, batch, size)
    local = encode_mine(model, batch, [p for p in pieces if p.rank == rank])
    counts = [sum(1 for p in pieces if p.rank == r) for r in range(size)]
    grids = gather_grids(local.grids.to(local.features.device), counts, group)
    tokens = [int(g.prod(-1).sum()) for g in grids.split(counts)]
    widths = [local.features.shape[-1], *(level.shape[-1] for level in local.levels)]
    joined = gather_rows(torch.cat([local.features, *local.levels], dim=-1), tokens, group, rank)
    if not local.num_images:  # this rank's run on no picture: its exact 0 keeps its vision side in the graph
        joined = joined + local.zero().to(joined.dtype)
    features, *levels = joined.split(widths, dim=-1)
    images = sum(1 for p in pieces if not p.video)
    cut = int(grids[:images].prod(-1).sum())
    visual = VisualTokens(features[:cut], grids[:images], local.window, tuple(level[:cut] for level in levels))
    video_grids = whole_videos(grids[images:], pieces[images:])
    videos = VisualTokens(features[cut:], video_grids, local.window, tuple(level[cut:] for level in levels))
    return (rows_images(model, batch, visual if images else None),
            rows_videos(model, batch, videos if video_grids.numel() else None))


def whole_videos(grids: torch.Tensor, pieces: list[Piece]) -> torch.Tensor:
    """(V, 3) each video's (LLM-side) grid from its pieces' (t_r, h, w): the temporal patches added up."""
    out: list[torch.Tensor] = []
    for grid, piece, previous in zip(grids, pieces, [None, *pieces][:len(pieces)], strict=True):
        if previous is not None and previous.index == piece.index:
            out[-1][0] += grid[0]
        else:
            out.append(grid.clone())
    return torch.stack(out) if out else grids.new_zeros(0, 3)


def rows_images(model: Any, batch: VisionBatch, visual: VisualTokens | None) -> VisualTokens | None:
    """The rows' images (`image_index`: rows sharing encoded images) from the batch's encoded images."""
    if visual is None or batch.image_index is None:
        return visual
    spans = contract.locate(batch.input_ids, model.tokens.image_token_id)
    return model.shared_images(visual, batch.image_index, spans)


def rows_videos(model: Any, batch: VisionBatch, videos: VisualTokens | None) -> VisualTokens | None:
    """The rows' videos (`video_index`: rows sharing encoded videos) from the batch's encoded videos."""
    if videos is None or batch.video_index is None:
        return videos
    return frames.shared(videos, batch, contract.locate(batch.input_ids, model.tokens.video_token_id))


def gather_grids(grids: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
    """(P, 3) every rank's pieces' grids (rank r has `counts[r]`), in rank order."""
    width = max(counts)
    padded = F.pad(grids.long(), (0, 0, 0, width - grids.shape[0]))
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])


def gather_rows(x: torch.Tensor, counts: list[int], group: Any, rank: int) -> torch.Tensor:
    """Every rank's rows of `x` (rank r's (counts[r], W)) joined in rank order. The backward sums the gradient over
    the group and keeps this rank's rows: after the gather each rank decodes only its shard of the sequence, so its
    gradient for the gathered tokens is its shard's share, and a rank's pieces need every rank's share."""
    return _GatherRows.apply(x, counts, group, rank)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: list[int], group: Any, rank: int) -> torch.Tensor:
        ctx.start, ctx.count, ctx.group = sum(counts[:rank]), counts[rank], group
        padded = F.pad(x, (0, 0, 0, max(counts) - x.shape[0])).contiguous()
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.contiguous().clone()  # each rank's gradient is its own shard's share: summed over the group
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.start:ctx.start + ctx.count], None, None, None
