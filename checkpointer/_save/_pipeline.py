"""Save execution: snapshot to host, write through TensorStore, record, commit.

The three phases are separate so that `save_async` can run the last two on a
background thread (see `_async.py`):

1. `take_snapshot` (caller's thread, blocking): plans the whole tree (`_save_plan`:
   every process computes every process's chunks from the shardings' global device
   maps), then copies the chunks this process writes (whole shards, or the slices of a
   replica-parallel split) to fresh host buffers.
2. `write_snapshot` (any thread): writes the chunks into `<path>.partial-<generation>/`,
   durably (TensorStore's file driver fsyncs), then `processes/<i>.json`.
3. `commit` (any thread): the commit protocol of DESIGN.md, through `Coordinator`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

import jax
import ml_dtypes
import numpy as np
import tensorstore as ts

from .. import _commit, _coord, _encoding, _format, _memory, _storage
from .._commit import SAVE_LOCK_SUFFIX
from .._errors import CheckpointExistsError, CommitTimeoutError, SaveAgreementError, SaveError, UnsupportedValueError, where
from .._format import (
    ZARR_JSON,
    ArrayMetadata,
    Box,
    ChunkRecord,
    PackRecord,
    ProcessRecord,
    SavedSharding,
    describe,
    flatten,
    manifest_json,
    metadata_json,
    write_group_nodes,
)
from .._memory import HostBufferPool, copy_to_host
from .._storage import FileLock, Storage, storage_for, ts_context
from ._plan import ChunkWrite, LeafAssignment, LeafShards, LeafWritePlan, ShardInfo, plan_writes

log = logging.getLogger("checkpointer")


@dataclasses.dataclass
class LeafSnapshot:
    """One array leaf's plan, metadata and this process's host copies (one per write)."""

    meta: ArrayMetadata
    plan: LeafWritePlan
    host: list[np.ndarray]


@dataclasses.dataclass
class Snapshot:
    """Everything the background needs to write and commit one save."""

    storage: Storage
    path: str
    generation: str
    process_index: int
    process_count: int
    structure: dict
    arrays: list[LeafSnapshot]
    values: dict[str, dict]
    user_metadata: dict
    step: int | None
    overwrite: bool
    commit_timeout_s: float
    buffers: HostBufferPool | None = None
    per_process_state: object = None  # this process's JSON value, stored in its own record
    lock: FileLock | None = None  # process 0's lock on `<partial>.lock` while writing
    write_limiter: _storage.TokenBucket | None = None  # max_write_bytes_per_s (None: unlimited)
    # Writes every array's zarr.json and the group nodes: process 0 (None), or every
    # process into its own folder (the local tier of `_tiers`: True).
    writes_array_metadata: bool | None = None
    snapshot_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    bytes_written: int = 0
    # Wall-clock spans of this process's phases, name -> (start, end) unix seconds: the
    # record keeps wait_for_arrays/snapshot/write/durable, the manifest process 0's wait, `_timeline` draws them.
    phases_unix_s: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    pack_index: PackRecord | None = None  # this process's pack of small leaves, once written (`_pack`)

    @property
    def partial_path(self) -> str:
        parent, name = self.path.rsplit("/", 1)
        return f"{parent}/{_format.partial_name(name, self.generation)}"

    @property
    def write_path(self) -> str:
        """Where the files go: the partial folder on POSIX, the final path on object stores."""
        return _commit.strategy_for(self.storage).write_path(self.path, self.generation)


def _is_array(x: object) -> TypeGuard[jax.Array | np.ndarray]:
    return isinstance(x, (jax.Array, np.ndarray))


def _saved_sharding(arr: jax.Array) -> SavedSharding:
    s = arr.sharding
    shard_shape = tuple(s.shard_shape(arr.shape))
    n = len(s.device_set)
    if isinstance(s, jax.sharding.NamedSharding):
        spec = tuple(tuple(p) if isinstance(p, tuple) else p for p in s.spec)
        return SavedSharding("named", tuple(s.mesh.axis_names), tuple(s.mesh.devices.shape), spec, shard_shape, n)
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        return SavedSharding("single_device", (), (), (), shard_shape, n)
    return SavedSharding("other", (), (), (), shard_shape, n)


# Longest name of one folder on common file systems (ext4, xfs, tmpfs, APFS), bytes.
_MAX_NAME_BYTES = 255


def _check_storable(leaf_path: str, dtype: np.dtype, path: str) -> None:
    """Raises UnsupportedValueError unless the format can hold an array leaf of `dtype`."""
    dtype = np.dtype(dtype)
    if not _format.is_numeric_dtype(dtype) or dtype.hasobject:
        raise UnsupportedValueError(
            f"{where(leaf=leaf_path, path=path)}: dtype {dtype} cannot be stored; convert it to a numeric or bool array"
        )
    if not _format.zarr_supports_dtype(dtype):
        try:
            wider = "int8" if ml_dtypes.iinfo(dtype).min < 0 else "uint8"
        except (ValueError, TypeError):
            wider = "float32"
        raise UnsupportedValueError(
            f"{where(leaf=leaf_path, path=path)}: dtype {dtype} has no zarr v3 data type in TensorStore, so it "
            f"cannot be stored. Save it as a wider dtype (x.astype(jnp.{wider})) and convert it back after restoring"
        )
    for part in _format.array_dir(leaf_path).split("/"):
        if len(part.encode()) > _MAX_NAME_BYTES:
            raise UnsupportedValueError(
                f"{where(leaf=leaf_path, path=path)}: the escaped key {part[:40]!r}... is {len(part.encode())} bytes, "
                f"longer than the {_MAX_NAME_BYTES} bytes a file or folder name may have; shorten the key "
                "(non-ASCII characters take 6 to 12 bytes each once escaped)"
            )


def _global_shards(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[ShardInfo, ...]:
    """Every device's shard on every process, from the sharding's full device→index map
    (the same on every process); replica ids numbered in device order, as JAX does."""
    seen: dict[Box, int] = {}
    out = []
    device: Any  # no Device stubs
    for device, index in sharding.devices_indices_map(shape).items():
        box = Box.from_index(index, shape)
        rid = seen.get(box, 0)
        seen[box] = rid + 1
        out.append(ShardInfo(box, device.id, device.process_index, rid))
    return tuple(out)


@dataclasses.dataclass
class _ArrayLeaf:
    """One array leaf between the planning passes: the planner's input and what the
    metadata and the copies need."""

    shards: LeafShards
    dtype: np.dtype
    saved: SavedSharding | None
    key_impl: str | None
    kind: str
    by_device: dict  # device id -> the shard's data (jax.Array or numpy)
    plan_key: tuple  # (leaf path, sharding or None, shape, itemsize): what the plan depends on


# The last few trees' plans: a training loop saves the same tree with the same shardings
# every time, and planning a large tree on many devices takes seconds (docs/SCALE.md).
_PLAN_CACHE: collections.OrderedDict[tuple, tuple[LeafAssignment, ...]] = collections.OrderedDict()
_PLAN_CACHE_SIZE = 4
_PLAN_CACHE_LOCK = threading.Lock()


def _plan_tree(described: list[_ArrayLeaf]) -> tuple[LeafAssignment, ...]:
    """`plan_writes` of the tree, reused while the leaf paths, shardings, shapes and
    dtypes stay the same (the plan depends on nothing else)."""
    key = tuple(d.plan_key for d in described)
    with _PLAN_CACHE_LOCK:
        hit = _PLAN_CACHE.get(key)
        if hit is not None:
            _PLAN_CACHE.move_to_end(key)
            return hit
    plan = plan_writes([d.shards for d in described])
    with _PLAN_CACHE_LOCK:
        _PLAN_CACHE[key] = plan
        while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
            _PLAN_CACHE.popitem(last=False)
    return plan


def _describe_array(leaf_path: str, arr: jax.Array | np.ndarray, pidx: int, path: str, cache: dict) -> _ArrayLeaf:
    """The planner's input for one array leaf; `cache` holds global shards by (sharding, shape)."""
    if isinstance(arr, np.ndarray):
        _check_storable(leaf_path, arr.dtype, path)
        if not arr.dtype.isnative:  # e.g. '>f4': store (and checksum) the native-order bytes
            arr = arr.astype(arr.dtype.newbyteorder("="))
        shape = arr.shape
        # A host array is process 0's (processes may hold different values).
        spec = LeafShards(leaf_path, shape, arr.dtype.itemsize, shape, (ShardInfo(Box.whole(shape), -1, 0, 0),))
        return _ArrayLeaf(spec, arr.dtype, None, None, "numpy", {-1: arr}, (leaf_path, None, shape, arr.dtype.itemsize))
    if arr.is_deleted():
        raise UnsupportedValueError(
            f"{where(leaf=leaf_path, path=path, process=pidx)}: the array was deleted (donated to a jitted "
            "function?); save the state before donating it"
        )
    key_impl = None
    saved = _saved_sharding(arr)
    if jax.dtypes.issubdtype(arr.dtype, jax.dtypes.prng_key):
        key_impl = str(jax.random.key_impl(arr))
        arr = jax.random.key_data(arr)
    dtype = np.dtype(arr.dtype)
    _check_storable(leaf_path, dtype, path)
    shape = tuple(arr.shape)
    key = (arr.sharding, shape)
    if key not in cache:
        cache[key] = _global_shards(arr.sharding, shape)
    spec = LeafShards(leaf_path, shape, dtype.itemsize, tuple(arr.sharding.shard_shape(shape)), cache[key])
    by_device = {s.device.id: s.data for s in arr.addressable_shards}
    return _ArrayLeaf(spec, dtype, saved, key_impl, "jax", by_device, (leaf_path, arr.sharding, shape, dtype.itemsize))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _slice_in_dim(x: jax.Array, start, size: int, axis: int) -> jax.Array:
    # `start` is traced: one compilation per (shard shape, dtype, chunk length, axis),
    # not one per chunk offset.
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _chunk_data(leaf: _ArrayLeaf, w: ChunkWrite):
    """The data of one planned chunk: the device's shard, or the slice of it the plan
    names (cut on the device, so only the chunk's bytes are copied to host)."""
    data = leaf.by_device[w.device_id]
    if w.shard_box is None:
        return data
    rel = w.box.relative_to(w.shard_box)
    cut = [d for d, (sl, n) in enumerate(zip(rel, data.shape)) if (sl.start, sl.stop) != (0, n)]
    if not isinstance(data, jax.Array) or len(cut) != 1:
        return data[rel]
    d = cut[0]
    return _slice_in_dim(data, rel[d].start, rel[d].stop - rel[d].start, d)


