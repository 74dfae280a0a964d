"""Restore execution: run the restore plan, read, place on devices.

`_targets` resolves the target and assigns device boxes, `_restore_plan` plans the reads;
this module only executes: it checks that the chunk files the plan needs exist with the
right size (before anything is allocated), then reads, per unique target box of its own
devices, the byte ranges the plan names (through `_read`), and puts the result on every
local device that holds that box, within `max_inflight_bytes` of host memory.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .. import _encoding, _format, _memory
from .._encoding import BoxRead, LeafRestorePlan, RestorePlan, RestoreStats, chunk_keys
from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, DTypeMismatchError, where
from .._format import ArrayMetadata, CheckpointMetadata, PyTree, ValueMetadata, read_metadata, rebuild
from .._storage import Storage, storage_for
from . import _agreement
from ._plan import build_plan
from ._targets import LeafTarget, ResolvedTarget, resolve_tree

if TYPE_CHECKING:
    import tensorstore as ts

log = logging.getLogger("checkpointer")

DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30
_COPIES_IN_FLIGHT = 3


def _check_stored(store: ts.TensorStore, meta: ArrayMetadata, path: str) -> None:
    if tuple(store.shape) != meta.shape or np.dtype(store.dtype.numpy_dtype) != meta.dtype:
        raise CorruptCheckpointError(
            f"{where(leaf=meta.path, path=path)}: zarr.json says {tuple(store.shape)} {store.dtype.numpy_dtype}, "
            f"the manifest says {meta.shape} {meta.dtype}"
        )


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


@functools.partial(jax.jit, donate_argnums=0)
def _update(buf: jax.Array, piece: jax.Array, offsets: tuple[int, ...]) -> jax.Array:
    return jax.lax.dynamic_update_slice(buf, piece, offsets)


def _read_host(
    storage: Storage, path: str, meta: ArrayMetadata, b: BoxRead, store: ts.TensorStore | None,
    pool: concurrent.futures.Executor | None, stats: RestoreStats, pidx: int,
) -> np.ndarray:
    if b.box.size == 0:
        return np.zeros(b.box.shape, meta.dtype)
    if store is None:
        return _encoding.read_box(storage, path, meta, b, pool, stats)
    try:
        return store[b.box.slices()].read().result()
    except ValueError as e:  # TensorStore reports missing, truncated and checksum-failing data as ValueError
        raise CorruptCheckpointError(
            f"{where(leaf=meta.path, path=path, process=pidx)}: reading box {b.box} failed: {e}. "
            f"Run `checkpointer verify {path}` for a full report."
        ) from e


def _read_leaf(
    storage: Storage, path: str, meta: ArrayMetadata, lt: LeafTarget, lp: LeafRestorePlan, budget: _Budget, pidx: int,
    pool: concurrent.futures.Executor | None, stats: RestoreStats,
) -> dict[int, object]:
    """Reads every unique box of one leaf as planned and puts it on the devices that hold it.

    Returns {device id: single-device jax.Array}, or {-1: numpy array} for a host target.
    Host memory in use stays within the budget: a box is read, cast, put on its
    devices and dropped before the next one; a box the plan split into slabs is read
    slab by slab into a donated device buffer.

    Only damage is reported as CorruptCheckpointError (missing, truncated or
    checksum-failing data, from `_read` or TensorStore); any other exception is a bug
    or a device failure and propagates as itself.
    """
    store = None
    if not _encoding.fast_path_supported(meta.dtype):
        try:
            store = _encoding.open_zarr_array(storage, path, meta).result()
        except (ValueError, OSError) as e:  # TensorStore: zarr.json missing, unreadable or disagreeing
            raise CorruptCheckpointError(f"{where(leaf=meta.path, path=path, process=pidx)}: cannot open the zarr array: {e}") from e
        _check_stored(store, meta, path)
    # Where each device's piece goes: the device, in the target's memory kind (so a
    # target in pinned_host memory gets host-offloaded arrays).
    devices: dict[int, jax.sharding.Sharding] = {}
    if lt.sharding is not None:
        addressable: set[Any] = lt.sharding.addressable_devices  # Any: jaxlib has no stubs for Device
        memory_kind = lt.sharding.memory_kind
        devices = {d.id: jax.sharding.SingleDeviceSharding(d, memory_kind=memory_kind) for d in addressable}
    dtype = lt.dtype if lt.dtype is not None else meta.dtype
    out: dict[int, object] = {}
    for b in lp.boxes:
        bufs = None
        for slab in b.slabs or (b,):
            # A slab in flight costs up to three copies of its bytes in host memory: the
            # file reads, the assembled host box and (on CPU) the device staging copy.
            cost = slab.bytes_needed * _COPIES_IN_FLIGHT
            budget.acquire(cost)
            try:
                host = _read_host(storage, path, meta, slab, store, pool, stats, pidx)
                if lt.dtype is not None:
                    with np.errstate(all="ignore"):  # the cast was asked for: NaN/overflow are not news
                        host = host.astype(lt.dtype)
                if lt.sharding is None:
                    out[-1] = host
                elif not b.slabs:
                    # The first device may adopt the host buffer without a copy (CPU);
                    # every other device gets its own copy, so that donating one
                    # device's buffer can never change another's.
                    first, *rest = b.device_ids
                    out[first] = jax.device_put(host, devices[first])
                    for d in rest:
                        out[d] = jax.device_put(out[first], devices[d])
                else:
                    if bufs is None:
                        bufs = {d: jnp.zeros(b.box.shape, dtype, device=devices[d]) for d in b.device_ids}
                    offsets = tuple(s.start for s in slab.box.relative_to(b.box))
                    for d in b.device_ids:
                        bufs[d] = _update(bufs[d], jax.device_put(host, devices[d]), offsets)
                        bufs[d].block_until_ready()
                del host
            finally:
                budget.release(cost)
        if bufs is not None:
            out.update(bufs)
    return out


def _assemble(
    meta: ArrayMetadata, lt: LeafTarget, placed: dict[int, Any], exchange_spec: PartitionSpec | None = None
) -> object:
    """The leaf's global array from its single-device pieces: on the target sharding,
    or (`exchange_spec` given) the raw stored array in the exchange layout over the
    target's mesh, for `_exchange`."""
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
      CorruptCheckpointError: stored bytes or metadata are missing, malformed or fail a
        checksum; names the leaf and chunk.
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
    storage, path = storage_for(path)
    return restore_from(
        storage, path, target, partial=partial, missing=missing, max_inflight_bytes=max_inflight_bytes,
        stats=stats, cooperative=cooperative,
    )


