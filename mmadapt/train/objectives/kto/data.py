"""KTO's data: unpaired records (a prompt, one completion, a desirable / undesirable label), one row each, and the
batches that add each prompt's KL row.

Records are read in trl's unpaired layout, `{"prompt": str | messages, "completion": str | messages, "label": bool,
"images": [paths]}` (or `"image": path`), with trl's conventions as `mmadapt.data.preference` reads them: a string
prompt is one user turn, a string completion one assistant turn, `<image>` or `{"type": "image"}` parts mark the
images in order. `label` must be a JSON boolean, as trl requires (`KTOTrainer` reads it as a bool tensor): anything
else ("yes", 1, null, a missing field) is a counted `bad_format` problem naming the record and the field, never
guessed. A file of preference pairs (any layout `mmadapt.data.preference` reads) is unpaired as trl's
`maybe_unpair_preference_dataset` does: each pair gives its chosen answer labelled desirable and its rejected one
labelled undesirable, in trl's order (within each block of `UNPAIR_BLOCK` pairs, the block's chosen rows, then its
rejected rows: `datasets.Dataset.map`'s default batch size), with the ids `"<pair id>/chosen"` and
`"<pair id>/rejected"` (unique when the pairs' ids are); a pair the preference reader refuses (e.g. two equal
answers) is a problem of both its rows. Whether a file holds pairs is decided by its first readable record, as trl
decides by its columns (`KtoDataset(paired=...)` says it outright).

`KtoEncoder` encodes a record once: the conversation prompt + completion under the model's chat template, labels on
the completion only, the images read and preprocessed once; a row over `max_length` is a counted `too_long` problem
(fatal with `truncation: raise`), never cut. The completion starts at the row's first labelled token
(`EncodedKto.prompt_length`): what the template renders before it is the prompt.

`KtoCollator` lays a batch of B records out as trl's KTO collators do: the B rows, then (with `kl`, as `kto` needs
and `apo_zero_unpaired` does not) the B KL rows, row i's prompt tokens followed by the completion tokens of row
`kl_partners(B, B)[i]` (trl's rotation: row i takes row i - 1's completion; a batch of one pairs its row with itself,
as trl's last short batch does; trl refuses a per-device batch of one, which `kl_partners(n, 1)` refuses too). The KL
rows are built from the batch itself, so any sampler keeps them the batch's own completions (trl precomputes them
over the dataset in order and needs sequential sampling for that); with sequential batches they are trl's. A KL row
is never cut either: it may be longer than `max_length` (at most the longest prompt plus the longest completion of
its batch), where trl cuts it. Each prompt's images are encoded once for its row and its KL row (`image_index`, as
`PairCollator` does); videos are laid out per row. The loss's per-row token counts come with the log-probs
(`SequenceLogProbs.tokens` of `forward(head=SequenceLogps())`); trl's KTO sums the log-probs and uses none.

Shapes: B records; R = 2B rows with `kl` (B without); L the padded width; I the images of the B prompts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mmadapt.data.collate import Collator
from mmadapt.data.pipeline import SampleEncoder, check_answers
from mmadapt.data.preference import PreferenceSample, _answer, _turns, is_preference_record, parse_preference
from mmadapt.data.problems import DataProblem, guarded, per_sample, read_guarded
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
)
from mmadapt.data.templates import IGNORE
from mmadapt.train.objectives.kto.loss import kl_partners

UNPAIR_BLOCK = 1000
"""trl unpairs a preference dataset with a batched `map` of `datasets`' default batch size: per block of this many
pairs, the block's chosen rows, then its rejected rows."""
KTO_KEYS = frozenset({"prompt", "completion", "label"})


@dataclass(frozen=True)
class KtoSample:
    """A prompt (its turns end with a user turn, its images and videos resolved), one completion and its label."""

    id: str
    prompt: Sample
    completion: str
    desirable: bool

    def row(self) -> Sample:
        """The conversation: the prompt's turns, then the completion as the assistant's turn."""
        p = self.prompt
        return Sample(self.id, p.images, (*p.turns, Turn("assistant", self.completion)), p.videos)

    @classmethod
    def of_pair(cls, pair: PreferenceSample, chosen: bool) -> KtoSample:
        """One side of a `PreferenceSample`: its chosen answer (desirable) or its rejected one (undesirable, with the
        rejected answer's own images when it has them); id `"<pair id>/chosen"` or `"<pair id>/rejected"`."""
        side = "chosen" if chosen else "rejected"
        row = pair.rows()[0 if chosen else 1]
        prompt = Sample(f"{pair.id}/{side}", row.images, row.turns[:-1], row.videos)
        return cls(prompt.id, prompt, row.turns[-1].text, chosen)


