"""The snapshot's one copy of a shard read in place: its zarr shard file, whole, in file
order (issue 28, "one copy on the way out"; docs/DESIGN-decisions.md).

Where the snapshot reads a shard's bytes in place (`_memory.reads_in_place`: the CPU
backend, numpy leaves) and the save writes local files, the snapshot copies the shard
straight into a `ShardImage`: a page-aligned host buffer that holds the chunk's zarr
shard file exactly as TensorStore writes it (`_write`'s module docstring: the inner
chunks in C order, each followed by its crc32c, then the index and its crc32c). The
direct writer then submits the buffer as it is (`write_image`): no staging copy.

The blocking copy (`fill_images`) moves bytes on every core: a shard's inner chunks are
cut into groups of whole bands (inner chunks sharing their first-axis index) of about
`_TASK_BYTES`, each group copied by one task. Where the inner chunks cut the box's rows
and the box is C-contiguous, the task also checksums each band's rows of the box right
after copying them, while they are in the CPU cache: the record's `data_crc32c` (the box's
C-order bytes, combined across tasks with `_crc.combine`). The inner chunks' crc32c come
after, off the blocking path, in one pass over the image (`ShardImage.checksum`, run by
the writer's thread right before it submits the buffer, or by an incremental save's
equality check first, whichever asks first; once): one call per inner chunk, contiguous
in the file, written into its word. Where the inner chunks are bands of whole rows,
`data_crc32c` combines from their real rows' crc32c in that pass; a strided box (rows not
contiguous) is gathered there instead, each band a few rows at a time into C order in a
small buffer (the caller's shard cannot be read any more: it may be donated once the
snapshot returns). Measured (save_cpu_check.py, 1 GiB, alternating): gathering every box
in the writer's pass cost 0.86-0.93 CPU-s/GiB until committed, against 0.62-0.78 with
the fill's hot pass, which adds 30-60 ms to the blocking copy (docs/DESIGN-decisions.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import math
import os
import struct
import threading
from collections.abc import Callable, Sequence

import crc32c
import numpy as np

from .._format import ShardFileLayout
from .._storage import DIRECT_ALIGN
from . import _crc

_THREADS = max(2, os.cpu_count() or 2)
_TASK_BYTES = 8 << 20  # bytes of inner chunks one task fills (whole bands, at least one)
_INLINE_BYTES = 256 << 10  # shards up to this size are filled on the calling thread
_GATHER_BYTES = 256 << 10  # rows of a band gathered into C order at a time (cache-sized)
_scratch = threading.local()  # per thread: the gather buffer of `_checksum`


@dataclasses.dataclass
class _Sums:
    """The checksums of one image, once computed (`ShardImage.checksum`)."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    inner: np.ndarray | None = None
    data: int | None = None  # set by `fill_images` already where it checksummed the box's rows


@dataclasses.dataclass(frozen=True, eq=False)
class ShardImage:
    """One chunk's zarr shard file, byte for byte, in a page-aligned host buffer.

    The bytes are copied by the blocking snapshot; the crc32c words (after each inner
    chunk) are written by `checksum`, which the writer calls before it submits the
    buffer: until then the buffer is not yet the file.

    Attributes:
      buffer: uint8, `DIRECT_ALIGN`-aligned, at least `file_bytes` rounded up to
        `DIRECT_ALIGN` long (the bytes after `file_bytes` are padding, never written).
      file_bytes: the file's length, bytes.
      data_bytes: bytes of the chunk's data (its box's elements times the itemsize).
      layout: the file's layout.
      box_shape: the chunk's box shape, elements.
      dtype: the chunk's dtype.
    """

    buffer: np.ndarray
    file_bytes: int
    data_bytes: int
    layout: ShardFileLayout
    box_shape: tuple[int, ...]
    dtype: np.dtype
    _sums: _Sums = dataclasses.field(default_factory=_Sums, repr=False)

    @property
    def nbytes(self) -> int:
        """Host bytes the image holds (its buffer)."""
        return self.buffer.nbytes

    @property
    def checksummed(self) -> bool:
        """Whether `checksum` ran (the crc32c words are in the buffer)."""
        return self._sums.inner is not None

    def checksum(self) -> None:
        """Computes, once, each inner chunk's crc32c (written into the buffer, after the
        inner chunk) and the chunk's `data_crc32c`, in one pass over the image. Thread-
        safe: a second caller waits for the first's result."""
        sums = self._sums
        if sums.inner is not None:
            return
        with sums.lock:
            if sums.inner is None:
                sums.inner, sums.data = _checksum(self, sums.data)

    @property
    def inner_crc32c(self) -> np.ndarray:
        """Per stored inner chunk in file order, the crc32c of its bytes (uint32;
        `checksum` first if not yet)."""
        self.checksum()
        assert self._sums.inner is not None
        return self._sums.inner

    @property
    def data_crc32c(self) -> int:
        """crc32c of the chunk's C-order bytes (the record's `data_crc32c`; `checksum`
        first if not yet)."""
        self.checksum()
        assert self._sums.data is not None
        return self._sums.data


