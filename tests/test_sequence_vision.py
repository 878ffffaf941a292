"""The vision side of a sequence-parallel forward divided across the group (`mmadapt.sequence_vision`): how a batch's
pictures are cut into the ranks' pieces, and why a video may be cut between temporal patches (the Qwen ViTs give a
video's tokens exactly when it is encoded in temporal pieces). The SP = 2 equality with one process is in
tests/test_sequence_parallel.py (the `vision_sharded` cases)."""

from __future__ import annotations

import pytest
import torch

from mmadapt import VisionLanguageModel
from mmadapt.batch import VisionBatch
from mmadapt.sequence_parallel import SequenceParallel
from mmadapt.sequence_vision import assign, shardable, whole_videos


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
def test_a_video_encoded_in_temporal_pieces_gives_its_whole_encoding(family):
    torch.manual_seed(0)
    model = VisionLanguageModel.from_names(f"{family}_vit", "qwen_merger", family).train()
    t, h, w = 5, 4, 6
    pixels = torch.randn(t * h * w, model.encoder.patch_dim)
    whole = model.encode_images(pixels, torch.tensor([[t, h, w]]))
    for cuts in ((2, 3), (1, 1, 1, 1, 1), (4, 1)):
        starts = [sum(cuts[:k]) for k in range(len(cuts))]
        parts = [model.encode_images(pixels[s * h * w:(s + c) * h * w], torch.tensor([[c, h, w]]))
                 for s, c in zip(starts, cuts, strict=True)]
        torch.testing.assert_close(torch.cat([p.features for p in parts]), whole.features, rtol=0, atol=1e-6)
        for k, level in enumerate(whole.levels):
            torch.testing.assert_close(torch.cat([p.levels[k] for p in parts]), level, rtol=0, atol=1e-6)
        assert whole_videos(torch.cat([p.grids for p in parts]), [_piece(c) for c in cuts]).tolist() == \
            whole.grids.tolist()
    assert (family == "qwen3_vl") == bool(whole.levels)


def _piece(frames):
    from mmadapt.sequence_vision import Piece

    return Piece(0, True, 0, 0, frames, slice(0, 0))


def qwen_batch(model, image_grids, video_grids):
    dim = model.encoder.patch_dim
    images = torch.tensor(image_grids) if image_grids else None
    videos = torch.tensor(video_grids) if video_grids else None
    return VisionBatch(input_ids=torch.zeros(1, 4, dtype=torch.long),
                       pixel_values=None if images is None else torch.randn(int(images.prod(-1).sum()), dim),
                       image_grid_thw=images,
                       pixel_values_videos=None if videos is None else torch.randn(int(videos.prod(-1).sum()), dim),
                       video_grid_thw=videos)


@pytest.fixture(scope="module")
def qwen():
    return VisionLanguageModel.from_names("qwen3_vl_vit", "qwen_merger", "qwen3_vl")


def test_pieces_are_contiguous_balanced_by_patches_and_cut_videos_between_temporal_patches(qwen):
    batch = qwen_batch(qwen, [[1, 4, 4]], [[3, 4, 6], [2, 6, 4]])  # 16 + 3 x 24 + 2 x 24 = 136 patches
    pieces = assign(qwen, batch, 2)
    assert [(p.rank, p.video, p.index, p.first, p.frames) for p in pieces] == [
        (0, False, 0, 0, 1), (0, True, 0, 0, 2), (1, True, 0, 2, 1), (1, True, 1, 0, 2)]
    assert [(p.rows.start, p.rows.stop) for p in pieces] == [(0, 16), (0, 48), (48, 72), (72, 120)]
    four = assign(qwen, batch, 4)  # 34 patches a rank: no rank more than one unit (24) above it
    loads = [sum(p.rows.stop - p.rows.start for p in four if p.rank == r) for r in range(4)]
    assert sum(loads) == 136 and max(loads) - 34 <= 24, loads
    assert [p.rank for p in four] == sorted(p.rank for p in four)  # contiguous: rank order is encoding order
    lone = assign(qwen, qwen_batch(qwen, [[1, 4, 4]], None), 2)
    assert [(p.rank, p.index) for p in lone] == [(1, 0)]  # an image is never cut: the other rank has no piece


def test_a_fixed_size_encoder_splits_its_images_and_malformed_pixels_stay_replicated(qwen):
    clip = VisionLanguageModel.from_names("clip", "mlp2x_gelu", "llama")
    side = clip.encoder.image_size
    batch = VisionBatch(input_ids=torch.zeros(1, 4, dtype=torch.long), pixel_values=torch.zeros(3, 3, side, side))
    assert shardable(clip, batch)
    assert [(p.rank, p.index, p.rows) for p in assign(clip, batch, 2)] == [
        (0, 0, slice(0, 1)), (1, 1, slice(1, 2)), (1, 2, slice(2, 3))]
    assert not shardable(clip, VisionBatch(input_ids=batch.input_ids, pixel_values=torch.zeros(12, 48)))
    bad = qwen_batch(qwen, [[1, 4, 4]], None).replace(image_grid_thw=torch.tensor([[1, 4, 8]]))
    assert not shardable(qwen, bad)  # the replicated path's encoder names what is wrong
    assert not shardable(qwen, VisionBatch(input_ids=batch.input_ids))


def test_the_vision_mode_is_validated_and_sharded_without_sequence_parallelism_warns(monkeypatch):
    import mmadapt.train.config as config_module
    from mmadapt.train.config import RunConfig

    with pytest.raises(ValueError, match="sequence_parallel_vision must be one of"):
        RunConfig.from_dict({"distributed": {"sequence_parallel_vision": "shard"}})
    with pytest.raises(ValueError, match="sequence-parallel vision 'shard'"):
        SequenceParallel(None, 2, 0, vision="shard")
    warned: list[str] = []  # the module's logger itself (another test's logging setup may keep records from caplog)
    monkeypatch.setattr(config_module.log, "warning", lambda message, *args: warned.append(message % args))
    RunConfig.from_dict({"distributed": {"sequence_parallel_vision": "sharded"}})
    assert any("has no effect with distributed.sequence_parallel: 1" in w for w in warned), warned


def test_the_plan_divides_the_vision_side_by_the_group_when_it_is_sharded(tmp_path, monkeypatch):
    from mmadapt.train.config import RunConfig
    from mmadapt.train.plan.predict import predict

    monkeypatch.setenv("MMADAPT_CACHE", str(tmp_path))

    def plan(**distributed):
        return predict(RunConfig.from_dict({
            "model": {"encoder": "qwen3_5_vit", "projector": "qwen_merger", "backbone": "qwen3_5"},
            "data": {"max_length": 128, "batch_size": 2}, "stages": {"encoder": "full"},
            "distributed": distributed}), gpus=2, device="cpu")

    replicated = plan(sequence_parallel=2)
    sharded = plan(sequence_parallel=2, sequence_parallel_vision="sharded")
    one = plan()  # SP = 1 (data parallel): the vision side is each rank's own
    note = next(n for n in sharded.notes if n.startswith("sequence parallelism"))
    assert "the vision side sharded" in note and "50% of the patches" in note, note
    assert any("the vision side replicated" in n for n in replicated.notes)
    # the decoder's load is the same under both: what differs is half the vision side's activations
    vision = replicated.activations_without_checkpointing - sharded.activations_without_checkpointing
    assert 0 < vision < replicated.activations_without_checkpointing, (replicated.table(), sharded.table())
    assert sharded.per_gpu["total"] <= replicated.per_gpu["total"]
    assert one.activations_without_checkpointing > replicated.activations_without_checkpointing
