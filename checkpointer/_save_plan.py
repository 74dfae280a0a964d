"""Save planning (pure): which shards each process writes, and the chunk grid.

No device work and no I/O: the inputs are plain descriptions of shards, so the rules are
tested exhaustively with hand-built shardings.

Rules:
- The chunk grid is the saved shard shape: every shard is exactly one chunk, so every
  zarr shard file has one writer.
- Of the shards holding the same box, only the one with `replica_id == 0` is written, by
  the process whose device holds it; a box replicated across processes is written once in
  total (the approach of `jax.experimental.array_serialization`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ._box import Box
from ._errors import UnsupportedValueError
from ._format import inner_chunk_shape


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One device's shard of a global array.

    Attributes:
      box: the region of the global array the shard holds.
      device_id: the JAX device id.
      process_index: the process that owns the device.
      replica_id: 0 for the copy that is written; other copies are skipped.
    """

    box: Box
    device_id: int
    process_index: int
    replica_id: int


@dataclasses.dataclass(frozen=True)
class ChunkWrite:
    """One chunk (zarr shard file) one process writes.

    Attributes:
      chunk_index: the chunk's cell in the chunk grid.
      box: the region of the global array it holds (clipped at the array's edge).
      device_id: the device whose shard is copied.
    """

    chunk_index: tuple[int, ...]
    box: Box
    device_id: int


@dataclasses.dataclass(frozen=True)
class LeafWritePlan:
    """What one process writes of one array leaf.

    Attributes:
      leaf_path: the leaf path.
      shape: the global shape.
      chunk_shape: the chunk grid (= the saved shard shape; 1 where a dimension is 0).
      inner_chunk_shape: inner chunks of each zarr shard file.
      writes: the chunks this process writes, in chunk order.
    """

    leaf_path: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    writes: tuple[ChunkWrite, ...]


def chunk_shape_for(shape: Sequence[int], shard_shape: Sequence[int]) -> tuple[int, ...]:
    """The chunk shape for a leaf: its shard shape, with zero-size dimensions as 1."""
    return tuple(max(1, s) for s in shard_shape) if shape else ()


def plan_leaf_write(
    leaf_path: str,
    shape: Sequence[int],
    itemsize: int,
    shard_shape: Sequence[int],
    shards: Sequence[ShardInfo],
    process_index: int,
    *,
    inner_target_bytes: int | None = None,
) -> LeafWritePlan:
    """Plans the writes of one array leaf for one process.

    Args:
      leaf_path: the leaf path (for errors).
      shape: the global shape.
      itemsize: bytes per element.
      shard_shape: the sharding's per-device shard shape.
      shards: the shards of this process's devices (others are ignored).
      process_index: the process to plan for.
      inner_target_bytes: override of the inner chunk size target, bytes.
    Returns:
      The plan; `writes` is empty when no local shard has `replica_id == 0`.
    Raises:
      UnsupportedValueError: a shard does not fall on the chunk grid (a sharding JAX
        cannot produce for a NamedSharding).
    """
    shape = tuple(shape)
    chunk = chunk_shape_for(shape, shard_shape)
    inner = inner_chunk_shape(chunk, itemsize, inner_target_bytes)
    writes: dict[tuple[int, ...], ChunkWrite] = {}
    for s in shards:
        if s.process_index != process_index or s.replica_id != 0 or s.box.size == 0:
            continue
        cell = tuple(o // c for o, c in zip(s.box.origin, chunk))
        expected = Box(tuple(i * c for i, c in zip(cell, chunk)), tuple(min(c, d - i * c) for i, c, d in zip(cell, chunk, shape)))
        if s.box != expected:
            raise UnsupportedValueError(
                f"leaf {leaf_path!r}: shard {s.box} on device {s.device_id} is not the chunk {expected} of the "
                f"grid {chunk}; shardings whose shards are not a regular grid are not supported. Reshard "
                "the array with a NamedSharding before saving."
            )
        writes.setdefault(cell, ChunkWrite(cell, s.box, s.device_id))
    return LeafWritePlan(leaf_path, shape, chunk, inner, tuple(writes[c] for c in sorted(writes)))
