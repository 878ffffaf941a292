"""A WebDataset tar shard's samples as its headers declare them, before any member is read.

`sample_groups(tar)` groups consecutive file members sharing a name up to the first dot (`000017.jpg`,
`000017.txt`) into one `Group` per sample: its key, its first members (as many as asked: a sample of a million
members costs no memory), and the count and declared bytes of all of them, which `mmadapt.data.stream.Shard` checks
against `SampleLimits` (the data settings `max_images`, `max_sample_members`, `max_sample_bytes`) before it reads
anything. Reading headers only, memory stays flat over a shard: tarfile's list of every header read is emptied
after each sample.

tarfile stops quietly at a header past the first that it cannot parse (cut short, a bad checksum), as if the
archive ended there; `sample_groups` raises `tarfile.ReadError` instead, before it hands over the sample such a break
may have cut short. `sample_offsets(path)` is where each sample's first header starts (extended headers included),
and `open_at(path, offset)` reads the shard from there as an archive of its own: a sample by index costs its own
headers, not the shard's before it.
"""

from __future__ import annotations

import contextlib
import io
import tarfile
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

# A sample's limits from its tar headers (`SampleLimits`; the data settings max_sample_bytes, max_sample_members)
DEFAULT_MAX_SAMPLE_BYTES: Final[int] = 256 * 1024 * 1024
DEFAULT_MAX_SAMPLE_MEMBERS: Final[int] = 128


@dataclass(frozen=True)
class SampleLimits:
    """What one shard sample may declare in its tar headers, checked before any of its members is read: images
    (the data setting `max_images`), members (`max_sample_members`) and bytes of all its members together
    (`max_sample_bytes`)."""

    max_images: int | None = None  # None (no data settings given): the record's parse checks it, after the read
    max_members: int = DEFAULT_MAX_SAMPLE_MEMBERS
    max_bytes: int = DEFAULT_MAX_SAMPLE_BYTES

    @classmethod
    def of(cls, config: Any = None) -> SampleLimits:
        """The limits of `config` (a `DataConfig`); None: the default members and bytes."""
        if config is None:
            return cls()
        return cls(config.max_images, config.max_sample_members, config.max_sample_bytes)


@dataclass
class Group:
    """One sample's members as the shard's headers declare them: the first ones kept (`sample_groups`' `keep`),
    `count` and `size` (declared bytes) over all of them."""

    key: str
    members: list[tarfile.TarInfo]
    count: int
    size: int


def key_and_extension(name: str) -> tuple[str, str]:
    """A member's sample key (its name up to the first dot of its base name) and its extension, lower-cased."""
    directory, _, base = name.rpartition("/")
    stem, _, extension = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), extension.lower()


def sample_groups(tar: tarfile.TarFile, keep: int) -> Iterator[Group]:
    """Each sample of an open tar, in file order, with at most `keep` of its members kept (the others counted).
    Raises `tarfile.TarError` where the shard cannot be read on (the sample it cut is not handed over)."""
    group: Group | None = None
    for info in iter(tar.next, None):
        if not info.isfile():
            continue
        key, _ = key_and_extension(info.name)
        if group is not None and key != group.key:
            yield group
            group = None
            tar.members.clear()  # TarFile keeps every header it read (~0.5 KB each): keep only this sample's
        if group is None:
            group = Group(key, [], 0, 0)
        if len(group.members) < keep:
            group.members.append(info)
        group.count, group.size = group.count + 1, group.size + info.size
    _check_end(tar)  # before the last sample: a break may have cut it short
    if group is not None:
        yield group


def sample_offsets(path: Path) -> array:
    """Where each sample's first header starts in the shard at `path`, from one pass over its headers (those before
    a break, for a broken shard). Empty for a shard with global pax headers: they would not apply to a read starting
    past them, so such a shard is read in order."""
    offsets = array("q")
    try:
        with tarfile.open(path, "r:") as tar:
            for group in sample_groups(tar, keep=1):
                if tar.pax_headers:
                    return array("q")
                offsets.append(group.members[0].offset)  # TarInfo.offset: where its first header starts
    except tarfile.TarError:
        pass
    return offsets


@contextlib.contextmanager
def open_at(path: Path, offset: int) -> Iterator[tarfile.TarFile]:
    """The shard at `path` read from byte `offset` (a sample's first header, `sample_offsets`) as a tar of its own."""
    with open(path, "rb") as file, tarfile.open(fileobj=_From(file, offset), mode="r:") as tar:
        yield tar


class _From(io.RawIOBase):
    """A file from byte `start` on, as a file of its own."""

    def __init__(self, file: Any, start: int) -> None:
        self.file, self.start = file, start
        file.seek(start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self.file.readinto(buffer)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.file.seek(offset + self.start if whence == io.SEEK_SET else offset, whence) - self.start

    def tell(self) -> int:
        return self.file.tell() - self.start


def _check_end(tar: tarfile.TarFile) -> None:
    """Raise `ReadError` unless `tar` stopped at its end: a zero block or the end of the file."""
    tar.fileobj.seek(tar.offset)
    block = tar.fileobj.read(tarfile.BLOCKSIZE)
    if block.strip(b"\0"):
        raise tarfile.ReadError(f"a cut or corrupt tar header at byte {tar.offset}")
