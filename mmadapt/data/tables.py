"""Datasets in the hub's formats as records: Parquet files, Arrow files, `save_to_disk` directories and hub datasets
in the local hub cache, each row given as a LLaVA or messages record when it is asked for, its embedded images as
`EmbeddedImage`s and its embedded videos as `EmbeddedVideo`s.

A source is converted once into the records cache (`mmadapt.data.records`: an Arrow IPC file named by the checksum
of the source's bytes, found again by the files' `records.stat_key`), in record batches of up to `TABLE_ROWS` rows:
Parquet is read with pyarrow, Arrow files and `save_to_disk` directories with `datasets` (its row order and any
indices applied). The converted file is memory-mapped and read a batch at a time, so that opening it touches no
row's data. (`datasets`' own cache is Arrow's stream format, which it opens by reading every record batch: the
whole file would become resident in every process that opens it.)

Column layouts (`LAYOUTS`), recognised from the column names:

- `llava`: `conversations` ([{from, value}]) + `image` or `images` (+ `video` / `videos`, `id`): LLaVA-OneVision-Data,
  ShareGPT4V, LLaVA-Video-178K;
- `messages`: `messages` ([{role, content}], content a string or OpenAI-style parts) + `images` (+ `videos`, `id`):
  LLaMA-Factory, ms-swift, trl's vision sets (llava-instruct-mix);
- `pairs`: `prompt` + `chosen` + `rejected` (+ `images`, `id`): trl's preference sets (RLAIF-V as trl formats it),
  read as DPO pairs (`mmadapt.data.preference`);
- `texts`: `texts` ([{user, assistant}]) + `images`: The Cauldron, FineVision, Docmatix. Their texts hold no image
  placeholder: the images go before the first user text as `<image>\\n` each (the LLaVA convention), so a row gives
  the same tokens as the same sample written as LLaVA JSON.

`columns:` (a data setting) maps the names of a dataset whose columns are named otherwise:
`{conversations: conv, images: pictures}` reads `conv` as `conversations` and `pictures` as `images`. A dataset
whose columns fit no layout is one ValueError naming the columns found and the layouts known.

An image cell is `{bytes, path}` (the `datasets` `Image` feature): its bytes, when present, are the image, checked
from its header before decoding like a file (`mmadapt.data.images`); a path alone is a file relative to the image
root, confined to it like any path in a record. A video cell is the same (the `Video` feature): its bytes are the
video container, opened from memory and checked from its header against the video limits before any frame is
decoded, exactly as a file is (`mmadapt.data.video.decode`).

Sizes are checked before anything is decoded (`mmadapt.data.table_limits`): the layout from the schema before any
conversion, each Parquet row group from the footer before it is decoded (a refused group's rows, and the rest of a
group that cannot be read on, are kept in the conversion as null rows holding their problem, `PROBLEM_COLUMN`), each
Arrow file from its IPC metadata before any batch is read; a row that does not convert (a text cell that is not
UTF-8) or holds a cell over `max_cell_bytes` is that row's problem, naming the file and the row. A refused or failed
conversion leaves nothing in the cache. A `save_to_disk` directory is read only through the files its `state.json`
names inside it (`saved_files`).

A hub dataset is named `hub:OWNER/NAME[/SUBSET][@SPLIT]` (`HubDataset`; split default `train`, subset default the
dataset's default config) and read from the local hub cache only, never the network: `huggingface_hub` finds the
snapshot of `refs/main` in the cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`, read
when the source is opened), and `datasets` says which of its files are the subset's split, as the hub does (the
README's `configs:` YAML, else the `data/{split}-*` and `{subset}/{split}-*` file-name conventions). Those Parquet or
Arrow shards, in `datasets`' order, are one source, converted like a local directory of them. A snapshot holding a
dataset script (`NAME.py`) is refused: mmadapt never runs a dataset's code (`datasets` >= 4 refuses it too). The
README's `configs:` paths are checked before `datasets` resolves them (a URL or `hf://` path would make it connect;
an absolute path or `..` would read files of no dataset), and every file found must resolve, links followed, inside
the dataset's `datasets--OWNER--NAME` folder (the snapshot's files are links into its `blobs/`). Not
`hf://datasets/...`: that is an fsspec path into the repository's files, where a third part is a folder, not a
subset.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from mmadapt.data.images import EmbeddedImage
from mmadapt.data.problems import DataProblem
from mmadapt.data.records import MappedBatches, cached_arrow, write_batches
from mmadapt.data.table_limits import (
    TABLE_ROWS,
    RowGroupRefused,
    TableLimits,
    check_arrow_files,
    decoded_batches,
    row_group_refusal,
)
from mmadapt.data.video.decode import EmbeddedVideo

LAYOUTS: dict[str, tuple[str, ...]] = {"llava": ("conversations",), "messages": ("messages",), "texts": ("texts",),
                                       "pairs": ("prompt", "chosen", "rejected")}
"""layout -> the columns that identify it (the first layout whose columns are all present is taken)."""
IMAGE_COLUMNS = ("images", "image")
VIDEO_COLUMNS = ("videos", "video")
TABLE_SUFFIXES = (".parquet", ".arrow")
HUB_SCHEME = "hub:"
HUB_FORM = "hub:OWNER/NAME[/SUBSET][@SPLIT]"


@dataclass(frozen=True)
class HubDataset:
    """A dataset of the hub, read from the local hub cache (see the module docstring): `repo_id` OWNER/NAME, `subset`
    the config name (None: the dataset's default), `split`."""

    repo_id: str
    subset: str | None = None
    split: str = "train"

    @classmethod
    def parse(cls, text: str) -> HubDataset:
        """`hub:OWNER/NAME[/SUBSET][@SPLIT]` as a `HubDataset`; a ValueError showing the form when it is not one."""
        body, at, split = text.removeprefix(HUB_SCHEME).partition("@")
        parts = body.split("/")
        if not text.startswith(HUB_SCHEME) or len(parts) not in (2, 3) or not all(parts) or "@" in split \
                or (at and not split):
            raise ValueError(f"{text!r}: a hub dataset is written {HUB_FORM}, e.g. "
                             "hub:HuggingFaceM4/the_cauldron/ai2d@train")
        return cls("/".join(parts[:2]), parts[2] if len(parts) == 3 else None, split or "train")

    def __str__(self) -> str:
        return f"{HUB_SCHEME}{self.repo_id}{'/' + self.subset if self.subset else ''}@{self.split}"

    def files(self) -> list[Path]:
        """The subset's split's Parquet or Arrow files in the cached snapshot, in order; one-line ValueErrors when the
        dataset is not cached, is a script, or has no such subset or split."""
        snapshot = self.snapshot()
        script = snapshot / f"{self.repo_id.split('/')[1]}.py"
        if script.is_file():
            raise ValueError(f"{self}: {self.repo_id} is a dataset script ({script.name}), and mmadapt never runs a "
                             "dataset's code. Fix: where you trust it, load it with datasets and save its splits "
                             "with to_parquet, then give that directory as the source")
        readme = snapshot / "README.md"
        for path in readme_paths(readme):
            if "://" in path or path.startswith(("/", "~")) or ".." in PurePosixPath(path).parts:
                raise ValueError(f"{self}: {readme} names the data files {path!r}, not a path inside the dataset "
                                 "(an absolute path, a URL or '..'); mmadapt reads only the dataset's own files, "
                                 "offline. Fix: download a dataset whose README names its own files")
        builder = self._builder(snapshot)
        splits = dict(builder.config.data_files or {})
        if self.split not in splits:
            raise ValueError(f"{self}: no split {self.split!r} in subset {builder.config.name!r} of {self.repo_id}; "
                             f"its splits: {list(splits)}. Fix: name one after '@'")
        repo = snapshot.parent.parent  # the snapshot's files are links into the repository's blobs/
        files = [inside(Path(f), repo, f"{self}: {readme}") for f in splits[self.split]]
        odd = [f for f in files if f.suffix not in TABLE_SUFFIXES or not f.is_file()]
        if odd:
            raise ValueError(f"{self}: {odd[0]} is not a Parquet or Arrow file in the snapshot; mmadapt reads a hub "
                             "dataset's Parquet or Arrow files. Fix: give that file itself as the source")
        return files

    def snapshot(self) -> Path:
        """The cached snapshot of the dataset's `refs/main`, found without the network."""
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        cache = hub_cache()
        try:
            return Path(snapshot_download(self.repo_id, repo_type="dataset", cache_dir=cache, local_files_only=True))
        except LocalEntryNotFoundError as e:  # also an incomplete snapshot (IncompleteSnapshotError)
            raise ValueError(f"{self}: dataset {self.repo_id} is not (completely) in the local hub cache {cache} "
                             "(mmadapt reads the hub offline). Fix: on a machine with internet run `hf download "
                             f"--repo-type dataset {self.repo_id}` (huggingface-cli download on older versions) "
                             "and copy its cache here, or set HF_HUB_CACHE to the cache that holds it") from e

    def _builder(self, snapshot: Path) -> Any:
        """`datasets`' builder of the subset (its data files resolved as the hub resolves them; no code is run)."""
        datasets = _datasets()
        try:
            return datasets.load_dataset_builder(str(snapshot), name=self.subset)
        except FileNotFoundError as e:  # datasets' EmptyDatasetError / DataFilesNotFoundError
            raise ValueError(f"{self}: the cached snapshot {snapshot} holds no data files datasets recognises "
                             f"({type(e).__name__}). Fix: download the dataset again") from None
        except ValueError:
            known = datasets.get_dataset_config_names(str(snapshot))
            if self.subset is not None and self.subset not in known:
                raise ValueError(f"{self}: no subset {self.subset!r} in {self.repo_id}; its subsets: {known}. Fix: "
                                 f"write {HUB_SCHEME}{self.repo_id}/SUBSET with one of them") from None
            if self.subset is None:
                raise ValueError(f"{self}: {self.repo_id} has several subsets and none is the default; its "
                                 f"subsets: {known}. Fix: write {HUB_SCHEME}{self.repo_id}/SUBSET") from None
            raise


def readme_paths(readme: Path) -> list[str]:
    """The data file paths and data directories a dataset card's `configs:` YAML names (none without a card)."""
    from huggingface_hub.repocard import metadata_load

    try:
        configs = (metadata_load(readme) or {}).get("configs") if readme.is_file() else None
    except Exception as e:  # YAML that does not parse: the card is not read by guessing
        raise ValueError(f"{readme}: its YAML header does not parse ({type(e).__name__}: "
                         f"{' '.join(str(e).split())}). Fix: download the dataset again") from None
    out: list[str] = []
    for config in configs if isinstance(configs, list) else []:
        if isinstance(config, dict):
            out += _paths(config.get("data_files")) + _paths(config.get("data_dir"))
    return out


def _paths(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [p for v in value for p in _paths(v.get("path") if isinstance(v, dict) else v)]
    if isinstance(value, dict):
        return [p for v in value.values() for p in _paths(v)]
    return []


def hub_cache() -> Path:
    """The hub cache directory as `huggingface_hub` derives it from the environment, read now (its own constant is
    fixed when it is imported, so a later `HF_HUB_CACHE` or `HF_HOME` would be missed)."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def is_hub_source(path: str | os.PathLike) -> bool:
    """A `hub:` dataset name (a path is a `PathLike` or a string without the scheme)."""
    return isinstance(path, str) and path.startswith(HUB_SCHEME)


def is_table_source(path: str | os.PathLike) -> bool:
    """A Parquet or Arrow file, or a directory of them, or a `save_to_disk` directory."""
    path = Path(path)
    if path.is_dir():
        return (path / "state.json").is_file() or any(_table_files(path))
    return path.suffix in TABLE_SUFFIXES


def _table_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.suffix in TABLE_SUFFIXES and p.is_file())


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ImportError("reading Arrow and save_to_disk datasets needs the `datasets` package. Fix: pip install "
                          "'mmadapt[datasets]'") from e
    datasets.disable_progress_bars()
    return datasets


@dataclass(frozen=True)
class TableSource:
    """A dataset's files, opened as far as their schema and footers: `names` (its columns, the layout checked from
    them before anything is converted) and `convert(limits)`, the records cache's copy."""

    name: str
    kind: str  # .parquet, .arrow-table or .saved: conversions of the same bytes kept apart
    files: list[Path]
    names: list[str]
    dataset: Any = None  # the `datasets.Dataset` of Arrow files and `save_to_disk` directories

    @classmethod
    def open(cls, path: Path | HubDataset, limits: TableLimits) -> TableSource:
        if isinstance(path, HubDataset):
            return cls.of_files(path.files(), str(path), limits)
        if path.is_dir() and (path / "state.json").is_file():
            files = saved_files(path)
            check_arrow_files(files, limits)
            dataset = _datasets().load_from_disk(str(path))
            return cls(str(path), ".saved", files, list(dataset.column_names), dataset)
        files = _table_files(path) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"{path}: no .parquet or .arrow files in it")
        return cls.of_files(files, str(path), limits)

    @classmethod
    def of_files(cls, files: list[Path], name: str, limits: TableLimits) -> TableSource:
        if len({f.suffix for f in files}) > 1:
            raise ValueError(f"{name}: holds both Parquet and Arrow files; give one kind")
        if files[0].suffix == ".arrow":
            check_arrow_files(files, limits)
            datasets = _datasets()
            parts = [datasets.Dataset.from_file(str(f)) for f in files]
            dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
            return cls(name, ".arrow-table", files, list(dataset.column_names), dataset)
        schema = _parquet_schema(files[0])
        for f in files[1:]:
            if not _parquet_schema(f).equals(schema, check_metadata=False):
                raise ValueError(f"{f}: its columns differ from {files[0]}'s; a dataset's Parquet files share one "
                                 "schema")
        return cls(name, ".parquet", files, list(schema.names))

    def convert(self, limits: TableLimits) -> Path:
        """The records cache's copy (see the module docstring); a refused or failed conversion leaves nothing."""
        if self.dataset is not None:
            return cached_arrow(self.files, self.kind, lambda target: _write_dataset(self.dataset, target))
        cache_schema = pa_schema_with_problems(_parquet_schema(self.files[0]))
        return cached_arrow(self.files, f"{self.kind}-{limits.key}",
                            lambda target: write_batches(target, cache_schema, self._batches(cache_schema, limits)))

    def file_rows(self) -> list[tuple[str, int]]:
        """(file, its first row in the dataset) of each Parquet file, from the footers (Arrow sources: [])."""
        import pyarrow.parquet as pq

        if self.dataset is not None:
            return []
        out, start = [], 0
        for f in self.files:
            out.append((str(f), start))
            start += pq.ParquetFile(f).metadata.num_rows
        return out

    def _batches(self, schema: Any, limits: TableLimits) -> Iterator[Any]:
        """The Parquet files' rows as record batches of `schema` (theirs + `PROBLEM_COLUMN`): a row group refused by
        the limits, or that cannot be read on, gives null rows holding the problem (`reason<TAB>what`)."""
        import pyarrow.parquet as pq

        for f in self.files:
            file = pq.ParquetFile(f)
            for group in range(file.num_row_groups):
                rows, done = file.metadata.row_group(group).num_rows, 0
                refusal = row_group_refusal(file.metadata, group, limits)
                if refusal is None:
                    try:
                        for batch in decoded_batches(file, group, limits):
                            yield _with_problems(batch, schema, None)
                            done += batch.num_rows
                        continue
                    except RowGroupRefused as e:
                        refusal = f"table_too_large\t{e}"
                    except Exception as e:  # a corrupt page: the group's other rows are its problem, not the run's
                        refusal = f"unreadable_row\trow group {group} cannot be read on ({type(e).__name__}: {e})"
                else:
                    refusal = f"table_too_large\t{refusal}"
                if done < rows:
                    yield _with_problems(None, schema, refusal, rows - done)


