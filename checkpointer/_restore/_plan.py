"""Cooperative restore planning (pure): the plan of a whole target tree, and the exchange
layout under which processes that share a box read disjoint pieces of it.

Cooperative restore (`build_plan(..., cooperative=True)`): a leaf whose target puts
the same box on devices of several processes (a replicated target, e.g. parameters
under pure data parallelism) is not read whole by each of them. The planner refines
the target's `NamedSharding` into an *exchange layout* (`exchange_spec`): the target's
PartitionSpec with the unused mesh axes that span processes added to a dimension they
divide, so every device's exchange box lies inside its target box and the processes
that shared a box now hold disjoint pieces of it. Each process reads only its
devices' exchange boxes, as its leaf's encoding plans its share (`LeafEncoding.plan_share`:
a packed chunk several exchange boxes cut is read in pieces, one per process, its
crc32c checked after the exchange) (`LeafRestorePlan.boxes`, each `BoxRead.receivers` naming the
processes that need those bytes too); the executor assembles them into a global array
of the exchange layout and reshards it onto the target with JAX, so the pieces a
process needs but did not read (`LeafRestorePlan.received`, each with its reader) come
from its peers over the device interconnect. Rules: only axes of size > 1 along which
the owning process changes are added (an axis inside one process saves no storage
read), each to the dimension with the largest per-device extent it divides (ties:
the first; the first it divides where the leaf's encoding wants shares contiguous in
C order, as packed leaves do); a leaf where no such axis divides a dimension, a host target, a target
that is not a `NamedSharding` or lives in host memory keeps the plain plan. PRNG key
data is split along the key array's own dimensions only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._encoding import LeafRestorePlan, PeerPiece, RestorePlan, encoding_of, plan_leaf
from .._format import ArrayMetadata, Box, named_shard_boxes, spec_axes
from ._targets import ResolvedLeaf, ResolvedTarget


def exchange_spec(
    shape: Sequence[int], mesh_shape: Mapping[str, int], spec: PartitionSpec, owners: Sequence[int], *, major_first: bool = False
) -> PartitionSpec | None:
    """The exchange layout of a target that several processes share (module docstring).

    Args:
      shape: the dimensions that may be split (the key array's for PRNG keys).
      mesh_shape: the target mesh's axis name → size, in axis order.
      spec: the target's PartitionSpec.
      owners: the process of every mesh device, in row-major mesh order.
      major_first: add each axis to the first dimension it divides instead (the
        leaf's encoding asks for shares contiguous in C order: `LeafEncoding.contiguous_shares`).
    Returns:
      `spec` with the unused, process-spanning mesh axes added (each as the minor axis
      of the dimension with the largest per-device extent it divides), or None when no
      such axis divides any dimension (no box is shared, or it cannot be split).

    Multi-process: pure.
    """
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    grid = np.asarray(owners).reshape(sizes)
    entries = [list(spec_axes(spec[d])) if d < len(spec) else [] for d in range(len(shape))]
    used = {a for e in entries for a in e}
    added = False
    for i, (name, size) in enumerate(zip(names, sizes)):
        if name in used or size == 1 or not (grid != np.take(grid, [0], axis=i)).any():
            continue  # used by the target, trivial, or inside one process
        best = None
        for d, n in enumerate(shape):
            extent = n // int(np.prod([mesh_shape[a] for a in entries[d]], dtype=np.int64))
            if extent % size == 0 and extent >= size and (best is None or extent > best[1] and not major_first):
                best = (d, extent)
        if best is not None:
            entries[best[0]].append(name)
            added = True
    if not added:
        return None
    return PartitionSpec(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])


def _cooperative_leaf(leaf: ResolvedLeaf, process_index: int, slab_bytes: int | None) -> LeafRestorePlan | None:
    """The cooperative plan of one leaf for `process_index`, or None (read it plainly)."""
    meta, lt = leaf.meta, leaf.target
    assert isinstance(meta, ArrayMetadata) and lt is not None
    s = lt.sharding
    if not leaf.all_boxes or not isinstance(s, NamedSharding) or s.memory_kind not in (None, "device"):
        return None
    owners = [p for _, p, _ in leaf.all_boxes]
    if len(set(owners)) < 2:
        return None
    encoding = encoding_of(meta)
    spec = exchange_spec(lt.shape, s.mesh.shape, s.spec, owners, major_first=encoding.contiguous_shares)
    if spec is None:
        return None
    key_tail = meta.shape[len(lt.shape) :]
    pieces = [Box(b.origin + (0,) * len(key_tail), b.shape + key_tail) for b in named_shard_boxes(lt.shape, s.mesh.shape, spec)]
    holders: dict[Box, set[int]] = {}
    needs: dict[Box, set[int]] = {}  # unique target box -> processes that hold it
    for (_, p, target), piece in zip(leaf.all_boxes, pieces):
        holders.setdefault(piece, set()).add(p)
        needs.setdefault(target, set()).add(p)
    mine = [(d, piece) for (d, p, _), piece in zip(leaf.all_boxes, pieces) if p == process_index]
    shares = {piece: frozenset(procs) for piece, procs in holders.items()}
    plain = encoding.plan_share(meta, mine, shares, process_index, slab_bytes=slab_bytes)
    boxes = []
    for b in plain.boxes:
        receivers = sorted({q for t, procs in needs.items() if b.box.intersect(t) is not None for q in procs} - {process_index})
        boxes.append(dataclasses.replace(b, receivers=tuple(receivers)))
    targets = tuple(sorted({b for _, b in leaf.device_boxes}))
    received = []
    for piece, procs in sorted(holders.items()):
        if process_index in procs:
            continue
        for t in targets:
            inter = piece.intersect(t)
            if inter is not None:
                received.append(PeerPiece(inter, min(procs)))
    return dataclasses.replace(plain, boxes=tuple(boxes), exchange_spec=spec, target_boxes=targets, received=tuple(received))


def build_plan(
    resolved: ResolvedTarget, path: str, *, slab_bytes: int | None = None, cooperative: bool = False
) -> RestorePlan:
    """Plans every array leaf of a resolved target.

    Args:
      resolved: the target matched and resolved for one process (`_targets.resolve_tree`,
        with `cooperative=True` for a cooperative plan).
      path: the checkpoint path.
      slab_bytes: as for `plan_leaf`; applied to leaves placed on devices only (a host
        target is read whole).
      cooperative: split boxes that several processes need among them (module
        docstring); leaves that cannot be split keep the plain plan.
    Returns:
      The `RestorePlan`, its leaves in target order.

    Multi-process: pure.
    """
    leaves = []
    for leaf in resolved.leaves:
        if leaf.target is None or not isinstance(leaf.meta, ArrayMetadata):
            continue  # a value leaf: nothing to read
        on_devices = leaf.target.sharding is not None
        planned = _cooperative_leaf(leaf, resolved.process_index, slab_bytes) if cooperative and on_devices else None
        if planned is None:
            planned = plan_leaf(leaf.meta, leaf.device_boxes, slab_bytes=slab_bytes if on_devices else None)
        leaves.append(planned)
    return RestorePlan(path, resolved.process_index, tuple(leaves))
