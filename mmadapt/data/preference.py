"""Preference pairs: one prompt (messages, images, videos) and two answers, `chosen` and `rejected`.

Three record formats are read, as their tools write them:

- trl: `{"prompt": str | messages, "chosen": str | messages, "rejected": str | messages, "images": [paths]}`
  (a string prompt is one user turn; a string answer is one assistant turn; `{"type": "image"}` parts or `<image>`
  mark the images, in order);
- LLaMA-Factory (sharegpt): `{"conversations": [...prompt turns...], "chosen": {"from": "gpt", "value": ...},
  "rejected": {...}, "images": [paths]}` (`messages` with `role` / `content` turns are read too);
- ms-swift: `{"messages": [...prompt turns..., {"role": "assistant", "content": CHOSEN}], "rejected_response":
  REJECTED, "images": [paths], "rejected_images": [paths]}`; with `rejected_images` the rejected answer is read with
  its own images (e.g. a corrupted picture), and `rejected_response` may be left out (the chosen text, then).

Each becomes `PreferenceSample(id, prompt: Sample, chosen, rejected, rejected_images)`. `PairEncoder` encodes it once:
the prompt's images are read and preprocessed once and shared by both rows (`EncodedPair.shared`), and both rows
render the same prompt tokens, with the image spans at the same places (checked). A pair is never cut: one over
`max_length` is a counted `too_long` problem whatever `truncation` says (cutting one answer changes what is
preferred; cutting an image span breaks the contract), or a fatal one with `truncation: raise`.

`PairCollator` lays a batch out as trl does: the B chosen rows, then the B rejected rows (row i and row B + i are a
pair), padded; the images once per pair (`pixel_values` holds each pair's prompt images once, and the rejected
images of pairs that have their own), with `image_index` (one entry per image of the rows, in row order) saying which
encoded image each row's image is, so the vision side runs once per picture and both rows receive the same visual
tokens (`VisionLanguageModel.prepare`). Videos are laid out per row.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mmadapt.data.collate import Collator
from mmadapt.data.pipeline import SampleEncoder, check_answers
from mmadapt.data.problems import DataProblem, per_sample, problem_of, read_guarded
from mmadapt.data.samples import (
    IMAGE,
    VIDEO,
    EncodedSample,
    OverSampleEncoder,
    Sample,
    Turn,
    parse_record,
    read_records,
    record_id,
    resolve_image_path,
)
from mmadapt.data.templates import IGNORE

FORMATS = ("trl (prompt / chosen / rejected)", "LLaMA-Factory (conversations + chosen / rejected)",
           "ms-swift (messages + rejected_response)")


@dataclass(frozen=True)
class PreferenceSample:
    """A prompt (its turns end with a user turn) and two answers; `rejected_images` (resolved paths) when the
    rejected answer is read with other images than the prompt's, else None (both rows share the prompt's)."""

    id: str
    prompt: Sample
    chosen: str
    rejected: str
    rejected_images: tuple[str, ...] | None = None

    def rows(self) -> tuple[Sample, Sample]:
        """The two conversations: the prompt + the chosen answer, the prompt (with `rejected_images`) + the rejected."""
        p = self.prompt
        chosen = Sample(p.id, p.images, (*p.turns, Turn("assistant", self.chosen)), p.videos)
        images = p.images if self.rejected_images is None else self.rejected_images
        return chosen, Sample(p.id, images, (*p.turns, Turn("assistant", self.rejected)), p.videos)


def is_preference_record(record: Any) -> bool:
    """Whether a record is a preference pair in one of the `FORMATS` (for `data check` / `data show`)."""
    return isinstance(record, dict) and ("rejected" in record or "rejected_response" in record
                                         or "rejected_images" in record)


def parse_preference(record: Any, index: int, image_root: str | os.PathLike | None = None,
                     allow_outside_root: bool = False, *, max_images: int | None = None,
                     max_frames: int | None = None) -> PreferenceSample:
    """A preference record in one of the `FORMATS` as a `PreferenceSample`; `DataProblem("bad_format")` if it is not
    (and the problems `parse_record` raises for its prompt)."""
    if isinstance(record, DataProblem):
        raise record
    sample_id = record_id(record, index)
    if not isinstance(record, dict):
        raise DataProblem("bad_format", f"expected a JSON object, got {type(record).__name__}", sample_id=sample_id)
    if not is_preference_record(record):
        raise DataProblem("bad_format", f"not a preference pair: no 'rejected' or 'rejected_response' field. Give "
                          f"one of: {'; '.join(FORMATS)}", sample_id=sample_id)
    base = {k: v for k, v in record.items() if k not in ("prompt", "chosen", "rejected", "rejected_response",
                                                          "rejected_images")}
    if "prompt" in record:  # trl
        turns = _turns(record["prompt"], "user", "prompt", sample_id)
        chosen = _answer(record.get("chosen"), "chosen", sample_id)
        rejected = _answer(record.get("rejected"), "rejected", sample_id)
        base["messages"] = turns
        base.setdefault("images", record.get("images", []))
    elif "rejected_response" in record or ("rejected_images" in record and "chosen" not in record):  # ms-swift
        messages = record.get("messages", record.get("conversations"))
        if not isinstance(messages, list) or not messages:
            raise DataProblem("bad_format", "an ms-swift preference record needs 'messages' ending with the chosen "
                              "assistant answer", sample_id=sample_id)
        last = _message(messages[-1], len(messages) - 1, sample_id)
        if last["role"] != "assistant":
            raise DataProblem("bad_format", "'messages' must end with the chosen assistant answer (ms-swift's "
                              "format: the rejected one is 'rejected_response')", sample_id=sample_id)
        chosen = _text(last["content"], "the chosen answer", sample_id)
        rejected = (chosen if record.get("rejected_response") is None and "rejected_images" in record
                    else _answer(record.get("rejected_response"), "rejected_response", sample_id))
        key = "messages" if "messages" in record else "conversations"
        base[key] = messages[:-1]
    else:  # LLaMA-Factory
        chosen = _answer(record.get("chosen"), "chosen", sample_id)
        rejected = _answer(record.get("rejected"), "rejected", sample_id)
    if "conversations" in base and "images" in base and "image" not in base:  # LLaMA-Factory's sharegpt: "images"
        base["image"] = base.pop("images")
    if not any(k in base for k in ("messages", "conversations")):
        raise DataProblem("bad_format", "no prompt: give 'prompt' (trl), 'conversations' (LLaMA-Factory) or "
                          "'messages' (ms-swift)", sample_id=sample_id)
    prompt = parse_record(base, index, image_root, allow_outside_root, max_images=max_images, max_frames=max_frames)
    if not prompt.turns or prompt.turns[-1].role != "user":
        raise DataProblem("bad_format", "the prompt must end with a user turn (the answers follow it)",
                          sample_id=sample_id)
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        if IMAGE in text or VIDEO in text:
            raise DataProblem("bad_format", f"the {name} answer holds {IMAGE} or {VIDEO}: images and videos belong to "
                              "the prompt", sample_id=sample_id)
    rejected_images = None
    if record.get("rejected_images") is not None:
        listed = record["rejected_images"]
        listed = [listed] if isinstance(listed, str) else listed
        if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
            raise DataProblem("bad_format", "rejected_images must be a path or a list of paths", sample_id=sample_id)
        if max_images is not None and len(listed) > max_images:
            raise DataProblem("sample_too_large", f"{len(listed)} rejected images > max_images {max_images}",
                              sample_id=sample_id)
        if len(listed) != len(prompt.images):
            raise DataProblem("bad_pair", f"{len(listed)} rejected_images for {len(prompt.images)} images: the "
                              "rejected answer's images replace the prompt's one for one", sample_id=sample_id)
        resolved = tuple(resolve_image_path(p, image_root, allow_outside_root, sample_id) for p in listed)
        rejected_images = None if resolved == prompt.images else resolved
    if chosen == rejected and rejected_images is None:
        raise DataProblem("bad_pair", "the chosen and rejected answers are the same text with the same images: "
                          "nothing to prefer", sample_id=sample_id)
    return PreferenceSample(sample_id, prompt, chosen, rejected, rejected_images)


def _message(message: Any, k: int, sample_id: str) -> dict[str, Any]:
    """{"role", "content"} of a messages or sharegpt turn."""
    if isinstance(message, dict) and "from" in message:
        return {"role": {"human": "user", "gpt": "assistant"}.get(message["from"], message["from"]),
                "content": message.get("value")}
    if isinstance(message, dict) and "role" in message:
        return {"role": message["role"], "content": message.get("content")}
    raise DataProblem("bad_format", f"turn {k} needs 'role' / 'content' (or sharegpt's 'from' / 'value')",
                      sample_id=sample_id)


def _text(content: Any, what: str, sample_id: str) -> str:
    """The text of an answer's content: a string, or text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise DataProblem("bad_format", f"{what} must be text (a string or text parts), got {str(content)[:120]!r}",
                      sample_id=sample_id)