PROBLEM_COLUMN = "__mmadapt_problem__"
"""A converted Parquet source's extra column: null, or why the row could not be read (its row group refused)."""


def pa_schema_with_problems(schema: Any) -> Any:
    import pyarrow as pa

    return pa.schema([f.with_nullable(True) for f in schema] + [pa.field(PROBLEM_COLUMN, pa.string())])


def _with_problems(batch: Any, schema: Any, problem: str | None, rows: int = 0) -> Any:
    import pyarrow as pa

    if batch is None:
        columns = [pa.nulls(rows, f.type) for f in schema][:-1]
        return pa.record_batch([*columns, pa.array([problem] * rows, pa.string())], schema=schema)
    return pa.record_batch([*batch.columns, pa.nulls(batch.num_rows, pa.string())], schema=schema)


def saved_files(directory: Path) -> list[Path]:
    """The Arrow files a `save_to_disk` directory's `state.json` names, each a file inside the directory (symlinks
    resolved): a name that is absolute, leaves the directory or is missing is one line naming the file and path."""
    state = directory / "state.json"
    try:
        entries = json.loads(state.read_text())["_data_files"]
        names = [e["filename"] for e in entries]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{state}: not a save_to_disk state ({type(e).__name__}: {e}). Fix: save the dataset "
                         "again with save_to_disk") from None
    files = []
    for name in names:
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"{state}: names the data file {name!r}, which is not a file of the dataset's own "
                             "directory; mmadapt reads only the dataset's files. Fix: save the dataset again")
        files.append(inside(directory / name, directory, str(state)))
    if not files:
        raise ValueError(f"{state}: names no data files")
    return files


