"""Restore from safetensors onto any mesh (`restore_safetensors`): a single file or a
Hugging Face sharded folder, each process reading only the byte ranges its devices need.

Each target leaf is named (its keys joined by `separator`, or `name_fn`), matched to a
tensor of the files' headers (`_safetensors_files`), and resolved as a stored leaf
would be (`resolve_target`: shape, dtype cast, sharding; `device_boxes`: this
process's boxes). A tensor is one C-order byte range, so a box is a set of equal row
runs (`box_runs`); the runs of a box, or of each slab of it (`row_slabs`, within
`max_inflight_bytes`), are read with the storage's ranged reader into one
host buffer, the runs of all the leaf's boxes together (`_read_boxes`: runs side by
side in the file are one request, small gaps are read and thrown away within
`max_over_read_ratio`), then put on the devices that hold the box, as the restore
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
from .._storage import (
    DEFAULT_MAX_OVER_READ_RATIO,
    DEFAULT_READ_CHUNK_BYTES,
    Reader,
    Storage,
    coalesce_ranges as _coalesce,
    storage_for,
)
from . import _safetensors_files as _files
from ._matching import _is_target_leaf
from ._options import RestoreOptions
from ._pipeline import _COPIES_IN_FLIGHT, DEFAULT_MAX_INFLIGHT_BYTES, _Budget, _check_device_dtype
from ._safetensors_files import TensorEntry
from ._targets import LeafTarget, device_boxes, resolve_target

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
    max_over_read_ratio: float = DEFAULT_MAX_OVER_READ_RATIO,
    read_chunk_bytes: int | None = None,
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
      max_over_read_ratio: bound on bytes read over bytes needed (>= 1; default 1.05):
        the row runs of a leaf's boxes (column blocks side by side in the file) are
        fetched together, and a gap between them is read (and thrown away) when it
        costs less than another request would, within this ratio of each leaf's bytes.
      read_chunk_bytes: bound on one request that gathers several runs, bytes (default:
        4 MiB for local files, 16 MiB for object stores).
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
      ValueError: `max_inflight_bytes` or `read_chunk_bytes` is not a positive int or
        None, or `max_over_read_ratio` is not a number >= 1.

    Host memory: the restored host leaves, plus at most about `max_inflight_bytes` of
    reads in flight.
    Multi-process: every process calls it with targets of the same global shardings;
    each reads only the bytes of its own devices' boxes (a box that devices of several
    processes hold is read by each of them). No collective: processes do not wait for
    each other.
    """
    options = RestoreOptions(partial=partial, max_inflight_bytes=max_inflight_bytes, max_over_read_ratio=max_over_read_ratio,
                             read_chunk_bytes=read_chunk_bytes)
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


_local = threading.local()


def _staging(n: int) -> np.ndarray:
    """A reusable per-thread buffer of at least `n` bytes for coalesced reads (no
    zero-fill, no page faults after the first use)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = np.empty(max(n, 1 << 20), np.uint8)
        _local.buf = buf
    return buf[:n]


@dataclasses.dataclass(frozen=True)
class _Requests:
    """How one reader's requests are made: the options' bounds and the reader's cost."""

    max_over_read_ratio: float
    read_chunk_bytes: int
    request_cost_bytes: int

    @classmethod
    def of(cls, options: RestoreOptions, reader: Reader) -> _Requests:
        chunk = options.read_chunk_bytes or max(DEFAULT_READ_CHUNK_BYTES, reader.run_bytes)
        return cls(options.max_over_read_ratio, chunk, reader.request_cost_bytes)


