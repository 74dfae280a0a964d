"""Pure sharding geometry: the box of every device of a `NamedSharding`, from the mesh
shape and the PartitionSpec alone (no devices), for save previews and restore plans."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from jax.sharding import PartitionSpec as P

from ._box import Box


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry names (major to minor)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def named_shard_boxes(
    shape: Sequence[int], mesh_shape: Mapping[str, int], spec: P, positions: Sequence[int] | None = None
) -> list[Box]:
    """The box of every device of `NamedSharding(mesh, spec)`, purely, in mesh order.

    Args:
      shape: the global shape.
      mesh_shape: mesh axis name → size, in the mesh's axis order (`mesh.shape`).
      spec: the PartitionSpec (entries None, an axis name or a tuple of names; fewer
        entries than dimensions replicate the rest).
      positions: only these devices (positions in row-major mesh order); default all.
    Returns:
      One box per device, devices in row-major order of the mesh axes (the order of
      `mesh.devices.flat`), or per position given. Equals `devices_indices_map` on a
      concrete mesh.
    Raises:
      ValueError: an entry names an axis the mesh lacks, or its axes' sizes do not
        divide the dimension (the message says which).

    Multi-process: pure; needs no devices.
    """
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    per_dim = []  # (mesh axis positions, parts, shard length) per dimension
    for dim, n in enumerate(shape):
        axes = spec_axes(spec[dim]) if dim < len(spec) else ()
        for a in axes:
            if a not in mesh_shape:
                raise ValueError(f"PartitionSpec {spec} names mesh axis {a!r}, which the mesh ({', '.join(names)}) lacks")
        parts = math.prod(mesh_shape[a] for a in axes)
        if n % parts:
            raise ValueError(f"dimension {dim} of size {n} is not divisible by {parts} ({'*'.join(axes)})")
        per_dim.append(([names.index(a) for a in axes], n // parts))
    out = []
    every = np.ndindex(*sizes) if positions is None else (np.unravel_index(p, sizes) for p in positions)
    for coords in every:
        origin = []
        for positions, length in per_dim:
            idx = 0
            for p in positions:
                idx = idx * sizes[p] + int(coords[p])
            origin.append(idx * length)
        out.append(Box(tuple(origin), tuple(length for _, length in per_dim)))
    return out
