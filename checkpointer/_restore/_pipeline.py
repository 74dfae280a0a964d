"""Restore execution: run the restore plan, read, place on devices.

`_targets` resolves the target and assigns device boxes, `_plan` plans the reads; this
module only executes: it checks that the files the plan needs exist with the right size
(before anything is allocated), then has each leaf's encoding (`_encoding.encoding_of`)
read the byte ranges the plan names and put them on every local device that holds
them, within `max_inflight_bytes` of host memory; a cooperative restore then exchanges
the shares and checks the chunks read in pieces.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .. import _encoding, _format, _memory
from .._encoding import ReadContext, RestorePlan, RestoreStats
from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, DTypeMismatchError, where
from .._format import ArrayMetadata, CheckpointMetadata, PyTree, ValueMetadata, read_metadata, rebuild
from .._storage import DEFAULT_MAX_OVER_READ_RATIO, LocalStorage, Storage, storage_for
from . import _agreement
from ._options import RestoreOptions
from ._plan import build_plan
from ._targets import ResolvedTarget, resolve_tree

_DEFAULT_OPTIONS = RestoreOptions()
log = logging.getLogger("checkpointer")

DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30
_COPIES_IN_FLIGHT = 3


class _Budget:
    """Bounds the bytes of reads in flight (`max_inflight_bytes`); one read always proceeds."""

    def __init__(self, limit: int):
        self.limit, self.used, self.cv = max(1, int(limit)), 0, threading.Condition()

    def acquire(self, n: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    def release(self, n: int) -> None:
        with self.cv:
            self.used -= n
            self.cv.notify_all()


_T = TypeVar("_T")


def _check_device_dtype(meta: ArrayMetadata, dtype: np.dtype, path: str) -> None:
    """Raises DTypeMismatchError if JAX would silently narrow `dtype` on a device (x64 off)."""
    if jax.dtypes.canonicalize_dtype(dtype) != np.dtype(dtype):
        raise DTypeMismatchError(
            f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: the result dtype {np.dtype(dtype)} cannot live on a device while "
            f"jax_enable_x64 is off (JAX would make it {jax.dtypes.canonicalize_dtype(dtype)}). Enable x64 "
            "(jax.config.update('jax_enable_x64', True) or `with jax.enable_x64(True):`), restore it to the host "
            f"(target leaf None), or ask for the cast explicitly with a target dtype of "
            f"{jax.dtypes.canonicalize_dtype(dtype)}."
        )


def restore(
    path: str | os.PathLike,
    target: object = None,
    *,
    partial: bool = False,
    missing: str = "error",
    max_inflight_bytes: int | None = None,
    stats: RestoreStats | None = None,
    cooperative: bool = True,
    max_over_read_ratio: float = DEFAULT_MAX_OVER_READ_RATIO,
    read_chunk_bytes: int | None = None,
) -> PyTree:
    """Restores the committed checkpoint at `path`, onto the target's shardings.

    Args:
      path: a checkpoint path (local, `file://`, `memory://`, `gs://`, `s3://`).
      target: a pytree shaped like the saved tree (or a subset with `partial=True`)
        whose leaves are `jax.ShapeDtypeStruct` with `.sharding`, `jax.Array` (its
        sharding, shape, dtype), `jax.sharding.Sharding` (shape and dtype from the
        checkpoint) or None (a host numpy array). `target=None` restores the whole
        tree as host numpy arrays, rebuilding containers from the manifest. A target
        dtype that differs from the stored one is a cast within one kind, on the host.
      partial: if True, saved leaves absent from the target are not read, and a None
        target leaf where the checkpoint holds a subtree is skipped (returned as None).
      missing: what to do with target leaves the checkpoint lacks (fine-tuning a new
        head). `"error"` (default): StructureMismatchError. `"keep_target"`: return the
        target's own leaf there, as it is (a `jax.Array`, numpy array, scalar or None;
        an abstract leaf raises InvalidTargetError, since a value is needed); their key
        strings are logged at INFO on the `checkpointer` logger and listed in
        `stats.kept_from_target`.
      max_inflight_bytes: bound on bytes of reads in flight, bytes (default 1 GiB);
        a larger box is still read, alone.
      stats: a `RestoreStats` to fill in (bytes and chunks read, the plan executed,
        seconds); `restore` still returns only the tree.
      cooperative: with several processes, a box that devices of several processes
        hold (a replicated target) is read once in all: each of them reads a disjoint
        share from storage and JAX reshards the shares onto the target over the device
        interconnect, so the job reads about the checkpoint's bytes, not P times them.
        The restore is then collective (see Multi-process). False: every process reads
        all it needs itself, with no collective; prefer it when storage serves P
        readers at P times the bandwidth and the interconnect is slower, or when
        processes restore independently (different times, paths or targets).
      max_over_read_ratio: bound on bytes read over bytes needed (>= 1; default
        1.05): nearby byte ranges of one file (inner chunks of a zarr shard file, the
        column blocks of a safetensors row) are fetched by one request when the bytes
        between them cost less than another request would, reading at most this ratio
        of what each leaf needs. 1.0: never read bytes that are not needed.
      read_chunk_bytes: bound on one request that gathers several ranges, bytes
        (default: 4 MiB for local files, 16 MiB for object stores).
    Returns:
      The restored tree, with the target's own node types (NamedTuples, dataclasses,
      `TrainState`); array leaves are `jax.Array` with the target sharding, or numpy.
    Raises:
      CheckpointNotFoundError: no committed checkpoint at `path`.
      StructureMismatchError, ShapeMismatchError, DTypeMismatchError, InvalidTargetError:
        the target does not fit (DTypeMismatchError also for a 64-bit result dtype on a
        device while jax_enable_x64 is off); the message names the leaves (as
        `jax.tree_util.keystr` prints them) and the fix. StructureMismatchError also for a
        None target leaf over a saved subtree without `partial=True`.
      CorruptCheckpointError: stored bytes or metadata are missing, malformed, fail a
        checksum or cannot be read (an I/O error, e.g. EIO: its cause); names the leaf
        and chunk, or the file.
      RestoreAgreementError: (cooperative restore) another process restores another
        path, save or target, could not restore or read its share (its error is
        named), or did not arrive in time; raised on every process before the exchange.
      ValueError: `missing` is not `"error"` or `"keep_target"`, or `max_inflight_bytes`
        or `cooperative` is malformed.

    Multi-process: every process calls it with targets of the same global shardings.
    Without a shared box (or with `cooperative=False`) each reads what its own devices
    need and no collective is run. With one (the default then cooperates) it is
    collective: every process calls it, in the same order, with the same path and
    target; they agree through the coordination service before reading and after
    (a process that cannot restore makes every process raise), then exchange.
    """
    options = RestoreOptions(partial, missing, max_inflight_bytes, stats, cooperative, max_over_read_ratio, read_chunk_bytes)
    storage, path = storage_for(path)
    return restore_from(storage, path, target, options)


def restore_from(storage: Storage, path: str, target: object = None, options: RestoreOptions = _DEFAULT_OPTIONS) -> PyTree:
    """`restore` of `path` read through `storage` (the two tiers' view of a step, see
    `_tiers.TieredStorage`), `options` its keyword arguments. Result and errors as for
    `restore`.

    Multi-process: as `restore`.
    """
    stats = RestoreStats() if options.stats is None else options.stats
    t0 = time.perf_counter()
    if options.cooperative and jax.process_count() > 1:
        result = _restore_cooperative(storage, path, target, options, stats)
        if result is not _NOT_SHARED:
            stats.elapsed_s = time.perf_counter() - t0
            return result
    # A checkpoint replaced (overwrite=True) or deleted (retention) while it is read
    # must not yield a mix of two saves or a false report of damage: compare the commit
    # marker before and after, and read once more if it changed.
    for _ in range(2):
        before = _marker(storage, path)
        try:
            stats.attempts += 1
            result, ok = _restore_once(storage, path, target, options, stats), True
        except (CorruptCheckpointError, OSError):
            # Files that vanish under the reader (the folder renamed away by retention,
            # then removed) surface as either; only the marker tells damage from deletion.
            if _marker(storage, path) == before:
                raise
            result, ok = None, False
        after = _marker(storage, path)
        if after is None:
            raise CheckpointNotFoundError(f"{path} was deleted (e.g. by retention) while it was being restored")
        if after == before and ok:
            stats.elapsed_s = time.perf_counter() - t0
            return result
        log.warning("%s was replaced while it was being restored; reading it again", path)
    raise CheckpointError(f"{path} kept being replaced while it was being restored; try again")


_NOT_SHARED = object()  # `_restore_cooperative`: no box is shared, restore plainly


def _restore_cooperative(storage: Storage, path: str, target: object, options: RestoreOptions, stats: RestoreStats) -> PyTree:
    """The collective restore (see `restore`); `_NOT_SHARED` when no box is shared.

    Round 1 (agree on path, commit marker and target) before any chunk is read; round
    2 (every share read) before the exchange, so a failure on one process raises on
    all instead of leaving them in a collective. The marker is checked again after the
    exchange: a save replaced or deleted meanwhile raises (no second attempt: that
    would need every process to retry together).
    """
    pidx = jax.process_index()
    before = _marker(storage, path)
    try:
        if before is None:
            raise CheckpointNotFoundError(f"no committed checkpoint at {path} (process {pidx}): its commit marker is absent")
        meta, resolved, plan, budget = _prepare(storage, path, target, options, stats, cooperative=True)
    except BaseException as e:
        # The others may be about to cooperate on this restore: let them fail at once.
        # A restore number only where they would (a restore that shares no box takes
        # none, so a process may make one alone): decided from the target alone.
        if _target_may_share_boxes(target):
            _agreement.refuse(_agreement.next_ticket(), path, e)
        raise
    if not plan.cooperative:
        return _NOT_SHARED
    ticket = _agreement.next_ticket()
    _agreement.agree(ticket, path, before.decode("utf-8", "replace"), _agreement.target_description(resolved, options.partial, options.missing))
    stats.attempts += 1
    stats.plan = plan
    try:
        results, piece_crcs = _read_all(storage, path, resolved, plan, budget, stats, options)
    except BaseException as e:
        _agreement.refuse(ticket, path, e, phase="read")
        if _marker(storage, path) is None and isinstance(e, (CorruptCheckpointError, OSError)):
            raise CheckpointNotFoundError(f"{path} was deleted (e.g. by retention) while it was being restored") from e
        raise
    _agreement.report_read(ticket, path)
    t0 = time.perf_counter()
    pieces = _exchange(resolved, plan, results, _encoding.piece_values(plan, piece_crcs))
    stats.exchange_s = time.perf_counter() - t0
    stats.bytes_received = plan.bytes_received
    after = _marker(storage, path)
    if after is None:
        raise CheckpointNotFoundError(f"{path} was deleted (e.g. by retention) while it was being restored")
    if after != before:
        raise CheckpointError(
            f"{path} was replaced (overwrite=True) while it was being restored cooperatively; restore it again"
        )
    _encoding.check_pieces(plan, pieces, path)  # chunks read in pieces by several processes, alike on every process
    return _finish(meta, resolved, path, results)


def _target_may_share_boxes(target: object) -> bool:
    """Whether a target leaf puts one box on devices of several processes (the plan
    would then cooperate; a box's bytes decide nothing here), from the target alone for
    a process that failed before planning. True when it cannot tell (no target: the
    saved shardings; a leaf it cannot read)."""
    if target is None:
        return True
    try:
        for leaf in jax.tree_util.tree_leaves(target):
            sharding, shape = getattr(leaf, "sharding", None), getattr(leaf, "shape", None)
            if not isinstance(sharding, NamedSharding) or shape is None:
                continue
            owners: dict[tuple, set[int]] = {}
            placed: Mapping[Any, tuple] = sharding.devices_indices_map(tuple(shape))  # Any: jaxlib has no stubs for Device
            for device, index in placed.items():
                owners.setdefault(tuple((i.start, i.stop) for i in index), set()).add(device.process_index)
            if any(len(procs) > 1 for procs in owners.values()):
                return True
        return False
    except Exception:
        return True


def _marker(storage: Storage, path: str) -> bytes | None:
    """The commit marker's content (it names the save's generation), None if absent.

    Raises:
      CorruptCheckpointError: it cannot be read (an I/O error: its cause).
    """
    try:
        return storage.read_file(f"{path}/{_format.COMMITTED}")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):  # a folder in its place: no marker either
        return None
    except OSError as e:  # the documented error, as for a chunk that cannot be read
        raise CorruptCheckpointError(
            f"{path}/{_format.COMMITTED} cannot be read (process {jax.process_index()}): {e}. An I/O error is not "
            f"always damage: try again, or check the checkpoint with `checkpointer verify {path}`"
        ) from e


def _check_files(storage: Storage, path: str, resolved: ResolvedTarget) -> None:
    """Checks that every file this process's devices need exists with its planned size,
    before the plan is built or anything is allocated: a damaged or hostile manifest
    declaring a huge shape is refused at its first file (one `stat` each). A
    cooperative plan reads a subset of these files."""
    _encoding.check_files(storage, path, [
        (leaf.meta, [b for _, b in leaf.device_boxes])
        for leaf in resolved.leaves if leaf.target is not None and isinstance(leaf.meta, ArrayMetadata)
    ])


def _check_no_link_out(storage: Storage, path: str) -> None:
    """Local checkpoints: refuses a link (to a file or a folder) inside `path` whose
    target lies outside it, before anything is read: a restore returns the checkpoint's
    own bytes only (a chunk of another checkpoint passes the zarr checksums, a manifest
    of another carries its values). Links within it, and a link to the whole checkpoint
    (`path` itself), are fine. One `scandir` per folder; object stores have no links.

    Raises:
      CorruptCheckpointError: names the link, its target and the checkpoint.
    """
    if not isinstance(storage, LocalStorage):
        return
    root = os.path.realpath(path)
    folders = [path]
    while folders:
        try:
            with os.scandir(folders.pop()) as it:
                entries = list(it)
        except OSError:
            continue  # absent or unreadable: the reads say so
        for e in entries:
            if e.is_symlink():
                target = os.path.realpath(e.path)
                if target != root and not target.startswith(root + os.sep):
                    raise CorruptCheckpointError(
                        f"{e.path} is a link to {target}, outside the checkpoint {path}: refused, a restore reads the "
                        "checkpoint's own files only. Copy the file into the checkpoint, or restore another step"
                    )
            elif e.is_dir(follow_symlinks=False):
                folders.append(e.path)


def _prepare(
    storage: Storage, path: str, target: object, options: RestoreOptions, stats: RestoreStats, *, cooperative: bool = False
) -> tuple[CheckpointMetadata, ResolvedTarget, RestorePlan, _Budget]:
    """Reads the manifest, resolves the target and plans this process's reads (no chunk I/O)."""
    with _memory.paused():  # many small objects: no full collections over the heap meanwhile
        return _prepare_paused(storage, path, target, options, stats, cooperative)


