"""mmadapt.data.video: sampling, PyAV loading with DataProblems, and bit-exact parity with Qwen3VLVideoProcessor."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from mmadapt.data.problems import DataProblem
from mmadapt.data.video import (
    Video,
    VideoLimits,
    VideoProcessor,
    VideoSampling,
    calculate_timestamps,
    frame_text,
    load_video,
)
from mmadapt.data.video import decode as video_decode
from mmadapt.data.video import sampling as video_sampling

transformers_video = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: E402
from transformers.video_utils import VideoMetadata, read_video_pyav  # noqa: E402

CODEC = "libx264" if "libx264" in av.codecs_available else "mpeg4"


def frames_of(count: int, height: int, width: int, seed: int = 0) -> list[np.ndarray]:
    """A noisy background with a moving bright square: (H, W, 3) uint8 frames."""
    rng = np.random.default_rng(seed)
    background = rng.integers(0, 200, (height, width, 3), dtype=np.uint8)
    side = max(2, min(height, width) // 4)
    out = []
    for i in range(count):
        frame = background.copy()
        top, left = (3 * i) % max(1, height - side), (5 * i) % max(1, width - side)
        frame[top : top + side, left : left + side] = (255, 240 - 5 * i % 200, 30)
        out.append(frame)
    return out


def write_video(path: Path, count: int, height: int, width: int, fps: int = 10, faststart: bool = False) -> Path:
    options = {"movflags": "+faststart"} if faststart else {}
    with av.open(str(path), "w", options=options) as container:
        stream = container.add_stream(CODEC, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames_of(count, height, width):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def hf_processor(**kwargs) -> transformers_video.Qwen3VLVideoProcessor:
    settings = dict(patch_size=16, temporal_patch_size=2, merge_size=2, cap_pixels_per_frame=False)
    settings.update(kwargs)
    return transformers_video.Qwen3VLVideoProcessor(**settings)


def hf_run(path: Path, sample_kwargs: dict, **kwargs):
    """transformers on a file: its pyav backend decodes + samples with its own sample_frames, then preprocesses."""
    hf = hf_processor(**kwargs)
    array, metadata = read_video_pyav(str(path), sample_indices_fn=lambda metadata: hf.sample_frames(
        metadata, **sample_kwargs))
    out = hf(videos=[array], video_metadata=[metadata], do_sample_frames=False, return_metadata=True,
             return_tensors="pt")
    return out, metadata


class TinyTokenizer:
    """Just enough of a tokenizer for Qwen3VLProcessor.replace_video_token."""

    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"
    vision_start_token = "<|vision_start|>"
    vision_end_token = "<|vision_end|>"


def hf_prompt(hf, grid_thw: torch.Tensor, metadata: VideoMetadata) -> str:
    processor = object.__new__(Qwen3VLProcessor)  # no tokenizer files needed: set just what the method reads
    processor.video_processor = hf
    processor.video_token = TinyTokenizer.video_token
    processor.vision_start_token = TinyTokenizer.vision_start_token
    processor.vision_end_token = TinyTokenizer.vision_end_token
    return processor.replace_video_token({"video_grid_thw": grid_thw, "video_metadata": [metadata]}, 0)


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("videos")
    return {
        "a": write_video(root / "a.mp4", 23, 96, 128),  # odd frame count, 4:3
        "b": write_video(root / "b.mp4", 30, 72, 160, fps=15),
        "c": write_video(root / "c.mp4", 9, 200, 120, fps=10),
        "d": write_video(root / "d.mp4", 8, 360, 480, fps=8),  # downscaled with antialiasing
    }


# ---- parity with transformers -------------------------------------------------------------------
CASES = [
    ("a", {"fps": 2.0}, {}),  # 2.3 s at 2 fps -> 4 (min_frames)
    ("a", {"fps": 5.0}, {}),  # 11 frames: odd, the last temporal patch padded
    ("b", {"fps": 4.0, "min_frames": 2, "max_frames": 5}, {}),
    ("b", {"fps": None, "num_frames": 7}, {}),
    ("c", {"fps": 3.0, "min_frames": 3}, {"min_pixels": 32 * 32, "max_pixels": 32 * 32 * 4}),  # shrink
    ("c", {"fps": None, "num_frames": 5}, {"min_pixels": 32 * 32 * 40, "max_pixels": 32 * 32 * 60}),  # upscale
    ("d", {"fps": 2.0}, {"min_pixels": 32 * 32, "max_pixels": 32 * 32 * 30}),
    ("d", {"fps": None, "num_frames": 3}, {"min_pixels": 32 * 32 * 20, "max_pixels": 32 * 32 * 60}),
    ("a", {"fps": 10.0}, {"cap_pixels_per_frame": True, "min_pixels": 32 * 32 * 2, "max_pixels": 32 * 32 * 40}),
]


@pytest.mark.parametrize(("name", "sampling", "geometry"), CASES)
def test_file_parity(videos, name, sampling, geometry):
    ours_sampling = VideoSampling(**sampling)
    video = load_video(videos[name], sampling=ours_sampling)
    sample_kwargs = {"fps": sampling.get("fps"), "num_frames": sampling.get("num_frames")}
    size = {"shortest_edge": geometry.get("min_pixels", 128 * 32 * 32),
            "longest_edge": geometry.get("max_pixels", 32 * 32 * 768)}
    hf_kwargs = {"size": size, "cap_pixels_per_frame": geometry.get("cap_pixels_per_frame", False),
                 "min_frames": ours_sampling.min_frames, "max_frames": ours_sampling.max_frames}
    expected, metadata = hf_run(videos[name], sample_kwargs, **hf_kwargs)

    assert video.indices == list(metadata.frames_indices)
    assert video.total_frames == metadata.total_num_frames and video.source_fps == metadata.fps
    processor = VideoProcessor(**geometry, sampling=ours_sampling)
    out = processor([video])
    assert torch.equal(out.video_grid_thw, expected["video_grid_thw"])
    assert out.pixel_values_videos.dtype == torch.float32
    assert torch.equal(out.pixel_values_videos, expected["pixel_values_videos"])
    t, h, w = out.video_grid_thw[0].tolist()
    assert out.frames == [t] and out.tokens_per_frame == [h * w // 4]
    assert processor.tokens_for(len(video), *video.size) == t * h * w // 4
    hf = hf_processor(**hf_kwargs)
    assert hf.get_num_of_video_patches(len(video), *video.size) == t * h * w
    # timestamps and prompt text, as Qwen3VLProcessor writes them
    assert out.timestamps[0] == Qwen3VLProcessor._calculate_timestamps(None, metadata.frames_indices, metadata.fps, 2)
    text = processor.frame_text(out.timestamps[0], out.tokens_per_frame[0], TinyTokenizer.vision_start_token,
                                TinyTokenizer.video_token, TinyTokenizer.vision_end_token)
    assert text == hf_prompt(hf, expected["video_grid_thw"], metadata)


def test_batch_of_videos_parity(videos):
    """Several videos of different sizes in one call: concatenated in order, like transformers."""
    sampling = VideoSampling(fps=3.0)
    ours = VideoProcessor(min_pixels=32 * 32, max_pixels=32 * 32 * 24, sampling=sampling)
    loaded = [load_video(videos[n], sampling=sampling) for n in ("c", "a", "b")]
    out = ours(loaded)
    hf = hf_processor(size={"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 24})
    arrays = [v.frames.permute(0, 2, 3, 1).numpy() for v in loaded]
    expected = hf(videos=arrays, do_sample_frames=False, return_tensors="pt")
    assert torch.equal(out.video_grid_thw, expected["video_grid_thw"])
    assert torch.equal(out.pixel_values_videos, expected["pixel_values_videos"])
    assert len(out) == 3 and out.tokens_per_video == [t * h * w // 4 for t, h, w in out.video_grid_thw.tolist()]


def test_frame_list_parity(tmp_path, caplog):
    """PIL and path frame lists: all frames used; equals transformers with do_sample_frames=False."""
    arrays = frames_of(7, 91, 67, seed=3)  # odd sizes: frame lists need no yuv420p
    images = [Image.fromarray(a) for a in arrays]
    paths = []
    for i, image in enumerate(images):
        image.save(tmp_path / f"{i}.png")
        paths.append(tmp_path / f"{i}.png")
    from_pil = load_video(images, fps=4.0)
    from_paths = load_video(paths, fps=4.0)
    assert torch.equal(from_pil.frames, from_paths.frames) and from_pil.indices == list(range(7))
    processor = VideoProcessor(min_pixels=32 * 32, max_pixels=32 * 32 * 12)
    out = processor([from_pil])
    hf = hf_processor(size={"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 12})
    expected = hf(videos=[images], do_sample_frames=False, return_metadata=True, return_tensors="pt")
    assert torch.equal(out.video_grid_thw, expected["video_grid_thw"])
    assert torch.equal(out.pixel_values_videos, expected["pixel_values_videos"])
    # no fps: transformers' prompt falls back to 24 fps, and so do we (with a warning)
    metadata = expected["video_metadata"][0]
    assert metadata.frames_indices == list(range(7)) and metadata.fps is None
    video_sampling.warn_no_fps.cache_clear()
    with caplog.at_level(logging.WARNING, logger="mmadapt.data.video"):
        no_fps = processor([load_video(images)])
    assert "24" in caplog.text
    text = frame_text(no_fps.timestamps[0], no_fps.tokens_per_frame[0], "<s>", "<p>", "</s>")
    hf_text = hf_prompt(hf, expected["video_grid_thw"], metadata)
    assert text == hf_text.replace(TinyTokenizer.vision_start_token, "<s>").replace(
        TinyTokenizer.video_token, "<p>").replace(TinyTokenizer.vision_end_token, "</s>")


# ---- sampling ------------------------------------------------------------------------------------
@pytest.mark.parametrize("total", [1, 3, 8, 23, 100, 1001])
@pytest.mark.parametrize("source_fps", [None, 7.5, 10.0, 29.97, 60.0])
@pytest.mark.parametrize("kwargs", [{}, {"fps": 1.0, "min_frames": 2, "max_frames": 9}, {"fps": None},
                                    {"fps": None, "num_frames": 6}, {"fps": 0.3}])
def test_sample_indices_equal_transformers(total, source_fps, kwargs):
    sampling = VideoSampling(**kwargs)
    hf = hf_processor(min_frames=sampling.min_frames, max_frames=sampling.max_frames)
    hf.fps = sampling.fps  # the processor's default fps (None with num_frames)
    metadata = VideoMetadata(total_num_frames=total, fps=source_fps)
    expected = hf.sample_frames(metadata, num_frames=sampling.num_frames)
    np.testing.assert_array_equal(sampling.sample_indices(total, source_fps), expected)


def test_sampling_validation():
    with pytest.raises(ValueError, match="mutually exclusive"):
        VideoSampling(num_frames=8)
    assert VideoSampling.uniform(8) == VideoSampling(fps=None, num_frames=8)
    for bad in ({"fps": 0}, {"fps": float("nan")}, {"fps": None, "num_frames": 0}, {"min_frames": 5, "max_frames": 4},
                {"min_frames": 0}):
        with pytest.raises(ValueError, match="VideoSampling"):
            VideoSampling(**bad)
    with pytest.raises(ValueError, match="VideoLimits"):
        VideoLimits(max_frames_decoded=0)


def test_timestamps_and_text():
    assert calculate_timestamps([0, 5, 10], 10.0, 2) == Qwen3VLProcessor._calculate_timestamps(None, [0, 5, 10], 10.0)
    assert frame_text([0.25, 1.0], 2, "[", "x", "]") == "<0.2 seconds>[xx]<1.0 seconds>[xx]"


def test_short_videos_and_repeats(tmp_path):
    """One frame (transformers' smart_resize raises; we count it as T frames) and repeated indices."""
    one = load_video(write_video(tmp_path / "one.mp4", 1, 64, 64))
    assert one.indices == [0] and len(one.frames) == 1
    out = VideoProcessor()([one])
    assert out.video_grid_thw.tolist() == [[1, *out.video_grid_thw[0, 1:].tolist()]]
    first, second = out.pixel_values_videos.view(-1, 3, 2, 256)[:, :, 0], out.pixel_values_videos.view(
        -1, 3, 2, 256)[:, :, 1]
    assert torch.equal(first, second)  # the padded temporal slot repeats the frame
    repeated = load_video(tmp_path / "one.mp4", sampling=VideoSampling.uniform(3))
    assert repeated.indices == [0, 0, 0] and len(repeated.frames) == 3


# ---- problems ------------------------------------------------------------------------------------
def test_missing_and_not_a_video(tmp_path):
    with pytest.raises(DataProblem, match="no such file") as missing:
        load_video(tmp_path / "nope.mp4", sample_id="s1")
    assert missing.value.reason == "missing_video" and missing.value.sample_id == "s1"
    text = tmp_path / "text.mp4"
    text.write_text("this is not a video\n" * 20)
    with pytest.raises(DataProblem, match="Fix") as bad:
        load_video(text)
    assert bad.value.reason == "unreadable_video" and bad.value.path == str(text)
    with pytest.raises(DataProblem) as directory:
        load_video(tmp_path)
    assert directory.value.reason == "unreadable_video"


def test_no_video_stream(tmp_path):
    path = tmp_path / "audio.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    with pytest.raises(DataProblem, match="no video stream") as info:
        load_video(path)
    assert info.value.reason == "unreadable_video"


@pytest.mark.parametrize("faststart", [False, True])
def test_truncated(tmp_path, faststart):
    path = write_video(tmp_path / "full.mp4", 30, 96, 128, faststart=faststart)
    data = path.read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataProblem) as info:
        load_video(cut)
    assert info.value.reason == "unreadable_video"
    if faststart:  # header intact, frames missing: says how many could be decoded
        assert "only" in info.value.detail and "30" in info.value.detail


