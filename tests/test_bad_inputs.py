"""The bad-input corpus (issue 30): what a careless user or an attacker can hand the data pipeline.

Every case ends as a counted `DataProblem` (its reason, and the sample id or `file:line` in its message) or as a
one-line error, never a traceback or a dead DataLoader; the limits are checked from headers before anything is
decoded, and the memory cases stay under a stated bound. Each case's file is made here, small.

Memory is measured as the growth of `ru_maxrss` (the peak resident set: it sees Pillow's, PyAV's and torch's native
allocations, which tracemalloc does not) in a fresh Python process, over a baseline taken after the models are built
and one good sample of each kind was encoded; the cases run one after the other, so each bound holds for the peak of
all the cases so far.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers import noise_image, write_jsonl
from PIL import Image

from mmadapt import build_model
from mmadapt.cli import main
from mmadapt.data import (
    Collator,
    DataConfig,
    DataProblem,
    SampleEncoder,
    VideoLimits,
    VLMDataset,
    char_tokenizer,
    load_image,
    load_video,
    prepare_tokenizer,
    processor_for,
    read_records,
)
from mmadapt.data.config import settings
from mmadapt.data.templates import IGNORE, supervised_labels

QWEN = ("qwen3_5_vit", "qwen_merger", "qwen3_5")
QWEN_FLAGS = ["--encoder", "qwen3_5_vit", "--projector", "qwen_merger", "--backbone", "qwen3_5"]
MiB = 1 << 20


def messages(sample_id, *turns, images=None, videos=None):
    """A messages record from (role, content) pairs."""
    record = {"id": sample_id, "messages": [{"role": r, "content": c} for r, c in turns]}
    if images is not None:
        record["images"] = images
    if videos is not None:
        record["videos"] = videos
    return record


def good(sample_id="good"):
    return messages(sample_id, ("user", "<image>What is it?"), ("assistant", "Noise."), images=["noise.png"])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    noise_image(root / "noise.png")
    Image.new("RGB", (3000, 3000), (30, 60, 90)).save(root / "big.png")  # 27 MB decoded, a few KB on disk
    Image.new("RGB", (1024, 1024), (200, 0, 0)).save(root / "frame.png")
    return root


@pytest.fixture(scope="module")
def qwen(root):
    """The tiny Qwen3.5 model with Qwen3.5's official chat template, images under `root`."""
    torch.manual_seed(0)
    model = build_model(*QWEN)
    tokenizer = prepare_tokenizer(model, char_tokenizer())
    return model, SampleEncoder.for_model(model, tokenizer, chat_template="qwen3_5", image_root=str(root))


# ---- every per-sample failure is a DataProblem ---------------------------------------------------------------
TEMPLATE_REFUSALS = {
    "only_assistant": (messages("only_assistant", ("assistant", "Hello.")), "No user query found in messages"),
    "image_in_system": (messages("image_in_system", ("system", [{"type": "image"}, {"type": "text", "text": "Sys."}]),
                                 ("user", "Hi?"), ("assistant", "Hi."), images=["noise.png"]),
                        "System message cannot contain images"),
}


@pytest.mark.parametrize("case", sorted(TEMPLATE_REFUSALS))
def test_a_template_refusal_is_a_counted_problem_naming_the_sample_and_the_template_message(qwen, case):
    record, said = TEMPLATE_REFUSALS[case]
    dataset = VLMDataset([good(), record], qwen[1])
    problem = dataset[1]
    assert isinstance(problem, DataProblem) and problem.reason == "template_error" and not problem.fatal
    assert problem.sample_id == case and said in str(problem) and "qwen3_5" in str(problem)
    assert not isinstance(dataset[0], DataProblem)  # the good sample beside it is unaffected


def test_eval_prompts_of_the_bad_records_are_problems_too(qwen, monkeypatch):
    """`mmadapt eval` / `sees` encode prompts (`encode_prompt`) and skip `DataProblem`s: every failure must be one."""
    encoder = qwen[1]
    for record, _ in TEMPLATE_REFUSALS.values():
        with pytest.raises(DataProblem) as error:
            encoder.encode_prompt(record, 0)
        assert error.value.reason == "template_error" and error.value.sample_id == record["id"]

    def broken(images):
        raise RuntimeError("boom")

    monkeypatch.setattr(encoder.processor, "process", broken)
    with pytest.raises(DataProblem) as error:
        encoder.encode_prompt(good(), 0)
    assert error.value.reason == "unexpected_error" and "RuntimeError: boom" in error.value.detail