def is_kto_record(record: Any) -> bool:
    """Whether a record is in trl's unpaired layout (a `completion` and a `label`)."""
    return isinstance(record, dict) and "completion" in record and "label" in record


def parse_kto(record: Any, index: int, image_root: str | os.PathLike | None = None,
              allow_outside_root: bool = False, *, max_images: int | None = None,
              max_frames: int | None = None) -> KtoSample:
    """A record in trl's unpaired layout as a `KtoSample`; `DataProblem("bad_format")` naming the field when it is not
    (a label that is not a JSON boolean included), and the problems `parse_record` raises for its prompt."""
    if isinstance(record, DataProblem):
        raise record
    sample_id = record_id(record, index)
    if not isinstance(record, dict):
        raise DataProblem("bad_format", f"expected a JSON object, got {type(record).__name__}", sample_id=sample_id)
    if is_preference_record(record):
        raise DataProblem("bad_format", "a preference pair in an unpaired KTO file: give the whole file as pairs (it "
                          "is unpaired as trl does) or every record as prompt / completion / label",
                          sample_id=sample_id)
    missing = [k for k in ("prompt", "completion") if record.get(k) is None]
    if missing:
        raise DataProblem("bad_format", f"no {missing[0]!r}: a KTO record is trl's {{'prompt', 'completion', 'label', "
                          "'images'}", sample_id=sample_id)
    label = record.get("label")
    if not isinstance(label, bool):
        raise DataProblem("bad_format", f"field 'label' must be true or false (trl's KTO reads a boolean), got "
                          f"{label!r}. Fix: write the label as a JSON boolean", sample_id=sample_id)
    completion = _answer(record["completion"], "completion", sample_id)
    if IMAGE in completion or VIDEO in completion:
        raise DataProblem("bad_format", f"the completion holds {IMAGE} or {VIDEO}: images and videos belong to the "
                          "prompt", sample_id=sample_id)
    base = {k: v for k, v in record.items() if k not in KTO_KEYS and k not in ("image", "images")}
    base["messages"] = _turns(record["prompt"], "user", "prompt", sample_id)
    base["images"] = record.get("images", record.get("image", []))
    prompt = parse_record(base, index, image_root, allow_outside_root, max_images=max_images, max_frames=max_frames)
    if not prompt.turns or prompt.turns[-1].role != "user":
        raise DataProblem("bad_format", "the prompt must end with a user turn (the completion follows it)",
                          sample_id=sample_id)
    return KtoSample(sample_id, prompt, completion, label)


def unpaired_row(row: int, num_pairs: int, block: int = UNPAIR_BLOCK) -> tuple[int, bool]:
    """Which pair and side (True: chosen) row `row` of the unpaired dataset is, in trl's order (`UNPAIR_BLOCK`)."""
    if not 0 <= row < 2 * num_pairs:
        raise IndexError(f"row {row} of {2 * num_pairs} unpaired rows")
    start = row // (2 * block) * block  # the block's first pair
    size = min(block, num_pairs - start)
    offset = row - 2 * start
    return (start + offset, True) if offset < size else (start + offset - size, False)


@dataclass
class EncodedKto:
    """A record ready to collate: its row (`sample`: prompt + completion, labels on the completion, its images
    preprocessed), where its completion starts (`prompt_length`), its label, and its index in its dataset."""

    id: str
    sample: EncodedSample
    prompt_length: int
    desirable: bool
    index: int = -1  # the row's index in its dataset (a precomputed reference's key)

    def __len__(self) -> int:
        return len(self.sample)


