"""Sample formats -> one internal schema, and the encoded form the collators take.

Two input formats are read:

- LLaVA: `{"id", "image": path | [paths] (optional), "conversations": [{"from": "human" | "gpt"
  | "system", "value": "<image>\\n..."}]}`;
- messages (LLaMA-Factory / ms-swift / OpenAI style): `{"id"?, "images": [paths], "messages":
  [{"role": "system" | "user" | "assistant", "content": str | [{"type": "text", "text"} |
  {"type": "image"}]}]}`; `<image>` in a string content and `{"type": "image"}` parts both mark
  an image, in order.

Videos come as LLaMA-Factory and ms-swift write them: `"videos": [video, ...]` (LLaVA records also `"video"`),
marked by `<video>` in the text or by `{"type": "video"}` parts (a part may carry its video inline:
`{"type": "video", "video": ...}`, Qwen's style, instead of the record-level list), in order. A video is a file
path, or a list of frame image paths (frames already sampled, in order).

Both become `Sample(id, images, turns, videos)`, where turns are `Turn(role, text)` with role in
{system, user, assistant}, each image marked by `IMAGE` and each video by `VIDEO` in the text, in order.
Image and video paths resolve against the image root; absolute paths and `..` escaping the root are a
`DataProblem("path_outside_root")` unless `allow_outside_root=True`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmadapt.data.images import EmbeddedImage
from mmadapt.data.problems import DataProblem
from mmadapt.data.records import open_records
from mmadapt.data.stream import ShardRecords, is_shard_source
from mmadapt.data.tables import HubDataset, TableRecords, is_hub_source, is_table_source
from mmadapt.data.turns import IMAGE, VIDEO, Turn
from mmadapt.data.video.decode import EmbeddedVideo

VideoSource = str | EmbeddedVideo | tuple[str, ...]  # a video file (or its bytes), or its frames' image files in order
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
         "tool": "tool", "observation": "tool", "function_call": "assistant"}
"""Record roles -> `Turn` roles (sharegpt's; LLaMA-Factory's tool turns: `function_call` is an assistant's call,
`observation` a tool's result)."""


@dataclass(frozen=True)
class Sample:
    """One conversation; `images` (resolved paths) and `videos` (a file or a tuple of frame files, resolved) are
    marked by `IMAGE` and `VIDEO` in the turns' text, in order."""

    id: str
    images: tuple[Any, ...]
    turns: tuple[Turn, ...]
    videos: tuple[Any, ...] = ()

    @property
    def num_placeholders(self) -> int:
        return sum(turn.text.count(IMAGE) for turn in self.turns)

    @property
    def num_video_placeholders(self) -> int:
        return sum(turn.text.count(VIDEO) for turn in self.turns)


@dataclass
class EncodedSample:
    """A sample ready to collate. `tokens_per_image[i]` is the span length of image i in `input_ids`.

    pixel_values: fixed-size encoders (I, C, S, S); dynamic ones (patches, F) with `image_grid_thw` (I, 3).
    Videos (dynamic encoders): `pixel_values_videos` (patches, F) with `video_grid_thw` (V, 3);
    `tokens_per_video[v]`: video v's visual tokens in all (its t frame spans of h*w / merge^2 each).
    """

    id: str
    input_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    tokens_per_image: list[int] = field(default_factory=list)
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    tokens_per_video: list[int] = field(default_factory=list)
    source: str | None = None  # the `data.train` source it came from, in a mixture (`mmadapt.data.mixture`)

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_images(self) -> int:
        return len(self.tokens_per_image)

    @property
    def num_videos(self) -> int:
        return len(self.tokens_per_video)


def read_records(path: str | os.PathLike, errors: str = "raise", columns: dict[str, str] | None = None,
                 config: Any = None) -> Sequence[Any]:
    """Records of a `.json` (a list) or `.jsonl` file, as a memory-mapped `records.Records` sequence: the file is
    converted once (streamed) to the records cache and `records[i]` is parsed when asked for, so memory does not
    grow with the file (mmadapt.data.records). A Parquet or Arrow file or directory, or a `save_to_disk` directory,
    is read with `datasets` (`tables.TableRecords`, its column layout recognised or mapped by `columns`), and so is a
    hub dataset in the local hub cache, named `hub:OWNER/NAME[/SUBSET][@SPLIT]` (`tables.HubDataset`: offline, split
    default `train`, subset default the dataset's default). WebDataset `.tar` shards (a file, a glob, a directory) are
    read in file order (`stream.ShardRecords`: what `data check` and `data show` see of a stream), each sample checked
    from its tar headers against the limits of `config` (a `DataConfig`; None: the defaults) before it is read.
    Parquet and Arrow sources are checked against `config`'s table limits (`table_limits.TableLimits`) from their
    footers before a row group is decoded.

    A `.jsonl` file is read line by line (bytes, decoded per line; a UTF-8 byte-order mark on line 1 is allowed): a
    line that is not UTF-8, not JSON, nested too deeply for the parser or holding a number Python refuses (an integer
    of more than 4300 digits) raises ValueError naming `file:line`; with `errors="report"` it becomes a
    `DataProblem("bad_format")` with id "line N" in its place (`VLMDataset` and `check_dataset` count it like any bad
    sample) and the other lines are read. A `.json` file that does not parse is one ValueError naming its line and
    column.
    """
    if errors not in ("raise", "report"):
        raise ValueError(f"errors must be 'raise' or 'report', got {errors!r}")
    table_limits = getattr(config, "table_limits", None)
    if is_hub_source(path):
        return TableRecords(HubDataset.parse(str(path)), columns, table_limits)
    if is_shard_source(path):
        return ShardRecords(path, columns, config)
    if is_table_source(path):
        return TableRecords(path, columns, table_limits)
    records = open_records(path)
    if errors == "raise" and (problems := records.problems()):
        raise ValueError(problems[0].detail)
    return records


def record_id(record: Any, index: int) -> str:
    return str(record.get("id", index)) if isinstance(record, dict) else str(index)


def parse_record(record: Any, index: int, image_root: str | os.PathLike | None = None,
                 allow_outside_root: bool = False, *, max_images: int | None = None,
                 max_frames: int | None = None) -> Sample:
    """A LLaVA or messages record as a `Sample`; `DataProblem("bad_format" | "path_outside_root")` if it is not, and
    `sample_too_large` for more than `max_images` images or `max_frames` frames in its frame lists (counted before
    any path is resolved, so a record listing 100,000 files costs nothing)."""
    if isinstance(record, DataProblem):  # a line `read_records(errors="report")` could not parse
        raise record
    sample_id = record_id(record, index)
    if not isinstance(record, dict):
        raise DataProblem("bad_format", f"expected a JSON object, got {type(record).__name__}", sample_id=sample_id)
    inline: list[Any] = []
    if "conversations" in record:
        images, turns = record.get("image", []), _llava_turns(record["conversations"], sample_id)
        videos = record.get("videos", record.get("video", []))
    elif "messages" in record:
        images, turns = record.get("images", []), _message_turns(record["messages"], sample_id, inline)
        videos = record.get("videos", [])
    elif "prompt" in record and ("chosen" in record or "rejected" in record):
        raise DataProblem("bad_format", "a preference pair (trl's prompt / chosen / rejected), not a conversation: "
                          "train it with train.objective: dpo", sample_id=sample_id)
    else:
        raise DataProblem("bad_format", "no 'conversations' (LLaVA) or 'messages' field", sample_id=sample_id)
    if inline:
        if videos:
            raise DataProblem("bad_format", "videos are given both in 'videos' and inside {'type': 'video'} parts; "
                              "give each video once (either place)", sample_id=sample_id)
        videos = inline
    images = [images] if isinstance(images, str | EmbeddedImage) else images
    if max_images is not None and isinstance(images, list) and len(images) > max_images:
        raise over_limit(sample_id, f"{len(images)} images", "max_images", max_images)
    listed = sum(len(v) for v in videos if isinstance(v, list)) if isinstance(videos, list) else 0
    if max_frames is not None and listed > max_frames:
        raise over_limit(sample_id, f"{listed} frames in its frame lists", "max_sample_frames", max_frames)
    if not isinstance(images, list) or not all(isinstance(p, str | EmbeddedImage) for p in images):
        raise DataProblem("bad_format", f"images must be a path or a list of paths, got {_clip(images)}",
                          sample_id=sample_id)
    if any(turn.role == "system" for turn in turns[1:]):
        raise DataProblem("bad_format", "a system turn may only come first", sample_id=sample_id)
    paths = tuple(p if isinstance(p, EmbeddedImage) else resolve_image_path(p, image_root, allow_outside_root,
                                                                             sample_id) for p in images)
    return Sample(sample_id, paths, turns, _videos(videos, image_root, allow_outside_root, sample_id))


def _videos(videos: Any, image_root: str | os.PathLike | None, allow_outside_root: bool,
            sample_id: str) -> tuple[VideoSource, ...]:
    """Resolved video sources: a path, a video embedded in a dataset (kept as it is), or a list of frame paths (one
    video) - a list of these."""
    videos = [videos] if isinstance(videos, str | EmbeddedVideo) else videos
    if not isinstance(videos, list):
        raise DataProblem("bad_format", f"videos must be a list of videos (a path, or a list of frame paths), got "
                          f"{videos!r}", sample_id=sample_id)
    out: list[VideoSource] = []
    for k, video in enumerate(videos):
        if isinstance(video, str):
            out.append(resolve_image_path(video, image_root, allow_outside_root, sample_id))
        elif isinstance(video, EmbeddedVideo):
            out.append(video)
        elif isinstance(video, list) and video and all(isinstance(p, str) for p in video):
            out.append(tuple(resolve_image_path(p, image_root, allow_outside_root, sample_id) for p in video))
        else:
            raise DataProblem("bad_format", f"videos[{k}] must be a file path or a non-empty list of frame image "
                              f"paths, got {video!r}", sample_id=sample_id)
    return tuple(out)


def _llava_turns(conversations: Any, sample_id: str) -> tuple[Turn, ...]:
    if not isinstance(conversations, list) or not conversations:
        raise DataProblem("bad_format", "'conversations' must be a non-empty list", sample_id=sample_id)
    turns = []
    for k, message in enumerate(conversations):
        if not isinstance(message, dict) or message.get("from") not in ROLES:
            raise DataProblem("bad_format", f"conversations[{k}] needs 'from' in {sorted(ROLES)}",
                              sample_id=sample_id)
        value = message.get("value")
        if not isinstance(value, str):
            raise DataProblem("bad_format", f"conversations[{k}].value must be a string", sample_id=sample_id)
        if message["from"] == "function_call":  # LLaMA-Factory: the call as JSON (or a list of calls)
            turns.append(Turn("assistant", "", _calls(_json(value, f"conversations[{k}].value", sample_id),
                                                      f"conversations[{k}]", sample_id)))
            continue
        turns.append(Turn(ROLES[message["from"]], value))
    return tuple(turns)


def _json(text: str, where: str, sample_id: str) -> Any:
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataProblem("bad_format", f"{where} is not JSON ({e.msg})", sample_id=sample_id) from None


def _calls(value: Any, where: str, sample_id: str) -> tuple[tuple[str, str], ...]:
    """OpenAI `tool_calls` ({"function": {"name", "arguments"}} each; `arguments` an object or its JSON text) or
    LLaMA-Factory's ({"name", "arguments"}), as `Turn.calls`."""
    import json

    calls = value if isinstance(value, list) else [value]
    out = []
    for n, call in enumerate(calls):
        call = call.get("function", call) if isinstance(call, dict) else None
        arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            arguments = _json(arguments, f"{where} call {n}'s arguments", sample_id)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            raise DataProblem("bad_format", f"{where} call {n} must be {{'name': str, 'arguments': {{...}}}} (OpenAI's "
                              "tool_calls put it under 'function')", sample_id=sample_id)
        out.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
    return tuple(out)


def _message_turns(messages: Any, sample_id: str, inline: list[Any]) -> tuple[Turn, ...]:
    if not isinstance(messages, list) or not messages:
        raise DataProblem("bad_format", "'messages' must be a non-empty list", sample_id=sample_id)
    turns = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DataProblem("bad_format", f"messages[{k}] needs 'role' in {sorted(ROLES)}", sample_id=sample_id)
        calls = message.get("tool_calls")
        if calls and ROLES[message["role"]] != "assistant":
            raise DataProblem("bad_format", f"messages[{k}] has tool_calls but is not an assistant turn",
                              sample_id=sample_id)
        content = message.get("content")
        text = "" if content is None and calls else _content_text(content, k, sample_id, inline)
        turns.append(Turn(ROLES[message["role"]], text, _calls(calls, f"messages[{k}]", sample_id) if calls else ()))
    return tuple(turns)


def _content_text(content: Any, k: int, sample_id: str, inline: list[Any]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DataProblem("bad_format", f"messages[{k}].content must be a string or a list of parts",
                          sample_id=sample_id)
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind in ("image", "image_url"):
            pieces.append(IMAGE)
        elif kind == "video":
            pieces.append(VIDEO)
            if part.get("video") is not None:
                inline.append(part["video"])
        else:
            raise DataProblem("bad_format", f"messages[{k}].content has an unsupported part {part!r}; expected "
                              "{'type': 'text', 'text': ...}, {'type': 'image'} or {'type': 'video'}",
                              sample_id=sample_id)
    return "".join(pieces)


def resolve_image_path(path: str, image_root: str | os.PathLike | None, allow_outside_root: bool,
                       sample_id: str) -> str:
    """`path` joined to `image_root`; absolute paths or `..` leaving the root are refused unless allowed."""
    if allow_outside_root:
        return str(Path(image_root or ".", path))
    if os.path.isabs(path):
        raise DataProblem("path_outside_root", f"image path {path!r} is absolute; paths must be relative to the "
                          "image root. Fix: make it relative, or pass allow_outside_root=True "
                          "(--allow-outside-root) if you trust the dataset", sample_id=sample_id, path=path)
    # Lexical check (no symlink resolution): `root/coco -> /data/coco` links inside the root are fine.
    root = os.path.abspath(image_root or ".")
    resolved = os.path.normpath(os.path.join(root, path))
    if resolved != root and not resolved.startswith(root if root.endswith(os.sep) else root + os.sep):
        raise DataProblem("path_outside_root", f"image path {path!r} escapes the image root {str(root)!r}. Fix: "
                          "move the image under the root, or pass allow_outside_root=True if you trust the dataset",
                          sample_id=sample_id, path=path)
    return resolved


def over_limit(sample_id: str, what: str, setting: str, limit: int) -> DataProblem:
    """`sample_too_large`: the sample's `what` exceeds the data setting `setting` (checked before decoding)."""
    return DataProblem("sample_too_large", f"{what} > {setting} {limit} (from the record and the headers, nothing "
                       f"decoded). Fix: split the sample, or raise data.{setting} if the machine has the memory",
                       sample_id=sample_id)


def _clip(value: Any, width: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def iter_samples(records: list[Any], image_root: str | os.PathLike | None = None,
                 allow_outside_root: bool = False) -> Iterator[Sample | DataProblem]:
    """Each record parsed, or the `DataProblem` that prevents it."""
    for index, record in enumerate(records):
        try:
            yield parse_record(record, index, image_root, allow_outside_root)
        except DataProblem as problem:
            yield problem


class OverSampleEncoder:
    """Base of an encoder of another kind of record (RL prompts, preference pairs) over a `SampleEncoder`: its
    settings (`config`), pad id, and the record parsing with the settings' root and limits (`parse_with`)."""

    encoder: Any  # the SampleEncoder (mmadapt.data.pipeline)

    @property
    def config(self) -> Any:
        return self.encoder.config

    @property
    def pad_token_id(self) -> int:
        return self.encoder.pad_token_id

    def parse_with(self, parse: Any, record: Any, index: int) -> Any:
        """`parse(record, index, image_root, allow_outside_root, max_images=, max_frames=)` with the settings'."""
        c = self.config
        return parse(record, index, c.image_root, c.allow_outside_root, max_images=c.max_images,
                     max_frames=c.max_sample_frames)