def test_eval_over_a_file_with_bad_lines_and_refused_records_counts_them_and_goes_on(qwen, root, tmp_path, capsys):
    """`mmadapt eval` reads its data file as training does: a line that does not parse and a record the template
    refuses are skipped samples, counted in the report, and the good records are evaluated."""
    model, encoder = qwen
    model.save_pretrained(tmp_path / "model", tokenizer=encoder.tokenizer)
    data = tmp_path / "eval.jsonl"
    lines = [json.dumps(good("a")), "[" * 100_000 + "]" * 100_000,
             json.dumps(TEMPLATE_REFUSALS["only_assistant"][0]), json.dumps(good("b"))]
    data.write_text("\n".join(lines) + "\n")
    report = tmp_path / "report.json"
    code = main(["eval", str(tmp_path / "model"), str(data), "--image-root", str(root), "--chat-template", "qwen3_5",
                 "--max-new-tokens", "2", "--json", str(report)])
    assert code in (0, 1), capsys.readouterr().err  # a verdict, not an error
    result = json.loads(report.read_text())
    assert result["samples"] == 2 and result["skipped"] == 2, result
    skipped = {problem["id"]: problem["reason"] for problem in result["skipped_samples"]}
    assert skipped == {"line 2": "bad_format", "only_assistant": "template_error"}, skipped