def restore_from(
    storage: Storage,
    path: str,
    target: object = None,
    *,
    partial: bool = False,
    missing: str = "error",
    max_inflight_bytes: int | None = None,
    stats: RestoreStats | None = None,
    cooperative: bool = True,
) -> PyTree:
    """`restore` of `path` read through `storage` (the two tiers' view of a step, see
    `_tiers.TieredStorage`). Arguments, result and errors as for `restore`.

    Multi-process: as `restore`.
    """
    if max_inflight_bytes is not None and (
        isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int) or max_inflight_bytes < 1
    ):
        raise ValueError(f"max_inflight_bytes must be a positive int (bytes) or None, got {max_inflight_bytes!r}")
    if not isinstance(cooperative, bool):
        raise ValueError(f"cooperative must be True or False, got {cooperative!r}")
    stats = RestoreStats() if stats is None else stats
    t0 = time.perf_counter()
    if cooperative and jax.process_count() > 1:
        result = _restore_cooperative(storage, path, target, partial, missing, max_inflight_bytes, stats)
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
            result, ok = _restore_once(storage, path, target, partial, missing, max_inflight_bytes, stats), True
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


def _restore_cooperative(
    storage: Storage,
    path: str,
    target: object,
    partial: bool,
    missing: str,
    max_inflight_bytes: int | None,
    stats: RestoreStats,
) -> PyTree:
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
        meta, resolved, plan, budget = _prepare(
            storage, path, target, partial, missing, max_inflight_bytes, stats, cooperative=True
        )
    except BaseException as e:
        # The others may be about to cooperate on this restore: let them fail at once.
        _agreement.refuse(_agreement.next_ticket(), path, e)
        raise
    if not plan.cooperative:
        return _NOT_SHARED
    ticket = _agreement.next_ticket()
    _agreement.agree(ticket, path, before.decode("utf-8", "replace"), _agreement.target_description(resolved, partial, missing))
    stats.attempts += 1
    stats.plan = plan
    try:
        results = _read_all(storage, path, resolved, plan, budget, stats)
    except BaseException as e:
        _agreement.refuse(ticket, path, e, phase="read")
        if _marker(storage, path) is None and isinstance(e, (CorruptCheckpointError, OSError)):
            raise CheckpointNotFoundError(f"{path} was deleted (e.g. by retention) while it was being restored") from e
        raise
    _agreement.report_read(ticket, path)
    t0 = time.perf_counter()
    _exchange(resolved, plan, results)
    stats.exchange_s = time.perf_counter() - t0
    stats.bytes_received = plan.bytes_received
    after = _marker(storage, path)
    if after is None:
        raise CheckpointNotFoundError(f"{path} was deleted (e.g. by retention) while it was being restored")
    if after != before:
        raise CheckpointError(
            f"{path} was replaced (overwrite=True) while it was being restored cooperatively; restore it again"
        )
    return _finish(meta, resolved, path, results)