def inside(path: Path, root: Path, what: str) -> Path:
    """`path`, when it (its symlinks resolved) is a file inside `root`; else one line naming `what` and the path."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise ValueError(f"{what}: {path} resolves to {resolved}, outside {root}; mmadapt reads only a dataset's own "
                         "files. Fix: copy the file into the dataset, or give it as a source of its own")
    if not resolved.is_file():
        raise ValueError(f"{what}: {path} is not a file")
    return path


def _parquet_schema(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e}). Fix: re-download or rewrite the file") from None


def _write_dataset(dataset: Any, target: Path) -> None:
    tables = dataset.with_format("arrow").iter(batch_size=TABLE_ROWS)  # raw cells, in the dataset's row order
    batches = (batch for table in tables for batch in table.to_batches())
    write_batches(target, dataset.data.schema, batches)


def layout_of(columns: Sequence[str], mapping: Mapping[str, str], source: str) -> str:
    """The layout these columns fit once renamed by `mapping` (theirs -> ours); a ValueError naming the columns
    found when none."""
    names = {mapping.get(c, c) for c in columns}
    missing = [c for c in mapping if c not in columns]
    if missing:
        raise ValueError(f"{source}: columns: names {missing} that the dataset does not have; its columns: "
                         f"{list(columns)}")
    for layout, needed in LAYOUTS.items():
        if all(n in names for n in needed):
            return layout
    known = "; ".join(f"{k}: {' + '.join(v)}" for k, v in LAYOUTS.items())
    raise ValueError(f"{source}: no known column layout in columns {list(columns)} (known: {known}, with images in "
                     f"'images' or 'image'). Fix: map yours with data.columns, e.g. {{conversations: <your column>}}")


class RowLayout:
    """How a table's rows become records: its `layout` (`LAYOUTS`, from its column names and `columns`), and `source`
    (a file) for the problems' where. `TableRecords` reads rows from the records cache; a streamed Parquet shard
    (`mmadapt.data.stream`) from the file."""

    def __init__(self, source: str, names: Sequence[str], columns: Mapping[str, str] | None = None,
                 limits: TableLimits | None = None) -> None:
        self.source, self.limits = source, limits or TableLimits()
        self.columns = dict(columns or {})  # ours -> theirs
        self.layout = layout_of(names, {v: k for k, v in self.columns.items()}, self.source)

    def read_row(self, batch: Any, row: int, index: int) -> Any:
        """Row `row` of a decoded record batch (row `index` of the source) as a record, or the `DataProblem` that
        stops it: a cell over `max_cell_bytes` (measured on the buffers, before any Python object is made), a row
        that does not convert (a text cell that is not UTF-8)."""
        try:
            for name, column in zip(batch.schema.names, batch.columns, strict=True):
                size = column.slice(row, 1).nbytes  # the bytes of the cell's buffers
                if size > self.limits.max_cell_bytes:
                    return self.problem(index, "table_too_large", f"column {name!r} holds {size} bytes, over "
                                        f"max_cell_bytes = {self.limits.max_cell_bytes}: not read")
            values = batch.slice(row, 1).to_pylist()[0]
        except Exception as e:  # e.g. UnicodeDecodeError: this row's problem; the others are read
            return self.problem(index, "unreadable_row", f"cannot be read ({type(e).__name__}: {e})")
        values.pop(PROBLEM_COLUMN, None)
        return self.row_record(values, index)

    def problem(self, index: int, reason: str, what: str) -> DataProblem:
        """Row `index`'s problem, naming its file and its row there (`where`)."""
        file, row = self.where(index)
        return DataProblem(reason, f"{file} row {row}: {what}", sample_id=f"row {row}", path=file)

    def where(self, index: int) -> tuple[str, int]:
        """(the file, the row in it) of row `index`."""
        return self.source, index

    def row_record(self, row: dict[str, Any], index: int) -> Any:
        """Row `index` (its columns by the dataset's names) as a record, or the `DataProblem` that stops it."""
        theirs = {v: k for k, v in self.columns.items()}
        row = {theirs.get(k, k): v for k, v in row.items()}
        try:
            return self.record(row, index)
        except DataProblem as problem:
            return problem

    def record(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        """Row `index` as a LLaVA or messages record."""
        sample_id = str(row["id"]) if row.get("id") is not None else str(index)
        images = self._media(row, IMAGE_COLUMNS, index, sample_id)
        videos = self._media(row, VIDEO_COLUMNS, index, sample_id)
        if self.layout == "llava":
            return {"id": sample_id, "conversations": row["conversations"], "image": images, "videos": videos}
        if self.layout == "messages":
            return {"id": sample_id, "messages": row["messages"], "images": images, "videos": videos}
        if self.layout == "pairs":  # trl's preference layout: a DPO pair (`mmadapt.data.preference`)
            return {"id": sample_id, "prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"],
                    **({"images": images} if images else {})}
        texts = row["texts"]
        if not isinstance(texts, list) or not texts:
            raise DataProblem("bad_format", "'texts' must be a non-empty list of {user, assistant}",
                              sample_id=sample_id, path=self.source)
        conversations = []
        for k, turn in enumerate(texts):
            if not isinstance(turn, dict) or not isinstance(turn.get("user"), str) \
                    or not isinstance(turn.get("assistant"), str):
                raise DataProblem("bad_format", f"texts[{k}] needs 'user' and 'assistant' strings",
                                  sample_id=sample_id, path=self.source)
            user = ("<image>\n" * len(images) if k == 0 else "") + turn["user"]
            conversations += [{"from": "human", "value": user}, {"from": "gpt", "value": turn["assistant"]}]
        return {"id": sample_id, "conversations": conversations, "image": images, "videos": videos}

    def _media(self, row: dict[str, Any], names: tuple[str, ...], index: int, sample_id: str) -> list[Any]:
        column = next((n for n in names if n in row), None)
        cells = row.get(column) if column else None
        if cells is None:
            return []
        cells = cells if isinstance(cells, list) else [cells]
        out = []
        for k, cell in enumerate(cells):
            where = f"{self.source} row {index} {column}[{k}]"
            if isinstance(cell, dict) and cell.get("bytes") is not None:
                embedded = EmbeddedVideo if column in VIDEO_COLUMNS else EmbeddedImage
                out.append(embedded(bytes(cell["bytes"]), where))
            elif isinstance(cell, dict) and isinstance(cell.get("path"), str):
                out.append(cell["path"])
            elif isinstance(cell, str | list):
                out.append(cell)  # a path, or a video's frame paths
            else:
                raise DataProblem("bad_format", f"{column}[{k}] is neither bytes nor a path: {str(cell)[:80]}",
                                  sample_id=sample_id, path=self.source)
        return out


