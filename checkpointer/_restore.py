"""Restore execution: match the target to the checkpoint, plan, read, place on devices.

Each process reads, per unique target box of its own devices, only the inner chunks
that box intersects (the byte ranges `_restore_plan` planned, fetched by `_read`), and
puts the result on every local device that holds that box, within `max_inflight_bytes`
of host memory.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tensorstore as ts

from . import _format, _read
from ._box import Box, grid_cells
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DTypeMismatchError,
    InvalidTargetError,
    ShapeMismatchError,
    StructureMismatchError,
    where,
)
from ._format import ArrayMetadata, ValueMetadata
from ._metadata import CheckpointMetadata, read_metadata
from ._restore_plan import BoxRead, LeafRestorePlan, RestorePlan, plan_chunk_read, plan_leaf
from ._storage import TS_CONTEXT, Storage, storage_for
from ._tree import flatten, rebuild

log = logging.getLogger("checkpointer")

DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30
_COPIES_IN_FLIGHT = 3


@dataclasses.dataclass(frozen=True)
class LeafTarget:
    """A resolved target for one array leaf.

    Attributes:
      sharding: where the result goes, or None for a host numpy array.
      shape: the shape of the result (the stored shape; for PRNG keys without the
        key data's trailing dimensions).
      dtype: the result dtype (a cast from the stored dtype when it differs).
    """

    sharding: jax.sharding.Sharding | None
    shape: tuple[int, ...]
    dtype: np.dtype | None


def _is_target_leaf(x: object) -> bool:
    return x is None or isinstance(x, (jax.ShapeDtypeStruct, jax.Array, jax.sharding.Sharding, np.ndarray))


def _kind(dtype: np.dtype) -> str | None:
    """'b' bool, 'i' integer (signed or unsigned, int4 too), 'f' floating (bfloat16,
    float8_* too), 'c' complex; None for anything else. (numpy.can_cast's "same_kind"
    is not used: it allows int to float and, through ml_dtypes, float32 to int4.)"""
    if dtype.kind in "bfc":
        return dtype.kind
    if dtype.kind in "iu":
        return "i"
    for info, kind in ((ml_dtypes.iinfo, "i"), (ml_dtypes.finfo, "f")):
        try:
            info(dtype)
            return kind
        except (ValueError, TypeError):
            continue
    return None


def _check_cast(meta: ArrayMetadata, dtype, path: str) -> np.dtype | None:
    """The dtype to cast to, None when none is needed; raises DTypeMismatchError."""
    stored_key = meta.key_impl is not None
    if dtype is None:
        return None
    target_key = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    if stored_key or target_key:
        if stored_key != target_key:
            raise DTypeMismatchError(
                f"{where(leaf=meta.path, path=path)}: stored {'a PRNG key array' if stored_key else meta.dtype} "
                f"but the target asks for {dtype}; a key and its raw data are not interchangeable. "
                "Use jax.random.key_data / wrap_key_data on your side."
            )
        stored = jax.eval_shape(lambda: jax.random.key(0, impl=meta.key_impl)).dtype
        if stored != dtype:
            raise DTypeMismatchError(
                f"{where(leaf=meta.path, path=path)}: stored a {meta.key_impl} PRNG key array ({stored}) but the "
                f"target asks for {dtype}; keys of one impl cannot be made into another. Fix the target's impl."
            )
        return None
    dtype = np.dtype(dtype)
    if dtype == meta.dtype:
        return None
    if _kind(meta.dtype) != _kind(dtype) or _kind(dtype) is None:
        raise DTypeMismatchError(
            f"{where(leaf=meta.path, path=path)}: stored dtype {meta.dtype}, target dtype {dtype}. A target "
            "dtype is applied as a cast only within one kind (float to float, int to int, complex to complex); "
            f"restore as {meta.dtype} and convert it yourself, or fix the target."
        )
    return dtype


def resolve_target(meta: ArrayMetadata, target: object, path: str) -> LeafTarget:
    """Turns one target leaf (see `restore`) into a `LeafTarget`, checking shape and dtype."""
    stored_shape = meta.shape
    if meta.key_impl is not None:
        try:
            data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=meta.key_impl)))
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptCheckpointError(
                f"{where(leaf=meta.path, path=path)}: unknown PRNG key impl {meta.key_impl!r:.100} ({e})"
            ) from e
        key_dims = len(data.shape)
        if meta.shape[len(meta.shape) - key_dims :] != tuple(data.shape) or meta.dtype != data.dtype:
            raise CorruptCheckpointError(
                f"{where(leaf=meta.path, path=path)}: a {meta.key_impl} key array needs key data of trailing "
                f"shape {tuple(data.shape)} and dtype {data.dtype}; the manifest says {meta.shape} {meta.dtype}"
            )
        stored_shape = meta.shape[: len(meta.shape) - key_dims]
    if target is None or isinstance(target, (bool, int, float, complex, np.generic)):
        # A scalar in the target (e.g. `step=0` of a fresh TrainState where the saved
        # state had an array): the stored array comes back on the host.
        return LeafTarget(None, stored_shape, None)
    if not isinstance(target, (jax.sharding.Sharding, np.ndarray, jax.ShapeDtypeStruct, jax.Array)):
        raise InvalidTargetError(
            f"{where(leaf=meta.path, path=path)}: target leaf of type {type(target).__name__} is not one of "
            "jax.ShapeDtypeStruct (with a sharding), jax.Array, jax.sharding.Sharding, None or a scalar"
        )
    if isinstance(target, jax.sharding.Sharding):
        return LeafTarget(target, stored_shape, None)
    if isinstance(target, np.ndarray):
        shape, dtype, sharding = target.shape, target.dtype, None
    else:
        shape, dtype = tuple(target.shape), target.dtype
        sharding = getattr(target, "sharding", None)
        if sharding is None:
            raise InvalidTargetError(
                f"{where(leaf=meta.path, path=path)}: target ShapeDtypeStruct has no sharding; give it one "
                "(jax.ShapeDtypeStruct(shape, dtype, sharding=...)) or use None for a host numpy array"
            )
    if tuple(shape) != stored_shape:
        raise ShapeMismatchError(
            f"{where(leaf=meta.path, path=path)}: stored shape {stored_shape}, target shape {tuple(shape)}. "
            "Restore needs the same global shape; fix the target (jax.eval_shape of your init gives it) or "
            "restore with a Sharding / None leaf to take the stored shape."
        )
    cast = _check_cast(meta, dtype, path)
    return LeafTarget(sharding, stored_shape, cast)


def _device_boxes(target: LeafTarget, meta: ArrayMetadata, process_index: int) -> list[tuple[int, Box]]:
    """(device id, box) of the target's devices that belong to `process_index`."""
    if target.sharding is None:
        return [(-1, Box.whole(meta.shape))]
    key_tail = meta.shape[len(target.shape) :]
    try:
        indices = target.sharding.devices_indices_map(target.shape)
    except ValueError as e:  # IndivisibleError and friends
        raise InvalidTargetError(
            f"leaf {meta.path!r}: the target sharding {target.sharding} does not fit shape {target.shape}: {e}. "
            "Choose a PartitionSpec whose mesh axes divide the dimensions, or replicate that dimension (None)."
        ) from e
    out = []
    for device, index in indices.items():
        if device.process_index != process_index:
            continue
        box = Box.from_index(index, target.shape)
        out.append((device.id, Box(box.origin + (0,) * len(key_tail), box.shape + key_tail)))
    return out


def match(meta: CheckpointMetadata, target: object, *, partial: bool, path: str):
    """Pairs target leaves with stored leaves.

    Returns:
      (treedef or None, [(leaf path, stored metadata, target leaf)]) in target order;
      treedef None means "rebuild from the manifest".
    Raises:
      StructureMismatchError: leaf paths differ (names missing and extra paths).
    """
    if target is None:
        return None, [(p, m, None) for p, m in meta.leaves.items()]
    flat = flatten_target(target)
    paths = [p for p, _ in flat]
    missing = [p for p in paths if p not in meta.leaves]
    extra = [p for p in meta.leaves if p not in set(paths)] if not partial else []
    if missing or extra:
        msg = [f"the target tree does not match the checkpoint {path}:"]
        if missing:
            msg.append(f"  in the target but not in the checkpoint ({len(missing)}): {_show(missing)}")
        if extra:
            msg.append(f"  in the checkpoint but not in the target ({len(extra)}): {_show(extra)}")
        msg.append(
            "Fix the target's structure (ckpt.metadata(path).tree shows the saved one)"
            + (", or pass partial=True to restore a subset." if extra and not missing else ".")
        )
        raise StructureMismatchError("\n".join(msg))
    return jax.tree_util.tree_structure(target, is_leaf=_is_target_leaf), [(p, meta.leaves[p], leaf) for p, leaf in flat]


def flatten_target(target: object) -> list[tuple[str, object]]:
    """(leaf path, target leaf) pairs; ShapeDtypeStructs, arrays, shardings and None are leaves."""
    return flatten(target, is_leaf=_is_target_leaf)


def _show(paths: list[str], n: int = 10) -> str:
    shown = ", ".join(repr(p) for p in paths[:n])
    return shown + (f", ... ({len(paths) - n} more)" if len(paths) > n else "")


def build_plan(
    storage: Storage, path: str, meta: CheckpointMetadata, target: object, *, partial: bool, process_index: int,
    check_files: bool = False,
):
    """Matches and plans. Returns (treedef, items, RestorePlan) with items
    `(leaf path, stored metadata, LeafTarget | None, LeafRestorePlan | None)`.

    With `check_files`, each leaf's chunk files that this process needs are first
    checked to exist with the size the manifest implies (local storage), one `stat`
    each, before the leaf is planned: a damaged or hostile manifest declaring a huge
    shape is refused before memory proportional to it is spent.
    """
    tdef, pairs = match(meta, target, partial=partial, path=path)
    items, plans = [], []
    for p, m, t in pairs:
        if isinstance(m, ValueMetadata):
            items.append((p, m, None, None))
            continue
        lt = resolve_target(m, t, path)
        device_boxes = _device_boxes(lt, m, process_index)
        if check_files:
            boxes = sorted({b for _, b in device_boxes})
            _read.check_chunk_files(
                storage, path, m, (_format.chunk_key(m.path, c) for b in boxes for c in grid_cells(b, m.chunk_shape))
            )
        lp = plan_leaf(m, device_boxes)
        items.append((p, m, lt, lp))
        plans.append(lp)
    return tdef, items, RestorePlan(path, process_index, tuple(plans))


def _open_for_read(storage: Storage, path: str, meta: ArrayMetadata):
    # The manifest's metadata as a constraint: TensorStore refuses a zarr.json whose
    # shape, dtype, chunk grid or codecs differ, so bytes are never decoded as another
    # dtype or inner-chunk layout.
    spec = {
        "driver": "zarr3",
        "kvstore": storage.kvstore_spec(f"{path}/{_format.array_dir(meta.path)}"),
        "metadata": _format.zarr_metadata(meta.shape, meta.dtype, meta.chunk_shape, meta.inner_chunk_shape),
        "open": True,
        "fill_missing_data_reads": False,
        "recheck_cached_data": False,
    }
    return ts.open(spec, context=TS_CONTEXT, read=True)


def _check_stored(store, meta: ArrayMetadata, path: str) -> None:
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


def _slabs(b: BoxRead, meta: ArrayMetadata, limit_bytes: int) -> list[BoxRead]:
    """Splits a box larger than `limit_bytes` into slabs along its first dimension.

    Each slab is planned like a box of its own (the chunk reads clipped to it), so a
    leaf larger than `max_inflight_bytes` is read in pieces, never refused.
    """
    if b.bytes_needed <= limit_bytes or not b.box.shape or b.box.shape[0] <= 1:
        return [b]
    row_bytes = b.bytes_needed // b.box.shape[0]
    rows = max(1, limit_bytes // max(1, row_bytes))
    out = []
    for start in range(0, b.box.shape[0], rows):
        n = min(rows, b.box.shape[0] - start)
        slab = Box((b.box.origin[0] + start,) + b.box.origin[1:], (n,) + b.box.shape[1:])
        reads = []
        for r in b.reads:
            region = r.box.intersect(slab)
            if region is not None:
                reads.append(plan_chunk_read(meta, r.chunk_index, region))
        out.append(BoxRead(slab, b.device_ids, tuple(reads), slab.size * meta.dtype.itemsize))
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _update(buf, piece, offsets):
    return jax.lax.dynamic_update_slice(buf, piece, offsets)


def _read_host(storage, path, meta: ArrayMetadata, b: BoxRead, store, pool) -> np.ndarray:
    if b.box.size == 0:
        return np.zeros(b.box.shape, meta.dtype)
    if store is None:
        return _read.read_box(storage, path, meta, b, pool)
    return store[b.box.slices()].read().result()


def _read_leaf(storage, path, meta: ArrayMetadata, lt: LeafTarget, lp: LeafRestorePlan, budget: _Budget, pidx: int, pool):
    """Reads every unique box of one leaf and puts it on the devices that hold it.

    Returns {device id: single-device jax.Array}, or {-1: numpy array} for a host target.
    Host memory in use stays within the budget: a box is read, cast, put on its
    devices and dropped before the next one; a box larger than the budget is read in
    slabs that are written into a donated device buffer.
    """
    store = None
    if not _read.fast_path_supported(meta.dtype):
        try:
            store = _open_for_read(storage, path, meta).result()
        except Exception as e:
            raise CorruptCheckpointError(f"{where(leaf=meta.path, path=path, process=pidx)}: cannot open the zarr array: {e}") from e
        _check_stored(store, meta, path)
    # Where each device's piece goes: the device, in the target's memory kind (so a
    # target in pinned_host memory gets host-offloaded arrays).
    devices = (
        {d.id: jax.sharding.SingleDeviceSharding(d, memory_kind=lt.sharding.memory_kind) for d in lt.sharding.addressable_devices}
        if lt.sharding is not None
        else {}
    )
    dtype = lt.dtype if lt.dtype is not None else meta.dtype
    out: dict[int, object] = {}
    for b in lp.boxes:
        # A slab in flight costs up to three copies of its bytes in host memory: the
        # file reads, the assembled host box and (on CPU) the device staging copy.
        slabs = _slabs(b, meta, budget.limit // _COPIES_IN_FLIGHT) if lt.sharding is not None else [b]
        bufs = None
        for slab in slabs:
            cost = slab.bytes_needed * _COPIES_IN_FLIGHT
            budget.acquire(cost)
            try:
                host = _read_host(storage, path, meta, slab, store, pool)
                if lt.dtype is not None:
                    with np.errstate(all="ignore"):  # the cast was asked for: NaN/overflow are not news
                        host = host.astype(lt.dtype)
                if lt.sharding is None:
                    out[-1] = host
                elif len(slabs) == 1:
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
                    offsets = tuple(o - p for o, p in zip(slab.box.origin, b.box.origin))
                    for d in b.device_ids:
                        bufs[d] = _update(bufs[d], jax.device_put(host, devices[d]), offsets)
                        bufs[d].block_until_ready()
                del host
            except (CorruptCheckpointError, MemoryError):
                raise
            except Exception as e:
                raise CorruptCheckpointError(
                    f"{where(leaf=meta.path, path=path, process=pidx)}: reading box {slab.box} failed: {e}. "
                    f"Run `checkpointer verify {path}` for a full report."
                ) from e
            finally:
                budget.release(cost)
        if bufs is not None:
            out.update(bufs)
    return out


def _assemble(meta: ArrayMetadata, lt: LeafTarget, placed: dict):
    if lt.sharding is None:
        out = placed[-1]
    else:
        devices = sorted(lt.sharding.addressable_devices, key=lambda d: d.id)
        out = jax.make_array_from_single_device_arrays(meta.shape, lt.sharding, [placed[d.id] for d in devices])
    return jax.random.wrap_key_data(out, impl=meta.key_impl) if meta.key_impl is not None else out


def _with_x64(x64: bool, fn, *args):
    with jax.enable_x64(x64):
        return fn(*args)


def _check_device_dtype(meta: ArrayMetadata, dtype: np.dtype, path: str) -> None:
    """Raises DTypeMismatchError if JAX would silently narrow `dtype` on a device (x64 off)."""
    if jax.dtypes.canonicalize_dtype(dtype) != np.dtype(dtype):
        raise DTypeMismatchError(
            f"{where(leaf=meta.path, path=path)}: the result dtype {np.dtype(dtype)} cannot live on a device while "
            f"jax_enable_x64 is off (JAX would make it {jax.dtypes.canonicalize_dtype(dtype)}). Enable x64 "
            "(jax.config.update('jax_enable_x64', True) or `with jax.enable_x64(True):`), restore it to the host "
            f"(target leaf None), or ask for the cast explicitly with a target dtype of "
            f"{jax.dtypes.canonicalize_dtype(dtype)}."
        )


def restore(path, target=None, *, partial=False, max_inflight_bytes=None):
    """Restores the committed checkpoint at `path`, onto the target's shardings.

    Args:
      path: a checkpoint path (local, `file://`, `memory://`, `gs://`, `s3://`).
      target: a pytree shaped like the saved tree (or a subset with `partial=True`)
        whose leaves are `jax.ShapeDtypeStruct` with `.sharding`, `jax.Array` (its
        sharding, shape, dtype), `jax.sharding.Sharding` (shape and dtype from the
        checkpoint) or None (a host numpy array). `target=None` restores the whole
        tree as host numpy arrays, rebuilding containers from the manifest. A target
        dtype that differs from the stored one is a cast within one kind, on the host.
      partial: if True, saved leaves absent from the target are not read.
      max_inflight_bytes: bound on bytes of reads in flight, bytes (default 1 GiB);
        a larger box is still read, alone.
    Returns:
      The restored tree, with the target's own node types (NamedTuples, dataclasses,
      `TrainState`); array leaves are `jax.Array` with the target sharding, or numpy.
    Raises:
      CheckpointNotFoundError: no committed checkpoint at `path`.
      StructureMismatchError, ShapeMismatchError, DTypeMismatchError, InvalidTargetError:
        the target does not fit (DTypeMismatchError also for a 64-bit result dtype on a
        device while jax_enable_x64 is off); the message names the leaf paths and the fix.
      CorruptCheckpointError: stored bytes or metadata are missing, malformed or fail a
        checksum; names the leaf and chunk.

    Multi-process: every process calls it with targets of the same global shardings;
    each reads only what its own devices need. No collective is run.
    """
    if max_inflight_bytes is not None and (
        isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int) or max_inflight_bytes < 1
    ):
        raise ValueError(f"max_inflight_bytes must be a positive int (bytes) or None, got {max_inflight_bytes!r}")
    storage, path = storage_for(path)
    # A checkpoint replaced (overwrite=True) or deleted (retention) while it is read
    # must not yield a mix of two saves or a false report of damage: compare the commit
    # marker before and after, and read once more if it changed.
    for _ in range(2):
        before = _marker(storage, path)
        try:
            result, ok = _restore_once(storage, path, target, partial, max_inflight_bytes), True
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
            return result
        log.warning("%s was replaced while it was being restored; reading it again", path)
    raise CheckpointError(f"{path} kept being replaced while it was being restored; try again")


def _marker(storage: Storage, path: str) -> bytes | None:
    """The commit marker's content (it names the save's generation), None if absent."""
    try:
        return storage.read_file(f"{path}/{_format.COMMITTED}")
    except (FileNotFoundError, NotADirectoryError):
        return None


def _restore_once(storage: Storage, path: str, target, partial: bool, max_inflight_bytes):
    meta = read_metadata(storage, path)
    pidx = jax.process_index()
    tdef, items, _ = build_plan(storage, path, meta, target, partial=partial, process_index=pidx, check_files=True)
    for _, m, lt, _ in items:
        if lt is not None and lt.sharding is not None and m.key_impl is None:
            _check_device_dtype(m, lt.dtype if lt.dtype is not None else m.dtype, path)
    budget = _Budget(max_inflight_bytes or DEFAULT_MAX_INFLIGHT_BYTES)
    results: dict[str, object] = {}
    # The worker threads place arrays on devices: they must see the caller's
    # jax_enable_x64 (a `with jax.enable_x64(...)` block is thread-local).
    read_leaf = functools.partial(_with_x64, jax.config.jax_enable_x64, _read_leaf)

    workers = max(4, 2 * (os.cpu_count() or 2))
    with concurrent.futures.ThreadPoolExecutor(workers) as leaf_pool, concurrent.futures.ThreadPoolExecutor(workers) as chunk_pool:
        futures = {}
        for p, m, lt, lp in items:
            if isinstance(m, ValueMetadata):
                results[p] = m.value
            else:
                futures[p] = leaf_pool.submit(read_leaf, storage, path, m, lt, lp, budget, pidx, chunk_pool)
        for p, m, lt, _ in items:
            if p in futures:
                results[p] = _assemble(m, lt, futures[p].result())
    if tdef is None:
        return rebuild(meta.structure, lambda p: results[p], where=path)
    return jax.tree_util.tree_unflatten(tdef, [results[p] for p, _, _, _ in items])


def plan_restore(path, target, *, process_index=None, partial=False) -> RestorePlan:
    """Plans a restore without touching devices or chunk data.

    Args:
      path: a checkpoint path.
      target: as for `restore`.
      process_index: plan for this process (default: the caller's). The target's
        shardings decide which devices belong to it.
      partial: as for `restore`.
    Returns:
      A `RestorePlan`: per leaf and unique target box, the chunks, inner chunks and
      bytes to read; `.bytes_needed`, `.bytes_read`, `.read_amplification`; `print()` it
      for a table.
    Raises:
      As `restore`, for metadata and target mismatches.

    Multi-process: pure; any process may call it alone.
    """
    storage, path = storage_for(path)
    meta = read_metadata(storage, path)
    pidx = jax.process_index() if process_index is None else process_index
    return build_plan(storage, path, meta, target, partial=partial, process_index=pidx)[2]
