"""Where checkpoint files live: a local POSIX directory or a TensorStore kvstore URL.

TensorStore moves the array bytes; this module adds only what TensorStore lacks for a
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
import shutil
import stat
import threading
from typing import TYPE_CHECKING

from .._errors import CheckpointError, LockHeldError

if TYPE_CHECKING:
    import tensorstore as ts


_TS_LOCK = threading.Lock()
_ts_context: list[ts.Context] = []


def ts_context() -> ts.Context:
    """The one TensorStore context of the process, so that `memory://` locations opened
    twice see the same bytes and cache/concurrency limits are shared. Made on first use:
    tensorstore is imported only when a kvstore or a zarr array is opened (a restore of
    local files never needs it)."""
    with _TS_LOCK:
        if not _ts_context:
            import tensorstore as ts

            _ts_context.append(ts.Context())
        return _ts_context[0]


# Buffers one preadv() takes at most (Linux's IOV_MAX).
_IOV_MAX = 1024

# Longest holder note a lock file carries (`pid 123 on host`), bytes.
_HOLDER_NOTE_BYTES = 200


class FileLock:
    """An advisory `flock` on one file, held until `release` or the process dies.

    The kernel drops the lock with its process, so a crashed holder never leaves a
    stale lock; only the lock file may remain. Used for the directory lock of a
    manager (`DIR/.checkpointer.lock`, with a holder note) and the save lock of a
    save in flight (`<partial>.lock`, removed on release).
    """

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd: int | None = fd

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
        os.close(self._fd)
        self._fd = None


class Reader(abc.ABC):
    """Byte-range reads of one file, opened once (a zarr shard file, typically).

    A context manager; `close` is idempotent.

    Attributes:
      run_bytes: how many bytes of adjacent inner chunks one read should cover at most:
        large where each read is a request (object stores), small (about an L2 cache)
        where a read is a system call, so the bytes are checked and copied while they
        are still in the CPU cache.
    """

    run_bytes: int = 16 << 20

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


class _LocalReader(Reader):
    """`os.preadv` on one open file descriptor, straight into the caller's buffer."""

    # 1 GiB fresh restore (2 cores): 16 MiB runs cost ~100 ms more CPU in the kernel's
    # copy and the crc32c check than 1 MiB runs (docs/DESIGN-decisions.md, issue 15).
    run_bytes = 1 << 20

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


class _KvReader(Reader):
    """Byte-range reads through TensorStore's kvstore (one request each)."""

    def __init__(self, storage: KvStorage, path: str):
        self._storage, self._path = storage, path

    def size(self) -> None:
        return None  # a kvstore read returns no object size: finding it costs a download

    def read_into(self, offset: int, buffer: memoryview | bytearray) -> None:
        view = memoryview(buffer).cast("B")
        data = self._storage.read_range(self._path, offset, len(view))
        if len(data) != len(view):
            raise EOFError(f"short read: {len(data)} of {len(view)} bytes at offset {offset}")
        view[:] = data


