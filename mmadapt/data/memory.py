"""The host memory a rank's data loading holds, for the memory plan (`mmadapt plan`): what grows with the dataset.

Records themselves are never Python objects (`mmadapt.data.records`): a file source is memory-mapped from the
records cache, so its pages are the operating system's page cache, shared by the ranks and workers of a machine and
dropped under pressure; the plan reports their size apart (`mapped`). What a rank's processes hold privately, and
how it grows:

- the sampler's epoch order: 8 bytes a sample (an int64 permutation) in the rank's main process;
- a mixture's source orders: each process that reads samples (the DataLoader workers, else the main process) keeps
  its current permutation of each source, 4 bytes a record (`mmadapt.data.mixture`);
- a stream's shuffle buffer: `buffer` raw samples per reader (`mmadapt.data.stream`), a sample's bytes estimated as
  its shards' bytes over their samples; a stream has no sampler and maps nothing.

The DataLoader's prefetched batches (2 per worker) do not grow with the dataset; the GPU plan's workload bounds them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DataMemory:
    """Per rank: `rows` of (what, bytes, how it is counted) held privately by its loading processes, and the bytes
    of the records it maps from the records cache (shared page cache)."""

    rows: list[tuple[str, int, str]] = field(default_factory=list)
    mapped: int = 0

    @property
    def private(self) -> int:
        return sum(b for _, b, _ in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {"private": self.private, "mapped": self.mapped, **{name: b for name, b, _ in self.rows}}


def data_memory(train: Any, *, num_workers: int, columns: dict[str, str] | None = None) -> DataMemory:
    """The host memory of reading `train` (`data.train`: a path, a list of sources or a stream) in one rank with
    `num_workers` DataLoader workers (see the module docstring). Reads the sources' sizes (a file is converted into
    the records cache if it is not there yet, as the run would)."""
    from mmadapt.data.mixture import parse_sources
    from mmadapt.data.samples import read_records
    from mmadapt.data.stream import StreamingDataset, as_stream

    readers = max(num_workers, 1)
    memory = DataMemory()
    stream = as_stream(train)  # {stream: ...}, or a plain path of tar shards, which the run streams too
    if stream is not None:
        data = StreamingDataset(stream["stream"], None, buffer=stream["buffer"])
        samples = max(len(data), 1)
        per_sample = sum(os.path.getsize(s.path) for s in data.shards) // samples
        memory.rows.append(("stream buffers", stream["buffer"] * per_sample * readers,
                            f"{stream['buffer']} samples of ~{per_sample / 1024:.0f} KiB x {readers} reader(s)"))
        return memory
    sources = parse_sources(train) or ()
    sizes = []
    for source in sources:
        records = read_records(source.path, errors="report", columns=columns)
        sizes.append(len(records))
        memory.mapped += _mapped_bytes(records)
    if isinstance(train, list | tuple):  # a mixture: its epoch's slots and each source's order per reader
        from mmadapt.data.mixture import Mixture

        slots = len(Mixture(sources, [_Sized(n) for n in sizes]))
        memory.rows.append(("sampler", 8 * slots, f"the epoch's order: 8 B x {slots:,} slots, main process"))
        memory.rows.append(("mixture orders", 4 * sum(sizes) * readers,
                            f"4 B x {sum(sizes):,} records x {readers} reader(s)"))
    else:
        memory.rows.append(("sampler", 8 * sum(sizes), f"the epoch's order: 8 B x {sum(sizes):,} samples, main "
                            "process"))
    return memory


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _mapped_bytes(records: Any) -> int:
    """The size of the records-cache file `records` maps (0 for sources read otherwise, e.g. shards)."""
    table = getattr(records, "_rows", None) or getattr(records, "table", None)
    path = getattr(table, "arrow", None) or getattr(table, "path", None)
    return Path(path).stat().st_size if path is not None and Path(path).is_file() else 0
