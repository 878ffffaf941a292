"""Video in the data pipeline: records with videos -> the token stream Qwen's processor writes -> a checked batch.

Records as LLaMA-Factory / ms-swift / Qwen write them (`videos` + `<video>`, `{"type": "video"}` parts, inline
videos, frame lists); the rendered ids are Qwen's reference stream, which transformers' `Qwen3VLProcessor` writes on
the same file and text (real Qwen3 tokenizer) from 5.25 on and, on 5.10 - 5.24, once the template's own outer
brackets it keeps are removed (Qwen's reference replaces the template's whole
`<|vision_start|><|video_pad|><|vision_end|>`; helpers.TRANSFORMERS_KEEPS_VIDEO_WRAPPER), with the same
`pixel_values_videos` and `video_grid_thw`; a mixed
image + video + text-only batch passes the contract; truncation never cuts a video span; bad videos are counted
per sample by `check_dataset` (`mmadapt data check`); a model that takes no video refuses, fatally.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import TRANSFORMERS_KEEPS_VIDEO_WRAPPER
from PIL import Image
from real_tokenizers import real_tokenizer

import mmadapt
from mmadapt.contract import check_batch
from mmadapt.data import Collator, DataProblem, SampleEncoder, Turn, char_tokenizer, check_dataset, parse_record
from mmadapt.synthetic import moving_square, write_video

VIDEO_SETTINGS = {"fps": 4, "min_pixels": 16 * 16, "max_pixels": 8 * 64 * 64}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    write_video(root / "left.mp4", moving_square(12, 32, 48, direction=(0, -1), start=(8, 40)), fps=8)
    write_video(root / "down.mp4", moving_square(7, 48, 32, direction=(1, 0)), fps=5)
    frames = moving_square(4, 32, 32)
    for k, frame in enumerate(frames.numpy()):
        Image.fromarray(frame).save(root / f"frame{k}.png")
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(root / "grey.png")
    Image.fromarray(np.zeros((48, 32, 3), np.uint8)).save(root / "tall.png")
    (root / "notes.mp4").write_text("not a video")
    data = (root / "left.mp4").read_bytes()
    (root / "cut.mp4").write_bytes(data[: len(data) // 2])
    return root


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    return mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5").eval()


def encoder_for(model, media, tokenizer=None, **config):
    return SampleEncoder.for_model(model, tokenizer or char_tokenizer(), image_root=str(media),
                                   video=config.pop("video", VIDEO_SETTINGS), **config)


RECORDS = [
    {"id": "llava", "video": "left.mp4",
     "conversations": [{"from": "human", "value": "<video>\nWhich way?"}, {"from": "gpt", "value": "left"}]},
    {"id": "messages", "videos": ["down.mp4"], "images": ["grey.png"],
     "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Go?"}]},
                  {"role": "assistant", "content": "down"}]},
    {"id": "inline-frames", "messages": [
        {"role": "user", "content": [{"type": "video", "video": [f"frame{k}.png" for k in range(4)]},
                                     {"type": "text", "text": "Which way?"}]},
        {"role": "assistant", "content": "right"}]},
    {"id": "text", "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "hi"}]},
]


def test_records_carry_videos_as_llama_factory_ms_swift_and_qwen_write_them(media):
    samples = [parse_record(r, i, image_root=media) for i, r in enumerate(RECORDS)]
    assert [len(s.videos) for s in samples] == [1, 1, 1, 0]
    assert samples[0].videos[0].endswith("left.mp4") and samples[1].images[0].endswith("grey.png")
    assert isinstance(samples[2].videos[0], tuple) and len(samples[2].videos[0]) == 4
    assert [s.num_video_placeholders for s in samples] == [1, 1, 1, 0]
    with pytest.raises(DataProblem, match="both in 'videos' and inside"):
        parse_record({**RECORDS[2], "videos": ["left.mp4"]}, 0, image_root=media)
    with pytest.raises(DataProblem, match="path_outside_root"):
        parse_record({**RECORDS[0], "video": "/etc/passwd"}, 0, image_root=media)


def test_the_rendered_ids_and_pixels_equal_qwens_processor_on_the_same_file(media, qwen):
    """Real Qwen3 tokenizer and chat template; transformers' Qwen3VLProcessor on the same file (its pyav decoding,
    the same sampling): our ids == theirs, Qwen's reference stream (one <|vision_start|> ... <|vision_end|> per
    temporal patch), which transformers 5.25 writes as it is and 5.10 - 5.24 inside one more bracket pair."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import read_video_pyav

    from mmadapt.data import TEMPLATES

    tokenizer = real_tokenizer("qwen3")
    tokenizer.chat_template = TEMPLATES.get("qwen3_vl").jinja(tokenizer)  # Qwen3-VL's own chat template
    encoder = encoder_for(qwen, media, tokenizer)
    record = {"id": "v", "videos": ["left.mp4"],
              "messages": [{"role": "user", "content": "<video>\nWhich way does it move?"},
                           {"role": "assistant", "content": "left"}]}
    ours = encoder.encode_prompt(record, 0)
    vp = encoder.video_processor
    theirs_video = Qwen3VLVideoProcessor(patch_size=vp.patch_size, temporal_patch_size=2, merge_size=2,
                                         size={"shortest_edge": vp.min_pixels, "longest_edge": vp.max_pixels},
                                         cap_pixels_per_frame=False)
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=vp.patch_size, merge_size=2),
                                 tokenizer=tokenizer, video_processor=theirs_video, chat_template="")
    array, metadata = read_video_pyav(str(media / "left.mp4"), sample_indices_fn=lambda metadata:
                                      theirs_video.sample_frames(metadata, fps=VIDEO_SETTINGS["fps"]))
    question = [{"type": "video"}, {"type": "text", "text": "\nWhich way does it move?"}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
    assert "<|vision_start|><|video_pad|><|vision_end|>\nWhich way" in prompt
    expected = processor(text=[prompt], videos=[array], video_metadata=[metadata], do_sample_frames=False,
                         return_tensors="pt")
    ids = expected["input_ids"][0].tolist()
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    patches = int(expected["video_grid_thw"][0, 0])
    wrapper = int(TRANSFORMERS_KEEPS_VIDEO_WRAPPER)  # this transformers' outer pair: 1 on 5.10 - 5.24, 0 from 5.25
    assert ids.count(start) == ids.count(end) == patches + wrapper
    reference = ids
    if wrapper:  # the template's pair, kept around the frames: Qwen's reference stream is what lies inside it
        first, last = ids.index(start), len(ids) - 1 - ids[::-1].index(end)
        assert ids[first + 1] != start and ids[last - 1] == end  # its first block starts with a timestamp
        reference = ids[:first] + ids[first + 1 : last] + ids[last + 1 :]
    assert ours.input_ids.tolist() == reference
    assert torch.equal(ours.pixel_values_videos, expected["pixel_values_videos"])
    assert torch.equal(ours.video_grid_thw, expected["video_grid_thw"])
    text = tokenizer.decode(ours.input_ids)
    # 12 frames at 8 fps sampled at 4 fps: frames 0, 2, 4, 7, 9, 11 -> patches at (0 + 0.25) / 2, (0.5 + 0.875) / 2,
    # (1.125 + 1.375) / 2 seconds
    assert all(f"<{t} seconds><|vision_start|><|video_pad|>" in text for t in ("0.1", "0.7", "1.2"))
    assert text.count("<|vision_start|>") == int(ours.video_grid_thw[0, 0])


def test_a_mixed_image_video_text_batch_passes_the_contract_and_trains(media, qwen):
    encoder = encoder_for(qwen, media)
    samples = [encoder.encode(r, i) for i, r in enumerate(RECORDS)]
    assert [s.num_videos for s in samples] == [1, 1, 1, 0] and samples[1].num_images == 1
    batch = Collator.for_model(qwen, encoder.pad_token_id)(samples)
    assert batch["videos_per_sample"].tolist() == [1, 1, 1, 0]
    report = check_batch(qwen, batch)
    assert report.ok, report
    model = qwen.train()
    try:
        model(**batch).loss.backward()
    finally:
        model.eval().zero_grad(set_to_none=True)
    packed = Collator.for_model(qwen, encoder.pad_token_id, max_tokens=max(map(len, samples)) * 2)(samples)
    assert check_batch(qwen, packed).ok


def test_timestamps_follow_the_sampled_frames_and_the_fps(media, qwen):
    encoder = encoder_for(qwen, media, video={**VIDEO_SETTINGS, "fps": 2})
    sample = encoder.encode(RECORDS[0], 0)
    text = char_tokenizer().decode([t for t in sample.input_ids.tolist() if t < 100])
    # 12 frames at 8 fps, 2 fps wanted -> int(12 / 8 * 2) = 3, clamped up to min_frames 4: frames 0, 4, 7, 11
    # -> temporal patches (0, 4) and (7, 11): (0 + 0.5) / 2 = 0.25 -> "0.2", (0.875 + 1.375) / 2 = 1.125 -> "1.1"
    assert "<0.2 seconds>" in text and "<1.1 seconds>" in text and text.count("seconds>") == 2
    frames = encoder_for(qwen, media, video={**VIDEO_SETTINGS, "frames_fps": 1}).encode(RECORDS[2], 2)
    text = char_tokenizer().decode([t for t in frames.input_ids.tolist() if t < 100])
    assert "<0.5 seconds>" in text and "<2.5 seconds>" in text  # frames 0..3 at 1 fps


def test_truncation_never_cuts_a_video_span(media, qwen):
    full = encoder_for(qwen, media).encode(RECORDS[0], 0)
    spans = (full.input_ids == qwen.tokens.video_token_id).nonzero().flatten()
    limit = int(spans[-1])  # inside the last frame's span
    with pytest.raises(DataProblem, match="an image or video span ends at token"):
        encoder_for(qwen, media, max_length=limit, truncation="text").encode(RECORDS[0], 0)
    with pytest.raises(DataProblem, match="too_long"):
        encoder_for(qwen, media, max_length=limit).encode(RECORDS[0], 0)
    encoder = encoder_for(qwen, media)
    estimate = encoder.estimated_length(RECORDS[0], 0)
    assert abs(estimate - len(full)) <= 0.15 * len(full), (estimate, len(full))


def test_bad_videos_are_counted_per_sample_by_the_dataset_check(media, qwen):
    def record(sample_id, videos, text="<video>\nWhich way?"):
        return {"id": sample_id, "videos": videos,
                "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "left"}]}

    records = [
        record("ok", ["left.mp4"]),
        record("missing", ["nowhere.mp4"]),
        record("not-a-video", ["notes.mp4"]),
        record("truncated", ["cut.mp4"]),
        record("no-placeholder", ["left.mp4"], text="Which way?"),
        record("placeholder-without-video", [], text="<video>\nWhich way?"),
        record("two-placeholders", ["left.mp4"], text="<video><video>\nWhich way?"),
        record("mixed-frame-sizes", [["frame0.png", "tall.png"]]),
        record("too-many-frames", ["left.mp4"]),
    ]
    encoder = encoder_for(qwen, media)
    report = check_dataset(records[:-1], encoder)
    found = {p["id"]: p["reason"] for p in report.problems}
    assert found == {"missing": "missing_video", "not-a-video": "unreadable_video", "truncated": "unreadable_video",
                     "no-placeholder": "video_without_placeholder",
                     "placeholder-without-video": "placeholder_mismatch",
                     "two-placeholders": "placeholder_mismatch", "mixed-frame-sizes": "variable_frame_size"}
    assert report.ok == 1 and len(report.video_tokens) == 1 and "visual tokens per video" in report.format()
    capped = encoder_for(qwen, media, video={**VIDEO_SETTINGS, "max_frames_decoded": 10})
    problem = check_dataset(records[-1:], capped).problems[0]
    assert problem["reason"] == "video_too_large" and "12 frames" in problem["detail"]
    assert problem["id"] == "too-many-frames" and problem["path"].endswith("left.mp4")


def test_models_that_take_no_video_refuse_it_fatally_with_the_fix(media):
    clip = mmadapt.build_model("clip", "mlp2x_gelu", "llama")
    encoder = encoder_for(clip, media)
    with pytest.raises(DataProblem, match=r"video_unsupported: encoder 'clip' .* give the frames as images") as e:
        encoder.encode(RECORDS[0], 0)
    assert e.value.fatal
    assert encoder.encode(RECORDS[3], 3).num_videos == 0  # text-only samples are fine


def test_video_settings_are_checked_when_the_config_is_read():
    from mmadapt.data import DataConfig

    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['fsp'\]"):
        DataConfig(video={"fsp": 2})
    with pytest.raises(ValueError, match="mutually exclusive"):
        DataConfig(video={"fps": 2, "num_frames": 8})
    assert DataConfig(video={"num_frames": 8}).video.sampling.fps is None
    assert json.dumps(DataConfig().video.sampling.fps) == "2.0"


def test_video_config_holds_a_sampling_and_limits_and_reads_its_flat_and_nested_forms_back():
    from dataclasses import asdict

    from mmadapt.data import VideoConfig, VideoLimits, VideoSampling

    flat = {"fps": 1, "max_frames": 64, "max_pixels": 100_000, "max_seconds": 5.0, "frames_fps": 4.0}
    config = VideoConfig.parse(flat)
    assert config.sampling == VideoSampling(fps=1, max_frames=64) and config.limits == VideoLimits(max_seconds=5.0)
    assert (config.max_pixels, config.frames_fps, config.min_pixels) == (100_000, 4.0, None)
    assert VideoConfig.parse(config) is config and VideoConfig.parse(None) == VideoConfig()
    assert VideoConfig.parse(config.to_dict()) == config == VideoConfig.parse(asdict(config))  # a saved run reads back
    assert {key: config.to_dict()[key] for key in flat} == flat and set(config.to_dict()) == set(VideoConfig.settings())
    with pytest.raises(ValueError, match="'fps' is given twice"):
        VideoConfig.parse({"fps": 1, "sampling": {"fps": 2}})
    with pytest.raises(TypeError, match="sampling must be a VideoSampling"):
        VideoConfig(sampling={"fps": 1})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mmadapt import Processor

    torch.manual_seed(0)
    model, tokenizer = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5").eval(), char_tokenizer()
    Processor.for_model(model, tokenizer)  # adds the span tokens, as training does
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path, tokenizer=tokenizer)
    return path


def greedy(model_dir, conversation, images=(), videos=(), max_new_tokens=6):
    from mmadapt import Processor, VisionLanguageModel

    model = VisionLanguageModel.from_pretrained(model_dir).eval()
    processor = Processor.from_pretrained(model_dir)
    inputs = processor(conversation, images=list(images), videos=list(videos))
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=processor.eos_token_ids,
                         pad_token_id=processor.encoder.pad_token_id)
    return processor.decode(out[0])


def test_the_processor_takes_videos_as_the_dataset_path_does(model_dir, media):
    from mmadapt import Processor, VisionLanguageModel

    processor = Processor.from_pretrained(model_dir)
    inputs = processor("<video>\nWhich way?", videos=[media / "left.mp4"])
    encoder = processor.encoder
    expected = encoder.prompt_for("p", [Turn("user", "<video>\nWhich way?")], [], [str(media / "left.mp4")])
    assert inputs["input_ids"][0].tolist() == expected.input_ids.tolist()
    assert torch.equal(inputs["pixel_values_videos"], expected.pixel_values_videos)
    assert inputs["videos_per_sample"].tolist() == [1] and inputs["mm_token_type_ids"].max() == 2
    frames = [Image.open(media / f"frame{k}.png") for k in range(4)]  # a frame list of PIL images, inline
    inline = [{"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "?"}]}]
    batch = processor([inline, "<video><image>\nBoth?"], images=[[], [media / "grey.png"]],
                      videos=[[], [media / "down.mp4"]])
    assert batch["videos_per_sample"].tolist() == [1, 1] and batch["images_per_sample"].tolist() == [0, 1]
    model = VisionLanguageModel.from_pretrained(model_dir).eval()
    assert check_batch(model, batch).ok
    with pytest.raises(ValueError, match=r"1 <video> placeholder\(s\) for 0 video\(s\)"):
        processor("<video>\nWhich way?")


def test_chat_takes_a_video_from_the_command_line_and_from_stdin(model_dir, media, capsys, monkeypatch):
    import io

    from mmadapt.cli import main

    assert main(["chat", str(model_dir), "--video", str(media / "left.mp4"), "--max-new-tokens", "6", "Which",
                 "way?"]) == 0
    # the video directly followed by the question, as an OpenAI request's parts [video, text] render it
    expected = greedy(model_dir, "<video>Which way?", videos=[media / "left.mp4"])
    assert capsys.readouterr().out.replace("\n", "") == expected.replace("\n", "")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/video {media / 'down.mp4'}\nWhich way?\n"))
    assert main(["chat", str(model_dir), "--max-new-tokens", "6"]) == 0
    expected = greedy(model_dir, "<video>Which way?", videos=[media / "down.mp4"])
    assert capsys.readouterr().out.replace("\n", "") == expected.replace("\n", "")


def test_data_check_reports_bad_videos_by_id_from_the_command_line(media, tmp_path, capsys):
    from mmadapt.cli import main

    path = tmp_path / "data.jsonl"
    records = [RECORDS[0], {**RECORDS[0], "id": "gone", "video": "gone.mp4"}, {**RECORDS[0], "id": "cut",
                                                                               "video": "cut.mp4"}]
    path.write_text("\n".join(json.dumps(r) for r in records))
    args = ["data", "check", str(path), "--image-root", str(media), "--encoder", "qwen3_5_vit", "--projector",
            "qwen_merger", "--backbone", "qwen3_5", "--video", "{fps: 4, min_pixels: 256, max_pixels: 32768}"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "missing_video" in out and "gone" in out and "unreadable_video" in out and "cut" in out
    assert "visual tokens per video" in out
    assert main([*args[:-1], "{fsp: 4}"]) == 2
    assert "unknown setting(s) ['fsp']" in capsys.readouterr().err


def test_plan_counts_the_largest_video_the_sampling_settings_let_through():
    from mmadapt.data.video import VideoConfig
    from mmadapt.train.config import RunConfig
    from mmadapt.train.plan import workload
    from mmadapt.weights import empty_weights

    with empty_weights():
        model = mmadapt.build_model({"name": "qwen3_5_vit", "preset": "qwen3.5-2b"}, "qwen_merger",
                                    {"name": "qwen3_5", "preset": "qwen3.5-2b"})
        llava = mmadapt.build_model("clip", "mlp2x_gelu", "llama")
    default = workload(RunConfig.from_dict({"data": {"max_length": 8192}}), model)
    assert default.video_frames == 0  # transformers' video budget (<= 384 tokens) is below the largest image
    settings = {"num_frames": 32, "max_pixels": 16 * 1024 * 1024}
    work = workload(RunConfig.from_dict({"data": {"max_length": 8192, "video": settings}}), model)
    videos = VideoConfig.parse(settings).processor(mmadapt.data.processor_for(model))
    assert work.video_frames == 32 and work.visual_per_image == videos.tokens_for(32, 4096, 4096)
    assert work.visual_per_image > default.visual_per_image and "video(s) of 32 frames" in work.describe()
    assert workload(RunConfig.from_dict({"data": {"video": settings}}), llava).video_frames == 0


def test_eval_and_sees_on_video_data_report_frames_reversed(model_dir, media, tmp_path, capsys):
    from mmadapt.cli import main

    records = [{"id": f"v{k}", "videos": [name], "messages": [{"role": "user", "content": "<video>\nWhich way?"},
                                                              {"role": "assistant", "content": answer}]}
               for k, (name, answer) in enumerate((("left.mp4", "left"), ("down.mp4", "down")) * 2)]
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    video = ["--image-root", str(media), "--video", "{fps: 4, min_pixels: 256, max_pixels: 32768}"]
    assert main(["eval", str(model_dir), str(path), *video, "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "reversed " in out and "frames reversed" in out  # the row and the verdict name it
    assert main(["sees", str(model_dir), str(path), *video, "--batches", "1", "--batch-size", "4"]) in (0, 1)
    out = capsys.readouterr().out
    assert "reversed" in out.splitlines()[0] and "its videos on 1 batch(es)" in out
