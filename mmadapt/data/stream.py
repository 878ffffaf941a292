"""Streaming: WebDataset tar shards read as a stream, split across ranks and loader workers, shuffled in blocks,
resumed exactly.

    data:
      train: {stream: /data/pretrain/*.tar, buffer: 1000}

Stage-1 pretraining data (image-caption pairs by the million) comes as WebDataset shards: tar files whose members
are grouped into samples by their name up to the first dot (`000017.jpg`, `000017.txt`, `000017.json`). A sample
becomes a record: its `.json` member (a LLaVA or messages record) with the sample's images (its `.jpg` / `.jpeg` /
`.png` / `.webp` / `.bmp` members, in the order of their extensions) as its images, or, without a `.json`, its `.txt`
caption as the answer to its images (`<image>` per image: the LLaVA pretraining layout). Images are kept as bytes
(`EmbeddedImage`, named `shard.tar:key.jpg`) and checked from their headers before decoding like any image. Nothing is
extracted to disk: no path from a tar is ever opened.

Bad samples are counted problems naming the shard and the key, never an exception out of a stream. A sample is checked
from its tar headers before any member is read (`tar_headers.SampleLimits`: its members, their declared bytes
together, its images; a sparse member is refused), so a small hostile shard costs header reads, not memory. A sample
with neither record nor caption, or a `.json` that does not parse (nested too deeply included), is a problem; a shard
that cannot be read on (truncated, a member declared past the end of the file, a corrupt header: `tarfile.TarError`)
ends with one `unreadable_shard` problem, the samples before the break kept. A plain path of tar shards (`data.train:
shards/*.tar`) streams as `{stream: ...}` does (`as_stream`); read by index (`ShardRecords`: a mixture's source, an
evaluation set, `data check`) a sample is read from its own first header (`Shard.offsets`).

Splitting: the `world * workers` streams (rank r's worker w is stream `r * workers + w`; a run without workers has
one per rank) each take every `streams`-th shard of the epoch's seeded shard order, so no two streams read the same
shard and each shard is read once an epoch. A stream runs through its shards epoch after epoch; it shuffles in blocks
of `buffer` samples, each block permuted by a generator seeded by (seed, stream, block): a shuffle buffer whose
contents are a function of the position, so the position alone restores it.

Position: a rank's DataLoader takes its batches from its workers in turn (batch i from worker i % workers), so after
s steps of `grad_accum` micro-batches each stream has yielded a number of samples that is a function of s
(`StreamPosition`). A resumed run starts every stream there: it skips whole shards by their sample counts (counted
once from the tar headers and kept in the records cache) and the skipped samples of a shard without decoding them,
then refills the current block. The checkpoint records the layout it was taken with (world, workers, batch) and a
resume with another layout is refused, since the same step would then mean other samples.
"""

from __future__ import annotations

import glob
import io
import json
import os
import tarfile
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from mmadapt.data.images import EmbeddedImage
from mmadapt.data.problems import DataProblem, guarded
from mmadapt.data.tar_headers import Group, SampleLimits, key_and_extension, open_at, sample_groups, sample_offsets

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp")
DEFAULT_BUFFER = 1000
STREAM_KEYS = ("stream", "buffer")


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions, unlike `hash`)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value ^ (part + 0x9E3779B97F4A7C15 + (value << 6) + (value >> 2))) & (2**64 - 1)
    return value & (2**63 - 1)


def stream_source(value: Any) -> dict[str, Any] | None:
    """`data.train` as a stream (`{stream: PATTERN, buffer: N}`), checked; None when it is not one."""
    if not isinstance(value, dict):
        return None
    unknown = sorted(set(value) - set(STREAM_KEYS))
    if "stream" not in value or unknown:
        raise ValueError(f"data.train as a stream is {{stream: SHARDS, buffer: N}}; got keys {sorted(value)}")
    buffer = value.get("buffer", DEFAULT_BUFFER)
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
        raise ValueError(f"data.train.buffer (the shuffle buffer, samples) must be an integer >= 1, got {buffer!r}")
    return {"stream": os.fspath(value["stream"]), "buffer": buffer}


