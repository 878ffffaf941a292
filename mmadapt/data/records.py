"""A data file's records without holding them as Python objects: `Records`, a memory-mapped sequence.

A `.json` (one list, LLaVA's layout) or `.jsonl` file is converted once, streamed (the file is never parsed whole),
to an Arrow IPC file in the records cache, keyed by the SHA-256 of its bytes: each record is kept as its JSON text,
and a JSONL line that does not parse as the problem that `read_records(errors="report")` gives for it. Every later
read (another run, every rank, every loader worker) maps that file: the pages are the operating system's, shared
by every process, and `records[i]` parses record i when it is asked for. Memory does not grow with the file.

The cache is `$MMADAPT_CACHE/records` (default `~/.cache/mmadapt/records`). A file seen before is found by its
path, size and modification time without reading it again (a small stat entry pointing at the checksum); a changed
file has another checksum and is converted again. Conversions are written to a temporary file and renamed (atomic),
under a lock so that ranks starting together convert a file once.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mmadapt.data.problems import DataProblem

FORMAT = 1  # the cache layout; a new value converts every file again
BATCH_ROWS = 8192  # records per Arrow record batch: the unit mapped and located by `Records.__getitem__`
READ_BYTES = 1 << 24  # the JSON list reader's chunk


def cache_root() -> Path:
    """`$MMADAPT_CACHE/records`, default `~/.cache/mmadapt/records`."""
    base = os.environ.get("MMADAPT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mmadapt")
    return Path(base) / "records"


class Records(Sequence):
    """The records of one converted file. `records[i]`: the record as `json.loads` gives it, or the `DataProblem`
    of a line that did not parse. Pickles as its cache path (a loader worker maps the same file)."""

    def __init__(self, arrow: str | os.PathLike, source: str) -> None:
        self.table, self.source = MappedBatches(arrow), source

    @property
    def arrow(self) -> Path:
        return self.table.arrow

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"record {index} of {n} in {self.source}")
        batch, row = self.table.batch_of(index)
        problem = batch.column(1)[row].as_py()
        if problem is not None:
            return DataProblem("bad_format", self.source + problem, sample_id=batch.column(0)[row].as_py())
        return json.loads(batch.column(0)[row].as_py())

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    def problems(self) -> list[DataProblem]:
        """The lines that did not parse (read from the problem column only)."""
        out = []
        for batch in self.table.batches():
            if batch.column(1).null_count == batch.num_rows:
                continue
            for row, problem in enumerate(batch.column(1).to_pylist()):
                if problem is not None:
                    out.append(DataProblem("bad_format", self.source + problem,
                                           sample_id=batch.column(0)[row].as_py()))
        return out

    def __repr__(self) -> str:
        return f"Records({self.source!r}, {len(self)} records, cached at {str(self.arrow)!r})"


def open_records(path: str | os.PathLike) -> Records:
    """The records of a `.json` or `.jsonl` file, converted on first use (see the module docstring)."""
    path = Path(path)
    if path.suffix not in (".json", ".jsonl"):
        raise ValueError(f"{path}: expected a .json or .jsonl file")
    return Records(cached_arrow([path], path.suffix, lambda target: _convert(path, target)), str(path))


def cached_arrow(files: list[Path], kind: str, write: Any) -> Path:
    """The records cache's Arrow IPC file for `files` (in order): found by their paths, sizes and modification times
    without reading them, else named by the SHA-256 of their bytes and written by `write(target)` (to a temporary
    file renamed when complete) under the cache's lock. `kind` keeps conversions of the same bytes apart."""
    stats = [(str(f.resolve()), f.stat()) for f in files]  # FileNotFoundError names the path
    root = cache_root()
    (root / "stat").mkdir(parents=True, exist_ok=True)
    key = "|".join(f"{name}|{st.st_size}|{st.st_mtime_ns}" for name, st in stats)
    seen = root / "stat" / (_digest(f"{FORMAT}|{kind}|{key}") + ".json")
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
        target = root / json.loads(seen.read_text())["arrow"]
        if target.is_file():
            return target
    with _locked(root / "convert.lock"):
        checksum = _digest("|".join(_file_sha256(f) for f in files)) if len(files) > 1 else _file_sha256(files[0])
        target = root / f"{checksum}-{FORMAT}{kind}.arrow"
        if not target.is_file():
            write(target)
        write_text_atomic(seen, json.dumps({"arrow": target.name, "sources": [name for name, _ in stats]}))
    return target