def _committed(storage: Storage, path: str) -> bool:
    return storage.exists(f"{path}/{_format.COMMITTED}")


# What a checkpoint folder (or a crashed save under the final name) may contain.
_FORMAT_NAMES = frozenset({_format.ARRAYS, _format.PROCESSES, _format.MANIFEST, _format.COMMITTED, ZARR_JSON, _encoding.PACKED})


def check_target(storage: Storage, path: str, pidx: int, overwrite: bool) -> None:
    """Refuses a save to `path` before anything is planned: something that is no
    folder blocks it, a folder holds foreign files, or it is committed without
    `overwrite`.

    Raises:
      SaveError: a file (not a folder) is at `path`.
      TypeError: `overwrite` is not a bool.
      CheckpointExistsError: `path` holds foreign files, or is committed and
        `overwrite` is False.
    """
    if _commit.strategy_for(storage).target_blocked(path):
        raise SaveError(
            f"cannot save to {path} (process {pidx}): it exists and is not a folder; a checkpoint path is a "
            "folder. Remove or rename that file, or save to another path"
        )
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
    _check_target_folder(storage, path, pidx)
    if _committed(storage, path) and not overwrite:
        raise CheckpointExistsError(
            f"{path} is already a committed checkpoint (process {pidx}); pass overwrite=True "
            "(CheckpointManager: force=True) to replace it atomically, or save to a new path"
        )


