"""The fault-injecting storage layer: wraps every `Storage` operation of local files and
the system calls of the direct writer, refuses any path outside the run's directories,
and fires one armed fault at the n-th operation of an injection point.

    layer = FaultLayer(roots=[run_dir, local_dir])
    with layer.installed():
        layer.arm(Fault("eio", "commit", countdown=2))
        ...                       # the 2nd commit operation raises OSError(EIO)
        layer.fired               # the Fired record, or None if no operation matched

What is wrapped (in this process, for as long as `installed()` is entered):
- every method of the `Storage` interface on `LocalStorage` (the class, so `isinstance`
  checks of the library still hold): `write_file`, `read_file`, `read_range`,
  `open_reader`, `makedirs`, `rename`, `sync_dir`, `delete_tree`, `delete_file`,
  `list_dir`, `list_files`, `exists`, `is_folder`, `size`;
- the `os` module as `checkpointer._storage._local`, `._direct` and
  `checkpointer._manage._peer_copy` (a holder's copy of a peer's step) see it (a proxy):
  `write`, `pwrite` (short writes, ENOSPC, EIO), `fsync` (fsync failure), `preadv`,
  `pread` (EIO on restore), `open` (the path guard for direct chunk files).

TensorStore's own C++ writes (zarr.json of arrays in buffered mode) are not seen here;
the sentinel check of `invariants.Sentinel` covers them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import signal
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# The storage kinds of fault this layer injects, and the process kinds it can also fire
# at an injection point (the process signals itself: `sigkill`, `sigterm`).
STORAGE_KINDS = ("eio", "enospc", "short_write", "fsync_eio", "slow_io")
SIGNAL_KINDS = ("sigkill", "sigterm")
POINTS = ("save", "commit", "replication", "retention", "restore")
# Points the campaign does not draw (its loop has no peers): a holder writing a peer's copy
# of a local step (any path under a `peer-copies/` folder).
PEER_POINTS = ("peer_copy",)
SLOW_IO_S = 0.3  # how long a `slow_io` fault stalls its operation, seconds

# Which operations each kind can strike (an op of another kind does not count down).
_WRITES = {"write_file", "makedirs", "pwrite", "write", "open_write", "rename"}
_KIND_OPS = {
    "eio": _WRITES | {"read_file", "read_range", "open_reader", "preadv", "pread", "sync_dir", "fsync", "delete_tree"},
    "enospc": {"write_file", "makedirs", "pwrite", "write", "open_write"},
    "short_write": {"pwrite", "write"},
    "fsync_eio": {"fsync", "sync_dir"},
    "slow_io": _WRITES | {"read_file", "read_range", "preadv", "pread", "fsync", "sync_dir", "delete_tree"},
    "sigkill": _WRITES | {"read_file", "preadv", "pread", "fsync", "sync_dir", "delete_tree"},
    "sigterm": _WRITES | {"read_file", "preadv", "pread", "fsync", "sync_dir", "delete_tree"},
}
_READS = {"read_file", "read_range", "open_reader", "preadv", "pread"}
_SYSCALLS = {"write", "pwrite", "fsync", "open_write"}
# The kinds that can strike at each point (a retention only renames and deletes; a
# restore only reads).
POINT_KINDS = {
    "save": STORAGE_KINDS, "commit": STORAGE_KINDS, "replication": STORAGE_KINDS,
    "retention": ("eio", "slow_io"), "restore": ("eio", "slow_io"), "peer_copy": STORAGE_KINDS,
}


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault to inject: `kind` at the `countdown`-th operation of `point`."""

    kind: str
    point: str
    countdown: int = 1

    def __post_init__(self) -> None:
        if self.kind not in STORAGE_KINDS + SIGNAL_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}: one of {STORAGE_KINDS + SIGNAL_KINDS}")
        if self.point not in POINTS + PEER_POINTS:
            raise ValueError(f"unknown injection point {self.point!r}: one of {POINTS + PEER_POINTS}")


@dataclasses.dataclass(frozen=True)
class Fired:
    """Where an armed fault struck."""

    fault: Fault
    op: str
    path: str
    thread: str


class OutsideRootsError(PermissionError):
    """The library touched a path outside the run's directories (a violation)."""