def row_bands(layout: ShardFileLayout, box_shape: tuple[int, ...]) -> bool:
    """Whether the inner chunks are bands of whole rows of the box (split along the first
    axis only, the box not cut along any other): then the box's C-order bytes are the
    inner chunks' real rows, in order, and its crc32c combines from theirs."""
    return all(i == c == b for i, c, b in zip(layout.inner_chunk_shape[1:], layout.chunk_shape[1:], box_shape[1:]))


@functools.lru_cache(maxsize=256)
def stored_inner_chunks(layout: ShardFileLayout, box_shape: tuple[int, ...]) -> tuple[tuple[int, int, tuple, tuple | None], ...]:
    """The inner chunks a box of `box_shape` stores, in C order: `(index in the file's
    grid, first-axis index, the box's slices, the slices of the inner chunk they fill
    where the box's shape cuts it, else None)`. Those entirely outside are left out.
    Cached: a save writes many chunks of one layout and shape."""
    inner = layout.inner_chunk_shape
    out = []
    for ident, cell in enumerate(itertools.product(*(range(g) for g in layout.inner_grid))):
        lo = [c * i for c, i in zip(cell, inner)]
        if any(lo_d >= b for lo_d, b in zip(lo, box_shape)):
            continue  # entirely outside the array's shape: not stored
        part = tuple(slice(lo_d, min(lo_d + i, b)) for lo_d, i, b in zip(lo, inner, box_shape))
        cut = None if all(p.stop - p.start == i for p, i in zip(part, inner)) else tuple(slice(0, p.stop - p.start) for p in part)
        out.append((ident, cell[0] if cell else 0, part, cut))
    return tuple(out)


def image_bytes(layout: ShardFileLayout, box_shape: tuple[int, ...]) -> int:
    """The buffer bytes of a `ShardImage` of a box of `box_shape`: its file bytes rounded
    up to `DIRECT_ALIGN`."""
    n = len(stored_inner_chunks(layout, tuple(box_shape))) * layout.inner_bytes_with_crc + layout.index_bytes
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