def _answer(value: Any, field: str, sample_id: str) -> str:
    """An answer: a string, one assistant turn (messages or sharegpt), or a list holding one."""
    if value is None:
        raise DataProblem("bad_pair", f"no {field!r} answer", sample_id=sample_id)
    if isinstance(value, list):
        if len(value) != 1:
            raise DataProblem("bad_format", f"{field!r} must be one assistant turn, got {len(value)} turns",
                              sample_id=sample_id)
        value = value[0]
    if isinstance(value, dict):
        message = _message(value, 0, sample_id)
        if message["role"] != "assistant":
            raise DataProblem("bad_format", f"{field!r} must be an assistant turn, got role {message['role']!r}",
                              sample_id=sample_id)
        value = message["content"]
    text = _text(value, f"{field!r}", sample_id)
    if not text.strip():
        raise DataProblem("empty_answer", f"the {field!r} answer is empty", sample_id=sample_id)
    return text


def _turns(prompt: Any, role: str, field: str, sample_id: str) -> list[dict[str, Any]]:
    """trl's prompt: a string (one `role` turn) or a list of messages."""
    if isinstance(prompt, str):
        return [{"role": role, "content": prompt}]
    if isinstance(prompt, list) and prompt:
        return [_message(m, k, sample_id) for k, m in enumerate(prompt)]
    raise DataProblem("bad_format", f"{field!r} must be a string or a non-empty list of messages", sample_id=sample_id)