SHARD_SUFFIXES = (".tar", ".parquet")


def shard_files(pattern: str) -> list[Path]:
    """The shards of a stream: a `.tar` or `.parquet` file, a directory of them, or a glob pattern
    (`shards/train-*.tar`); one kind of shard per stream."""
    path = Path(pattern).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.glob("*") if p.suffix in SHARD_SUFFIXES and p.is_file())
    elif path.is_file():
        files = [path] if path.suffix in SHARD_SUFFIXES else []
    else:
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).suffix in SHARD_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"data.train.stream {pattern!r} names no .tar or .parquet shard: give a shard file, "
                                "a directory of them or a glob pattern such as 'shards/train-*.tar'")
    kinds = sorted({p.suffix for p in files})
    if len(kinds) > 1:
        raise ValueError(f"data.train.stream {pattern!r} mixes {kinds} shards: stream one kind (a mixture of two "
                         "streams is not supported yet)")
    return files


def shard_of(path: Path, columns: dict[str, str] | None = None, config: Any = None) -> Shard | ParquetShard:
    """The shard at `path`, checked against the limits of `config` (a `DataConfig`; None: the defaults)."""
    if path.suffix == ".parquet":
        return ParquetShard(path, columns, getattr(config, "table_limits", None))
    return Shard(path, SampleLimits.of(config))


