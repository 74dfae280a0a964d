"""Direct I/O of local files (`O_DIRECT`): the probe, one file written from aligned
buffers with its unaligned tail, and folder syncs (the staging buffers: `_memory`).

`O_DIRECT` moves the bytes from the caller's buffer to the device without the page
cache: a checkpoint burst then neither evicts other files (a data loader's) nor costs the
kernel's copy and writeback. The kernel asks three things: the buffer's address, the
file offset and the length are multiples of the logical block size. `ALIGN` (4096) is a
multiple of every block size in use (512 and 4096).

The unaligned tail (a zarr shard file ends with its index, at any length) is written
**padded to `ALIGN` and then truncated** (`DirectFile.finish`): one file descriptor, every
data byte through `O_DIRECT`, and one `ftruncate` that `fsync` makes durable with the
size. The alternatives cost more: writing the tail buffered puts a page of every file in
the cache and needs a second descriptor without `O_DIRECT` (or an `fcntl` flip between
writes); a save interrupted between the padded write and the truncation leaves a file
too long, inside a partial folder that is never committed (recovery removes it).

Durability is that of `LocalStorage.write_file`: `fsync` of every file (data and size),
then of every folder whose entries the writes created (`sync_folders`), before a process
reports its chunks durable.
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np

from .._memory import aligned_empty

ALIGN = 4096
# The values `direct_io=` takes: "auto" probes, True requires direct writes, False never.
DIRECT_IO_VALUES = ("auto", True, False)


def check_direct_io(direct_io: object) -> str | bool:
    """Validates `direct_io`.

    Raises:
      ValueError: not "auto", True or False.
    """
    if isinstance(direct_io, bool) or (isinstance(direct_io, str) and direct_io == "auto"):
        return direct_io
    raise ValueError(f"direct_io must be 'auto', True or False, got {direct_io!r}")


def round_up(n: int) -> int:
    """`n` rounded up to a multiple of `ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def _flags() -> int | None:
    flag = getattr(os, "O_DIRECT", None)
    return None if flag is None else os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag | getattr(os, "O_CLOEXEC", 0)


# What a file system that refuses `O_DIRECT` answers: EINVAL (tmpfs before Linux 6.6, most
# others), EOPNOTSUPP/ENOTSUP (some FUSE and network file systems).
_REFUSALS = frozenset({errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)})


def _name(code: int | None) -> str:  # Linux's EOPNOTSUPP is ENOTSUP: say the one the kernel's docs use
    return "EOPNOTSUPP" if code == errno.EOPNOTSUPP else errno.errorcode.get(code or 0, str(code))


def probe(folder: str) -> str | None:
    """Whether the file system of `folder` (an existing folder) takes direct writes:
    creates a file there with `O_DIRECT`, writes one aligned block, removes it.

    Returns:
      None when it does; else why not (no `O_DIRECT` on this platform, or the file
      system refuses it: `EINVAL`, `EOPNOTSUPP` or `ENOTSUP`, named in the reason).
    Raises:
      OSError: any other failure (the folder is missing or not writable).
    """
    flags = _flags()
    if flags is None:
        return "this platform has no O_DIRECT"
    name = f"{folder}/.direct-io-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        try:
            fd = os.open(name, flags, 0o644)
        except OSError as e:
            if e.errno not in _REFUSALS:
                raise
            return f"the file system of {folder} refuses O_DIRECT (opening: {_name(e.errno)})"
        try:
            os.pwrite(fd, aligned_empty((ALIGN,), np.dtype(np.uint8), ALIGN).data, 0)
        except OSError as e:
            if e.errno not in _REFUSALS:
                raise
            return f"the file system of {folder} refuses O_DIRECT (writing: {_name(e.errno)})"
        finally:
            os.close(fd)
    finally:
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
    return None


class DirectFile:
    """One file written with `O_DIRECT`: aligned pieces at aligned offsets (`write_at`),
    then `finish(size)`: the padded tail, the truncation to `size`, `fsync`, close.

    Raises (every method): OSError from the system calls (EINVAL where the file system
    refuses direct I/O); the descriptor is closed on any failure of `finish`.
    """

    def __init__(self, path: str) -> None:
        flags = _flags()
        if flags is None:
            raise OSError(errno.EINVAL, "this platform has no O_DIRECT", path)
        self.path = path
        self._fd: int | None = os.open(path, flags, 0o644)

    def write_at(self, offset: int, data: np.ndarray) -> None:
        """Writes `data` (uint8, its address, `offset` and length multiples of `ALIGN`)."""
        assert self._fd is not None and offset % ALIGN == 0 and data.nbytes % ALIGN == 0 and data.ctypes.data % ALIGN == 0
        view, done = memoryview(data.data).cast("B"), 0
        while done < len(view):  # a write may take fewer bytes (then a multiple of the block size)
            n = os.pwrite(self._fd, view[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"direct write of {len(view) - done} bytes took none", self.path)
            done += n

    def finish(self, size: int) -> None:
        """After the last `write_at`: cuts the file to `size` bytes (the padding of the
        tail goes), makes data and size durable (`fsync`) and closes it."""
        fd, self._fd = self._fd, None
        assert fd is not None
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Closes without making anything durable (after a failure)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_file(path: str, data: np.ndarray, size: int) -> None:
    """Writes the first `size` bytes of `data` to a new file `path` with `O_DIRECT`,
    durably (`data`: an `ALIGN`-aligned uint8 buffer of `round_up(size)` bytes, its
    padding after `size` anything)."""
    f = DirectFile(path)
    try:
        if size:
            f.write_at(0, data[: round_up(size)])
        f.finish(size)
    finally:
        f.close()


def sync_folders(folders: set[str]) -> None:
    """`fsync` of every folder in `folders`, deepest first (their new entries durable)."""
    for folder in sorted(folders, key=lambda p: (-p.count("/"), p)):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
