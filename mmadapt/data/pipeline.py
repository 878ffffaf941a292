"""From a record to an `EncodedSample`: parse, check, load images, preprocess, render, truncate.

`SampleEncoder.for_model(model, tokenizer, config=DataConfig(...))` (or single settings, `max_length=...`) wires the
model's processor (encoder side), chat template and span tokens (backbone side) to a tokenizer; the settings are
`mmadapt.data.config.DataConfig`'s. `encode(record, index)` returns an `EncodedSample` or raises `DataProblem` with a
reason from `REASONS`:

- images without any placeholder -> `image_without_placeholder` (or, with
  `insert_missing_placeholder=True`, "<image>\\n" per image is put before the first user text);
  placeholders != images -> `placeholder_mismatch`;
- an empty assistant turn -> `empty_answer`; no supervised token at all -> `no_supervised_tokens`;
- longer than `max_length` -> by `truncation`: "drop" (default: a counted `too_long` problem),
  "raise" (a fatal `too_long` that stops a run), or "text" (cut text after the last image or video span,
  keeping >= 1 supervised token; otherwise `too_long`). An image or video span is never cut.

Videos (models with a dynamic encoder and a backbone with a video token: Qwen3.5, Qwen3-VL): each is decoded
and sampled (`data.video`, `mmadapt.data.video.VideoConfig`), preprocessed as transformers' Qwen3-VL video
processor does, and its `<video>` placeholder becomes, per temporal patch (two frames), the timestamp text
`<{t:.1f} seconds>` (t: the mean time of the patch's two sampled frames, from their real frame indices and the
video's fps) + `<|vision_start|>` + `<|video_pad|>` x its tokens + `<|vision_end|>`: Qwen's own rendering (the
reference processor replaces the template's `<|vision_start|><|video_pad|><|vision_end|>` whole, as transformers 5.25
does; 5.10 - 5.24's generic path leaves those brackets around the frames, a token stream the models were not
trained on). Videos
with other models are a fatal `video_unsupported` (give the frames as images instead). Bad videos are counted
problems like bad images (`missing_video`, `unreadable_video`, `video_too_large`, `empty_video`,
`variable_frame_size`, `video_without_placeholder`, `placeholder_mismatch`).

Work is checked before it is done (`encode`): the record's image and frame-list counts before any path is resolved
(`max_images`, `max_sample_frames`), then the image and video headers (`max_image_pixels`, `max_sample_pixels`,
`max_sample_frames`, `max_video_bytes`, the per-video `data.video` limits), then the sample's length from the header
sizes, so an over-long or oversized sample is a counted problem before any pixel is decoded (docs/data.md, "Limits
checked before work"); images are then decoded and preprocessed one at a time. Any other exception raised while a
sample is encoded becomes its `DataProblem` too (`mmadapt.data.problems.per_sample`).

`VLMDataset` is the map-style dataset (safe with `DataLoader` workers): a bad sample comes back
as its `DataProblem`, which the collator drops and reports in the batch, so a run never crashes
on one. `length_grouped_sampler` batches samples of similar length together.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmadapt.data.config import DataConfig
from mmadapt.data.images import image_size, load_image
from mmadapt.data.problems import DataProblem, guarded, per_sample, read_guarded
from mmadapt.data.processors import ProcessedImages
from mmadapt.data.samples import (
    IMAGE,
    VIDEO,
    EncodedSample,
    Sample,
    Turn,
    over_limit,
    parse_record,
    read_records,
    record_id,
)
from mmadapt.data.templates import (
    IGNORE,
    TEMPLATES,
    ChatTemplate,
    ChatTemplateError,
    JinjaTemplate,
    TemplateRenderError,
    expand_images,
    resolve_template,
    with_kwargs,
)
from mmadapt.data.tokenizer import prepare_tokenizer
from mmadapt.data.video import VideoHeader, load_video, probe_video
from mmadapt.data.video.decode import check_bytes

log = logging.getLogger(__name__)


class SampleEncoder:
    """Turns records into `EncodedSample`s for one model + tokenizer."""

    def __init__(self, *, tokenizer: Any, template: ChatTemplate, processor: Any, image_token_id: int,
                 vision_start_token_id: int | None = None, vision_end_token_id: int | None = None,
                 config: DataConfig | None = None, video_token_id: int | None = None,
                 video_processor: Any = None, video_refusal: str | None = None) -> None:
        """`video_processor` (a `VideoProcessor`) with `video_token_id` take videos; without them a sample with a
        video is a fatal `video_unsupported` problem whose detail is `video_refusal`."""
        self.tokenizer, self.template, self.processor = tokenizer, template, processor
        self.image_token_id = image_token_id
        self.video_token_id, self.video_processor = video_token_id, video_processor
        self.video_refusal = video_refusal or "this model takes no video"
        self.brackets = (vision_start_token_id, vision_end_token_id) if vision_start_token_id is not None else None
        self.config = config or DataConfig()
        vocab = tokenizer.get_vocab()
        missing = [t for t in template.specials(tokenizer) if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer lacks the special tokens {missing} that template {template.name!r} needs. "
                             "Fix: call mmadapt.data.prepare_tokenizer(model, tokenizer) first.")
        span = [t for t in (*(self.brackets or ())[:1], image_token_id, *(self.brackets or ())[1:]) if t is not None]
        self.image_text = "".join(tokenizer.convert_ids_to_tokens(span))  # how a template writes an image

    @classmethod
    def for_model(cls, model: Any, tokenizer: Any, processor: Any = None, *, config: DataConfig | None = None,
                  **settings: Any) -> SampleEncoder:
        """The encoder for `model` with the data settings `config` (a `DataConfig`, or a run's data section) and/or
        single `settings` (`max_length=...`, which win); adds missing special tokens to `tokenizer` (see
        `prepare_tokenizer`), resolves `chat_template` (the tokenizer's own by default), checks a built-in against
        the tokenizer's own, and leaves the template in use as `tokenizer.chat_template` (so a saved tokenizer serves
        what was trained)."""
        from mmadapt.data.processors import processor_for

        data = DataConfig.of(config, **settings)
        own = tokenizer_template(tokenizer)
        template = resolve_template(data.chat_template, tokenizer, model.backbone_spec.chat_template)
        prepare_tokenizer(model, tokenizer, template)  # idempotent: adds what is missing, aligns ids and embeddings
        processor = processor or processor_for(model)
        video, refusal = None, None
        if not model.encoder.dynamic:
            refusal = (f"encoder {model.config.encoder.name!r} encodes fixed-size images and takes no video. Fix: give "
                       "the frames as images (`images` with one <image> per frame), or use a dynamic encoder "
                       "(qwen3_5_vit, qwen3_vl_vit) with a Qwen backbone")
        elif model.tokens.video_token_id is None:
            refusal = (f"backbone {model.config.backbone.name!r} has no video placeholder token. Fix: give the frames "
                       "as images, or use a backbone that renders video (qwen3_5, qwen3_vl)")
        else:
            video = data.video.processor(processor)
        encoder = cls(tokenizer=tokenizer, template=template, processor=processor,
                      image_token_id=model.tokens.image_token_id,
                      vision_start_token_id=model.tokens.vision_start_token_id,
                      vision_end_token_id=model.tokens.vision_end_token_id, config=data,
                      video_token_id=model.tokens.video_token_id if video is not None else None,
                      video_processor=video, video_refusal=refusal)
        encoder.check_template(own)
        builtin = not isinstance(template, JinjaTemplate) or template.source or template.file
        if own is None or builtin or data.template_kwargs:  # what is trained is what a saved tokenizer serves
            tokenizer.chat_template = with_kwargs(template.jinja(tokenizer), data.template_kwargs)
        return encoder

    @property
    def image_mode(self) -> str | None:
        """How images enter the chat template, in words (`JinjaTemplate.image_mode`); None for a built-in, which
        places them itself, or a model without images."""
        if not isinstance(self.template, JinjaTemplate) or self.image_token_id is None:
            return None
        return self.template.image_mode(self.tokenizer, self.image_text)

    @property
    def span_ids(self) -> set[int]:
        return {t for t in (self.image_token_id, self.video_token_id, *(self.brackets or ())) if t is not None}

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad (else EOS) id; never an image-span id, which the contract would see as an image."""
        tok = self.tokenizer
        candidates = (tok.pad_token_id, tok.eos_token_id, *range(len(tok)))
        return next(i for i in candidates if i is not None and i not in self.span_ids)

    def parse(self, record: Any, index: int) -> Sample:
        return parse_record(record, index, self.config.image_root, self.config.allow_outside_root,
                            max_images=self.config.max_images, max_frames=self.config.max_sample_frames)

    def encode(self, record: Any, index: int) -> EncodedSample:
        """One record -> `EncodedSample`; raises `DataProblem` (with the sample id) when it cannot, whatever went
        wrong (`per_sample`).

        Work is checked before it is done: the per-sample limits from the image and video headers, then the token
        ids rendered from the header sizes (the visual tokens and video timestamps depend on nothing else), so a
        too-long sample is dropped before any pixel is decoded; images are then decoded and preprocessed one at a
        time (videos are rendered again from what they decode to, the ids being the same)."""
        with per_sample(record_id(record, index)):
            sample = self.check_placeholders(self.parse(record, index))
            check_answers(sample)
            headers = self.headers(sample)
            expected = self.expected_videos(headers)
            ids, labels = self.render(sample, headers.tokens_per_image, videos=expected)
            self.check_span_tokens(sample, ids, headers.tokens_per_image, expected)
            ids, labels = self.fit(sample.id, ids, labels)
            if not sample.videos:
                return self.encoded(sample.id, ids, labels, self.load_images(sample, headers), None)
            processed = self.load_images(sample, headers)
            videos = self.process_videos(sample)
            ids, labels = self.render(sample, processed.tokens_per_image, videos=videos)
            self.check_span_tokens(sample, ids, processed.tokens_per_image, videos)
            ids, labels = self.fit(sample.id, ids, labels)
            return self.encoded(sample.id, ids, labels, processed, videos)

    def headers(self, sample: Sample) -> SampleHeaders:
        """The sample's image and video headers (nothing decoded) with the per-sample limits checked: the pixels, the
        frames kept and their bytes (the image and frame-list counts were checked by `parse`, before any path was
        resolved)."""
        config = self.config
        if sample.videos and self.video_processor is None:
            raise DataProblem("video_unsupported", self.video_refusal, sample_id=sample.id, fatal=True)
        try:
            sizes = [image_size(path, max_pixels=config.max_image_pixels) for path in sample.images]
        except DataProblem as problem:
            raise problem.for_sample(sample.id) from None
        pixels = sum(w * h for w, h in sizes)
        if pixels > config.max_sample_pixels:
            raise over_limit(sample.id, f"{pixels} image pixels", "max_sample_pixels", config.max_sample_pixels)
        videos = [self.video_header(video, sample.id) for video in sample.videos]
        frames = sum(v.frames for v in videos)
        if frames > config.max_sample_frames:
            raise over_limit(sample.id, f"{frames} video frames", "max_sample_frames", config.max_sample_frames)
        decoded = sum(v.bytes for v in videos)
        if decoded > config.max_video_bytes:
            raise over_limit(sample.id, f"{decoded} bytes of decoded video frames", "max_video_bytes",
                             config.max_video_bytes)
        return SampleHeaders(sizes, [self.processor.tokens_for_size(w, h) for w, h in sizes], videos)

    def video_header(self, video: Any, sample_id: str) -> VideoPlan:
        """What one video will cost, from its header (a frame list: its length and first frame's header)."""
        frame_list = isinstance(video, tuple | list)
        limits = self.config.video.limits
        header = probe_video(list(video) if frame_list else video, limits=limits, sample_id=sample_id,
                             fps=self.config.video.frames_fps if frame_list else None)
        frames = self.video_processor.sampled_frames(header, frame_list=frame_list)
        try:
            check_bytes(video if not frame_list else "frame list", frames, header.height, header.width, limits)
        except DataProblem as problem:
            raise problem.for_sample(sample_id) from None
        tokens, patches = self.video_processor.tokens_for_header(header, frame_list=frame_list)
        return VideoPlan(header, frame_list, frames, frames * header.height * header.width * 3, tokens, patches)

    def expected_videos(self, headers: SampleHeaders) -> Any:
        """The sample's `ProcessedVideos` as their headers predict them, pixels aside (None without videos)."""
        if not headers.videos:
            return None
        return self.video_processor.expected([v.header for v in headers.videos],
                                             [v.frame_list for v in headers.videos])

    def check_visual_length(self, sample_id: str, headers: SampleHeaders) -> None:
        """`too_long` when the visual tokens alone (with their brackets, from the headers) exceed `max_length`: the
        sample cannot fit whatever its text, so nothing is decoded (truncation never cuts a span)."""
        visual = headers.visual_tokens(bracketed=self.brackets is not None)
        if visual > self.config.max_length:
            raise DataProblem("too_long", f"its images and videos alone are {visual} tokens > max_length "
                              f"{self.config.max_length} (from their headers, nothing decoded). Fix: raise "
                              "max_length, or lower the video's fps / max_pixels", sample_id=sample_id,
                              fatal=self.config.truncation == "raise")

    def load_images(self, sample: Sample, headers: SampleHeaders) -> ProcessedImages:
        """The sample's images decoded and preprocessed one at a time (one decoded image in memory at once); each
        must yield the tokens its header promised."""
        parts = []
        for path, size, tokens in zip(sample.images, headers.image_sizes, headers.tokens_per_image, strict=True):
            try:
                part = self.processor([load_image(path, max_pixels=self.config.max_image_pixels)])
            except DataProblem as problem:
                raise problem.for_sample(sample.id) from None
            if part.tokens_per_image != [tokens]:
                raise DataProblem("unreadable_image", f"its header says {size[0]} x {size[1]} ({tokens} visual "
                                  f"tokens) but it decodes to {part.tokens_per_image[0]} tokens. Fix: re-encode the "
                                  "file", sample_id=sample.id, path=str(path))
            parts.append(part)
        return ProcessedImages.concat(parts) if parts else self.processor([])

    def encoded(self, sample_id: str, ids: list[int], labels: list[int], processed: Any,
                videos: Any) -> EncodedSample:
        with_images, with_videos = len(processed) > 0, videos is not None and len(videos) > 0
        return EncodedSample(id=sample_id, input_ids=torch.tensor(ids), labels=torch.tensor(labels),
                             pixel_values=processed.pixel_values if with_images else None,
                             image_grid_thw=processed.image_grid_thw if with_images else None,
                             tokens_per_image=list(processed.tokens_per_image),
                             pixel_values_videos=videos.pixel_values_videos if with_videos else None,
                             video_grid_thw=videos.video_grid_thw if with_videos else None,
                             tokens_per_video=videos.tokens_per_video if with_videos else [])

    def process_videos(self, sample: Sample) -> Any:
        """The sample's videos decoded, sampled and preprocessed (`ProcessedVideos`), or None when it has none
        (their limits are checked from the headers first by `encode`; each video's own by `load_video`)."""
        if not sample.videos:
            return None
        if self.video_processor is None:
            raise DataProblem("video_unsupported", self.video_refusal, sample_id=sample.id, fatal=True)
        settings = self.config.video
        loaded = []
        for video in sample.videos:
            frames = isinstance(video, tuple | list)
            loaded.append(load_video(list(video) if frames else video, sampling=self.video_processor.sampling,
                                     limits=settings.limits, fps=settings.frames_fps if frames else None,
                                     sample_id=sample.id))
        return self.video_processor(loaded)

    def video_text(self, processed: Any) -> list[str]:
        """Per video, what its `<video>` placeholder becomes before tokenisation: per temporal patch, the timestamp
        text and the bracketed span with ONE video token (expanded to the frame's tokens after tokenisation)."""
        start, end = (self.tokenizer.convert_ids_to_tokens(t) for t in self.brackets) if self.brackets else ("", "")
        pad = self.tokenizer.convert_ids_to_tokens(self.video_token_id)
        return [self.video_processor.frame_text(times, 1, start, pad, end) for times in processed.timestamps]

    def encode_prompt(self, record: Any, index: int) -> EncodedSample:
        """The prompt for generation: `encode` without the last assistant turn, plus the template's generation
        prompt; labels are all -100. Raises `DataProblem` as `encode` does (`too_long` when over `max_length`), the
        per-sample limits and the visual tokens checked from the headers before anything is decoded."""
        with per_sample(record_id(record, index)):
            sample = self.check_placeholders(self.parse(record, index))
            self.check_visual_length(sample.id, self.headers(sample))
            try:
                images = [load_image(path, max_pixels=self.config.max_image_pixels) for path in sample.images]
            except DataProblem as problem:
                raise problem.for_sample(sample.id) from None
            return self.prompt_for(sample.id, sample.turns, images, sample.videos)

    def prompt_for(self, sample_id: str, turns: Sequence[Turn], images: Sequence[Any],
                   videos: Sequence[Any] = (), *, tools: Sequence[dict] | None = None) -> EncodedSample:
        """A generation prompt from turns, decoded RGB images and videos (files or frame lists, loaded here): the
        `Processor`'s entry, shared with datasets; `tools`: the function schemas the template lists (its `tools`)."""
        turns = tuple(turns)
        if turns and turns[-1].role == "assistant":
            if IMAGE in turns[-1].text or VIDEO in turns[-1].text:
                raise DataProblem("placeholder_mismatch", f"the last assistant turn holds {IMAGE} or {VIDEO}, so it "
                                  "cannot be dropped for a generation prompt. Fix: put images and videos in user "
                                  "turns", sample_id=sample_id)
            turns = turns[:-1]
        sample = self.check_placeholders(Sample(sample_id, tuple(images), turns, tuple(videos)))
        processed = self.processor(list(images))
        processed_videos = self.process_videos(sample)
        ids, _ = self.render(sample, processed.tokens_per_image, add_generation_prompt=True,
                             videos=processed_videos, tools=tools)
        self.check_span_tokens(sample, ids, processed.tokens_per_image, processed_videos)
        if len(ids) > self.config.max_length:
            raise DataProblem("too_long", f"prompt of {len(ids)} tokens > max_length {self.config.max_length}",
                              sample_id=sample_id, fatal=self.config.truncation == "raise")
        return self.encoded(sample_id, ids, [IGNORE] * len(ids), processed, processed_videos)

    def render(self, sample: Sample, tokens_per_image: Sequence[int], *, add_generation_prompt: bool = False,
               videos: Any = None, tools: Sequence[dict] | None = None) -> tuple[list[int], list[int]]:
        """Token ids and labels of `sample` under the chat template, image and video spans expanded (`videos`: the
        sample's `ProcessedVideos`; see the module docstring for their text)."""
        turns = sample.turns
        if videos is not None:
            texts = iter(self.video_text(videos))
            turns = tuple(dataclasses.replace(t, text=_replace_each(t.text, VIDEO, texts)) for t in turns)
        try:
            ids, labels = self.template.encode(turns, self.tokenizer, image_token_id=self.image_token_id,
                                               image_span=self.image_span, image_text=self.image_text,
                                               tokens_per_image=tokens_per_image,
                                               add_generation_prompt=add_generation_prompt,
                                               **self.config.template_kwargs, **({"tools": list(tools)} if tools
                                                                                 else {}))
            if videos is None:
                return ids, labels
            per_frame = [n for n, t in zip(videos.tokens_per_frame, videos.frames, strict=True) for _ in range(t)]
            return expand_images(ids, labels, self.video_token_id, per_frame, self.template.name, kind="video frame")
        except TemplateRenderError as e:
            raise DataProblem("template_error", f"{str(e).rstrip('.')}. Fix: give the conversation the shape the "
                              "template takes (a user turn before each answer, images and videos in user turns), or "
                              "drop the sample", sample_id=sample.id) from None
        except ChatTemplateError as e:
            raise DataProblem("placeholder_mismatch", f"{e}: the text holds an image or video token (or a bracket "
                              f"token) literally, or the template dropped a placeholder. Fix: write images as {IMAGE} "
                              f"and videos as {VIDEO} only, in user turns", sample_id=sample.id) from None

    def check_template(self, own: str | None) -> None:
        """At start: the template places images (when the model takes them), and a built-in in use where the
        tokenizer has its own template renders a probe conversation to the same ids (`ChatTemplateMismatch`)."""
        if self.image_token_id is not None:
            probe = Sample("template probe", ("probe.png",), PROBE_TURNS)
            try:
                self.template.encode(probe.turns, self.tokenizer, image_token_id=self.image_token_id,
                                     image_span=self.image_span, image_text=self.image_text, tokens_per_image=[1],
                                     **self.config.template_kwargs)
            except ChatTemplateError as e:
                raise ChatTemplateError(
                    f"chat template {self.template.name!r} cannot take images: {e} (an image part rendered to no image "
                    f"placeholder). Fix: a template that places images (chat_template: "
                    f"{', '.join(n for n in TEMPLATES.names() if n != 'llava_hf')}, or the model's own tokenizer's)"
                ) from None
        if own is None or (isinstance(self.template, JinjaTemplate) and self.template.source is None
                           and self.template.file is None):
            return
        check_against_own(self, own)

    def image_span(self, num_tokens: int) -> list[int]:
        span = [self.image_token_id] * num_tokens
        return [self.brackets[0], *span, self.brackets[1]] if self.brackets else span

    def check_placeholders(self, sample: Sample) -> Sample:
        images, placeholders = len(sample.images), sample.num_placeholders
        if images and not placeholders:
            if not self.config.insert_missing_placeholder:
                raise DataProblem("image_without_placeholder", f"{images} image(s) but no {IMAGE} in the text. Fix: "
                                  f"put {IMAGE} where each image belongs, or opt in to insert_missing_placeholder=True "
                                  "(--insert-missing-placeholder) to put them before the first user text",
                                  sample_id=sample.id)
            return insert_placeholders(sample)
        if placeholders != images:
            raise DataProblem("placeholder_mismatch", f"{placeholders} {IMAGE} placeholder(s) for {images} image(s). "
                              f"Fix: one {IMAGE} per image, in image order", sample_id=sample.id)
        videos, placeholders = len(sample.videos), sample.num_video_placeholders
        if videos and not placeholders:
            raise DataProblem("video_without_placeholder", f"{videos} video(s) but no {VIDEO} in the text. Fix: put "
                              f"{VIDEO} where each video belongs (or a {{'type': 'video'}} part)", sample_id=sample.id)
        if placeholders != videos:
            raise DataProblem("placeholder_mismatch", f"{placeholders} {VIDEO} placeholder(s) for {videos} video(s). "
                              f"Fix: one {VIDEO} per video, in video order", sample_id=sample.id)
        return sample

    def check_span_tokens(self, sample: Sample, ids: list[int], tokens_per_image: Sequence[int],
                          videos: Any = None) -> None:
        """The rendered ids hold exactly the image (and video) tokens the images (videos) need (text may spell the
        tokens literally), and one bracket pair per image and per video frame."""
        frames = sum(videos.frames) if videos is not None else 0
        if self.video_token_id is not None:
            found = sum(1 for t in ids if t == self.video_token_id)
            needed = sum(videos.tokens_per_video) if videos is not None else 0
            if found != needed:
                token = self.tokenizer.convert_ids_to_tokens(self.video_token_id)
                raise DataProblem("placeholder_mismatch", f"the rendered text holds {found} video tokens but the "
                                  f"videos need {needed}: the text contains {token!r} literally. Fix: write videos "
                                  f"as {VIDEO} only", sample_id=sample.id)
        found = sum(1 for t in ids if t == self.image_token_id)
        if found != sum(tokens_per_image):
            token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
            raise DataProblem("placeholder_mismatch", f"the rendered text holds {found} image tokens but the images "
                              f"need {sum(tokens_per_image)}: the text contains {token!r} (or a bracket token) "
                              f"literally. Fix: write images as {IMAGE} only", sample_id=sample.id)
        if self.brackets and sum(1 for t in ids if t in self.brackets) != 2 * (len(tokens_per_image) + frames):
            raise DataProblem("placeholder_mismatch", "the text contains vision start/end tokens literally. Fix: "
                              f"write images as {IMAGE} only", sample_id=sample.id)

    def fit(self, sample_id: str, ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
        """Apply `max_length` and the truncation policy; never cut an image span."""
        limit, policy = self.config.max_length, self.config.truncation
        if not any(label != IGNORE for label in labels[1:]):
            raise DataProblem("no_supervised_tokens", "no assistant tokens to learn from. Fix: add an assistant turn",
                              sample_id=sample_id)
        if len(ids) <= limit:
            return ids, labels
        detail = f"{len(ids)} tokens > max_length {limit}"
        if policy == "text":
            image_ids = self.span_ids
            last_image_end = max((k + 1 for k, t in enumerate(ids) if t in image_ids), default=0)
            if last_image_end > limit:
                detail += f"; an image or video span ends at token {last_image_end}, so cutting would split it"
            elif not any(label != IGNORE for label in labels[1:limit]):
                detail += "; cutting the text would leave no supervised token"
            else:
                return ids[:limit], labels[:limit]
        fix = "" if policy == "text" else ". Fix: raise max_length, shorten the sample, or use truncation='text'"
        raise DataProblem("too_long", detail + fix, sample_id=sample_id, fatal=policy == "raise")

    def estimated_length(self, record: Any, index: int) -> int:
        """Token count from the text and the image and video headers only (no decoding): for length-grouped
        batching; 1 for a sample that has a problem."""
        try:
            with per_sample(record_id(record, index)):
                sample = self.check_placeholders(self.parse(record, index))
                headers = self.headers(sample)
                video_tokens = sum(v.tokens + v.patches * (TIMESTAMP_TOKENS + 2) for v in headers.videos)
                length = len(self.render(sample, headers.tokens_per_image)[0]) + video_tokens
                return min(length, self.config.max_length)
        except DataProblem:
            return 1


@dataclass(frozen=True)
class VideoPlan:
    """One video as its header says it will be: the header, whether it is a frame list, the frames kept, their
    decoded bytes, its visual tokens and temporal patches."""

    header: VideoHeader
    frame_list: bool
    frames: int
    bytes: int
    tokens: int
    patches: int


@dataclass(frozen=True)
class SampleHeaders:
    """A sample's headers: per image (width, height) and its visual tokens; per video its `VideoPlan`."""

    image_sizes: list[tuple[int, int]]
    tokens_per_image: list[int]
    videos: list[VideoPlan]

    def visual_tokens(self, *, bracketed: bool) -> int:
        """The image and video tokens, with a start / end bracket pair per image and per temporal patch."""
        spans = len(self.tokens_per_image) + sum(v.patches for v in self.videos)
        return sum(self.tokens_per_image) + sum(v.tokens for v in self.videos) + (2 * spans if bracketed else 0)


# "<12.5 seconds>" is about 6 tokens for Qwen's tokenizer; only lengths for batching are estimated with it.
TIMESTAMP_TOKENS = 6
PROBE_TURNS = (Turn("user", f"{IMAGE}\nWhat is in the picture?"), Turn("assistant", "A red square."),
               Turn("user", "And its colour?"), Turn("assistant", "Red."))


class ChatTemplateMismatch(ChatTemplateError):
    """A built-in template renders the tokenizer's own differently: the model would train on another format than
    the one it was trained or will be served with."""


def tokenizer_template(tokenizer: Any) -> str | None:
    own = getattr(tokenizer, "chat_template", None)
    return own if isinstance(own, str) and own else None


def check_against_own(encoder: SampleEncoder, own: str) -> None:
    """Render `PROBE_TURNS` with the built-in in use and with the tokenizer's own template; differing ids are a
    `ChatTemplateMismatch` (or, with `chat_template_mismatch: warn`, one logged warning)."""
    theirs = JinjaTemplate(name="tokenizer", description="the tokenizer's own", source=own)
    texts = [t.text.replace(f"{IMAGE}\n", "") for t in PROBE_TURNS]  # text-only: templates without images compare too
    turns = [Turn(t.role, text) for t, text in zip(PROBE_TURNS, texts, strict=True)]
    kwargs = dict(image_token_id=encoder.image_token_id, image_span=encoder.image_span,
                  image_text=encoder.image_text, tokens_per_image=[], **encoder.config.template_kwargs)
    ours = encoder.template.encode(turns, encoder.tokenizer, **kwargs)[0]
    expected = theirs.encode(turns, encoder.tokenizer, **kwargs)[0]
    if ours == expected:
        return
    k = next((i for i, (a, b) in enumerate(zip(ours, expected, strict=False)) if a != b), min(len(ours), len(expected)))
    decode = encoder.tokenizer.decode

    def context(ids: list[int]) -> str:
        return f"{decode(ids[max(0, k - 8):k])!r} >>> {decode(ids[k:k + 8])!r}"

    message = (f"chat template {encoder.template.name!r} renders a conversation differently from the tokenizer's own "
               f"chat_template: first difference at token {k}: built-in {context(ours)}; tokenizer's "
               f"{context(expected)}"
               ". The model would train on a prompt format it was not trained or served with. Fix: chat_template: "
               "auto (the tokenizer's own), or accept it knowingly with chat_template_mismatch: warn")
    if encoder.config.chat_template_mismatch == "warn":
        log.warning("%s (accepted: chat_template_mismatch: warn)", message)
        return
    raise ChatTemplateMismatch(message)


def _replace_each(text: str, marker: str, replacements: Any) -> str:
    """`text` with each occurrence of `marker` replaced by the next item of `replacements`, in order."""
    pieces = text.split(marker)
    return pieces[0] + "".join(next(replacements) + piece for piece in pieces[1:])


def check_answers(sample: Sample) -> None:
    for k, turn in enumerate(sample.turns):
        if turn.role == "assistant" and not turn.text.strip() and not turn.calls:
            raise DataProblem("empty_answer", f"assistant turn {k} is empty. Fix: remove the turn or give the answer",
                              sample_id=sample.id)


def insert_placeholders(sample: Sample) -> Sample:
    """`<image>\\n` per image before the first user turn's text (the LLaVA convention), when the user opts in."""
    turns = list(sample.turns)
    first = next((k for k, t in enumerate(turns) if t.role == "user"), None)
    if first is None:
        raise DataProblem("image_without_placeholder", "no user turn to put the images in", sample_id=sample.id)
    turns[first] = Turn("user", f"{IMAGE}\n" * len(sample.images) + turns[first].text)
    return Sample(sample.id, sample.images, tuple(turns))


class VLMDataset(torch.utils.data.Dataset):
    """Map-style: `dataset[i]` is an `EncodedSample`, or the `DataProblem` that stops it (fatal ones raise)."""

    def __init__(self, records: Sequence[Any] | str | os.PathLike, encoder: SampleEncoder) -> None:
        self.records = (read_records(records, errors="report", columns=encoder.config.columns, config=encoder.config)
                        if isinstance(records, (str, os.PathLike))
                        else records if isinstance(records, Sequence) else list(records))
        self.encoder = encoder

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> EncodedSample | DataProblem:
        """The encoded sample, or its `DataProblem` (any exception while encoding it becomes one, its type and
        message kept in the detail; fatal problems, Ctrl-C and exit raise)."""
        record = read_guarded(self.records, index)  # a row that cannot be read is its problem, as a bad sample is
        return guarded(lambda: self.encoder.encode(record, index), lambda: record_id(record, index))

    def lengths(self) -> list[int]:
        return [self.encoder.estimated_length(r, i) for i, r in enumerate(self.records)]


def length_grouped_sampler(dataset: VLMDataset, batch_size: int, seed: int = 0) -> Any:
    """transformers' `LengthGroupedSampler`: random mega-batches, sorted by length inside (less padding)."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    generator = torch.Generator().manual_seed(seed)
    return LengthGroupedSampler(batch_size, lengths=dataset.lengths(), generator=generator)
