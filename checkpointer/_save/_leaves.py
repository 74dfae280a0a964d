"""A tree's array leaves as the save planner sees them: whether the format can store a
leaf, its saved sharding, every device's shard on every process (from the sharding's
global device map), and the data of one planned chunk (a device-side slice of a shard
for replica-parallel splits, so only the chunk's bytes are copied to the host).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeGuard

import jax
import ml_dtypes
import numpy as np

from .. import _format
from .._errors import UnsupportedValueError, where
from .._format import Box, SavedSharding
from ._plan import ChunkWrite, LeafShards, ShardInfo


def is_array(x: object) -> TypeGuard[jax.Array | np.ndarray]:
    """Whether a leaf is an array leaf (a jax.Array or a host numpy array)."""
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


def check_storable(leaf_path: str, dtype: np.dtype, path: str) -> None:
    """Raises UnsupportedValueError unless the format can hold an array leaf of `dtype`."""
    dtype = np.dtype(dtype)
    _check_dtype(leaf_path, dtype, path)
    _check_name_lengths(leaf_path, path)


def _check_dtype(leaf_path: str, dtype: np.dtype, path: str) -> None:
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


def _check_name_lengths(leaf_path: str, path: str) -> None:
    if len(leaf_path) * 4 <= _MAX_NAME_BYTES:  # no component can be longer (UTF-8: at most 4 bytes a character)
        return
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
class ArrayLeaf:
    """One array leaf between the planning passes: the planner's input and what the
    metadata and the copies need."""

    leaf_path: str
    # The planner's input: shared by the leaves of one layout (its `leaf_path` is the
    # first such leaf's; `plan_writes` takes each leaf's path beside it).
    shards: LeafShards
    dtype: np.dtype
    saved: SavedSharding | None
    key_impl: str | None
    kind: str
    by_device: dict  # device id -> the shard's data (jax.Array or numpy)
    # (sharding or None, shape, itemsize): with the leaf path, what the plan depends on (one
    # object for the leaves of one layout).
    layout_key: tuple


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What `describe_array` derives from a jax.Array's (sharding, shape, dtype) alone,
    shared by every leaf that has the same three (a tree of thousands of small leaves
    has a handful)."""

    saved: SavedSharding
    key_impl: str | None
    dtype: np.dtype  # stored (a PRNG key's data dtype)
    shape: tuple[int, ...]  # stored (a PRNG key's data shape)
    sharding: jax.sharding.Sharding  # of the stored data
    shard_shape: tuple[int, ...]
    shards: tuple[ShardInfo, ...]
    # The one device of a single-device sharding, when it is this process's: the leaf's
    # (stored) data is its only shard (no `addressable_shards`, which builds a new array).
    single_device: int | None
    multi_device: bool
    key: tuple  # `ArrayLeaf.layout_key`
    spec: LeafShards  # the first leaf's, shared by all (`ArrayLeaf.shards`)



def _layout_of(leaf_path: str, arr: jax.Array, path: str, cache: dict) -> _Layout:
    key_impl = None
    saved = _saved_sharding(arr)
    if jax.dtypes.issubdtype(arr.dtype, jax.dtypes.prng_key):
        key_impl = str(jax.random.key_impl(arr))
        arr = jax.random.key_data(arr)
    dtype = np.dtype(arr.dtype)
    _check_dtype(leaf_path, dtype, path)
    sharding, shape = arr.sharding, tuple(arr.shape)
    key = (sharding, shape)
    if key not in cache:
        cache[key] = _global_shards(sharding, shape)
    devices = sharding.device_set
    single = None
    if len(devices) == 1:
        device: Any  # no Device stubs
        (device,) = devices
        if sharding.is_fully_addressable:
            single = device.id
    shard_shape = tuple(sharding.shard_shape(shape))
    return _Layout(saved, key_impl, dtype, shape, sharding, shard_shape, cache[key], single, len(devices) > 1,
                   (sharding, shape, dtype.itemsize), LeafShards(leaf_path, shape, dtype.itemsize, shard_shape, cache[key]))


def describe_array(leaf_path: str, arr: jax.Array | np.ndarray, pidx: int, path: str, cache: dict) -> ArrayLeaf:
    """The planner's input for one array leaf; `cache` holds what leaves of one
    (sharding, shape, dtype) share (global shards, saved sharding, checked dtype)."""
    if isinstance(arr, np.ndarray):
        check_storable(leaf_path, arr.dtype, path)
        if not arr.dtype.isnative:  # e.g. '>f4': store (and checksum) the native-order bytes
            arr = arr.astype(arr.dtype.newbyteorder("="))
        shape = arr.shape
        # A host array is process 0's (processes may hold different values).
        spec = LeafShards(leaf_path, shape, arr.dtype.itemsize, shape, (ShardInfo(Box.whole(shape), -1, 0, 0),))
        return ArrayLeaf(leaf_path, spec, arr.dtype, None, None, "numpy", {-1: arr}, (None, shape, arr.dtype.itemsize))
    if arr.is_deleted():
        raise UnsupportedValueError(
            f"{where(leaf=leaf_path, path=path, process=pidx)}: the array was deleted (donated to a jitted "
            "function?); save the state before donating it"
        )
    lkey = ("layout", arr.sharding, arr.shape, arr.dtype)  # (arrays of one device have a sharding object each)
    layout = cache.get(lkey)
    if layout is None:
        layout = cache[lkey] = _layout_of(leaf_path, arr, path, cache)
    _check_name_lengths(leaf_path, path)
    if layout.key_impl is not None:
        arr = jax.random.key_data(arr)
    if layout.single_device is not None:
        by_device = {layout.single_device: arr}
    elif layout.multi_device:
        by_device = {s.device.id: s.data for s in arr.addressable_shards}
    else:  # one device of another process
        by_device = {}
    return ArrayLeaf(leaf_path, layout.spec, layout.dtype, layout.saved, layout.key_impl, "jax", by_device, layout.key)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _slice_in_dim(x: jax.Array, start, size: int, axis: int) -> jax.Array:
    # `start` is traced: one compilation per (shard shape, dtype, chunk length, axis),
    # not one per chunk offset.
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def chunk_data(leaf: ArrayLeaf, w: ChunkWrite):
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
