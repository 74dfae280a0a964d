"""The encoding of packed small leaves: each chunk a byte range of its writer's pack
(`packed/process-<i>/c/0`, see `_pack`), located by the manifest's `packed` index.

Plans read whole packed chunks (each crc32c covers one chunk), coalesced into runs of
neighbouring byte ranges. In a cooperative restore a chunk several processes need is
split among them when every process's part of it is one contiguous byte range (a
replicated leaf split along its first dimension, the common case): each reads only its
piece and the chunk's crc32c is checked after the exchange from the pieces' crc32c
(`SharedChunk`, `_crc`), so every packed byte is read once in all and still checked.
Restore reads the packed leaves in batches within the memory budget and places each
leaf with one `jax.make_array_from_callback` (each device its own host copy).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from .. import _errors, _format, _memory
from .._errors import CorruptCheckpointError, SaveError, leaf_name, where
from .._format import ZARR_JSON, ArrayMetadata, Box, PackedBox, ProcessRecord, cell_box, grid_cells
from .._storage import Storage, acquire
from . import _pack, _pack_verify
from ._base import Item, LeafEncoding, ReadContext, VerifyContext
from ._leaf_plan import BoxRead, LeafRestorePlan, PackedRead, SharedChunk, coalesce_packed
from ._read import RestoreStats
from ._write import LeafWrite, WriteContext, WriteResult

log = logging.getLogger("checkpointer")

def _chunks_of(meta: ArrayMetadata, box: Box, chunks: Mapping[tuple[int, ...], PackedBox]) -> Iterator[tuple[PackedBox, Box]]:
    """The packed chunks `box` intersects, with the region of each it needs."""
    for cell in grid_cells(box, meta.chunk_shape):
        chunk_box = cell_box(cell, meta.chunk_shape, meta.shape)
        region = box.intersect(chunk_box)
        if region is None:
            continue
        pb = chunks.get(chunk_box.origin)
        if pb is None or pb.box != chunk_box:
            raise CorruptCheckpointError(
                f"{where(leaf=meta.path, keystr=meta.keystr, process=_errors.this_process())}: the chunk at {chunk_box.origin} of a packed leaf "
                "is in no pack (the manifest's 'packed' index lacks it). Run `checkpointer verify` on the checkpoint."
            )
        yield pb, region


def _whole_read(pb: PackedBox, region: Box, box: Box) -> PackedRead:
    local = Box(tuple(o - c for o, c in zip(region.origin, pb.box.origin)), region.shape)
    dest = tuple(o - b for o, b in zip(region.origin, box.origin))
    return PackedRead(pb.key, pb.file_bytes, pb.offset, pb.nbytes, pb.crc32c, pb.box, region, local, dest)


def _contiguous_start(region: Box, chunk: Box) -> int | None:
    """Where `region` starts in `chunk`'s C-order elements if its elements are one
    contiguous run there (leading dimensions of extent 1, one partial dimension, the rest
    whole); else None."""
    k = 0
    while k < len(region.shape) and region.shape[k] == 1:
        k += 1
    if any(r != c for r, c in zip(region.shape[k + 1 :], chunk.shape[k + 1 :])):
        return None
    start, stride = 0, 1
    for o, c, n in reversed(list(zip(region.origin, chunk.origin, chunk.shape))):
        start += (o - c) * stride
        stride *= n
    return start


def shared_chunks(meta: ArrayMetadata, holders: Mapping[Box, frozenset[int]]) -> dict[tuple[int, ...], SharedChunk]:
    """The chunks of a packed leaf that a cooperative restore splits among processes:
    those that several exchange boxes cut, when each box's part is a contiguous byte
    range (else every process that needs the chunk reads it whole), by chunk origin.

    Pure and the same on every process: it depends on every process's exchange boxes."""
    chunks = {b.box.origin: b for b in meta.pack_boxes}
    parts: dict[tuple[int, ...], list[tuple[Box, int]]] = {}
    for piece, procs in holders.items():
        for pb, region in _chunks_of(meta, piece, chunks):
            parts.setdefault(pb.box.origin, []).append((region, min(procs)))
    itemsize = meta.dtype.itemsize
    out = {}
    for origin, regions in sorted(parts.items()):
        pb = chunks[origin]
        if len(regions) < 2:
            continue
        pieces = []
        for region, reader in regions:
            start = _contiguous_start(region, pb.box)
            if start is None:
                break
            pieces.append((pb.offset + start * itemsize, region.size * itemsize, reader))
        else:
            pieces.sort()
            ends = [pb.offset] + [o + n for o, n, _ in pieces]
            if all(o == e for (o, _, _), e in zip(pieces, ends)) and ends[-1] == pb.offset + pb.nbytes:
                out[origin] = SharedChunk(pb.key, pb.offset, pb.nbytes, pb.crc32c, tuple(pieces))
    return out


