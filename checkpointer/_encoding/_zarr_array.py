"""The encoding of a leaf stored as its own zarr v3 array (`arrays/<leaf>/`): one zarr
shard file per chunk, inner chunks and the shard index each with a crc32c.

Plans are per inner chunk (`_leaf_plan`), reads fetch the planned byte ranges and check
every inner chunk (`_read`); what the byte-range reader does not decode (complex and
sub-byte dtypes, big-endian hosts) goes through TensorStore's array layer. Each leaf is
read on a worker thread, box by box (or slab by slab), and put on the devices that
hold each box.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .. import _errors, _format
from .._errors import CorruptCheckpointError, leaf_name, where
from .._format import ArrayMetadata, Box, ProcessRecord, cell_box, grid_cells
from .._memory import device_destination_supported, device_destinations, host_buffer, populate_destination
from .._storage import Storage
from . import _read, _write
from ._base import Item, LeafEncoding, ReadContext, VerifyContext
from ._leaf_plan import BoxRead, LeafRestorePlan, plan_array_leaf
from ._write import LeafWrite, WriteContext, WriteResult

if TYPE_CHECKING:
    import tensorstore as ts


def _check_stored(store: ts.TensorStore, meta: ArrayMetadata, path: str) -> None:
    if tuple(store.shape) != meta.shape or np.dtype(store.dtype.numpy_dtype) != meta.dtype:
        raise CorruptCheckpointError(
            f"{where(leaf=meta.path, keystr=meta.keystr, path=path, process=_errors.this_process())}: zarr.json says {tuple(store.shape)} "
            f"{store.dtype.numpy_dtype}, the manifest says {meta.shape} {meta.dtype}. Run `checkpointer verify {path}`."
        )


@functools.partial(jax.jit, donate_argnums=0)
def _update(buf: jax.Array, piece: jax.Array, offsets: tuple[int, ...]) -> jax.Array:
    return jax.lax.dynamic_update_slice(buf, piece, offsets)


def _read_host(
    storage: Storage, path: str, meta: ArrayMetadata, b: BoxRead, store: ts.TensorStore | None, ctx: ReadContext,
    into: np.ndarray | None = None,
) -> np.ndarray:
    if b.box.size == 0:
        return np.zeros(b.box.shape, meta.dtype)
    if store is None:
        return _read.read_box(storage, path, meta, b, ctx.chunk_pool, ctx.stats, into, ctx.max_over_read_ratio, ctx.read_chunk_bytes)
    try:
        return store[b.box.slices()].read().result()
    except ValueError as e:  # TensorStore reports missing, truncated and checksum-failing data as ValueError
        raise CorruptCheckpointError(
            f"{where(leaf=meta.path, keystr=meta.keystr, path=path, process=ctx.process_index)}: reading box {b.box} failed: {e}. "
            f"Run `checkpointer verify {path}` for a full report."
        ) from e


def _leaf_devices(lt: Any) -> dict[int, jax.sharding.SingleDeviceSharding]:
    """Where each device's piece goes: the device, in the target's memory kind (so a
    target in pinned_host memory gets host-offloaded arrays); {} for a host target."""
    if lt.sharding is None:
        return {}
    addressable: set[Any] = lt.sharding.addressable_devices  # Any: jaxlib has no stubs for Device
    memory_kind = lt.sharding.memory_kind
    return {d.id: jax.sharding.SingleDeviceSharding(d, memory_kind=memory_kind) for d in addressable}


def _destinations(items: Sequence[Item]) -> list[dict[int, tuple[jax.Array, np.ndarray]]]:
    """Per item, XLA-owned device buffers, each with a writable view, for its whole boxes
    (by index) placed on a CPU device's default memory: the box is read straight into its
    first device's buffer, which a donating step then reuses (an adopted host buffer it
    would not). Boxes read in slabs, empty ones, TensorStore's reads (dtypes the byte-range
    reader does not decode) and other devices and memory kinds are placed from host arrays.

    Every item's buffers are allocated in one call, before any is filled: one compiled
    program for all of them (not one per distinct box shape), and whole pages for huge pages.
    """
    wanted: list[tuple[int, int]] = []  # (item, box)
    requests = []
    for k, (meta, lt, lp) in enumerate(items):
        if lt.sharding is None or not _read.fast_path_supported(meta.dtype):
            continue
        devices = _leaf_devices(lt)
        dtype = lt.dtype if lt.dtype is not None else meta.dtype
        for i, b in enumerate(lp.boxes):
            if not b.slabs and b.box.size and device_destination_supported(devices[b.device_ids[0]]):
                wanted.append((k, i))
                requests.append((b.box.shape, dtype, devices[b.device_ids[0]]))
    out: list[dict[int, tuple[jax.Array, np.ndarray]]] = [{} for _ in items]
    made = device_destinations(requests, populate=False) if requests else []  # each box's reader populates its own
    for (k, i), m in zip(wanted, made, strict=True):
        if m is not None:
            out[k][i] = m
    return out


def _read_leaf(
    storage: Storage, path: str, meta: ArrayMetadata, lt: Any, lp: LeafRestorePlan, ctx: ReadContext,
    dests: dict[int, tuple[jax.Array, np.ndarray]],
) -> dict[int, object]:
    """Reads every unique box of one leaf as planned and puts it on the devices that hold
    it; a box with an entry in `dests` (its device buffer and view, `_destinations`) is
    read into that buffer.

    Returns {device id: single-device jax.Array}, or {-1: numpy array} for a host target.
    Host memory in use stays within the budget: boxes are read together in batches of
    at most the budget (`_read.read_boxes`: the reads of one zarr shard file by several
    boxes are one set of requests), cast, put on their devices and dropped before the
    next batch; a box the plan split into slabs is read slab by slab into a donated
    device buffer.

    Only damage is reported as CorruptCheckpointError (missing, truncated or
    checksum-failing data, from `_read` or TensorStore); any other exception is a bug
    or a device failure and propagates as itself.
    """
    store = None
    if not _read.fast_path_supported(meta.dtype):
        try:
            store = _read.open_zarr_array(storage, path, meta).result()
        except (ValueError, OSError) as e:  # TensorStore: zarr.json missing, unreadable or disagreeing
            raise CorruptCheckpointError(
                f"{where(leaf=meta.path, keystr=meta.keystr, path=path, process=ctx.process_index)}: cannot open the zarr array: {e}. "
                f"Run `checkpointer verify {path}`."
            ) from e
        _check_stored(store, meta, path)
    devices = _leaf_devices(lt)
    dtype = lt.dtype if lt.dtype is not None else meta.dtype
    out: dict[int, object] = {}
    together = [i for i, b in enumerate(lp.boxes) if store is None and not b.slabs and b.box.size]
    for batch in _batches(together, [lp.boxes[i].bytes_needed * ctx.copies_in_flight for i in together], ctx.budget.limit):
        _read_batch(storage, path, meta, lt, lp, ctx, dests, devices, batch, out)
    alone = sorted(set(range(len(lp.boxes))) - set(together))
    _place_boxes(storage, path, meta, lt, lp, ctx, dests, store, devices, dtype, alone, out)
    return out


def _batches(boxes: list[int], costs: list[int], limit: int) -> Iterator[list[int]]:
    """`boxes` in order, in consecutive batches whose costs add up to at most `limit`
    (a box that costs more goes alone)."""
    batch: list[int] = []
    total = 0
    for i, cost in zip(boxes, costs):
        if batch and total + cost > limit:
            yield batch
            batch, total = [], 0
        batch.append(i)
        total += cost
    if batch:
        yield batch


def _read_batch(
    storage: Storage, path: str, meta: ArrayMetadata, lt: Any, lp: LeafRestorePlan, ctx: ReadContext,
    dests: dict[int, tuple[jax.Array, np.ndarray]], devices: dict[int, Any], batch: list[int], out: dict[int, object],
) -> None:
    """Reads the boxes `batch` of one leaf together (`_read.read_boxes`), each into its
    device buffer (`dests`, without a cast) or a host buffer, then places each."""
    cost = sum(lp.boxes[i].bytes_needed for i in batch) * ctx.copies_in_flight
    ctx.budget.acquire(cost)
    try:
        mine = {i: dests.pop(i, None) for i in batch}
        bufs = {i: d[1] if d is not None and lt.dtype is None else host_buffer(lp.boxes[i].box.shape, meta.dtype)
                for i, d in mine.items()}
        pool = ctx.chunk_pool
        # The first touch of each device buffer's head and tail, spread over the pool.
        _read._spread(pool, [functools.partial(populate_destination, d[1]) for d in mine.values() if d is not None])
        _read.read_boxes(storage, path, meta, [(lp.boxes[i], bufs[i]) for i in batch], ctx.stats,
                         ctx.max_over_read_ratio, ctx.read_chunk_bytes, pool)
        for i in batch:
            _place(lp.boxes[i], bufs.pop(i), mine.pop(i), lt, devices, out)
    finally:
        ctx.budget.release(cost)


def _place(b: BoxRead, host: np.ndarray, dest: tuple[jax.Array, np.ndarray] | None, lt: Any, devices: dict[int, Any],
           out: dict[int, object]) -> None:
    """Puts one box read into `host` (the stored dtype; `dest`'s own view when it was read
    in place) on the devices that hold it, cast to the target's dtype, in `out`."""
    if lt.dtype is not None:
        with np.errstate(all="ignore"):  # the cast was asked for: NaN/overflow are not news
            host = host.astype(lt.dtype)
    if lt.sharding is None:
        out[-1] = host
        return
    # The first device gets the box without a copy where it can (CPU); every other
    # device gets its own copy, so that donating one device's buffer can never change another's.
    first, *rest = b.device_ids
    if dest is None:
        out[first] = jax.device_put(host, devices[first])
    else:
        if host is not dest[1]:
            np.copyto(dest[1], host, casting="unsafe")
        out[first] = dest[0]
        dest = None  # the view must not outlive the array it points into
    for d in rest:
        out[d] = jax.device_put(out[first], devices[d])