class Shard:
    """One tar shard: its sample count (from its headers, cached by path, size and modification time) and its
    samples as records from any position, each checked against `limits` from its headers before it is read.

    A shard that cannot be read on (truncated, a corrupt header) ends with one `unreadable_shard` problem in the
    place of the rest: `groups()`, `len()` and `records()` agree on it, so a stream's positions stay exact."""

    def __init__(self, path: Path, limits: SampleLimits | None = None) -> None:
        self.path = Path(path)
        self.limits = limits if limits is not None else SampleLimits()
        self._count: int | None = None
        self._offsets: array | None = None

    def __len__(self) -> int:
        if self._count is None:
            self._count = _cached_count(self.path)
        return self._count

    def groups(self) -> Iterator[Group | DataProblem]:
        """Each sample's `Group`, in file order, reading headers only; then, where the shard cannot be read on, the
        `DataProblem` that ends it."""
        for _, item in self._items():
            yield item

    def records(self, start: int = 0) -> Iterator[dict[str, Any] | DataProblem]:
        """The records from sample `start` on; the samples before it are skipped by their headers."""
        for position, (tar, item) in enumerate(self._items()):
            if position >= start:
                yield item if isinstance(item, DataProblem) else self.record(tar, item)

    def record_at(self, position: int) -> dict[str, Any] | DataProblem:
        """Sample `position`'s record, read from its own first header (`offsets`), never the samples before it."""
        offsets = self.offsets()
        if position >= len(offsets):  # the problem that ends a broken shard, or a shard read only in order
            return next(self.records(position))
        try:
            with open_at(self.path, offsets[position]) as tar:
                return self.record(tar, next(sample_groups(tar, keep=self.limits.max_members + 1)))
        except tarfile.TarError as e:  # the shard changed since its offsets were read
            return DataProblem("unreadable_shard", f"sample {position} cannot be read from byte {offsets[position]}: "
                               f"{e}", sample_id=f"{self.path.name}:#{position}", path=str(self.path))

    def offsets(self) -> array:
        """Where each sample's first header starts in the file (its extended headers included), from one pass over
        the headers, kept (8 bytes a sample). Empty for a shard with global pax headers (they would not apply to a
        read that starts past them): it is read in order."""
        if self._offsets is None:
            self._offsets = sample_offsets(self.path)
        return self._offsets

    def _items(self) -> Iterator[tuple[tarfile.TarFile | None, Group | DataProblem]]:
        """(the open shard, each sample's group) in file order; a `TarError` ends the shard as one problem."""
        done, key = 0, None
        try:
            with tarfile.open(self.path, "r:") as tar:
                for group in sample_groups(tar, keep=self.limits.max_members + 1):
                    yield tar, group
                    done, key = done + 1, group.key
        except tarfile.TarError as e:
            where = f"after sample {key!r} ({done} read)" if done else "at its start"
            yield None, DataProblem("unreadable_shard", f"the shard cannot be read {where}: {e}. The rest of it is "
                                    "skipped. Fix: write or download the shard again (tar -tf lists what it holds)",
                                    sample_id=f"{self.path.name}:#{done}", path=str(self.path))

    def refusal(self, group: Group) -> DataProblem | None:
        """Why the sample `group` is not read (its headers over a limit, a sparse member), or None. A member declared
        past the end of the file never gets here: tarfile refuses it when it reads the next header ("unexpected end
        of data"), which ends the shard (`_items`) with the sample it belongs to."""
        sample_id, limits = f"{self.path.name}:{group.key}", self.limits

        def problem(reason: str, detail: str, fix: str = "") -> DataProblem:
            return DataProblem(reason, f"{detail}: nothing of it is read{fix}", sample_id=sample_id,
                               path=str(self.path))

        if group.count > limits.max_members:
            return problem("sample_too_large", f"{group.count} members, over max_sample_members {limits.max_members}")
        if group.size > limits.max_bytes:
            return problem("sample_too_large", f"its members declare {group.size} bytes, over max_sample_bytes "
                           f"{limits.max_bytes}")
        images = sum(key_and_extension(m.name)[1].rsplit(".", 1)[-1] in IMAGE_EXTENSIONS for m in group.members)
        if limits.max_images is not None and images > limits.max_images:
            return problem("sample_too_large", f"{images} images, over max_images {limits.max_images}")
        for info in group.members:
            if info.issparse():
                return problem("bad_format", f"member {info.name} is a sparse file declaring {info.size} bytes, "
                               "holes the shard does not hold (sparse members are refused)", ". Fix: write the shard "
                               "without tar's --sparse")
        return None

    def record(self, tar: tarfile.TarFile, group: Group) -> dict[str, Any] | DataProblem:
        """Sample `group` as a record, or the problem that refuses it (checked from its headers first)."""
        refused = self.refusal(group)
        if refused is not None:
            return refused
        sample_id = f"{self.path.name}:{group.key}"
        try:
            return self._record(tar, group.key, {key_and_extension(m.name)[1]: m for m in group.members})
        except tarfile.TarError as e:  # a member's data unreadable though its header was
            return DataProblem("unreadable_shard", f"a member of {group.key} cannot be read: {e}",
                               sample_id=sample_id, path=str(self.path))

    def _record(self, tar: tarfile.TarFile, key: str,
                parts: dict[str, tarfile.TarInfo]) -> dict[str, Any] | DataProblem:
        sample_id = f"{self.path.name}:{key}"
        images = [EmbeddedImage(tar.extractfile(parts[e]).read(), f"{self.path}:{key}.{e}")
                  for e in sorted(parts, key=_image_order) if e.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS]
        if "json" in parts:
            try:
                record = json.loads(tar.extractfile(parts["json"]).read())
            except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, a huge integer, nested too deeply
                return DataProblem("bad_format", f"{key}.json does not parse: {type(e).__name__}: {_clip(e)}",
                                   sample_id=sample_id, path=str(self.path))
            if not isinstance(record, dict):
                return DataProblem("bad_format", f"{key}.json holds a {type(record).__name__}, not a record",
                                   sample_id=sample_id, path=str(self.path))
            record = {"id": sample_id, **{k: v for k, v in record.items() if k not in ("image", "images")}}
            if images:  # the sample's own images, under the key its layout reads (LLaVA: image; messages: images)
                record["images" if "messages" in record else "image"] = images
            return record
        if "txt" in parts:
            caption = tar.extractfile(parts["txt"]).read().decode("utf-8", errors="replace").strip()
            return {"id": sample_id, "image": images, "conversations": [
                {"from": "human", "value": "<image>\n" * len(images)}, {"from": "gpt", "value": caption}]}
        return DataProblem("bad_format", f"sample {key} has members {sorted(parts)} but no .json record or .txt "
                           "caption. Fix: give each sample a KEY.json (a LLaVA or messages record) or KEY.txt (a "
                           "caption)", sample_id=sample_id, path=str(self.path))


