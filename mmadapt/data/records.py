"""A data file's records without holding them as Python objects: `Records`, a memory-mapped sequence.

A `.json` (one list, LLaVA's layout) or `.jsonl` file is converted once, streamed (the file is never parsed whole),
to an Arrow IPC file in the records cache, keyed by the SHA-256 of its bytes: each record is kept as its JSON text,
and a JSONL line that does not parse as the problem that `read_records(errors="report")` gives for it. Every later
read (another run, every rank, every loader worker) maps that file: the pages are the operating system's, shared
by every process, and `records[i]` parses record i when it is asked for. Memory does not grow with the file.

The cache is `$MMADAPT_CACHE/records` (default `~/.cache/mmadapt/records`). A file seen before is found by its
stat (`stat_key`: path, size, modification time, change time, inode and device) without reading it again (a small
stat entry pointing at the checksum); a changed file has another stat, then another checksum, and is converted
again. Conversions are written to a temporary file and renamed (atomic), under a lock so that ranks starting
together convert a file once.
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
    """The records cache's Arrow IPC file for `files` (in order): found by their `stat_key`s without reading them,
    else named by the SHA-256 of their bytes and written by `write(target)` (to a temporary
    file renamed when complete) under the cache's lock. `kind` keeps conversions of the same bytes apart."""
    names = [str(f.resolve()) for f in files]
    key = "|".join(stat_key(f) for f in files)  # FileNotFoundError names the path
    root = cache_root()
    (root / "stat").mkdir(parents=True, exist_ok=True)
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
        write_text_atomic(seen, json.dumps({"arrow": target.name, "sources": names}))
    return target


def stat_key(path: Path) -> str:
    """What says, without reading it, that a file is the one converted before: its resolved path, size, modification
    time, change time (ctime), inode and device. A file whose content changed has another key even when its size and
    modification time were kept (`cp -p`, `tar x`, `touch -r` set the modification time, not the bytes' identity):
    the kernel sets ctime to the clock on every write and on every metadata change, and no call (utime, chmod, cp,
    tar) can set it back; a file replaced by another (a rename, `tar x` unlinking first) has another inode or device.
    Enough, then, short of a change within the same clock tick (a few ms) as the previous one before the file was
    first read. A changed key costs a checksum of the file only: the conversion is named by the SHA-256 of the bytes,
    so a file whose ctime changed without its bytes (chmod) finds its conversion again."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}|{st.st_dev}"


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
    that is not one list that parses is one ValueError naming its line and column, found by the reader where it
    stopped: the file is never parsed whole, not even to name its error."""
    decoder = json.JSONDecoder()
    with path.open("rb") as f:
        text = _Chunks(f, path)
        if text.skip(0) >= len(text.buffer) or text.buffer[text.pos] != "[":
            raise text.error(text.pos, "expected a JSON list of samples (or use .jsonl), got "
                             f"{_KINDS.get(text.buffer[text.pos:text.pos + 1], 'no list')}")
        text.skip(text.pos + 1)
        if text.buffer[text.pos:text.pos + 1] == "]":
            return
        while True:
            while True:  # the item starts at `text.pos` (reading on moves the buffer, not the item)
                try:
                    _, end = decoder.raw_decode(text.buffer, text.pos)
                    if end < len(text.buffer) or text.eof:
                        break
                except json.JSONDecodeError as e:
                    if text.eof:
                        raise text.error(e.pos, f"not valid JSON ({e.msg}, column {text.column_of(e.pos)})") from None
                except JSON_ERRORS as e:
                    raise text.error(text.pos, json_error(e, b"")) from None
                text.more()
            yield text.buffer[text.pos:end], None
            text.skip(end)
            separator = text.buffer[text.pos:text.pos + 1]
            if separator == "]":
                if text.skip(text.pos + 1) < len(text.buffer):
                    raise text.error(text.pos, "not valid JSON (Extra data after the list)")
                return
            if separator != ",":
                raise text.error(text.pos, "not valid JSON (Expecting ',' delimiter or ']' after an item)")
            text.skip(text.pos + 1)


_KINDS = {"{": "dict", '"': "str", "t": "bool", "f": "bool", "n": "None", **dict.fromkeys("-0123456789", "a number")}
FIX_JSON = ("Fix the file (a .json file is one list that must parse whole; a .jsonl file is read line by line, a bad "
            "line counted and skipped)")


class _Chunks:
    """A UTF-8 file read in chunks of `READ_BYTES`: the text not yet consumed is `buffer[pos:]`; the line and column
    of any buffer position are known from the newlines of the text already dropped (for errors)."""

    def __init__(self, f: Any, path: Path) -> None:
        self.f, self.path, self.utf8 = f, path, _Utf8(first=True)
        self.buffer, self.pos, self.eof, self.started = "", 0, False, False
        self.lines, self.column = 0, 0  # newlines in the dropped text, characters after its last newline
        self.more()

    def more(self) -> bool:
        """Read the next chunk onto the buffer (dropping what is before `pos`); False at the end of the file."""
        if self.eof:
            return False
        chunk = self.f.read(READ_BYTES)
        self.eof = not chunk
        dropped, self.buffer, self.pos = self.buffer[:self.pos], self.buffer[self.pos:], 0
        newlines = dropped.count("\n")
        self.lines += newlines
        self.column = len(dropped) - dropped.rfind("\n") - 1 if newlines else self.column + len(dropped)
        try:
            self.buffer += self.utf8.decode(chunk, final=self.eof)
        except UnicodeDecodeError as e:
            if not self.started and chunk.startswith((b"\xff\xfe", b"\xfe\xff")):
                raise self.error(0, json_error(e, chunk)) from None
            good = e.object[:e.start].decode("utf-8", errors="replace")  # the chunk's text before the bad byte
            at = len(self.buffer) + len(good)
            self.buffer += good
            raise self.error(at, f"not UTF-8: byte 0x{e.object[e.start]:02x} at column {self.column_of(at)} is not "
                             "valid UTF-8; save the file as UTF-8") from None
        self.started = True
        return True

    def skip(self, at: int) -> int:
        """`pos` past the white space from `at`, reading on when the buffer ends there."""
        self.pos = _skip_space(self.buffer, at)
        while self.pos >= len(self.buffer) and self.more():
            self.pos = _skip_space(self.buffer, self.pos)
        return self.pos

    def column_of(self, at: int) -> int:
        last = self.buffer.rfind("\n", 0, at)
        return at - last if last >= 0 else self.column + at + 1

    def error(self, at: int, what: str) -> ValueError:
        line = self.lines + self.buffer.count("\n", 0, at) + 1
        return ValueError(f"{self.path}:{line}:{self.column_of(at)}: {what}. {FIX_JSON}")


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
