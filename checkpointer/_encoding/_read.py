"""Read execution: fetch the planned byte ranges of zarr shard files, check, assemble.

The format stays standard zarr v3 (`sharding_indexed` + `crc32c`, every inner chunk
stored), so the restore planner can fetch exactly the ranges it planned through the OS
(local files, `os.preadv`) or TensorStore's kvstore layer (object stores), check each
inner chunk's `crc32c` itself and copy straight into the destination box. That skips
TensorStore's array layer (chunk cache, per-chunk decode pipeline), which reads the
same bytes at roughly half the throughput on this machine (see DESIGN.md performance
notes). Anything this path does not handle (sub-byte dtypes, big-endian hosts) goes
through TensorStore's array read instead.

The reader executes a `ChunkRead` as planned (see `_restore_plan`): it checks the file's
size, reads the shard index range the plan names, looks up the planned inner chunk ids
in it (the index is the only source of the inner chunks' file offsets), coalesces
inner chunks adjacent in the file, checks each one's crc32c and copies the planned
spans into the destination buffer. The file layout itself is `_format.ShardFileLayout`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import crc32c
import numpy as np

from .. import _errors, _format
from .._errors import CorruptCheckpointError, where
from .._format import ArrayMetadata, Box, ShardFileLayout, is_whole_byte_dtype
from .._memory import host_buffer
from .._storage import DEFAULT_MAX_OVER_READ_RATIO, Storage, coalesce_ranges, ts_context
from ._leaf_plan import BoxRead, ChunkRead, RestorePlan, plan_array_leaf

if TYPE_CHECKING:
    import tensorstore as ts

# One read covers at most this many bytes of adjacent inner chunks (and at most the
# reader's `run_bytes`: 1 MiB for local files, so its crc32c check and copy find the
# bytes in the CPU cache).
_MAX_RUN_BYTES = 16 << 20
# A read straight into the destination covers at most this many inner chunks (two
# buffers each in one preadv; Linux takes at most 1024).
_DIRECT_RUN_INNER_CHUNKS = 256


@dataclasses.dataclass(eq=False)
class RestoreStats:
    """What one `restore` did, filled in when passed as `restore(..., stats=...)`.

    Attributes:
      bytes_read: bytes fetched from storage by the byte-range reader (inner chunks,
        their crc32c and shard indexes); leaves read through TensorStore's array layer
        (sub-byte dtypes) are not counted.
      chunk_reads: chunk (zarr shard file) reads executed.
      attempts: 1, or 2 when the checkpoint was replaced while it was read.
      elapsed_s: seconds `restore` took, when it returned.
      plan: the `RestorePlan` executed (of the last attempt).
      bytes_received: a cooperative restore: bytes of this process's target boxes
        that peers read and the exchange delivered (as planned); else 0.
      exchange_s: a cooperative restore: seconds of the exchange (JAX resharding
        over the device interconnect); else None.
      kept_from_target: key strings (as `jax.tree_util.keystr` prints them) of the
        target leaves returned as they were, not read (`restore(..., missing="keep_target")`
        for leaves the checkpoint lacks, `partial=True` for None over a saved subtree).
    """

    bytes_read: int = 0
    chunk_reads: int = 0
    attempts: int = 0
    elapsed_s: float | None = None
    plan: RestorePlan | None = None
    bytes_received: int = 0
    exchange_s: float | None = None
    kept_from_target: tuple[str, ...] = ()
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def __repr__(self) -> str:
        """The figures, and the plan as a summary (a plan lists every chunk read)."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr and f.name != "plan"]
        plan = "None" if self.plan is None else (
            f"<RestorePlan: {len(self.plan.leaves)} leaves, {len(self.plan.reads)} chunk reads, "
            f"{self.plan.bytes_read} bytes>")
        return f"RestoreStats({', '.join(shown)}, plan={plan})"

    def _add(self, bytes_read: int, chunk_reads: int = 0) -> None:
        with self._lock:
            self.bytes_read += bytes_read
            self.chunk_reads += chunk_reads