BAD_LINES = {
    "nested_100000_deep": (("[" * 100_000 + "]" * 100_000).encode(), "RecursionError"),
    "int_of_5000_digits": (('{"id": ' + "9" * 5000 + "}").encode(), "4300"),
    "utf16_bom": ('{"id": "x"}'.encode("utf-16"), "UTF-16"),
    "invalid_utf8": (b'{"id": "\xff\xfe caf\xe9"}', "not UTF-8"),
    "broken_json": (b'{"id": "x", "messages": [}', "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_bad_jsonl_line_is_a_problem_with_file_and_line_and_the_others_are_read(tmp_path, qwen, case):
    line, said = BAD_LINES[case]
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(good("first")).encode() + b"\n" + line + b"\n" + json.dumps(good("last")).encode()
                     + b"\n")
    records = read_records(path, errors="report")
    assert len(records) == 3 and records[0]["id"] == "first" and records[2]["id"] == "last"
    problem = records[1]
    assert isinstance(problem, DataProblem) and problem.reason == "bad_format" and problem.sample_id == "line 2"
    assert f"{path}:2:" in str(problem) and said in str(problem)
    with pytest.raises(ValueError, match=f"{path}:2: ") as error:  # errors="raise": one line naming file:line
        read_records(path)
    assert "\n" not in str(error.value)
    dataset = VLMDataset(path, qwen[1])  # the dataset reads the file with errors="report"
    assert [isinstance(dataset[k], DataProblem) for k in range(3)] == [False, True, False]


def test_a_json_file_that_does_not_parse_is_one_line_with_its_line_and_column(tmp_path, capsys):
    path = tmp_path / "data.json"
    path.write_text('[\n{"id": "a"},\n{"id": "b",,}\n]')
    with pytest.raises(ValueError, match=r"data\.json:3:12: not valid JSON"):
        read_records(path)
    assert main(["data", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "data.json:3:12" in err and "\n" not in err


def test_any_exception_while_encoding_is_a_problem_keeping_its_type_but_interrupts_pass(qwen, monkeypatch):
    encoder = qwen[1]
    dataset = VLMDataset([good()], encoder)

    def broken(images):
        raise RuntimeError("boom in the processor")

    monkeypatch.setattr(encoder.processor, "process", broken)
    problem = dataset[0]
    assert isinstance(problem, DataProblem) and problem.reason == "unexpected_error" and problem.sample_id == "good"
    assert "RuntimeError: boom in the processor" in problem.detail

    def interrupted(images):
        raise KeyboardInterrupt

    monkeypatch.setattr(encoder.processor, "process", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dataset[0]


def test_an_allocation_failure_while_decoding_is_an_out_of_memory_problem(qwen, root, monkeypatch):
    def no_memory(image):
        raise MemoryError

    monkeypatch.setattr("mmadapt.data.images.to_rgb", no_memory)
    with pytest.raises(DataProblem) as error:
        load_image(root / "noise.png")
    assert error.value.reason == "out_of_memory" and str(root / "noise.png") in str(error.value)
    problem = VLMDataset([good()], qwen[1])[0]
    assert problem.reason == "out_of_memory" and problem.sample_id == "good"


def test_a_frame_list_of_100000_frames_is_refused_from_headers_and_a_failed_allocation_is_a_problem(tmp_path):
    frames = [str(tmp_path / "frame.png")] * 100_000
    Image.new("RGB", (4096, 4096), (0, 0, 200)).save(frames[0])
    with pytest.raises(DataProblem) as error:  # the defaults: 100,000 x 4096 x 4096 x 3 bytes > max_bytes_decoded
        load_video(frames)
    assert error.value.reason == "video_too_large" and "max_bytes_decoded" in str(error.value)
    with pytest.raises(DataProblem) as error:  # no byte cap: torch's failed allocation (5 PB) is still a problem
        load_video(frames, limits=VideoLimits(max_bytes_decoded=None), sample_id="frames")
    assert error.value.reason == "out_of_memory" and error.value.sample_id == "frames"


# ---- Pillow opens only the allowed formats ------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "plugin"), [("PPM", "PpmImagePlugin.PpmImageFile"),
                                              ("TGA", "TgaImagePlugin.TgaImageFile"),
                                              ("ICO", "IcoImagePlugin.IcoImageFile"),
                                              ("PCX", "PcxImagePlugin.PcxImageFile")])
def test_an_image_in_another_format_is_refused_naming_the_allowed_ones_and_its_parser_never_runs(tmp_path, qwen,
                                                                                                 monkeypatch, kind,
                                                                                                 plugin):
    path = tmp_path / f"picture.{kind.lower()}"
    Image.new("RGB", (16, 16), (1, 2, 3)).save(path, format=kind)

    def parser_ran(self):
        raise AssertionError(f"Pillow's {kind} parser ran")

    monkeypatch.setattr(f"PIL.{plugin}._open", parser_ran)
    with pytest.raises(DataProblem) as error:
        load_image(path)
    assert error.value.reason == "unreadable_image" and "PNG, JPEG, WEBP, GIF, BMP, TIFF" in error.value.detail
    record = messages("odd", ("user", "<image>?"), ("assistant", "."), images=[str(path)])
    problem = VLMDataset([record], SampleEncoder.for_model(qwen[0], qwen[1].tokenizer, allow_outside_root=True))[0]
    assert problem.reason == "unreadable_image" and problem.sample_id == "odd"


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_the_allowed_formats_load(tmp_path, kind):
    path = tmp_path / f"picture.{kind.lower()}"
    Image.new("RGB", (16, 8), (0, 128, 255)).save(path, format=kind)
    assert load_image(path).size == (16, 8)


# ---- budgets checked before work ---------------------------------------------------------------------------
def test_per_sample_counts_are_checked_before_any_file_is_opened(qwen):
    """The paths do not exist: a check that opened a file would say missing_image."""
    encoder = qwen[1]
    many = messages("many", ("user", "<image>" * 10_000 + "Which?"), ("assistant", "That."),
                    images=[f"missing{k}.png" for k in range(10_000)])
    frames = messages("frames", ("user", "<video>What happens?"), ("assistant", "Nothing."),
                      videos=[[f"missing{k}.png" for k in range(100_000)]])
    start = time.perf_counter()
    problems = [VLMDataset([many, frames], encoder)[k] for k in range(2)]
    assert time.perf_counter() - start < 1.0
    assert [(p.reason, p.sample_id) for p in problems] == [("sample_too_large", "many"), ("sample_too_large", "frames")]
    assert "max_images 64" in str(problems[0]) and "max_sample_frames 1024" in str(problems[1])


def test_per_sample_pixels_frames_and_video_bytes_are_checked_from_headers(qwen, root):
    model, encoder = qwen
    config = DataConfig.of(encoder.config, max_sample_pixels=2 * 32 * 32 - 1, max_sample_frames=8,
                           max_video_bytes=4 * 1024 * 1024 * 3 - 1)
    strict = SampleEncoder.for_model(model, encoder.tokenizer, config=config)
    two = messages("two", ("user", "<image><image>Same?"), ("assistant", "No."), images=["noise.png"] * 2)
    nine = messages("nine", ("user", "<video>Red?"), ("assistant", "Yes."), videos=[["frame.png"] * 9])
    four = messages("four", ("user", "<video>Red?"), ("assistant", "Yes."), videos=[["frame.png"] * 4])
    problems = [VLMDataset([two, nine, four], strict)[k] for k in range(3)]
    assert [p.reason for p in problems] == ["sample_too_large"] * 3
    for problem, setting in zip(problems, ("max_sample_pixels", "max_sample_frames", "max_video_bytes"), strict=True):
        assert setting in str(problem)
    defaults = VLMDataset([two, four], encoder)
    assert not any(isinstance(defaults[k], DataProblem) for k in range(2))  # under the defaults both encode


def test_a_too_long_sample_is_dropped_from_its_headers_before_any_image_is_decoded(qwen, monkeypatch):
    twelve = messages("twelve", ("user", "<image>" * 12 + "Twelve?"), ("assistant", "Yes."), images=["big.png"] * 12)

    def never(*args, **kwargs):
        raise AssertionError("an image was decoded")

    monkeypatch.setattr("mmadapt.data.pipeline.load_image", never)
    problem = VLMDataset([twelve], qwen[1])[0]
    assert problem.reason == "too_long" and problem.sample_id == "twelve"


def test_a_too_long_video_sample_is_dropped_from_its_headers_before_any_frame_is_decoded(qwen, root, monkeypatch):
    from mmadapt.synthetic import write_video

    model, encoder = qwen
    write_video(root / "clip.mp4", np.zeros((8, 32, 32, 3), np.uint8))
    record = messages("clip", ("user", "<video>What happens?"), ("assistant", "Nothing."), videos=["clip.mp4"])
    length = len(encoder.encode(record, 0))  # what it encodes to, decoded
    short = SampleEncoder.for_model(model, encoder.tokenizer, config=DataConfig.of(encoder.config,
                                                                                    max_length=length - 1))

    def never(*args, **kwargs):
        raise AssertionError("a video was decoded")

    monkeypatch.setattr("mmadapt.data.pipeline.load_video", never)
    problem = VLMDataset([record], short)[0]
    assert problem.reason == "too_long" and f"{length} tokens > max_length {length - 1}" in str(problem)


@pytest.mark.parametrize("size", [(64, 40), (40, 64), (97, 13), (13, 97), (1, 1), (300, 7), (7, 300)])
@pytest.mark.parametrize("resample", ["bicubic", "bilinear", "nearest"])
def test_pad_mode_without_the_full_canvas_equals_padding_then_resizing(size, resample):
    """`pad_resize` against the steps run one by one (main's way: the whole padded square, then the resize)."""
    torch.manual_seed(0)
    processor = processor_for(build_model("clip", "mlp2x_gelu", "llama"), resample=resample)
    assert processor.mode == "pad"
    pixels = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)).permute(2, 0, 1)
    steps = processor.plan(*size)
    expected = pixels
    for step in steps:
        expected = processor.apply(step, expected)
    assert torch.equal(processor.run(pixels), expected)