def _place_per_device(meta: ArrayMetadata, sharding: jax.sharding.Sharding, hosts: dict[Box, np.ndarray]) -> jax.Array:
    """`place` for a target in another memory kind (e.g. pinned_host): one put per device."""
    shape = meta.shape
    index: Any = sharding.addressable_devices_indices_map(shape)
    pieces = [
        jax.device_put(hosts[Box.from_index(idx, shape)].copy(), jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind))
        for d, idx in sorted(index.items(), key=lambda kv: kv[0].id)
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)


try:  # what `jax.make_array_from_callback` ends in, for a one-device target (`_Placer`)
    from jax._src import core as _jax_core
    from jax._src.interpreters import pxla as _pxla

    _PUT: Any = _pxla.batched_device_put
    _AVAL: Any = _jax_core.update_aval_with_sharding
    _SHAPED: Any = _jax_core.ShapedArray
except (ImportError, AttributeError):  # another jax: `make_array_from_callback` for every leaf
    _PUT = None


class _Placer:
    """Puts the host boxes of a batch's leaves on their target devices.

    A leaf whose target puts it whole on one local device (its device memory, a dtype JAX
    keeps as it is) is put with the one call `jax.make_array_from_callback` ends in, its
    aval made once per (shape, dtype, sharding): a fifth of that function's cost per leaf
    (its argument checks, done once here). Any other target, and any failure of that call
    (another jax), goes through `place`."""

    def __init__(self) -> None:
        self._devices: dict[int, Any] = {}  # id(sharding) -> its one device, or None (the batch keeps them alive)
        self._avals: dict[tuple, Any] = {}
        self._dtypes: dict[np.dtype, bool] = {}

    def single_device(self, sharding: jax.sharding.Sharding | None) -> Any:
        """The one local device `sharding` puts a whole array on (device memory), else None."""
        if sharding is None or _PUT is None:
            return None
        key = id(sharding)
        if key not in self._devices:
            device = None
            if sharding.memory_kind in (None, "device") and sharding.is_fully_addressable and len(sharding.device_set) == 1:
                (device,) = sharding.device_set
            self._devices[key] = device
        return self._devices[key]

    def put(self, meta: ArrayMetadata, sharding: jax.sharding.Sharding, device: Any, host: np.ndarray) -> jax.Array:
        """`host` (the whole leaf, its own buffer) on `device`, the one device of `sharding`."""
        global _PUT
        dtype = host.dtype
        kept = self._dtypes.get(dtype)
        if kept is None:
            kept = self._dtypes[dtype] = bool(jax.dtypes.canonicalize_dtype(dtype) == dtype)
        if kept and _PUT is not None:
            key = (host.shape, dtype, id(sharding))
            try:
                aval = self._avals.get(key)
                if aval is None:
                    aval = self._avals[key] = _AVAL(_SHAPED(host.shape, dtype), sharding)
                out = _PUT(aval, sharding, [host], [device])
                if isinstance(out, jax.Array) and out.shape == host.shape and out.dtype == dtype:
                    return out
            except Exception as e:  # not the function it was in the jax this was written for
                log.debug("one-device put of %s failed (%s: %s); using jax.make_array_from_callback", meta.path, type(e).__name__, e)
            _PUT = None
        return place(meta, sharding, {Box.whole(meta.shape): host})