class FaultLayer:
    """Wraps local storage and the direct writer; see the module docstring.

    Args:
      roots: the run's directories (absolute or not): every operation's path must lie
        under one of them, or `OutsideRootsError` is raised and recorded in `outside`.
      durable_root: with two tiers, the durable directory: writes under it are the
        `replication` point (the save commits on the local tier first).
      ignore_outside: path prefixes the guard lets through (e.g. a temporary folder of
        the test itself); none by default.

    Attributes:
      phase: set by the driver to "restore" while it restores (reads then count for the
        `restore` point); None otherwise.
      fired: where the armed fault struck, or None.
      outside: the paths touched outside `roots` (each one a violation).
      ops: how many operations passed through the layer.
    """

    def __init__(self, roots: Sequence[str], durable_root: str | None = None,
                 ignore_outside: Sequence[str] = ()) -> None:
        self.roots = [os.path.abspath(r).rstrip("/") + "/" for r in roots]
        self.durable_root = None if durable_root is None else os.path.abspath(durable_root).rstrip("/") + "/"
        self.ignore_outside = [os.path.abspath(r) for r in ignore_outside]
        self.phase: str | None = None
        self.fired: Fired | None = None
        self.outside: list[str] = []
        self.ops = 0
        self._armed: Fault | None = None
        self._left = 0
        self._mu = threading.Lock()
        self.on_signal: Callable[[int], None] = lambda sig: os.kill(os.getpid(), sig)

    # --- arming --------------------------------------------------------------------------

    def arm(self, fault: Fault) -> None:
        """Arms `fault` (replacing an armed one); `fired` is reset."""
        with self._mu:
            self._armed, self._left, self.fired = fault, fault.countdown, None

    def disarm(self) -> Fired | None:
        """Disarms; returns where the fault struck (None: it never did)."""
        with self._mu:
            self._armed = None
            return self.fired

    # --- classification ------------------------------------------------------------------

    def point_of(self, op: str, path: str, dst: str = "") -> str | None:
        """The injection point an operation belongs to, or None."""
        if self.phase == "restore":
            return "restore" if op in _READS else None
        if "/peer-copies/" in path and op not in _READS:
            return "peer_copy"
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if op == "delete_tree" or (op == "rename" and ".deleting-" in dst):
            return "retention"
        if op in _READS:
            return None  # reads during a save (listings, manifests) are not a point
        if self.durable_root is not None and (path + "/").startswith(self.durable_root):
            return "replication"
        if op == "rename" or op in ("sync_dir",) or name in ("manifest.json", "COMMITTED"):
            return "commit"
        if op in _SYSCALLS and self._committing.get(threading.get_ident()):
            return "commit"  # the system calls inside a commit's `write_file` or `rename`
        return "save"

    _committing: dict[int, bool] = {}

    # --- the hook every wrapped operation calls ------------------------------------------

    def check(self, op: str, path: str, dst: str = "") -> int | None:
        """Guards `path` (and `dst`), counts the op down and fires the armed fault.

        Returns:
          For `short_write` on a write op: the number of bytes to let through (the
          caller writes that many); else None.
        Raises:
          OutsideRootsError, OSError: the guard or the fault.
        """
        self.ops += 1
        for p in (path, dst):
            if p and not self._inside(p):
                self.outside.append(f"{op} {p}")
                raise OutsideRootsError(errno.EACCES, "fault layer: outside the run's directories", p)
        fault = self._armed
        if fault is None or op not in _KIND_OPS[fault.kind]:
            return None
        if self.point_of(op, path, dst) != fault.point:
            return None
        with self._mu:
            if self._armed is not fault:
                return None
            self._left -= 1
            if self._left > 0:
                return None
            self._armed = None
            self.fired = Fired(fault, op, path, threading.current_thread().name)
        return self._strike(fault, op, path)

    def _strike(self, fault: Fault, op: str, path: str) -> int | None:
        kind = fault.kind
        if kind == "slow_io":
            time.sleep(SLOW_IO_S)
            return None
        if kind == "short_write":
            return -1  # the caller halves its write
        if kind in SIGNAL_KINDS:
            self.on_signal(signal.SIGKILL if kind == "sigkill" else signal.SIGTERM)
            return None
        code = {"eio": errno.EIO, "enospc": errno.ENOSPC, "fsync_eio": errno.EIO}[kind]
        raise OSError(code, f"{os.strerror(code)} (injected: {kind} at {fault.point})", path)

    def _inside(self, path: str) -> bool:
        p = os.path.abspath(path)
        return any((p + "/").startswith(r) for r in self.roots) or any(
            p == i or p.startswith(i + "/") for i in self.ignore_outside
        )

    # --- installing ----------------------------------------------------------------------

    @contextlib.contextmanager
    def installed(self) -> Iterator[FaultLayer]:
        """Wraps `LocalStorage` and the `os` of the local and direct storage modules for
        the duration; restores them after. One layer at a time per process (RuntimeError
        otherwise); every thread of the process goes through it (the save and
        replication threads too)."""
        import sys

        import checkpointer._manage._peer_copy  # noqa: F401  (the peer copies' reads and writes)
        import checkpointer._storage  # noqa: F401  (the package, so its modules are loaded)

        local_mod = sys.modules["checkpointer._storage._local"]
        direct_mod = sys.modules["checkpointer._storage._direct"]
        copy_mod = sys.modules["checkpointer._manage._peer_copy"]
        if isinstance(local_mod.os, _OsProxy):
            raise RuntimeError("a FaultLayer is already installed in this process: one at a time")
        cls = local_mod.LocalStorage
        saved_methods = {name: cls.__dict__[name] for name in _STORAGE_OPS if name in cls.__dict__}
        saved_os = (local_mod.os, direct_mod.os, copy_mod.os)
        for name, real in saved_methods.items():
            setattr(cls, name, _wrap_method(self, name, real))
        direct_file = direct_mod.DirectFile
        real_init = direct_file.__init__

        def init(df: Any, path: str) -> None:
            self.check("open_write", path)
            real_init(df, path)

        direct_file.__init__ = init
        local_mod.os = _OsProxy(self, os, {})
        direct_mod.os = _OsProxy(self, os, {})
        copy_mod.os = _OsProxy(self, os, {})
        try:
            yield self
        finally:
            for name, real in saved_methods.items():
                setattr(cls, name, real)
            direct_file.__init__ = real_init
            local_mod.os, direct_mod.os, copy_mod.os = saved_os


