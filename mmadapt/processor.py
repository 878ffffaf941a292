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
bool masks, right padding.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mmadapt.data import Collator, SampleEncoder
from mmadapt.data.images import load_image, to_rgb
from mmadapt.data.samples import IMAGE, VIDEO, Turn, _message_turns
from mmadapt.data.tokenizer import load_tokenizer


class Processor:
    def __init__(self, encoder: SampleEncoder, collator: Collator) -> None:
        self.encoder, self.collator = encoder, collator
        self.tokenizer = encoder.tokenizer

    @classmethod
    def for_model(cls, model: Any, tokenizer: Any, **data_config: Any) -> Processor:
        """The processor of `model` with `tokenizer` (missing span tokens are added, as for training)."""
        encoder = SampleEncoder.for_model(model, tokenizer, **data_config)
        return cls(encoder, Collator.for_model(model, encoder.pad_token_id))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **data_config: Any) -> Processor:
        """From a model directory alone: its tokenizer files and its config (the model is built on meta only)."""
        from mmadapt import directory as model_directory
        from mmadapt.model import VisionLanguageModel

        tokenizer = load_tokenizer(directory)
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
        if isinstance(image, (str, os.PathLike)):
            return load_image(image, max_pixels=self.encoder.config.max_image_pixels)
        if hasattr(image, "mode") and hasattr(image, "size"):  # a PIL image
            return to_rgb(image)
        raise TypeError(f"images must be PIL images or paths, got {type(image).__name__}")

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
        """The ids that end an answer: the tokenizer's EOS and the template's end of turn."""
        end = self.encoder.template.end_of_turn(self.tokenizer)
        ids = {self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids(end)}
        return sorted(i for i in ids if i is not None)


def _is_message(value: Any) -> bool:
    return isinstance(value, dict) and "role" in value