def _read_boxes(reader: Reader, e: TensorEntry, boxes: Sequence[Box], counter: _Counter, how: _Requests) -> list[np.ndarray]:
    """The elements of each of `boxes` of tensor `e`, read from its file together.

    Every box is a set of equal runs (`box_runs`); the runs of all boxes are sorted by
    file offset and grouped into requests (`coalesce_ranges`: the runs of boxes side by
    side, such as the column blocks of one row, are one range; small gaps are read and
    thrown away within `max_over_read_ratio`). A request that is one contiguous part of
    one box is read straight into it, in reads of at most `read_chunk_bytes`; any other
    is read into a staging buffer and copied out, one strided copy per box and stretch
    of equally spaced runs.
    """
    item = e.dtype.itemsize
    outs = [host_buffer(box.shape, e.dtype) for box in boxes]
    flat = [o.reshape(-1).view(np.uint8) for o in outs]
    parts = []
    for k, box in enumerate(boxes):
        if box.size == 0:
            continue
        run, starts = _files.box_runs(box, e.shape)
        n = len(starts)
        parts.append((starts * item + e.offset_bytes, np.full(n, run * item, np.int64), np.full(n, k, np.int64),
                      np.arange(n, dtype=np.int64) * (run * item)))
    if not parts:
        return outs
    file_at, length, owner, dest_at = (np.concatenate(c) for c in zip(*parts))
    order = np.argsort(file_at, kind="stable")
    file_at, length, owner, dest_at = file_at[order], length[order], owner[order], dest_at[order]
    end = file_at + length
    first = _coalesce(file_at, end, request_cost_bytes=how.request_cost_bytes,
                      max_over_read_ratio=how.max_over_read_ratio, read_chunk_bytes=how.read_chunk_bytes)
    request = np.zeros(len(file_at), np.int64)
    request[first[1:]] = 1
    request = np.cumsum(request)
    # Within each request, each box's runs in file (= destination) order; a stretch is a
    # maximal sequence of one request and box with equally spaced runs that land one
    # after another in the box.
    order = np.lexsort((file_at, owner, request))
    f, ln, ow, d, rq = file_at[order], length[order], owner[order], dest_at[order], request[order]
    step = np.zeros(len(f), np.int64)
    step[1:] = f[1:] - f[:-1]
    cut = np.ones(len(f), bool)
    cut[1:] = (rq[1:] != rq[:-1]) | (ow[1:] != ow[:-1]) | (d[1:] != d[:-1] + ln[:-1])
    cut[2:] |= step[2:] != step[1:-1]
    stretch = np.flatnonzero(cut)
    stretch_end = np.append(stretch[1:], len(f))
    by_request = np.searchsorted(rq[stretch], np.arange(len(first) + 1))
    spans_end = np.maximum.reduceat(end, first)
    for r in range(len(first)):
        lo, hi = int(file_at[first[r]]), int(spans_end[r])
        mine = range(by_request[r], by_request[r + 1])
        if len(mine) == 1:
            s0, s1 = int(stretch[mine[0]]), int(stretch_end[mine[0]])
            if s1 - s0 == 1 or int(step[s0 + 1]) == int(ln[s0]):  # one contiguous part of one box
                dest = flat[int(ow[s0])][int(d[s0]) : int(d[s0]) + hi - lo]
                for at in range(0, hi - lo, how.read_chunk_bytes):
                    piece = dest[at : at + how.read_chunk_bytes]
                    reader.read_into(lo + at, piece.data)
                    counter.add(len(piece))
                continue
        staged = _staging(hi - lo)
        reader.read_into(lo, staged.data)
        counter.add(hi - lo)
        for m in mine:
            s0, s1 = int(stretch[m]), int(stretch_end[m])
            count, run = s1 - s0, int(ln[s0])
            stride = int(step[s0 + 1]) if count > 1 else run
            src = np.lib.stride_tricks.as_strided(staged[int(f[s0]) - lo :], (count, run), (stride, 1), writeable=False)
            dst = flat[int(ow[s0])][int(d[s0]) : int(d[s0]) + count * run].reshape(count, run)
            np.copyto(dst, src)
    if sys.byteorder == "big" and e.dtype.itemsize > 1:  # the file is little-endian
        for out in outs:
            out.byteswap(inplace=True)
    return outs