def _place_boxes(
    storage: Storage, path: str, meta: ArrayMetadata, lt: Any, lp: LeafRestorePlan, ctx: ReadContext,
    dests: dict[int, tuple[jax.Array, np.ndarray]], store: ts.TensorStore | None, devices: dict[int, Any], dtype: np.dtype,
    boxes: list[int], out: dict[int, object],
) -> None:
    """`_read_leaf`'s loop over the boxes not read in batches (`boxes`: read slab by slab,
    through TensorStore, or empty): each read, cast, and put on its devices, in `out`."""
    for i in boxes:
        b = lp.boxes[i]
        bufs = None
        dest = dests.pop(i, None)
        if dest is not None:
            populate_destination(dest[1])
        for slab in b.slabs or (b,):
            # A slab in flight costs up to three copies of its bytes in host memory: the
            # file reads, the assembled host box and (on CPU) the device staging copy.
            cost = slab.bytes_needed * ctx.copies_in_flight
            ctx.budget.acquire(cost)
            try:
                host = _read_host(storage, path, meta, slab, store, ctx, dest[1] if dest is not None and lt.dtype is None else None)
                if not b.slabs:
                    _place(b, host, dest, lt, devices, out)
                    dest = None
                else:
                    if lt.dtype is not None:
                        with np.errstate(all="ignore"):
                            host = host.astype(lt.dtype)
                    if bufs is None:
                        bufs = {d: jnp.zeros(b.box.shape, dtype, device=devices[d]) for d in b.device_ids}
                    offsets = tuple(s.start for s in slab.box.relative_to(b.box))
                    for d in b.device_ids:
                        bufs[d] = _update(bufs[d], jax.device_put(host, devices[d]), offsets)
                        bufs[d].block_until_ready()
                del host
            finally:
                ctx.budget.release(cost)
        if bufs is not None:
            out.update(bufs)