class KtoEncoder(OverSampleEncoder):
    """Turns KTO records (or sides of preference pairs) into `EncodedKto`s, with a `SampleEncoder`'s model,
    tokenizer and settings."""

    def __init__(self, encoder: SampleEncoder) -> None:
        self.encoder = encoder

    def parse(self, record: Any, index: int) -> KtoSample:
        return self.parse_with(parse_kto, record, index)

    def unpair(self, record: Any, index: int, chosen: bool) -> KtoSample:
        """The chosen (desirable) or rejected (undesirable) side of preference record `index`."""
        return KtoSample.of_pair(self.parse_with(parse_preference, record, index), chosen)

    def encode(self, record: Any, index: int) -> EncodedKto:
        """An unpaired record -> `EncodedKto`; raises `DataProblem` naming the record."""
        with per_sample(record_id(record, index)):
            return self.encode_sample(self.parse(record, index))

    def encode_sample(self, kto: KtoSample) -> EncodedKto:
        """A parsed record -> `EncodedKto`: checked and rendered from the image headers first (a row over
        `max_length` is dropped before any pixel is decoded), then its images decoded and preprocessed once."""
        e = self.encoder
        with per_sample(kto.id):
            row = e.check_placeholders(kto.row())
            check_answers(row)
            headers = e.headers(row)
            videos = e.expected_videos(headers)
            ids, labels = self.render(row, headers.tokens_per_image, videos)
            processed = e.load_images(row, headers)
            if row.videos:  # videos render from what they decode to (the same ids as from the headers)
                videos = e.process_videos(row)
                ids, labels = self.render(row, processed.tokens_per_image, videos)
            prompt_length = next(k for k, label in enumerate(labels) if label != IGNORE)
            return EncodedKto(kto.id, e.encoded(kto.id, ids, labels, processed, videos), prompt_length,
                              kto.desirable)

    def render(self, row: Sample, tokens_per_image: Sequence[int], videos: Any) -> tuple[list[int], list[int]]:
        """The row's ids and labels, its spans checked, within `max_length` (never cut) and with its images and
        videos in the prompt (the KL rows give a prompt's visual tokens another completion)."""
        e = self.encoder
        ids, labels = e.render(row, tokens_per_image, videos=videos)
        e.check_span_tokens(row, ids, tokens_per_image, videos)
        self.fit(row.id, ids, labels)
        first = next(k for k, label in enumerate(labels) if label != IGNORE)
        late = next((k for k, t in enumerate(ids) if t in e.span_ids and k >= first), None)
        if late is not None:
            raise DataProblem("bad_format", f"an image or video token at {late}, inside the completion: images and "
                              "videos belong to the prompt", sample_id=row.id)
        return ids, labels

    def fit(self, sample_id: str, ids: list[int], labels: list[int]) -> None:
        """A row within `max_length`, never cut: `too_long` (fatal with `truncation: raise`) when it is not."""
        if not any(label != IGNORE for label in labels[1:]):
            raise DataProblem("no_supervised_tokens", "the completion renders to no supervised token. Fix: check the "
                              "chat template's assistant turns", sample_id=sample_id)
        limit = self.config.max_length
        if len(ids) > limit:
            raise DataProblem("too_long", f"a row of {len(ids)} tokens > max_length {limit}: KTO rows are never cut (a "
                              "cut completion changes what is labelled, a cut image span breaks the contract). Fix: "
                              "raise max_length or shorten the record", sample_id=sample_id,
                              fatal=self.config.truncation == "raise")