def _marker(storage: Storage, path: str) -> bytes | None:
    """The commit marker's content (it names the save's generation), None if absent."""
    try:
        return storage.read_file(f"{path}/{_format.COMMITTED}")
    except (FileNotFoundError, NotADirectoryError):
        return None


def _check_files(storage: Storage, path: str, resolved: ResolvedTarget) -> None:
    """Checks that every zarr shard file this process's devices need exists with its
    planned size, before the plan is built or anything is allocated: a damaged or
    hostile manifest declaring a huge shape is refused at its first file (one `stat`
    each). A cooperative plan reads a subset of these files."""
    packed = []
    for leaf in resolved.leaves:
        if leaf.target is not None and isinstance(leaf.meta, ArrayMetadata):
            if leaf.meta.packed:
                packed.append(leaf.meta)
                continue
            keys = chunk_keys(leaf.meta, [b for _, b in leaf.device_boxes])
            _encoding.check_chunk_files(storage, path, leaf.meta, keys)
    _encoding.check_pack_files(storage, path, packed)


def _prepare(
    storage: Storage,
    path: str,
    target: object,
    partial: bool,
    missing: str,
    max_inflight_bytes: int | None,
    stats: RestoreStats,
    *,
    cooperative: bool = False,
) -> tuple[CheckpointMetadata, ResolvedTarget, RestorePlan, _Budget]:
    """Reads the manifest, resolves the target and plans this process's reads (no chunk I/O)."""
    with _memory.paused():  # many small objects: no full collections over the heap meanwhile
        return _prepare_paused(storage, path, target, partial, missing, max_inflight_bytes, stats, cooperative)


