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
import functools
import itertools
import math
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

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

_T = TypeVar("_T")

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
      chunk_reads: zarr shard files (and packed-chunk runs) read: a file that several
        boxes of a leaf need counts once when they are read together (`read_boxes`).
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


@dataclasses.dataclass
class _Run:
    """One request of a zarr shard file (`_ChunkFile`) and where its inner chunks go.

    Attributes:
      file: the file, with `what` (leaf, checkpoint, process and chunk) for messages.
      start, nbytes: the bytes the request fetches.
      entries: per inner chunk fetched (ascending offsets), `(offset, targets)`; each
        target `(inner_id, spans, out, direct)`: its box buffer, the spans to copy
        (`ChunkRead.spans`) and, when the request is read straight into `out` (`direct`),
        the bytes of `out` it fills.
      direct: the request scatters the inner chunks straight into their destinations.
    """

    file: _ChunkFile
    what: str
    start: int
    nbytes: int
    entries: list[tuple[int, list[tuple[int, tuple, np.ndarray, memoryview | None]]]]
    direct: bool


def read_chunk_index(
    storage: Storage, path: str, meta: ArrayMetadata, reads: list[tuple[ChunkRead, np.ndarray]], stats: RestoreStats,
    max_over_read_ratio: float, read_chunk_bytes: int | None, opened: list[_ChunkFile],
) -> list[_Run]:
    """Opens one zarr shard file (appended to `opened`, for the caller to close), checks
    its size, reads and checks its index, and returns the requests that fetch every inner
    chunk `reads` need (the reads of one file by several boxes, each `(read, its box
    buffer)`), in file order.

    An inner chunk two boxes need is fetched once. Inner chunks apart in the file are
    one request when `coalesce_ranges` says so (the gap costs less than another request,
    within `max_over_read_ratio` of the bytes needed; a request spans at most
    `read_chunk_bytes`, default the reader's `run_bytes`).

    Raises:
      CorruptCheckpointError: the file is missing, of another size than planned, its
        index fails its checksum, or an entry is missing or out of range.
    """
    read = reads[0][0]
    what = f"{where(leaf=meta.path, keystr=meta.keystr, path=path, process=_errors.this_process())}: chunk {read.chunk_key}"
    if read.source is not None:
        what += f" (referenced in {_format.source_path(path, read.source)})"
    try:
        f = _ChunkFile(storage, _format.source_path(path, read.source), read.chunk_key, stats)
    except OSError as e:
        state = "is missing" if isinstance(e, FileNotFoundError) else "cannot be opened"
        raise CorruptCheckpointError(f"{what} {state} ({e.strerror}). Run `checkpointer verify {path}`.") from e
    opened.append(f)
    stats._add(0, chunk_reads=1)
    try:
        size = f.size()
        if size is not None and size != read.file_bytes:
            raise CorruptCheckpointError(
                f"{what} has {size} bytes, expected {read.file_bytes} (truncated or damaged). Run `checkpointer verify {path}`."
            )
        index = np.frombuffer(_check_crc(f.read(read.index_offset, read.index_bytes), f"{what} index", path), "<u8").reshape(-1, 2)
    except (OSError, EOFError) as e:
        raise CorruptCheckpointError(f"{what} cannot be read: {e}. Run `checkpointer verify {path}`.") from e
    step = read.inner_bytes_with_crc
    by_offset: dict[int, list[tuple[int, tuple, np.ndarray, memoryview | None]]] = {}
    for r, out in reads:
        for inner_id, spans in zip(r.inner_ids, itertools.product(*r.spans)):
            offset, nbytes = int(index[inner_id, 0]), int(index[inner_id, 1])
            if offset == ShardFileLayout.MISSING or nbytes != step or offset + nbytes > read.index_offset:
                raise CorruptCheckpointError(
                    f"{what}: index entry {inner_id} is missing or out of range (offset {offset}, {nbytes} bytes; "
                    f"expected {step} bytes ending by byte {read.index_offset}). Run `checkpointer verify {path}`."
                )
            by_offset.setdefault(offset, []).append((inner_id, spans, out, direct_destination(out, meta.inner_chunk_shape, spans)))
    offsets = sorted(by_offset)
    # Each group `coalesce_ranges` makes (at most `run_bytes` plus one inner chunk) is one
    # request; a group without gaps is cut where it switches between inner chunks that
    # are each a contiguous part of one box (and needed by that box alone: read straight
    # into the boxes, at most `_DIRECT_RUN_INNER_CHUNKS` per request) and others (read
    # through a per-thread scratch buffer).
    run_bytes = read_chunk_bytes or min(_MAX_RUN_BYTES, f.run_bytes)
    starts = np.asarray(offsets, np.int64)
    firsts = coalesce_ranges(starts, starts + step, request_cost_bytes=f.request_cost_bytes,
                             max_over_read_ratio=max_over_read_ratio, read_chunk_bytes=run_bytes).tolist()
    runs: list[_Run] = []
    for a, b in zip(firsts, firsts[1:] + [len(offsets)]):
        group = [(o, by_offset[o]) for o in offsets[a:b]]
        if group[-1][0] - group[0][0] != (len(group) - 1) * step:  # gaps: one read through scratch
            runs.append(_Run(f, what, group[0][0], group[-1][0] + step - group[0][0], group, False))
            continue
        for item in group:
            direct = len(item[1]) == 1 and item[1][0][3] is not None
            last = runs[-1] if runs and item is not group[0] else None
            if last is not None and last.direct == direct and (not direct or len(last.entries) < _DIRECT_RUN_INNER_CHUNKS):
                last.entries.append(item)
                last.nbytes += step
            else:
                runs.append(_Run(f, what, item[0], step, [item], direct))
    return runs