def _clip(error: BaseException, width: int = 200) -> str:
    text = str(error)
    return text if len(text) <= width else text[:width] + "..."


class ParquetShard:
    """One Parquet shard of a stream: its row count from the file's footer, its rows as records (the hub's column
    layouts, `mmadapt.data.tables.RowLayout`) from any position, whole row groups before it skipped unread. Each row
    group is checked from the footer against `limits` before it is decoded (`tables.row_group_refusal`); a refused
    group's rows, a row that does not convert, and the rows after a read error (the shard cannot be read on) are
    counted problems naming the shard and the row, so the stream keeps its positions and goes on."""

    def __init__(self, path: Path, columns: dict[str, str] | None = None, limits: Any = None) -> None:
        from mmadapt.data.table_limits import TableLimits

        self.path, self.columns, self.limits = Path(path), dict(columns or {}), limits or TableLimits()
        self._count: int | None = None

    def __len__(self) -> int:
        if self._count is None:
            self._count = self._file().metadata.num_rows
        return self._count

    def _file(self) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{self.path}: not a readable Parquet shard ({e}). Fix: re-download or rewrite it, or "
                             "remove it from the stream") from None

    def records(self, start: int = 0) -> Iterator[Any]:
        from mmadapt.data.tables import RowLayout

        file = self._file()
        rows = RowLayout(str(self.path), file.schema_arrow.names, self.columns, self.limits)
        first = 0
        for group in range(file.num_row_groups):
            size = file.metadata.row_group(group).num_rows
            if first + size > start:
                yield from self._group(file, rows, group, first, start)
            first += size

    def _group(self, file: Any, rows: Any, group: int, first: int, start: int) -> Iterator[Any]:
        """Row group `group`'s records (rows `first`... of the shard) from row `start` on."""
        from mmadapt.data.table_limits import RowGroupRefused, decoded_batches, row_group_refusal

        index, end = first, first + file.metadata.row_group(group).num_rows
        refusal, reason = row_group_refusal(file.metadata, group, self.limits), "table_too_large"
        if refusal is None:
            try:
                for batch in decoded_batches(file, group, self.limits):
                    for row in range(batch.num_rows):
                        if index >= start:
                            yield rows.read_row(batch, row, index)
                        index += 1
                return
            except RowGroupRefused as e:
                refusal = str(e)
            except Exception as e:  # a corrupt page: the group's other rows are counted, the stream goes on
                refusal = f"the shard cannot be read on from row group {group} ({type(e).__name__}: {e})"
                reason = "unreadable_row"
        for k in range(max(index, start), end):
            yield rows.problem(k, reason, refusal)


def _image_order(extension: str) -> tuple[int, str]:
    """Members `0.jpg`, `1.jpg`, ... in their number's order, then the others by name."""
    head = extension.split(".", 1)[0]
    return (int(head), extension) if head.isdigit() else (1 << 30, extension)


def _cached_count(path: Path) -> int:
    """The shard's sample count, from its headers once, then from the records cache, keyed by the shard's
    `records.stat_key` (a shard changed with its size and mtime kept, by `cp -p` or `tar x`, is counted again)."""
    import hashlib

    from mmadapt.data.records import cache_root, stat_key, write_text_atomic

    index = cache_root() / "shards" / f"{hashlib.sha256(stat_key(path).encode()).hexdigest()}.json"
    if index.is_file():
        try:
            return int(json.loads(index.read_text())["samples"])
        except (ValueError, KeyError, OSError):
            pass
    count = sum(1 for _ in Shard(path).groups())
    index.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(index, json.dumps({"path": str(path), "samples": count}))
    return count


