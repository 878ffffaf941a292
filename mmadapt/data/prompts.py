"""Prompts for online RL (`train.objective: grpo`): a conversation that ends with a user turn, its images and videos,
and the columns a reward reads (`solution`, `answer`, ...).

Three record formats are read, as their tools write them:

- trl: `{"prompt": str | messages, "image": path | "images": [paths], ...columns}` (a string prompt is one user
  turn; `{"type": "image"}` parts or `<image>` mark the images, in order; a prompt with images and no mark gets
  them before its text);
- EasyR1 / verl: `{"problem": str, "answer": str, "images": [paths]}` (`<image>` in the problem marks the images);
  verl's parquet layout too (`prompt` as messages, `reward_model.ground_truth` read as the `answer` column, the
  tools of `extra_info.tools_kwargs` as the prompt's tools);
- ms-swift: `{"messages": [...turns ending with a user turn...], "images": [paths], "solution": str}` (sharegpt's
  `conversations` are read too).

With tools (`grpo.tools`), a record's `tools` (names, or trl / OpenAI function schemas) says which of the run's tools
its prompt offers (default: all); the prompt then keeps its decoded images and turns (what tools work on, and what a
recorded trajectory starts with).

Every other key of the record is a column the rewards receive (`PromptSample.columns`: EasyR1's `answer`, ms-swift's
`solution`, trl's extra columns), the prompt's own keys and the images aside. `PromptEncoder` encodes a prompt once
(`SampleEncoder.prompt_for`: the model's chat template with its generation prompt, the images read and preprocessed
once for every completion of the group), and a prompt that would leave less than `completion_tokens` of `max_length`
for its answers is a counted `too_long` problem: it is dropped, never cut (cutting it would cut an image span or the
question).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmadapt.data.images import load_image
from mmadapt.data.pipeline import SampleEncoder
from mmadapt.data.problems import DataProblem, guarded, per_sample, read_guarded
from mmadapt.data.samples import (
    IMAGE,
    EncodedSample,
    OverSampleEncoder,
    Sample,
    parse_record,
    read_records,
    record_id,
)

FORMATS = ("trl (prompt + image(s) + columns)", "EasyR1 / verl (problem + answer + images)",
           "ms-swift (messages ending with a user turn + images + solution)")
PROMPT_KEYS = frozenset({"id", "prompt", "problem", "messages", "conversations", "image", "images", "videos",
                         "video", "tools"})
"""The keys that make the prompt; every other key of a record is a column for the rewards."""


@dataclass(frozen=True)
class PromptSample:
    """A prompt (its turns end with a user turn, images and videos resolved) and the columns its rewards read."""

    id: str
    prompt: Sample
    columns: dict[str, Any] = field(default_factory=dict)
    tools: tuple[str, ...] | None = None  # the tools this prompt offers (names; None: the run's every tool)


def is_prompt_record(record: Any) -> bool:
    """Whether a record is an RL prompt in one of the `FORMATS` (no assistant answer to learn from)."""
    if not isinstance(record, dict):
        return False
    if "prompt" in record:
        return "chosen" not in record and "rejected" not in record
    if "problem" in record:
        return True
    turns = record.get("messages", record.get("conversations"))
    return isinstance(turns, list) and bool(turns) and _role(turns[-1]) == "user"


def parse_prompt(record: Any, index: int, image_root: str | os.PathLike | None = None,
                 allow_outside_root: bool = False, *, max_images: int | None = None,
                 max_frames: int | None = None) -> PromptSample:
    """An RL prompt record as a `PromptSample`; `DataProblem("bad_format")` if it is none of the `FORMATS` (and the
    problems `parse_record` raises for its turns and paths)."""
    if isinstance(record, DataProblem):
        raise record
    sample_id = record_id(record, index)
    if not isinstance(record, dict):
        raise DataProblem("bad_format", f"expected a JSON object, got {type(record).__name__}", sample_id=sample_id)
    base: dict[str, Any] = {"id": sample_id}
    images = record.get("images", record.get("image", []))
    if "prompt" in record:  # trl
        if "chosen" in record or "rejected" in record:
            raise DataProblem("bad_format", "a preference pair (prompt / chosen / rejected), not an RL prompt: train "
                              "it with train.objective: dpo", sample_id=sample_id)
        base["messages"] = _turns(record["prompt"], "prompt", sample_id)
    elif "problem" in record:  # EasyR1 / verl
        if not isinstance(record["problem"], str) or not record["problem"].strip():
            raise DataProblem("bad_format", "'problem' must be a non-empty string", sample_id=sample_id)
        base["messages"] = [{"role": "user", "content": record["problem"]}]
    elif "messages" in record or "conversations" in record:  # ms-swift (sharegpt too)
        base["messages"] = _turns(record.get("messages", record.get("conversations")), "messages", sample_id)
    else:
        raise DataProblem("bad_format", f"not an RL prompt: give one of: {'; '.join(FORMATS)}", sample_id=sample_id)
    base["images"] = [images] if isinstance(images, str) else images
    base["videos"] = record.get("videos", record.get("video", []))
    if base["messages"][-1]["role"] != "user":
        raise DataProblem("bad_format", "the prompt must end with a user turn (the policy writes the answer); a "
                          "record ending with an assistant answer is supervised data (train.objective: sft)",
                          sample_id=sample_id)
    _mark_images(base, sample_id)
    prompt = parse_record(base, index, image_root, allow_outside_root, max_images=max_images, max_frames=max_frames)
    columns = {k: v for k, v in record.items() if k not in PROMPT_KEYS}
    truth = record.get("reward_model", {}).get("ground_truth") if isinstance(record.get("reward_model"), dict) else None
    if truth is not None and "answer" not in columns and "solution" not in columns:  # verl's rule-based reward
        columns["answer"] = truth
    tools = record.get("tools")
    extra = record.get("extra_info")
    if tools is None and isinstance(extra, dict) and isinstance(extra.get("tools_kwargs"), dict):  # verl's per-sample
        tools = list(extra["tools_kwargs"])  # tools: their names (their create_kwargs are verl's tool classes')
    return PromptSample(sample_id, prompt, columns, _tool_names(tools, sample_id))


def _tool_names(value: Any, sample_id: str) -> tuple[str, ...] | None:
    """A record's `tools`: names, or function schemas as trl / OpenAI write them (`{"type": "function", "function":
    {"name", ...}}`, or the function object itself), by name; a JSON string of either (a Parquet column)."""
    if value is None:
        return None
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = [value]
    names = []
    for entry in value if isinstance(value, list) else [value]:
        entry = entry.get("function", entry) if isinstance(entry, dict) else entry
        name = entry.get("name") if isinstance(entry, dict) else entry
        if not isinstance(name, str) or not name:
            raise DataProblem("bad_format", f"'tools' must list tool names or function schemas with a name, got "
                              f"{entry!r}", sample_id=sample_id)
        names.append(name)
    return tuple(names)


def _role(message: Any) -> str | None:
    if isinstance(message, dict):
        role = message.get("role", message.get("from"))
        return {"human": "user", "gpt": "assistant"}.get(role, role)
    return None


def _turns(value: Any, field_name: str, sample_id: str) -> list[dict[str, Any]]:
    """A string (one user turn) or a list of messages / sharegpt turns, as {"role", "content"} turns."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataProblem("bad_format", f"{field_name!r} must be a string or a non-empty list of messages",
                          sample_id=sample_id)
    turns = []
    for k, message in enumerate(value):
        role = _role(message)
        if role is None:
            raise DataProblem("bad_format", f"{field_name}[{k}] needs 'role' / 'content' (or sharegpt's 'from' / "
                              "'value')", sample_id=sample_id)
        turns.append({"role": role, "content": message.get("content", message.get("value"))})
    return turns


def _mark_images(base: dict[str, Any], sample_id: str) -> None:
    """trl's and EasyR1's string prompts may leave the images unmarked: they go before the last user turn's text (the
    `[image, text]` parts of an OpenAI request), one `<image>` each."""
    images = base["images"]
    count = len(images) if isinstance(images, list) else 0
    texts = [t["content"] for t in base["messages"] if isinstance(t["content"], str)]
    parts = [p for t in base["messages"] if isinstance(t["content"], list) for p in t["content"]]
    marked = sum(text.count(IMAGE) for text in texts) + sum(isinstance(p, dict) and p.get("type") == "image"
                                                            for p in parts)
    if count and not marked and isinstance(base["messages"][-1]["content"], str):
        base["messages"][-1] = {"role": "user", "content": IMAGE * count + base["messages"][-1]["content"]}


@dataclass
class EncodedPrompt:
    """A prompt encoded once: its generation prompt (`sample`: ids, no labels, images preprocessed) and the columns
    its rewards read."""

    sample: EncodedSample
    columns: dict[str, Any]
    images: tuple[Any, ...] = ()  # its decoded images (RGB), which tools work on (kept when tools are offered)
    tools: tuple[str, ...] = ()  # the tools it offers
    turns: tuple[Any, ...] = ()  # its turns (`Turn`s, kept with tools: a trajectory's record starts with them)

    @property
    def id(self) -> str:
        return self.sample.id


class PromptEncoder(OverSampleEncoder):
    """Encodes RL prompts for one model: the `SampleEncoder`'s template, images and limits, and room for answers of
    `completion_tokens` within its `max_length`."""

    def __init__(self, encoder: SampleEncoder, completion_tokens: int, tools: Sequence[Any] = (),
                 list_tools: bool = True) -> None:
        """`tools` (`mmadapt.tools.Tool`s): what a prompt may offer (all of them unless its record's `tools` names
        some), listed in its prompt by the template when `list_tools`; with tools, each prompt keeps its decoded
        images for them."""
        if completion_tokens < 1:
            raise ValueError(f"completion_tokens must be >= 1, got {completion_tokens}")
        self.encoder, self.completion_tokens = encoder, completion_tokens
        self.tools, self.list_tools = {t.name: t for t in tools}, list_tools

    def offered(self, parsed: PromptSample) -> tuple[str, ...]:
        """The tools a prompt offers: its record's, each one the run has (`DataProblem` naming one it lacks)."""
        if parsed.tools is None:
            return tuple(self.tools)
        unknown = [name for name in parsed.tools if name not in self.tools]
        if unknown:
            raise DataProblem("bad_format", f"its tools {unknown} are not among the run's grpo.tools "
                              f"{sorted(self.tools)}. Fix: add them to grpo.tools, or drop them from the record",
                              sample_id=parsed.id)
        return parsed.tools

    def parse(self, record: Any, index: int) -> PromptSample:
        return self.parse_with(parse_prompt, record, index)

    def encode(self, record: Any, index: int) -> EncodedPrompt:
        """One record -> `EncodedPrompt`, or a `DataProblem` naming the sample (`too_long`: the prompt leaves less
        than `completion_tokens` of `max_length`)."""
        with per_sample(record_id(record, index)):
            parsed = self.parse(record, index)
            prompt = parsed.prompt
            images = [load_image(path, max_pixels=self.config.max_image_pixels) for path in prompt.images]
            offered = self.offered(parsed) if self.tools else ()
            if offered and prompt.videos:
                raise DataProblem("video_unsupported", "a prompt with a video cannot offer tools yet (a trajectory's "
                                  "later turns take images only). Fix: give the video's frames as images, or offer "
                                  "no tools for it (its record's tools: [])", sample_id=parsed.id)
            schemas = [self.tools[name].schema() for name in offered] if self.list_tools else []
            sample = self.encoder.prompt_for(parsed.id, prompt.turns, images, prompt.videos, tools=schemas or None)
            room = self.config.max_length - len(sample.input_ids)
            if room < self.completion_tokens:
                raise DataProblem("too_long", f"its prompt is {len(sample.input_ids)} tokens, leaving {room} of "
                                  f"max_length {self.config.max_length} for answers of up to {self.completion_tokens} "
                                  "tokens (grpo.max_completion_length): dropped, never cut. Fix: raise max_length or "
                                  "lower max_completion_length", sample_id=parsed.id,
                                  fatal=self.config.truncation == "raise")
            kept = bool(self.tools)
            return EncodedPrompt(sample, parsed.columns, tuple(images) if kept else (), offered,
                                 tuple(prompt.turns) if kept else ())


class PromptDataset(torch.utils.data.Dataset):
    """RL prompts from a file or records; an item is an `EncodedPrompt`, or the `DataProblem` that made it unusable
    (counted and skipped by the collator and the trainer, as `VLMDataset`'s)."""

    def __init__(self, records: Sequence[Any] | str | os.PathLike, encoder: PromptEncoder) -> None:
        self.records = (read_records(records, errors="report", columns=encoder.config.columns,
                                     config=encoder.config)
                        if isinstance(records, str | os.PathLike)
                        else records if isinstance(records, Sequence) else list(records))
        self.encoder = encoder

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> EncodedPrompt | DataProblem:
        record = read_guarded(self.records, index)
        return guarded(lambda: self.encoder.encode(record, index), lambda: record_id(record, index))

    def ids(self) -> list[str]:
        return [record_id(r, i) for i, r in enumerate(self.records)]


class PromptCollator:
    """A `Collator` batch of the prompts (right-padded generation prompts, their images once each) with `columns`:
    per kept prompt, in row order, the columns its rewards read (problems counted in `meta`, as the collator's)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    @property
    def pad_token_id(self) -> int:
        return self.collator.pad_token_id

    def __call__(self, items: Sequence[EncodedPrompt | DataProblem]) -> dict[str, Any]:
        batch = self.collator([i.sample if isinstance(i, EncodedPrompt) else i for i in items])
        kept = [i for i in items if isinstance(i, EncodedPrompt)]
        batch["columns"] = [i.columns for i in kept]
        if any(i.images or i.tools for i in kept):  # what tools work on, per kept prompt in row order
            batch["images"], batch["tools"] = [i.images for i in kept], [i.tools for i in kept]
            batch["turns"] = [i.turns for i in kept]
        return batch
