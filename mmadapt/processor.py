"""`Processor`: text or chat messages + images and videos -> the model's keyword inputs, as transformers users expect.

    processor = Processor.from_pretrained("OUT/model")          # or Processor.for_model(model, tokenizer)
    inputs = processor("<image>\nWhat digit is this?", images=[Image.open("7.png")], return_tensors="pt")
    answer = processor.decode(model.generate(**inputs)[0])
    inputs = processor("<video>\nWhich way does it move?", videos=["clip.mp4"])   # Qwen3.5 / Qwen3-VL models

A prompt is a string (one user turn; `<image>` marks each image, `<video>` each video), a list of messages
(`{"role", "content"}`, content a string or OpenAI-style parts with `{"type": "image"}` / `{"type": "video"}`), or
a list of prompts for a batch (then `images` and `videos` are one list per prompt). Images are PIL images or
paths; videos are files or lists of frames (PIL images or paths), sampled by the `video` settings. The
code is the dataset path's (`SampleEncoder.prompt_for` and `Collator`), so inference inputs are
built exactly as training inputs were: same template, same image preprocessing and token counts,
bool masks, right padding. The data settings default to those the model was trained with (`for_model`).

`export_processor` writes the processor side of a transformers export (`save_pretrained(dir, format="transformers",
processor_export=export_processor)`, `mmadapt export --format transformers`; docs/export.md): what transformers'
`AutoProcessor` reads to build the same inputs as this processor - the image processor (`Qwen2VLImageProcessor`, or
`LlavaImageProcessor` with LLaVA-1.5's pad-to-square in the mean colour), Qwen's video processor
(`Qwen3VLVideoProcessor` with the training sampling), the processor config (`Qwen3VLProcessor`, or `LlavaProcessor` with
its token arithmetic) and the tokenizer with the training chat template and its `template_kwargs`.

Videos: mmadapt (as Qwen's reference processor, transformers 4.57) replaces a video's
`<|vision_start|><|video_pad|><|vision_end|>` whole by its per-frame `<t seconds><|vision_start|>...<|vision_end|>`
blocks; transformers 5.10 - 5.24, and vLLM on them (vllm-project/vllm#41359), replace only the `<|video_pad|>`,
keeping two more tokens around them (transformers 5.25 collapses the three tokens to the pad first). The exported
template therefore writes a video part as the bare `<|video_pad|>`, which every one of those expands to exactly the
training stream.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from mmadapt import directory as model_directory
from mmadapt.data import Collator, SampleEncoder
from mmadapt.data.config import PREPROCESSING, DataConfig
from mmadapt.data.images import EmbeddedImage, load_image, to_rgb
from mmadapt.data.processors import RESCALE, FixedSizeProcessor, QwenProcessor, processor_for
from mmadapt.data.samples import IMAGE, VIDEO, Turn, _message_turns
from mmadapt.data.templates import JINJA_MARK, TEMPLATES, JinjaTemplate, TemplateRenderError, resolve_template
from mmadapt.data.tokenizer import required_tokens, saved_tokenizer
from mmadapt.data.video import VideoProcessor

log = logging.getLogger(__name__)


class Processor:
    def __init__(self, encoder: SampleEncoder, collator: Collator) -> None:
        self.encoder, self.collator = encoder, collator
        self.tokenizer = encoder.tokenizer

    @classmethod
    def for_model(cls, model: Any, tokenizer: Any, **data_config: Any) -> Processor:
        """The processor of `model` with `tokenizer` (missing span tokens are added, as for training).

        The data settings are those `model` was trained with (`trained_settings`: chat template, `template_kwargs`,
        video sampling), each replaced by a setting given here (`chat_template=...`); `config=` (a whole
        `DataConfig`) replaces them all."""
        if "config" not in data_config:
            data_config = {**trained_settings(model), **data_config}
        encoder = SampleEncoder.for_model(model, tokenizer, **data_config)
        return cls(encoder, Collator.for_model(model, encoder.pad_token_id))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **data_config: Any) -> Processor:
        """From a model directory alone: its tokenizer files and its config (the model is built on meta only)."""
        from mmadapt import directory as model_directory
        from mmadapt.model import VisionLanguageModel

        tokenizer = saved_tokenizer(directory)
        if tokenizer is None:
            raise FileNotFoundError(f"{directory} holds no tokenizer files (tokenizer.json, tokenizer_config.json); "
                                    "save the model with save_pretrained(dir, tokenizer=tokenizer)")
        return cls.for_model(model_directory.structure(VisionLanguageModel, directory), tokenizer, **data_config)

    def __call__(self, prompts: str | Sequence[Any], images: Sequence[Any] | None = None,
                 return_tensors: str = "pt", videos: Sequence[Any] | None = None) -> dict[str, Any]:
        if return_tensors != "pt":
            raise ValueError(f"return_tensors={return_tensors!r}: mmadapt returns torch tensors ('pt') only")
        batch = isinstance(prompts, (list, tuple)) and prompts and not _is_message(prompts[0])
        prompts_list = list(prompts) if batch else [prompts]
        images_list = (list(images) if images is not None else [[] for _ in prompts_list]) if batch else [images or []]
        videos_list = (list(videos) if videos is not None else [[] for _ in prompts_list]) if batch else [videos or []]
        for name, given in (("image", images_list), ("video", videos_list)):
            if len(given) != len(prompts_list):
                raise ValueError(f"{len(prompts_list)} prompts but {len(given)} {name} lists: one list per prompt")
        samples = []
        for k, (prompt, imgs, vids) in enumerate(zip(prompts_list, images_list, videos_list, strict=True)):
            turns, inline = self.turns(prompt, k)
            if inline and vids:
                raise ValueError(f"prompt {k}: videos given both inline ({{'type': 'video', 'video': ...}}) and in "
                                 "videos=; give each once")
            samples.append(self.encoder.prompt_for(f"prompt {k}", turns, [self.image(i) for i in imgs],
                                                   [self.video(v) for v in (inline or vids)]))
        batch = self.collator(samples)
        return {k: v for k, v in batch.items() if k not in ("labels", "meta")}  # generate()'s inputs

    def turns(self, prompt: Any, k: int) -> tuple[list[Turn], list[Any]]:
        """The prompt's turns and the videos given inline in its message parts."""
        if isinstance(prompt, str):
            return [Turn("user", prompt)], []
        if isinstance(prompt, (list, tuple)):
            inline: list[Any] = []
            return list(_message_turns(list(prompt), f"prompt {k}", inline)), inline
        raise TypeError(f"prompt {k}: give a string or a list of messages, got {type(prompt).__name__}")

    def video(self, video: Any) -> Any:
        """A video file path, or a list of frames (PIL images or paths), as the data pipeline takes it."""
        if isinstance(video, (str, os.PathLike)):
            return os.fspath(video)
        if isinstance(video, (list, tuple)) and video:
            return tuple(os.fspath(f) if isinstance(f, (str, os.PathLike)) else to_rgb(f) for f in video)
        raise TypeError(f"videos must be file paths or non-empty lists of frames, got {type(video).__name__}")

    def image(self, image: Any) -> Any:
        """A path, encoded bytes (`EmbeddedImage`) or a PIL image -> the decoded RGB image training would see."""
        if isinstance(image, (str, os.PathLike, EmbeddedImage)):
            return load_image(image, max_pixels=self.encoder.config.max_image_pixels)
        if hasattr(image, "mode") and hasattr(image, "size"):  # a PIL image
            return to_rgb(image)
        raise TypeError(f"images must be PIL images, paths or EmbeddedImage, got {type(image).__name__}")

    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens).strip()

    @property
    def placeholder_texts(self) -> tuple[str, ...]:
        """The text this processor reads as visual input: `<image>`, `<video>` and the span tokens' own strings
        (e.g. Qwen's `<|image_pad|>`, `<|video_pad|>`, `<|vision_start|>`, `<|vision_end|>`)."""
        encoder = self.encoder
        ids = [encoder.image_token_id, encoder.video_token_id, *(encoder.brackets or ())]
        tokens = [self.tokenizer.convert_ids_to_tokens(i) for i in ids if i is not None]
        return tuple(dict.fromkeys(t for t in (IMAGE, VIDEO, *tokens) if t))

    def inert(self, text: str) -> str:
        """`text` with every placeholder text (`placeholder_texts`) removed, until none is left (a removal may join
        two pieces into a new one): what a model's answer becomes before it is put back into a prompt, so an answer
        is never read as visual input."""
        while any(p in text for p in self.placeholder_texts):
            for placeholder in self.placeholder_texts:
                text = text.replace(placeholder, "")
        return text

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end an answer: the tokenizer's EOS and the template's end of turn, when that is one token of
        the vocabulary (an empty end, or one the tokenizer does not hold, would name its unknown token)."""
        tokenizer = self.tokenizer
        end = self.encoder.template.end_of_turn(tokenizer)
        end_id = tokenizer.convert_tokens_to_ids(end) if end else None
        unknown = getattr(tokenizer, "unk_token_id", None)
        if end_id is not None and end_id == unknown and end != getattr(tokenizer, "unk_token", None):
            end_id = None
        return sorted(i for i in {tokenizer.eos_token_id, end_id} if i is not None)


def _is_message(value: Any) -> bool:
    return isinstance(value, dict) and "role" in value


def trained_settings(model: Any) -> dict[str, Any]:
    """The data settings `model` was trained with (`mmadapt.directory.data_settings`), checked: {} when unknown."""
    settings = model_directory.data_settings(model)
    unknown = sorted(set(settings) - set(PREPROCESSING))
    if unknown:
        raise ValueError(f"the model's saved data settings hold {unknown}, which this mmadapt does not know (known: "
                         f"{list(PREPROCESSING)}); the directory was written by a newer mmadapt. Fix: upgrade mmadapt")
    return settings


# ---- the processor side of a transformers export -------------------------------------------------------------------
PREPROCESSOR_FILE: Final[str] = "preprocessor_config.json"
VIDEO_PREPROCESSOR_FILE: Final[str] = "video_preprocessor_config.json"
PROCESSOR_FILE: Final[str] = "processor_config.json"
PIL_RESAMPLE: Final[dict[str, int]] = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4,
                                       "hamming": 5}  # PIL.Image.Resampling, as preprocessor configs write it
QWEN_PROCESSOR: Final[str] = "Qwen3VLProcessor"  # what transformers maps qwen3_5(_moe) and qwen3_vl(_moe) to
PARTS_MARK: Final[str] = "{#- mmadapt: OpenAI-style content parts read as the training template's text -#}"
VIDEO_PART_NOTE: Final[str] = (
    "videos: the exported template writes a video part as a bare <|video_pad|>, which transformers' "
    "Qwen3VLProcessor (4.57 and >= 5) and vLLM with vllm-project/vllm#41359 on transformers >= 5.10 expand to "
    "exactly training's per-frame blocks; a vLLM that looks for the whole <|vision_start|><|video_pad|><|vision_end|> "
    "string (before that change, or on transformers < 5.10) refuses the video ('found 0 prompt updates'): upgrade "
    "vLLM and transformers")


def export_processor(model: Any, tokenizer: Any, architecture: str,
                     directory: str | os.PathLike) -> model_directory.ProcessorExport:
    """Write the processor side of `model`'s transformers export (`architecture`: its transformers model_type) into
    `directory` (module docstring), from the settings the model was trained with; `tokenizer` None writes the image
    and video processors only. The tokenizer is checked first (it must hold the model's span tokens at the model's
    ids: `Processor.for_model(model, tokenizer)` adds them, as training does) and is left as it was; it is saved
    with the chat template training used (a built-in written anew, the `template_kwargs` set inside it). Returns the
    files, the ids that end an answer and the record's part (version, data settings, notes on what transformers'
    processor does differently, each also logged: a warning for those that touch common inputs)."""
    from mmadapt.version import __version__

    data = DataConfig(**trained_settings(model))
    images = processor_for(model)
    files = processor_configs(model, images, data, architecture)
    notes = expression_notes(images, data)
    eos: tuple[int, ...] = ()
    if tokenizer is not None:
        eos, note = save_trained_tokenizer(model, tokenizer, data, directory)
        notes += [(note, False)] if note else []
    for name, config in files.items():
        (Path(directory) / name).write_text(json.dumps(config, indent=2) + "\n")
    for note, warn in notes:
        log.log(logging.WARNING if warn else logging.INFO, "transformers export of %s: %s", architecture, note)
    record = {"mmadapt_version": __version__, model_directory.DATA_KEY: data.preprocessing(),
              "processor": model.encoder.processor_defaults(), "notes": [note for note, _ in notes]}
    return model_directory.ProcessorExport(tuple(files), eos, record)


def processor_configs(model: Any, images: Any, data: DataConfig, architecture: str) -> dict[str, dict[str, Any]]:
    """{file: JSON} of the image processor, the video processor (Qwen families) and the processor config."""
    if isinstance(images, QwenProcessor):
        video = data.video.processor(images)
        return {PREPROCESSOR_FILE: qwen_image_config(images), VIDEO_PREPROCESSOR_FILE: qwen_video_config(video),
                PROCESSOR_FILE: {"processor_class": QWEN_PROCESSOR}}
    if architecture != "llava" or not isinstance(images, FixedSizeProcessor):
        raise ValueError(f"a transformers {architecture!r} export takes a {type(images).__name__}; mmadapt writes "
                         "processors for LLaVA (fixed-size images) and the Qwen VLMs (dynamic) only")
    encoder = model.encoder
    return {PREPROCESSOR_FILE: llava_image_config(images),
            PROCESSOR_FILE: {"processor_class": "LlavaProcessor", "image_token": model.backbone_spec.image_token,
                             "patch_size": encoder.patch_size, "num_additional_image_tokens": int(encoder.has_cls),
                             "vision_feature_select_strategy": "default" if encoder.drop_cls else "full"}}


def _normalisation(resample: str, mean: Sequence[float], std: Sequence[float]) -> dict[str, Any]:
    return {"do_convert_rgb": True, "do_resize": True, "resample": PIL_RESAMPLE[resample], "do_rescale": True,
            "rescale_factor": RESCALE, "do_normalize": True, "image_mean": list(mean), "image_std": list(std)}


def qwen_image_config(images: QwenProcessor) -> dict[str, Any]:
    """`Qwen2VLImageProcessor`'s config equal to `images`: smart-resize within [min_pixels, max_pixels]."""
    return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": QWEN_PROCESSOR,
            **_normalisation(images.resample, images.mean, images.std), "patch_size": images.patch_size,
            "temporal_patch_size": images.temporal_patch_size, "merge_size": images.merge_size,
            "size": {"shortest_edge": images.min_pixels, "longest_edge": images.max_pixels}}