def _rounds(leaf: _Leaf, item: int, slab_bytes: int, sliced: bool) -> list[list[tuple[int, Box, bool]]]:
    """The reads of one leaf, in rounds of at most about `slab_bytes`: per round, per box
    read, `(index in leaf.boxes, box or slab, whether it is a slab)`.

    Boxes that are each one contiguous range of the file are read one per round (a box
    larger than `slab_bytes` in slabs of rows, as `restore` does). Boxes made of many
    runs (a column-sharded tensor: each row's blocks side by side in the file) are read
    together, so that their runs coalesce into few requests: all in one round when they
    fit, else slab `k` of every box in round `k`.
    """
    boxes = [b for b, _ in leaf.boxes]
    nbytes = [b.size * item for b in boxes]
    if not sliced:  # a host leaf: the whole tensor at once
        return [[(0, boxes[0], False)]]
    strided = len(boxes) > 1 and any(len(_files.box_runs(b, leaf.entry.shape)[1]) > 1 for b in boxes if b.size)
    if not strided:
        out = []
        for k, b in enumerate(boxes):
            slabs = row_slabs(b, item, slab_bytes) if b.size else [b]
            out += [[(k, s, len(slabs) > 1)] for s in slabs]
        return out
    if sum(nbytes) <= slab_bytes:
        return [[(k, b, False) for k, b in enumerate(boxes)]]
    per = [row_slabs(b, item, max(1, slab_bytes // len(boxes))) if b.size else [b] for b in boxes]
    return [[(k, s[r], len(s) > 1) for k, s in enumerate(per) if r < len(s)] for r in range(max(len(s) for s in per))]


def _read_leaf(storage: Storage, leaf: _Leaf, budget: _Budget, slab_bytes: int, counter: _Counter, options: RestoreOptions) -> object:
    """Reads one leaf's boxes and places them; returns its restored value."""
    e, lt = leaf.entry, leaf.target
    sharding = lt.sharding
    devices: dict[int, jax.sharding.Sharding] = {}
    if sharding is not None:
        addressable: set[Any] = sharding.addressable_devices  # Any: no Device stubs
        devices = {d.id: jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind) for d in addressable}
    dtype = lt.dtype if lt.dtype is not None else e.dtype
    placed: dict[int, Any] = {}
    bufs: dict[int, dict[int, Any]] = {}  # box index -> device id -> device buffer of a box read in slabs
    try:
        reader = storage.open_reader(e.file)
    except FileNotFoundError as err:
        raise CorruptCheckpointError(f"{e.file} (tensor {e.name!r}) vanished while it was being restored") from err
    with reader:
        how = _Requests.of(options, reader)
        for group in _rounds(leaf, e.dtype.itemsize, slab_bytes, sharding is not None):
            cost = max(1, sum(s.size for _, s, _ in group) * e.dtype.itemsize) * _COPIES_IN_FLIGHT
            budget.acquire(cost)
            try:
                try:
                    hosts = _read_boxes(reader, e, [s for _, s, _ in group], counter, how)
                except EOFError as err:
                    raise CorruptCheckpointError(f"{e.file}: tensor {e.name!r} ends early ({err}). Download it again.") from err
                for (k, slab, is_slab), host in zip(group, hosts, strict=True):
                    if lt.dtype is not None:
                        with np.errstate(all="ignore"):  # the cast was asked for
                            host = host.astype(lt.dtype)
                    if sharding is None:
                        return host
                    box, ids = leaf.boxes[k]
                    if not is_slab:
                        first, *rest = ids
                        placed[first] = jax.device_put(host, devices[first])
                        for d in rest:
                            placed[d] = jax.device_put(placed[first], devices[d])
                    else:
                        mine = bufs.setdefault(k, {})
                        if not mine:
                            mine.update({d: jnp.zeros(box.shape, dtype, device=devices[d]) for d in ids})
                        offsets = tuple(s.start for s in slab.relative_to(box))
                        for d in ids:
                            mine[d] = _update(mine[d], jax.device_put(host, devices[d]), offsets)
                            mine[d].block_until_ready()
                del hosts
            finally:
                budget.release(cost)
    for mine in bufs.values():
        placed.update(mine)
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
        futures = {leaf.index: pool.submit(_with_x64, x64, _read_leaf, storage, leaf, budget, slab_bytes, counter, options) for leaf in leaves}
        try:
            results = {i: f.result() for i, f in futures.items()}
        finally:
            for f in futures.values():
                f.cancel()
    stats.bytes_read += counter.bytes
    stats.chunk_reads += counter.reads
    return results
