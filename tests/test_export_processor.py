"""A transformers export every tool loads: transformers' own classes rebuild mmadapt's inputs, logits and answers.

For each exportable family - LLaVA-1.5 (CLIP, and SigLIP, + mlp2x_gelu + Llama, the real Llama-2 tokenizer and the
trained vicuna_v1 template), Qwen3.5, Qwen3.5-MoE, Qwen3-VL and Qwen3-VL-MoE (the real Qwen3 tokenizer with the
family's official template, and data settings that are not the defaults: video sampling, pixel bounds, for Qwen3.5
`enable_thinking: false`) - a tiny model is exported once per module with `save_pretrained(dir,
format="transformers", tokenizer=tok)` (LLaVA and Qwen3.5 in the fast tier, every family in the full suite). Then,
using transformers alone on that directory:
- `AutoProcessor.apply_chat_template` on a two-turn conversation with two images of different sizes gives mmadapt
  `Processor`'s `input_ids`, `pixel_values` and `image_grid_thw` exactly;
- a video file (Qwen families; frames as transformers' pyav reader decodes them, its own fps sampling) gives the same
  `pixel_values_videos`, `video_grid_thw` and ids (the exported template writes a video part as the bare
  `<|video_pad|>`: docs/export.md), Qwen's reference stream, under transformers 5.24 and 5.25 alike; vLLM's
  replacement rule (`vllm_video_ids`, written out here: no vLLM needed) expands the exported template to the same ids;
- `AutoModelForImageTextToText` gives mmadapt's logits (fp32, <= 1e-5) on the image prompt and on the video prompt
  as mmadapt renders it, and transformers' `generate` gives mmadapt's greedy continuation.
Also: the export record (version, data settings, every file's SHA-256, the source's), the architectures the hub
uses with Qwen3-VL-MoE's experts in the hub's layout, the settings read back by mmadapt, a string-only built-in
template (chatml) reading content parts through its prelude, a tokenizer that does not fit the model refused before
anything is written, and the data settings a run attaches kept by its checkpoints, OUT/model and inference loading.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from helpers import TRANSFORMERS_KEEPS_VIDEO_WRAPPER
from PIL import Image
from real_tokenizers import real_tokenizer

import mmadapt
from mmadapt import Processor, VisionLanguageModel
from mmadapt import directory as model_directory
from mmadapt.data import TEMPLATES
from mmadapt.data.config import DataConfig
from mmadapt.processor import export_processor
from mmadapt.synthetic import moving_square, synthetic_batch, write_video

ATOL = 1e-5
NEW_TOKENS = 6
QWEN_VIDEO = {"fps": 4, "min_pixels": 16 * 16, "max_pixels": 8 * 48 * 48}


@dataclass(frozen=True)
class Family:
    parts: tuple[str, str, str]
    tokenizer: str
    template: str | None  # the official template the tokenizer carries (None: the tokenizer's own, none for Llama-2)
    architecture: str
    settings: dict[str, Any]


FAMILIES = {
    "llava": Family(("clip", "mlp2x_gelu", "llama"), "llama2", None, "LlavaForConditionalGeneration", {}),
    "llava_siglip": Family(("siglip", "mlp2x_gelu", "llama"), "llama2", None, "LlavaForConditionalGeneration", {}),
    "qwen3_5": Family(("qwen3_5_vit", "qwen_merger", "qwen3_5"), "qwen3", "qwen3_5",
                      "Qwen3_5ForConditionalGeneration",
                      {"video": QWEN_VIDEO, "template_kwargs": {"enable_thinking": False}}),
    "qwen3_5_moe": Family(("qwen3_5_vit", "qwen_merger", "qwen3_5_moe"), "qwen3", "qwen3_5",
                          "Qwen3_5MoeForConditionalGeneration", {"video": QWEN_VIDEO}),
    "qwen3_vl": Family(("qwen3_vl_vit", "qwen_merger", "qwen3_vl"), "qwen3", "qwen3_vl",
                       "Qwen3VLForConditionalGeneration", {"video": QWEN_VIDEO}),
    "qwen3_vl_moe": Family(("qwen3_vl_vit", "qwen_merger", "qwen3_vl_moe"), "qwen3", "qwen3_vl",
                           "Qwen3VLMoeForConditionalGeneration", {"video": QWEN_VIDEO}),
}


@dataclass
class Export:
    family: Family
    model: VisionLanguageModel
    processor: Processor
    path: Any

    @property
    def qwen(self) -> bool:
        return self.family.tokenizer == "qwen3"


FAST = ("llava", "qwen3_5")  # the fast tier's; every family in the full suite (a Qwen vocabulary costs ~10 s a family)


@pytest.fixture(scope="module", params=[pytest.param(name, marks=() if name in FAST else pytest.mark.slow)
                                        for name in FAMILIES])
def export(request, tmp_path_factory) -> Export:
    """A tiny model of the family with the real tokenizer, trained settings attached (as a run attaches them),
    prepared as training prepares it, and exported."""
    family = FAMILIES[request.param]
    torch.manual_seed(0)
    model = mmadapt.build_model(*family.parts).eval()
    with torch.no_grad():  # routers that prefer different experts for different tokens (their init is zeros)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    tokenizer = real_tokenizer(family.tokenizer)
    if family.template:
        tokenizer.chat_template = TEMPLATES.get(family.template).jinja(tokenizer)  # as the checkpoint ships it
    model_directory.set_data_settings(model, DataConfig(**family.settings).preprocessing())
    processor = Processor.for_model(model, tokenizer)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, format="transformers", processor_export=export_processor, tokenizer=processor.tokenizer)
    return Export(family, model, processor, path)


@pytest.fixture(scope="module")
def auto(export):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoProcessor.from_pretrained(export.path), AutoModelForImageTextToText.from_pretrained(export.path).eval()


def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in ((40, 56, 3), (64, 32, 3))]


def conversation(pictures: list[Image.Image] | None = None) -> list[dict]:
    """Two user turns, the first with two images (as parts; `pictures` put inside them for transformers)."""
    first, second = ({"type": "image", **({"image": p} if pictures else {})} for p in (pictures or [None, None]))
    return [{"role": "user", "content": [first, {"type": "text", "text": "\nWhat differs from"}, second,
                                         {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "The colours."},
            {"role": "user", "content": [{"type": "text", "text": "Which is larger?"}]}]


def theirs_for_images(processor) -> dict:
    return processor.apply_chat_template(conversation(images()), add_generation_prompt=True, tokenize=True,
                                         return_dict=True, return_tensors="pt")


def test_autoprocessor_builds_mmadapts_inputs_for_images(export, auto):
    processor, _ = auto
    ours = export.processor(conversation(), images=images())
    theirs = theirs_for_images(processor)
    assert type(processor).__name__ == ("Qwen3VLProcessor" if export.qwen else "LlavaProcessor")
    assert theirs["input_ids"].tolist() == ours["input_ids"].tolist()
    assert torch.equal(theirs["pixel_values"], ours["pixel_values"])
    if export.qwen:
        assert torch.equal(theirs["image_grid_thw"], ours["image_grid_thw"])
        assert theirs["mm_token_type_ids"].tolist() == ours["mm_token_type_ids"].long().tolist()
    text = export.processor.tokenizer.decode(ours["input_ids"][0])
    if export.family.settings.get("template_kwargs"):  # the trained non-thinking prompt, with nothing passed again
        assert text.endswith("<think>\n\n</think>\n\n")
        assert processor.apply_chat_template(conversation(images()), add_generation_prompt=True,
                                             tokenize=False).endswith("<think>\n\n</think>\n\n")
        thinking = processor.apply_chat_template(conversation(images()), add_generation_prompt=True, tokenize=False,
                                                 enable_thinking=True)  # a default: a caller (a server) may change it
        assert thinking.endswith("<|im_start|>assistant\n<think>\n")


def test_the_models_logits_and_greedy_answer_equal_mmadapts(export, auto):
    processor, theirs_model = auto
    ours = export.processor(conversation(), images=images())
    theirs = theirs_for_images(processor)
    with torch.no_grad():
        expected = theirs_model(**theirs).logits
        got = export.model(**ours).logits
    assert (got - expected).abs().max() <= ATOL
    stop = export.processor.eos_token_ids
    answer = theirs_model.generate(**theirs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=export.processor.encoder.pad_token_id)
    mine = export.model.generate(**ours, max_new_tokens=NEW_TOKENS, eos_token_id=stop)
    answer = answer[0, theirs["input_ids"].shape[1]:].tolist()
    assert answer and answer == mine[0, : len(answer)].tolist()
    assert len(answer) == NEW_TOKENS or answer[-1] in stop  # transformers stopped where mmadapt stops


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / "left.mp4"
    return write_video(path, moving_square(12, 32, 48, direction=(0, -1), start=(8, 40)), fps=8)


def video_conversation(part: dict) -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "Which way does it move?"}]}]


def test_autoprocessor_samples_preprocesses_and_writes_a_video_as_mmadapt(export, auto, video):
    """Same frames, pixels, grid and ids: the exported template writes a video part as the bare <|video_pad|>, which
    transformers' processor expands to mmadapt's per-frame blocks with no outer <|vision_start|> / <|vision_end|>
    (Qwen's reference stream); the exported model gives mmadapt's logits on it."""
    if not export.qwen:
        pytest.skip("LLaVA takes no video")
    from transformers.video_utils import read_video_pyav

    processor, theirs_model = auto
    ours = export.processor(video_conversation({"type": "video", "video": str(video)}))
    text = processor.apply_chat_template(video_conversation({"type": "video"}), add_generation_prompt=True,
                                         tokenize=False)
    frames, metadata = read_video_pyav(str(video), sample_indices_fn=lambda metadata, **_: np.arange(
        metadata.total_num_frames))  # every frame: transformers' processor samples them, at its configured fps
    theirs = processor(text=[text], videos=[frames], video_metadata=[metadata], return_tensors="pt")
    assert torch.equal(theirs["pixel_values_videos"], ours["pixel_values_videos"])
    assert torch.equal(theirs["video_grid_thw"], ours["video_grid_thw"])
    assert int(ours["video_grid_thw"][0, 0]) == 3  # 12 frames at 8 fps sampled at 4 fps: 6 frames, 3 patches
    assert theirs["input_ids"].tolist() == ours["input_ids"].tolist()
    tokens = export.model.tokens
    ids = ours["input_ids"][0].tolist()
    assert ids.count(tokens.vision_start_token_id) == ids.count(tokens.vision_end_token_id) == 3  # one per patch
    assert torch.equal(theirs["mm_token_type_ids"].bool(), ours["mm_token_type_ids"].bool())
    inputs = {k: v for k, v in ours.items() if k not in ("images_per_sample", "videos_per_sample")}
    inputs["attention_mask"] = inputs["attention_mask"].long()
    inputs["mm_token_type_ids"] = inputs["mm_token_type_ids"].long()
    with torch.no_grad():
        expected = theirs_model(**inputs).logits
        got = export.model(**ours).logits
    assert (got - expected).abs().max() <= ATOL


# vLLM's rule for a Qwen3-VL / Qwen3.5 video prompt (vllm-project/vllm, vllm/model_executor/models/qwen3_vl.py:
# Qwen3VLMultiModalProcessor._get_prompt_updates, its PromptReplacement(modality="video", target=...,
# replacement=get_video_replacement_qwen3vl), and Qwen3VLProcessingInfo._get_video_second_idx / _calculate_timestamps
# for the times). Each target in the rendered prompt becomes, per temporal patch, the tokens of f"<{t:.1f} seconds>"
# then [vision_start] + [video_token] * (h * w / merge**2) + [vision_end], t the mean of the patch's first and last
# frame's time; the frames are those the video processor samples (`fps`, clamped to min_frames / max_frames and the
# video's frames, np.linspace rounded). The target: the video token alone since vllm-project/vllm#41359 with
# transformers >= 5.10 (vllm-project/vllm#52526 describes it), the whole three-token string before that. A prompt
# holding a different count of targets than videos is refused ("... found 0 prompt updates").
VLLM_LEGACY_VIDEO_TARGET = "<|vision_start|><|video_pad|><|vision_end|>"


def vllm_video_ids(prompt: str, target: str, tokenizer: Any, grid_thw: list[int], metadata: Any,
                   video_processor: Any) -> list[int]:
    """The ids vLLM's rule (above) makes of `prompt` with one video (`metadata`: its fps and frame count)."""
    pieces = prompt.split(target)
    if len(pieces) != 2:
        raise ValueError(f"Expected there to be 1 prompt updates corresponding to 1 video items, but instead found "
                         f"{len(pieces) - 1} prompt updates")
    total, fps, merge = metadata.total_num_frames, metadata.fps, video_processor.merge_size
    count = min(max(int(total / fps * video_processor.fps), video_processor.min_frames), video_processor.max_frames,
                total)
    indices = np.linspace(0, total - 1, count).round().astype(int).tolist()
    indices += indices[-1:] * (-len(indices) % merge)
    times = [(indices[i] + indices[i + merge - 1]) / 2 / fps for i in range(0, len(indices), merge)]
    patches, height, width = grid_thw
    assert len(times) == patches
    start, pad, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|video_pad|>", "<|vision_end|>"])
    video = []
    for time in times:
        video += tokenizer.encode(f"<{time:.1f} seconds>", add_special_tokens=False)
        video += [start] + [pad] * (height * width // merge**2) + [end]
    head, tail = (tokenizer.encode(piece, add_special_tokens=False) for piece in pieces)
    return head + video + tail


def test_vllms_rule_expands_the_exported_template_to_qwens_stream(export, auto, video):
    """vLLM's replacement (`vllm_video_ids`) turns the exported template's bare <|video_pad|> into mmadapt's ids, Qwen's
    reference stream; a vLLM that looks for the whole <|vision_start|><|video_pad|><|vision_end|> refuses it, as the
    export's note says. Qwen's own form, the three-token string, gives that stream to the older vLLM and transformers
    5.25 but one more bracket pair to transformers 5.10 - 5.24: why the export writes the bare pad."""
    if not export.qwen:
        pytest.skip("LLaVA takes no video")
    from transformers.video_utils import read_video_pyav

    processor, _ = auto
    ours = export.processor(video_conversation({"type": "video", "video": str(video)}))["input_ids"][0].tolist()
    text = processor.apply_chat_template(video_conversation({"type": "video"}), add_generation_prompt=True,
                                         tokenize=False)
    assert text.count(processor.video_token) == 1 and VLLM_LEGACY_VIDEO_TARGET not in text  # the bare pad
    frames, metadata = read_video_pyav(str(video), sample_indices_fn=lambda metadata, **_: np.arange(
        metadata.total_num_frames))
    grid = processor(text=[text], videos=[frames], video_metadata=[metadata],
                     return_tensors="pt")["video_grid_thw"][0].tolist()
    rule = dict(tokenizer=processor.tokenizer, grid_thw=grid, metadata=metadata,
                video_processor=processor.video_processor)
    assert vllm_video_ids(text, processor.video_token, **rule) == ours
    with pytest.raises(ValueError, match="found 0 prompt updates"):
        vllm_video_ids(text, VLLM_LEGACY_VIDEO_TARGET, **rule)
    wrapped = text.replace(processor.video_token, VLLM_LEGACY_VIDEO_TARGET)  # a video as Qwen's templates write it
    assert vllm_video_ids(wrapped, VLLM_LEGACY_VIDEO_TARGET, **rule) == ours
    theirs = processor(text=[wrapped], videos=[frames], video_metadata=[metadata],
                       return_tensors="pt")["input_ids"][0].tolist()
    assert len(theirs) == len(ours) + 2 * TRANSFORMERS_KEEPS_VIDEO_WRAPPER
    assert (theirs == ours) != TRANSFORMERS_KEEPS_VIDEO_WRAPPER


def test_the_export_holds_what_autoprocessor_and_the_servers_read(export):
    path, family = export.path, export.family
    names = {p.name for p in path.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "preprocessor_config.json", "processor_config.json", "mmadapt_export.json"}
    assert expected | ({"video_preprocessor_config.json"} if export.qwen else set()) == names
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [family.architecture]  # the hub's name: vLLM / SGLang find their class by it
    record = json.loads((path / "mmadapt_export.json").read_text())
    assert record["mmadapt_version"] == mmadapt.__version__ and record["architecture"] == config["model_type"]
    assert record["data"] == DataConfig(**family.settings).preprocessing()
    assert set(record["files"]) == names - {"mmadapt_export.json"}
    for name, digest in record["files"].items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == digest, name
    assert record["loaded_from"] is None  # built in code, not read from a directory
    generation = json.loads((path / "generation_config.json").read_text())
    assert set(export.processor.eos_token_ids) <= set(generation["eos_token_id"])  # stops where mmadapt chat stops
    if export.qwen:
        video = json.loads((path / "video_preprocessor_config.json").read_text())
        assert (video["fps"], video["size"], video["cap_pixels_per_frame"]) == \
            (4, {"shortest_edge": 256, "longest_edge": 8 * 48 * 48}, False)
        assert any("bare <|video_pad|>" in note for note in record["notes"])  # what a video part becomes, stated


def test_mmadapt_reads_the_export_back_with_its_settings(export):
    processor = Processor.from_pretrained(export.path)
    again = VisionLanguageModel.from_pretrained(export.path).eval()
    assert model_directory.data_settings(again) == DataConfig(**export.family.settings).preprocessing()
    assert again.encoder.processor_defaults() == export.model.encoder.processor_defaults()  # pixel bounds kept
    if not export.qwen:  # the built-in behind its content-parts prelude, read back as the built-in
        assert processor.encoder.template.name == export.processor.encoder.template.name == "vicuna_v1"
    served = processor(conversation(), images=images())
    ours = export.processor(conversation(), images=images())
    assert served["input_ids"].tolist() == ours["input_ids"].tolist()
    with torch.no_grad():
        assert (again(**served).logits - export.model(**ours).logits).abs().max() <= ATOL
    if export.qwen:
        return  # exporting the read-back model again costs the Qwen vocabulary once more; LLaVA shows the record
    target = export.path.parent / f"{export.path.name}-again"
    again.save_pretrained(target, format="transformers", tokenizer=processor.tokenizer,
                          processor_export=export_processor)
    record = json.loads((target / "mmadapt_export.json").read_text())
    weights = hashlib.sha256((export.path / "model.safetensors").read_bytes()).hexdigest()
    assert record["loaded_from"]["path"] == str(export.path.resolve()) and record["loaded_from"]["sha256"] == weights
    assert (target / "chat_template.jinja").read_text() == (export.path / "chat_template.jinja").read_text()


def test_qwen3_vl_moe_experts_are_stored_as_the_hub_stores_them(tmp_path):
    """(E, hidden, 2 x intermediate) and (E, intermediate, hidden): the layout vLLM and SGLang read; transformers
    and mmadapt read it back to the same logits."""
    from safetensors import safe_open
    from transformers import Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(0)
    model = mmadapt.build_model("qwen3_vl_vit", "qwen_merger", "qwen3_vl_moe").eval()
    model.save_pretrained(tmp_path, format="transformers", processor_export=export_processor)
    text = model.backbone.config
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k.rsplit(".", 1)[-1]: tuple(f.get_slice(k).get_shape()) for k in f.keys() if ".mlp.experts." in k}
    experts, hidden, inner = text.num_experts, text.hidden_size, text.moe_intermediate_size
    assert shapes == {"gate_up_proj": (experts, hidden, 2 * inner), "down_proj": (experts, inner, hidden)}
    batch = synthetic_batch(model, (1, 2))
    inputs = {k: v for k, v in batch.items() if k not in ("images_per_sample", "labels")}
    inputs["attention_mask"] = batch["attention_mask"].long()
    inputs["mm_token_type_ids"] = (batch["input_ids"] == model.tokens.image_token_id).long()
    with torch.no_grad():
        ours = model(**batch).logits
        theirs = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path).eval()(**inputs).logits
        again = VisionLanguageModel.from_pretrained(tmp_path).eval()(**batch).logits
    mask = batch["attention_mask"]
    assert (theirs - ours)[mask].abs().max() <= ATOL and torch.equal(again, ours)