def _prepare_paused(
    storage: Storage, path: str, target: object, partial: bool, missing: str, max_inflight_bytes: int | None,
    stats: RestoreStats, cooperative: bool,
) -> tuple[CheckpointMetadata, ResolvedTarget, RestorePlan, _Budget]:
    meta = read_metadata(storage, path)
    pidx = jax.process_index()
    resolved = resolve_tree(meta, target, partial=partial, process_index=pidx, missing=missing, cooperative=cooperative)
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
    budget = _Budget(max_inflight_bytes or DEFAULT_MAX_INFLIGHT_BYTES)
    plan = build_plan(resolved, path, slab_bytes=budget.limit // _COPIES_IN_FLIGHT, cooperative=cooperative)
    return meta, resolved, plan, budget


def _restore_once(
    storage: Storage,
    path: str,
    target: object,
    partial: bool,
    missing: str,
    max_inflight_bytes: int | None,
    stats: RestoreStats,
) -> PyTree:
    meta, resolved, plan, budget = _prepare(storage, path, target, partial, missing, max_inflight_bytes, stats)
    stats.plan = plan
    results = _read_all(storage, path, resolved, plan, budget, stats)
    return _finish(meta, resolved, path, results)


def _finish(meta: CheckpointMetadata, resolved: ResolvedTarget, path: str, results: dict[str, object]) -> PyTree:
    """The restored tree: the target's structure (its kept leaves as they were), or the
    manifest's for `target=None`."""
    if resolved.treedef is None:
        return rebuild(meta.structure, lambda p: results[p], where=path)
    results.update(resolved.kept)
    return jax.tree_util.tree_unflatten(resolved.treedef, [results[p] for p in resolved.order])


def _read_all(
    storage: Storage, path: str, resolved: ResolvedTarget, plan: RestorePlan, budget: _Budget, stats: RestoreStats
) -> dict[str, object]:
    """Runs the plan: every leaf path -> its value, a `jax.Array` on the target's sharding,
    a numpy array, or, for a leaf with an exchange, the global array of its exchange layout
    (`_exchange` reshards those)."""
    pidx = plan.process_index
    leaf_plans = {lp.leaf_path: lp for lp in plan.leaves}
    results: dict[str, object] = {}
    # The worker threads place arrays on devices: they must see the caller's
    # jax_enable_x64 (a `with jax.enable_x64(...)` block is thread-local).
    # (Config declares its flags at runtime, hence the ignore.)
    read_leaf = functools.partial(_with_x64, jax.config.jax_enable_x64, _read_leaf)  # type: ignore[attr-defined]

    workers = max(4, 2 * (os.cpu_count() or 2))
    with concurrent.futures.ThreadPoolExecutor(workers) as leaf_pool, concurrent.futures.ThreadPoolExecutor(workers) as chunk_pool:
        pending = []
        packed = []
        for leaf in resolved.leaves:
            m, lt = leaf.meta, leaf.target
            if isinstance(m, ValueMetadata):
                results[leaf.path] = m.value
                continue
            assert lt is not None, "resolve_tree gives every array leaf a target"
            if m.packed:  # small leaves: read from the packs and placed in one batch, below
                packed.append((m, lt, leaf_plans[leaf.path]))
                continue
            future = leaf_pool.submit(read_leaf, storage, path, m, lt, leaf_plans[leaf.path], budget, pidx, chunk_pool, stats)
            pending.append((leaf.path, m, lt, future))
        if packed:
            with _memory.paused():
                results.update(_encoding.restore_packed(storage, path, packed, budget, stats, _COPIES_IN_FLIGHT))
        for leaf_path, m, lt, future in pending:
            results[leaf_path] = _assemble(m, lt, future.result(), leaf_plans[leaf_path].exchange_spec)
    return results


def _exchange(resolved: ResolvedTarget, plan: RestorePlan, results: dict[str, object]) -> None:
    """Reshards every leaf read in its exchange layout onto its target, in one JAX
    program (collectives over the device interconnect: gloo on CPU, NCCL on GPUs).

    Multi-process: collective; every process runs it with the same leaves, in order.
    """
    names = [lp.leaf_path for lp in plan.leaves if lp.exchange_spec is not None]
    if not names:
        return
    targets = {leaf.path: leaf for leaf in resolved.leaves}
    shardings = []
    for name in names:
        lt = targets[name].target
        assert lt is not None and lt.sharding is not None
        shardings.append(lt.sharding)
    # Waited for, so that `RestoreStats.exchange_s` is the exchange's time, not its dispatch.
    out = jax.block_until_ready(jax.jit(_identity, out_shardings=tuple(shardings))(tuple(results[n] for n in names)))
    for name, arr in zip(names, out):
        meta = targets[name].meta
        assert isinstance(meta, ArrayMetadata)
        results[name] = jax.random.wrap_key_data(arr, impl=meta.key_impl) if meta.key_impl is not None else arr


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
    Returns:
      A `RestorePlan`: per leaf and unique box read, the chunks, inner chunks and
      bytes to read; `.bytes_needed`, `.bytes_read`, `.bytes_received` (from peers),
      `.read_amplification`; `print()` it for a table.
    Raises:
      As `restore`, for metadata and target mismatches; MeshError when `processes`
      does not divide a target mesh's devices.

    Multi-process: pure; any process may call it alone.
    """
    storage, path = storage_for(path)
    meta = read_metadata(storage, path)
    pidx = jax.process_index() if process_index is None else process_index
    coop = cooperative and (jax.process_count() if processes is None else processes) > 1
    resolved = resolve_tree(
        meta, target, partial=partial, process_index=pidx, processes=processes, missing=missing, cooperative=coop
    )
    slab_bytes = (max_inflight_bytes or DEFAULT_MAX_INFLIGHT_BYTES) // _COPIES_IN_FLIGHT
    return build_plan(resolved, path, slab_bytes=slab_bytes, cooperative=coop)
