"""The local POSIX backend: durable writes with fsync, atomic folder rename, flock, and
ranged reads straight into the caller's buffers (`preadv`)."""

from __future__ import annotations

import errno
import os
import shutil
import stat

from ._contract import FileLock, Reader, Storage, _too_large

# Buffers one preadv() takes at most (Linux's IOV_MAX).
_IOV_MAX = 1024


class _LocalReader(Reader):
    """`os.preadv` on one open file descriptor, straight into the caller's buffer."""

    # 1 GiB fresh restore (2 cores): 16 MiB runs cost ~100 ms more CPU in the kernel's
    # copy and the crc32c check than 1 MiB runs (docs/DESIGN-decisions.md, issue 15).
    run_bytes = 1 << 20
    # A system call and a page-cache copy: ~64 KiB of copying (a seek on a disk costs more).
    request_cost_bytes = 64 << 10

    def __init__(self, path: str):
        self._fd: int | None = os.open(path, os.O_RDONLY)

    def _open_fd(self) -> int:
        if self._fd is None:
            raise ValueError("read of a closed reader")
        return self._fd

    def size(self) -> int:
        return os.fstat(self._open_fd()).st_size

    def read_into(self, offset: int, buffer: memoryview | bytearray) -> None:
        fd, view = self._open_fd(), memoryview(buffer).cast("B")
        n, done = len(view), 0
        while done < n:  # one call returns at most ~2 GiB on Linux, and may return less
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise EOFError(f"short read: {done} of {n} bytes at offset {offset}")
            done += got

    def read_into_buffers(self, offset: int, buffers: list[memoryview]) -> None:
        fd, views = self._open_fd(), [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
        while views:
            got = os.preadv(fd, views[:_IOV_MAX], offset)
            if got == 0:
                raise EOFError(f"short read: {sum(len(v) for v in views)} bytes missing at offset {offset}")
            offset += got
            while views and got >= len(views[0]):  # drop the buffers filled, resume inside a partial one
                got -= len(views[0])
                views.pop(0)
            if got:
                views[0] = views[0][got:]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LocalStorage(Storage):
    """A local POSIX file system: durable writes with fsync, atomic directory rename,
    flock."""

    supports_rename = True
    supports_locks = True
    has_folders = True
    cheap_size = True

    def kvstore_spec(self, path: str) -> dict:
        return {"driver": "file", "path": path.rstrip("/") + "/"}

    def write_file(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        with open(path, "rb") as f:
            if max_bytes is not None and os.fstat(f.fileno()).st_size > max_bytes:
                raise _too_large(path, max_bytes)
            return f.read()

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        with open(path, "rb") as f:
            return os.pread(f.fileno(), length, offset)

    def open_reader(self, path: str) -> Reader:
        return _LocalReader(path)

    def size(self, path: str) -> int:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        return st.st_size

    def exists(self, path: str) -> bool:
        return os.path.isfile(path)

    def is_folder(self, path: str) -> bool:
        return os.path.isdir(path)

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_files(self, path: str) -> list[str]:
        out = []
        for parent, _, files in os.walk(path):
            rel = os.path.relpath(parent, path)
            out += [f if rel == "." else f"{rel}/{f}" for f in files]
        return sorted(out)

    def delete_tree(self, path: str) -> None:
        if os.path.islink(path):  # e.g. a step folder linked to an archive: drop the link only
            os.unlink(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)

    def delete_file(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def folder_bytes(self, path: str) -> int:
        total = 0
        for root, _, files in os.walk(path):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_size
                except FileNotFoundError:  # removed while we walk (a save or gc at work)
                    pass
        return total

    def modified_unix_s(self, path: str) -> float | None:
        try:
            return os.stat(path).st_mtime
        except OSError:
            return None

    def lock(self, path: str, *, wait: bool = True, holder: str | None = None) -> FileLock:
        return FileLock.acquire(path, wait=wait, holder=holder)

    def lock_holder(self, path: str) -> str | None:
        return FileLock.holder(path)

    def makedirs(self, path: str) -> None:
        if os.path.exists(path) and not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        os.makedirs(path, exist_ok=True)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
