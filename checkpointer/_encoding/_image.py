"""The snapshot's one copy of a shard read in place: its zarr shard file, whole, in file
order (issue 28, "one copy on the way out"; docs/DESIGN-decisions.md).

Where the snapshot reads a shard's bytes in place (`_memory.reads_in_place`: the CPU
backend, numpy leaves) and the save writes local files, the snapshot copies the shard
straight into a `ShardImage`: a page-aligned host buffer that holds the chunk's zarr
shard file exactly as TensorStore writes it (`_write`'s module docstring: the inner
chunks in C order, each followed by its crc32c, then the index and its crc32c). Each
inner chunk's crc32c is computed in the same pass, right after its bytes were copied
(while they are in the CPU cache), and kept (`ShardImage.inner_crc32c`: the input of an
equality check of incremental saves). The direct writer then submits the buffer as it is
(`write_image`): no staging copy, no checksum in the background.

The copy runs on every core: a shard's inner chunks are cut into groups of whole bands
(inner chunks sharing their first-axis index) of about `_TASK_BYTES`, each group filled
by one task, which also computes the crc32c of its band's rows of the shard (the record's
`data_crc32c`, combined across groups with `_crc.combine`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import os
import struct
from collections.abc import Callable, Sequence

import crc32c
import numpy as np

from .. import _format
from .._format import ShardFileLayout
from .._storage import DIRECT_ALIGN
from . import _crc

_THREADS = max(2, os.cpu_count() or 2)
_TASK_BYTES = 8 << 20  # bytes of inner chunks one task fills (whole bands, at least one)
_INLINE_BYTES = 256 << 10  # shards up to this size are filled on the calling thread


@dataclasses.dataclass(frozen=True)
class ShardImage:
    """One chunk's zarr shard file, byte for byte, in a page-aligned host buffer.

    Attributes:
      buffer: uint8, `DIRECT_ALIGN`-aligned, at least `file_bytes` rounded up to
        `DIRECT_ALIGN` long (the bytes after `file_bytes` are padding, never written).
      file_bytes: the file's length, bytes.
      inner_crc32c: per stored inner chunk in file order, the crc32c of its bytes
        (uint32; those in the file, computed once, while copying).
      data_crc32c: crc32c of the chunk's C-order bytes (the record's `data_crc32c`).
      data_bytes: bytes of the chunk's data (its box's elements times the itemsize).
    """

    buffer: np.ndarray
    file_bytes: int
    inner_crc32c: np.ndarray
    data_crc32c: int
    data_bytes: int

    @property
    def nbytes(self) -> int:
        """Host bytes the image holds (its buffer)."""
        return self.buffer.nbytes


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


@dataclasses.dataclass
class _Job:
    layout: ShardFileLayout
    src: np.ndarray
    buffer: np.ndarray
    stored: tuple
    bands: bool
    crcs: np.ndarray
    parts: list  # per task in order: (crc32c, bytes) of its share of the chunk's data


def _fill(job: _Job, lo: int, hi: int, slot: int) -> None:
    """Copies stored inner chunks [lo, hi) (whole bands) of `job` into its buffer, each
    followed by its crc32c; records the crc32c of their share of the chunk's data."""
    layout, src, buf = job.layout, job.src, job.buffer
    n, nc, inner, dtype = layout.inner_bytes, layout.inner_bytes_with_crc, tuple(layout.inner_chunk_shape), src.dtype
    view = buf.data
    flat = src.reshape(-1).view(np.uint8) if (src.flags.c_contiguous and not job.bands and src.ndim) else None
    band_bytes = (src.nbytes // src.shape[0] if src.ndim else src.nbytes) * (inner[0] if inner else 1)
    data_crc, data_len, band = 0, 0, -1

    def band_done(b: int) -> None:
        nonlocal data_crc, data_len
        assert flat is not None
        rows = flat[b * band_bytes : (b + 1) * band_bytes]
        data_crc, data_len = crc32c.crc32c(rows.data, value=data_crc), data_len + rows.nbytes

    for k in range(lo, hi):
        _, first, part, cut = job.stored[k]
        if flat is not None and first != band:
            if band >= 0:  # the host rows of the band just copied, checksummed while cached
                band_done(band)
            band = first
        raw = buf[k * nc : k * nc + n]
        piece = src[part]
        if cut is not None:  # cut by the array's shape: the rest is fill (zero bytes)
            raw[...] = 0
            np.copyto(raw.view(dtype).reshape(inner)[cut], piece)
        else:
            np.copyto(raw.view(dtype).reshape(inner), piece)
        if job.bands:  # the real rows lead the inner chunk, the fill follows
            real = piece.nbytes
            head = crc32c.crc32c(raw[:real].data)
            crc = crc32c.crc32c(raw[real:].data, value=head) if real < n else head
            data_crc, data_len = _crc.combine(data_crc, head, real), data_len + real
        else:
            crc = crc32c.crc32c(raw.data)
        struct.pack_into("<I", view, k * nc + n, crc)
        job.crcs[k] = crc
    if flat is not None and band >= 0:
        band_done(band)
    job.parts[slot] = (data_crc, data_len)


def _tasks(job: _Job) -> list[tuple[int, int]]:
    """Ranges of stored inner chunks, whole bands, about `_TASK_BYTES` each."""
    nc, out, lo = job.layout.inner_bytes_with_crc, [], 0
    per = max(1, _TASK_BYTES // max(1, nc))
    stored = job.stored
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
    shard, read in place), filled on every core: the one copy of those bytes.

    Args:
      requests: per chunk its file layout and its box's host array (any strides; its
        dtype whole-byte, little-endian: `direct_supported`).
      take: gives a `DIRECT_ALIGN`-aligned uint8 buffer of at least the given bytes (a
        pool's, reused between saves).
    Returns:
      The images, in the order of `requests`.
    """
    jobs: list[_Job] = []
    work: list[tuple[_Job, int, int, int]] = []
    for layout, src in requests:
        shape = tuple(src.shape)
        stored = stored_inner_chunks(layout, shape)
        buf = take(image_bytes(layout, shape))
        job = _Job(layout, src, buf, stored, row_bands(layout, shape), np.zeros(len(stored), np.uint32), [])
        ranges = _tasks(job)
        job.parts = [None] * len(ranges)
        jobs.append(job)
        work.extend((job, lo, hi, slot) for slot, (lo, hi) in enumerate(ranges))
    big = [w for w in work if w[0].src.nbytes > _INLINE_BYTES]
    for w in work:
        if w[0].src.nbytes <= _INLINE_BYTES:
            _fill(*w)
    if len(big) == 1:
        _fill(*big[0])
    elif big:
        with concurrent.futures.ThreadPoolExecutor(min(_THREADS, len(big))) as ex:
            for f in [ex.submit(_fill, *w) for w in big]:
                f.result()
    return [_finish(job) for job in jobs]


def _finish(job: _Job) -> ShardImage:
    """Writes the index and its crc32c after the inner chunks; combines the data crc32c."""
    layout, buf = job.layout, job.buffer
    nc = layout.inner_bytes_with_crc
    index = np.full((layout.inner_chunks, 2), ShardFileLayout.MISSING, dtype="<u8")
    if job.stored:
        index[[ident for ident, _, _, _ in job.stored]] = [(k * nc, nc) for k in range(len(job.stored))]
    at = len(job.stored) * nc
    tail = index.reshape(-1).view(np.uint8)
    buf[at : at + tail.nbytes] = tail
    struct.pack_into("<I", buf.data, at + tail.nbytes, crc32c.crc32c(tail.data))
    size = at + tail.nbytes + ShardFileLayout.CRC_BYTES
    src = job.src
    if src.size and not job.bands and not (src.flags.c_contiguous and src.ndim):  # a strided view: one more pass
        data_crc = _format.data_crc32c(src)
    else:
        data_crc = _crc.combine_all((c, n) for c, n in job.parts)
    return ShardImage(buf, size, job.crcs, data_crc, src.nbytes)


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