@functools.lru_cache(maxsize=256)
def _index_tail(layout: ShardFileLayout, box_shape: tuple[int, ...]) -> bytes:
    """The file's index and its crc32c (the same for every box of this shape)."""
    stored = stored_inner_chunks(layout, box_shape)
    nc = layout.inner_bytes_with_crc
    index = np.full((layout.inner_chunks, 2), ShardFileLayout.MISSING, dtype="<u8")
    if stored:
        index[[ident for ident, _, _, _ in stored]] = [(k * nc, nc) for k in range(len(stored))]
    tail = index.tobytes()
    return tail + struct.pack("<I", crc32c.crc32c(tail))


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[...] = src` (same shape and dtype), as bytes where both last axes are
    contiguous (numpy copies uint8 rows faster than most element types)."""
    if dst.ndim and dst.strides[-1] == dst.itemsize and src.strides[-1] == src.itemsize:
        dst, src = dst.view(np.uint8), src.view(np.uint8)
    np.copyto(dst, src)


def _fill(layout: ShardFileLayout, src: np.ndarray, buf: np.ndarray, stored: tuple, lo: int, hi: int,
          parts: list[tuple[int, int]] | None = None, slot: int = 0) -> None:
    """Copies stored inner chunks [lo, hi) (whole bands) of a box `src` into their places
    in `buf` (their crc32c words are `checksum`'s). With `parts` (a C-contiguous `src`
    whose inner chunks cut its rows): after each band is copied, the crc32c of the
    band's rows of `src`, read again while they are in the CPU cache, goes into
    `parts[slot]` as `(crc32c, bytes)`: this task's share of the record's `data_crc32c`."""
    n, nc, inner = layout.inner_bytes, layout.inner_bytes_with_crc, tuple(layout.inner_chunk_shape)
    dtype = src.dtype
    band, rows, crc, length = -1, None, 0, 0
    for k in range(lo, hi):
        _, first, part, cut = stored[k]
        if parts is not None and first != band:
            if rows is not None:
                crc, length = _rows_crc(src, rows, crc, length)
            band, rows = first, part[0]
        raw = buf[k * nc : k * nc + n]
        piece = src[part]
        if cut is not None:  # cut by the array's shape: the rest is fill (zero bytes)
            raw[...] = 0
            _copy(raw.view(dtype).reshape(inner)[cut], piece)
        else:
            _copy(raw.view(dtype).reshape(inner), piece)
    if parts is not None:
        if rows is not None:
            crc, length = _rows_crc(src, rows, crc, length)
        parts[slot] = (crc, length)


def _rows_crc(src: np.ndarray, rows: slice, crc: int, length: int) -> tuple[int, int]:
    """`(crc, length)` advanced over the C-order bytes of `src[rows]` (`src` C-contiguous)."""
    data = src[rows].reshape(-1).view(np.uint8)
    return crc32c.crc32c(data.data, value=crc), length + data.nbytes


def _tasks(layout: ShardFileLayout, stored: tuple) -> list[tuple[int, int]]:
    """Ranges of stored inner chunks, whole bands, about `_TASK_BYTES` each."""
    out, lo = [], 0
    per = max(1, _TASK_BYTES // max(1, layout.inner_bytes_with_crc))
    while lo < len(stored):
        hi = min(len(stored), lo + per)
        while hi < len(stored) and stored[hi][1] == stored[hi - 1][1]:  # finish the band
            hi += 1
        out.append((lo, hi))
        lo = hi
    return out


def fill_images(
    requests: Sequence[tuple[ShardFileLayout, np.ndarray]], take: Callable[[int], np.ndarray],
) -> list[ShardImage]:
    """The shard files of `requests`, each `(layout, host bytes of the box)` (a view of the
    shard, read in place), copied on every core: the one copy of those bytes. The
    checksums are not computed here (`ShardImage.checksum`).

    Args:
      requests: per chunk its file layout and its box's host array (any strides; its
        dtype whole-byte, little-endian: `direct_supported`).
      take: gives a `DIRECT_ALIGN`-aligned uint8 buffer of at least the given bytes (a
        pool's, reused between saves).
    Returns:
      The images, in the order of `requests`.
    """
    images: list[ShardImage] = []
    pending: list[tuple[ShardImage, list[tuple[int, int]]]] = []
    small: list[tuple] = []
    big: list[tuple] = []
    for layout, src in requests:
        shape = tuple(src.shape)
        stored = stored_inner_chunks(layout, shape)
        buf = take(image_bytes(layout, shape))
        at = len(stored) * layout.inner_bytes_with_crc
        tail = _index_tail(layout, shape)
        buf[at : at + len(tail)] = np.frombuffer(tail, np.uint8)
        image = ShardImage(buf, at + len(tail), src.nbytes, layout, shape, src.dtype)
        images.append(image)
        ranges = _tasks(layout, stored)
        # Inner chunks that cut the box's rows: the box's C-order crc32c from its rows,
        # right after each band is copied (hot), not by gathering the image later.
        parts: list[tuple[int, int]] | None = [(0, 0)] * len(ranges) if src.size and src.ndim and src.flags.c_contiguous and not row_bands(layout, shape) else None
        if parts is not None:
            pending.append((image, parts))
        work = [(layout, src, buf, stored, lo, hi, parts, slot) for slot, (lo, hi) in enumerate(ranges)]
        (small if src.nbytes <= _INLINE_BYTES else big).extend(work)
    for w in small:
        _fill(*w)
    if len(big) == 1:
        _fill(*big[0])
    elif big:
        with concurrent.futures.ThreadPoolExecutor(min(_THREADS, len(big))) as ex:
            for f in [ex.submit(_fill, *w) for w in big]:
                f.result()
    for image, parts in pending:
        image._sums.data = _crc.combine_all(parts)
    return images


def _checksum(image: ShardImage, data_crc32c: int | None) -> tuple[np.ndarray, int]:
    """The crc32c of each stored inner chunk of `image` (written into its word) and the
    crc32c of the box's C-order bytes (`data_crc32c` where the fill computed it already),
    in one pass (module docstring)."""
    layout, shape, buf = image.layout, image.box_shape, image.buffer
    stored = stored_inner_chunks(layout, shape)
    n, nc = layout.inner_bytes, layout.inner_bytes_with_crc
    crcs = np.zeros(len(stored), np.uint32)
    if data_crc32c is not None:  # each inner chunk is contiguous in the file: one call each
        data = data_crc32c
        for k in range(len(stored)):
            crcs[k] = crc32c.crc32c(buf[k * nc : k * nc + n].data)
    elif row_bands(layout, shape):  # the real rows lead each inner chunk, the fill follows
        itemsize, data = np.dtype(image.dtype).itemsize, 0
        for k, (_, _, part, _) in enumerate(stored):
            raw = buf[k * nc : k * nc + n]
            real = itemsize * math.prod(p.stop - p.start for p in part)
            head = crc32c.crc32c(raw[:real].data)
            crcs[k] = crc32c.crc32c(raw[real:].data, value=head) if real < n else head
            data = _crc.combine(data, head, real)
    else:
        data = _gathered(image, stored, crcs)
    view = buf.data
    for k, crc in enumerate(crcs.tolist()):
        struct.pack_into("<I", view, k * nc + n, crc)
    return crcs, data


def _gathered(image: ShardImage, stored: tuple, crcs: np.ndarray) -> int:
    """Inner chunks that cut the box's rows (not `row_bands`): each band a few rows at a
    time, the inner chunks' crc32c (into `crcs`) advanced over those rows, the rows
    gathered into C order in a small buffer and checksummed there. Returns the crc32c of
    the box's C-order bytes."""
    layout, shape, dtype, buf = image.layout, image.box_shape, np.dtype(image.dtype), image.buffer
    n, nc, inner = layout.inner_bytes, layout.inner_bytes_with_crc, tuple(layout.inner_chunk_shape)
    inner_row = n // inner[0]  # bytes of one row of an inner chunk
    box_row = math.prod(shape[1:]) * dtype.itemsize  # bytes of one row of the box
    rows = max(1, _GATHER_BYTES // max(box_row, 1))
    scratch = getattr(_scratch, "buffer", None)
    if scratch is None or scratch.nbytes < rows * box_row:
        scratch = _scratch.buffer = np.empty(max(rows * box_row, _GATHER_BYTES), np.uint8)
    data, k = 0, 0
    while k < len(stored):
        band = k
        while k < len(stored) and stored[k][1] == stored[band][1]:
            k += 1
        real_rows = stored[band][2][0].stop - stored[band][2][0].start
        for g in range(0, inner[0], rows):
            stop = min(g + rows, inner[0])
            for j in range(band, k):  # the inner chunks' crc32c over rows g..stop (fill rows too)
                crcs[j] = crc32c.crc32c(buf[j * nc + g * inner_row : j * nc + stop * inner_row].data, value=int(crcs[j]))
            if g >= real_rows:
                continue
            m = min(stop, real_rows) - g
            out = scratch[: m * box_row].view(dtype).reshape((m, *shape[1:]))
            for j in range(band, k):
                _, _, part, cut = stored[j]
                tile = buf[j * nc : j * nc + n].view(dtype).reshape(inner)[g : g + m]
                if cut is not None:
                    tile = tile[(slice(None), *cut[1:])]
                _copy(out[(slice(None), *part[1:])], tile)
            data = crc32c.crc32c(scratch[: m * box_row].data, value=data)
    return data


def image_data(image: ShardImage, layout: ShardFileLayout, box_shape: tuple[int, ...], dtype: np.dtype) -> list[np.ndarray]:
    """The chunk's C-order data bytes read back from its image, as uint8 pieces in order
    (what `data_crc32c` covers): views of the inner chunks' leading bytes where they are
    bands of whole rows (no copy), else the box reassembled (one copy). For a check that
    needs the data itself (incremental saves' XXH3-128), only where the crc32c matched."""
    shape = tuple(box_shape)
    stored = stored_inner_chunks(layout, shape)
    n, nc, buf = layout.inner_bytes, layout.inner_bytes_with_crc, image.buffer
    itemsize = np.dtype(dtype).itemsize
    if row_bands(layout, shape):
        return [buf[k * nc : k * nc + itemsize * int(np.prod([p.stop - p.start for p in part]))] for k, (_, _, part, _) in enumerate(stored)]
    out = np.empty(shape, dtype)
    inner = tuple(layout.inner_chunk_shape)
    for k, (_, _, part, cut) in enumerate(stored):
        raw = buf[k * nc : k * nc + n].view(dtype).reshape(inner)
        out[part] = raw[cut] if cut is not None else raw
    return [out.reshape(-1).view(np.uint8)]