def fast_path_supported(dtype: np.dtype) -> bool:
    """Whether `read_box` can decode this dtype itself: whole-byte real dtypes on a
    little-endian host (complex and sub-byte dtypes go through TensorStore's array read)."""
    return sys.byteorder == "little" and np.dtype(dtype).kind != "c" and is_whole_byte_dtype(dtype)


_local = threading.local()


def _scratch(n: int) -> memoryview:
    """A reusable per-thread read buffer of at least `n` bytes (no zero-fill, no page
    faults after the first use)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = np.empty(max(n, 1 << 20), np.uint8)
        _local.buf = buf
    return buf.data[:n]


class _ChunkFile:
    """Byte-range access to one zarr shard file through the storage's `Reader`,
    counting the bytes fetched into the restore's statistics."""

    def __init__(self, storage: Storage, path: str, key: str, stats: RestoreStats):
        self.stats = stats
        self.location = f"{path}/{key}"
        self._reader = storage.open_reader(self.location)

    def size(self) -> int | None:
        return self._reader.size()

    @property
    def run_bytes(self) -> int:
        return self._reader.run_bytes

    @property
    def request_cost_bytes(self) -> int:
        return self._reader.request_cost_bytes

    def read(self, offset: int, n: int) -> memoryview:
        """`n` bytes from `offset`: a view of a per-thread scratch buffer that is valid
        until this thread's next read."""
        self.stats._add(n)
        buf = _scratch(n)
        self._reader.read_into(offset, buf)
        return buf

    def read_into_buffers(self, offset: int, buffers: list[memoryview]) -> None:
        """The consecutive bytes from `offset` scattered into `buffers` (see `Reader`)."""
        self.stats._add(sum(len(b) for b in buffers))
        self._reader.read_into_buffers(offset, buffers)

    def close(self) -> None:
        self._reader.close()


def check_chunk_files(storage: Storage, path: str, meta: ArrayMetadata, keys) -> None:
    """Checks that the zarr shard files `keys` exist with the size the manifest implies
    (each a key, or `(key, source folder)` for a referenced chunk: `ChunkRead.source`).

    Local files only (a `stat` each, in the order given, stopping at the first bad
    one); on object stores the reads themselves check.

    Raises:
      CorruptCheckpointError: a file is missing, not a file, or of another size; names
        the leaf and the chunk key.
    """
    if not storage.cheap_size:
        return
    expected = meta.layout.file_bytes
    here = where(leaf=meta.path, keystr=meta.keystr, path=path, process=_errors.this_process())
    seen: set[str] = set()
    for item in keys:  # may be a generator: stops at the first bad file, holding only what it checked
        key, source = (item, None) if isinstance(item, str) else item
        if key in seen:
            continue
        seen.add(key)
        root = _format.source_path(path, source)
        check_file_size(storage, root, key, expected, f"{here}: chunk {key}" + (f" (referenced in {root})" if source else ""))


def check_file_size(storage: Storage, path: str, key: str, expected_bytes: int, what: str) -> None:
    """Checks that the file `key` of the checkpoint at `path` exists with `expected_bytes`.

    Raises:
      CorruptCheckpointError: it is missing, unreadable or of another size; the message
        starts with `what` (leaf, checkpoint path, process and file) and names the fix.
    """
    try:
        size = storage.size(f"{path}/{key}")
    except OSError as e:
        state = "is missing" if isinstance(e, FileNotFoundError) else "cannot be read"
        raise CorruptCheckpointError(f"{what} {state} ({e.strerror}). Run `checkpointer verify {path}`.") from e
    if size != expected_bytes:
        raise CorruptCheckpointError(
            f"{what} has {size} bytes, expected {expected_bytes} (truncated or damaged). "
            f"Run `checkpointer verify {path}`."
        )


def _check_crc(blob: memoryview, what: str, path: str) -> memoryview:
    data, stored = ShardFileLayout.split_crc(blob)
    computed = crc32c.crc32c(data)
    if computed != stored:
        raise CorruptCheckpointError(
            f"{what}: crc32c mismatch (stored {stored:#010x}, the bytes read give {computed:#010x}): the data is "
            f"damaged. Run `checkpointer verify {path}` for a full report."
        )
    return data