def test_labelling_is_linear_in_the_number_of_turns(qwen):
    """200,000 one-character tokens and 2,000 answers: main's labelling (each token against every answer) took
    about 60 s on this machine; a bisection takes well under a second. And a 400-turn conversation encodes in
    seconds with Qwen3.5's template."""
    spans = [(100 * k + 10, 100 * k + 60) for k in range(2000)]
    offsets = [(i, i + 1) for i in range(200_000)]
    start = time.perf_counter()
    labels = supervised_labels(list(range(200_000)), offsets, spans)
    assert time.perf_counter() - start < 3.0
    assert labels[:12] == [IGNORE] * 10 + [10, 11] and labels[59:61] == [59, IGNORE]
    turns = [t for k in range(200) for t in (("user", f"Question {k}?"), ("assistant", f"Answer {k}."))]
    encoder = SampleEncoder.for_model(qwen[0], qwen[1].tokenizer, chat_template="qwen3_5", max_length=100_000)
    start = time.perf_counter()
    sample = encoder.encode(messages("long", *turns), 0)
    assert time.perf_counter() - start < 5.0
    supervised = sample.input_ids[sample.labels != IGNORE].tolist()
    assert encoder.tokenizer.decode(supervised).count("Answer") == 200


MEMORY_SCRIPT = r"""
import json, resource, sys
from pathlib import Path
import torch
from mmadapt import build_model
from mmadapt.data import DataProblem, SampleEncoder, char_tokenizer, load_video, prepare_tokenizer

root = Path(sys.argv[1])
torch.manual_seed(0)


def encoder(names, **settings):
    model = build_model(*names)
    return SampleEncoder.for_model(model, prepare_tokenizer(model, char_tokenizer()), image_root=str(root),
                                   **settings)


def record(images, videos=None):
    text = "<image>" * len(images) + "<video>" * len(videos or []) + "What is it?"
    record = {"id": "x", "images": images, "messages": [{"role": "user", "content": text},
                                                         {"role": "assistant", "content": "Red."}]}
    return {**record, "videos": videos} if videos else record


llava = encoder(("clip", "mlp2x_gelu", "llama"))
qwen = encoder(("qwen3_5_vit", "qwen_merger", "qwen3_5"), max_video_bytes=16 << 20, video={"num_frames": 64})
llava.encode(record(["noise.png"]), 0)
qwen.encode(record(["noise.png"], ["small.mp4"]), 0)


def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


cases = {
    "pad_20000x100": lambda: llava.encode(record(["wide.png"]), 0),
    "pad_100x20000": lambda: llava.encode(record(["tall.png"]), 0),
    "twelve_3000x3000": lambda: qwen.encode(record(["big.png"] * 12), 0),
    "frame_list_100000": lambda: load_video([str(root / "frame.png")] * 100_000),
    "video_64x1024x1024": lambda: qwen.encode(record([], ["big.mp4"]), 0),
}
base, out = peak(), {}
for name, case in cases.items():
    try:
        case()
        result = "encoded"
    except DataProblem as problem:
        result = problem.reason
    out[name] = {"result": result, "growth": peak() - base}
print(json.dumps(out))
"""
# What each memory case ends as. Measured here: every case +0 MiB over the baseline. main's code (its pad, its
# decoding before the length check, no byte caps) in the same script: +1.05 GiB at the first pad case; the twelve
# images decode 12 x 27 MB before the length check, the frame list dies allocating (RuntimeError), the video decodes
# whole (64 x 1024 x 1024 x 3 = 192 MiB).
MEMORY_CASES = {"pad_20000x100": "encoded", "pad_100x20000": "encoded", "twelve_3000x3000": "too_long",
                "frame_list_100000": "video_too_large", "video_64x1024x1024": "sample_too_large"}
