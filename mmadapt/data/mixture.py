"""Several training sources as one: `data.train` as a list, each source with a weight or a sample count.

    data:
      train:
        - {path: llava_onevision_si.parquet, weight: 3}
        - {path: sharegpt4v.json, weight: 1}

or, counts per epoch (ms-swift's `dataset#N`; a source with neither takes its size):

        - {path: textvqa.jsonl, samples: 20000}
        - docvqa.parquet

An epoch of the mixture holds `n_k` samples of source k: its `samples`, or, with weights, its share of the sources'
total size (`n_k = round(w_k / sum(w) * sum(len))`). A source asked for fewer samples than it has gives a different
part of itself each epoch (it is read in the order of its own seeded permutations, one after the other, so every
sample comes once before any comes twice); a source asked for more repeats, each pass in a new order. The epoch's
`sum(n_k)` slots are then shuffled by `GlobalBatchSampler` like any dataset's, so each global batch holds the sources
in their ratio up to sampling error (a hypergeometric draw of the batch's size from the epoch).

Everything is a pure function of (seed, index): `Mixture[e * len + i]` is slot i of epoch e (the sampler's
`epoch_indices`), so a resumed run draws exactly what the uninterrupted run drew, on any number of ranks, with no
state saved beyond the step. Each item carries its source's name (`EncodedSample.source`, `DataProblem.source`), so
the trainer logs samples, problems and loss per source.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmadapt.data.problems import read_guarded
from mmadapt.data.stream import StreamingDataset, as_stream, hash_seed, stream_source

SOURCE_KEYS = ("path", "weight", "samples", "name")


@dataclass(frozen=True)
class Source:
    """One training source: `path` (any file or dataset `read_records` takes), and at most one of `weight` (a share
    of the epoch) or `samples` (samples per epoch); `name` (default: the file's stem) labels its logs."""

    path: str
    weight: float | None = None
    samples: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        where = f"data.train source {self.path!r}"
        if self.weight is not None and self.samples is not None:
            raise ValueError(f"{where} gives both weight and samples: give one (a share of the epoch, or samples "
                             "per epoch)")
        if self.weight is not None and (isinstance(self.weight, bool) or not isinstance(self.weight, int | float)
                                        or not self.weight > 0):
            raise ValueError(f"{where}: weight must be a number > 0, got {self.weight!r}")
        if self.samples is not None and (isinstance(self.samples, bool) or not isinstance(self.samples, int)
                                         or self.samples < 1):
            raise ValueError(f"{where}: samples must be an integer >= 1, got {self.samples!r}")
        if not self.name:
            object.__setattr__(self, "name", _stem(self.path))

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, **({"weight": self.weight} if self.weight is not None else {}),
                **({"samples": self.samples} if self.samples is not None else {}), "name": self.name}


def _stem(path: str) -> str:
    if str(path).startswith("hub:"):  # a hub dataset (`mmadapt.data.tables.HubDataset`): its name, subset and split
        return str(path)[4:]
    p = Path(str(path).rstrip("/"))
    return p.name.removesuffix(".gz").rsplit(".", 1)[0] if p.suffix else p.name


def parse_sources(value: Any) -> tuple[Source, ...] | None:
    """`data.train` / `data.eval` as sources: None, a path (one source), or a list of paths and mappings with the
    keys of `SOURCE_KEYS`. Weights and sample counts are not mixed in one list; names are unique."""
    if value is None:
        return None
    if isinstance(value, str | os.PathLike):
        return (Source(os.fspath(value)),)
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"data.train must be a path or a list of sources ({{path: P, weight: W}} or {{path: P, "
                         f"samples: N}}), got {value!r}")
    sources = []
    for item in value:
        if isinstance(item, str | os.PathLike):
            sources.append(Source(os.fspath(item)))
            continue
        if not isinstance(item, dict) or "path" not in item:
            raise ValueError(f"a data.train source must be a path or a mapping with a path, got {item!r}")
        unknown = sorted(set(item) - set(SOURCE_KEYS))
        if unknown:
            raise ValueError(f"data.train source {item['path']!r}: unknown keys {unknown}; known: {list(SOURCE_KEYS)}")
        sources.append(Source(os.fspath(item["path"]), item.get("weight"), item.get("samples"), item.get("name") or ""))
    weighted = [s for s in sources if s.weight is not None]
    if weighted and len(weighted) != len(sources):
        raise ValueError("data.train: give every source a weight, or none (samples per epoch, or each source's size); "
                         f"weights are missing for {[s.name for s in sources if s.weight is None]}")
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"data.train: two sources are named {twice}: give them distinct `name`s")
    return tuple(sources)


