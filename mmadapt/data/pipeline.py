"""From a record to an `EncodedSample`: parse, check, load images, preprocess, render, truncate.

`SampleEncoder.for_model(model, tokenizer, ...)` wires the model's processor (encoder side),
chat template and span tokens (backbone side) to a tokenizer. `encode(record, index)` returns
an `EncodedSample` or raises `DataProblem` with a reason from `REASONS`:

- images without any placeholder -> `image_without_placeholder` (or, with
  `insert_missing_placeholder=True`, "<image>\\n" per image is put before the first user text);
  placeholders != images -> `placeholder_mismatch`;
- an empty assistant turn -> `empty_answer`; no supervised token at all -> `no_supervised_tokens`;
- longer than `max_length` -> by `truncation`: "drop" (default: a counted `too_long` problem),
  "raise" (a fatal `too_long` that stops a run), or "text" (cut text after the last image span,
  keeping >= 1 supervised token; otherwise `too_long`). An image span is never cut.

`VLMDataset` is the map-style dataset (safe with `DataLoader` workers): a bad sample comes back
as its `DataProblem`, which the collator drops and reports in the batch, so a run never crashes
on one. `length_grouped_sampler` batches samples of similar length together.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mmadapt.data.images import DEFAULT_MAX_PIXELS, image_size, load_image
from mmadapt.data.problems import DataProblem
from mmadapt.data.samples import IMAGE, EncodedSample, Sample, Turn, parse_record, read_records
from mmadapt.data.templates import IGNORE, TEMPLATES, ChatTemplate, render
from mmadapt.data.tokenizer import prepare_tokenizer

Truncation = Literal["drop", "raise", "text"]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    image_root: str | None = None
    allow_outside_root: bool = False
    max_length: int = 2048
    truncation: Truncation = "drop"
    insert_missing_placeholder: bool = False
    max_image_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if self.truncation not in ("drop", "raise", "text"):
            raise ValueError(f"truncation must be 'drop', 'raise' or 'text', got {self.truncation!r}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")


class SampleEncoder:
    """Turns records into `EncodedSample`s for one model + tokenizer."""

    def __init__(self, *, tokenizer: Any, template: ChatTemplate, processor: Any, image_token_id: int,
                 vision_start_token_id: int | None = None, vision_end_token_id: int | None = None,
                 config: DataConfig | None = None) -> None:
        self.tokenizer, self.template, self.processor = tokenizer, template, processor
        self.image_token_id = image_token_id
        self.brackets = (vision_start_token_id, vision_end_token_id) if vision_start_token_id is not None else None
        self.config = config or DataConfig()
        vocab = tokenizer.get_vocab()
        missing = [t for t in template.specials(tokenizer) if t not in vocab]
        if missing:
            raise ValueError(f"tokenizer lacks the special tokens {missing} that template {template.name!r} needs. "
                             "Fix: call mmadapt.data.prepare_tokenizer(model, tokenizer) first.")

    @classmethod
    def for_model(cls, model: Any, tokenizer: Any, processor: Any = None, **config: Any) -> SampleEncoder:
        """The encoder for `model`; adds missing special tokens to `tokenizer` (see `prepare_tokenizer`)."""
        from mmadapt.data.processors import processor_for

        prepare_tokenizer(model, tokenizer)  # idempotent: adds what is missing, aligns ids and embeddings
        return cls(tokenizer=tokenizer, template=TEMPLATES.get(model.backbone_spec.chat_template),
                   processor=processor or processor_for(model), image_token_id=model.tokens.image_token_id,
                   vision_start_token_id=model.tokens.vision_start_token_id,
                   vision_end_token_id=model.tokens.vision_end_token_id, config=DataConfig(**config))

    @property
    def span_ids(self) -> set[int]:
        return {self.image_token_id, *(self.brackets or ())}

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad (else EOS) id; never an image-span id, which the contract would see as an image."""
        tok = self.tokenizer
        candidates = (tok.pad_token_id, tok.eos_token_id, *range(len(tok)))
        return next(i for i in candidates if i is not None and i not in self.span_ids)

    def parse(self, record: Any, index: int) -> Sample:
        return parse_record(record, index, self.config.image_root, self.config.allow_outside_root)

    def encode(self, record: Any, index: int) -> EncodedSample:
        """One record -> `EncodedSample`; raises `DataProblem` (with the sample id) when it cannot."""
        sample = self.check_placeholders(self.parse(record, index))
        check_answers(sample)
        try:
            images = [load_image(path, max_pixels=self.config.max_image_pixels) for path in sample.images]
        except DataProblem as problem:
            raise problem.for_sample(sample.id) from None
        processed = self.processor(images)
        pieces = self.template.pieces(sample.turns, self.tokenizer)
        ids, labels = render(pieces, self.tokenizer, self.image_span, processed.tokens_per_image)
        self.check_span_tokens(sample, ids, processed.tokens_per_image)
        ids, labels = self.fit(sample.id, ids, labels)
        return EncodedSample(id=sample.id, input_ids=torch.tensor(ids), labels=torch.tensor(labels),
                             pixel_values=processed.pixel_values if images else None,
                             image_grid_thw=processed.image_grid_thw if images else None,
                             tokens_per_image=list(processed.tokens_per_image))

    def encode_prompt(self, record: Any, index: int) -> EncodedSample:
        """The prompt for generation: `encode` without the last assistant turn, plus the template's generation
        prompt; labels are all -100. Raises `DataProblem` as `encode` does (`too_long` when over `max_length`)."""
        sample = self.check_placeholders(self.parse(record, index))
        try:
            images = [load_image(path, max_pixels=self.config.max_image_pixels) for path in sample.images]
        except DataProblem as problem:
            raise problem.for_sample(sample.id) from None
        return self.prompt_for(sample.id, sample.turns, images)

    def prompt_for(self, sample_id: str, turns: Sequence[Turn], images: Sequence[Any]) -> EncodedSample:
        """A generation prompt from turns and decoded RGB images (the `Processor`'s entry, shared with datasets)."""
        turns = tuple(turns)
        if turns and turns[-1].role == "assistant":
            if IMAGE in turns[-1].text:
                raise DataProblem("placeholder_mismatch", f"the last assistant turn holds {IMAGE}, so it cannot be "
                                  "dropped for a generation prompt. Fix: put images in user turns",
                                  sample_id=sample_id)
            turns = turns[:-1]
        sample = self.check_placeholders(Sample(sample_id, tuple(images), turns))
        processed = self.processor(list(images))
        pieces = self.template.pieces(sample.turns, self.tokenizer, add_generation_prompt=True)
        ids, _ = render(pieces, self.tokenizer, self.image_span, processed.tokens_per_image)
        self.check_span_tokens(sample, ids, processed.tokens_per_image)
        if len(ids) > self.config.max_length:
            raise DataProblem("too_long", f"prompt of {len(ids)} tokens > max_length {self.config.max_length}",
                              sample_id=sample_id, fatal=self.config.truncation == "raise")
        return EncodedSample(id=sample_id, input_ids=torch.tensor(ids), labels=torch.full((len(ids),), IGNORE),
                             pixel_values=processed.pixel_values if images else None,
                             image_grid_thw=processed.image_grid_thw if images else None,
                             tokens_per_image=list(processed.tokens_per_image))

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
        return sample

    def check_span_tokens(self, sample: Sample, ids: list[int], tokens_per_image: Sequence[int]) -> None:
        """The rendered ids hold exactly the image tokens the images need (text may spell the tokens literally)."""
        found = sum(1 for t in ids if t == self.image_token_id)
        if found != sum(tokens_per_image):
            token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
            raise DataProblem("placeholder_mismatch", f"the rendered text holds {found} image tokens but the images "
                              f"need {sum(tokens_per_image)}: the text contains {token!r} (or a bracket token) "
                              f"literally. Fix: write images as {IMAGE} only", sample_id=sample.id)
        if self.brackets and sum(1 for t in ids if t in self.brackets) != 2 * len(tokens_per_image):
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
            image_ids = {self.image_token_id, *(self.brackets or ())}
            last_image_end = max((k + 1 for k, t in enumerate(ids) if t in image_ids), default=0)
            if last_image_end > limit:
                detail += f"; an image span ends at token {last_image_end}, so cutting would split it"
            elif not any(label != IGNORE for label in labels[1:limit]):
                detail += "; cutting the text would leave no supervised token"
            else:
                return ids[:limit], labels[:limit]
        fix = "" if policy == "text" else ". Fix: raise max_length, shorten the sample, or use truncation='text'"
        raise DataProblem("too_long", detail + fix, sample_id=sample_id, fatal=policy == "raise")

    def estimated_length(self, record: Any, index: int) -> int:
        """Token count from the text and image headers only (no decoding): for length-grouped batching."""
        try:
            sample = self.check_placeholders(self.parse(record, index))
            tokens = [self.processor.tokens_for_size(*image_size(p)) for p in sample.images]
            pieces = self.template.pieces(sample.turns, self.tokenizer)
            return min(len(render(pieces, self.tokenizer, self.image_span, tokens)[0]), self.config.max_length)
        except DataProblem:
            return 1


def check_answers(sample: Sample) -> None:
    for k, turn in enumerate(sample.turns):
        if turn.role == "assistant" and not turn.text.strip():
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
        self.records = (read_records(records, errors="report") if isinstance(records, (str, os.PathLike))
                        else list(records))
        self.encoder = encoder

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> EncodedSample | DataProblem:
        try:
            return self.encoder.encode(self.records[index], index)
        except DataProblem as problem:
            if problem.fatal:
                raise
            return problem

    def lengths(self) -> list[int]:
        return [self.encoder.estimated_length(r, i) for i, r in enumerate(self.records)]


def length_grouped_sampler(dataset: VLMDataset, batch_size: int, seed: int = 0) -> Any:
    """transformers' `LengthGroupedSampler`: random mega-batches, sorted by length inside (less padding)."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    generator = torch.Generator().manual_seed(seed)
    return LengthGroupedSampler(batch_size, lengths=dataset.lengths(), generator=generator)