class KtoDataset(torch.utils.data.Dataset):
    """Map-style: `dataset[i]` is an `EncodedKto`, or the `DataProblem` that stops it (fatal ones raise). `paired`:
    whether the records are preference pairs (each two rows, in trl's unpaired order, `unpaired_row`); None decides
    from the first record that reads as a JSON object."""

    def __init__(self, records: Sequence[Any] | str | os.PathLike, encoder: KtoEncoder | SampleEncoder, *,
                 paired: bool | None = None) -> None:
        config = (encoder.encoder if isinstance(encoder, KtoEncoder) else encoder).config
        self.records = (read_records(records, errors="report", columns=config.columns, config=config)
                        if isinstance(records, (str, os.PathLike))
                        else records if isinstance(records, Sequence) else list(records))
        self.encoder = encoder if isinstance(encoder, KtoEncoder) else KtoEncoder(encoder)
        self.paired = self.holds_pairs() if paired is None else paired

    def holds_pairs(self) -> bool:
        """Whether the first record that reads as a JSON object is a preference pair (trl decides by its columns)."""
        for k in range(len(self.records)):
            record = read_guarded(self.records, k)
            if isinstance(record, dict):
                return is_preference_record(record)
        return False

    def __len__(self) -> int:
        return 2 * len(self.records) if self.paired else len(self.records)

    def __getitem__(self, index: int) -> EncodedKto | DataProblem:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        where, chosen = unpaired_row(index, len(self.records)) if self.paired else (index, True)
        record = read_guarded(self.records, where)
        encoder = self.encoder

        def encode() -> EncodedKto:
            if not self.paired:
                return encoder.encode(record, where)
            with per_sample(self.row_id(record, where, chosen)):
                return encoder.encode_sample(encoder.unpair(record, where, chosen))

        item = guarded(encode, lambda: self.row_id(record, where, chosen))
        if isinstance(item, EncodedKto):
            item.index = index
        elif self.paired:  # the pair's problem, attributed to this row
            item = item.for_sample(self.row_id(record, where, chosen))
        return item

    def row_id(self, record: Any, where: int, chosen: bool) -> str:
        base = record_id(record, where)
        return f"{base}/{'chosen' if chosen else 'rejected'}" if self.paired else base

    def ids(self) -> list[str]:
        """The rows' ids, in dataset order."""
        if not self.paired:
            return [record_id(r, i) for i, r in enumerate(self.records)]
        return [self.row_id(self.records[w], w, c) for w, c in (unpaired_row(i, len(self.records))
                                                                  for i in range(len(self)))]


@dataclass(frozen=True, kw_only=True)
class KtoCollator:
    """Records -> one padded batch: the B rows, then (`kl`) the B KL rows, each prompt's images encoded once.

    Adds to `Collator`'s keys: `desirable` (B,) bool, `rows` (B: the labelled rows come first, the KL rows after),
    `image_index` (with `kl` and images: one per image of the rows, in row order, the index of its pixels among the
    encoded images; a KL row reads its prompt's), `meta["row_ids"]`, `meta["row_index"]` (the rows' ids and dataset
    indices) and `meta["kl_partners"]` (B: whose completion each KL row takes; empty without `kl`);
    `meta["sample_ids"]` holds one entry per record, so the bad-sample budget counts records. Problems are dropped
    and reported in `meta["problems"]`; a batch of problems only has 0 rows (`input_ids` (0, 0))."""

    base: Collator
    kl: bool = True

    @classmethod
    def for_model(cls, model: Any, pad_token_id: int, *, kl: bool = True, **kw: Any) -> KtoCollator:
        return cls(base=Collator.for_model(model, pad_token_id, **kw), kl=kl)

    @property
    def pad_token_id(self) -> int:
        return self.base.pad_token_id

    def __call__(self, items: Sequence[EncodedKto | DataProblem]) -> dict[str, Any]:
        if self.base.packing:
            raise ValueError("KTO rows are padded, not packed: set data.packing: false")
        kept = [k for k in items if isinstance(k, EncodedKto)]
        partners = kl_partners(len(kept), max(len(kept), 2)).tolist() if self.kl else []
        rows = [k.sample for k in kept] + [kl_row(kept[i], kept[j]) for i, j in enumerate(partners)]
        batch = self.base.rows_to_batch([[row] for row in rows])
        images = sum(k.sample.num_images for k in kept)
        if self.kl and images:  # the KL rows' images are their prompts', in the same order: encoded once
            batch["image_index"] = torch.arange(images).repeat(2)
        batch["desirable"] = torch.tensor([k.desirable for k in kept], dtype=torch.bool)
        batch["rows"] = len(kept)
        batch["meta"] = {"sample_ids": [[k.id] for k in kept], "row_ids": [k.id for k in kept],
                         "row_index": [k.index for k in kept], "kl_partners": partners,
                         "problems": [p.to_dict() for p in items if isinstance(p, DataProblem)]}
        return batch


def kl_row(row: EncodedKto, partner: EncodedKto) -> EncodedSample:
    """`row`'s prompt tokens (its images' spans included) followed by `partner`'s completion tokens and labels; its
    pixels are left out (the collator points its images at `row`'s), its videos kept (laid out per row)."""
    p, q = row.prompt_length, partner.prompt_length
    return replace(row.sample, input_ids=torch.cat([row.sample.input_ids[:p], partner.sample.input_ids[q:]]),
                   labels=torch.cat([row.sample.labels[:p], partner.sample.labels[q:]]), pixel_values=None,
                   image_grid_thw=None)