@dataclass(frozen=True)
class StreamLayout:
    """How a rank's loader consumes its streams: what a position means. A checkpoint keeps it."""

    world: int
    workers: int  # DataLoader workers per rank (0: the main process reads)
    micro_batch: int
    grad_accum: int

    @property
    def streams_per_rank(self) -> int:
        return max(self.workers, 1)

    def position(self, step: int, worker: int) -> int:
        """Samples worker `worker`'s stream has yielded after `step` optimizer steps (its batches: every
        `streams_per_rank`-th micro-batch of the rank's, from the worker's own index on)."""
        batches, n = step * self.grad_accum, self.streams_per_rank
        return max(0, (batches - worker + n - 1) // n) * self.micro_batch

    def to_dict(self) -> dict[str, int]:
        return {"world": self.world, "workers": self.workers, "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum}


class StreamingDataset(torch.utils.data.IterableDataset):
    """A rank's part of a WebDataset stream: its workers' streams, encoded (`SampleEncoder`), from `start_step`.
    `len()` is the stream's samples per epoch (all shards, counted from their headers)."""

    def __init__(self, pattern: str, encoder: Any, *, buffer: int = DEFAULT_BUFFER, seed: int = 0) -> None:
        self.pattern, self.encoder, self.buffer, self.seed = pattern, encoder, buffer, seed
        config = getattr(encoder, "config", None)
        columns = getattr(config, "columns", None)
        self.shards = [shard_of(p, columns, config) for p in shard_files(pattern)]
        self.rank, self.layout, self.start_step = 0, StreamLayout(1, 0, 1, 1), 0

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def for_rank(self, rank: int, layout: StreamLayout, start_step: int = 0) -> StreamingDataset:
        """This dataset as rank `rank` reads it under `layout`, from `start_step` on."""
        streams = layout.world * layout.streams_per_rank
        if streams > len(self.shards):
            raise ValueError(f"the stream {self.pattern!r} has {len(self.shards)} shards, fewer than its {streams} "
                             f"readers ({layout.world} ranks x {layout.streams_per_rank} loader processes): each "
                             "reader needs a shard of its own. Fix: fewer data.num_workers, or more, smaller shards")
        if len(self) == 0:
            raise ValueError(f"the stream {self.pattern!r} holds no samples in its {len(self.shards)} shards")
        copy = StreamingDataset.__new__(StreamingDataset)
        copy.__dict__.update(self.__dict__)
        copy.rank, copy.layout, copy.start_step = rank, layout, start_step
        return copy

    def shards_of(self, stream: int, epoch: int) -> list[Shard | ParquetShard]:
        """Stream `stream`'s shards in epoch `epoch`: every streams-th of the epoch's seeded shard order."""
        streams = self.layout.world * self.layout.streams_per_rank
        order = torch.randperm(len(self.shards), generator=torch.Generator().manual_seed(hash_seed(self.seed, epoch)))
        return [self.shards[int(k)] for k in order[stream::streams]]

    def raw(self, stream: int, start: int = 0) -> Iterator[Any]:
        """Stream `stream`'s records (or problems), from its sample `start` on, forever, shuffled in blocks."""
        epoch, skip = 0, start
        while True:
            shards = self.shards_of(stream, epoch)
            size = sum(len(s) for s in shards)
            if skip >= size:
                epoch, skip = epoch + 1, skip - size
                continue
            block, offset = divmod(skip, self.buffer)
            yield from self._blocks(shards, stream, epoch, block, offset, size)
            epoch, skip = epoch + 1, 0

    def _blocks(self, shards: list[Shard | ParquetShard], stream: int, epoch: int, block: int, offset: int,
                size: int) -> Iterator[Any]:
        records = self._from(shards, block * self.buffer)
        while block * self.buffer < size:
            items = [next(records) for _ in range(min(self.buffer, size - block * self.buffer))]
            generator = torch.Generator().manual_seed(hash_seed(self.seed, stream, epoch, block))
            for k in torch.randperm(len(items), generator=generator).tolist()[offset:]:
                yield items[k]
            block, offset = block + 1, 0

    @staticmethod
    def _from(shards: Sequence[Shard | ParquetShard], start: int) -> Iterator[Any]:
        for shard in shards:
            if start >= len(shard):
                start -= len(shard)
                continue
            yield from shard.records(start)
            start = 0

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        stream = self.rank * self.layout.streams_per_rank + worker
        for index, record in enumerate(self.raw(stream, self.layout.position(self.start_step, worker))):
            yield self.encode(record, index)

    def encode(self, record: Any, index: int) -> Any:
        if isinstance(record, DataProblem):
            return record
        return guarded(lambda: self.encoder.encode(record, index), lambda: str(record.get("id", index)))

    def __repr__(self) -> str:
        return f"StreamingDataset({self.pattern!r}, {len(self.shards)} shards, buffer {self.buffer})"


def is_shard_source(path: str | os.PathLike) -> bool:
    """A `.tar` file, a glob of `.tar` or `.parquet` shards, or a directory holding `.tar` files (and no Parquet /
    Arrow: a directory of Parquet files is a dataset, `mmadapt.data.tables`)."""
    text = os.fspath(path)
    if text.endswith(".tar") or (glob.has_magic(text) and text.endswith(SHARD_SUFFIXES)):
        return True
    p = Path(text)
    return p.is_dir() and any(p.glob("*.tar")) and not any(p.glob("*.parquet")) and not any(p.glob("*.arrow"))


def as_stream(value: Any) -> dict[str, Any] | None:
    """`data.train` as a stream: `{stream: SHARDS, buffer: N}` (`stream_source`), or a plain path of WebDataset tar
    shards (a `.tar`, a `*.tar` glob, a directory of them), which streams with the default buffer: read in order,
    its cost per sample never grows with the position. None for anything else."""
    stream = stream_source(value)
    if stream is not None or not isinstance(value, str | os.PathLike):
        return stream
    text = os.fspath(value)
    if is_shard_source(text) and not text.endswith(".parquet"):
        return {"stream": text, "buffer": DEFAULT_BUFFER}
    return None


class ShardRecords(Sequence):
    """A stream's shards as records in file order, for `data check` / `data show` / `read_records` (no split, no
    shuffle): `len` from the shards' counts, `iter_from(i)` reads on from record i, `records[i]` reads one: a tar
    shard's sample from its own first header (`Shard.record_at`), whatever its position, so a mixture's or an
    evaluation's reads cost what sequential ones do."""

    def __init__(self, pattern: str | os.PathLike, columns: dict[str, str] | None = None,
                 config: Any = None) -> None:
        self.pattern = os.fspath(pattern)
        self.shards = [shard_of(p, columns, config) for p in shard_files(self.pattern)]

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def iter_from(self, start: int) -> Iterator[Any]:
        return StreamingDataset._from(self.shards, start)

    def __iter__(self) -> Iterator[Any]:
        return self.iter_from(0)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return list(islice(self.iter_from(start), max(stop - start, 0)))
            return [self[i] for i in range(start, stop, step)]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of {len(self)} in {self.pattern}")
        for shard in self.shards:
            if index < len(shard):
                return shard.record_at(index) if isinstance(shard, Shard) else next(shard.records(index))
            index -= len(shard)
        raise AssertionError("unreachable: the index was checked against the shards' counts")

    def __repr__(self) -> str:
        return f"ShardRecords({self.pattern!r}, {len(self.shards)} shards)"


def write_shards(directory: str | os.PathLike, samples: Sequence[dict[str, bytes]], per_shard: int,
                 prefix: str = "shard") -> list[Path]:
    """`samples` (each {extension: bytes}, with a "__key__") written as WebDataset tar shards of `per_shard` samples:
    what tests and benchmarks stream. Returns the shard paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for start in range(0, len(samples), per_shard):
        path = directory / f"{prefix}-{start // per_shard:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for sample in samples[start : start + per_shard]:
                key = sample["__key__"]
                for extension, data in sample.items():
                    if extension == "__key__":
                        continue
                    info = tarfile.TarInfo(f"{key}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths
