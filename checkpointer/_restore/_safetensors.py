"""Restore from safetensors onto any mesh (`restore_safetensors`): a single file or a
Hugging Face sharded folder, each process reading only the byte ranges its devices need.

Each target leaf is named (its keys joined by `separator`, or `name_fn`), matched to a
tensor of the files' headers (`_safetensors_files`), and resolved as a stored leaf
would be (`resolve_target`: shape, dtype cast, sharding; `device_boxes`: this
process's boxes). A tensor is one C-order byte range, so a box is a set of equal row
runs (`box_runs`); the runs of a box, or of each slab of it (`row_slabs`, within
`max_inflight_bytes`), are read with the storage's ranged reader straight into one
host buffer (a scatter read: small gaps between runs go to a scratch buffer, within
3% of the bytes needed), then put on the devices that hold the box, as the restore
pipeline does for a zarr leaf.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .._encoding import RestoreStats
from .._errors import CorruptCheckpointError, InvalidTargetError, StructureMismatchError
from .._format import ArrayMetadata, Box, PyTree, row_slabs
from .._memory import host_buffer
from .._storage import Reader, Storage, storage_for
from . import _safetensors_files as _files
from ._matching import _is_target_leaf
from ._options import RestoreOptions
from ._pipeline import _COPIES_IN_FLIGHT, DEFAULT_MAX_INFLIGHT_BYTES, _Budget, _check_device_dtype
from ._safetensors_files import TensorEntry
from ._targets import LeafTarget, device_boxes, resolve_target

# A gap between two runs of a box is read (into scratch) when it is at most this many
# bytes and all such gaps of the box stay within `_WASTE_FRACTION` of its bytes.
_MAX_GAP_BYTES = 64 << 10
_WASTE_FRACTION = 0.03

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One target leaf: its position, tensor and resolved target."""

    index: int
    keystr: str
    entry: TensorEntry
    target: LeafTarget
    meta: ArrayMetadata
    boxes: tuple[tuple[Box, tuple[int, ...]], ...]  # (box, device ids), this process's unique boxes


def _key_text(key: object) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def default_name(key_path: Sequence[object], separator: str = ".") -> str:
    """The tensor name of a target leaf: its keys joined by `separator` (dict keys as
    text, list indices as numbers, attribute names), as `ckpt.export` names them."""
    return separator.join(_key_text(k) for k in key_path)


def restore_safetensors(
    path: str | os.PathLike,
    target: object,
    *,
    separator: str = ".",
    name_fn: Callable[[tuple[Any, ...]], str] | None = None,
    partial: bool = False,
    max_inflight_bytes: int | None = None,
) -> PyTree:
    """Restores the tensors of a safetensors file or a Hugging Face sharded folder onto
    the target's shardings.

    Args:
      path: a `.safetensors` file, a folder with `model.safetensors.index.json` (the
        files it names) or `model.safetensors`, or the index itself; local, `file://`,
        `gs://`, `s3://` or `memory://`.
      target: a pytree whose leaves are `jax.ShapeDtypeStruct` with `.sharding`,
        `jax.Array`, `jax.sharding.Sharding` (shape and dtype from the file) or None / a
        numpy array (a host numpy array), as for `ckpt.restore`; each leaf is named by
        its keys joined by `separator` (`{"model": {"embed": w}}` reads `model.embed`;
        list indices are numbers) and shapes are the tensors' shapes (elements per
        dimension). A target dtype that differs from the stored one is a cast within
        one kind. Two leaves may name one tensor (tied weights).
      separator: joins a leaf's keys into its tensor name.
      name_fn: the tensor name of a leaf from its key path (the tuple of JAX keys
        `jax.tree_util.tree_flatten_with_path` gives), instead of joining.
      partial: tensors of the files the target does not name are not read (else
        StructureMismatchError).
      max_inflight_bytes: bound on host bytes of reads in flight (default 1 GiB); a
        larger box is read in slabs of rows, one row at least.
    Returns:
      The target's tree with every leaf restored: a `jax.Array` on the target
      sharding, or a numpy array for a host leaf.
    Raises:
      StructureMismatchError: a target leaf names no tensor of the files, or (without
        `partial`) a tensor no leaf names; names the tensors, the files and the fix.
      ShapeMismatchError, DTypeMismatchError, InvalidTargetError: a leaf does not fit
        its tensor; names the leaf, the tensor and the file.
      CorruptCheckpointError: a header is malformed or disagrees with its file's size,
        or the index disagrees with the files; names the file and the tensor.
      UnsupportedValueError: a tensor to read has a packed sub-byte dtype (F4, F6).
      InvalidTargetError: also for a `name_fn` that returns no str.
      FileNotFoundError: no safetensors file at `path`.
      ValueError: `max_inflight_bytes` is not a positive int or None.

    Host memory: the restored host leaves, plus at most about `max_inflight_bytes` of
    reads in flight.
    Multi-process: every process calls it with targets of the same global shardings;
    each reads only the bytes of its own devices' boxes (a box that devices of several
    processes hold is read by each of them). No collective: processes do not wait for
    each other.
    """
    options = RestoreOptions(partial=partial, max_inflight_bytes=max_inflight_bytes)
    storage, location = storage_for(path)
    return read_safetensors(storage, location, target, options, separator=separator, name_fn=name_fn)


def read_safetensors(
    storage: Storage,
    path: str,
    target: object,
    options: RestoreOptions,
    *,
    separator: str = ".",
    name_fn: Callable[[tuple[Any, ...]], str] | None = None,
    stats: RestoreStats | None = None,
) -> PyTree:
    """`restore_safetensors` of `path` through `storage`, filling `stats` (bytes read:
    headers, index and data; reads; seconds). Result and errors as there.

    Multi-process: as `restore_safetensors`.
    """
    t0 = time.perf_counter()
    stats = RestoreStats() if stats is None else stats
    counter = [0]
    files, weight_map, index = _files.files_of(storage, path, counter)
    entries: dict[str, TensorEntry] = {}
    packed: dict[str, tuple[str, str]] = {}
    packed_files: dict[str, str] = {}
    for file in files:
        try:
            found, found_packed = _files.read_file_header(storage, file, counter)
        except FileNotFoundError as e:
            if weight_map is None:
                raise
            name = next(n for n, f in weight_map.items() if f == file)
            raise CorruptCheckpointError(f"{index} maps tensor {name!r} to {file}, which does not exist. Download the "
                                         "model again.") from e
        for name in (*found, *found_packed):
            if name in entries or name in packed:
                raise CorruptCheckpointError(
                    f"tensor {name!r} is in both {entries[name].file if name in entries else packed_files[name]} and {file}; "
                    "a model's files hold each tensor once. Download the model again."
                )
        entries.update(found)
        packed.update(found_packed)
        packed_files.update({n: file for n in found_packed})
    if weight_map is not None and index is not None:
        _files.check_index(weight_map, entries, packed_files, index)
    shown = path if len(files) == 1 else f"{path} ({len(files)} files)"
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_target_leaf)
    leaves = _resolve(flat, entries, packed, packed_files, shown, separator, name_fn, options.partial)
    results = _read_leaves(storage, leaves, options, counter, stats)
    stats.bytes_read += counter[0]
    stats.elapsed_s = time.perf_counter() - t0
    return jax.tree_util.tree_unflatten(treedef, [results[i] for i in range(len(flat))])


def _resolve(
    flat: list[tuple[Any, object]], entries: dict[str, TensorEntry], packed: dict[str, tuple[str, str]],
    packed_files: dict[str, str], shown: str, separator: str, name_fn: Callable[[tuple[Any, ...]], str] | None, partial: bool,
) -> list[_Leaf]:
    """Names every target leaf, checks the names against the files' tensors and resolves
    each leaf (shape, dtype, sharding, this process's boxes)."""
    named = []
    for i, (key_path, leaf) in enumerate(flat):
        name = name_fn(tuple(key_path)) if name_fn is not None else default_name(key_path, separator)
        if not isinstance(name, str):
            raise InvalidTargetError(
                f"name_fn returned {name!r} for the target leaf {jax.tree_util.keystr(tuple(key_path)) or '<root>'}; it must "
                "return the tensor name, a str"
            )
        named.append((i, jax.tree_util.keystr(tuple(key_path)), name, leaf))
    stored = set(entries) | set(packed)
    missing = [(ks, name) for _, ks, name, _ in named if name not in stored]
    extra = sorted(stored - {name for _, _, name, _ in named})
    if missing or (extra and not partial):
        msg = [f"the target does not match the tensors of {shown}:"]
        if missing:
            msg.append(f"  target leaves naming no tensor: {_show([(ks or '<root>') + f' -> {n!r}' for ks, n in missing])}")
            msg.append(f"  the files hold: {_show(sorted(stored))}")
        if extra and not partial:
            msg.append(f"  tensors no target leaf names: {_show(extra)}")
        fixes = []
        if missing:
            fixes.append(f"name the leaves as the files do (separator={separator!r} joins the keys; name_fn=... maps a key "
                         "path to a name)")
        if extra and not partial:
            fixes.append("pass partial=True to leave the other tensors unread")
        msg.append("Fix: " + "; ".join(fixes) + ".")
        raise StructureMismatchError("\n".join(msg))
    pidx = jax.process_index()
    out = []
    for i, ks, name, leaf in named:
        if name in packed:
            _files.check_readable(name, packed, packed_files[name])
        e = entries[name]
        meta = ArrayMetadata(name, e.shape, e.dtype, e.shape, e.shape, None, keystr=f"{ks or '<root>'} (tensor {name!r})")
        lt = resolve_target(meta, leaf, e.file)
        if lt.sharding is not None:
            _check_device_dtype(meta, lt.dtype if lt.dtype is not None else meta.dtype, e.file)
        by_box: dict[Box, list[int]] = {}
        for d, box in device_boxes(lt, meta, pidx, path=e.file):
            by_box.setdefault(box, []).append(d)
        out.append(_Leaf(i, ks, e, lt, meta, tuple((b, tuple(ds)) for b, ds in by_box.items())))
    return out


def _show(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


@functools.partial(jax.jit, donate_argnums=0)
def _update(buf: jax.Array, piece: jax.Array, offsets: tuple[int, ...]) -> jax.Array:
    return jax.lax.dynamic_update_slice(buf, piece, offsets)


class _Counter:
    def __init__(self) -> None:
        self.bytes, self.reads, self.lock = 0, 0, threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes += n
            self.reads += 1


def _read_box(reader: Reader, e: TensorEntry, box: Box, counter: _Counter) -> np.ndarray:
    """The box's elements of tensor `e`, read from its file (only the box's runs and the
    small gaps between them)."""
    out = host_buffer(box.shape, e.dtype)
    if box.size == 0:
        return out
    item = e.dtype.itemsize
    run, starts = _files.box_runs(box, e.shape)
    run_bytes = run * item
    starts_bytes = starts * item + e.offset_bytes
    dest = memoryview(out.reshape(-1).view(np.uint8).data)
    waste = int(box.size * item * _WASTE_FRACTION)
    groups = _files.coalesce(starts_bytes, run_bytes, min(_MAX_GAP_BYTES, waste), waste)
    scratch = memoryview(bytearray(min(_MAX_GAP_BYTES, waste))) if len(groups) < len(starts) else None
    for first, count in groups:
        if count == 1:
            reader.read_into(int(starts_bytes[first]), dest[first * run_bytes : (first + 1) * run_bytes])
            counter.add(run_bytes)
            continue
        assert scratch is not None
        bufs: list[memoryview] = []
        for k in range(first, first + count):
            if k > first:
                gap = int(starts_bytes[k] - starts_bytes[k - 1]) - run_bytes
                if gap:
                    bufs.append(scratch[:gap])
            bufs.append(dest[k * run_bytes : (k + 1) * run_bytes])
        span = int(starts_bytes[first + count - 1] - starts_bytes[first]) + run_bytes
        reader.read_into_buffers(int(starts_bytes[first]), bufs)
        counter.add(span)
    if sys.byteorder == "big" and out.dtype.itemsize > 1:  # the file is little-endian
        out.byteswap(inplace=True)
    return out


def _read_leaf(storage: Storage, leaf: _Leaf, budget: _Budget, slab_bytes: int, counter: _Counter) -> object:
    """Reads one leaf's boxes and places them; returns its restored value."""
    e, lt = leaf.entry, leaf.target
    sharding = lt.sharding
    devices: dict[int, jax.sharding.Sharding] = {}
    if sharding is not None:
        addressable: set[Any] = sharding.addressable_devices  # Any: no Device stubs
        devices = {d.id: jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind) for d in addressable}
    dtype = lt.dtype if lt.dtype is not None else e.dtype
    placed: dict[int, Any] = {}
    try:
        reader = storage.open_reader(e.file)
    except FileNotFoundError as err:
        raise CorruptCheckpointError(f"{e.file} (tensor {e.name!r}) vanished while it was being restored") from err
    with reader:
        for box, ids in leaf.boxes:
            # A host leaf is the whole tensor, in one buffer: it is the result.
            slabs = row_slabs(box, e.dtype.itemsize, slab_bytes) if box.size and sharding is not None else [box]
            bufs: dict[int, Any] | None = None
            for slab in slabs:
                cost = max(1, slab.size * e.dtype.itemsize) * _COPIES_IN_FLIGHT
                budget.acquire(cost)
                try:
                    try:
                        host = _read_box(reader, e, slab, counter)
                    except EOFError as err:
                        raise CorruptCheckpointError(f"{e.file}: tensor {e.name!r} ends early ({err}). Download it again.") from err
                    if lt.dtype is not None:
                        with np.errstate(all="ignore"):  # the cast was asked for
                            host = host.astype(lt.dtype)
                    if sharding is None:
                        return host
                    if len(slabs) == 1:
                        first, *rest = ids
                        placed[first] = jax.device_put(host, devices[first])
                        for d in rest:
                            placed[d] = jax.device_put(placed[first], devices[d])
                    else:
                        if bufs is None:
                            bufs = {d: jnp.zeros(box.shape, dtype, device=devices[d]) for d in ids}
                        offsets = tuple(s.start for s in slab.relative_to(box))
                        for d in ids:
                            bufs[d] = _update(bufs[d], jax.device_put(host, devices[d]), offsets)
                            bufs[d].block_until_ready()
                    del host
                finally:
                    budget.release(cost)
            if bufs is not None:
                placed.update(bufs)
    assert sharding is not None
    every: set[Any] = sharding.addressable_devices  # Any: no Device stubs
    ordered = sorted(every, key=lambda d: d.id)
    return jax.make_array_from_single_device_arrays(lt.shape, sharding, [placed[d.id] for d in ordered])


def _with_x64(x64: bool, fn: Callable[..., _T], *args: object) -> _T:
    with jax.enable_x64(x64):
        return fn(*args)


def _read_leaves(storage: Storage, leaves: list[_Leaf], options: RestoreOptions, header_bytes: list[int], stats: RestoreStats) -> dict[int, object]:
    """Every leaf's value by its position, read on worker threads within the budget."""
    budget = _Budget(options.max_inflight_bytes or DEFAULT_MAX_INFLIGHT_BYTES)
    slab_bytes = max(1, budget.limit // _COPIES_IN_FLIGHT)
    counter = _Counter()
    x64 = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]  # worker threads see the caller's x64
    workers = max(4, 2 * (os.cpu_count() or 2))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {leaf.index: pool.submit(_with_x64, x64, _read_leaf, storage, leaf, budget, slab_bytes, counter) for leaf in leaves}
        try:
            results = {i: f.result() for i, f in futures.items()}
        finally:
            for f in futures.values():
                f.cancel()
    stats.bytes_read += counter.bytes
    stats.chunk_reads += counter.reads
    return results