def _assemble(meta: ArrayMetadata, lt: Any, placed: dict[int, Any], exchange_spec: PartitionSpec | None = None) -> object:
    """The leaf's global array from its single-device pieces: on the target sharding,
    or (`exchange_spec` given) the raw stored array in the exchange layout over the
    target's mesh, for the exchange."""
    if lt.sharding is None:
        out = placed[-1]
    else:
        sharding = lt.sharding
        if exchange_spec is not None:
            assert isinstance(sharding, NamedSharding)
            sharding = NamedSharding(sharding.mesh, exchange_spec, memory_kind=sharding.memory_kind)
        addressable: set[Any] = lt.sharding.addressable_devices  # Any: jaxlib has no stubs for Device
        devices = sorted(addressable, key=lambda d: d.id)
        out = jax.make_array_from_single_device_arrays(meta.shape, sharding, [placed[d.id] for d in devices])
        if exchange_spec is not None:
            return out  # wrapped as a key (if it is one) after the exchange
    return jax.random.wrap_key_data(out, impl=meta.key_impl) if meta.key_impl is not None else out


_T = TypeVar("_T")


def _with_x64(x64: bool, fn: Callable[..., _T], *args: object) -> _T:
    with jax.enable_x64(x64):
        return fn(*args)


def _verify_reference(storage: Storage, path: str, m: ArrayMetadata, cell: tuple[int, ...], key: str, data: np.ndarray,
                      ctx: VerifyContext) -> None:
    """Checks a referenced chunk's decoded bytes against the reference (crc32c, XXH3-128)
    and against the record of the checkpoint that holds them (its crc32c)."""
    import xxhash

    ref = m.references[cell]
    target = _format.source_path(path, ref.folder)
    crc = _format.data_crc32c(data)
    here = f"leaf {leaf_name(m.path, m.keystr)}: chunk {key} referenced in {target}"
    if crc != ref.data_crc32c:
        ctx.problems.append(f"{here}: its bytes' crc32c {crc:#010x} differs from the reference's {ref.data_crc32c:#010x}")
    elif ref.xxh3_128 is not None and xxhash.xxh3_128_hexdigest(np.ascontiguousarray(data).view(np.uint8).reshape(-1).data) != ref.xxh3_128:
        ctx.problems.append(f"{here}: its bytes' XXH3-128 differs from the reference's")
    records = ctx.target_chunks(storage, target)
    rec = records.get(key)
    if rec is None:
        ctx.problems.append(f"{here}: that checkpoint has no process record of the chunk")
    elif rec.data_crc32c != ref.data_crc32c:
        ctx.problems.append(f"{here}: its record's crc32c differs from the reference's")