def _check_target_folder(storage: Storage, path: str, pidx: int) -> None:
    """Refuses to save into a folder that holds anything but a checkpoint's own files.

    A save replaces what is at its path only when that is a checkpoint (committed, with
    overwrite) or a crashed save of one; a folder with other content (a project, a
    manager's run directory) is never moved aside or deleted.
    """
    foreign = [n for n in storage.list_dir(path) if n not in _FORMAT_NAMES]
    if foreign:
        raise CheckpointExistsError(
            f"cannot save to {path} (process {pidx}): it exists and holds {len(foreign)} entries that are not "
            f"part of a checkpoint (e.g. {foreign[:3]}); a save never replaces such a folder, even with "
            "overwrite=True. Save to a new path (e.g. a subfolder named after the step)"
        )


def take_snapshot(
    path: str | os.PathLike,
    tree: object,
    *,
    metadata: Mapping | None = None,
    overwrite: bool = False,
    step: int | None = None,
    commit_timeout_s: float = _coord.DEFAULT_COMMIT_TIMEOUT_S,
    buffers: HostBufferPool | None = None,
    agreement_timeout_s: float = _commit.DEFAULT_AGREEMENT_TIMEOUT_S,
    per_process_state: object = None,
    pack_small_leaves_bytes: int | None = None,
) -> Snapshot:
    """Plans the save, agrees on it with the other processes, and copies this process's
    shards to host memory (blocking).

    The host buffers are real copies, never views of device buffers: once this returns
    the caller may donate, delete or overwrite the arrays. With `buffers`, the copies
    go into buffers reused from earlier snapshots and return to it once written.

    Raises:
      CheckpointExistsError: `path` is committed and `overwrite` is False.
      UnsupportedValueError: a leaf cannot be stored (names the leaf path), or
        `per_process_state` is not JSON-serialisable.
      SaveAgreementError: the processes differ in path, step or tree, one refused, or
        one did not arrive within `agreement_timeout_s`; nothing was written.

    Multi-process: every process calls it (through a save) once per save, in the same
    order: the n-th save of every process is agreed on as one (DESIGN.md step 0).
    """
    ticket = _commit.next_ticket()
    agreed: list[str] = []
    try:
        with _memory.paused():  # many small objects: no full collections over the heap meanwhile
            return _take_snapshot(
                ticket, agreed, path, tree, metadata=metadata, overwrite=overwrite, step=step,
                commit_timeout_s=commit_timeout_s, buffers=buffers, agreement_timeout_s=agreement_timeout_s,
                per_process_state=per_process_state, pack_bytes=_encoding.check_threshold(pack_small_leaves_bytes),
            )
    except BaseException as e:
        if isinstance(e, SaveAgreementError):
            raise
        if not agreed:  # the others must not wait for us: tell them why we are out
            _commit.refuse(ticket, os.fspath(path), e)
        else:  # agreed, then failed copying: process 0 stops waiting for our shards
            _coord.Coordinator(agreed[0], timeout_s=commit_timeout_s).report_error(f"{type(e).__name__}: {e}")
        raise


