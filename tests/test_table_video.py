"""Videos embedded in a dataset's rows (mmadapt.data.tables, mmadapt.data.video.decode.EmbeddedVideo): a tiny set in
LLaVA-Video-178K's layout (`id`, `conversations`, `video`) written by `datasets` with the video files' bytes in the
`video` column gives the tokens, labels and video pixels of the same samples written as LLaVA JSON with the files on
disk; a corrupt blob and a video over the limits are counted problems naming the row and column, the latter found
from the header with no frame decoded."""

from __future__ import annotations

import json

import datasets
import pytest
import torch

import mmadapt
from mmadapt.data import DataProblem, SampleEncoder, VLMDataset, char_tokenizer, check_dataset, read_records
from mmadapt.data.video import EmbeddedVideo, VideoSampling, load_video, probe_video
from mmadapt.data.video import decode as video_decode
from mmadapt.synthetic import moving_square, write_video

VIDEO_SETTINGS = {"fps": 4, "min_pixels": 16 * 16, "max_pixels": 8 * 64 * 64}
QUESTIONS = [("left.mp4", "Which way does the square move?", "Left."), ("down.mp4", "Where does it go?", "Down.")]


def turns(question: str, answer: str) -> list[dict[str, str]]:
    return [{"from": "human", "value": f"<video>\n{question}"}, {"from": "gpt", "value": answer}]


def video_table(path, rows: list[dict]) -> None:
    """`rows` ({id, conversations, video bytes}) as LLaVA-Video-178K's layout, the bytes in a `datasets` Video
    column."""
    cells = [{"id": r["id"], "conversations": r["conversations"], "video": {"bytes": r["video"], "path": None}}
             for r in rows]
    datasets.Dataset.from_list(cells).cast_column("video", datasets.Video()).to_parquet(str(path))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Two clips on disk with their LLaVA JSON, and the same clips embedded in a Parquet file; a 5-second clip."""
    root = tmp_path_factory.mktemp("table_video")
    write_video(root / "left.mp4", moving_square(12, 32, 48, direction=(0, -1), start=(8, 40)), fps=8)
    write_video(root / "down.mp4", moving_square(7, 48, 32, direction=(1, 0)), fps=5)
    write_video(root / "long.mp4", moving_square(40, 32, 32), fps=8)
    records = [{"id": f"v{k}", "video": name, "conversations": turns(q, a)} for k, (name, q, a) in enumerate(QUESTIONS)]
    (root / "llava.json").write_text(json.dumps(records))
    video_table(root / "videos.parquet", [{**r, "video": (root / r["video"]).read_bytes()} for r in records])
    return root


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    return mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5").eval()


def encoder_for(model, media, **video):
    return SampleEncoder.for_model(model, char_tokenizer(), image_root=str(media), video={**VIDEO_SETTINGS, **video})


def test_an_embedded_video_decodes_to_the_frames_of_the_same_file(media):
    data = (media / "left.mp4").read_bytes()
    embedded = EmbeddedVideo(data, "videos.parquet row 0 video[0]")
    assert probe_video(embedded) == probe_video(media / "left.mp4")
    sampling = VideoSampling(fps=4)
    ours, theirs = load_video(embedded, sampling=sampling), load_video(media / "left.mp4", sampling=sampling)
    assert torch.equal(ours.frames, theirs.frames) and ours.indices == theirs.indices and len(ours) > 1
    assert ours.path == "videos.parquet row 0 video[0]" and repr(embedded).endswith(f"{len(data)} bytes)")


def test_embedded_videos_give_the_tokens_labels_and_pixels_of_the_same_llava_json(media, qwen):
    encoder = encoder_for(qwen, media)
    records = read_records(media / "videos.parquet")
    assert records.layout == "llava" and isinstance(records[0]["videos"][0], EmbeddedVideo)
    table, reference = VLMDataset(records, encoder), VLMDataset(media / "llava.json", encoder)
    assert len(table) == len(reference) == 2
    for k in range(2):
        ours, theirs = table[k], reference[k]
        assert not isinstance(ours, DataProblem), ours
        assert ours.id == theirs.id == f"v{k}" and ours.num_videos == 1
        assert torch.equal(ours.input_ids, theirs.input_ids) and torch.equal(ours.labels, theirs.labels)
        assert torch.equal(ours.pixel_values_videos, theirs.pixel_values_videos)
        assert torch.equal(ours.video_grid_thw, theirs.video_grid_thw)
        assert ours.tokens_per_video == theirs.tokens_per_video


def test_a_corrupt_blob_and_a_video_over_the_limits_are_counted_problems_naming_the_row(media, qwen, tmp_path,
                                                                                          monkeypatch):
    left = (media / "left.mp4").read_bytes()
    rows = [{"id": "ok", "conversations": turns("Which way?", "Left."), "video": left},
            {"id": "garbage", "conversations": turns("Which way?", "Left."), "video": b"not a video at all"},
            {"id": "cut", "conversations": turns("Which way?", "Left."), "video": left[: len(left) // 2]},
            {"id": "too-long", "conversations": turns("How long?", "Long."),
             "video": (media / "long.mp4").read_bytes()}]
    video_table(tmp_path / "bad.parquet", rows)
    records = read_records(tmp_path / "bad.parquet")
    encoder = encoder_for(qwen, media, max_seconds=2.0)  # left.mp4 is 1.5 seconds, long.mp4 5
    report = check_dataset(records, encoder)
    found = {p["id"]: p["reason"] for p in report.problems}
    assert found == {"garbage": "unreadable_video", "cut": "unreadable_video", "too-long": "video_too_large"}
    assert report.ok == 1
    paths = {p["id"]: p["path"] for p in report.problems}
    assert paths["garbage"] == f"{tmp_path / 'bad.parquet'} row 1 video[0]"  # where: the file, row and column
    garbage = next(p["detail"] for p in report.problems if p["id"] == "garbage")
    assert garbage.startswith("not a readable video container: InvalidDataError") and "<none>" not in garbage
    detail = next(p["detail"] for p in report.problems if p["id"] == "too-long")
    assert "5.0 seconds exceeds max_seconds = 2.0" in detail
    # the too-long video is refused from its header: not one frame of it is decoded
    monkeypatch.setattr(video_decode, "_decode", lambda *args: pytest.fail("a frame was decoded"))
    problem = check_dataset(records[3:], encoder).problems[0]
    assert problem["reason"] == "video_too_large" and problem["path"].endswith("bad.parquet row 3 video[0]")


def test_a_video_set_with_embedded_bytes_trains_through_mmadapt_train(media, tmp_path):
    from helpers import write_run

    from mmadapt.cli import main
    from mmadapt.train import latest_checkpoint

    write_run(tmp_path / "run.yaml", model={"encoder": "qwen3_5_vit", "projector": "qwen_merger",
                                            "backbone": "qwen3_5", "preset": "tiny"},
              data={"train": str(media / "videos.parquet"), "batch_size": 2, "video": VIDEO_SETTINGS},
              train={"steps": 1, "out": str(tmp_path / "out"), "progress": False})
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    state = json.loads((latest_checkpoint(tmp_path / "out") / "trainer_state.json").read_text())
    assert state["samples_seen"] == 2 and state["bad_samples"] == 0