class ZarrArrayEncoding(LeafEncoding):
    """A leaf in its own zarr v3 array (`sharding_indexed` + `crc32c`), one zarr shard
    file per chunk."""

    name = "zarr_array"

    def stores(self, meta: ArrayMetadata) -> bool:
        return not meta.packed

    def plan(self, meta: ArrayMetadata, by_box: Mapping[Box, Sequence[int]], *, slab_bytes: int | None = None) -> LeafRestorePlan:
        return plan_array_leaf(meta, by_box, slab_bytes=slab_bytes)

    def plan_share(
        self, meta: ArrayMetadata, mine: Sequence[tuple[int, Box]], holders: Mapping[Box, frozenset[int]],
        process_index: int, *, slab_bytes: int | None = None,
    ) -> LeafRestorePlan:
        # Exchange boxes of different processes are disjoint: each reads the inner
        # chunks of its own (an inner chunk two boxes cut is read by both: the grain).
        by_box: dict[Box, list[int]] = {}
        for d, box in mine:
            by_box.setdefault(box, []).append(d)
        return plan_array_leaf(meta, by_box, slab_bytes=slab_bytes)

    def files(self, meta: ArrayMetadata, boxes: Iterable[Box]) -> Iterator[tuple[str, int]]:
        size = meta.layout.file_bytes
        seen: set[str] = set()
        for box in sorted(set(boxes)):
            for chunk in grid_cells(box, meta.chunk_shape):
                key = _format.chunk_key(meta.path, chunk)
                if key not in seen:
                    seen.add(key)
                    yield key, size

    def check_files(self, storage: Storage, path: str, leaves: Sequence[tuple[ArrayMetadata, Sequence[Box]]]) -> None:
        for meta, boxes in leaves:
            cells = (cell for box in sorted(set(boxes)) for cell in grid_cells(box, meta.chunk_shape))
            _read.check_chunk_files(storage, path, meta, ((_format.chunk_key(meta.path, c), meta.source_of(c)) for c in cells))

    def start_restore(self, storage: Storage, path: str, items: Sequence[Item], ctx: ReadContext) -> Callable[[], dict[str, object]]:
        read_leaf = functools.partial(_with_x64, ctx.x64, _read_leaf)
        with jax.enable_x64(ctx.x64):
            dests = _destinations(items)
        if ctx.leaf_pool is None:
            done = {m.path: _assemble(m, lt, read_leaf(storage, path, m, lt, lp, ctx, d), lp.exchange_spec)
                    for (m, lt, lp), d in zip(items, dests, strict=True)}
            return lambda: done
        futures = [(m, lt, lp, ctx.leaf_pool.submit(read_leaf, storage, path, m, lt, lp, ctx, d))
                   for (m, lt, lp), d in zip(items, dests, strict=True)]
        del dests  # each leaf's reader holds its own (a view must not outlive its array)

        def finish() -> dict[str, object]:
            return {m.path: _assemble(m, lt, f.result(), lp.exchange_spec) for m, lt, lp, f in futures}

        return finish

    def chunk_count(self, meta: ArrayMetadata) -> int:
        return math.prod(-(-s // c) for s, c in zip(meta.shape, meta.chunk_shape)) if math.prod(meta.shape) else 0

    def verify(self, storage: Storage, path: str, metas: Sequence[ArrayMetadata], ctx: VerifyContext) -> None:
        """Decodes every chunk through TensorStore (which checks the crc32c of each inner
        chunk and of each shard index) and compares it with its writer's record."""
        for m in metas:
            stores: dict[str | None, Any] = {}  # by source: this checkpoint (None) or a referenced one
            for cell in grid_cells(Box.whole(m.shape), m.chunk_shape):
                key, n = _format.chunk_key(m.path, cell), 0
                source = m.source_of(cell)
                try:
                    if source not in stores:
                        stores[source] = _read.open_zarr_array(storage, _format.source_path(path, source), m).result()
                    data = stores[source][cell_box(cell, m.chunk_shape, m.shape).slices()].read().result()
                    n = data.nbytes
                    rec = ctx.chunks.get(key)
                    if source is not None:  # a reference: the bytes it names, and the target's own record
                        _verify_reference(storage, path, m, cell, key, data, ctx)
                    elif rec is None:
                        ctx.problems.append(f"leaf {leaf_name(m.path, m.keystr)}: chunk {key} is not in any process record")
                    elif rec.data_crc32c != _format.data_crc32c(data):
                        ctx.problems.append(f"leaf {leaf_name(m.path, m.keystr)}: chunk {key} decodes to bytes whose crc32c differs from the writer's record")
                except Exception as e:  # every failure is a finding, keep going
                    ctx.problems.append(f"leaf {leaf_name(m.path, m.keystr)}: chunk {key}: {str(e).splitlines()[0]}")
                ctx.done(1, n)

    def region_reader(self, storage: Storage, path: str, meta: ArrayMetadata) -> Callable[[Box], np.ndarray]:
        return _read.region_reader(storage, path, meta)

    def read_into(self, storage: Storage, path: str, meta: ArrayMetadata, boxes: Sequence[tuple[Box, np.ndarray]],
                  pool: concurrent.futures.Executor | None = None) -> None:
        """The byte-range reader straight into the buffers (`_read.read_boxes`: each
        inner chunk read, checked and placed in one pass; the boxes of one zarr shard file
        read together); TensorStore's array read where that reader does not decode."""
        if not _read.fast_path_supported(meta.dtype):
            super().read_into(storage, path, meta, boxes, pool)
            return
        outs: dict[Box, list[np.ndarray]] = {}
        for box, out in boxes:
            if box.size:
                outs.setdefault(box, []).append(out)
        if not outs:
            return
        lp = plan_array_leaf(meta, {box: [-1] for box in outs})
        _read.read_boxes(storage, path, meta, [(b, outs[b.box][0]) for b in lp.boxes], _read.RestoreStats(), pool=pool)
        for b in lp.boxes:
            for extra in outs[b.box][1:]:
                np.copyto(extra, outs[b.box][0])

    def replicated_files(self, record: ProcessRecord) -> list[str]:
        packs = {p.key for p in record.own_packs}
        return list(dict.fromkeys(c.key for c in record.chunks if c.data_bytes != 0 and c.key not in packs))

    def start_write(self, storage: Storage, root: str, leaves: Sequence[LeafWrite], ctx: WriteContext) -> Callable[[], WriteResult]:
        return _write.start_zarr_writes(storage, root, leaves, ctx)
