"""`plan_save`: the save plan of a tree (or an abstract tree), for any process count.

Turns each array leaf's sharding into the save planner's input (every device's shard,
with its process) and runs `_save_plan` exactly as a save does, without devices, disk or
the other processes. Device→process rule with `processes=P` (as `plan_restore`): the
mesh's devices in mesh order, consecutive blocks of `n_devices // P` per process.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from .. import _coord, _encoding
from .._errors import MeshError, UnsupportedValueError, where
from .._format import Box, flatten, named_shard_boxes
from ._plan import SPLIT_FLOOR_BYTES, LeafShards, SavePlan, ShardInfo, plan_writes, summarize


def _shards(sharding: jax.sharding.Sharding, shape: tuple[int, ...], processes: int | None, leaf: str) -> tuple[ShardInfo, ...]:
    """Every device's shard of `sharding` on `shape`, replica ids in device order."""
    abstract = isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh)
    if isinstance(sharding, NamedSharding):
        n = math.prod(sharding.mesh.axis_sizes)
        try:
            boxes = named_shard_boxes(shape, sharding.mesh.shape, sharding.spec)
        except ValueError as e:
            raise UnsupportedValueError(f"{where(leaf=leaf)}: the sharding {sharding.spec} does not fit shape {shape}: {e}") from e
        devices: list[Any] = list(range(n)) if abstract else list(sharding.mesh.devices.flat)
    else:
        index_map = sharding.devices_indices_map(shape)
        devices = list(index_map)
        n = len(devices)
        boxes = [Box.from_index(index_map[d], shape) for d in devices]
    if processes is None:
        if abstract:
            raise MeshError(f"{where(leaf=leaf)}: the sharding is over an abstract mesh; give the process count (processes=P)")
        owners = [d.process_index for d in devices]
    else:
        if processes < 1 or n % processes:
            raise MeshError(f"{where(leaf=leaf)}: {processes} processes do not divide the sharding's {n} devices; choose a divisor")
        owners = [i // (n // processes) for i in range(n)]
    ids = devices if abstract else [d.id for d in devices]
    seen: dict[Box, int] = {}
    out = []
    for device_id, owner, box in zip(ids, owners, boxes):
        rid = seen.get(box, 0)
        seen[box] = rid + 1
        out.append(ShardInfo(box, device_id, owner, rid))
    return tuple(out)


def _key_data(dtype) -> jax.ShapeDtypeStruct | None:
    """The key data of one PRNG key of `dtype` (None for other dtypes)."""
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))


def _key_tail(dtype) -> tuple[int, ...]:
    """The trailing key-data dimensions of a PRNG key dtype (() for other dtypes)."""
    data = _key_data(dtype)
    return () if data is None else tuple(data.shape)


def _storage_dtype(dtype) -> np.dtype:
    data = _key_data(dtype)
    return np.dtype(dtype if data is None else data.dtype)


def _storage_itemsize(dtype) -> int:
    return _storage_dtype(dtype).itemsize


def plan_save(
    tree_or_abstract: object, *, processes: int | None = None, split_floor_bytes: int = SPLIT_FLOOR_BYTES,
    pack_small_leaves_bytes: int | None = None,
) -> SavePlan:
    """Shows which process writes which bytes when `tree_or_abstract` is saved.

    Args:
      tree_or_abstract: the state to save, or its abstract form: array leaves are
        `jax.Array`s, numpy arrays (written by process 0), or `jax.ShapeDtypeStruct`s with
        a sharding (a `NamedSharding` over a concrete or an `AbstractMesh`; without one, a
        host array). Other leaves are values and write nothing.
      processes: plan as if the shardings' devices were spread over this many processes
        in mesh order (consecutive blocks); None: each device's own `process_index`
        (needed for concrete shardings only).
      split_floor_bytes: the smallest chunk a replica-parallel split may produce, bytes
        (what `save` uses by default).
      pack_small_leaves_bytes: as for `save` (None: its default): chunks of packed
        leaves count into one pack file per writing process.
    Returns:
      The SavePlan: per leaf the chunk grid and each chunk's writer; per process the
      bytes and files it writes.
    Raises:
      MeshError: an abstract mesh without `processes`, or `processes` not dividing a
        sharding's device count.
      UnsupportedValueError: a sharding does not fit its leaf's shape.

    Multi-process: pure; any process may call it, alone.
    """
    pack_bytes = _encoding.check_threshold(pack_small_leaves_bytes)
    leaves: list[LeafShards] = []
    dtypes: list[np.dtype] = []
    cache: dict = {}
    for leaf_path, leaf in flatten(tree_or_abstract):
        if isinstance(leaf, np.ndarray) or (isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None):
            shape = tuple(leaf.shape) + _key_tail(leaf.dtype)
            itemsize = _storage_itemsize(leaf.dtype)
            leaves.append(LeafShards(leaf_path, shape, itemsize, shape, (ShardInfo(Box.whole(shape), -1, 0, 0),)))
            dtypes.append(_storage_dtype(leaf.dtype))
            continue
        if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            continue
        sharding = leaf.sharding
        shape = tuple(leaf.shape)
        key = (sharding, shape)
        if key not in cache:
            cache[key] = _shards(sharding, shape, processes, leaf_path)
        shards = cache[key]
        tail = _key_tail(leaf.dtype)
        if tail:  # key data: the trailing dimensions are whole in every shard
            shards = tuple(
                ShardInfo(Box(s.box.origin + (0,) * len(tail), s.box.shape + tail), s.device_id, s.process_index, s.replica_id)
                for s in shards
            )
        shard_shape = tuple(sharding.shard_shape(shape)) + tail
        leaves.append(LeafShards(leaf_path, shape + tail, _storage_itemsize(leaf.dtype), shard_shape, shards))
        dtypes.append(_storage_dtype(leaf.dtype))
    assignments = plan_writes(leaves, split_floor_bytes=split_floor_bytes)
    if processes is None:
        owners = max((s.process_index + 1 for leaf in leaves for s in leaf.shards), default=1)
        processes = max(_coord.process_count(), owners)
    packed = [_encoding.packs_leaf(leaf.shape, a.chunk_shape, dt, pack_bytes) for leaf, a, dt in zip(leaves, assignments, dtypes)]
    return summarize(assignments, processes, packed)
