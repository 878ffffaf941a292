"""What a Parquet / Arrow reader checks before it decodes: `TableLimits` (the data settings `max_cell_bytes`,
`max_row_group_bytes`, `max_decode_ratio`, declared with their defaults in `mmadapt.data.config`) against a Parquet
file's footer (`row_group_refusal`: a row group's decoded bytes, each column chunk's decoded / stored bytes and
decoded bytes a row) and an Arrow IPC file's message metadata (`check_arrow_files`: a record batch's bytes, a
compressed body). A crafted file whose cells decode to gigabytes costs its footer read, not its decoding; a cell over
`max_cell_bytes` that the footer cannot show is measured on the decoded buffers before it becomes Python objects
(`tables.RowLayout.read_row`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TABLE_ROWS = 1024  # rows per decoded / converted record batch at most: a row's batch is what reading it maps
BATCH_BYTES = 64 * 1024 * 1024  # decoded bytes a converted / streamed Parquet batch aims at (rows of images are large)

# The defaults of the limits (the data settings'): real hub datasets pass them (LLaVA-OneVision / FineVision rows
# carry images of a few MB, datasets writes 100-row groups of images, a few hundred MB decoded; images barely
# compress, text a few times), a crafted file whose cells decode to gigabytes does not.
DEFAULT_MAX_CELL_BYTES: int = 256 * 1024 * 1024
DEFAULT_MAX_ROW_GROUP_BYTES: int = 1 << 30
DEFAULT_MAX_DECODE_RATIO: float = 100.0
RATIO_FLOOR: int = 16 * 1024 * 1024
"""A column chunk decoding to at most this many bytes is not held to `max_decode_ratio` (a small column of repeated
text may compress a thousand times and still cost nothing)."""


@dataclass(frozen=True, kw_only=True)
class TableLimits:
    """What a Parquet / Arrow reader checks from a file's footer (IPC metadata) before it decodes a row group, and
    from the decoded buffers before a row becomes Python objects (the `DataConfig` fields of the same names)."""

    max_cell_bytes: int = DEFAULT_MAX_CELL_BYTES
    max_row_group_bytes: int = DEFAULT_MAX_ROW_GROUP_BYTES
    max_decode_ratio: float = DEFAULT_MAX_DECODE_RATIO

    @property
    def key(self) -> str:
        """The limits as part of a records-cache name: a conversion depends on them."""
        return f"{self.max_cell_bytes}-{self.max_row_group_bytes}-{self.max_decode_ratio:g}"


def row_group_refusal(metadata: Any, group: int, limits: TableLimits) -> str | None:
    """Why row group `group` of a Parquet file must not be decoded, from the footer alone (None: it may be): its
    decoded bytes over `max_row_group_bytes`, a column chunk decoding over `RATIO_FLOOR` bytes at more than
    `max_decode_ratio` times its stored bytes, or a column's cells over `max_cell_bytes` on average."""
    meta = metadata.row_group(group)
    if meta.total_byte_size > limits.max_row_group_bytes:
        return (f"row group {group} decodes to {meta.total_byte_size} bytes, over max_row_group_bytes = "
                f"{limits.max_row_group_bytes}: not decoded")
    for c in range(meta.num_columns):
        chunk = meta.column(c)
        decoded, stored = chunk.total_uncompressed_size, max(chunk.total_compressed_size, 1)
        if decoded > RATIO_FLOOR and decoded > limits.max_decode_ratio * stored:
            return (f"column {chunk.path_in_schema} of row group {group} decodes to {decoded} bytes from {stored} "
                    f"stored ({decoded / stored:.0f}x), over max_decode_ratio = {limits.max_decode_ratio:g}: not "
                    "decoded")
        if meta.num_rows and decoded / meta.num_rows > limits.max_cell_bytes:
            return (f"column {chunk.path_in_schema} of row group {group} holds {decoded // meta.num_rows} bytes a "
                    f"row on average, over max_cell_bytes = {limits.max_cell_bytes}: not decoded")
    return None