def write_batches(target: Path, schema: Any, batches: Iterator[Any]) -> None:
    """Record batches into an Arrow IPC file at `target`, through a temporary file renamed when complete."""
    import pyarrow as pa

    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".arrow")
    os.close(fd)
    try:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for batch in batches:
                writer.write_batch(batch)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class MappedBatches:
    """An Arrow IPC file, memory-mapped, read a record batch at a time: `row(i)` touches only the batch holding row i
    (opening reads each batch's header, not its data). Pickles as its path."""

    def __init__(self, arrow: str | os.PathLike) -> None:
        self.arrow = Path(arrow)
        self._open()

    def _open(self) -> None:
        import pyarrow as pa

        self._reader = pa.ipc.open_file(pa.memory_map(str(self.arrow), "r"))
        self.schema = self._reader.schema
        self._starts = [0]
        for k in range(self._reader.num_record_batches):
            self._starts.append(self._starts[-1] + self._reader.get_batch(k).num_rows)
        self._batch: tuple[int, Any] | None = None

    def __getstate__(self) -> dict:
        return {"arrow": str(self.arrow)}

    def __setstate__(self, state: dict) -> None:
        self.arrow = Path(state["arrow"])
        self._open()

    def __len__(self) -> int:
        return self._starts[-1]

    def batches(self) -> Iterator[Any]:
        for k in range(self._reader.num_record_batches):
            yield self._reader.get_batch(k)

    def batch_of(self, index: int) -> tuple[Any, int]:
        """(the record batch holding row `index`, the row's place in it)."""
        k = bisect.bisect_right(self._starts, index) - 1
        if self._batch is None or self._batch[0] != k:
            self._batch = (k, self._reader.get_batch(k))  # zero-copy: a view of the mapped file
        return self._batch[1], index - self._starts[k]

    def row(self, index: int) -> dict[str, Any]:
        batch, row = self.batch_of(index)
        return batch.slice(row, 1).to_pylist()[0]


# What parsing one JSON text may raise: JSONDecodeError and UnicodeDecodeError are ValueErrors, so is the refusal of
# an integer of more than `sys.get_int_max_str_digits()` digits; RecursionError for nesting deeper than the parser's.
JSON_ERRORS = (ValueError, RecursionError)


def json_document(path: Path) -> Any:
    raw = path.read_bytes()
    try:
        return json.loads(raw.decode("utf-8-sig"))
    except json.JSONDecodeError as e:
        message = f"{path}:{e.lineno}:{e.colno}: {json_error(e, raw)}"
    except UnicodeDecodeError as e:
        line, line_start = raw.count(b"\n", 0, e.start) + 1, raw.rfind(b"\n", 0, e.start) + 1
        message = f"{path}:{line}: {json_error(e, raw[line_start:], line_start)}"
    except JSON_ERRORS as e:
        message = f"{path}: {json_error(e, raw)}"
    raise ValueError(f"{message}. Fix the file (a .json file is one list that must parse whole; a .jsonl file is read "
                     "line by line, a bad line counted and skipped)")


def json_error(error: BaseException, raw: bytes, offset: int = 0) -> str:
    """What is wrong with a JSON text, in words: the parser's message, or the encoding or limit it hit. `raw`: the
    bytes of the line (`offset`: where they start in what was decoded)."""
    if isinstance(error, UnicodeDecodeError):
        if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
            return "not UTF-8: it starts with a UTF-16 byte-order mark; save the file as UTF-8"
        column = error.start - offset
        return f"not UTF-8: byte 0x{raw[column]:02x} at column {column + 1} is not valid UTF-8; save the file as UTF-8"
    if isinstance(error, json.JSONDecodeError):
        return f"not valid JSON ({error.msg}, column {error.colno})"
    if isinstance(error, RecursionError):
        return "nested too deeply to parse (RecursionError)"
    return f"a value JSON allows but Python refuses ({type(error).__name__}: {error})"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _convert(path: Path, target: Path) -> None:
    """Stream `path`'s records into an Arrow IPC file at `target`."""
    import pyarrow as pa

    schema = pa.schema([("record", pa.large_string()), ("problem", pa.string())],
                       metadata={"mmadapt.format": str(FORMAT)})
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _json_list_rows(path)

    def batches() -> Iterator[Any]:
        texts: list[str] = []
        problems: list[str | None] = []
        written = False
        for text, problem in rows:
            texts.append(text)
            problems.append(problem)
            if len(texts) == BATCH_ROWS:
                yield pa.record_batch([texts, problems], schema=schema)
                written, texts, problems = True, [], []
        if texts or not written:
            yield pa.record_batch([texts, problems], schema=schema)

    write_batches(target, schema, batches())


