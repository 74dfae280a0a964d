"""The TensorStore kvstore backend (`memory://`, `gs://`, `s3://`; no rename: the commit
marker alone publishes a save), the S3 spec from the standard environment variables,
and `storage_for`, which picks the backend of a location from the registry of URL
schemes (`register_storage`)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Union

from .._errors import CheckpointError
from ._contract import Reader, Storage, _too_large
from ._local import LocalStorage

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


class KvStorage(Storage):
    """Any TensorStore kvstore URL. No rename: the commit marker alone publishes a save."""

    def __init__(self, scheme_root: str, spec: str | dict | None = None):
        import tensorstore as ts  # lazily: see `ts_context`
        self._root = scheme_root  # e.g. "memory://", "s3://bucket/"
        self._spec = spec  # a JSON spec replaces the URL (it may carry context resources)
        self._kv = ts.KvStore.open(scheme_root if spec is None else spec, context=ts_context()).result()

    @property
    def root(self) -> str:
        """The location this backend opens (`memory://`, `s3://bucket`): `storage_for(self)`."""
        return self._root if self._root.endswith("://") else self._root.rstrip("/")

    def _key(self, path: str) -> str:
        if path == self.root and not self._root.endswith("://"):
            return ""  # the bucket itself (`s3://b`, the parent of `s3://b/run`)
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


# A location: a local path, a `scheme://...` URL, a `Storage` object with a `root` (e.g.
# a `KvStorage`), or a `(Storage, path)` pair naming a folder inside that storage.
Location = Union[str, "os.PathLike[str]", Storage, tuple[Storage, str]]
StorageFactory = Callable[[str], tuple[Storage, str]]

_BACKENDS: dict[str, StorageFactory] = {}
_BACKENDS_MU = threading.Lock()


def register_storage(scheme: str, factory: StorageFactory, *, replace: bool = False) -> None:
    """Registers the backend of the URLs `<scheme>://...`.

    Args:
      scheme: the URL scheme, lower case letters, digits, `+`, `-` or `.` (e.g. "gs").
      factory: `factory(url)` → (the backend's `Storage`, the URL normalised for it:
        the paths inside the location are `<that>/<name>`); called by `storage_for` for
        every location of the scheme.
      replace: replace a registered factory (a test's fault-injecting backend).
    Raises:
      ValueError: a malformed scheme, or one registered already without `replace`.

    Multi-process: per process; register the same schemes on every process.
    """
    if not scheme or not all(c.isalnum() or c in "+-." for c in scheme) or scheme != scheme.lower():
        raise ValueError(f"a storage scheme is lower case letters, digits, '+', '-' or '.', got {scheme!r}")
    with _BACKENDS_MU:
        if scheme in _BACKENDS and not replace:
            raise ValueError(f"a backend of {scheme}:// is registered already; pass replace=True to replace it")
        _BACKENDS[scheme] = factory


def registered_schemes() -> list[str]:
    """The URL schemes `storage_for` opens, sorted."""
    with _BACKENDS_MU:
        return sorted(_BACKENDS)


def _local_backend(location: str) -> tuple[Storage, str]:
    return LocalStorage(), os.path.abspath(location.removeprefix("file://"))


def _memory_backend(location: str) -> tuple[Storage, str]:
    return KvStorage("memory://"), location.rstrip("/")


def _bucket_backend(location: str) -> tuple[Storage, str]:
    scheme, rest = location.split("://", 1)
    bucket = rest.split("/", 1)[0]
    root = f"{scheme}://{bucket}/"
    try:
        return KvStorage(root, s3_spec(bucket) if scheme == "s3" else None), location.rstrip("/")
    except ValueError as e:
        raise CheckpointError(f"cannot open {root}: {e}") from e


register_storage("file", _local_backend)
register_storage("memory", _memory_backend)
register_storage("gs", _bucket_backend)
register_storage("s3", _bucket_backend)


def storage_for(location: Location) -> tuple[Storage, str]:
    """Returns the backend for `location` and the location normalised for it.

    Args:
      location: a local path; a URL of a registered scheme (`file://`, `memory://`,
        `gs://`, `s3://`, and any `register_storage` added); a `Storage` object with a
        `root` attribute (its root is the location); or a `(Storage, path)` pair (a
        backend the caller built, e.g. one wrapping another).
    Raises:
      CheckpointError: the URL scheme has no registered backend.
      TypeError: a `Storage` object without a `root`, or another type.
    """
    if isinstance(location, tuple):
        if len(location) != 2 or not isinstance(location[0], Storage) or not isinstance(location[1], str):
            raise TypeError(f"a location pair is (Storage, path), got {location!r}")
        return location[0], location[1].rstrip("/") or location[1]
    if isinstance(location, Storage):
        root = getattr(location, "root", None)
        if not isinstance(root, str):
            raise TypeError(
                f"{type(location).__name__} has no root to use as the location: pass (storage, path) instead"
            )
        return location, root
    loc = os.fspath(location)
    if not isinstance(loc, str):
        raise TypeError(f"a location is a str path or URL, got {loc!r}")
    if "://" not in loc:
        return _local_backend(loc)
    scheme = loc.split("://", 1)[0]
    with _BACKENDS_MU:
        factory = _BACKENDS.get(scheme)
    if factory is None:
        urls = ", ".join(f"{s}://" for s in registered_schemes())
        raise CheckpointError(
            f"unsupported location {loc!r}: use a local path or a URL of a registered scheme ({urls}), or register "
            f"a backend of {scheme}:// with checkpointer.register_storage"
        )
    return factory(loc)
