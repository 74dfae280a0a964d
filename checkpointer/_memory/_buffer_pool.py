"""Host buffers reused between snapshots, and the process-wide pool of `save_async`.

Fresh memory is expensive: on the 2-core VM of `benchmarks/` a snapshot of 960 MiB into
freshly allocated buffers takes about 120,000 page faults and 1 s of system time, the
same copy into buffers of the previous snapshot about 0.1 s. A `CheckpointManager` keeps
its own pool; plain `save_async` uses the process-wide one (`shared_pool`), emptied by
`ckpt.release_host_buffers()`.

Rules (every pool):
- A buffer is either free (in the pool) or in use by exactly one snapshot: `take`
  removes it from the pool, `give_back` returns it once that snapshot's bytes are
  durable. Two saves in flight therefore never share a buffer; the second one gets
  fresh buffers while the first one's are in use.
- A buffer given back while something else still references it (TensorStore keeps a
  reference to a write's source until the write is done, `write_snapshot` writes with
  `can_reference_source_data_indefinitely=True`) is dropped, not pooled: the next
  snapshot must never overwrite bytes someone may still read.
- The free buffers are bounded by the largest snapshot taken from the pool
  (`note_snapshot`): buffers given back beyond that are dropped, least recently given
  back first, so a pool holds at most one snapshot's worth of idle memory.
"""

from __future__ import annotations

import collections
import math
import sys
import threading
from collections.abc import Sequence

import numpy as np

from ._aligned import aligned_empty
from ._restore_memory import HUGE_PAGE_BYTES, host_buffer
from ._staging import STAGING_ALIGN as PAGE_ALIGN, staging_buffers


def page_aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data is `PAGE_ALIGN`-aligned (as `O_DIRECT` wants):
    from one huge page on, its own 2 MiB-aligned mapping advised `MADV_HUGEPAGE`
    (`host_buffer`: fresh memory costs one page fault per 2 MiB instead of 512, which is
    most of a fresh process's first save), else a page-aligned numpy buffer."""
    dtype = np.dtype(dtype)
    if math.prod(shape) * dtype.itemsize >= HUGE_PAGE_BYTES:
        out = host_buffer(tuple(shape), dtype)
        if out.ctypes.data % PAGE_ALIGN == 0:  # else malloc's fallback (no mapping left): aligned below
            return out
    return aligned_empty(tuple(shape), dtype, PAGE_ALIGN)


class HostBufferPool:
    """Free host buffers by (shape, dtype), reused by the next snapshot. Thread-safe.

    Holds at most `max_free_bytes` of free buffers: the largest snapshot taken from it
    (see the module docstring), never a buffer in use.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (shape, dtype, page aligned) -> {id: free buffer}; `_order` holds every free
        # buffer's id in give-back order (the oldest is dropped first).
        self._free: dict[tuple, dict[int, np.ndarray]] = {}
        self._order: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._free_bytes = 0
        self._max_free_bytes = 0

    @property
    def free_bytes(self) -> int:
        """Bytes of the free buffers the pool holds."""
        with self._lock:
            return self._free_bytes

    @property
    def max_free_bytes(self) -> int:
        """The bound on `free_bytes`: the largest snapshot noted, bytes."""
        with self._lock:
            return self._max_free_bytes

    def note_snapshot(self, nbytes: int) -> None:
        """Records that one snapshot takes `nbytes` of buffers from the pool (raises the bound)."""
        with self._lock:
            self._max_free_bytes = max(self._max_free_bytes, int(nbytes))

    def take(self, shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
        """A buffer of `shape` and `dtype`, now in use by the caller alone: a free one if
        any, else a new one, its data `align`-byte aligned (64, or `PAGE_ALIGN` for the
        shard files the direct writer submits as they are)."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        keys = [(shape, dtype, True)] if align > 64 else [(shape, dtype, False), (shape, dtype, True)]
        assert align <= PAGE_ALIGN and PAGE_ALIGN % align == 0
        with self._lock:
            for key in keys:
                free = self._free.get(key)
                if free:
                    ident, buf = free.popitem()  # the most recently given back: warmest
                    del self._order[ident]
                    if not free:
                        del self._free[key]
                    self._free_bytes -= buf.nbytes
                    return buf
        if align > 64:
            return page_aligned_empty(shape, dtype)
        return aligned_empty(shape, dtype, max(64, align))

    def give_back(self, arrays: Sequence[np.ndarray]) -> None:
        """Returns buffers from `take` whose contents are no longer needed; drops the
        least recently given back free buffers beyond the bound."""
        with self._lock:
            for a in arrays:
                if sys.getrefcount(a) > _UNSHARED_REFS:  # still referenced elsewhere: not ours to reuse
                    continue
                key = (a.shape, a.dtype, a.ctypes.data % PAGE_ALIGN == 0)
                self._free.setdefault(key, {})[id(a)] = a
                self._order[id(a)] = key
                self._free_bytes += a.nbytes
            while self._free_bytes > self._max_free_bytes and self._order:
                ident, key = self._order.popitem(last=False)
                free = self._free[key]
                self._free_bytes -= free.pop(ident).nbytes
                if not free:
                    del self._free[key]

    def clear(self) -> int:
        """Drops every free buffer and resets the bound (buffers in use that come back
        later are dropped unless a new snapshot raised the bound again); returns the
        bytes dropped."""
        with self._lock:
            dropped, self._free_bytes = self._free_bytes, 0
            self._free.clear()
            self._order.clear()
            self._max_free_bytes = 0
            return dropped


def _refs_in_give_back(arrays: Sequence[np.ndarray]) -> int:
    for a in arrays:  # the same loop as `give_back`'s: the list, `a`, getrefcount's argument
        return sys.getrefcount(a)
    return 0


# References `give_back` sees for a buffer that only the caller's list holds.
_UNSHARED_REFS = _refs_in_give_back([np.empty(1)])

_SHARED = HostBufferPool()


def shared_pool() -> HostBufferPool:
    """The process-wide pool of plain `save_async` snapshots."""
    return _SHARED


def release_host_buffers() -> int:
    """Frees the host buffers that `save_async` keeps between saves, and the staging
    buffers of direct writes (`direct_io`; a few MiB per writer thread, kept by every
    save's writer, the manager's too).

    `save_async` copies the arrays into host buffers that it reuses for the next
    `save_async` (fresh memory costs page faults: about 1 s of system time per GiB on a
    small VM), so after a save the process holds up to one snapshot's worth of idle host
    memory: at most the largest snapshot `save_async` took so far. Call this when no
    further saves are coming soon (e.g. after training). Buffers of saves still in
    flight are not freed (they are in use); wait for those saves first. A
    `CheckpointManager` keeps buffers of its own, freed by its `close()`.

    Returns:
      The bytes of host memory released (0 if none were held).

    Multi-process: each process holds and frees its own buffers; call it on any process.
    """
    return _SHARED.clear() + staging_buffers().clear()