def test_empty(videos, monkeypatch):
    """PyAV writes no file without frames, so a zero-frame header is simulated; and an empty frame list."""
    monkeypatch.setattr(video_decode, "_header", lambda *args: (0, 10.0))
    with pytest.raises(DataProblem, match="no frames") as info:
        load_video(videos["a"])
    assert info.value.reason == "empty_video"
    with pytest.raises(DataProblem) as listed:
        load_video([])
    assert listed.value.reason == "empty_video"


def test_too_large_before_decoding(tmp_path, monkeypatch):
    path = write_video(tmp_path / "v.mp4", 12, 96, 128)

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded despite the limits")

    monkeypatch.setattr(video_decode, "_decode", no_decode)
    for limits, what in [(VideoLimits(max_frames_decoded=11), "12 frames"),
                         (VideoLimits(max_pixels_per_frame=128 * 96 - 1), "128 x 96"),
                         (VideoLimits(max_seconds=1.0), "seconds")]:
        start = time.perf_counter()
        with pytest.raises(DataProblem, match=what) as info:
            load_video(path, limits=limits)
        assert info.value.reason == "video_too_large" and time.perf_counter() - start < 1.0
    with pytest.raises(DataProblem) as listed:
        load_video([Image.new("RGB", (64, 64))] * 3, limits=VideoLimits(max_frames_decoded=2))
    assert listed.value.reason == "video_too_large"