def _execute(runs: list[_Run], meta: ArrayMetadata, step: int, path: str) -> None:
    """Fetches each request, checks every inner chunk's crc32c in it (still in the CPU's
    cache: a request through scratch covers at most `run_bytes`) and places it."""
    dtype = meta.dtype.newbyteorder("<") if meta.dtype.itemsize > 1 and meta.dtype.kind in "iufc" else meta.dtype
    for run in runs:
        try:
            if run.direct:
                _read_run_direct(run.file, run.start, [(o, t[0][0], t[0][1], t[0][3]) for o, t in run.entries], run.what, path)
                continue
            blob = run.file.read(run.start, run.nbytes)
        except (OSError, EOFError) as e:
            raise CorruptCheckpointError(f"{run.what} cannot be read: {e}. Run `checkpointer verify {path}`.") from e
        for offset, targets in run.entries:
            rel = offset - run.start
            data = _check_crc(blob[rel : rel + step], f"{run.what} inner chunk {targets[0][0]}", path)
            inner = np.frombuffer(data, dtype=dtype).reshape(meta.inner_chunk_shape)
            for _, spans, out, _ in targets:
                src = tuple(slice(s, s + n) for s, _, n in spans)
                dst = tuple(slice(d, d + n) for _, d, n in spans)
                out[dst] = inner[src]


def read_boxes(
    storage: Storage, path: str, meta: ArrayMetadata, boxes: list[tuple[BoxRead, np.ndarray]], stats: RestoreStats,
    max_over_read_ratio: float = DEFAULT_MAX_OVER_READ_RATIO, read_chunk_bytes: int | None = None,
    pool: concurrent.futures.Executor | None = None,
) -> None:
    """Reads several boxes (or slabs) of one leaf, each `(its plan, its buffer)`: C-contiguous,
    of the box's shape and the stored dtype.

    The reads of one zarr shard file by all these boxes are one set of requests
    (`read_chunk_index`): its index read once, nearby inner chunks of different boxes
    fetched together (a 1x8 column reshard of row-sharded files reads each file in a few
    requests, not one per inner chunk per box). Each request is one pass: read (into a
    per-thread buffer still in the CPU's cache, or straight into the box), every inner
    chunk's crc32c checked there, then placed. With `pool` (never one of whose workers
    calls this: they would wait on each other), the files' indexes are read in parallel,
    then the requests are spread over one task per core (consecutive requests each).

    Raises:
      CorruptCheckpointError: a file is missing, of another size than planned, an index
        entry is missing or out of range, or a checksum fails; the message names the leaf
        and the chunk key.
    """
    by_file: dict[tuple[str | None, str], list[tuple[ChunkRead, np.ndarray]]] = {}
    for b, out in boxes:
        for r in b.reads:
            by_file.setdefault((r.source, r.chunk_key), []).append((r, out))
    if not by_file:
        return
    files = list(by_file.values())
    step = files[0][0][0].inner_bytes_with_crc
    opened: list[_ChunkFile] = []
    how = (max_over_read_ratio, read_chunk_bytes, opened)
    try:
        if pool is None or len(files) <= 1:
            runs = [run for reads in files for run in read_chunk_index(storage, path, meta, reads, stats, *how)]
        else:
            runs = [run for runs_of in _spread(pool, [functools.partial(read_chunk_index, storage, path, meta, reads, stats, *how)
                                                      for reads in files]) for run in runs_of]
        tasks = min(len(runs), os.cpu_count() or 1) if pool is not None else 1
        cuts = [len(runs) * k // tasks for k in range(tasks + 1)]
        _spread(pool, [functools.partial(_execute, runs[a:b], meta, step, path) for a, b in zip(cuts, cuts[1:])])
    finally:
        for f in opened:
            f.close()


def _spread(pool: concurrent.futures.Executor | None, calls: list[Callable[[], _T]]) -> list[_T]:
    """Runs `calls` (the first on this thread, the others on `pool`), waits for all of
    them (none still running when this returns or raises), and returns their results."""
    if pool is None or len(calls) <= 1:
        return [c() for c in calls]
    futures = [pool.submit(c) for c in calls[1:]]
    try:
        first = calls[0]()
    finally:
        concurrent.futures.wait(futures)
    return [first] + [fut.result() for fut in futures]


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
    """Assembles one target box (or slab) from its chunk reads (`read_boxes`, concurrently
    when `pool` is given), into `out` (C-contiguous, of the box's shape and the stored
    dtype) or a new host buffer. `pool` must not be one whose worker calls this (a worker
    would wait on tasks queued behind it)."""
    if out is None:
        out = host_buffer(box_read.box.shape, meta.dtype)
    read_boxes(storage, path, meta, [(box_read, out)], stats, max_over_read_ratio, read_chunk_bytes, pool)
    return out
