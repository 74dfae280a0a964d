"""Save execution: snapshot to host, write through TensorStore, record, commit.

The three phases are separate so that `save_async` can run the last two on a
background thread (see `_async.py`):

1. `take_snapshot` (caller's thread, blocking): plans the whole tree (`_save_plan`:
   every process computes every process's chunks from the shardings' global device
   maps), then copies the chunks this process writes (whole shards, or the slices of a
   replica-parallel split) to host memory, once: straight into their zarr shard files
   where the shard is read in place and the files are local (`_encoding.fill_images`;
   their crc32c come later, from the writer: `ShardImage.checksum`), else into host arrays of their boxes
   (`_memory.snapshot_to_host`); into the buffers of a pool when given one.
2. `write_snapshot` (any thread): writes the chunks into `<path>.partial-<generation>/`,
   durably (TensorStore's file driver fsyncs, or the direct writer of local files,
   `_encoding.start_write`), then `processes/<i>.json`.
3. the commit (any thread): the commit protocol of DESIGN.md, `_commit.Commit`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import tensorstore as ts

from .. import _commit, _coord, _encoding, _format, _memory, _storage
from .._commit import SAVE_LOCK_SUFFIX
from .._errors import CheckpointExistsError, SaveAgreementError, SaveError, UnsupportedValueError, where
from .._format import (
    ZARR_JSON,
    ArrayMetadata,
    ChunkRecord,
    PackRecord,
    ProcessRecord,
    describe,
    flatten,
    manifest_json,
    metadata_json,
    write_group_nodes,
)
from .._memory import HostBufferPool
from .._storage import FileLock, Storage, storage_for, ts_context
from . import _incremental
from ._copy import LeafSnapshot, copy_leaves
from ._leaves import ArrayLeaf, chunk_data, describe_array, is_array
from ._options import SaveOptions
from ._plan import LeafAssignment, LeafWritePlan, plan_writes

_DEFAULT_OPTIONS = SaveOptions()
log = logging.getLogger("checkpointer")


@dataclasses.dataclass
class SaveResult:
    """What writing and committing one snapshot produced, filled in by the thread that
    writes it (`write_snapshot`, `run_background`, the local tier's runner) and read once
    it is done (the manager's status, the journal).

    Attributes:
      write_s: seconds from the first write to every chunk durable and the record written.
      commit_s: seconds of the commit sequence.
      bytes_written: bytes of this process's chunk files.
      phases_unix_s: wall-clock spans of this process's phases, name -> (start, end)
        unix seconds: the snapshot's (`wait_for_arrays`, `snapshot`), then `write`,
        `durable`, process 0's `wait` and `commit`; the record keeps this process's, the
        manifest process 0's wait, `_timeline` draws them.
      pack_index: this process's pack of small leaves, once written (`_pack`).
      write_mode, write_mode_reason: "direct" or "buffered", and why
        (`_encoding.write_context`), once writing.
      lock: process 0's lock on `<partial>.lock` while writing.
      references: incremental saves: the references this process made, `(leaf path,
        ChunkRef or a packed chunk's PackedBox)` (`_incremental.Base.split`/`split_packed`).
      incremental: what the equality check of an incremental save found and cost.
    """

    write_s: float = 0.0
    commit_s: float = 0.0
    bytes_written: int = 0
    phases_unix_s: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    pack_index: PackRecord | None = None
    write_mode: str | None = None
    write_mode_reason: str | None = None
    lock: FileLock | None = None
    references: list[tuple[str, _format.ChunkRef | _format.PackedBox]] = dataclasses.field(default_factory=list)
    incremental: _incremental.Stats = dataclasses.field(default_factory=_incremental.Stats)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One save as planned and copied to host memory (immutable: `dataclasses.replace`
    makes a variant, e.g. the local tier's), and `result`, what writing it produced.

    The plan fields say what to write where (and how: `direct_io`, `write_limiter`,
    `writes_array_metadata`); `snapshot_s`, `copied_bytes` and `copy_route_bytes` say what
    the blocking snapshot did. Each leaf's `host` holds its host copies until they are
    durable (`release_host`)."""

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
    write_limiter: _storage.TokenBucket | None = None  # max_write_bytes_per_s (None: unlimited)
    # Writes every array's zarr.json and the group nodes: process 0 (None), or every
    # process into its own folder (the local tier of `_tiers`: True).
    writes_array_metadata: bool | None = None
    direct_io: str | bool = "auto"  # `SaveOptions.direct_io`
    snapshot_s: float = 0.0  # the blocking call, the wait for the arrays included
    copied_bytes: int = 0  # bytes the snapshot copied to host memory, each saved byte once
    copy_route_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # those bytes by route (`IMAGE` included)
    # Incremental saves: the checkpoint it may reference, the jax.Arrays it saves (weakly).
    base: _incremental.Base | None = None
    saved_arrays: Mapping[str, weakref.ref] = dataclasses.field(default_factory=dict)
    incremental: bool = False  # `SaveOptions.incremental`
    # The packed chunks laid out as this process's pack (`_copy`): the leaves' host copies
    # of them are its views; its buffer is the pool's when `pack_slab_pooled`.
    pack_slab: _encoding.PackSlab | None = None
    pack_slab_pooled: bool = False
    # Per array leaf, its manifest entry (`ArrayMetadata.to_json()` without references),
    # one object per layout: the manifest takes them as they are (`manifest_json`).
    array_entries: list[dict] | None = None
    result: SaveResult = dataclasses.field(default_factory=SaveResult)

    @property
    def partial_path(self) -> str:
        parent, name = self.path.rsplit("/", 1)
        return f"{parent}/{_format.partial_name(name, self.generation)}"

    @property
    def write_path(self) -> str:
        """Where the files go: the partial folder on POSIX, the final path on object stores."""
        return _commit.strategy_for(self.storage).write_path(self.path, self.generation)


# The last few trees' plans: a training loop saves the same tree with the same shardings
# every time, and planning a large tree on many devices takes seconds (docs/SCALE.md).
_PLAN_CACHE: collections.OrderedDict[tuple, tuple[LeafAssignment, ...]] = collections.OrderedDict()
_PLAN_CACHE_SIZE = 4
_PLAN_CACHE_LOCK = threading.Lock()


def _plan_tree(described: list[ArrayLeaf]) -> tuple[LeafAssignment, ...]:
    """`plan_writes` of the tree, reused while the leaf paths, shardings, shapes and
    dtypes stay the same (the plan depends on nothing else)."""
    # The key: the leaf paths, each leaf's layout as a position in the list of distinct
    # layouts, and that list (hashing a sharding per leaf would cost more than planning).
    position: dict[int, int] = {}  # id(layout key) -> its position
    distinct: dict[tuple, int] = {}
    for d in described:
        if id(d.layout_key) not in position:
            position[id(d.layout_key)] = distinct.setdefault(d.layout_key, len(distinct))
    paths = [d.leaf_path for d in described]
    key = (tuple(paths), tuple(position[id(d.layout_key)] for d in described), tuple(distinct))
    with _PLAN_CACHE_LOCK:
        hit = _PLAN_CACHE.get(key)
        if hit is not None:
            _PLAN_CACHE.move_to_end(key)
            return hit
    plan = plan_writes([d.shards for d in described], paths=paths)
    with _PLAN_CACHE_LOCK:
        _PLAN_CACHE[key] = plan
        while len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
            _PLAN_CACHE.popitem(last=False)
    return plan


def _committed(storage: Storage, path: str) -> bool:
    return storage.exists(f"{path}/{_format.COMMITTED}")


# What a checkpoint folder (or a crashed save under the final name) may contain.
_FORMAT_NAMES = frozenset({_format.ARRAYS, _format.PROCESSES, _format.MANIFEST, _format.COMMITTED, _format.RETIRED, ZARR_JSON,
                           _encoding.PACKED})


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
    if overwrite and _committed(storage, path):
        _incremental.check_unreferenced(storage, path, pidx)


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
    options: SaveOptions = _DEFAULT_OPTIONS,
    *,
    step: int | None = None,
    buffers: HostBufferPool | None = None,
    write_limiter: _storage.TokenBucket | None = None,
) -> Snapshot:
    """Plans the save, agrees on it with the other processes, and copies this process's
    shards to host memory (blocking). `options` as `ckpt.save`'s keyword arguments
    (`max_write_bytes_per_s` is the writer's: pass its bucket as `write_limiter`,
    `_storage.limiter_for`, or a manager's bucket shared by its saves).

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
            return _take_snapshot(ticket, agreed, path, tree, options, step=step, buffers=buffers, write_limiter=write_limiter)
    except BaseException as e:
        if isinstance(e, SaveAgreementError):
            raise
        if not agreed:  # the others must not wait for us: tell them why we are out
            _commit.refuse(ticket, os.fspath(path), e)
        else:  # agreed, then failed copying: process 0 stops waiting for our shards
            _commit.commit_round(agreed[0], os.fspath(path), options.commit_timeout_s).refuse(e)
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
    ticket: int, agreed: list[str], path, tree, options: SaveOptions, *, step: int | None, buffers: HostBufferPool | None,
    write_limiter: _storage.TokenBucket | None,
) -> Snapshot:
    overwrite, per_process_state = options.overwrite, options.per_process_state
    pack_bytes = _encoding.check_threshold(options.pack_small_leaves_bytes)
    t0, wall0 = time.perf_counter(), time.time()
    storage, path = storage_for(path)
    pidx, pcount = _coord.process_index(), _coord.process_count()
    check_target(storage, path, pidx, overwrite)
    user_metadata = metadata_json(options.metadata, path)
    if per_process_state is not None:
        per_process_state = _check_per_process_state(per_process_state, path, pidx)
    leaves = flatten(tree)
    base = _incremental.find_base(storage, path) if options.incremental else None
    entries: dict[str, dict] = {}  # leaf path -> manifest entry, in tree order (the agreement's digest)
    described: list[ArrayLeaf] = []
    values: dict[str, dict] = {}
    cache: dict = {}
    for leaf_path, leaf in leaves:
        if is_array(leaf):
            described.append(describe_array(leaf_path, leaf, pidx, path, cache))
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
    by_path = dict(leaves) if base is not None else {}
    identical: list[tuple[_format.ChunkRef, ...] | None] = []  # per leaf: its references if unchanged by identity
    planned: list[tuple[ArrayMetadata, LeafWritePlan]] = []
    device_data = []
    array_entries: list[dict] = []
    # Leaves of one layout and one assignment of writes share their plan and metadata but
    # for the path, and their manifest entry (one object: the agreement encodes each
    # distinct entry once). Keyed by ids: `described` and `assignments` keep them alive.
    shared: dict[tuple[int, int], tuple[LeafWritePlan, ArrayMetadata, dict]] = {}
    for d, assignment in zip(described, assignments):
        path_ = d.leaf_path
        template = shared.get((id(d.layout_key), id(assignment.writes)))
        if template is None:
            plan = assignment.for_process(pidx)
            meta = ArrayMetadata(path_, d.shards.shape, d.dtype, plan.chunk_shape, plan.inner_chunk_shape, d.saved, d.key_impl,
                                 d.kind, packed=_encoding.packs_leaf(d.shards.shape, plan.chunk_shape, d.dtype, pack_bytes))
            template = shared[(id(d.layout_key), id(assignment.writes))] = (plan, meta, meta.to_json())
        else:
            plan = _format.with_fields(template[0], leaf_path=path_)
            meta = _format.with_fields(template[1], path=path_, references={})
        planned.append((meta, plan))
        identical.append(base.identical(meta, by_path.get(path_), [w.chunk_index for w in plan.writes]) if base else None)
        device_data.append([] if identical[-1] is not None else  # nothing to copy
                           [d.by_device[w.device_id] if w.shard_box is None else chunk_data(d, w) for w in plan.writes])
        entries[path_] = template[2]
        array_entries.append(template[2])
    structure = describe(tree, is_array)
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
        ticket,
        # One process agrees with itself: its tree's description (a text per leaf) would be compared with nothing.
        _commit.proposal(path, step, structure, entries if pcount > 1 else {}, incremental=options.incremental,
                         describe_structure=pcount > 1),
        timeout_s=options.agreement_timeout_s, before_verdict=clear,
    )
    agreed.append(generation)

    copies = copy_leaves(storage, options, planned, device_data, buffers)
    arrays = [dataclasses.replace(leaf, references=refs) if refs is not None else leaf for leaf, refs in zip(copies.leaves, identical)]
    return Snapshot(
        storage=storage, path=path, generation=generation, process_index=pidx, process_count=pcount,
        structure=structure, arrays=arrays, values=values, user_metadata=user_metadata, step=step,
        overwrite=overwrite, commit_timeout_s=options.commit_timeout_s, buffers=buffers, per_process_state=per_process_state,
        base=base, saved_arrays=_incremental.weak_arrays(leaves) if options.incremental else {}, incremental=options.incremental,
        write_limiter=write_limiter, direct_io=options.direct_io, copied_bytes=copies.copied_bytes,
        copy_route_bytes=copies.route_bytes, pack_slab=copies.pack_slab, pack_slab_pooled=copies.pack_slab_pooled,
        array_entries=array_entries,
        snapshot_s=time.perf_counter() - t0,  # the whole blocking call, the wait for the arrays included
        result=SaveResult(phases_unix_s={**snap_phases, "snapshot": (ready, time.time())}),
    )


def open_for_write(snap: Snapshot, meta: ArrayMetadata, create: bool) -> Any:
    """Opens (`create`: creates) the zarr array of one leaf in the write path (a TensorStore future)."""
    kvstore = snap.storage.kvstore_spec(f"{snap.write_path}/{_format.array_dir(meta.path)}")
    return ts.open(_format.zarr_spec(kvstore, meta, mode="create" if create else "write"), context=ts_context())


def begin_write(snap: Snapshot) -> None:
    """Before the first chunk: process 0 takes the save lock on `<partial>.lock` (held
    until commit or abort: recovery and gc leave a locked partial alone); every process
    creates the `processes/` folder of the write path."""
    if snap.process_index == 0 and snap.storage.supports_locks:
        snap.storage.makedirs(snap.partial_path.rsplit("/", 1)[0])
        snap.result.lock = snap.storage.lock(snap.partial_path + SAVE_LOCK_SUFFIX)
    snap.storage.makedirs(f"{snap.write_path}/{_format.PROCESSES}")


def write_record(snap: Snapshot, chunks: Sequence[ChunkRecord], packed: PackRecord | None = None) -> ProcessRecord:
    """Once this process's chunks are durable: writes its `processes/<i>.json` (with
    `snap.result.write_s` as measured, and the index of its pack of small leaves) and returns
    the record."""
    snap.result.bytes_written = sum(c.file_bytes for c in chunks if c.file_bytes is not None)
    record = ProcessRecord(
        process_index=snap.process_index,
        generation=snap.generation,
        chunks=tuple(chunks),
        bytes_written=snap.result.bytes_written,
        snapshot_s=round(snap.snapshot_s, 6),
        write_s=round(snap.result.write_s, 6),
        write_mode=snap.result.write_mode,  # additive: absent in records of older versions
        write_mode_reason=snap.result.write_mode_reason,
        per_process_state=snap.per_process_state,  # additive: absent when the save gave none
        phases_unix_s=dict(snap.result.phases_unix_s) or None,
        packed=packed,  # additive: absent when this process packed nothing
        references=tuple(_incremental.references_json(snap.result.references)) or None,  # additive: incremental saves
        packed_references=_incremental.pack_references(snap.result.references),
    )
    location = f"{snap.write_path}/{_format.process_record_name(snap.process_index)}"
    snap.storage.write_file(location, _format.readable_size(_format.dumps_large(record.to_json()), location, (
        "Its per_process_state (or its list of chunks) is too large: keep large state (e.g. a data loader's "
        "permutation) as an array in the tree")))
    return record


def write_snapshot(snap: Snapshot) -> ProcessRecord:
    """Writes this process's chunks and its `processes/<i>.json` record, durably.

    Process 0 also writes every array's `zarr.json` and the group nodes of
    `_zarr_groups`. The chunks are written by each leaf's encoding
    (`_encoding.start_write`), direct or buffered as `snap.direct_io` and the file
    system decide (`snap.result.write_mode`). Returns the record.

    Raises:
      SaveError: a write failed (names the leaf, the path and the process).
    """
    t0, wall0 = time.perf_counter(), time.time()
    root = snap.write_path
    finish = None
    try:
        begin_write(snap)
        meta_writer = snap.process_index == 0 if snap.writes_array_metadata is None else snap.writes_array_metadata
        ctx = _encoding.write_context(
            snap.storage, root, snap.direct_io, process_index=snap.process_index, writes_array_metadata=meta_writer,
            limiter=snap.write_limiter, pack_slab=snap.pack_slab,
        )
        result = snap.result
        result.write_mode, result.write_mode_reason = ctx.mode, ctx.mode_reason
        with _memory.paused():  # a LeafWrite per leaf: no full collections over the heap meanwhile
            leaves = [_encoding.LeafWrite(leaf.meta, [(w.chunk_index, w.box, h) for w, h in zip(leaf.plan.writes, leaf.host)])
                      for leaf in snap.arrays] if snap.base is None else [
                _incremental.leaf_write(  # all but the unchanged chunks; an image's check runs on the writer's thread
                    snap.base, leaf.meta, [(w.chunk_index, w.box, h) for w, h in zip(leaf.plan.writes, leaf.host)],
                    leaf.references, result.references, result.incremental) for leaf in snap.arrays]
        finish = _encoding.start_write(snap.storage, root, leaves, ctx)
        if meta_writer:  # zarr v3 group nodes: browsable with zarr.open_group
            write_group_nodes(snap.storage, root, snap.structure, [leaf.meta.path for leaf in snap.arrays if not leaf.meta.packed])
        issued = time.time()  # every chunk write issued; "durable" waits for them all
        done, finish = finish(), None
        _incremental.resolve(result.references)  # the checks made on the writer's threads
        snap.result.pack_index = done.packed
        snap.result.write_s = time.perf_counter() - t0
        snap.result.phases_unix_s.update(write=(wall0, issued), durable=(issued, time.time()))
        with _memory.paused():
            return write_record(snap, done.chunks, snap.result.pack_index)
    except BaseException as e:
        # Let the writes already issued finish before anyone removes the partial folder
        # (a creation still running would re-create files in it).
        if finish is not None:
            try:
                finish()
            except BaseException:
                pass
        if isinstance(e, SaveError):
            raise
        raise SaveError(f"writing {root} failed (process {snap.process_index}): {type(e).__name__}: {e}") from e


def manifest_bytes(snap: Snapshot, process_bytes: list[int], *, own_pack_only: bool = False,
                   referencing: Sequence[int] = ()) -> bytes:
    """The manifest of `snap` (`process_bytes`: bytes written per process), encoded.
    `own_pack_only` (a local tier's copy, written before the other processes' records
    exist): its `packed` index holds this process's pack alone, and says so
    (`packed_processes`). `referencing`: the processes whose records hold references."""
    with _memory.paused():
        if own_pack_only:
            packed = ([snap.result.pack_index] if snap.result.pack_index is not None else []) + list(
                _incremental.pack_references(snap.result.references) or ())
        else:
            packed = _encoding.packs_of_save(snap.storage, snap.write_path, snap.process_index, snap.result.pack_index, snap.process_count,
                                             _incremental.pack_references(snap.result.references) or ()) if (
                any(leaf.meta.packed for leaf in snap.arrays)) else []
        arrays = [leaf.meta for leaf in snap.arrays]
        entries = snap.array_entries
        if snap.base is not None or referencing:  # every process's references, by leaf (format_version 2 when any)
            entries = None
            arrays = _incremental.with_references(arrays, _incremental.gather(
                snap.storage, snap.path, snap.write_path, snap.process_index, snap.result.references, referencing))
        return _format.readable_size(_format.dumps_large(manifest_json(
            step=snap.step, generation=snap.generation, process_count=snap.process_count,
            process_bytes_written=process_bytes, structure=snap.structure, arrays=arrays,
            values=snap.values, user_metadata=snap.user_metadata,
            save_phases_unix_s={k: v for k, v in snap.result.phases_unix_s.items() if k == "wait"} or None,
            packed=packed, packed_processes=[snap.process_index] if own_pack_only else None, array_entries=entries,
        )), f"{snap.path}/{_format.MANIFEST}", "Its user metadata (metadata=, metrics=) or non-array leaves are too large "
            "(or the tree has too many leaves): keep large data as arrays in the tree")


def committer(snap: Snapshot) -> _commit.Commit:
    """The commit of `snap` by every process of the job (`_commit.Commit`)."""
    return _commit.Commit(
        snap.storage, snap.path, snap.generation, overwrite=snap.overwrite,
        round=_commit.commit_round(snap.generation, snap.path, snap.commit_timeout_s),
    )


def save_sync(path: str | os.PathLike, tree: object, options: SaveOptions, *, step: int | None = None) -> Snapshot:
    """take_snapshot, write_snapshot and commit on the caller's thread."""
    limiter = _storage.limiter_for(options.max_write_bytes_per_s)  # raises before the snapshot
    snap = take_snapshot(path, tree, options, step=step, write_limiter=limiter)
    run_background(snap)
    return snap