def test_a_template_that_reads_only_strings_takes_parts_through_a_prelude_and_stays_the_built_in(tmp_path):
    """chatml writes no video part: the exported template reads image and video parts through the prelude in front
    of it, AutoProcessor builds mmadapt's ids for images, and mmadapt reads the template back as chatml."""
    from transformers import AutoProcessor

    from mmadapt.data import char_tokenizer
    from mmadapt.data.templates import JINJA_MARK
    from mmadapt.processor import PARTS_MARK

    model = mmadapt.build_model("qwen3_vl_vit", "qwen_merger", "qwen3_vl").eval()
    model_directory.set_data_settings(model, DataConfig(chat_template="chatml", video=QWEN_VIDEO).preprocessing())
    processor = Processor.for_model(model, char_tokenizer())
    model.save_pretrained(tmp_path, format="transformers", processor_export=export_processor,
                          tokenizer=processor.tokenizer)
    template = (tmp_path / "chat_template.jinja").read_text()
    assert template.startswith(JINJA_MARK.format(name="chatml") + PARTS_MARK)
    assert processor.tokenizer.chat_template == TEMPLATES.get("chatml").jinja(processor.tokenizer)  # left as it was
    theirs = AutoProcessor.from_pretrained(tmp_path).apply_chat_template(
        conversation(images()), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    assert theirs["input_ids"].tolist() == processor(conversation(), images=images())["input_ids"].tolist()
    assert Processor.from_pretrained(tmp_path).encoder.template.name == "chatml"
    notes = json.loads((tmp_path / "mmadapt_export.json").read_text())["notes"]
    assert any("prelude" in note and "<|video_pad|>" in note for note in notes)


def test_a_tokenizer_that_does_not_fit_the_model_is_refused_before_anything_is_written(tmp_path):
    model = mmadapt.build_model("clip", "mlp2x_gelu", "llama")
    with pytest.raises(ValueError, match=r"tokenizer does not fit the model being exported: it lacks \['<image>'\].*"
                                         r"Processor.for_model\(model, tokenizer\)"):
        model.save_pretrained(tmp_path / "out", format="transformers", processor_export=export_processor,
                              tokenizer=real_tokenizer("llama2"))
    assert not (tmp_path / "out").exists()


def test_a_directory_remembers_its_data_settings_and_the_processor_defaults_to_them(tmp_path):
    """mmadapt's own format: config.json's "data"; Processor.from_pretrained renders and samples with them unless told
    otherwise."""
    from mmadapt.data import char_tokenizer

    model = mmadapt.build_model("qwen3_5_vit", "qwen_merger", "qwen3_5").eval()
    tokenizer = char_tokenizer()
    settings = DataConfig(chat_template="qwen3_5", template_kwargs={"enable_thinking": False},
                          video={"fps": 1, "max_frames": 8}).preprocessing()
    model_directory.set_data_settings(model, settings)
    Processor.for_model(model, tokenizer)
    model.save_pretrained(tmp_path, tokenizer=tokenizer)
    assert json.loads((tmp_path / "config.json").read_text())["data"] == settings
    processor = Processor.from_pretrained(tmp_path)
    assert processor.encoder.config.preprocessing() == settings and processor.encoder.template.name == "qwen3_5"
    assert processor.encoder.video_processor.sampling.fps == 1
    text = processor.tokenizer.decode(processor("Hi")["input_ids"][0])
    assert text.endswith("<think>\n\n</think>\n\n")  # enable_thinking: false, remembered
    thinking = Processor.from_pretrained(tmp_path, template_kwargs={"enable_thinking": True})  # a setting given wins
    assert thinking.encoder.config.template_kwargs == {"enable_thinking": True}


def test_a_run_gives_its_model_the_data_settings_it_trains_with_and_its_outputs_keep_them(tmp_path):
    """A run attaches its data settings to its model; its checkpoint and OUT/model save them; the model chat and
    serve load (`load_for_inference`) renders with them, nothing passed again."""
    from helpers import TINY_LLAVA, noise_image, write_jsonl

    from mmadapt.inference import load_for_inference
    from mmadapt.train import RunConfig
    from mmadapt.train.export import load_trained
    from mmadapt.train.run import build_run, run

    noise_image(tmp_path / "a.png")
    data = write_jsonl(tmp_path / "train.jsonl", [{"id": "a", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Noise."}]}])
    config = RunConfig.load(None, [f"train.out={tmp_path / 'out'}", f"data.train={data}", "train.steps=1",
                                   f"data.image_root={tmp_path}", "data.chat_template=llava_hf",
                                   "train.progress=false", "data.batch_size=1",
                                   *(f"model.{k}={v}" for k, v in TINY_LLAVA.items())])
    settings = DataConfig.of(config.data).preprocessing()
    assert settings["chat_template"] == "llava_hf"
    assert model_directory.data_settings(build_run(config).model) == settings
    run(config)
    for directory in (tmp_path / "out" / "model", *(tmp_path / "out" / "checkpoints").iterdir()):
        assert json.loads((directory / "config.json").read_text())["data"] == settings, directory
    model, tokenizer = load_for_inference(tmp_path / "out")
    assert model_directory.data_settings(model) == settings
    assert Processor.for_model(model, tokenizer).encoder.template.name == "llava_hf"
    checkpoint = next((tmp_path / "out" / "checkpoints").iterdir())
    assert model_directory.data_settings(load_trained(checkpoint)[0]) == settings
    saved = json.loads((checkpoint / "config.json").read_text())
    del saved["data"]  # a checkpoint written before config.json held them: its run's data section stands in
    (checkpoint / "config.json").write_text(json.dumps(saved))
    marker = json.loads((checkpoint / "COMPLETE").read_text())  # as that writer recorded it: the checkpoint verifies
    marker["files"]["config.json"] = hashlib.sha256((checkpoint / "config.json").read_bytes()).hexdigest()
    (checkpoint / "COMPLETE").write_text(json.dumps(marker))
    assert model_directory.data_settings(load_trained(checkpoint)[0]) == settings