def place(meta: ArrayMetadata, sharding: jax.sharding.Sharding, hosts: dict[Box, np.ndarray]) -> jax.Array:
    """The global array of one leaf on `sharding` from its host boxes (one per unique
    target box of this process's devices), in one `jax.make_array_from_callback`.

    Every device gets its own copy of its box (`_pack.unadoptable`): never one host
    buffer aliased across devices, which donation would corrupt.
    """
    shape = meta.shape
    by_origin = {b.origin: _pack.unadoptable(h) for b, h in hosts.items()}

    def piece(index: tuple[slice, ...] | None) -> np.ndarray:
        # A shard's origin names its box (JAX indices are unit-step slices, None = 0).
        return by_origin[tuple(sl.start or 0 for sl in index or ())]

    if sharding.memory_kind not in (None, "device"):
        return _place_per_device(meta, sharding, hosts)
    return jax.make_array_from_callback(shape, sharding, piece)


def _restore_batch(storage: Storage, path: str, batch: Sequence[Item], cost: int, ctx: ReadContext, out: dict[str, object]) -> None:
    ctx.budget.acquire(cost)
    try:
        runs = coalesce_packed((lp.name, p) for _, _, lp in batch for b in lp.boxes for p in b.packed)  # named for messages
        data = _pack.read_runs(storage, path, runs, ctx.stats, ctx.piece_crcs)
        placer = _Placer()
        for meta, lt, lp in batch:
            device = placer.single_device(lt.sharding) if lp.exchange_spec is None else None
            hosts: dict[Box, np.ndarray] = {}
            for b in lp.boxes:
                host = _pack.assemble_box(meta, b, data, adoptable=device is not None or lt.sharding is None)
                if lt.dtype is not None:
                    with np.errstate(all="ignore"):  # the cast was asked for: NaN/overflow are not news
                        host = host.astype(lt.dtype)
                hosts[b.box] = host
            if lt.sharding is None:
                arr: Any = hosts[Box.whole(meta.shape)]
            elif lp.exchange_spec is not None:  # cooperative: the exchange layout; the exchange reshards and wraps
                s = lt.sharding
                out[meta.path] = place(meta, NamedSharding(s.mesh, lp.exchange_spec, memory_kind=s.memory_kind), hosts)
                continue
            elif device is not None and len(hosts) == 1:
                arr = placer.put(meta, lt.sharding, device, next(iter(hosts.values())))
            else:
                arr = place(meta, lt.sharding, hosts)
            out[meta.path] = jax.random.wrap_key_data(arr, impl=meta.key_impl) if meta.key_impl is not None else arr
    finally:
        ctx.budget.release(cost)