def test_variable_frame_size():
    frames = [Image.new("RGB", (64, 48)), Image.new("RGB", (64, 48)), Image.new("RGB", (48, 64))]
    with pytest.raises(DataProblem, match="frame 2 is 48 x 64") as info:
        load_video(frames, sample_id="x")
    assert info.value.reason == "variable_frame_size" and info.value.sample_id == "x"


def test_problems_are_picklable_and_video_api(videos):
    import pickle

    problem = DataProblem("empty_video", "nothing", path="x.mp4")
    assert pickle.loads(pickle.dumps(problem)).reason == "empty_video"
    video = load_video(videos["a"])
    assert isinstance(video, Video) and video.frames.dtype == torch.uint8 and video.frames.shape[1] == 3
    assert video.size == (96, 128) and video.path == str(videos["a"])
    with pytest.raises(TypeError):
        VideoProcessor()(video)
    from mmadapt.data.processors import QwenProcessor

    derived = VideoProcessor.from_image_processor(QwenProcessor(patch_size=14, merge_size=2), min_pixels=28 * 28,
                                                  max_pixels=28 * 28 * 64)
    assert (derived.patch_size, derived.projector_merge, derived.max_pixels) == (14, 2, 28 * 28 * 64)
    # 4 x 280 x 280 over budget: beta = 2.5 -> 112 x 112 -> grid (2, 8, 8) -> 2 patches of 16 tokens
    assert derived.grid(4, 280, 280) == (2, 8, 8) and derived.tokens_for(4, 280, 280) == 32


def test_header_without_frame_count(tmp_path):
    """Matroska has no frame count in the header: the packets are counted (transformers would sample 0 frames)."""
    path = write_video(tmp_path / "v.mkv", 12, 64, 96)
    with av.open(str(path)) as container:
        header_frames = container.streams.video[0].frames
    video = load_video(path, sampling=VideoSampling(fps=None))
    assert video.total_frames == 12 and len(video) == 12 and header_frames in (0, 12)
    reference = load_video(write_video(tmp_path / "v.mp4", 12, 64, 96), sampling=VideoSampling(fps=None))
    assert torch.equal(video.frames, reference.frames)
