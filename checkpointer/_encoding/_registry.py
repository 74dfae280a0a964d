"""The registry of stored-leaf encodings, and the operations that dispatch through it.

`ENCODINGS` lists every encoding (`_base.LeafEncoding`); `encoding_of(meta)` is the one
that stores a leaf. The functions below are what the other packages call: each groups
leaves by encoding, in registry order, and calls the encoding's method.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from .._errors import CorruptCheckpointError, leaf_name
from .._format import ArrayMetadata, Box, ProcessRecord
from .._storage import Storage
from ._base import Item, LeafEncoding, ReadContext
from ._leaf_plan import LeafRestorePlan, by_box
from ._packed import PackedEncoding
from ._write import LeafWrite, WriteContext, WriteResult
from ._zarr_array import ZarrArrayEncoding

ENCODINGS: tuple[LeafEncoding, ...] = (ZarrArrayEncoding(), PackedEncoding())


def encoding_of(meta: ArrayMetadata) -> LeafEncoding:
    """The encoding that stores `meta`.

    Raises:
      CorruptCheckpointError: no encoding stores it (a manifest entry of a later release).
    """
    for encoding in ENCODINGS:
        if encoding.stores(meta):
            return encoding
    raise CorruptCheckpointError(f"leaf {leaf_name(meta.path, meta.keystr)}: no stored-leaf encoding of this release reads it; upgrade checkpointer")


def by_encoding(metas: Iterable[ArrayMetadata]) -> list[tuple[LeafEncoding, list[ArrayMetadata]]]:
    """`metas` grouped by encoding, in registry order (each group in the given order)."""
    return [(enc, group) for enc, group in _grouped(metas, lambda m: m) if group]


def _grouped(items, meta_of) -> list:
    groups: dict[int, list] = {id(e): [] for e in ENCODINGS}
    for item in items:
        groups[id(encoding_of(meta_of(item)))].append(item)
    return [(e, groups[id(e)]) for e in ENCODINGS]


def plan_leaf(
    meta: ArrayMetadata, device_boxes: Mapping[int, Box] | Sequence[tuple[int, Box]], *, slab_bytes: int | None = None
) -> LeafRestorePlan:
    """Plans the reads of one leaf for this process's devices (`LeafEncoding.plan`).

    Args:
      meta: the stored leaf.
      device_boxes: `(device_id, target box)` pairs of this process's devices.
      slab_bytes: host-memory bound of one read, bytes (slabs where the encoding has them).
    Returns:
      One `BoxRead` per unique box, in box order.
    """
    return encoding_of(meta).plan(meta, by_box(device_boxes), slab_bytes=slab_bytes)


def files(meta: ArrayMetadata, boxes: Iterable[Box]) -> Iterator[tuple[str, int]]:
    """The files (key, expected bytes) holding `boxes` of the leaf (`LeafEncoding.files`)."""
    return encoding_of(meta).files(meta, boxes)


def check_files(storage: Storage, path: str, leaves: Sequence[tuple[ArrayMetadata, Sequence[Box]]]) -> None:
    """Checks the files holding these leaves' boxes before reading (`LeafEncoding.check_files`).

    Raises:
      CorruptCheckpointError: naming the leaves whose bytes are missing or cut off.
    """
    for enc, group in _grouped(leaves, lambda lb: lb[0]):
        if group:
            enc.check_files(storage, path, group)


def start_restore(storage: Storage, path: str, items: Sequence[Item], ctx: ReadContext) -> Callable[[], dict[str, object]]:
    """Starts every leaf's reads, encoding by encoding in registry order (those on worker
    threads first), and returns the function that waits for all of them: leaf path →
    its value (`LeafEncoding.start_restore`)."""
    finishers = [enc.start_restore(storage, path, group, ctx) for enc, group in _grouped(items, lambda it: it[0]) if group]

    def finish() -> dict[str, object]:
        out: dict[str, object] = {}
        for f in finishers:
            out.update(f())
        return out

    return finish


def region_reader(storage: Storage, path: str, meta: ArrayMetadata) -> Callable[[Box], np.ndarray]:
    """Reads any region of a leaf, unplanned: `read(box)` returns the leaf's values in
    `box` (each a fresh array), for readers that walk a leaf region by region (export).

    Raises (from `read`):
      CorruptCheckpointError: stored bytes are missing, truncated or fail a checksum;
        names the leaf and the checkpoint path.
    """
    return encoding_of(meta).region_reader(storage, path, meta)


def read_into(storage: Storage, path: str, meta: ArrayMetadata, boxes: Sequence[tuple[Box, np.ndarray]],
              pool: concurrent.futures.Executor | None = None) -> None:
    """Reads regions of a leaf into the caller's buffers (`LeafEncoding.read_into`): each
    `(box, out)`, `out` C-contiguous, of the box's shape and the stored dtype; every byte
    checked. `pool`: worker threads for the reads (never one whose worker calls this).

    Raises:
      CorruptCheckpointError: stored bytes are missing, truncated or fail a checksum;
        names the leaf and the checkpoint path.
    """
    encoding_of(meta).read_into(storage, path, meta, boxes, pool)


def replicated_files(record: ProcessRecord) -> list[str]:
    """Every file of a process's record it copies to the durable tier, each once
    (`LeafEncoding.replicated_files`, every encoding)."""
    return list(dict.fromkeys(k for enc in ENCODINGS for k in enc.replicated_files(record)))


def start_write(storage: Storage, root: str, leaves: Sequence[LeafWrite], ctx: WriteContext) -> Callable[[], WriteResult]:
    """Issues every leaf's writes, encoding by encoding in registry order
    (`LeafEncoding.start_write`), and returns the function that waits for all of them,
    then (direct writes) makes the folders they created durable and stops the writer.

    Returns (from the function): the chunk records in registry order, then plan order;
    the pack's index.
    Raises (either): SaveError; nothing started is still running when it raises.
    """
    finishers: list[Callable[[], WriteResult]] = []

    def finish_all() -> WriteResult:
        out, first = WriteResult(), None
        for f in finishers:
            try:
                r = f()
            except BaseException as e:  # wait for the others before raising
                first = first or e
                continue
            out.chunks.extend(r.chunks)
            out.packed = r.packed or out.packed
        for writer in (ctx.direct, ctx.files):
            if writer is not None:
                writer.close(sync=first is None)
        if first is not None:
            raise first
        return out

    try:
        for enc, group in _grouped(leaves, lambda lw: lw.meta):
            if group:
                finishers.append(enc.start_write(storage, root, group, ctx))
    except BaseException:
        try:
            finish_all()
        except BaseException:
            pass
        raise
    return finish_all