class PackedEncoding(LeafEncoding):
    """A small leaf whose chunks are byte ranges of its writers' packs (`_pack`)."""

    name = "packed"
    contiguous_shares = True  # a piece of a packed chunk is read alone only when it is one byte range

    def stores(self, meta: ArrayMetadata) -> bool:
        return meta.packed

    def plan(self, meta: ArrayMetadata, by_box: Mapping[Box, Sequence[int]], *, slab_bytes: int | None = None) -> LeafRestorePlan:
        # Never in slabs: packed leaves are small by definition.
        return self._plan(meta, by_box, {})

    def _plan(self, meta: ArrayMetadata, by_box: Mapping[Box, Sequence[int]], split: Mapping[tuple[int, ...], SharedChunk]) -> LeafRestorePlan:
        itemsize = meta.dtype.itemsize
        zeros = (0,) * len(meta.shape)
        if len(by_box) == 1 and len(meta.pack_boxes) == 1 and not split:  # one box, one chunk (a small leaf on one device)
            ((box, ids),) = by_box.items()
            only = meta.pack_boxes[0]
            if only.box == box:  # the target box is the saved chunk: one read, no cutting
                read = PackedRead(only.key, only.file_bytes, only.offset, only.nbytes, only.crc32c, box, box, Box(zeros, box.shape),
                                  zeros)
                return LeafRestorePlan(meta.path, meta.shape, meta.dtype, (BoxRead(box, tuple(sorted(ids)), (), box.size * itemsize,
                                                                                    packed=(read,)),), keystr=meta.keystr)
        chunks = {b.box.origin: b for b in meta.pack_boxes}  # by origin: a tuple hashes faster than a Box
        boxes = []
        for box in sorted(by_box):
            devices = tuple(sorted(by_box[box]))
            pb = chunks.get(box.origin)
            if pb is not None and pb.box.shape == box.shape and box.origin not in split:
                # The target box is a saved chunk (same sharding): one read, no cutting.
                read = PackedRead(pb.key, pb.file_bytes, pb.offset, pb.nbytes, pb.crc32c, box, box, Box(zeros, box.shape), zeros)
                boxes.append(BoxRead(box, devices, (), box.size * itemsize, packed=(read,)))
                continue
            reads = []
            for pb, region in _chunks_of(meta, box, chunks):
                start = _contiguous_start(region, pb.box) if pb.box.origin in split else None
                if start is None:
                    reads.append(_whole_read(pb, region, box))
                    continue
                # A piece of a shared chunk: only its bytes, checked after the exchange.
                dest = tuple(o - b for o, b in zip(region.origin, box.origin))
                offset = pb.offset + start * itemsize
                reads.append(PackedRead(pb.key, pb.file_bytes, offset, region.size * itemsize, None, region, region,
                                        Box((0,) * len(region.shape), region.shape), dest))
            boxes.append(BoxRead(box, devices, (), box.size * itemsize, packed=tuple(reads)))
        shared = tuple(split[o] for o in sorted(split))
        return LeafRestorePlan(meta.path, meta.shape, meta.dtype, tuple(boxes), shared=shared, keystr=meta.keystr)

    def plan_share(
        self, meta: ArrayMetadata, mine: Sequence[tuple[int, Box]], holders: Mapping[Box, frozenset[int]],
        process_index: int, *, slab_bytes: int | None = None,
    ) -> LeafRestorePlan:
        by_box: dict[Box, list[int]] = {}
        for d, box in mine:
            by_box.setdefault(box, []).append(d)
        return self._plan(meta, by_box, shared_chunks(meta, holders))

    def _needed(self, meta: ArrayMetadata, boxes: Iterable[Box]) -> list[PackedBox]:
        if len(meta.pack_boxes) == 1 and all(c >= n for n, c in zip(meta.shape, meta.chunk_shape)):
            return list(meta.pack_boxes) if any(b.size for b in boxes) else []  # the leaf's one chunk
        chunks = {b.box.origin: b for b in meta.pack_boxes}
        seen: dict[tuple[int, ...], PackedBox] = {}
        for box in sorted(set(boxes)):
            for pb, _ in _chunks_of(meta, box, chunks):
                seen.setdefault(pb.box.origin, pb)
        return list(seen.values())

    def files(self, meta: ArrayMetadata, boxes: Iterable[Box]) -> Iterator[tuple[str, int]]:
        yield from dict.fromkeys((pb.key, pb.file_bytes) for pb in self._needed(meta, boxes))

    def check_files(self, storage: Storage, path: str, leaves: Sequence[tuple[ArrayMetadata, Sequence[Box]]]) -> None:
        """One `stat` per pack file. A file of another size than the index says fails
        the leaves whose needed bytes lie past its end (missing: all of them); the other
        leaves in it are read, each chunk checked by its own crc32c."""
        if not storage.cheap_size:
            return
        needed: dict[str, tuple[int, list[tuple[int, int, ArrayMetadata]]]] = {}
        for meta, boxes in leaves:
            for pb in self._needed(meta, boxes):
                needed.setdefault(pb.key, (pb.file_bytes, []))[1].append((pb.offset, pb.nbytes, meta))
        process = _errors.this_process()
        for key, (expected, ranges) in needed.items():
            try:
                size: int | None = storage.size(_format.pack_file(path, key))
            except OSError as e:
                found = f"is missing ({e.strerror})" if isinstance(e, FileNotFoundError) else f"cannot be read ({e.strerror})"
                size = None
            if size == expected:
                continue
            ranges.sort(key=lambda r: (r[0], r[1]))
            gone = _pack.gone_leaves([(o, n, leaf_name(m.path, m.keystr)) for o, n, m in ranges], size)
            if not gone:  # what this restore needs is there; each chunk's crc32c checks it
                log.warning("%s: pack file %s has %s bytes, expected %d: the packed bytes this restore needs are within it "
                            "and each is checked by its crc32c; run `checkpointer verify %s`", where(path=path, process=process),
                            key, size, expected, path)
                continue
            if size is not None:
                found = f"has {size} bytes, expected {expected} (truncated or damaged)"
                lost = f"bytes {size}..{max(o + n for o, n, _ in ranges)}"
            else:
                lost = "every byte"
            others = f" (and of {_pack.name_leaves(gone[1:])})" if len(gone) > 1 else ""
            raise CorruptCheckpointError(
                f"{where(keystr=gone[0], path=path, process=process)}: pack file {key} {found}: the leaf's packed bytes{others} "
                f"are gone ({lost} of the pack). Run `checkpointer verify {path}` for a full report; restore the other "
                "leaves with partial=True."
            )

    def start_restore(self, storage: Storage, path: str, items: Sequence[Item], ctx: ReadContext) -> Callable[[], dict[str, object]]:
        """Reads every packed leaf at once, on the caller's thread: leaves in target order,
        in batches of at most `budget.limit / copies_in_flight` bytes (at least one leaf),
        each batch's runs read, every chunk checked, boxes assembled, cast, placed."""
        out: dict[str, object] = {}
        limit = max(1, ctx.budget.limit // ctx.copies_in_flight)
        batch: list[Item] = []
        batch_bytes = 0
        with _memory.paused():  # many small objects: no full collections over the heap meanwhile
            for item in items:
                n = item[2].bytes_needed
                if batch and batch_bytes + n > limit:
                    _restore_batch(storage, path, batch, batch_bytes * ctx.copies_in_flight, ctx, out)
                    batch, batch_bytes = [], 0
                batch.append(item)
                batch_bytes += n
            if batch:
                _restore_batch(storage, path, batch, batch_bytes * ctx.copies_in_flight, ctx, out)
        return lambda: out

    def chunk_count(self, meta: ArrayMetadata) -> int:
        return len(meta.pack_boxes)

    def verify(self, storage: Storage, path: str, metas: Sequence[ArrayMetadata], ctx: VerifyContext) -> None:
        _pack_verify.verify_packs(storage, path, metas, ctx)

    def region_reader(self, storage: Storage, path: str, meta: ArrayMetadata) -> Callable[[Box], np.ndarray]:
        stats = RestoreStats()

        def read(box: Box) -> np.ndarray:
            b = self.plan(meta, {box: [-1]}).boxes[0]
            runs = coalesce_packed((leaf_name(meta.path, meta.keystr), p) for p in b.packed)
            return _pack.assemble_box(meta, b, _pack.read_runs(storage, path, runs, stats))

        return read

    def replicated_files(self, record: ProcessRecord) -> list[str]:
        return [k for p in record.own_packs for k in (p.key, f"{p.array}/{ZARR_JSON}")]

    def start_write(self, storage: Storage, root: str, leaves: Sequence[LeafWrite], ctx: WriteContext) -> Callable[[], WriteResult]:
        """Writes this process's pack (`_pack.PackWriter`): one file, one write."""
        pack = _pack.PackWriter(ctx.process_index, ctx.pack_slab)
        with _memory.paused():  # many small objects: no full collections over the heap meanwhile
            pack.add_all((lw.meta, box, host) for lw in leaves for _, box, host in lw.chunks)
        if not pack:
            return lambda: WriteResult()
        if ctx.limiter is not None:  # (`nbytes` is a sum over the chunks)
            acquire(ctx.limiter, pack.nbytes)  # the pack is one write
        name = _pack.array_name(ctx.process_index)
        try:
            with _memory.paused():
                done = pack.write(storage, root, ctx.direct)
        except Exception as e:
            raise SaveError(f"writing the pack of small leaves {name} in {root} failed (process {ctx.process_index}): {e}") from e

        def finish() -> WriteResult:
            try:
                record, chunk = done()
            except Exception as e:
                raise SaveError(f"writing the pack of small leaves {name} in {root} failed (process {ctx.process_index}): {e}") from e
            return WriteResult([chunk], record)

        return finish