MEMORY_BOUND = 64 * MiB


@pytest.mark.slow  # a fresh process: ~10 s of imports and model builds
def test_memory_cases_stay_under_their_bound(root, tmp_path):
    from mmadapt.synthetic import write_video

    for name, size in (("wide.png", (20000, 100)), ("tall.png", (100, 20000))):
        Image.new("RGB", size, (10, 200, 10)).save(root / name)
    write_video(root / "small.mp4", np.zeros((4, 32, 32, 3), np.uint8))
    write_video(root / "big.mp4", np.zeros((64, 1024, 1024, 3), np.uint8))
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(root)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert {name: m["result"] for name, m in measured.items()} == MEMORY_CASES
    over = {name: f"{m['growth'] / MiB:.0f} MiB" for name, m in measured.items() if m["growth"] > MEMORY_BOUND}
    assert not over, f"peak memory over the {MEMORY_BOUND // MiB} MiB bound: {over}"


# ---- the corpus in a training run and in `mmadapt data check` -----------------------------------------------------
def corpus(root, path):
    """Good samples and one of each bad input above (a bad JSON line among them); returns the path and the number
    of bad records."""
    bad = [TEMPLATE_REFUSALS["only_assistant"][0], TEMPLATE_REFUSALS["image_in_system"][0],
           messages("many", ("user", "<image>" * 100 + "?"), ("assistant", "."), images=["noise.png"] * 100),
           messages("frames", ("user", "<video>?"), ("assistant", "."), videos=[["frame.png"] * 2000])]
    records = [good(f"good{k}") for k in range(3)] + bad
    write_jsonl(path, records)
    with open(path, "ab") as f:
        f.write(("[" * 100_000 + "]" * 100_000).encode() + b"\n")
    return path, len(bad) + 1