class TableRecords(RowLayout, Sequence):
    """A dataset's rows as records (see the module docstring); `records[i]` reads row i only. Pickles as its cache
    path."""

    def __init__(self, path: str | os.PathLike | HubDataset, columns: Mapping[str, str] | None = None,
                 limits: TableLimits | None = None) -> None:
        limits = limits or TableLimits()
        source = TableSource.open(path if isinstance(path, HubDataset) else Path(path), limits)
        super().__init__(str(path), source.names, columns, limits)  # the layout, before anything is converted
        self._files = source.file_rows()
        self._rows = MappedBatches(source.convert(limits))
        self._problems = PROBLEM_COLUMN in self._rows.schema.names

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)} in {self.source}")
        batch, row = self._rows.batch_of(index)
        if self._problems and (what := batch.column(PROBLEM_COLUMN)[row].as_py()) is not None:
            reason, _, what = what.partition("\t")
            return self.problem(index, reason, what)
        return self.read_row(batch, row, index)

    def where(self, index: int) -> tuple[str, int]:
        if not self._files:
            return self.source, index
        starts = [start for _, start in self._files]
        k = bisect.bisect_right(starts, index) - 1
        return self._files[k][0], index - starts[k]

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"TableRecords({self.source!r}, {len(self)} rows, layout {self.layout!r})"