def qwen_video_config(video: VideoProcessor) -> dict[str, Any]:
    """`Qwen3VLVideoProcessor`'s config equal to `video`: its pixel bounds over a video's frames, its sampling (fps,
    or a fixed num_frames, within [min_frames, max_frames]) and the per-frame cap as training had it."""
    sampling = video.sampling
    return {"video_processor_type": "Qwen3VLVideoProcessor", "processor_class": QWEN_PROCESSOR,
            **_normalisation("bicubic", video.mean, video.std), "patch_size": video.patch_size,
            "temporal_patch_size": video.temporal_patch_size, "merge_size": video.merge_size,
            "size": {"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels},
            "do_sample_frames": True, "fps": sampling.fps, "num_frames": sampling.num_frames,
            "min_frames": sampling.min_frames, "max_frames": sampling.max_frames,
            "cap_pixels_per_frame": video.cap_pixels_per_frame, "max_video_tokens": video.max_video_tokens}


def llava_image_config(images: FixedSizeProcessor) -> dict[str, Any]:
    """`LlavaImageProcessor`'s config equal to `images` (CLIPImageProcessor's steps plus LLaVA-1.5's pad to a square
    of the mean colour, `do_pad`): "pad" pads then resizes, "resize" resizes to the square, "crop" resizes the short
    side and crops the centre."""
    side = images.image_size
    geometry = {"pad": {"do_pad": True, "size": {"shortest_edge": side}, "do_center_crop": True},
                "resize": {"do_pad": False, "size": {"height": side, "width": side}, "do_center_crop": False},
                "crop": {"do_pad": False, "size": {"shortest_edge": side}, "do_center_crop": True}}
    if images.mode not in geometry:
        raise ValueError(f"image mode {images.mode!r} has no transformers LlavaImageProcessor equivalent; known: "
                         f"{sorted(geometry)}")
    return {"image_processor_type": "LlavaImageProcessor", "processor_class": "LlavaProcessor",
            **_normalisation(images.resample, images.mean, images.std), **geometry[images.mode],
            "crop_size": {"height": side, "width": side}}


def expression_notes(images: Any, data: DataConfig) -> list[tuple[str, bool]]:
    """What transformers' processor does differently from this one on some inputs (the record's "notes"), each with
    whether it is common enough to warn about at export (the others are logged at info level)."""
    ratio = f"{images.max_aspect_ratio:g}"
    unlike = "refuses them (smart_resize)" if images.dynamic else (
        "does not (equal pixels in pad mode up to a one-pixel shift of the image, other pixels in resize and crop "
        "modes)")
    notes = [(f"images more than {ratio} times as long as they are wide (or as wide as long): mmadapt pads their "
              f"short side to {ratio}:1 in the mean colour first, transformers {unlike}", False)]
    if images.dynamic:
        frames = "24 fps" if data.video.frames_fps is None else f"{data.video.frames_fps:g} fps (data.video.frames_fps)"
        notes += [(VIDEO_PART_NOTE, True),
                  (f"videos given as lists of frames: mmadapt takes them as sampled already, at {frames}; "
                   "transformers' video processor samples them again unless called with do_sample_frames=False and "
                   "their metadata", True)]
    return notes


def save_trained_tokenizer(model: Any, tokenizer: Any, data: DataConfig,
                           directory: str | os.PathLike) -> tuple[tuple[int, ...], str | None]:
    """Save `tokenizer` into `directory` carrying the chat template training used (`SampleEncoder.for_model` leaves
    it there), read through the content-parts prelude (`reading_parts`) when that template does not render
    OpenAI-style image and video parts; `tokenizer` is left as it was. Returns the ids that end an answer
    (`Processor.eos_token_ids`) and the note on the prelude (None without it). Raises ValueError, naming the fix,
    when the tokenizer lacks a token the model needs or holds one at another id: preparing it would change the model
    being exported."""
    check_fits(model, tokenizer, data)
    kept = {name: getattr(tokenizer, name) for name in ("chat_template", "eos_token")}  # what preparing may set
    try:
        encoder = SampleEncoder.for_model(model, tokenizer, config=data)
        eos = tuple(Processor(encoder, Collator.for_model(model, encoder.pad_token_id)).eos_token_ids)
        tokens, note = model.tokens, None
        video = wrapped = None
        if encoder.video_token_id is not None:  # a video part is the bare pad: module docstring, "Videos"
            start, video, end = tokenizer.convert_ids_to_tokens([tokens.vision_start_token_id, tokens.video_token_id,
                                                                 tokens.vision_end_token_id])
            wrapped = start + video + end
        if not renders_parts(tokenizer, encoder.image_text, video, wrapped):
            tokenizer.chat_template = reading_parts(tokenizer.chat_template, encoder.image_text, video)
            note = ("the training chat template renders string content only: the exported one reads OpenAI-style "
                    f"content parts through a prelude in front of it, an image part written {encoder.image_text!r}"
                    + (f", a video part {video!r}" if video else "") + "; string content renders as in training")
        model_directory.save_tokenizer(tokenizer, directory)
    finally:
        for name, value in kept.items():
            if getattr(tokenizer, name) != value:
                setattr(tokenizer, name, value)
    return eos, note


def check_fits(model: Any, tokenizer: Any, data: DataConfig) -> None:
    """ValueError unless `tokenizer` holds every token `model` and its chat template need, at the model's ids, within
    its embeddings (`prepare_tokenizer` would otherwise add tokens and grow the model)."""
    template = resolve_template(data.chat_template, tokenizer, model.backbone_spec.chat_template)
    vocab, spec, tokens = tokenizer.get_vocab(), model.backbone_spec, model.tokens
    missing = [t for t in dict.fromkeys(required_tokens(model, tokenizer, template)) if t not in vocab]
    moved = {name: (getattr(tokens, f"{name}_token_id"), vocab[getattr(spec, f"{name}_token")])
             for name in ("image", "video", "vision_start", "vision_end")
             if getattr(spec, f"{name}_token") in vocab and getattr(tokens, f"{name}_token_id") is not None}
    moved = {name: ids for name, ids in moved.items() if ids[0] != ids[1]}
    size = model.backbone.get_input_embeddings().num_embeddings
    if missing or moved or len(tokenizer) > size:
        problem = (f"it lacks {missing}" if missing else f"its span token ids differ from the model's ({moved})"
                   if moved else f"it has {len(tokenizer)} tokens, more than the model's {size} embeddings")
        raise ValueError(f"the tokenizer does not fit the model being exported: {problem}. Fix: call "
                         "mmadapt.Processor.for_model(model, tokenizer) first (it adds the model's tokens and grows "
                         "the embeddings, as training does), or pass the tokenizer the model was trained with")


def renders_parts(tokenizer: Any, image_text: str, video_text: str | None, video_wrapped: str | None = None) -> bool:
    """Whether `tokenizer`'s chat template writes `image_text` for an image part (and `video_text`, not inside
    `video_wrapped`, for a video part) of a message's content list, as transformers' processors pass them."""
    parts = [{"type": "image"}, *([{"type": "video"}] if video_text else []), {"type": "text", "text": "?"}]
    try:
        text = JinjaTemplate(name="export", description="").apply(
            tokenizer, [{"role": "user", "content": parts}], add_generation_prompt=True)
    except TemplateRenderError:
        return False
    return text.count(image_text) == 1 and (video_text is None or (
        text.count(video_text) == 1 and not (video_wrapped and video_wrapped in text)))


def reading_parts(jinja: str, image_text: str, video_text: str | None) -> str:
    """`jinja` with, in front of it (after an mmadapt built-in's mark, which names the built-in when it is read
    back), a prelude that turns each message whose content is a list of parts into one with string content: text
    parts as they are, an image part as `image_text`, a video part as `video_text`. String contents are untouched,
    so the template renders them as in training."""
    head = next((m for m in (JINJA_MARK.format(name=n) for n in TEMPLATES.names()) if jinja.startswith(m)), "")
    video = (f"{{%- elif part.type in ['video', 'video_url'] -%}}{{%- set mmadapt_text.value = mmadapt_text.value + "
             f"{json.dumps(video_text)} -%}}") if video_text else ""
    prelude = (PARTS_MARK + "{%- set mmadapt_parts = namespace(messages=[]) -%}{%- for message in messages -%}"
               "{%- if message.content is string or message.content is none -%}"
               "{%- set mmadapt_parts.messages = mmadapt_parts.messages + [message] -%}{%- else -%}"
               "{%- set mmadapt_text = namespace(value='') -%}{%- for part in message.content -%}"
               "{%- if part.type == 'text' -%}{%- set mmadapt_text.value = mmadapt_text.value + part.text -%}"
               "{%- elif part.type in ['image', 'image_url'] -%}{%- set mmadapt_text.value = mmadapt_text.value + "
               f"{json.dumps(image_text)} -%}}{video}{{%- endif -%}}{{%- endfor -%}}"
               "{%- set mmadapt_parts.messages = mmadapt_parts.messages + [{'role': message.role, 'content': "
               "mmadapt_text.value}] -%}{%- endif -%}{%- endfor -%}{%- set messages = mmadapt_parts.messages -%}")
    return head + prelude + jinja[len(head):]