def test_a_dataloader_with_workers_over_the_corpus_keeps_going_and_the_budget_counts_the_bad_records(root, qwen,
                                                                                                    tmp_path):
    """What the trainer does with each global batch (`Trainer.count_problems`): the collator drops the problems into
    `meta["problems"]` (pickled back from the worker processes), the budget counts them by reason."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    from mmadapt.data import BadSampleBudget

    model, encoder = qwen
    path, bad = corpus(root, tmp_path / "train.jsonl")
    loader = DataLoader(VLMDataset(path, encoder), batch_size=4, num_workers=2,
                        collate_fn=Collator.for_model(model, encoder.pad_token_id))
    counts = SimpleNamespace(samples_seen=0, bad_samples=0, bad_counts={}, first_bad={})
    budget = BadSampleBudget(counts, max_fraction=0.7)
    for batch in loader:
        problems = batch["meta"]["problems"]
        budget.add(problems, seen=len(batch["meta"]["sample_ids"]) + len(problems), bad=len(problems))
        budget.check(step=1)
    assert counts.samples_seen == 8 and counts.bad_samples == bad
    assert counts.bad_counts == {"template_error": 2, "sample_too_large": 2, "bad_format": 1}
    assert counts.first_bad["bad_format"]["id"] == "line 8"


@pytest.mark.slow  # a real training step (~7 s)
def test_a_training_run_over_the_corpus_keeps_going_and_counts_the_bad_records(root, qwen, tmp_path):
    from mmadapt.train import RunConfig, Trainer

    model, encoder = qwen
    path, bad = corpus(root, tmp_path / "train.jsonl")
    dataset = VLMDataset(path, encoder)
    assert len(dataset) == 8
    config = RunConfig.load(None, [f"train.out={tmp_path / 'out'}", "train.progress=false", "train.steps=1",
                                   "data.batch_size=8", "data.max_bad_fraction=0.7", "checkpoint.every=0"])
    summary = Trainer(model, config, dataset, Collator.for_model(model, encoder.pad_token_id)).fit()
    assert summary["samples_seen"] == 8 and summary["bad_samples"] == bad  # the one step holds every record once
    assert len(summary["history"]) == 1 and np.isfinite(summary["history"][0]["loss"])


def test_data_check_reports_every_bad_input(root, tmp_path, capsys):
    path, _ = corpus(root, tmp_path / "data.jsonl")
    report = tmp_path / "report.json"
    code = main(["data", "check", str(path), *QWEN_FLAGS, "--chat-template", "qwen3_5", "--image-root", str(root),
                 "--json", str(report)])
    out = capsys.readouterr().out
    assert code == 1 and "FAILED" in out
    found = {p["id"]: p["reason"] for p in json.loads(report.read_text())["problems"]}
    assert found == {"only_assistant": "template_error", "image_in_system": "template_error",
                     "many": "sample_too_large", "frames": "sample_too_large", "line 8": "bad_format"}
    assert f"{path}:8: nested too deeply" in out  # the first of each reason is shown with its detail


def test_the_limits_are_data_settings_with_their_defaults(tmp_path, root, capsys):
    names = {s.name: s.default for s in settings()}
    assert {k: names[k] for k in ("max_images", "max_sample_pixels", "max_sample_frames", "max_video_bytes")} == {
        "max_images": 64, "max_sample_pixels": 128 * MiB, "max_sample_frames": 1024, "max_video_bytes": 1024 * MiB}
    with pytest.raises(ValueError, match="max_images must be an integer >= 1"):
        DataConfig(max_images=0)
    path = write_jsonl(tmp_path / "d.jsonl", [messages("two", ("user", "<image><image>?"), ("assistant", "."),
                                                       images=["noise.png"] * 2)])
    assert main(["data", "check", str(path), "data.max_images=1", *QWEN_FLAGS, "--image-root", str(root)]) == 1
    assert "sample_too_large" in capsys.readouterr().out
    assert main(["data", "check", str(path), *QWEN_FLAGS, "--image-root", str(root), "--max-images", "2"]) == 0
