"""Where checkpoint files live: a local POSIX directory or a TensorStore kvstore URL.

TensorStore moves the array bytes; this module adds only what TensorStore lacks for a
checkpointer: small durable files (manifest, records, commit marker), listing of step
folders, recursive deletion and, on POSIX, the atomic rename that publishes a save.

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

import tensorstore as ts

from ._errors import CheckpointError

# One TensorStore context for the whole process, so that `memory://` locations opened
# twice see the same bytes and cache/concurrency limits are shared.
TS_CONTEXT = ts.Context()


class Storage(abc.ABC):
    """A storage backend. Every method acts on one location string (path or URL)."""

    supports_rename: bool = False

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
        """Returns `length` bytes of `path` from byte `offset`. Raises FileNotFoundError."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file exists at `path`."""

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

    def hold_lock(self, path: str) -> object | None:
        """Creates `path` and holds an exclusive lock on it until `release_lock` (or
        process death). None where the backend has no locks (object stores)."""
        return None

    def lock_is_held(self, path: str) -> bool:
        """Whether some live process holds the lock at `path` (False when absent)."""
        return False

    def release_lock(self, path: str, handle: object | None) -> None:
        """Releases a lock from `hold_lock` and removes its file."""

    def makedirs(self, path: str) -> None:
        """Creates folder `path` (no-op on object stores)."""

    def rename(self, src: str, dst: str) -> None:
        """Atomically renames folder `src` to `dst` (POSIX only)."""
        raise NotImplementedError

    def sync_dir(self, path: str) -> None:
        """Makes the entries of folder `path` durable (POSIX only)."""

    @staticmethod
    def join(*parts: str) -> str:
        """Joins location parts with `/`."""
        head, *rest = parts
        return "/".join([head.rstrip("/")] + [p.strip("/") for p in rest if p])


def _too_large(path: str, max_bytes: int) -> OSError:
    return OSError(errno.EFBIG, f"larger than {max_bytes} bytes", path)


class LocalStorage(Storage):
    """A local POSIX file system: durable writes with fsync, atomic directory rename."""

    supports_rename = True

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

    def exists(self, path: str) -> bool:
        return os.path.isfile(path)

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

    def hold_lock(self, path: str) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def lock_is_held(self, path: str) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the probe's own lock
        return False

    def release_lock(self, path: str, handle: object | None) -> None:
        if handle is None:
            return
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        os.close(handle)

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
        self._root = scheme_root  # e.g. "memory://", "s3://bucket/"
        self._spec = spec  # a JSON spec replaces the URL (it may carry context resources)
        self._kv = ts.KvStore.open(scheme_root if spec is None else spec, context=TS_CONTEXT).result()

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
        r = self._kv.read(self._key(path), byte_range=slice(offset, offset + length)).result()
        if r.state != "value":
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return bytes(r.value)

    def exists(self, path: str) -> bool:
        return self._kv.read(self._key(path)).result().state == "value"

    def list_dir(self, path: str) -> list[str]:
        prefix = self._key(path).rstrip("/")
        prefix = prefix + "/" if prefix else ""
        key_range = ts.KvStore.KeyRange(prefix, prefix[:-1] + "0") if prefix else ts.KvStore.KeyRange()
        keys = self._kv.list(key_range).result()
        names = {k.decode()[len(prefix) :].split("/", 1)[0] for k in keys}
        return sorted(n for n in names if n)

    def list_files(self, path: str) -> list[str]:
        prefix = self._key(path).rstrip("/")
        prefix = prefix + "/" if prefix else ""
        key_range = ts.KvStore.KeyRange(prefix, prefix[:-1] + "0") if prefix else ts.KvStore.KeyRange()
        return sorted(k.decode()[len(prefix) :] for k in self._kv.list(key_range).result())

    def delete_file(self, path: str) -> None:
        self._kv.delete_range(ts.KvStore.KeyRange(self._key(path), self._key(path) + "\x00")).result()

    def delete_tree(self, path: str) -> None:
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
    if loc.startswith("file://"):
        loc = loc[len("file://") :]
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


def os_error_message(e: BaseException) -> str:
    """A one-line description of an OSError (`[Errno 28] No space left on device: '/x'`)."""
    return f"{type(e).__name__}: {e}"

