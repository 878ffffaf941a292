"""`sees_images`: a model that sees its images (videos) passes; one whose visual tokens are cut off does not; no side
effects. Videos: blanked, frames reversed in time (`reverse_frames`; t == 1 counted, not reordered) and shuffled
among equal grids; a batch of videos only works; image-only reports keep their fields and text."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import mmadapt
from mmadapt.controls import shuffle_images
from mmadapt.data.video import reverse_frames
from mmadapt.sees import SeesImagesReport, sees_images, sees_records
from mmadapt.synthetic import synthetic_batch, synthetic_samples, synthetic_video_batch

COMBINATIONS = [("qwen3_5_vit", "qwen_merger", "qwen3_5"), ("clip", "mlp2x_gelu", "llama")]


def tiny(names: tuple[str, str, str]) -> mmadapt.VisionLanguageModel:
    torch.manual_seed(0)
    return mmadapt.build_model(*names)


def batch_for(model, images_per_sample=(1, 1, 2)) -> dict:
    """Qwen: grids 16, 16, 32, 16 px -> the three 16 px images can be shuffled; CLIP: one fixed grid."""
    sides = [16, 16, 32, 16] if model.encoder.dynamic else None
    return synthetic_batch(model, images_per_sample, image_sides=sides, seed=3)


def snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, bool]]:
    return {name: (p.detach().clone(), None if p.grad is None else p.grad.clone(), p.requires_grad)
            for name, p in model.named_parameters()}


def assert_unchanged(model: nn.Module, before: dict) -> None:
    for name, p in model.named_parameters():
        value, grad, requires_grad = before[name]
        assert torch.equal(p.detach(), value), name
        assert p.requires_grad == requires_grad, name
        if grad is None:
            assert p.grad is None, name
        else:
            assert torch.equal(p.grad, grad), name


def last_linear(module: nn.Module) -> nn.Linear:
    return [m for m in module.modules() if isinstance(m, nn.Linear)][-1]


@pytest.mark.parametrize("names", COMBINATIONS, ids=lambda n: "+".join(n))
def test_a_normal_model_sees_its_images(names):
    model = tiny(names)
    report = sees_images(model, batch_for(model))
    assert report.ok, str(report)
    assert report.grad_projector > 0 and report.grad_encoder is not None and report.grad_encoder > 0
    assert report.blanked_change != 0 and report.shuffled_change not in (None, 0.0)
    assert report.images == 4 and report.images_shuffled == (3 if model.encoder.dynamic else 4)
    assert "sees its images" in str(report) and "shuffled images" in str(report)


def test_the_call_changes_no_parameter_gradient_flag_or_mode():
    model = tiny(COMBINATIONS[0]).train()
    model.encoder.requires_grad_(False)
    model.projector.requires_grad_(False)  # a frozen projector is still measured, and stays frozen
    for p in model.backbone.parameters():
        p.grad = torch.full_like(p, 0.5)  # gradients a user accumulated before the check stay as they were
    model.backbone.model.layers[0].eval()  # a submodule's own mode is restored too
    before = snapshot(model)
    report = sees_images(model, batch_for(model))
    assert report.ok, str(report)
    assert report.grad_encoder is None and "frozen (not measured)" in str(report)
    assert_unchanged(model, before)
    assert model.training and model.projector.training and not model.backbone.model.layers[0].training


@pytest.mark.parametrize("names", COMBINATIONS, ids=lambda n: "+".join(n))
def test_a_projector_that_outputs_nothing_is_reported_as_not_seeing(names):
    model = tiny(names)
    layer = last_linear(model.projector)
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.zero_()
    layer.requires_grad_(False)
    before = snapshot(model)
    report = sees_images(model, batch_for(model))
    assert not report.ok
    assert report.blanked_change == 0.0 and report.shuffled_change == 0.0
    assert any("the answer loss does not change with blanked images" in p for p in report.problems)
    assert "does NOT see its images" in str(report)
    assert_unchanged(model, before)


def test_visual_tokens_that_never_reach_the_llm_get_no_gradient(monkeypatch):
    model = tiny(COMBINATIONS[0])
    model.config.check_contract = False  # the contract would catch this; the check must too, without it
    monkeypatch.setattr(model, "embed", lambda input_ids, spans, visual: model.backbone.get_input_embeddings()(
        input_ids))
    report = sees_images(model, batch_for(model))
    assert not report.ok
    assert report.grad_projector == 0.0 and report.grad_encoder == 0.0
    assert any("no gradient reaches the projector" in p for p in report.problems)


def test_shuffling_is_not_applicable_when_no_two_images_share_a_grid():
    model = tiny(COMBINATIONS[0])
    batch = synthetic_batch(model, (1, 1), image_sides=[16, 32], seed=3)
    report = sees_images(model, batch)
    assert report.loss_shuffled is None and report.shuffled_change is None
    assert "not applicable" in str(report)
    assert report.ok, str(report)  # the gradient and the blanked loss still show the images are seen


def test_shuffle_images_moves_images_only_among_equal_grids():
    grids = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 2, 2], [1, 2, 2]])
    rows = grids.prod(-1).tolist()
    pixels = torch.cat([torch.full((n, 3), float(i)) for i, n in enumerate(rows)])
    out, moved = shuffle_images(pixels, grids)
    assert moved == 3
    images = [chunk[0, 0].item() for chunk in out.split(rows)]
    assert images == [3.0, 1.0, 0.0, 2.0]  # image 1 (the only 2x4 grid) stays; 0, 2, 3 rotate
    fixed = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 3, 2, 2)
    rolled, moved = shuffle_images(fixed)
    assert moved == 3 and rolled[:, 0, 0, 0].tolist() == [2.0, 0.0, 1.0]
    assert shuffle_images(fixed[:1]) is None


def test_a_batch_without_answers_or_images_is_refused():
    model = tiny(COMBINATIONS[0])
    batch = batch_for(model)
    with pytest.raises(ValueError, match="answer labels"):
        sees_images(model, {**batch, "labels": torch.full_like(batch["labels"], -100)})
    with pytest.raises(ValueError, match="pixel_values is missing"):
        sees_images(model, {k: v for k, v in batch.items() if k != "pixel_values"})
    videos = video_batch(model)
    with pytest.raises(ValueError, match="pixel_values is missing, and so is pixel_values_videos"):
        sees_images(model, {k: v for k, v in videos.items() if not k.startswith("pixel_values")})


def test_report_tolerance_and_dict():
    report = SeesImagesReport(loss=2.0, loss_blanked=2.0 + 1e-9, loss_shuffled=None, grad_projector=1.0,
                              grad_encoder=None, images=2, images_shuffled=0)
    assert not report.ok and report.to_dict()["ok"] is False  # a change of 1e-9 is float noise, not an image
    seen = dataclasses.replace(report, loss_blanked=2.1)
    assert seen.ok and seen.to_dict()["blanked_change"] == pytest.approx(0.1)


# ---- videos ----------------------------------------------------------------------------------------------
# three videos: two of 4 frames at 32 x 48 (t = 2, one grid: shuffled between them), one of 2 frames (t = 1)
VIDEO_LAYOUT = (("video", "image"), ("video",), ("video",))
VIDEO_SHAPES = ((4, 32, 48), (4, 32, 48), (2, 32, 32))


def video_batch(model, layout=VIDEO_LAYOUT, shapes=VIDEO_SHAPES, image_sides=(32,)) -> dict:
    return synthetic_video_batch(model, layout, video_shapes=shapes, image_sides=image_sides, seed=5)


def test_a_normal_model_sees_its_videos():
    model = tiny(COMBINATIONS[0])
    before = snapshot(model)
    report = sees_images(model, video_batch(model))
    assert report.ok, str(report)
    assert report.images == 1 and report.loss_shuffled is None and report.blanked_change not in (None, 0.0)
    assert (report.videos, report.videos_reversed, report.videos_single_frame, report.videos_shuffled) == (
        3, 2, 1, 2)
    for change in (report.blanked_videos_change, report.reversed_change, report.shuffled_videos_change):
        assert change is not None and change != 0.0
    text = str(report)
    assert "real images and videos" in text and "sees its images and videos" in text
    assert "2 of 3 videos reordered, 1 with one temporal patch" in text and "2 of 3 videos moved" in text
    data = report.to_dict()
    assert data["videos_single_frame"] == 1 and data["reversed_change"] == pytest.approx(
        report.loss_reversed - report.loss)
    assert_unchanged(model, before)


def test_a_batch_of_videos_only_is_measured():
    model = tiny(COMBINATIONS[0])
    report = sees_images(model, video_batch(model, (("video",), ("video",)), VIDEO_SHAPES[:2], image_sides=()))
    assert report.ok, str(report)
    assert report.images == 0 and report.loss_blanked is None and report.blanked_change is None
    assert report.videos == 2 and report.videos_shuffled == 2 and report.videos_single_frame == 0
    text = str(report)
    assert "real videos" in text and "sees its videos" in text and "images:" not in text


def test_videos_of_one_temporal_patch_or_distinct_grids_are_not_applicable():
    model = tiny(COMBINATIONS[0])
    report = sees_images(model, video_batch(model, (("video",), ("video",)), ((2, 32, 32), (2, 32, 48)),
                                            image_sides=()))
    assert report.loss_reversed is None and report.loss_shuffled_videos is None
    assert report.videos_single_frame == 2 and report.videos_reversed == 0
    assert "no video has two different temporal patches, 2 with one temporal patch" in str(report)
    assert "no two videos share a patch grid" in str(report)
    assert report.ok, str(report)  # the gradient and the blanked videos still show they are seen


def test_a_projector_that_outputs_nothing_does_not_see_videos():
    model = tiny(COMBINATIONS[0])
    layer = last_linear(model.projector)
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.zero_()
    report = sees_images(model, video_batch(model))
    assert not report.ok and report.reversed_change == 0.0 and report.blanked_videos_change == 0.0
    problems = " | ".join(report.problems)
    assert "does not change with blanked videos" in problems and "does not change with frames reversed" in \
        problems and "does not change with shuffled videos" in problems
    assert "does NOT see its images and videos" in str(report)


def test_image_only_reports_keep_their_fields_and_text():
    model = tiny(COMBINATIONS[0])
    report = sees_images(model, batch_for(model))
    assert (report.videos, report.loss_blanked_videos, report.loss_reversed, report.loss_shuffled_videos) == (
        0, None, None, None)
    lines = str(report).splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "answer loss, real images", "answer loss, blanked images", "answer loss, shuffled images",
        "gradient norm at projector", "gradient norm at encoder", "verdict"]
    assert lines[0] == f"answer loss, real images:     {report.loss:.4f}"


def test_reverse_frames_reverses_temporal_patches_inside_each_video():
    grids = torch.tensor([[3, 1, 2], [1, 2, 2], [2, 1, 1], [2, 1, 1]])
    rows = grids.prod(-1).tolist()
    # value = 10 * video + temporal patch; video 3's two patches are equal (nothing to reorder)
    values = [10.0 * v + (0 if v == 3 else k // (n // t))
              for v, (n, t) in enumerate(zip(rows, grids[:, 0].tolist(), strict=True)) for k in range(n)]
    pixels = torch.tensor(values)[:, None].expand(-1, 2)
    out, moved = reverse_frames(pixels, grids)
    assert moved == 2 and out.shape == pixels.shape
    videos = [chunk[:, 0].tolist() for chunk in out.split(rows)]
    assert videos == [[2.0, 2.0, 1.0, 1.0, 0.0, 0.0], [10.0] * 4, [21.0, 20.0], [30.0, 30.0]]
    again, _ = reverse_frames(out, grids)
    assert torch.equal(again, pixels)  # reversal is its own inverse


def test_sees_records_checks_the_first_batches_that_encode_and_prints_one_row_each():
    from mmadapt.data import Collator, DataProblem

    model = tiny(COMBINATIONS[1])
    samples = synthetic_samples(model, (1, 1, 1, 1, 1, 1, 1), seed=3)

    class Encoder:  # record i is sample i; the `bad` ones cannot be encoded (a counted, non-fatal problem)
        def __init__(self, bad=(1,)):
            self.bad = bad

        def encode(self, record, index):
            if index in self.bad:
                raise DataProblem("missing_image", "gone", sample_id=str(index))
            return samples[index]

    collate = Collator.for_model(model, pad_token_id=0)
    report = sees_records(model, Encoder(), collate, [{}] * 7, batches=2, batch_size=2, source="data.jsonl")
    assert len(report.batches) == 2 and report.ok and report.seen == "images"
    expected = [sees_images(model, collate([samples[0], samples[2]])), sees_images(model, collate(samples[3:5]))]
    assert [r.loss for r in report.batches] == [r.loss for r in expected]
    lines = str(report).splitlines()
    assert lines[0].split() == ["batch", "loss", "blanked", "shuffled", "grad", "proj", "verdict"] and len(lines) == 4
    assert lines[1].split()[:2] == ["0", f"{expected[0].loss:.4f}"] and lines[1].endswith("sees its images")
    assert lines[-1] == "the model sees its images on 2 batch(es) of data.jsonl"
    assert report.to_dict()["ok"] and len(report.to_dict()["batches"]) == 2
    with pytest.raises(ValueError, match=r"none of the records of data\.jsonl could be encoded"):
        sees_records(model, Encoder(bad=(0, 1)), collate, [{}, {}], source="data.jsonl")
