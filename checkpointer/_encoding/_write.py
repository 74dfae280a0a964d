"""Writing stored leaves: what a save gives every encoding's `start_write`, the choice
between direct and buffered writes, and the direct writer of zarr shard files.

Two ways of writing the same bytes (docs/DESIGN-decisions.md, "Direct local writes"):
- **buffered**: TensorStore writes every file (its `file` kvstore: the page cache, then
  `fsync`); every kvstore (`gs://`, `s3://`, `memory://`) is always written so.
- **direct**: on local POSIX files the library writes the zarr shard files and packs
  itself with `O_DIRECT` (`_storage._direct`), byte-identical to TensorStore's
  (`tests/test_direct_io.py`); TensorStore still writes every `zarr.json`, and the
  chunks of leaves whose dtype the byte layout below does not cover (sub-byte dtypes,
  big-endian hosts).

`direct_io="auto"` probes the write path with one aligned write (`_storage._direct.probe`)
and writes buffered where the file system refuses (`EINVAL`: tmpfs before Linux 6.6,
some network file systems; `EOPNOTSUPP`: some FUSE file systems); `True` requires direct writes; `False` never. The mode and
why go into the process record (`write_mode`, `write_mode_reason`).

A zarr shard file as TensorStore writes a whole chunk (`_format.ShardFileLayout`): the
inner chunks in C order, each its C-order little-endian bytes and their crc32c (an inner
chunk of an edge chunk that the array's shape cuts is padded with zeros, the fill value;
one entirely outside the shape is not stored and its index entry is all ones), then the
index (offset, nbytes: u64 LE per inner chunk in C order) and its crc32c.

Where the snapshot read the shard in place (CPU backend, numpy leaves), it already laid
the file out (`_image.ShardImage`): the writer's thread computes its crc32c words and the
record's `data_crc32c` in one pass over it (`ShardImage.checksum`, off the blocking path,
while the previous files are in flight) and submits the buffer as it is (`write_image`).
An incremental save's check of such a chunk runs there too, between that pass and the
write (`LeafWrite.write_if`): the chunk is written, or not, right after its checksum, as
any other image. Otherwise (the host copies of accelerators' shards, a local tier's
variant of a snapshot taken for an object store) each inner chunk is copied once from the
snapshot's host array into an aligned staging buffer and its crc32c computed there, once;
a full buffer goes to the file with one `O_DIRECT` write. The record's `data_crc32c` (the
chunk's C-order bytes) comes from the same pass (`_encode`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import numpy as np

from .. import _format
from .._errors import SaveError, where
from .._format import ArrayMetadata, Box, ChunkRecord, PackRecord, ShardFileLayout, is_whole_byte_dtype
from .._memory import staging_buffers
from .._storage import (
    DIRECT_ALIGN,
    DirectFile,
    LocalStorage,
    Storage,
    TokenBucket,
    acquire,
    probe_direct,
    sync_folders,
    ts_context,
    write_direct_file,
)
from . import _crc
from ._image import ShardImage, row_bands, stored_inner_chunks

DIRECT, BUFFERED = "direct", "buffered"
# Bytes of one staging buffer (one direct write), at least one inner chunk more.
STAGING_BYTES = 4 << 20
_THREADS = max(2, min(8, 2 * (os.cpu_count() or 2)))
# The nice value a direct writer's worker threads add to their own, per issuing thread
# (`lower_workers`: the background save thread sets it). The issuing thread itself keeps
# its priority: threads start at their creator's nice value, and process-wide pools it
# starts lazily (TensorStore's workers) would otherwise stay lowered for every later
# blocking save and restore.
_workers_nice = threading.local()


def lower_workers(nice: int) -> None:
    """The direct writers this thread creates from now on run their workers `nice` lower."""
    _workers_nice.value = nice


def _lower_priority(nice: int) -> None:
    """Adds `nice` to the calling thread's nice value (Linux only; elsewhere, or when
    refused, nothing: the save is the same, only its CPU share differs)."""
    if sys.platform != "linux" or nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # e.g. a seccomp profile; not worth failing a save
        pass
staging_buffers().max_free = _THREADS  # one free buffer per writer thread


@dataclasses.dataclass
class LeafWrite:
    """One array leaf's chunks this process writes: `(chunk index, box, host bytes of
    the box)` each, in plan order; the host bytes are an array of the box, or the
    chunk's whole shard file (`ShardImage`: the snapshot's one copy, written as it is).

    `write_if` (empty, or one entry per chunk): for a `ShardImage` chunk, a check the
    writer's thread runs right after the image's checksum pass and before its write
    (an incremental save's equality check, `_save._incremental`); False: the chunk is
    not written (no file, no record)."""

    meta: ArrayMetadata
    chunks: Sequence[tuple[tuple[int, ...], Box, np.ndarray | ShardImage]]
    write_if: Sequence[Callable[[], bool] | None] = ()


@dataclasses.dataclass
class WriteResult:
    """What an encoding wrote: the chunk records (in order) and its pack's index."""

    chunks: list[ChunkRecord] = dataclasses.field(default_factory=list)
    packed: PackRecord | None = None


class DirectWriter:
    """The direct writes of one save on one process: worker threads, the folders they
    created (synced once every file is durable) and the staging buffers.

    The threads start with the first `submit`: a writer that a failed save never used
    holds none, and `close` (which `start_write`'s function calls whatever happens)
    stops those that started."""

    def __init__(self, root: str, direct: bool = True) -> None:
        self.root = root.rstrip("/")
        self.direct = direct  # False: writes shard images through the page cache (`write_image`)
        self.staging = staging_buffers()  # process-wide: reused by every save's writer
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._folders: set[str] = set()
        self._made: set[str] = set()
        self._dirs = threading.Lock()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Runs `fn(*args)` on a worker thread; on this thread once the interpreter is
        shutting down (Python's pools then refuse new work, and the manager's last save
        still finishes at exit)."""
        try:
            with self._lock:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(
                        _THREADS, thread_name_prefix="checkpointer-direct",
                        initializer=_lower_priority, initargs=(getattr(_workers_nice, "value", 0),),
                    )
                pool = self._pool
            return pool.submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            done: concurrent.futures.Future = concurrent.futures.Future()
            try:
                done.set_result(fn(*args))
            except BaseException as e:
                done.set_exception(e)
            return done

    def makedirs(self, folder: str) -> None:
        """Creates `folder` (under the write path) and notes it and every parent up to
        the write path as folders to sync (any thread, before `close`)."""
        if folder in self._made:
            return
        with self._dirs:
            os.makedirs(folder, exist_ok=True)
            self._made.add(folder)
            while folder.startswith(self.root) and folder not in self._folders:
                self._folders.add(folder)
                if folder == self.root:
                    break
                folder = folder.rsplit("/", 1)[0]

    def close(self, *, sync: bool) -> None:
        """Waits for the threads; `sync`: makes the folders' new entries durable."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if sync:
            sync_folders(self._folders)


@dataclasses.dataclass
class WriteContext:
    """What a save gives every encoding's `start_write`.

    Attributes:
      process_index: this process (for error messages and the pack's name).
      writes_array_metadata: whether this process writes every array's `zarr.json`.
      limiter: `max_write_bytes_per_s`'s bucket, charged per chunk (None: unlimited).
      mode, mode_reason: "direct" or "buffered", and why (`choose_mode`).
      direct: the direct writer (mode "direct"), else None: TensorStore writes.
      files: the writer of shard images in mode "buffered" on local files (their
        bytes are the file's already: written through the page cache, not by
        TensorStore); None elsewhere.
      pack_slab: the snapshot's `_pack.PackSlab` where it laid this process's packed
        chunks out as the pack already (the pack writer then copies nothing), or None.
    """

    process_index: int
    writes_array_metadata: bool
    limiter: TokenBucket | None = None
    mode: str = BUFFERED
    mode_reason: str = "direct_io=False"
    direct: DirectWriter | None = None
    files: DirectWriter | None = None
    pack_slab: Any = None  # `_pack.PackSlab` (that module imports this one)

    @property
    def image_writer(self) -> DirectWriter | None:
        """The writer of shard images: the direct writer, else `files`."""
        return self.direct if self.direct is not None else self.files


def direct_supported(dtype: np.dtype) -> bool:
    """Whether the direct writer lays out this dtype's chunks itself: whole-byte dtypes
    on a little-endian host (the layout of the module docstring)."""
    return sys.byteorder == "little" and is_whole_byte_dtype(dtype) and np.dtype(dtype).byteorder != ">"


def choose_mode(storage: Storage, root: str, direct_io: str | bool, process_index: int) -> tuple[str, str]:
    """`(mode, reason)` of a save's writes into `root` (an existing folder for local files).

    Raises:
      SaveError: `direct_io=True` where direct writes are impossible (a kvstore, or the
        file system refuses `O_DIRECT`), naming the path, the process and the fix.
      OSError: the probe failed otherwise (the folder is not writable).
    """
    if direct_io is False:
        return BUFFERED, "direct_io=False"
    if not isinstance(storage, LocalStorage):
        why = "not a local POSIX path: TensorStore writes every kvstore"
    else:
        refused = probe_direct(root)
        if refused is None:
            return DIRECT, "direct_io=True" if direct_io is True else "direct_io='auto': the file system accepts O_DIRECT"
        why = refused
    if direct_io is True:
        raise SaveError(
            f"cannot save to {root} (process {process_index}) with direct_io=True: {why}. Pass direct_io='auto' "
            "(direct where the file system allows it, else buffered) or direct_io=False"
        )
    return BUFFERED, f"direct_io='auto': {why}"


def write_context(
    storage: Storage, root: str, direct_io: str | bool, *, process_index: int, writes_array_metadata: bool,
    limiter: TokenBucket | None = None, pack_slab: Any = None,
) -> WriteContext:
    """The `WriteContext` of one save's writes into `root`: the mode `choose_mode` gives,
    with a direct writer in mode "direct" (`start_write`'s function stops it).

    Raises:
      SaveError, OSError: as `choose_mode`.
    """
    mode, reason = choose_mode(storage, root, direct_io, process_index)
    files = DirectWriter(root, direct=False) if mode == BUFFERED and isinstance(storage, LocalStorage) else None
    return WriteContext(
        process_index, writes_array_metadata, limiter, mode, reason, DirectWriter(root) if mode == DIRECT else None, files,
        pack_slab,
    )


def chunk_record(meta: ArrayMetadata, chunk_index: Sequence[int], box: Box, data: np.ndarray, data_crc32c: int | None = None) -> ChunkRecord:
    """The record of one chunk written from `data` (the host bytes of `box`); its
    `data_crc32c` computed unless given."""
    return ChunkRecord(
        leaf=meta.path,
        key=_format.chunk_key(meta.path, chunk_index),
        box=box,
        file_bytes=meta.layout.file_bytes,
        data_bytes=data.nbytes,
        data_crc32c=_format.data_crc32c(data) if data_crc32c is None else data_crc32c,
    )


def write_shard_file(writer: DirectWriter, path: str, meta: ArrayMetadata, chunk_index: tuple[int, ...], box: Box, host: np.ndarray) -> ChunkRecord:
    """Writes one chunk's zarr shard file to `path` (its folder made) with `O_DIRECT`, durably, laid out
    as TensorStore does (module docstring); returns its record.

    Raises:
      OSError: from the file system.
    """
    layout = meta.layout
    f = DirectFile(path)
    stage = writer.staging.take(max(STAGING_BYTES, layout.inner_bytes_with_crc + DIRECT_ALIGN))
    try:
        data_crc = _encode(f, stage, layout, meta.inner_chunk_shape, box, host)
    finally:
        f.close()
        writer.staging.give_back(stage)
    return chunk_record(meta, chunk_index, box, host, data_crc)


def write_image(path: str, image: ShardImage, direct: bool) -> None:
    """Writes a chunk's shard file from its `ShardImage` as it is, durably: with
    `O_DIRECT` (`direct`), else through the page cache (a file system that refuses
    `O_DIRECT`); no copy. Its crc32c words first, unless computed already
    (`ShardImage.checksum`: one pass over the buffer, just before it is submitted).

    Raises:
      OSError: from the file system.
    """
    image.checksum()
    if direct:
        write_direct_file(path, image.buffer, image.file_bytes)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(image.buffer.data).cast("B")[: image.file_bytes]
        while view:
            view = view[os.pwrite(fd, view, image.file_bytes - len(view)) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def image_record(meta: ArrayMetadata, chunk_index: Sequence[int], box: Box, image: ShardImage) -> ChunkRecord:
    """The record of one chunk written from its `ShardImage`."""
    return ChunkRecord(
        leaf=meta.path, key=_format.chunk_key(meta.path, chunk_index), box=box, file_bytes=meta.layout.file_bytes,
        data_bytes=image.data_bytes, data_crc32c=image.data_crc32c,
    )


def _write_image_file(writer: DirectWriter, path: str, meta: ArrayMetadata, chunk_index: tuple[int, ...], box: Box, image: ShardImage,
                      check: Callable[[], bool] | None = None, limiter: TokenBucket | None = None) -> ChunkRecord | None:
    """Writes one image (its folder first); with `check` (`LeafWrite.write_if`): its
    checksum pass, then the check, then (paced by `limiter`) the write only if the check
    says so (else None)."""
    if check is not None:
        image.checksum()
        if not check():
            return None
        acquire(limiter, image.data_bytes)  # only what is written is paced
    writer.makedirs(path.rsplit("/", 1)[0])
    write_image(path, image, writer.direct)
    return image_record(meta, chunk_index, box, image)


def _encode(f: DirectFile, stage: np.ndarray, layout: ShardFileLayout, inner: tuple[int, ...], box: Box, host: np.ndarray) -> int:
    """Fills `stage` with the shard file's bytes, writing each full aligned part; ends
    the file. Returns the crc32c of `host`'s C-order bytes (the record's `data_crc32c`),
    computed in the same pass as the inner chunks': combined from theirs where the inner
    chunks are row bands (`row_bands`), else from each band of host rows right after
    its inner chunks were copied (while it is in the CPU cache)."""
    align, inner, shape = DIRECT_ALIGN, tuple(inner), tuple(box.shape)
    n, nc, cap = layout.inner_bytes, layout.inner_bytes_with_crc, stage.nbytes
    view = stage.data  # for the crc32c words
    stored = stored_inner_chunks(layout, shape)
    pos = base = 0  # next byte in `stage`; file offset of stage[0]
    bands = row_bands(layout, shape)
    flat = host.reshape(-1).view(np.uint8) if host.flags.c_contiguous and not bands else None
    band_bytes = (host.nbytes // shape[0] if host.ndim else host.nbytes) * (inner[0] if inner else 1)
    data_crc, band = 0, -1  # crc32c of no bytes; the first-axis inner index of the band in progress
    dtype = host.dtype

    def flush() -> None:  # writes the aligned part of `stage`, keeps the rest at its start
        nonlocal pos, base
        k = pos - pos % align
        if k:
            f.write_at(base, stage[:k])
            rest = pos - k
            stage[:rest] = stage[k:pos]
            base, pos = base + k, rest

    for _, first, part, cut in stored:
        if flat is not None and first != band:
            if band >= 0:  # the host rows of the band just copied, checksummed while cached
                data_crc = crc32c.crc32c(flat[band * band_bytes : (band + 1) * band_bytes].data, value=data_crc)
            band = first
        if pos + nc > cap:
            flush()
        raw = stage[pos : pos + n]
        src = host[part]
        if cut is not None:  # cut by the array's shape: the rest is fill (zero bytes)
            raw[...] = 0
            np.copyto(raw.view(dtype).reshape(inner)[cut], src)
        else:
            np.copyto(raw.view(dtype).reshape(inner), src)
        if bands:  # the real rows lead the inner chunk, the fill follows
            real = src.nbytes
            head = crc32c.crc32c(raw[:real].data)
            crc = crc32c.crc32c(raw[real:].data, value=head) if real < n else head
            data_crc = _crc.combine(data_crc, head, real)
        else:
            crc = crc32c.crc32c(raw.data)
        struct.pack_into("<I", view, pos + n, crc)
        pos += nc
    if flat is not None and band >= 0:
        data_crc = crc32c.crc32c(flat[band * band_bytes : (band + 1) * band_bytes].data, value=data_crc)
    index = np.full((layout.inner_chunks, 2), ShardFileLayout.MISSING, dtype="<u8")
    if stored:
        index[[ident for ident, _, _, _ in stored]] = [(k * nc, nc) for k in range(len(stored))]
    tail = index.reshape(-1).view(np.uint8)
    tail = np.concatenate([tail, np.frombuffer(crc32c.crc32c(tail.data).to_bytes(4, "little"), np.uint8)])
    while tail.size:
        take = min(tail.size, cap - pos)
        stage[pos : pos + take] = tail[:take]
        pos, tail = pos + take, tail[take:]
        if tail.size:
            flush()
    end = -(-pos // align) * align
    stage[pos:end] = 0
    if end:
        f.write_at(base, stage[:end])
    f.finish(base + pos)
    if not bands and flat is None:  # a strided snapshot (none is): one more pass
        data_crc = _format.data_crc32c(host)
    return data_crc


def wait_all(pending: Sequence[tuple[str, object]], root: str, process_index: int, what: str = "writing a chunk failed") -> list:
    """Waits for every `(leaf path, future)` (TensorStore's or a thread's), all of them
    even after a failure, and returns their results in order.

    Raises:
      SaveError: the first failure, naming its leaf, the path and the process.
    """
    out, first = [], None
    for leaf_path, fut in pending:
        try:
            out.append(fut.result())  # type: ignore[attr-defined]
        except Exception as e:
            out.append(None)
            if first is None:
                first = e
                if not isinstance(e, SaveError):
                    first = SaveError(f"{where(leaf=leaf_path, path=root, process=process_index)}: {what}: {e}")
                    first.__cause__ = e
    if first is not None:
        raise first
    return out


def open_array(storage: Storage, root: str, meta: ArrayMetadata, *, create: bool) -> Any:
    """Opens (`create`: creates, writing its `zarr.json`) a leaf's zarr array in the
    write path `root` for writing: a TensorStore future."""
    import tensorstore as ts  # lazily: a restore of local files never needs it

    kvstore = storage.kvstore_spec(f"{root}/{_format.array_dir(meta.path)}")
    return ts.open(_format.zarr_spec(kvstore, meta, mode="create" if create else "write"), context=ts_context())


def start_zarr_writes(storage: Storage, root: str, leaves: Sequence[LeafWrite], ctx: WriteContext):
    """Issues the writes of leaves stored as their own zarr arrays (`ZarrArrayEncoding`):
    TensorStore creates each `zarr.json` (`ctx.writes_array_metadata`) and writes the
    chunks in mode "buffered" (and of dtypes `direct_supported` refuses); the direct
    writer writes the others. Returns the function that waits for all of them and gives
    the `WriteResult` (chunk records in plan order).

    Raises (either): SaveError naming the leaf, the path and the process; nothing it
    started is still running when it raises.
    """
    pending: list[tuple[str, object]] = []  # (leaf path, future giving a ChunkRecord)
    creations: list[tuple[str, object]] = []  # (leaf path, TensorStore's creation of a zarr.json only)
    opened = []
    try:
        for lw in leaves:
            images = any(isinstance(host, ShardImage) for _, _, host in lw.chunks)
            if images and ctx.image_writer is None:
                raise SaveError(
                    f"{where(leaf=lw.meta.path, path=root, process=ctx.process_index)}: the snapshot holds shard files "
                    "(local files) but the write goes elsewhere; this is a bug of checkpointer, please report it"
                )
            direct = images or (ctx.direct is not None and direct_supported(lw.meta.dtype))
            fut = None
            if ctx.writes_array_metadata or not direct:
                fut = open_array(storage, root, lw.meta, create=ctx.writes_array_metadata)
            opened.append((lw, fut, direct))
        for lw, fut, direct in opened:
            meta, store = lw.meta, None
            if fut is not None and direct:
                creations.append((meta.path, fut))  # waited for at the end: the chunks need no store
            elif fut is not None:
                try:
                    store = fut.result()
                except Exception as e:
                    raise SaveError(f"{where(leaf=meta.path, keystr=meta.keystr, path=root, process=ctx.process_index)}: cannot create the zarr array: {e}") from e
            for k, (chunk_index, box, host) in enumerate(lw.chunks):
                if isinstance(host, ShardImage):  # the snapshot laid the file out: written as it is
                    check = lw.write_if[k] if lw.write_if else None
                    if check is None:
                        acquire(ctx.limiter, host.data_bytes)
                    writer = ctx.image_writer
                    assert writer is not None
                    path = f"{root}/{_format.chunk_key(meta.path, chunk_index)}"
                    pending.append((meta.path, writer.submit(_write_image_file, writer, path, meta, chunk_index, box, host, check,
                                                             ctx.limiter)))
                    continue
                acquire(ctx.limiter, host.nbytes)  # paced per chunk write
                if host.size == 0:
                    pending.append((meta.path, _Done(chunk_record(meta, chunk_index, box, host))))
                elif direct:
                    assert ctx.direct is not None
                    path = f"{root}/{_format.chunk_key(meta.path, chunk_index)}"
                    ctx.direct.makedirs(path.rsplit("/", 1)[0])  # here: the writer's folder set is not thread-safe
                    pending.append((meta.path, ctx.direct.submit(write_shard_file, ctx.direct, path, meta, chunk_index, box, host)))
                else:
                    assert store is not None
                    # TensorStore encodes straight from the snapshot instead of copying it into
                    # its cache first: nothing changes `host` before the write is durable, and a
                    # buffer TensorStore still references never returns to a pool (`_buffer_pool`).
                    write = store[box.slices()].write(host, can_reference_source_data_indefinitely=True)
                    pending.append((meta.path, _After(write, chunk_record(meta, chunk_index, box, host))))
    except BaseException:
        started: list[object] = [f for _, f, _ in opened if f is not None] + [f for _, f in pending]
        for started_future in started:
            try:
                started_future.result()  # type: ignore[attr-defined]
            except Exception:
                pass
        raise

    def finish() -> WriteResult:
        try:
            wait_all(creations, root, ctx.process_index, "cannot create the zarr array")
        finally:
            records = wait_all(pending, root, ctx.process_index)
        return WriteResult([r for r in records if r is not None])  # None: not written (`LeafWrite.write_if`)

    return finish


class _Done:
    """A future already done."""

    def __init__(self, value: object) -> None:
        self._value = value

    def result(self) -> object:
        return self._value


class _After:
    """`value` once TensorStore's `future` is done."""

    def __init__(self, future, value: object) -> None:
        self._future, self._value = future, value

    def result(self) -> object:
        self._future.result()
        return self._value