def release_host(snap: Snapshot) -> None:
    """Frees (or returns to its pool) the host copies of `snap`: its bytes are durable."""
    for leaf in snap.arrays:
        host = list(leaf.host)
        leaf.host.clear()
        if snap.buffers is not None and host:  # host copies adopted from jax are not the pool's
            mine = [h.buffer if isinstance(h, _encoding.ShardImage) else h
                    for h, pooled in zip(host, leaf.pooled or [True] * len(host)) if pooled]
            del host  # `give_back` pools only buffers that nothing else references
            snap.buffers.give_back(mine)
    freed = [b for b in [snap.pack_slab.release() if snap.pack_slab is not None else None] if b is not None]
    if freed and snap.pack_slab_pooled and snap.buffers is not None:  # its views went with the host lists
        snap.buffers.give_back(freed)  # the list's is the only reference left: pooled


def run_background(
    snap: Snapshot,
    after_publish: Callable[[], object] | None = None,
    *,
    write: Callable[[Snapshot], ProcessRecord] | None = None,
) -> None:
    """`write` (default `write_snapshot`) then the commit sequence of `_commit.Commit`
    (`after_publish` runs on process 0 after the commit, before the others are told: the
    manager's retention); on failure tells the others, cleans up, re-raises.

    Raises:
      CommitTimeoutError, SaveError: nothing was committed.
    """
    commit = committer(snap)
    try:
        try:
            record = (write or write_snapshot)(snap)
        except BaseException as e:
            commit.fail(e)
            raise
        release_host(snap)  # the bytes are durable: free (or recycle) host memory
        t0 = time.perf_counter()
        commit.run(
            record.bytes_written, lambda process_bytes: manifest_bytes(snap, process_bytes, referencing=commit.referencing),
            after_publish=after_publish, phases=snap.result.phases_unix_s, references=record.has_references,
            guard=_incremental.guard(snap.storage, snap.path.rsplit("/", 1)[0]) if snap.incremental else None,
        )
        snap.result.commit_s = time.perf_counter() - t0
        if snap.saved_arrays:  # the next incremental save's identity check
            _incremental.remember(snap.storage, snap.path, snap.generation, snap.saved_arrays)
    finally:
        release_host(snap)
        if snap.result.lock is not None:
            snap.result.lock.release(remove=True)
            snap.result.lock = None
    log.info(
        "saved %s: %.1f MiB written by process %d, snapshot %.3f s, write %.3f s, commit %.3f s",
        snap.path, snap.result.bytes_written / 2**20, snap.process_index, snap.snapshot_s, snap.result.write_s, snap.result.commit_s,
    )