class Storage(abc.ABC):
    """A storage backend. Every method acts on one location string (path or URL).

    Capabilities (class attributes):
      supports_rename: `rename` moves a folder atomically.
      supports_locks: `lock` gives advisory locks that die with their process.
      has_folders: folders exist apart from their files (an empty one too), and
        `is_folder` tells a missing folder; on object stores a folder is only a
        key prefix.
      cheap_size: `size` costs a metadata lookup, not a download.
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


class KvStorage(Storage):
    """Any TensorStore kvstore URL. No rename: the commit marker alone publishes a save."""

    def __init__(self, scheme_root: str, spec: str | dict | None = None):
        import tensorstore as ts  # lazily: see `ts_context`
        self._root = scheme_root  # e.g. "memory://", "s3://bucket/"
        self._spec = spec  # a JSON spec replaces the URL (it may carry context resources)
        self._kv = ts.KvStore.open(scheme_root if spec is None else spec, context=ts_context()).result()

    def _key(self, path: str) -> str:
        if not path.startswith(self._root):
            raise CheckpointError(f"{path} is not under {self._root}")
        return path[len(self._root) :].lstrip("/")

    def kvstore_spec(self, path: str) -> dict:
        spec = dict(self._spec) if isinstance(self._spec, dict) else self._kv.spec().to_json()
        spec["path"] = spec.get("path", "") + self._key(path).rstrip("/") + "/"
        return spec

    def write_file(self, path: str, data: bytes) -> None:
        self._kv.write(self._key(path), data).result()

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        r = self._kv.read(self._key(path)).result()
        if r.state != "value":
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        if max_bytes is not None and len(r.value) > max_bytes:
            raise _too_large(path, max_bytes)
        return bytes(r.value)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        try:
            r = self._kv.read(self._key(path), byte_range=slice(offset, offset + length)).result()
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise
            # The object ends before `offset + length`: return what is there, as pread does.
            return self.read_file(path)[offset : offset + length]
        if r.state != "value":
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return bytes(r.value)

    def open_reader(self, path: str) -> Reader:
        self._key(path)  # a path outside this store fails now, not at the first read
        return _KvReader(self, path)

    def size(self, path: str) -> int:
        r = self._kv.read(self._key(path)).result()
        if r.state == "value":
            return len(r.value)
        if self.is_folder(path):
            raise IsADirectoryError(errno.EISDIR, "a key prefix, not an object", path)
        raise FileNotFoundError(errno.ENOENT, "no such object", path)

    def exists(self, path: str) -> bool:
        return self._kv.read(self._key(path)).result().state == "value"

    def is_folder(self, path: str) -> bool:
        return bool(self.list_files(path))

    def list_dir(self, path: str) -> list[str]:
        import tensorstore as ts  # lazily: see `ts_context`
        prefix = self._key(path).rstrip("/")
        prefix = prefix + "/" if prefix else ""
        key_range = ts.KvStore.KeyRange(prefix, prefix[:-1] + "0") if prefix else ts.KvStore.KeyRange()
        keys = self._kv.list(key_range).result()
        names = {k.decode()[len(prefix) :].split("/", 1)[0] for k in keys}
        return sorted(n for n in names if n)

    def list_files(self, path: str) -> list[str]:
        import tensorstore as ts  # lazily: see `ts_context`
        prefix = self._key(path).rstrip("/")
        prefix = prefix + "/" if prefix else ""
        key_range = ts.KvStore.KeyRange(prefix, prefix[:-1] + "0") if prefix else ts.KvStore.KeyRange()
        return sorted(k.decode()[len(prefix) :] for k in self._kv.list(key_range).result())

    def delete_file(self, path: str) -> None:
        import tensorstore as ts  # lazily: see `ts_context`
        self._kv.delete_range(ts.KvStore.KeyRange(self._key(path), self._key(path) + "\x00")).result()

    def delete_tree(self, path: str) -> None:
        import tensorstore as ts  # lazily: see `ts_context`
        prefix = self._key(path).rstrip("/") + "/"
        self._kv.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()


def s3_spec(bucket: str) -> dict:
    """The kvstore spec of an S3 bucket, with the endpoint from the environment.

    TensorStore's `s3` driver does not read `AWS_ENDPOINT_URL`: without an `endpoint`
    in the spec it addresses `https://<bucket>.s3.amazonaws.com`. So the standard
    variables go into the spec here: `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` as
    `endpoint` (path-style requests `<endpoint>/<bucket>/<key>`, http or https), and
    with an endpoint `AWS_REGION` / `AWS_DEFAULT_REGION` as `aws_region` (the region
    used in request signatures; TensorStore asks the endpoint when it is absent).
    Credentials come from TensorStore's default AWS chain (`AWS_ACCESS_KEY_ID` /
    `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, then `~/.aws`, ECS, EC2 metadata);
    when the key variables are set, the spec names the `environment` provider, the one
    the chain would pick anyway, which spares the chain's error logs about absent
    profile files.
    """
    spec: dict = {"driver": "s3", "bucket": bucket}
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        spec["aws_credentials"] = {"type": "environment"}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint.rstrip("/")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            spec["aws_region"] = region
    return spec


def storage_for(location: str | os.PathLike) -> tuple[Storage, str]:
    """Returns the backend for `location` and the location normalised for it.

    Args:
      location: a local path, `file://` URL or a TensorStore kvstore URL.
    Raises:
      CheckpointError: the URL scheme is one TensorStore cannot open.
    """
    loc = os.fspath(location)
    loc = loc.removeprefix("file://")
    if "://" not in loc:
        return LocalStorage(), os.path.abspath(loc)
    scheme, rest = loc.split("://", 1)
    if scheme == "memory":
        return KvStorage("memory://"), loc.rstrip("/")
    if scheme in ("gs", "s3"):
        bucket = rest.split("/", 1)[0]
        root = f"{scheme}://{bucket}/"
        try:
            return KvStorage(root, s3_spec(bucket) if scheme == "s3" else None), loc.rstrip("/")
        except ValueError as e:
            raise CheckpointError(f"cannot open {root}: {e}") from e
    raise CheckpointError(
        f"unsupported location {loc!r}: use a local path or a file://, memory://, gs:// or s3:// URL"
    )