def read_chunk_into(
    storage: Storage, path: str, meta: ArrayMetadata, read: ChunkRead, out: np.ndarray, stats: RestoreStats,
    max_over_read_ratio: float = DEFAULT_MAX_OVER_READ_RATIO, read_chunk_bytes: int | None = None,
    pool: concurrent.futures.Executor | None = None,
) -> None:
    """Executes one planned chunk read into `out` (the buffer of the read's box).

    The inner chunks needed are fetched in file order, nearby ones by one request
    (`coalesce_ranges`: a gap of inner chunks not needed is read and thrown away when it
    costs less than another request, within `max_over_read_ratio` of the bytes needed;
    a request spans at most `read_chunk_bytes`, default the reader's `run_bytes`).
    Each request is one pass: read (into a per-thread buffer of at most 1 MiB, still in
    the CPU's cache, or straight into `out`), every inner chunk's crc32c checked there,
    then placed. With `pool` (never from one of its own workers: they would wait on
    each other), the requests are spread over one task per core.

    Raises:
      CorruptCheckpointError: the file is missing, of another size than planned, an
        index entry is missing or out of range, or a checksum fails; the message names
        the leaf and the chunk key.
    """
    what = f"{where(leaf=meta.path, keystr=meta.keystr, path=path, process=_errors.this_process())}: chunk {read.chunk_key}"
    if read.source is not None:
        what += f" (referenced in {_format.source_path(path, read.source)})"
    try:
        f = _ChunkFile(storage, _format.source_path(path, read.source), read.chunk_key, stats)
    except OSError as e:
        state = "is missing" if isinstance(e, FileNotFoundError) else "cannot be opened"
        raise CorruptCheckpointError(f"{what} {state} ({e.strerror}). Run `checkpointer verify {path}`.") from e
    stats._add(0, chunk_reads=1)
    try:
        size = f.size()
        if size is not None and size != read.file_bytes:
            raise CorruptCheckpointError(
                f"{what} has {size} bytes, expected {read.file_bytes} (truncated or damaged). Run `checkpointer verify {path}`."
            )
        index = np.frombuffer(_check_crc(f.read(read.index_offset, read.index_bytes), f"{what} index", path), "<u8").reshape(-1, 2)
        step = read.inner_bytes_with_crc
        wanted = []
        for inner_id, spans in zip(read.inner_ids, itertools.product(*read.spans)):
            offset, nbytes = int(index[inner_id, 0]), int(index[inner_id, 1])
            if offset == ShardFileLayout.MISSING or nbytes != step or offset + nbytes > read.index_offset:
                raise CorruptCheckpointError(
                    f"{what}: index entry {inner_id} is missing or out of range (offset {offset}, {nbytes} bytes; "
                    f"expected {step} bytes ending by byte {read.index_offset}). Run `checkpointer verify {path}`."
                )
            wanted.append((offset, inner_id, spans, direct_destination(out, meta.inner_chunk_shape, spans)))
        wanted.sort(key=lambda w: w[0])
        # Coalesce inner chunks that are adjacent in the file into one read; a run is
        # either read straight into `out` (every inner chunk a contiguous part of it) or
        # through the scratch buffer.
        # Inner chunks apart in the file (a gap of others) are one request when
        # `coalesce_ranges` says so; such a request goes through the scratch buffer.
        runs: list[list[tuple[int, int, tuple, memoryview | None]]] = []
        run_bytes = read_chunk_bytes or min(_MAX_RUN_BYTES, f.run_bytes)
        per_run = max(1, run_bytes // step)
        per_direct_run = max(1, min(run_bytes // step, _DIRECT_RUN_INNER_CHUNKS))
        starts = np.fromiter((w[0] for w in wanted), np.int64, len(wanted))
        firsts = coalesce_ranges(starts, starts + step, request_cost_bytes=f.request_cost_bytes,
                                 max_over_read_ratio=max_over_read_ratio, read_chunk_bytes=run_bytes).tolist()
        for a, b in zip(firsts, firsts[1:] + [len(wanted)]):
            group = wanted[a:b]
            if group[-1][0] - group[0][0] != (len(group) - 1) * step:  # gaps: one read through scratch
                runs.append([(o, i, sp, None) for o, i, sp, _ in group])
                continue
            for item in group:
                if (runs and runs[-1][-1][0] + step == item[0] and (runs[-1][-1][3] is None) == (item[3] is None)
                        and len(runs[-1]) < (per_run if item[3] is None else per_direct_run) and item is not group[0]):
                    runs[-1].append(item)
                else:
                    runs.append([item])
        dtype = meta.dtype.newbyteorder("<") if meta.dtype.itemsize > 1 and meta.dtype.kind in "iufc" else meta.dtype

        def run_all(some: list[list[tuple[int, int, tuple, memoryview | None]]]) -> None:
            for run in some:
                start = run[0][0]
                if run[0][3] is not None:
                    _read_run_direct(f, start, run, what, path)
                    continue
                blob = f.read(start, run[-1][0] + step - start)
                for offset, inner_id, spans, _ in run:
                    rel = offset - start
                    data = _check_crc(blob[rel : rel + step], f"{what} inner chunk {inner_id}", path)
                    inner = np.frombuffer(data, dtype=dtype).reshape(meta.inner_chunk_shape)
                    src = tuple(slice(s, s + n) for s, _, n in spans)
                    dst = tuple(slice(d, d + n) for _, d, n in spans)
                    out[dst] = inner[src]

        tasks = min(len(runs), os.cpu_count() or 1) if pool is not None else 1
        if pool is None or tasks <= 1:
            run_all(runs)
        else:
            # Consecutive runs per task (file order within each); this thread takes the first.
            cuts = [len(runs) * k // tasks for k in range(tasks + 1)]
            futures = [pool.submit(run_all, runs[a:b]) for a, b in zip(cuts[1:-1], cuts[2:])]
            try:
                run_all(runs[: cuts[1]])
            finally:
                concurrent.futures.wait(futures)  # none may still write into `out` or read `f` after this returns
            for fut in futures:
                fut.result()
    except (OSError, EOFError) as e:
        raise CorruptCheckpointError(f"{what} cannot be read: {e}. Run `checkpointer verify {path}`.") from e
    finally:
        f.close()


def direct_destination(out: np.ndarray, inner_chunk_shape: tuple[int, ...], spans: tuple) -> memoryview | None:
    """The bytes of `out` (C-contiguous) that one inner chunk fills, when the copy is the
    whole inner chunk into a contiguous part of `out`; else None (the inner chunk is cut,
    or its rows are strided in `out`).

    Args:
      out: the destination buffer of the box.
      inner_chunk_shape: the leaf's inner chunk shape, elements.
      spans: per dimension `(source start, destination start, length)`, as `ChunkRead.spans`.
    """
    if not out.flags.c_contiguous or out.dtype.byteorder == ">":  # stored bytes are little-endian
        return None
    if any(src != 0 or n != inner for (src, _, n), inner in zip(spans, inner_chunk_shape)):
        return None
    # Contiguous: after the first dimension of length > 1, every dimension is whole in `out`.
    k = len(spans) - 1
    while k > 0 and spans[k][2] == out.shape[k]:
        k -= 1
    if any(n != 1 for _, _, n in spans[:k]):
        return None
    first = sum(d * stride for (_, d, _), stride in zip(spans, out.strides))
    nbytes = math.prod(n for _, _, n in spans) * out.itemsize
    return out.reshape(-1).view(np.uint8).data[first : first + nbytes]


def _read_run_direct(f: _ChunkFile, start: int, run: list, what: str, path: str) -> None:
    """Reads a run of adjacent inner chunks straight into their destinations (one scatter
    read: each inner chunk's bytes into `out`, its crc32c into a small buffer), then checks
    each one's crc32c where it landed."""
    crcs = bytearray(len(run) * ShardFileLayout.CRC_BYTES)
    crc_views = [memoryview(crcs)[i * ShardFileLayout.CRC_BYTES : (i + 1) * ShardFileLayout.CRC_BYTES] for i in range(len(run))]
    buffers: list[memoryview] = []
    for (_, _, _, dest), crc in zip(run, crc_views):
        buffers += (dest, crc)
    f.read_into_buffers(start, buffers)
    for (_, inner_id, _, dest), crc in zip(run, crc_views):
        stored, computed = int.from_bytes(crc, "little"), crc32c.crc32c(dest)
        if computed != stored:
            raise CorruptCheckpointError(
                f"{what} inner chunk {inner_id}: crc32c mismatch (stored {stored:#010x}, the bytes read give "
                f"{computed:#010x}): the data is damaged. Run `checkpointer verify {path}` for a full report."
            )


def open_zarr_array(storage: Storage, path: str, meta: ArrayMetadata) -> ts.Future:
    """Opens a leaf's zarr array through TensorStore's array layer, for the reads the
    byte-range reader does not handle (see `fast_path_supported`) and for `verify`.
    The spec refuses a `zarr.json` that disagrees with the manifest (`_format.zarr_spec`)."""
    import tensorstore as ts  # lazily: a restore of local files never needs it

    kvstore = storage.kvstore_spec(f"{path}/{_format.array_dir(meta.path)}")
    return ts.open(_format.zarr_spec(kvstore, meta, mode="read"), context=ts_context(), read=True)


def region_reader(storage: Storage, path: str, meta: ArrayMetadata) -> Callable[[Box], np.ndarray]:
    """Reads any region of a leaf stored as its own zarr array, unplanned: `read(box)` returns the leaf's values in
    `box` (each a fresh array), for readers that walk a leaf region by region (export).

    Raises (from `read`):
      CorruptCheckpointError: stored bytes are missing, truncated or fail a checksum;
        names the leaf and the checkpoint path.
    """
    if fast_path_supported(meta.dtype):
        stats = RestoreStats()
        return lambda box: read_box(storage, path, meta, plan_array_leaf(meta, {box: [-1]}).boxes[0], None, stats)
    try:
        store = open_zarr_array(storage, path, meta).result()
    except (ValueError, OSError) as e:  # TensorStore: zarr.json missing, unreadable or disagreeing
        raise CorruptCheckpointError(f"{where(leaf=meta.path, keystr=meta.keystr, path=path, process=_errors.this_process())}: cannot open the zarr array: {e}") from e

    def read(box: Box) -> np.ndarray:
        try:
            return store[box.slices()].read().result()
        except ValueError as e:  # TensorStore reports missing, truncated and damaged data as ValueError
            raise CorruptCheckpointError(
                f"{where(leaf=meta.path, keystr=meta.keystr, path=path, process=_errors.this_process())}: reading box {box} failed: {e}. "
                f"Run `checkpointer verify {path}` for a full report."
            ) from e

    return read


def read_box(
    storage: Storage, path: str, meta: ArrayMetadata, box_read: BoxRead, pool, stats: RestoreStats, out: np.ndarray | None = None,
    max_over_read_ratio: float = DEFAULT_MAX_OVER_READ_RATIO, read_chunk_bytes: int | None = None,
) -> np.ndarray:
    """Assembles one target box (or slab) from its chunk reads (concurrently when `pool` is given),
    into `out` (C-contiguous, of the box's shape and the stored dtype) or a new host buffer;
    requests as `read_chunk_into` makes them. `pool` must not be one whose
    worker calls this (a worker would wait on tasks queued behind it)."""
    if out is None:
        out = host_buffer(box_read.box.shape, meta.dtype)
    how = (max_over_read_ratio, read_chunk_bytes)
    if pool is None or len(box_read.reads) <= 1:
        for r in box_read.reads:
            read_chunk_into(storage, path, meta, r, out, stats, *how, pool=pool)
    else:
        futures = [pool.submit(read_chunk_into, storage, path, meta, r, out, stats, *how) for r in box_read.reads]
        concurrent.futures.wait(futures)  # all done (none still writing into `out`) before any error propagates
        for fut in futures:
            fut.result()
    return out