def _jsonl_rows(path: Path) -> Iterator[tuple[str, str | None]]:
    """(record text, None) per line, or (sample id, the problem) for a line that does not parse; blank lines are
    skipped. The same messages as `read_records`."""
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                if line.strip():
                    json.loads(line)  # checked here, once; kept as text
                    yield line.strip(), None
            except JSON_ERRORS as e:
                # kept without the file's name: another file with the same bytes shares the cache entry
                yield f"line {number}", f":{number}: {json_error(e, raw)}. Fix or remove the line."


def _json_list_rows(path: Path) -> Iterator[tuple[str, None]]:
    """The items of a JSON list, read in chunks: each item is decoded from the buffer and kept as its text. A file
    that is not one list that parses is the one ValueError `read_records` gives for it (the file is parsed
    whole only then, to name the line and column)."""
    decoder = json.JSONDecoder()
    with path.open("rb") as f:
        raw = f.read(READ_BYTES)
        utf8 = _Utf8(first=True)
        buffer, eof = utf8.decode(raw, final=not raw), not raw
        pos = _skip_space(buffer, 0)

        def more() -> bool:
            nonlocal buffer, pos, eof
            if eof:
                return False
            chunk = f.read(READ_BYTES)
            eof = not chunk
            buffer = buffer[pos:] + utf8.decode(chunk, final=eof)
            pos = 0
            return True

        def skip(at: int) -> int:  # past white space, reading on when the buffer ends there
            nonlocal pos
            pos = _skip_space(buffer, at)
            while pos >= len(buffer) and more():
                pos = _skip_space(buffer, pos)
            return pos

        try:
            skip(pos)
            if buffer[pos:pos + 1] != "[":
                raise ValueError("not a list")
            skip(pos + 1)
            if buffer[pos:pos + 1] == "]":
                return
            while True:
                while True:
                    try:
                        _, end = decoder.raw_decode(buffer, pos)
                        if end < len(buffer) or eof:
                            break
                    except json.JSONDecodeError:
                        pass
                    if not more():
                        raise ValueError("item does not parse")
                yield buffer[pos:end], None
                skip(end)
                if buffer[pos:pos + 1] == "]":
                    skip(pos + 1)
                    if pos < len(buffer):
                        raise ValueError("data after the list")
                    return
                if buffer[pos:pos + 1] != ",":
                    raise ValueError("expected , or ]")
                skip(pos + 1)
        except (ValueError, RecursionError):
            data = json_document(path)  # raises the precise error for a file that does not parse
            if not isinstance(data, list):
                raise ValueError(f"{path}: expected a JSON list of samples (or use .jsonl), got "
                                 f"{type(data).__name__}") from None
            raise  # parses whole but not item by item: not expected; keep the reader's own error


def _skip_space(buffer: str, pos: int) -> int:
    while pos < len(buffer) and buffer[pos] in " \t\n\r":
        pos += 1
    return pos


class _Utf8:
    """Incremental UTF-8 decoding (a character split across chunks waits for its end); a byte-order mark at the
    start is dropped, as `utf-8-sig` does."""

    def __init__(self, first: bool) -> None:
        import codecs

        self._decoder = codecs.getincrementaldecoder("utf-8-sig" if first else "utf-8")()

    def decode(self, data: bytes, final: bool) -> str:
        return self._decoder.decode(data, final=final)
