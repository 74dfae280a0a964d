"""Read execution: fetch the planned byte ranges of zarr shard files, check, assemble.

The format stays standard zarr v3 (`sharding_indexed` + `crc32c`, every inner chunk
stored), so the restore planner can fetch exactly the ranges it planned through the OS
(local files, `os.preadv`) or TensorStore's kvstore layer (object stores), check each
inner chunk's `crc32c` itself and copy straight into the destination box. That skips
TensorStore's array layer (chunk cache, per-chunk decode pipeline), which reads the
same bytes at roughly half the throughput on this machine (see DESIGN.md performance
notes). Anything this path does not handle (sub-byte dtypes, big-endian hosts) goes
through TensorStore's array read instead.

Layout of one zarr shard file (chunk): the encoded inner chunks, each `raw bytes ||
crc32c(raw bytes)` (little-endian u32), then the index: per inner chunk in C order
`(offset u64, nbytes u64)`, then `crc32c(index)`.
"""

from __future__ import annotations

import math
import os
import stat
import sys
import threading

import crc32c
import ml_dtypes
import numpy as np

from . import _format
from ._box import Box, grid_cells
from ._errors import CorruptCheckpointError, where
from ._format import ArrayMetadata
from ._restore_plan import BoxRead, ChunkRead
from ._storage import LocalStorage, Storage

_MISSING = (1 << 64) - 1
_MAX_RUN_BYTES = 16 << 20  # one read covers at most this many bytes of adjacent inner chunks


class ReadCounter:
    """Bytes fetched from storage by the fast path (for tests that check the plan)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n


BYTES_READ = ReadCounter()


def fast_path_supported(dtype: np.dtype) -> bool:
    """Whether `read_box` can decode this dtype itself (whole-byte dtypes, little-endian host)."""
    if sys.byteorder != "little":
        return False
    for info in (ml_dtypes.finfo, ml_dtypes.iinfo, np.finfo, np.iinfo):
        try:
            return info(dtype).bits == dtype.itemsize * 8
        except (ValueError, TypeError):
            continue
    return dtype.kind in "bc"


_local = threading.local()


def _scratch(n: int) -> memoryview:
    """A reusable per-thread read buffer of at least `n` bytes (no zero-fill, no page
    faults after the first use)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = np.empty(max(n, 1 << 20), np.uint8)
        _local.buf = buf
    return memoryview(buf)[:n]


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data is `align`-byte aligned. XLA's CPU client
    adopts such buffers without copying (`jax.device_put` aliases them)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


class _ChunkFile:
    """Byte-range access to one zarr shard file."""

    def __init__(self, storage: Storage, path: str, key: str):
        self.storage, self.location = storage, f"{path}/{key}"
        self._fd = os.open(self.location, os.O_RDONLY) if isinstance(storage, LocalStorage) else None

    def size(self) -> int | None:
        return os.fstat(self._fd).st_size if self._fd is not None else None

    def read(self, offset: int, n: int) -> memoryview:
        """`n` bytes from `offset`; for local files a view of a per-thread scratch
        buffer that is valid until this thread's next read."""
        BYTES_READ.add(n)
        if self._fd is not None:
            buf = _scratch(n)
            done = 0
            while done < n:  # one call returns at most ~2 GiB on Linux, and may return less
                got = os.preadv(self._fd, [buf[done:]], offset + done)
                if got == 0:
                    raise EOFError(f"short read: {done} of {n} bytes at offset {offset}")
                done += got
            return buf
        return memoryview(self.storage.read_range(self.location, offset, n))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def check_chunk_files(storage: Storage, path: str, meta: ArrayMetadata, keys) -> None:
    """Checks that the zarr shard files `keys` exist with the size the manifest implies.

    Local files only (a `stat` each, in the order given, stopping at the first bad
    one); on object stores the reads themselves check.

    Raises:
      CorruptCheckpointError: a file is missing, not a file, or of another size; names
        the leaf and the chunk key.
    """
    if not isinstance(storage, LocalStorage):
        return
    expected = _format.encoded_chunk_bytes(meta.chunk_shape, meta.inner_chunk_shape, meta.dtype.itemsize)
    seen: set[str] = set()
    for key in keys:  # may be a generator: stops at the first bad file, holding only what it checked
        if key in seen:
            continue
        seen.add(key)
        what = f"{where(leaf=meta.path, path=path)}: chunk {key}"
        try:
            st = os.stat(f"{path}/{key}")
        except OSError as e:
            state = "is missing" if isinstance(e, FileNotFoundError) else "cannot be read"
            raise CorruptCheckpointError(f"{what} {state} ({e.strerror}). Run `checkpointer verify {path}`.") from e
        if not stat.S_ISREG(st.st_mode) or st.st_size != expected:
            raise CorruptCheckpointError(
                f"{what} has {st.st_size} bytes, expected {expected} (truncated or damaged). "
                f"Run `checkpointer verify {path}`."
            )


