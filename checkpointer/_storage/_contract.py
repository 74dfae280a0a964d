"""The storage contract: what the save, recovery and the CLI ask of where checkpoint
files live (`Storage`), ranged readers of one file (`Reader`) and the advisory lock
(`FileLock`). The backends: `_local` (a POSIX directory) and `_kvstore` (a TensorStore
kvstore URL; `storage_for` picks the backend of a location).

TensorStore moves the array bytes; a backend adds only what TensorStore lacks for a
checkpointer: small durable files (manifest, records, commit marker), listing of step
folders, recursive deletion, ranged reads of shard files, and on POSIX the advisory
locks and the atomic rename that publishes a save.

A backend says what it can do with capabilities (`supports_rename`, `supports_locks`,
`has_folders`, `cheap_size`) and hands out the commit strategy that fits it
(`_commit.strategy_for`: `RenameCommit` on POSIX, `MarkerCommit` on object
stores), so the save, recovery and the CLI never ask which backend they hold.

A location is a local path (`/ckpt`, `file:///ckpt`) or a kvstore URL TensorStore
understands (`memory://`, `gs://bucket/prefix`, `s3://bucket/prefix`; the S3 endpoint
comes from `AWS_ENDPOINT_URL`). Paths inside a location are `/`-joined strings.
"""

from __future__ import annotations

import abc
import errno
import fcntl
import os
import weakref

from .._errors import LockHeldError

# Longest holder note a lock file carries (`pid 123 on host`), bytes.
_HOLDER_NOTE_BYTES = 200