@dataclass
class EncodedPair:
    """A pair ready to collate: the chosen and rejected rows. `shared`: the rejected row reads the chosen row's
    images (its `pixel_values` is None; its spans are the same); otherwise it carries its own."""

    id: str
    chosen: EncodedSample
    rejected: EncodedSample
    shared: bool
    index: int = -1  # the record's index in its dataset (the precomputed reference's key)

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


class PairEncoder(OverSampleEncoder):
    """Turns preference records into `EncodedPair`s, with a `SampleEncoder`'s model, tokenizer and settings."""

    def __init__(self, encoder: SampleEncoder) -> None:
        self.encoder = encoder

    def parse(self, record: Any, index: int) -> PreferenceSample:
        return self.parse_with(parse_preference, record, index)

    def render(self, pair: PreferenceSample) -> tuple[tuple[Sample, Sample], list[tuple[list[int], list[int]]],
                                                      list[Any]]:
        """Both rows checked and rendered from the image headers (nothing decoded): (rows, [(ids, labels)] x 2,
        [headers] x 2); a pair over `max_length` is a `too_long` problem (never cut)."""
        e = self.encoder
        rows = tuple(e.check_placeholders(row) for row in pair.rows())
        for row in rows:
            check_answers(row)
        headers = [e.headers(rows[0])]
        headers.append(headers[0] if pair.rejected_images is None else e.headers(rows[1]))
        rendered = []
        for row, header in zip(rows, headers, strict=True):
            expected = e.expected_videos(header)
            ids, labels = e.render(row, header.tokens_per_image, videos=expected)
            e.check_span_tokens(row, ids, header.tokens_per_image, expected)
            rendered.append(self.fit(pair.id, ids, labels))
        self.check_rows(pair, rendered)
        return rows, rendered, headers

    def fit(self, sample_id: str, ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
        """A row within `max_length`, never cut: `too_long` (fatal with `truncation: raise`) when it is not."""
        if not any(label != IGNORE for label in labels[1:]):
            raise DataProblem("no_supervised_tokens", "an answer renders to no supervised token. Fix: check the "
                              "chat template's assistant turns", sample_id=sample_id)
        limit = self.config.max_length
        if len(ids) > limit:
            raise DataProblem("too_long", f"a row of {len(ids)} tokens > max_length {limit}: preference pairs are "
                              "never cut (a cut answer changes what is preferred, a cut image span breaks the "
                              "contract). Fix: raise max_length or shorten the pair", sample_id=sample_id,
                              fatal=self.config.truncation == "raise")
        return ids, labels

    def check_rows(self, pair: PreferenceSample, rendered: list[tuple[list[int], list[int]]]) -> None:
        """Both rows carry the prompt's tokens up to the first answer token, with the image (and video) spans at the
        same places (when the images are shared: the same tokens, not merely the same count)."""
        (chosen, chosen_labels), (rejected, rejected_labels) = rendered
        first = [next(k for k, label in enumerate(labels) if label != IGNORE)
                 for labels in (chosen_labels, rejected_labels)]
        spans = self.encoder.span_ids
        for k, row in enumerate((chosen, rejected)):
            late = [j for j, t in enumerate(row) if t in spans and j >= first[k]]
            if late:
                raise DataProblem("bad_pair", f"the {('chosen', 'rejected')[k]} row has an image or video token at "
                                  f"{late[0]}, inside its answer: images and videos belong to the prompt",
                                  sample_id=pair.id)
        if pair.rejected_images is None and chosen[: min(first)] != rejected[: min(first)]:
            at = next(j for j, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b)
            raise DataProblem("bad_pair", f"the chosen and rejected rows render different prompts (first difference "
                              f"at token {at}): the template's rendering of the prompt depends on the answer. Both "
                              "answers must follow the same prompt", sample_id=pair.id)

    def encode(self, record: Any, index: int) -> EncodedPair:
        """One record -> `EncodedPair` (the prompt's images decoded and preprocessed once); raises `DataProblem`."""
        e = self.encoder
        with per_sample(record_id(record, index)):
            pair = self.parse(record, index)
            rows, rendered, headers = self.render(pair)
            processed = e.load_images(rows[0], headers[0])
            videos = e.process_videos(rows[0])
            if videos is not None:  # videos render from what they decode to (the same ids as from the headers)
                rendered = []
                for row in rows:
                    ids, labels = e.render(row, processed.tokens_per_image, videos=videos)
                    e.check_span_tokens(row, ids, processed.tokens_per_image, videos)
                    rendered.append(self.fit(pair.id, ids, labels))
                self.check_rows(pair, rendered)
            chosen = e.encoded(pair.id, *rendered[0], processed, videos)
            if pair.rejected_images is None:
                rejected = e.encoded(pair.id, *rendered[1], processed, videos)
                rejected = replace(rejected, pixel_values=None, image_grid_thw=None)
                return EncodedPair(pair.id, chosen, rejected, shared=True)
            own = e.load_images(rows[1], headers[1])
            return EncodedPair(pair.id, chosen, e.encoded(pair.id, *rendered[1], own, videos), shared=False)

    def estimated_length(self, record: Any, index: int) -> int:
        try:
            with per_sample(record_id(record, index)):
                return sum(len(ids) for ids, _ in self.render(self.parse(record, index))[1])
        except DataProblem:
            return 1


class PreferenceDataset(torch.utils.data.Dataset):
    """Map-style: `dataset[i]` is an `EncodedPair`, or the `DataProblem` that stops it (fatal ones raise)."""

    def __init__(self, records: Sequence[Any] | str | os.PathLike, encoder: PairEncoder | SampleEncoder) -> None:
        config = (encoder.encoder if isinstance(encoder, PairEncoder) else encoder).config
        self.records = (read_records(records, errors="report", columns=config.columns, config=config)
                        if isinstance(records, (str, os.PathLike))
                        else records if isinstance(records, Sequence) else list(records))
        self.encoder = encoder if isinstance(encoder, PairEncoder) else PairEncoder(encoder)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> EncodedPair | DataProblem:
        record = read_guarded(self.records, index)
        try:
            pair = self.encoder.encode(record, index)
            pair.index = index
            return pair
        except DataProblem as problem:
            if problem.fatal:
                raise
            return problem
        except Exception as e:
            return problem_of(e, record_id(record, index))

    def ids(self) -> list[str]:
        return [record_id(r, i) for i, r in enumerate(self.records)]


@dataclass(frozen=True, kw_only=True)
class PairCollator:
    """Pairs -> one padded batch of 2B rows (chosen rows, then rejected rows), each pair's prompt images once.

    Adds to `Collator`'s keys: `image_index` (one per image of the rows, in row order: the index of its pixels among
    the encoded images; present when the batch has images), `pairs` (B), `meta["pair_ids"]` and `meta["pair_index"]`
    (the pairs' ids and dataset indices; `meta["sample_ids"]` holds one entry per pair, so the bad-sample budget
    counts pairs). Problems are dropped and reported in `meta["problems"]`, as by `Collator`."""

    base: Collator

    @classmethod
    def for_model(cls, model: Any, pad_token_id: int, **kw: Any) -> PairCollator:
        return cls(base=Collator.for_model(model, pad_token_id, **kw))

    @property
    def pad_token_id(self) -> int:
        return self.base.pad_token_id

    def __call__(self, items: Sequence[EncodedPair | DataProblem]) -> dict[str, Any]:
        if self.base.packing:
            raise ValueError("preference pairs are padded, not packed: set data.packing: false")
        pairs = [p for p in items if isinstance(p, EncodedPair)]
        problems = [p.to_dict() for p in items if isinstance(p, DataProblem)]
        rows = [[p.chosen] for p in pairs] + [[p.rejected] for p in pairs]
        batch = self.base.rows_to_batch(rows) if pairs else self.base.rows_to_batch([])
        batch.pop("pixel_values", None)
        batch.pop("image_grid_thw", None)
        encoded = [p.chosen for p in pairs] + [p.rejected for p in pairs if not p.shared]
        index: list[int] = []
        start = {}
        at = 0
        for sample in encoded:
            start[id(sample)] = at
            at += sample.num_images
        for p in pairs:
            index.extend(range(start[id(p.chosen)], start[id(p.chosen)] + p.chosen.num_images))
        for p in pairs:
            own = p.chosen if p.shared else p.rejected
            index.extend(range(start[id(own)], start[id(own)] + own.num_images))
        if index:
            with_images = [s for s in encoded if s.num_images]
            batch["pixel_values"] = torch.cat([s.pixel_values for s in with_images])
            if all(s.image_grid_thw is not None for s in with_images):
                batch["image_grid_thw"] = torch.cat([s.image_grid_thw for s in with_images])
            batch["image_index"] = torch.tensor(index, dtype=torch.long)
        batch["pairs"] = len(pairs)
        batch["meta"] = {"sample_ids": [[p.id] for p in pairs], "pair_ids": [p.id for p in pairs],
                         "pair_index": [p.index for p in pairs], "shared": [p.shared for p in pairs],
                         "problems": problems}
        return batch