def _check_crc(blob: memoryview, what: str) -> memoryview:
    data, stored = blob[:-4], int.from_bytes(blob[-4:], "little")
    if crc32c.crc32c(data) != stored:
        raise CorruptCheckpointError(f"{what}: crc32c mismatch (stored {stored:#010x})")
    return data


def read_chunk_into(storage: Storage, path: str, meta: ArrayMetadata, read: ChunkRead, out: np.ndarray, out_box: Box) -> None:
    """Reads `read.box` from its zarr shard file into `out` (the buffer of `out_box`).

    Raises:
      CorruptCheckpointError: the file is missing, truncated, or a checksum fails;
        the message names the leaf and the chunk key.
    """
    what = f"{where(leaf=meta.path, path=path)}: chunk {read.chunk_key}"
    inner_shape = meta.inner_chunk_shape
    grid = tuple(c // i for c, i in zip(meta.chunk_shape, inner_shape))
    n_inner = math.prod(grid)
    inner_bytes = math.prod(inner_shape) * meta.dtype.itemsize
    index_bytes = n_inner * 16 + 4
    try:
        f = _ChunkFile(storage, path, read.chunk_key)
    except OSError as e:
        state = "is missing" if isinstance(e, FileNotFoundError) else "cannot be opened"
        raise CorruptCheckpointError(f"{what} {state} ({e.strerror}). Run `checkpointer verify {path}`.") from e
    try:
        size = f.size()
        expected = _format.encoded_chunk_bytes(meta.chunk_shape, inner_shape, meta.dtype.itemsize)
        if size is not None and size != expected:
            raise CorruptCheckpointError(f"{what} has {size} bytes, expected {expected} (truncated or damaged)")
        index = np.frombuffer(_check_crc(f.read(expected - index_bytes, index_bytes), f"{what} index"), "<u8").reshape(n_inner, 2)
        chunk_origin = tuple(c * s for c, s in zip(read.chunk_index, meta.chunk_shape))
        local = Box(tuple(o - c for o, c in zip(read.box.origin, chunk_origin)), read.box.shape)
        wanted = []
        for cell in grid_cells(local, inner_shape):
            k = int(np.ravel_multi_index(cell, grid))
            offset, nbytes = int(index[k, 0]), int(index[k, 1])
            if offset == _MISSING or nbytes != inner_bytes + 4 or offset + nbytes > expected - index_bytes:
                raise CorruptCheckpointError(f"{what}: index entry {cell} is missing or out of range")
            wanted.append((offset, cell))
        wanted.sort()
        # Coalesce inner chunks that are adjacent in the file into one read.
        runs: list[list[tuple[int, tuple]]] = []
        per_run = max(1, _MAX_RUN_BYTES // (inner_bytes + 4))
        for offset, cell in wanted:
            if runs and runs[-1][-1][0] + inner_bytes + 4 == offset and len(runs[-1]) < per_run:
                runs[-1].append((offset, cell))
            else:
                runs.append([(offset, cell)])
        dtype = meta.dtype.newbyteorder("<") if meta.dtype.itemsize > 1 and meta.dtype.kind in "iufc" else meta.dtype
        for run in runs:
            start = run[0][0]
            blob = f.read(start, len(run) * (inner_bytes + 4))
            for offset, cell in run:
                rel = offset - start
                data = _check_crc(blob[rel : rel + inner_bytes + 4], f"{what} inner chunk {cell}")
                inner = np.frombuffer(data, dtype=dtype).reshape(inner_shape)
                inner_box = Box(tuple(chunk_origin[d] + cell[d] * inner_shape[d] for d in range(len(cell))), inner_shape)
                region = inner_box.intersect(read.box)
                if region is not None:
                    out[region.relative_to(out_box)] = inner[region.relative_to(inner_box)]
    except (OSError, EOFError) as e:
        raise CorruptCheckpointError(f"{what} cannot be read: {e}. Run `checkpointer verify {path}`.") from e
    finally:
        f.close()


def read_box(storage: Storage, path: str, meta: ArrayMetadata, box_read: BoxRead, pool=None) -> np.ndarray:
    """Assembles one target box from its chunk reads (concurrently when `pool` is given)."""
    out = aligned_empty(box_read.box.shape, meta.dtype)
    if pool is None or len(box_read.reads) <= 1:
        for r in box_read.reads:
            read_chunk_into(storage, path, meta, r, out, box_read.box)
    else:
        for fut in [pool.submit(read_chunk_into, storage, path, meta, r, out, box_read.box) for r in box_read.reads]:
            fut.result()
    return out