class Mixture(torch.utils.data.Dataset):
    """The sources' datasets as one map-style dataset of `len(self)` slots per epoch; index `e * len(self) + i` is
    slot i of epoch e (see the module's docstring). `datasets[k]` is source k's dataset, any map-style dataset whose
    items are `EncodedSample`s / `DataProblem`s (or anything with a settable `source`)."""

    def __init__(self, sources: Sequence[Source], datasets: Sequence[Any], seed: int = 0) -> None:
        self.sources, self.datasets, self.seed = tuple(sources), list(datasets), seed
        sizes = [len(d) for d in self.datasets]
        for source, size in zip(self.sources, sizes, strict=True):
            if size == 0:
                raise ValueError(f"data.train source {source.name!r} ({source.path}) holds no records")
        if all(s.weight is not None for s in self.sources):
            total, weights = sum(sizes), [s.weight for s in self.sources]
            self.counts = [max(1, round(w / sum(weights) * total)) for w in weights]
        else:
            self.counts = [s.samples if s.samples is not None else size for s, size in zip(self.sources, sizes,
                                                                                            strict=True)]
        self.sizes = sizes
        self.starts = [0]
        for n in self.counts:
            self.starts.append(self.starts[-1] + n)
        self._orders: dict[int, tuple[int, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """(source, the index in the source's dataset) of mixture index `index` (`e * len + i`)."""
        epoch, slot = divmod(index, len(self))
        k = bisect.bisect_right(self.starts, slot) - 1
        drawn = epoch * self.counts[k] + slot - self.starts[k]  # this source's draws before this one
        turn, position = divmod(drawn, self.sizes[k])
        return k, int(self._order(k, turn)[position])

    def _order(self, k: int, turn: int) -> torch.Tensor:
        """Source k's order in its `turn`-th pass: a permutation seeded by (seed, k, turn), the last one kept."""
        kept = self._orders.get(k)
        if kept is None or kept[0] != turn:
            generator = torch.Generator().manual_seed(hash_seed(self.seed, k, turn))
            kept = (turn, torch.randperm(self.sizes[k], generator=generator, dtype=torch.int32))
            self._orders[k] = kept
        return kept[1]

    def __getitem__(self, index: int) -> Any:
        k, inner = self.locate(index)
        item = read_guarded(self.datasets[k], inner)  # a source that cannot give one item costs that item
        item.source = self.sources[k].name
        return item

    def describe(self) -> str:
        """One line per source: its name, path, size and samples per epoch (the share of the epoch)."""
        return "\n".join(f"  {s.name}: {n} samples per epoch ({100 * n / len(self):.1f}%) of {size} records, {s.path}"
                         for s, n, size in zip(self.sources, self.counts, self.sizes, strict=True))


def training_set(value: Any, make: Callable[[str], Any], seed: int = 0, encoder: Any = None, *,
                 stream_shards: bool = True) -> Any:
    """The dataset of `data.train` / `data.eval`: `make(path)` for one path, a `Mixture` of `make(path)`s for a list,
    a `StreamingDataset` (`mmadapt.data.stream`, samples encoded by `encoder`) for `{stream: SHARDS, buffer: N}` and,
    with `stream_shards` (a training set), for a plain path of WebDataset tar shards (`stream.as_stream`: read in
    order, never indexed, so a sample's cost does not grow with its position in the shard). An evaluation set
    (`stream_shards=False`) reads such a path in file order (`make(path)`, `stream.ShardRecords`)."""
    stream = as_stream(value) if stream_shards else stream_source(value)
    if stream is not None:
        return StreamingDataset(stream["stream"], encoder, buffer=stream["buffer"], seed=seed)
    sources = parse_sources(value)
    if sources is None:
        return None
    if isinstance(value, str | os.PathLike):
        return make(sources[0].path)
    return Mixture(sources, [make(s.path) for s in sources], seed=seed)