# The locks this process holds: a forked child closes its copies of their descriptors.
_HELD: weakref.WeakSet[FileLock] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    """In a child forked (`os.fork`, multiprocessing's fork start method) from a process
    holding locks: closes its copies of their descriptors. A flock belongs to the open file
    description that both share, so a copy left open would keep the lock after the parent
    released it or died (a data-loader worker outliving its trainer would lock the next
    run out). Closing a copy leaves the parent's lock held; the child holds none."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


class FileLock:
    """An advisory `flock` on one file, held until `release` or the process dies.

    The kernel drops the lock with its process, so a crashed holder never leaves a
    stale lock; only the lock file may remain. A child forked from the holder does not
    hold it (`_drop_inherited_locks`). Used for the directory lock of a
    manager (`DIR/.checkpointer.lock`, with a holder note) and the save lock of a
    save in flight (`<partial>.lock`, removed on release).
    """

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd: int | None = fd
        _HELD.add(self)

    @classmethod
    def acquire(cls, path: str, *, wait: bool = True, holder: str | None = None) -> FileLock:
        """Creates `path` if absent and locks it exclusively.

        Args:
          path: the lock file.
          wait: block until the lock is free; else raise `LockHeldError` at once.
          holder: a note (e.g. `pid 12 on host`) written into the file once locked,
            for `holder` probes of other processes.
        Raises:
          LockHeldError: `wait=False` and another process holds the lock.
          OSError: the file cannot be created.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            note = os.pread(fd, _HOLDER_NOTE_BYTES, 0).decode(errors="replace").strip()
            os.close(fd)
            raise LockHeldError(path, note) from None
        except BaseException:
            os.close(fd)
            raise
        if holder is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{holder}\n".encode(), 0)
        return cls(path, fd)

    @staticmethod
    def holder(path: str) -> str | None:
        """Who holds the lock at `path`: its note ("unknown holder" without one), or
        None when no live process holds it (or the file is absent)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, _HOLDER_NOTE_BYTES, 0).decode(errors="replace").strip() or "unknown holder"
        finally:
            os.close(fd)  # closing drops the probe's own shared lock
        return None

    def release(self, *, remove: bool = False) -> None:
        """Drops the lock (idempotent); with `remove`, deletes the lock file first."""
        if self._fd is None:
            return
        if remove:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        os.close(fd)


class Reader(abc.ABC):
    """Byte-range reads of one file, opened once (a zarr shard file, typically).

    A context manager; `close` is idempotent.

    Attributes:
      run_bytes: how many bytes of adjacent inner chunks one read should cover at most:
        large where each read is a request (object stores), small (about an L2 cache)
        where a read is a system call, so the bytes are checked and copied while they
        are still in the CPU cache.
      request_cost_bytes: what one more read costs, in bytes of transfer: a gap at most
        this long between two ranges needed is read (and thrown away) rather than
        making two reads (`coalesce_ranges`). About latency times bandwidth: 2 MiB
        for object stores (tens of ms per request), 64 KiB for local files.
    """

    run_bytes: int = 16 << 20
    request_cost_bytes: int = 2 << 20

    @abc.abstractmethod
    def size(self) -> int | None:
        """The file's size in bytes, or None where that would cost a request."""

    @abc.abstractmethod
    def read_into(self, offset: int, buffer: memoryview | bytearray) -> None:
        """Fills `buffer` (writable, `len(buffer)` bytes) from byte `offset` of the file.

        Raises:
          EOFError: the file ends before `offset + len(buffer)`.
          OSError: the read failed.
        """

    def read_into_buffers(self, offset: int, buffers: list[memoryview]) -> None:
        """Fills `buffers` (writable byte views) one after another from the consecutive
        bytes starting at `offset`: a scatter read (one `preadv` for local files, so the
        bytes land in their destinations without a copy; here: one read, then copies).
        Raises as `read_into`."""
        views = [memoryview(b).cast("B") for b in buffers]
        data = bytearray(sum(len(v) for v in views))
        self.read_into(offset, data)
        start = 0
        for v in views:
            v[:] = memoryview(data)[start : start + len(v)]
            start += len(v)

    def read(self, offset: int, n: int) -> bytes:
        """`n` bytes from byte `offset`. Raises as `read_into`."""
        buf = bytearray(n)
        self.read_into(offset, buf)
        return bytes(buf)

    def close(self) -> None:
        """Releases the file."""

    def __enter__(self):  # -> Self (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Storage(abc.ABC):
    """A storage backend. Every method acts on one location string (path or URL).

    Capabilities (class attributes):

    - `supports_rename`: `rename` moves a folder atomically.
    - `supports_locks`: `lock` gives advisory locks that die with their process.
    - `has_folders`: folders exist apart from their files (an empty one too), and
      `is_folder` tells a missing folder; on object stores a folder is only a
      key prefix.
    - `cheap_size`: `size` costs a metadata lookup, not a download.
    """

    supports_rename: bool = False
    supports_locks: bool = False
    has_folders: bool = False
    cheap_size: bool = False

    @abc.abstractmethod
    def kvstore_spec(self, path: str) -> dict:
        """The TensorStore kvstore spec (JSON) of the folder `path`."""

    @abc.abstractmethod
    def write_file(self, path: str, data: bytes) -> None:
        """Writes `data` to `path` durably (fsync on POSIX), replacing any old content."""

    @abc.abstractmethod
    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """Returns the bytes at `path`. Raises FileNotFoundError if absent.

        With `max_bytes`, a larger file raises `OSError(errno.EFBIG)` (local files are
        not read at all then; object stores fetch the whole object first).
        """

    @abc.abstractmethod
    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """Returns `length` bytes of `path` from byte `offset` (fewer at the end of the
        file on POSIX). Raises FileNotFoundError if absent."""

    @abc.abstractmethod
    def open_reader(self, path: str) -> Reader:
        """Opens `path` for byte-range reads. Raises FileNotFoundError if absent
        (object stores: at the first read)."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """The size of the file at `path` in bytes (object stores fetch it whole, see
        `cheap_size`).

        Raises:
          FileNotFoundError: nothing is at `path`.
          IsADirectoryError: `path` is a folder.
        """

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file exists at `path`."""

    @abc.abstractmethod
    def is_folder(self, path: str) -> bool:
        """Whether `path` is a folder (object stores: whether any file is under it)."""

    @abc.abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names of the immediate children (files and folders) of `path`; [] if absent."""

    @abc.abstractmethod
    def list_files(self, path: str) -> list[str]:
        """Paths relative to `path` of every file under it, at any depth, sorted; [] if absent."""

    @abc.abstractmethod
    def delete_tree(self, path: str) -> None:
        """Removes `path` and everything under it; no error if absent."""

    @abc.abstractmethod
    def delete_file(self, path: str) -> None:
        """Removes the file at `path`; no error if absent."""

    def folder_bytes(self, path: str) -> int | None:
        """Total bytes of the files under `path`, or None where that costs a request
        per file (object stores)."""
        return None

    def modified_unix_s(self, path: str) -> float | None:
        """When `path` last changed (seconds since the epoch), or None where unknown."""
        return None

    def lock(self, path: str, *, wait: bool = True, holder: str | None = None) -> FileLock:
        """Takes the lock at `path` (see `FileLock.acquire`); needs `supports_locks`."""
        raise NotImplementedError(f"{type(self).__name__} has no locks")

    def lock_holder(self, path: str) -> str | None:
        """Who holds the lock at `path` (see `FileLock.holder`); None where nothing
        holds it, which is always so without `supports_locks`."""
        return None

    def makedirs(self, path: str) -> None:
        """Creates folder `path` (no-op on object stores)."""

    def rename(self, src: str, dst: str) -> None:
        """Atomically renames folder `src` to `dst`; needs `supports_rename`."""
        raise NotImplementedError(f"{type(self).__name__} has no rename")

    def sync_dir(self, path: str) -> None:
        """Makes the entries of folder `path` durable (POSIX only)."""


def _too_large(path: str, max_bytes: int) -> OSError:
    return OSError(errno.EFBIG, f"larger than {max_bytes} bytes", path)