_STORAGE_OPS = ("write_file", "read_file", "read_range", "open_reader", "makedirs", "rename", "sync_dir",
                "delete_tree", "delete_file", "list_dir", "list_files", "exists", "is_folder", "size",
                "folder_bytes", "modified_unix_s")


def _wrap_method(layer: FaultLayer, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(storage: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        dst = args[0] if name == "rename" else ""
        layer.check(name, path, dst)
        if name in ("write_file", "rename"):  # the fsyncs inside are a commit's when the file is
            name_ = path.rstrip("/").rsplit("/", 1)[-1]
            committing = name == "rename" or name_ in ("manifest.json", "COMMITTED")
            FaultLayer._committing[threading.get_ident()] = committing
            try:
                return real(storage, path, *args, **kwargs)
            finally:
                FaultLayer._committing.pop(threading.get_ident(), None)
        return real(storage, path, *args, **kwargs)

    wrapped.__name__ = name
    wrapped.__wrapped__ = real  # type: ignore[attr-defined]
    return wrapped


class _OsProxy(types.SimpleNamespace):
    """The `os` module, with the system calls of writes, syncs and reads faulted.

    File descriptors carry no path: the proxy remembers the path of each descriptor it
    opened (`open`), and names a descriptor it did not open `fd:<n>` (never outside)."""

    def __init__(self, layer: FaultLayer, real: types.ModuleType, fds: dict[int, str]) -> None:
        super().__init__()
        object.__setattr__(self, "_layer", layer)
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_fds", fds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _path(self, fd: int) -> str:
        return self._fds.get(fd, "")

    def open(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR) and not flags & getattr(os, "O_DIRECTORY", 0):
            self._layer.check("open_write", os.fspath(path))
        fd = self._real.open(path, flags, *args, **kwargs)
        self._fds[fd] = os.fspath(path)
        return fd

    def close(self, fd: int) -> None:
        self._fds.pop(fd, None)
        self._real.close(fd)

    def write(self, fd: int, data: Any) -> int:
        if self._layer.check("write", self._path(fd)) == -1 and len(data) > 1:
            return self._real.write(fd, memoryview(data)[: len(data) // 2])
        return self._real.write(fd, data)

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        if self._layer.check("pwrite", self._path(fd)) == -1:
            n = (len(data) // 2) // 4096 * 4096  # a direct write stays block-aligned
            if n > 0:
                return self._real.pwrite(fd, memoryview(data)[:n], offset)
        return self._real.pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        self._layer.check("fsync", self._path(fd))
        self._real.fsync(fd)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        self._layer.check("pread", self._path(fd))
        return self._real.pread(fd, n, offset)

    def preadv(self, fd: int, buffers: Any, offset: int) -> int:
        self._layer.check("preadv", self._path(fd))
        return self._real.preadv(fd, buffers, offset)