def _check_per_process_state(value: object, path: str, pidx: int) -> object:
    """The per-process state as stored (a JSON round trip), or UnsupportedValueError."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise UnsupportedValueError(
            f"per_process_state for {path} (process {pidx}) is not JSON-serialisable ({e}); pass dicts, lists, "
            "str, finite numbers, bool and None (e.g. a data loader's state_dict() of plain values)"
        ) from e


def _take_snapshot(
    ticket: int,
    agreed: list[str],
    path,
    tree,
    *,
    metadata,
    overwrite,
    step,
    commit_timeout_s,
    buffers,
    agreement_timeout_s,
    per_process_state,
    pack_bytes,
) -> Snapshot:
    t0, wall0 = time.perf_counter(), time.time()
    storage, path = storage_for(path)
    pidx, pcount = _coord.process_index(), _coord.process_count()
    check_target(storage, path, pidx, overwrite)
    user_metadata = metadata_json(metadata, path)
    if per_process_state is not None:
        per_process_state = _check_per_process_state(per_process_state, path, pidx)
    leaves = flatten(tree)
    entries: dict[str, dict] = {}  # leaf path -> manifest entry, in tree order (the agreement's digest)
    described: list[_ArrayLeaf] = []
    values: dict[str, dict] = {}
    cache: dict = {}
    for leaf_path, leaf in leaves:
        if _is_array(leaf):
            described.append(_describe_array(leaf_path, leaf, pidx, path, cache))
            entries[leaf_path] = {}  # filled in below, keeping tree order
            continue
        value = _format.value_to_json(leaf)
        if value is None:
            raise UnsupportedValueError(
                f"{where(leaf=leaf_path, path=path)}: a leaf of type {type(leaf).__module__}.{type(leaf).__qualname__} "
                "cannot be stored; leaves must be jax.Array, numpy arrays, None, bool, int, float, complex, "
                "str or numpy scalars (nothing is pickled). Convert it, or register its type as a pytree node."
            )
        values[leaf_path] = value
        entries[leaf_path] = {"type": "value", "value": value}
    # Every process plans every process's writes from the same global shard maps.
    assignments = _plan_tree(described)
    arrays: list[LeafSnapshot] = []
    device_data = []
    for d, assignment in zip(described, assignments):
        plan = assignment.for_process(pidx)
        meta = ArrayMetadata(
            d.shards.leaf_path, d.shards.shape, d.dtype, plan.chunk_shape, plan.inner_chunk_shape, d.saved, d.key_impl,
            d.kind, packed=_encoding.packs_leaf(d.shards.shape, plan.chunk_shape, d.dtype, pack_bytes),
        )
        arrays.append(LeafSnapshot(meta, plan, []))
        device_data.append([_chunk_data(d, w) for w in plan.writes])
        entries[meta.path] = meta.to_json()
    structure = describe(tree, _is_array)
    # Wait for the computations that produce the leaves (JAX dispatches asynchronously: a
    # save right after training steps waits for them here), so that the timeline's
    # `snapshot` is the agreement and the copy, and this wait is its own phase.
    jax.block_until_ready([d for datas in device_data for d in datas if isinstance(d, jax.Array)])
    ready = time.time()
    snap_phases = {"wait_for_arrays": (wall0, ready)}
    # Step 0: every process agrees on path, step and tree before anything is written.
    # Process 0 clears an object store's old step content only once all agreed.
    clear = (lambda: _commit.strategy_for(storage).prepare_overwrite(path)) if pidx == 0 else None
    generation = _commit.agree(
        ticket, _commit.proposal(path, step, structure, entries), timeout_s=agreement_timeout_s, before_verdict=clear,
    )
    agreed.append(generation)

    copies = iter(copy_to_host([d for datas in device_data for d in datas], buffers))
    for leaf, datas in zip(arrays, device_data):
        leaf.host = [next(copies) for _ in datas]
    snap = Snapshot(
        storage=storage, path=path, generation=generation, process_index=pidx, process_count=pcount,
        structure=structure, arrays=arrays, values=values, user_metadata=user_metadata, step=step,
        overwrite=overwrite, commit_timeout_s=commit_timeout_s, buffers=buffers, per_process_state=per_process_state,
    )
    snap.snapshot_s = time.perf_counter() - t0  # the whole blocking call, the wait for the arrays included
    snap.phases_unix_s.update(snap_phases, snapshot=(ready, time.time()))
    return snap


def _open_for_write(snap: Snapshot, meta: ArrayMetadata, create: bool):
    kvstore = snap.storage.kvstore_spec(f"{snap.write_path}/{_format.array_dir(meta.path)}")
    return ts.open(_format.zarr_spec(kvstore, meta, mode="create" if create else "write"), context=ts_context())


def begin_write(snap: Snapshot) -> None:
    """Before the first chunk: process 0 takes the save lock on `<partial>.lock` (held
    until commit or abort: recovery and gc leave a locked partial alone); every process
    creates the `processes/` folder of the write path."""
    if snap.process_index == 0 and snap.storage.supports_locks:
        snap.storage.makedirs(snap.partial_path.rsplit("/", 1)[0])
        snap.lock = snap.storage.lock(snap.partial_path + SAVE_LOCK_SUFFIX)
    snap.storage.makedirs(f"{snap.write_path}/{_format.PROCESSES}")


def chunk_record(meta: ArrayMetadata, chunk_index: Sequence[int], box: Box, data: np.ndarray) -> ChunkRecord:
    """The record of one chunk written from `data` (the host bytes of `box`)."""
    return ChunkRecord(
        leaf=meta.path,
        key=_format.chunk_key(meta.path, chunk_index),
        box=box,
        file_bytes=meta.layout.file_bytes,
        data_bytes=data.nbytes,
        data_crc32c=_format.data_crc32c(data),
    )


def write_record(snap: Snapshot, chunks: Sequence[ChunkRecord], packed: PackRecord | None = None) -> ProcessRecord:
    """Once this process's chunks are durable: writes its `processes/<i>.json` (with
    `snap.write_s` as measured, and the index of its pack of small leaves) and returns
    the record."""
    snap.bytes_written = sum(c.file_bytes for c in chunks if c.file_bytes is not None)
    record = ProcessRecord(
        process_index=snap.process_index,
        generation=snap.generation,
        chunks=tuple(chunks),
        bytes_written=snap.bytes_written,
        snapshot_s=round(snap.snapshot_s, 6),
        write_s=round(snap.write_s, 6),
        per_process_state=snap.per_process_state,  # additive: absent when the save gave none
        phases_unix_s=dict(snap.phases_unix_s) or None,
        packed=packed,  # additive: absent when this process packed nothing
    )
    snap.storage.write_file(f"{snap.write_path}/{_format.process_record_name(snap.process_index)}", _format.dumps_large(record.to_json()))
    return record


def write_snapshot(snap: Snapshot) -> ProcessRecord:
    """Writes this process's chunks and its `processes/<i>.json` record, durably.

    Process 0 also writes every array's `zarr.json` and the group nodes of
    `_zarr_groups`. Returns the record.

    Raises:
      SaveError: a write failed (names the leaf, the path and the process).
    """
    t0, wall0 = time.perf_counter(), time.time()
    root = snap.write_path
    futures: list = []
    opened: list = []
    try:
        begin_write(snap)
        meta_writer = snap.process_index == 0 if snap.writes_array_metadata is None else snap.writes_array_metadata
        # Packed leaves (`_pack`) go into this process's pack: no zarr array of their own.
        pack = _encoding.PackWriter(snap.process_index)
        for leaf in snap.arrays:
            if leaf.meta.packed:
                for w, host in zip(leaf.plan.writes, leaf.host):
                    pack.add(leaf.meta, w.box, host)
        unpacked = [leaf for leaf in snap.arrays if not leaf.meta.packed]
        opened = [(leaf, _open_for_write(snap, leaf.meta, create=meta_writer)) for leaf in unpacked]
        if meta_writer:  # zarr v3 group nodes: browsable with zarr.open_group
            write_group_nodes(snap.storage, root, snap.structure, [leaf.meta.path for leaf in unpacked])
        pack_done = None
        if pack:
            _storage.acquire(snap.write_limiter, pack.nbytes)  # the pack is one write
            with _memory.paused():
                pack_done = pack.write(snap.storage, root)
        chunks = []
        for leaf, fut in opened:
            try:
                store = fut.result()
            except Exception as e:
                raise SaveError(f"{where(leaf=leaf.meta.path, path=root, process=snap.process_index)}: cannot create the zarr array: {e}") from e
            for w, host in zip(leaf.plan.writes, leaf.host):
                _storage.acquire(snap.write_limiter, host.nbytes)  # paced per chunk write
                # TensorStore encodes straight from the snapshot instead of copying it into
                # its cache first: nothing changes `host` before the write is durable, and a
                # buffer TensorStore still references never returns to a pool (`_buffer_pool`).
                write = store[w.box.slices()].write(host, can_reference_source_data_indefinitely=True) if host.size else None
                futures.append((leaf.meta.path, write))
                chunks.append(chunk_record(leaf.meta, w.chunk_index, w.box, host))
        issued = time.time()  # every chunk write issued; "durable" waits for them all
        for leaf_path, f in futures:
            if f is None:
                continue
            try:
                f.result()
            except Exception as e:
                raise SaveError(f"{where(leaf=leaf_path, path=root, process=snap.process_index)}: writing a chunk failed: {e}") from e
        if pack_done is not None:
            try:
                snap.pack_index, pack_chunk = pack_done()
            except Exception as e:
                raise SaveError(f"writing the pack of small leaves {_encoding.array_name(snap.process_index)} in {root} failed "
                                f"(process {snap.process_index}): {e}") from e
            chunks.append(pack_chunk)
        snap.write_s = time.perf_counter() - t0
        snap.phases_unix_s.update(write=(wall0, issued), durable=(issued, time.time()))
        with _memory.paused():
            return write_record(snap, chunks, snap.pack_index)
    except BaseException as e:
        # Let array creations and writes already issued finish before anyone removes
        # the partial folder (a creation still running would re-create files in it).
        for _, f in opened + futures:
            if f is not None:
                try:
                    f.result()
                except Exception:
                    pass
        if isinstance(e, SaveError):
            raise
        raise SaveError(f"writing {root} failed (process {snap.process_index}): {type(e).__name__}: {e}") from e


def _manifest(snap: Snapshot, process_bytes: list[int], *, own_pack_only: bool = False) -> dict:
    """The manifest of `snap`'s save. `own_pack_only` (a local tier's copy, written
    before the other processes' records exist): its `packed` index holds this process's
    pack alone, and says so (`packed_processes`)."""
    if own_pack_only:
        packed = [snap.pack_index] if snap.pack_index is not None else []
    else:
        packed = _encoding.packs_of_save(snap.storage, snap.write_path, snap.process_index, snap.pack_index, snap.process_count) if (
            any(leaf.meta.packed for leaf in snap.arrays)) else []
    return manifest_json(
        step=snap.step, generation=snap.generation, process_count=snap.process_count,
        process_bytes_written=process_bytes, structure=snap.structure, arrays=[leaf.meta for leaf in snap.arrays],
        values=snap.values, user_metadata=snap.user_metadata,
        save_phases_unix_s={k: v for k, v in snap.phases_unix_s.items() if k == "wait"} or None,
        packed=packed, packed_processes=[snap.process_index] if own_pack_only else None,
    )


def commit(snap: Snapshot, record: ProcessRecord, after_publish: Callable[[], object] | None = None) -> None:
    """Runs the commit protocol; returns once the checkpoint is committed on every process.

    `after_publish` runs on process 0 after the commit and before the other processes
    are told (the manager's retention), so when `save` returns anywhere, retention of
    that step is done too. Its errors are logged, never raised: the commit stands.

    Raises:
      CommitTimeoutError, SaveError: nothing was committed.
    """
    t0, reported = time.perf_counter(), time.time()
    coord = _coord.Coordinator(snap.generation, timeout_s=snap.commit_timeout_s)
    coord.report_done(str(record.bytes_written))
    if snap.process_index != 0:
        coord.wait_commit()
        snap.commit_s = time.perf_counter() - t0
        return
    try:
        summaries = coord.wait_all_done()
        all_durable = time.time()
        snap.phases_unix_s["wait"] = (reported, all_durable)
        process_bytes = [int(s) for s in summaries] if summaries else [snap.bytes_written]
        _check_records(snap)
        _commit.add_entry(snap.storage, snap.path, snap.generation)  # before the marker
        _publish(snap, process_bytes)
        snap.phases_unix_s["commit"] = (all_durable, time.time())
    except BaseException as e:
        coord.announce_commit(f"{type(e).__name__}: {e}")
        raise
    if after_publish is not None:
        try:
            after_publish()
        except Exception as e:  # retention failures must not undo a commit
            log.warning("after committing %s: %s", snap.path, e)
    coord.announce_commit("ok")
    snap.commit_s = time.perf_counter() - t0


def _check_records(snap: Snapshot) -> None:
    """Process 0, before committing: every process's record is in this save's folder.

    A process that reported done for this generation but wrote elsewhere (saves called
    in different orders) must not yield a committed checkpoint with missing shards.
    """
    missing = [
        i for i in range(snap.process_count)
        if not snap.storage.exists(f"{snap.write_path}/{_format.process_record_name(i)}")
    ]
    if missing:
        raise SaveError(
            f"processes {missing} reported their shards durable but {snap.write_path} has no record of them; "
            "nothing was committed. Every process must call save with the same paths in the same order."
        )


def _publish(snap: Snapshot, process_bytes: list[int]) -> None:
    storage, root, final = snap.storage, snap.write_path, snap.path
    strategy = _commit.strategy_for(storage)
    try:
        with _memory.paused():
            manifest = _format.dumps_large(_manifest(snap, process_bytes))
        storage.write_file(f"{root}/{_format.MANIFEST}", manifest)
        marker = _format.dumps({"generation": snap.generation, "committed_unix_s": time.time()})
        storage.write_file(f"{root}/{_format.COMMITTED}", marker)
        replaced = strategy.publish(root, final, snap.generation, overwrite=snap.overwrite)
    except CheckpointExistsError:
        raise
    except OSError as e:
        raise SaveError(f"committing {final} failed (process {snap.process_index}): {e}") from e
    # Committed: from here on a failure is logged, never raised (a SaveError means that
    # nothing was committed). A leftover `.deleting-` folder is removed by recovery/gc.
    try:
        strategy.finish_publish(final, replaced)
    except OSError as e:
        log.warning("committed %s, but syncing its folder or removing the replaced checkpoint failed: %s", final, e)


def abort(snap: Snapshot, coord: _coord.Coordinator, *, timed_out: bool = False) -> None:
    """Best-effort removal of this save's partial folder after a failure (process 0).

    With several processes, the removal waits on a daemon thread until every process
    has reported (ok or error, up to the commit timeout), so that no one is still
    writing into the folder it removes, while the error reaches the caller at once. A
    process that never reports leaves the folder to garbage collection, unless the
    failure itself was the commit timeout (`timed_out`): processes silent for that long
    are taken for dead and the folder is removed at once.
    """
    folder = _commit.strategy_for(snap.storage).discard_path(snap.path, snap.generation)
    if snap.process_index != 0 or folder is None:
        return

    def remove() -> None:
        silent = [] if timed_out else coord.wait_all_reported(snap.commit_timeout_s)
        if silent:
            log.warning("processes %s never reported; leaving %s for garbage collection", silent, folder)
            return
        try:
            snap.storage.delete_tree(folder)
        except OSError:
            log.warning("could not remove %s after a failed save", folder)

    if snap.process_count == 1 or timed_out:
        remove()
    else:
        threading.Thread(target=remove, name=f"checkpointer-abort-{snap.generation}", daemon=True).start()


def save_sync(path, tree, *, metadata=None, overwrite=False, step=None, commit_timeout_s=_coord.DEFAULT_COMMIT_TIMEOUT_S,
              agreement_timeout_s=_commit.DEFAULT_AGREEMENT_TIMEOUT_S, per_process_state=None,
              write_limiter: _storage.TokenBucket | None = None,
              pack_small_leaves_bytes: int | None = None) -> Snapshot:
    """take_snapshot, write_snapshot and commit on the caller's thread."""
    snap = take_snapshot(path, tree, metadata=metadata, overwrite=overwrite, step=step, commit_timeout_s=commit_timeout_s,
                         agreement_timeout_s=agreement_timeout_s, per_process_state=per_process_state,
                         pack_small_leaves_bytes=pack_small_leaves_bytes)
    snap.write_limiter = write_limiter
    run_background(snap)
    return snap


def _release_host(snap: Snapshot) -> None:
    for leaf in snap.arrays:
        if snap.buffers is not None and leaf.host:
            snap.buffers.give_back(leaf.host)
        leaf.host = []


def run_background(
    snap: Snapshot,
    after_publish: Callable[[], object] | None = None,
    *,
    write: Callable[[Snapshot], ProcessRecord] | None = None,
) -> None:
    """`write` (default `write_snapshot`) then commit; on failure tells the others,
    cleans up, re-raises."""
    coord = _coord.Coordinator(snap.generation, timeout_s=snap.commit_timeout_s)
    try:
        try:
            record = (write or write_snapshot)(snap)
        except BaseException as e:
            coord.report_error(f"{type(e).__name__}: {e}")
            abort(snap, coord)
            raise
        _release_host(snap)  # the bytes are durable: free (or recycle) host memory
        try:
            commit(snap, record, after_publish)
        except BaseException as e:
            abort(snap, coord, timed_out=isinstance(e, CommitTimeoutError))
            raise
    finally:
        _release_host(snap)
        if snap.lock is not None:
            snap.lock.release(remove=True)
            snap.lock = None
    log.info(
        "saved %s: %.1f MiB written by process %d, snapshot %.3f s, write %.3f s, commit %.3f s",
        snap.path, snap.bytes_written / 2**20, snap.process_index, snap.snapshot_s, snap.write_s, snap.commit_s,
    )