def _prepare_paused(
    storage: Storage, path: str, target: object, options: RestoreOptions, stats: RestoreStats, cooperative: bool
) -> tuple[CheckpointMetadata, ResolvedTarget, RestorePlan, _Budget]:
    _check_no_link_out(storage, path)
    meta = read_metadata(storage, path)
    pidx = jax.process_index()
    resolved = resolve_tree(meta, target, partial=options.partial, process_index=pidx, missing=options.missing, cooperative=cooperative)
    stats.kept_from_target = resolved.kept_keystrs
    if resolved.kept_keystrs:
        log.info(
            "restore of %s: %d target leaves were not read and keep the target's values: %s",
            path, len(resolved.kept_keystrs), ", ".join(k or "<root>" for k in resolved.kept_keystrs),
        )
    for leaf in resolved.leaves:
        lt, m = leaf.target, leaf.meta
        if lt is not None and lt.sharding is not None and isinstance(m, ArrayMetadata) and m.key_impl is None:
            _check_device_dtype(m, lt.dtype if lt.dtype is not None else m.dtype, path)
    _check_files(storage, path, resolved)
    budget = _Budget(options.max_inflight_bytes or DEFAULT_MAX_INFLIGHT_BYTES)
    plan = build_plan(resolved, path, slab_bytes=budget.limit // _COPIES_IN_FLIGHT, cooperative=cooperative)
    return meta, resolved, plan, budget


def _restore_once(storage: Storage, path: str, target: object, options: RestoreOptions, stats: RestoreStats) -> PyTree:
    # One pause over planning, reading and the tree (no waits on other processes here):
    # the plan's objects die with it, uncollected, and only the restored tree survives.
    with _memory.paused():
        meta, resolved, plan, budget = _prepare(storage, path, target, options, stats)
        stats.plan = plan
        results, _ = _read_all(storage, path, resolved, plan, budget, stats, options)
        return _finish(meta, resolved, path, results)


def _finish(meta: CheckpointMetadata, resolved: ResolvedTarget, path: str, results: dict[str, object]) -> PyTree:
    """The restored tree: the target's structure (its kept leaves as they were), or the
    manifest's for `target=None`."""
    if resolved.treedef is None:
        return rebuild(meta.structure, lambda p: results[p], where=path)
    results.update(resolved.kept)
    return jax.tree_util.tree_unflatten(resolved.treedef, [results[p] for p in resolved.order])


def _read_all(
    storage: Storage, path: str, resolved: ResolvedTarget, plan: RestorePlan, budget: _Budget, stats: RestoreStats,
    options: RestoreOptions,
) -> tuple[dict[str, object], dict[tuple[str, int], int]]:
    """Runs the plan: every leaf path -> its value, a `jax.Array` on the target's sharding,
    a numpy array, or, for a leaf with an exchange, the global array of its exchange layout
    (`_exchange` reshards those); and the crc32c of the pieces of shared chunks read."""
    leaf_plans = {lp.leaf_path: lp for lp in plan.leaves}
    results: dict[str, object] = {}
    items = []
    for leaf in resolved.leaves:
        m, lt = leaf.meta, leaf.target
        if isinstance(m, ValueMetadata):
            results[leaf.path] = m.value
            continue
        assert lt is not None, "resolve_tree gives every array leaf a target"
        items.append((m, lt, leaf_plans[leaf.path]))
    workers = max(4, 2 * (os.cpu_count() or 2))
    # No cyclic collection while reading: the reads make only short-lived objects (freed
    # by reference counting), and one full collection over a large program's heap (JAX's
    # own objects) costs as much as checking the crc32c of a GiB.
    with _memory.paused(), concurrent.futures.ThreadPoolExecutor(workers) as leaf_pool, \
            concurrent.futures.ThreadPoolExecutor(workers) as chunk_pool:
        # The worker threads place arrays on devices: they must see the caller's
        # jax_enable_x64 (a `with jax.enable_x64(...)` block is thread-local).
        # (Config declares its flags at runtime, hence the ignore.)
        ctx = ReadContext(budget, stats, plan.process_index, _COPIES_IN_FLIGHT, leaf_pool, chunk_pool,
                          x64=jax.config.jax_enable_x64,  # type: ignore[attr-defined]
                          max_over_read_ratio=options.max_over_read_ratio, read_chunk_bytes=options.read_chunk_bytes)
        results.update(_encoding.start_restore(storage, path, items, ctx)())
    return results, ctx.piece_crcs


def _exchange(resolved: ResolvedTarget, plan: RestorePlan, results: dict[str, object], pieces: np.ndarray) -> np.ndarray:
    """Reshards every leaf read in its exchange layout onto its target, in one JAX
    program (collectives over the device interconnect: gloo on CPU, NCCL on GPUs), and
    gathers every process's `pieces` (crc32c of pieces of shared chunks, `piece_values`)
    with it; returns their XOR over processes (every piece's crc32c).

    Multi-process: collective; every process runs it with the same leaves, in order.
    """
    names = [lp.leaf_path for lp in plan.leaves if lp.exchange_spec is not None]
    if not names:
        return pieces
    targets = {leaf.path: leaf for leaf in resolved.leaves}
    shardings = []
    for name in names:
        lt = targets[name].target
        assert lt is not None and lt.sharding is not None
        shardings.append(lt.sharding)
    inputs = [results[n] for n in names]
    if pieces.size:
        first = shardings[0]
        assert isinstance(first, NamedSharding) and isinstance(first.mesh, jax.sharding.Mesh), "a cooperative target is on a Mesh"
        mesh = first.mesh
        rows, everywhere = _pieces_array(mesh, pieces)
        inputs.append(rows)
        shardings.append(everywhere)
    # Waited for, so that `RestoreStats.exchange_s` is the exchange's time, not its dispatch.
    out = jax.block_until_ready(jax.jit(_identity, out_shardings=tuple(shardings))(tuple(inputs)))
    for name, arr in zip(names, out):
        meta = targets[name].meta
        assert isinstance(meta, ArrayMetadata)
        results[name] = jax.random.wrap_key_data(arr, impl=meta.key_impl) if meta.key_impl is not None else arr
    if not pieces.size:
        return pieces
    return np.bitwise_xor.reduce(np.asarray(out[-1].addressable_data(0)), axis=0)


def _pieces_array(mesh: jax.sharding.Mesh, pieces: np.ndarray) -> tuple[jax.Array, NamedSharding]:
    """A global uint32 array of one row per device of `mesh`: this process's `pieces` in
    the row of its first device, zeros elsewhere; and the replicated sharding that
    gathers it."""
    shape = (mesh.devices.size, pieces.size)
    sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
    rows: Any = sharding.addressable_devices_indices_map(shape)
    mine = min(idx[0].start or 0 for idx in rows.values())
    zeros = np.zeros((1, pieces.size), np.uint32)
    arr = jax.make_array_from_callback(shape, sharding, lambda idx: pieces[None] if idx and (idx[0].start or 0) == mine else zeros)
    return arr, NamedSharding(mesh, PartitionSpec())


def _identity(xs: _T) -> _T:
    return xs


def plan_restore(
    path: str | os.PathLike,
    target: object,
    *,
    process_index: int | None = None,
    partial: bool = False,
    processes: int | None = None,
    max_inflight_bytes: int | None = None,
    missing: str = "error",
    cooperative: bool = True,
    max_over_read_ratio: float = DEFAULT_MAX_OVER_READ_RATIO,
    read_chunk_bytes: int | None = None,
) -> RestorePlan:
    """Plans a restore without touching devices or chunk data.

    Args:
      path: a checkpoint path.
      target: as for `restore`.
      process_index: plan for this process (default: the caller's).
      partial: as for `restore`.
      processes: None: the target's devices belong to their own processes (as
        `restore` would run here). P: plan as if the target meshes' devices were
        spread over P processes in mesh order, consecutive blocks each; needs no
        devices (targets over a `jax.sharding.AbstractMesh` of any size work).
      max_inflight_bytes: as for `restore`; boxes larger than a third of it are
        planned as slabs, as `restore` reads them.
      missing: as for `restore` (kept target leaves are not in the plan).
      cooperative: as for `restore`: with more than one process (`processes`, or the
        job's), boxes that several processes need are split among them
        (`LeafRestorePlan.exchange_spec`, `BoxRead.receivers`, `.received`).
      max_over_read_ratio, read_chunk_bytes: as for `restore` (checked; the plan lists
        the inner chunks needed, the reads may also fetch small gaps between them).
    Returns:
      A `RestorePlan`: per leaf and unique box read, the chunks, inner chunks and
      bytes to read; `.bytes_needed`, `.bytes_read`, `.bytes_received` (from peers),
      `.read_amplification`; `print()` it for a table.
    Raises:
      As `restore`, for metadata and target mismatches; MeshError when `processes`
      does not divide a target mesh's devices.

    Multi-process: pure; any process may call it alone.
    """
    options = RestoreOptions(partial, missing, max_inflight_bytes, None, cooperative, max_over_read_ratio, read_chunk_bytes)
    storage, path = storage_for(path)
    meta = read_metadata(storage, path)
    pidx = jax.process_index() if process_index is None else process_index
    coop = options.cooperative and (jax.process_count() if processes is None else processes) > 1
    resolved = resolve_tree(
        meta, target, partial=options.partial, process_index=pidx, processes=processes, missing=options.missing, cooperative=coop
    )
    slab_bytes = (options.max_inflight_bytes or DEFAULT_MAX_INFLIGHT_BYTES) // _COPIES_IN_FLIGHT
    return build_plan(resolved, path, slab_bytes=slab_bytes, cooperative=coop)