def batch_rows(metadata: Any, group: int) -> int:
    """Rows per decoded batch of row group `group`: about `BATCH_BYTES` decoded, at most `TABLE_ROWS`."""
    meta = metadata.row_group(group)
    per_row = max(1, meta.total_byte_size // max(meta.num_rows, 1))
    return max(1, min(TABLE_ROWS, BATCH_BYTES // per_row))


class RowGroupRefused(ValueError):
    """A row group whose decoded batches add up to more than `max_row_group_bytes`: its other rows are not decoded."""


def decoded_batches(file: Any, group: int, limits: TableLimits) -> Iterator[Any]:
    """Row group `group` of a `pyarrow.parquet.ParquetFile` as record batches of about `BATCH_BYTES` (`batch_rows`),
    counting what they decode to: past `max_row_group_bytes` it raises `RowGroupRefused`. The footer's sizes are what
    the writer said: a dictionary page that every row repeats decodes to more than its bytes (pyarrow's writer says
    52 bytes for a column decoding to 600 MiB), so the decoded bytes are counted too."""
    decoded = 0
    for batch in file.iter_batches(batch_size=batch_rows(file.metadata, group), row_groups=[group]):
        decoded += batch.nbytes
        if decoded > limits.max_row_group_bytes:
            raise RowGroupRefused(f"row group {group} decodes to over {decoded} bytes, more than its footer says "
                                  f"({file.metadata.row_group(group).total_byte_size}) and over max_row_group_bytes "
                                  f"= {limits.max_row_group_bytes}: its other rows not decoded")
        yield batch


def check_arrow_files(files: list[Path], limits: TableLimits) -> None:
    """Arrow IPC files (file or stream format, as `datasets` writes them) checked from their messages' metadata
    before any record batch is read: a compressed body (its decoded size is not in the metadata) and a record batch
    over `max_row_group_bytes` are one-line ValueErrors naming the file and the limit."""
    import pyarrow as pa

    for f in files:
        with pa.memory_map(str(f)) as source:
            if source.read(6) == b"ARROW1":
                source.seek(8)
            else:
                source.seek(0)
            try:
                messages = pa.ipc.MessageReader.open_stream(source)
                batches = (m for m in messages if m.type == "record batch")
                for k, message in enumerate(batches):
                    if message.body.size > limits.max_row_group_bytes:
                        raise ValueError(f"{f}: record batch {k} holds {message.body.size} bytes, over "
                                         f"max_row_group_bytes = {limits.max_row_group_bytes}. Fix: raise the limit "
                                         "(data.max_row_group_bytes) if the file is trusted, or rewrite it in "
                                         "smaller batches")
                    if _ipc_compressed(message.metadata.to_pybytes()):
                        raise ValueError(f"{f}: record batch {k} is compressed, and its decoded size is not in the "
                                         "file's metadata; mmadapt reads uncompressed Arrow files, as datasets "
                                         "writes them. Fix: rewrite it uncompressed or as Parquet")
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{f}: not a readable Arrow file ({e}). Fix: re-download or rewrite the file") \
                    from None


def _ipc_compressed(metadata: bytes) -> bool:
    """Whether an IPC `Message` flatbuffer (Arrow's format/Message.fbs) holds a RecordBatch whose `compression`
    (field 3) is set: its header (field 2) is read through the tables' vtables."""

    def u32(at: int) -> int:
        return int.from_bytes(metadata[at:at + 4], "little")

    def field(table: int, k: int) -> int | None:  # where field k of the table at `table` is, None when absent
        vtable = table - int.from_bytes(metadata[table:table + 4], "little", signed=True)
        entry = vtable + 4 + 2 * k
        if entry + 2 > vtable + int.from_bytes(metadata[vtable:vtable + 2], "little"):
            return None
        offset = int.from_bytes(metadata[entry:entry + 2], "little")
        return table + offset if offset else None

    header = field(u32(0), 2)
    return header is not None and field(header + u32(header), 3) is not None


