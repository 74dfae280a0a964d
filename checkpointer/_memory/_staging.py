"""The staging buffers of direct writes: aligned uint8 buffers reused between files and
saves, process-wide (`staging_buffers`), freed with the snapshot buffers by
`ckpt.release_host_buffers()`.

The direct writer (`_encoding._write`) copies each inner chunk of a host array of the
snapshot into one of these and writes it from there with `O_DIRECT` (which wants aligned
addresses and lengths). Snapshots read in place need none: they hold the shard files
themselves (`_encoding.ShardImage`). At most `max_free` free buffers (the writer threads' number, each 4 MiB unless
an inner chunk is larger) stay allocated between saves.
"""

from __future__ import annotations

import threading

import numpy as np

from ._aligned import aligned_empty

STAGING_ALIGN = 4096  # a multiple of every logical block size in use (512, 4096)


class StagingBuffers:
    """`STAGING_ALIGN`-aligned uint8 buffers, reused. Thread-safe; keeps at most
    `max_free` free buffers (the largest)."""

    def __init__(self, max_free: int) -> None:
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self.max_free = max_free

    @property
    def free_bytes(self) -> int:
        """Bytes of the free buffers held."""
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def take(self, nbytes: int) -> np.ndarray:
        """A free buffer of at least `nbytes` (rounded up to `STAGING_ALIGN`), or a new one."""
        nbytes = -(-max(1, nbytes) // STAGING_ALIGN) * STAGING_ALIGN
        with self._lock:
            for i, b in enumerate(self._free):
                if b.nbytes >= nbytes:
                    return self._free.pop(i)
        return aligned_empty((nbytes,), np.dtype(np.uint8), STAGING_ALIGN)

    def give_back(self, buf: np.ndarray) -> None:
        """Returns a buffer from `take` that nothing reads any more."""
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.nbytes)
            del self._free[: max(0, len(self._free) - self.max_free)]  # keep the largest

    def clear(self) -> int:
        """Drops every free buffer (buffers in use are dropped when given back only if
        beyond `max_free`); returns the bytes dropped."""
        with self._lock:
            dropped = sum(b.nbytes for b in self._free)
            self._free.clear()
            return dropped


_SHARED = StagingBuffers(max_free=8)


def staging_buffers() -> StagingBuffers:
    """The process-wide staging buffers of direct writes (`max_free`: set by the writer
    to its thread count)."""
    return _SHARED
