"""Directories written so that a reader sees the old one or the new one, never a mix, and never half of either.

`StagedDirectory(target)` is how mmadapt writes every directory it produces (a model directory in either format, a
training checkpoint, LoRA adapters):

    with StagedDirectory(target, what="model directory", overwrite=..., recognise=is_model_directory) as stage:
        ...write files into stage.path, calling stage.record(name) after each one (or use stage.open / write_bytes)
    # here the new directory is at `target`; after an exception `target` is as it was

- The target is checked first: an absent or empty directory is written; one that `recognise` accepts (a directory of
  the same kind) is replaced only with `overwrite=True`; anything else (a file, a symbolic link, a mount point, a
  non-empty directory of another kind) is refused with `TargetExistsError`, since replacing it would delete files
  that mmadapt did not write.
- The files go to a sibling temporary directory `.tmp-<name>~<host>~<pid>~<n>` (the same parent: the swap is a rename
  within one filesystem), locked with `flock` for its writer's life. Each recorded file is fsync'ed, and with
  `checksums=True` its SHA-256 is taken as it is written (`open`, `write_bytes`) or right after (`record`: from the
  page cache, in a background thread while the next file is written); `stage.checksums` then holds
  {relative path: SHA-256} of every file.
- The swap: an atomic exchange of the two directories (Linux `renameat2(RENAME_EXCHANGE)`; ext4, xfs, btrfs, tmpfs)
  where the filesystem supports it, else two renames (old -> `.old-<name>~...`, new -> target); the old directory is
  deleted only when the new one is in place.
- A write error (an `OSError` such as ENOSPC or EFBIG, safetensors' `SafetensorError`, which is not an `OSError`) is
  a `CheckpointWriteError` naming the target and the cause; the temporary directory is removed, the target untouched.
- A writer killed on the way leaves its temporary directory, unlocked. The next write beside it
  (`clean_leftovers`) removes it; an `.old-` directory whose target is missing (a kill between the two renames) is
  renamed back. A directory still locked by its (live) writer is never touched.

A single file that is written in place (a run's lock, log, config, plan, ...: `mmadapt.run_directory`) is opened with
`open_unlinked`, which never writes through a link: a symbolic link (or a hard link) planted at its name would make
the write truncate or append to the file it points to, so it is refused with `LinkedFileError` naming the file,
before anything is written.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import io
import itertools
import logging
import os
import re
import shutil
import socket
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import IO

TMP, OLD = ".tmp-", ".old-"
HOST = socket.gethostname().replace("~", "-")
_COUNTER = itertools.count()
log = logging.getLogger(__name__)


class CheckpointWriteError(OSError):
    """A checkpoint, model directory or adapters directory could not be written (a full disk, a failing device):
    what was there before is intact and no temporary directory is left."""


class TargetExistsError(FileExistsError):
    """The target holds something a write would replace, and replacing it was not asked for (or is never done)."""


class LinkedFileError(ValueError):
    """A file mmadapt writes in place is a link: writing it would write the file the link points to."""


_OPEN_FLAGS = {"w": os.O_WRONLY | os.O_CREAT, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
               "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND}


def open_unlinked(path: str | os.PathLike, mode: str = "w", *, encoding: str | None = "utf-8") -> IO:
    """`open(path, mode)` ("w", "a", "a+", or with "b" for bytes: "wb") that never writes through a link: a symbolic
    link at `path` (`O_NOFOLLOW`), or a name that is not a plain file of its own (a hard link, a FIFO), raises
    `LinkedFileError` naming `path` before anything is truncated or written."""
    text = mode.replace("b", "")
    if text not in _OPEN_FLAGS:
        raise ValueError(f"open_unlinked: mode {mode!r} is not one of {sorted(_OPEN_FLAGS)} (or with 'b')")
    fix = f"Fix: remove it (rm {path}) and run again; mmadapt then creates the file itself"
    try:
        fd = os.open(path, _OPEN_FLAGS[text] | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise LinkedFileError(f"{path} is a symbolic link (to {os.readlink(path)}): mmadapt never writes through a "
                              f"link, which would overwrite the file it points to. {fix}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
            what = "a hard link (the same file has another name)" if stat.S_ISREG(info.st_mode) else "not a file"
            raise LinkedFileError(f"{path} is {what}: mmadapt writes only a plain file of its own there. {fix}")
        os.set_blocking(fd, True)
        if text == "w":
            os.ftruncate(fd, 0)
        return open(fd, mode, encoding=None if "b" in mode else encoding)
    except BaseException:
        os.close(fd)
        raise


def is_write_error(error: BaseException) -> bool:
    """An error of the storage while writing: an `OSError` (not one of ours) or safetensors' `SafetensorError`."""
    if isinstance(error, CheckpointWriteError | TargetExistsError):
        return False
    return isinstance(error, OSError) or type(error).__name__ == "SafetensorError"


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file`, its storage errors as `OSError(errno, message, path)` (safetensors raises a
    `SafetensorError` that is no `OSError`; its message holds the OS error's code)."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata=metadata)
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        code = re.search(r"os error (\d+)", str(e))
        number = int(code.group(1)) if code else errno.EIO
        raise OSError(number, f"{os.strerror(number)} (safetensors: {e})", str(path)) from e


# ---- what a target may be -------------------------------------------------------------------------------------
def check_target(target: Path, *, what: str, overwrite: bool, recognise: Callable[[Path], bool] | None) -> bool:
    """Whether `target` holds a `what` that the write will replace; raises `TargetExistsError` when it must not be
    written (see the module docstring)."""
    if target.is_symlink():
        raise TargetExistsError(f"{target} is a symbolic link: give the real path of the {what} to write")
    if not target.exists():
        return False
    if not target.is_dir():
        raise TargetExistsError(f"{target} is a file, not a directory: choose another path for the {what}")
    if os.path.ismount(target):
        raise TargetExistsError(f"{target} is a mount point: a {what} is swapped in by a rename within one "
                                "filesystem. Write it into a directory inside the mount point.")
    entries = sorted(p.name for p in target.iterdir())
    if not entries:
        return False
    if recognise is None or not recognise(target):
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise TargetExistsError(f"{target} is not empty and does not hold a {what} (it holds {shown}). mmadapt "
                                f"replaces only a whole {what} and never deletes other files: choose a new or empty "
                                "directory.")
    if not overwrite:
        raise TargetExistsError(f"{target} already holds a {what}. Fix: choose another directory, or replace it "
                                "with overwrite=True (for `mmadapt export`: --overwrite); the old one stays until the "
                                "new one is complete.")
    return True


# ---- leftovers and their owners -----------------------------------------------------------------------------
def _leftover(entry: str) -> tuple[str, str, str, int] | None:
    """(kind TMP / OLD, target name, host, pid) of a staging directory's name, or None."""
    for kind in (TMP, OLD):
        if entry.startswith(kind) and entry.count("~") >= 3:
            head, host, pid, n = entry.rsplit("~", 3)
            if pid.isdigit() and n.isdigit():
                return kind, head[len(kind):], host, int(pid)
    return None


def _unowned(path: Path, host: str, pid: int) -> bool:
    """No live writer holds `path`: its `flock` can be taken (the kernel drops a dead process's locks); where the
    filesystem has no `flock`, a process `pid` on this host that no longer exists."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # gone already, or not ours to read
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return host == HOST and not _alive(pid)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(parent: Path, name: str | None = None) -> None:
    """Remove the staging directories in `parent` (of target `name`, or of any) that no live writer holds; put back
    an `.old-` directory whose target is missing (a writer killed between its two renames)."""
    if not parent.is_dir():
        return
    for entry in sorted(parent.iterdir()):
        found = _leftover(entry.name)
        if found is None or (name is not None and found[1] != name):
            continue
        kind, target_name, host, pid = found
        if kind == OLD and _restore(entry, parent / target_name):
            continue
        if not _unowned(entry, host, pid):
            log.info("leaving %s: its writer (pid %d on %s) is still writing", entry, pid, host)
            continue
        shutil.rmtree(entry, ignore_errors=True)
        log.info("removed %s, left by an interrupted write (pid %d on %s)", entry, pid, host)


def _restore(old: Path, target: Path) -> bool:
    """Put `old` (a previous version moved aside) back at `target` when `target` is missing and no writer holds it."""
    found = _leftover(old.name)
    if found is None or os.path.lexists(target) or not _unowned(old, found[2], found[3]):
        return False
    os.rename(old, target)
    log.warning("%s was missing: a write killed while swapping it left its previous version at %s, put back", target,
                old.name)
    return True


def recover(target: str | os.PathLike) -> bool:
    """When `target` is missing because a writer was killed mid-swap, put its previous version back (and nothing
    else: temporary directories are left to the next writer); True if so."""
    target = Path(os.path.abspath(target))
    if os.path.lexists(target) or not target.parent.is_dir():
        return False
    prefix = f"{OLD}{target.name}~"
    olds = [e for e in sorted(target.parent.iterdir()) if e.name.startswith(prefix)
            and (_leftover(e.name) or ("", "", "", 0))[1] == target.name]
    return any(_restore(old, target) for old in olds)


def _lock(fd: int, path: Path) -> None:
    """An exclusive, non-blocking `flock` on `fd` (of `path`): `BlockingIOError` when another process holds it; none
    where the filesystem has no `flock` (leftovers are then told by their writer's pid)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise
    except OSError as e:
        log.debug("no flock on %s (%s): leftovers are told by pid", path, e)


# ---- the swap -------------------------------------------------------------------------------------------------
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (renameat2 RENAME_EXCHANGE); False where the system or filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), str(b))


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_and_sync(path: Path, checksum: bool) -> str | None:
    """fsync `path` and, if asked, its SHA-256 (read right after writing: from the page cache)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        digest = None
        if checksum:
            with open(fd, "rb", closefd=False) as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        os.fsync(fd)
        return digest
    finally:
        os.close(fd)


class _HashingWriter(io.RawIOBase):
    """A binary file that hashes the bytes as they are written (torch.save writes through it)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.digest = file, hashlib.sha256()
        self.error: OSError | None = None  # the storage's error, which a writer may hide behind its own

    def writable(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return self.file.name

    def __repr__(self) -> str:  # as a file object's: it names the file
        return f"<{type(self).__name__} name={self.name!r}>"

    def write(self, data: bytes | bytearray | memoryview) -> int:
        try:
            written = self.file.write(data)
        except OSError as e:
            self.error = e
            raise
        self.digest.update(memoryview(data)[:written])
        return written


class StagedDirectory:
    """A directory written in full beside `target`, then swapped in (see the module docstring).

    `what` names it in messages; `overwrite`: replace a directory that `recognise` accepts; `checksums`: take every
    file's SHA-256 (`self.checksums` after the block); `advice()`: what the error message says is intact and how to
    go on, in place of the default.
    """

    def __init__(self, target: str | os.PathLike, *, what: str, overwrite: bool = False,
                 recognise: Callable[[Path], bool] | None = None, checksums: bool = False,
                 advice: Callable[[], str] | None = None) -> None:
        self.target = Path(os.path.abspath(target))
        self.what, self.overwrite, self.recognise = what, overwrite, recognise
        self.hashing, self.advice = checksums, advice
        self.path = self.target.with_name(f"{TMP}{self.target.name}~{HOST}~{os.getpid()}~{next(_COUNTER)}")
        self.checksums: dict[str, str] = {}
        self._pending: dict[str, Future[str | None]] = {}
        self._fd: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._replaces = False

    # ---- writing -----------------------------------------------------------------------------------------------
    def record(self, name: str, digest: str | None = None) -> None:
        """File `name` (relative to `self.path`) is written: fsync it (and hash it, unless `digest` is given) in the
        background while the next file is written."""
        assert self._pool is not None, "record() outside the with-block"
        path = self.path / name
        if digest is not None:
            self.checksums[name] = digest
        self._pending[name] = self._pool.submit(_hash_and_sync, path, self.hashing and digest is None)

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """A binary file `name` in the staging directory, hashed as it is written, fsync'ed and recorded on close."""
        path = self.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            writer = _HashingWriter(f)
            try:
                yield writer  # type: ignore[misc]
            except Exception as e:
                if writer.error is None or e is writer.error:
                    raise
                # torch.save reports a failed write as a RuntimeError of its own ("unexpected pos"): the cause is this
                raise OSError(writer.error.errno, writer.error.strerror, str(path)) from e
        self.record(name, writer.digest.hexdigest())

    def write_bytes(self, name: str, data: bytes) -> Path:
        with self.open(name) as f:
            f.write(data)
        return self.path / name

    # ---- the block ---------------------------------------------------------------------------------------------
    def __enter__(self) -> StagedDirectory:
        self._replaces = check_target(self.target, what=self.what, overwrite=self.overwrite, recognise=self.recognise)
        self.target.parent.mkdir(parents=True, exist_ok=True)
        clean_leftovers(self.target.parent, self.target.name)
        try:
            os.mkdir(self.path)
            if self._replaces:  # the new directory keeps the old one's permissions
                os.chmod(self.path, stat.S_IMODE(self.target.stat().st_mode))
            self._fd = os.open(self.path, os.O_RDONLY)
            _lock(self._fd, self.path)
        except BaseException as e:
            self._discard()
            self._release()
            if is_write_error(e):
                raise self._error(e) from e
            raise
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mmadapt-fsync")
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        failure = error
        try:
            if error is None:
                self._commit()
        except BaseException as e:
            failure = e
        finally:
            if failure is not None:
                self._discard()
            self._release()
        if failure is not None and is_write_error(failure):
            raise self._error(failure) from failure
        if failure is not error:
            raise failure  # the commit failed in another way than a write error

    def settle(self) -> dict[str, str]:
        """Record the files written without `record` (by a library: a tokenizer's, transformers'), wait until every
        file is fsync'ed (and hashed); returns {relative path: SHA-256} with `checksums=True`, else {}."""
        for file in sorted(p for p in self.path.rglob("*") if p.is_file()):
            name = file.relative_to(self.path).as_posix()
            if name not in self._pending:
                self.record(name)
        for name, future in self._pending.items():
            digest = future.result()
            if digest is not None:
                self.checksums[name] = digest
        return dict(sorted(self.checksums.items()))

    def discard(self) -> None:
        """Give the staged directory up, outside the with-block (a write finished in another thread that failed):
        removed, its lock released, the target untouched. Idempotent; a no-op once the directory was swapped in."""
        if self._fd is not None:
            self._discard()
            self._release()

    def _commit(self) -> None:
        self.settle()
        for directory in sorted({p.parent for p in self.path.rglob("*")} | {self.path}, reverse=True):
            fsync_path(directory)
        self._swap()

    def _swap(self) -> None:
        """The point of no return: after it the new directory is the target; what follows only tidies up."""
        if not os.path.lexists(self.target) or not any(self.target.iterdir()):
            os.replace(self.path, self.target)  # an empty directory is replaced by a rename
        elif not self._replaces:
            raise TargetExistsError(f"{self.target} was filled by another writer while this {self.what} was written; "
                                    "nothing of it was replaced")
        elif _exchange(self.path, self.target):
            shutil.rmtree(self.path, ignore_errors=True)  # the old directory, under the temporary name now
        else:
            self._swap_by_renames()
        try:
            fsync_path(self.target.parent)
        except OSError as e:
            log.warning("could not fsync %s after writing %s: %s", self.target.parent, self.target, e)

    def _swap_by_renames(self) -> None:
        """Where directories cannot be exchanged: old -> `.old-...` (locked meanwhile, so that no one puts it back
        under us), new -> target, then the old one deleted. A kill between the renames leaves the target missing;
        `recover` (run by the next reader or writer) puts the old one back."""
        aside = self.target.with_name(f"{OLD}{self.target.name}~{HOST}~{os.getpid()}~{next(_COUNTER)}")
        fd = os.open(self.target, os.O_RDONLY)
        try:
            _lock(fd, self.target)
            os.rename(self.target, aside)
            try:
                os.rename(self.path, self.target)
            except BaseException:
                os.rename(aside, self.target)
                raise
        finally:
            os.close(fd)
        shutil.rmtree(aside, ignore_errors=True)

    def _discard(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.path, ignore_errors=True)

    def _release(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _error(self, error: BaseException) -> CheckpointWriteError:
        if self.advice is not None:
            advice = self.advice()
        elif self._replaces:
            advice = f"The {self.what} that was there is intact. Fix: free disk space, then write it again."
        else:
            advice = "Nothing was left there. Fix: free disk space (or choose another directory), then write it again."
        wrapped = CheckpointWriteError(f"could not write {self.what} {self.target}: {error}. {advice}")
        wrapped.errno = error.errno if isinstance(error, OSError) and error.errno else errno.EIO
        return wrapped
