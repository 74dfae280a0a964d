"""Save planning (pure): which process writes which chunk, and each leaf's chunk grid.

No device work and no I/O: the inputs are plain descriptions of every device's shard
(all processes, from `sharding.devices_indices_map`, which every process sees whole),
so every process computes the same plan, and the rules are tested exhaustively with
hand-built shardings.

Rules (replica-parallel writes; docs/DESIGN-decisions.md "Replica-parallel writes"):
- A box's *holders* are the distinct processes with a device holding it; `R` of a leaf is
  the largest holder count of its boxes. Each chunk (zarr shard file) has exactly one
  writer, one of its box's holders, so every byte is written once in total.
- Split: with `R > 1` the chunk grid subdivides the saved shard shape along ONE
  dimension by a per-leaf factor `k` (so all chunks of a leaf form one regular grid),
  keeping every chunk at least `split_floor_bytes` (default `SPLIT_FLOOR_BYTES`, 1 MiB)
  so restores still read coarse files. The first of these that exists:
  (a) `k = R` along the first dimension whose shard length `R` divides;
  (b) the smallest divisor of a shard dimension that is at least `4 * R` (a box's `k`
      chunks then spread over its `R` holders within 25 %);
  (c) the largest `k` with `2 <= k < R` dividing a shard dimension (fewer chunks than
      holders: a box too small for `R` chunks above the floor still spreads);
  (first dimension on ties); else no split (`R == 1`, a tiny leaf): the chunk is the
  saved shard.
- Assignment: a chunk with one holder is written by it. Chunks with several holders are
  spread over the whole tree by bytes: largest first (ties: tree order, box order, chunk
  order), each to its holder with the fewest bytes assigned so far (single-holder chunks
  counted first; ties: the lowest process index). With equal loads the `R` chunks of a
  box go one to each holder; thousands of small replicated leaves spread instead of
  landing on process 0.
- The writing device of a chunk is, among the writer's devices holding the box, the one
  with the lowest `replica_id` (the lowest device id on ties). A single-process save
  therefore keeps the layout of release 0.1: one chunk per shard, written from replica 0.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence

from .._errors import UnsupportedValueError, leaf_name
from .._format import Box, ShardFileLayout, grid_cells, inner_chunk_shape, with_fields

# Smallest chunk a replica-parallel split may produce, bytes: below it a box is written
# whole by one of its holders (restores keep reading few, large files).
SPLIT_FLOOR_BYTES = 1 << 20

# When the holder count R divides no shard dimension, a split takes at least 4*R chunks
# per box, so no holder gets more than 1.25x its share of one box: ceil(k/R) / (k/R) <= 1.25
# (rule (b) of the module docstring).
_UNEVEN_SPLIT_MULTIPLE = 4

# Benchmark-only switch (benchmarks/replicated_save_bench.py; not API, never set by the
# library): True plans the one-writer behaviour instead of replica-parallel writes, i.e.
# no split and every box written whole by the holder of its `replica_id == 0` shard.
# `_save` caches plans: clear `_save._PLAN_CACHE` after changing it.
_ONE_WRITER = False


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One device's shard of a global array.

    Attributes:
      box: the region of the global array the shard holds.
      device_id: the JAX device id.
      process_index: the process that owns the device.
      replica_id: JAX's replica id of the shard (0 for the first device holding the box).
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
      shard_box: the box of that device's shard when the chunk is only part of it (a
        replica-parallel split: copy `box.relative_to(shard_box)` of the shard); None
        when the chunk is the whole shard.
    """

    chunk_index: tuple[int, ...]
    box: Box
    device_id: int
    shard_box: Box | None = None


@dataclasses.dataclass(frozen=True)
class LeafWritePlan:
    """What one process writes of one array leaf.

    Attributes:
      leaf_path: the leaf path.
      shape: the global shape.
      chunk_shape: the chunk grid (the saved shard shape, subdivided along `split_dim`
        by `split_factor`; 1 where a dimension is 0).
      inner_chunk_shape: inner chunks of each zarr shard file.
      writes: the chunks this process writes, in chunk order.
      split_dim: the dimension a replica-parallel split divides, or None.
      split_factor: chunks per saved shard (1: no split).
    """

    leaf_path: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    writes: tuple[ChunkWrite, ...]
    split_dim: int | None = None
    split_factor: int = 1


@dataclasses.dataclass(frozen=True)
class LeafShards:
    """The input of the save planner for one array leaf.

    Attributes:
      leaf_path: the leaf path (for errors).
      shape: the global shape.
      itemsize: bytes per element.
      shard_shape: the sharding's per-device shard shape.
      shards: every device's shard, on every process (a host numpy leaf: one shard,
        device id -1, process 0).
    """

    leaf_path: str
    shape: tuple[int, ...]
    itemsize: int
    shard_shape: tuple[int, ...]
    shards: tuple[ShardInfo, ...]


@dataclasses.dataclass(frozen=True)
class LeafAssignment:
    """Every process's writes of one array leaf.

    Attributes:
      leaf_path, shape, chunk_shape, inner_chunk_shape, split_dim, split_factor: as in
        `LeafWritePlan`.
      itemsize: bytes per element.
      replicas: R, the largest number of processes holding one box.
      writes: `(process_index, write)` of every chunk, in chunk order.
    """

    leaf_path: str
    shape: tuple[int, ...]
    itemsize: int
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    split_dim: int | None
    split_factor: int
    replicas: int
    writes: tuple[tuple[int, ChunkWrite], ...]

    def for_process(self, process_index: int) -> LeafWritePlan:
        """The part of the assignment `process_index` writes."""
        return LeafWritePlan(
            self.leaf_path, self.shape, self.chunk_shape, self.inner_chunk_shape,
            tuple(w for p, w in self.writes if p == process_index), self.split_dim, self.split_factor,
        )


def chunk_shape_for(shape: Sequence[int], shard_shape: Sequence[int]) -> tuple[int, ...]:
    """The chunk shape for a leaf: its shard shape, with zero-size dimensions as 1."""
    return tuple(max(1, s) for s in shard_shape) if shape else ()


def _smallest_divisor_at_least(n: int, low: int) -> int | None:
    """The smallest divisor of `n` that is >= `low`, or None."""
    best = None
    for i in range(1, math.isqrt(n) + 1):
        if n % i == 0:
            for d in (i, n // i):
                if d >= low and (best is None or d < best):
                    best = d
    return best


def split_rule(shard_shape: Sequence[int], itemsize: int, replicas: int, floor_bytes: int) -> tuple[int | None, int]:
    """The replica-parallel split of one leaf (module docstring, "Split").

    Args:
      shard_shape: the saved shard shape.
      itemsize: bytes per element.
      replicas: R, the number of processes holding a box.
      floor_bytes: the smallest chunk allowed, bytes.
    Returns:
      `(split_dim, split_factor)`; `(None, 1)` when no split applies.
    """
    if replicas <= 1 or not shard_shape or 0 in shard_shape:
        return None, 1
    shard_bytes = math.prod(shard_shape) * itemsize
    for d, n in enumerate(shard_shape):  # (a)
        if n % replicas == 0 and shard_bytes // replicas >= floor_bytes:
            return d, replicas
    best: tuple[int, int] | None = None
    for d, n in enumerate(shard_shape):  # (b)
        k = _smallest_divisor_at_least(n, _UNEVEN_SPLIT_MULTIPLE * replicas)
        if k is not None and shard_bytes // k >= floor_bytes and (best is None or k < best[0]):
            best = (k, d)
    if best is not None:
        return best[1], best[0]
    for k in range(min(replicas - 1, shard_bytes // max(1, floor_bytes)), 1, -1):  # (c)
        for d, n in enumerate(shard_shape):
            if n % k == 0:
                return d, k
    return None, 1


@dataclasses.dataclass
class _Group:
    """What the leaves of one (shard tuple, shape, shard shape, itemsize) share: the chunk
    grid, the split, and each chunk's box and holders; with `single_writes` when every
    chunk has one holder (then the writes and the bytes per process are the same for
    every leaf of the group)."""

    shape: tuple[int, ...]
    chunk: tuple[int, ...]
    split_dim: int | None
    k: int
    replicas: int
    layout: list[tuple[int, tuple[int, ...], Box, int, Box, dict[int, ShardInfo]]]
    single_writes: tuple[tuple[int, ChunkWrite], ...] | None
    single_loads: tuple[tuple[int, int], ...]


@dataclasses.dataclass
class _Leaf:
    spec: LeafShards
    group: _Group
    writes: list[tuple[int, ChunkWrite]] | None  # None: the group's `single_writes`


def _plan_group(spec: LeafShards, split_floor_bytes: int) -> _Group:
    """The chunk grid, split and chunk layout of a leaf (and of every leaf of its group)."""
    shard_chunk = chunk_shape_for(spec.shape, spec.shard_shape)
    groups = _group(spec, shard_chunk)
    replicas = max((len(h) for h in groups.values()), default=1)
    split_dim, k = split_rule(spec.shard_shape, spec.itemsize, 1 if _ONE_WRITER else replicas, split_floor_bytes)
    chunk = shard_chunk
    if split_dim is not None:
        chunk = chunk[:split_dim] + (chunk[split_dim] // k,) + chunk[split_dim + 1 :]
    # (box ordinal, chunk index, chunk box, its elements, shard box, holders)
    layout: list[tuple[int, tuple[int, ...], Box, int, Box, dict[int, ShardInfo]]] = []
    for b, box in enumerate(sorted(groups)):
        if chunk == shard_chunk:  # no split: the chunk is the shard
            cell = tuple(o // c for o, c in zip(box.origin, chunk))
            layout.append((b, cell, box, box.size, box, groups[box]))
            continue
        for cell in grid_cells(box, chunk):
            part = Box(
                tuple(c * n for c, n in zip(cell, chunk)),
                tuple(min(n, e - c * n) for c, n, e in zip(cell, chunk, box.stop)),
            )
            layout.append((b, cell, part, part.size, box, groups[box]))
    single_writes = None
    loads: dict[int, int] = {}
    if all(len(holders) == 1 for *_, holders in layout):
        writes = []
        for _, cell, part, size, box, holders in layout:
            ((p, s),) = holders.items()
            writes.append((p, ChunkWrite(cell, part, s.device_id, None if part is box or part == box else box)))
            loads[p] = loads.get(p, 0) + size * spec.itemsize
        single_writes = tuple(sorted(writes, key=lambda pw: pw[1].chunk_index))
    return _Group(tuple(spec.shape), chunk, split_dim, k, replicas, layout, single_writes, tuple(loads.items()))


def _group(spec: LeafShards, shard_chunk: tuple[int, ...]) -> dict[Box, dict[int, ShardInfo]]:
    """box -> {holder process: its shard with the lowest (replica_id, device_id)}; checks the grid."""
    groups: dict[Box, dict[int, ShardInfo]] = {}
    for s in spec.shards:
        if s.box.size == 0:
            continue
        cell = tuple(o // c for o, c in zip(s.box.origin, shard_chunk))
        expected = Box(
            tuple(i * c for i, c in zip(cell, shard_chunk)),
            tuple(min(c, d - i * c) for i, c, d in zip(cell, shard_chunk, spec.shape)),
        )
        if s.box != expected:
            raise UnsupportedValueError(
                f"leaf {leaf_name(spec.leaf_path)}: shard {s.box} on device {s.device_id} is not the chunk {expected} of the "
                f"grid {shard_chunk}; shardings whose shards are not a regular grid are not supported. Reshard "
                "the array with a NamedSharding before saving."
            )
        holders = groups.setdefault(s.box, {})
        best = holders.get(s.process_index)
        if best is None or (s.replica_id, s.device_id) < (best.replica_id, best.device_id):
            holders[s.process_index] = s
    return groups


def plan_writes(
    leaves: Sequence[LeafShards],
    *,
    split_floor_bytes: int = SPLIT_FLOOR_BYTES,
    inner_target_bytes: int | None = None,
    paths: Sequence[str] | None = None,
) -> tuple[LeafAssignment, ...]:
    """Plans which process writes which chunk of every array leaf of a tree.

    Args:
      leaves: the array leaves in tree order, each with every device's shard.
      paths: each leaf's path, when the `LeafShards` are shared by the leaves of one
        layout (their `leaf_path` is then the first such leaf's, which is the leaf an
        error of the layout names); None: each leaf's `leaf_path`.
      split_floor_bytes: the smallest chunk a replica-parallel split may produce, bytes.
      inner_target_bytes: override of the inner chunk size target, bytes.
    Returns:
      One assignment per leaf, in the order given.
    Raises:
      UnsupportedValueError: a shard does not fall on its leaf's shard grid (a sharding
        JAX cannot produce for a NamedSharding); the message names the leaf.

    Multi-process: pure; every process computes the same plan from the same inputs.
    """
    loads: dict[int, int] = {}
    planned: list[_Leaf] = []
    # Chunks with several holders: (-bytes, leaf, box ordinal, chunk index, chunk box, shard box, holders).
    pending: list[tuple[int, int, int, tuple[int, ...], Box, Box, dict[int, ShardInfo]]] = []
    # Leaves sharing one shard tuple, shape and itemsize share everything but their path
    # (a tree of thousands of small leaves has a handful of such groups): planned once.
    groups_of: dict[tuple, _Group] = {}
    shared_leaves: dict[int, list] = {}  # id(group) -> [group, leaves of it whose writes are the group's]
    group_of_spec: dict[int, _Group] = {}  # id(spec) -> its group (shared specs: one look-up per leaf)
    for li, spec in enumerate(leaves):
        g = group_of_spec.get(id(spec))
        if g is None:
            gkey = (id(spec.shards), spec.shape, spec.shard_shape, spec.itemsize)
            g = groups_of.get(gkey)
            if g is None:
                g = groups_of[gkey] = _plan_group(spec, split_floor_bytes)
            group_of_spec[id(spec)] = g
        leaf = _Leaf(spec, g, [] if g.single_writes is None else None)
        planned.append(leaf)
        if g.single_writes is not None:  # every chunk has one holder: the group's writes, shared (loads added below)
            shared_leaves.setdefault(id(g), [g, 0])[1] += 1
            continue
        assert leaf.writes is not None
        itemsize = spec.itemsize
        for b, cell, part, size, box, holders in g.layout:
            if len(holders) > 1:
                pending.append((-size * itemsize, li, b, cell, part, box, holders))
                continue
            ((p, s),) = holders.items()
            leaf.writes.append((p, ChunkWrite(cell, part, s.device_id, None if part is box or part == box else box)))
            loads[p] = loads.get(p, 0) + size * itemsize
    for g, count in shared_leaves.values():
        for p, nbytes in g.single_loads:
            loads[p] = loads.get(p, 0) + count * nbytes
    # One lazy min-heap of (load, process) per holder set: loads only grow, so an entry
    # whose load is stale is pushed back with the current load until the top is exact
    # (the same choice as min over the holders, in O(log R) instead of O(R)).
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    members_of: dict[int, tuple[int, ...]] = {}  # id(holders) -> sorted holders (the dicts are shared)
    for neg_bytes, li, _, cell, part, box, holders in sorted(pending, key=lambda t: t[:4]):
        members = members_of.get(id(holders))
        if members is None:
            members = members_of[id(holders)] = tuple(sorted(holders))
        heap = heaps.get(members)
        if heap is None:
            heap = heaps[members] = [(loads.get(q, 0), q) for q in members]
            heapq.heapify(heap)
        if _ONE_WRITER:  # the benchmark-only one-writer plan: the replica 0 holder writes it
            p = min(holders, key=lambda q: (holders[q].replica_id, holders[q].device_id))
            loads[p] = loads.get(p, 0) - neg_bytes
        else:
            while True:
                load, p = heapq.heappop(heap)
                if load == loads.get(p, 0):
                    break
                heapq.heappush(heap, (loads.get(p, 0), p))
            loads[p] = load - neg_bytes
            heapq.heappush(heap, (loads[p], p))
        writes = planned[li].writes
        assert writes is not None
        writes.append((p, ChunkWrite(cell, part, holders[p].device_id, None if part is box or part == box else box)))
    inners: dict[int, tuple[int, ...]] = {}
    templates: dict[int, LeafAssignment] = {}  # id(group) -> the assignment of its shared writes, copied per leaf
    out = []
    for li, leaf in enumerate(planned):
        spec, g = leaf.spec, leaf.group
        path = spec.leaf_path if paths is None else paths[li]
        if leaf.writes is None and id(g) in templates:
            out.append(with_fields(templates[id(g)], leaf_path=path))
            continue
        inner = inners.get(id(g))
        if inner is None:
            inner = inners[id(g)] = inner_chunk_shape(g.chunk, spec.itemsize, inner_target_bytes)
        if leaf.writes is None:
            assert g.single_writes is not None
            ordered = g.single_writes
        else:
            ordered = tuple(sorted(leaf.writes, key=lambda pw: pw[1].chunk_index))
        out.append(
            LeafAssignment(path, g.shape, spec.itemsize, g.chunk, inner, g.split_dim, g.k, g.replicas, ordered)
        )
        if leaf.writes is None:
            templates[id(g)] = out[-1]
    return tuple(out)


def plan_leaf_write(
    leaf_path: str,
    shape: Sequence[int],
    itemsize: int,
    shard_shape: Sequence[int],
    shards: Sequence[ShardInfo],
    process_index: int,
    *,
    inner_target_bytes: int | None = None,
    split_floor_bytes: int = SPLIT_FLOOR_BYTES,
) -> LeafWritePlan:
    """Plans the writes of a tree of one array leaf for one process (`plan_writes`).

    Args:
      leaf_path: the leaf path (for errors).
      shape: the global shape.
      itemsize: bytes per element.
      shard_shape: the sharding's per-device shard shape.
      shards: every device's shard, on every process.
      process_index: the process to plan for.
      inner_target_bytes: override of the inner chunk size target, bytes.
      split_floor_bytes: the smallest chunk a replica-parallel split may produce, bytes.
    Returns:
      The plan; `writes` is empty when this process writes nothing of the leaf.
    Raises:
      UnsupportedValueError: a shard does not fall on the shard grid.
    """
    spec = LeafShards(leaf_path, tuple(shape), itemsize, tuple(shard_shape), tuple(shards))
    (assignment,) = plan_writes([spec], split_floor_bytes=split_floor_bytes, inner_target_bytes=inner_target_bytes)
    return assignment.for_process(process_index)


# --- the plan as a whole (plan_save) --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessWrites:
    """What one process writes in a save.

    Attributes:
      process_index: the process.
      bytes_written: bytes of chunk files it writes (zarr shard files, index included;
        what `processes/<i>.json` records as `bytes_written`).
      data_bytes: array bytes it writes (uncompressed, without the indexes).
      files: chunk files it writes.
    """

    process_index: int
    bytes_written: int
    data_bytes: int
    files: int


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """Which process writes which bytes of a save (`checkpointer.plan_save`).

    Attributes:
      process_count: the processes of the save.
      leaves: every array leaf's assignment (chunk grid, split, writer of each chunk).
      processes: per process what it writes, by process index.
    """

    process_count: int
    leaves: tuple[LeafAssignment, ...]
    processes: tuple[ProcessWrites, ...]

    @property
    def bytes_written(self) -> int:
        """Bytes of chunk files over all processes."""
        return sum(p.bytes_written for p in self.processes)

    @property
    def data_bytes(self) -> int:
        """Array bytes over all processes (each element once)."""
        return sum(p.data_bytes for p in self.processes)

    @property
    def files(self) -> int:
        """Chunk files over all processes."""
        return sum(p.files for p in self.processes)

    @property
    def imbalance(self) -> float:
        """The largest process's `bytes_written` over the mean (1.0: perfectly even)."""
        mean = self.bytes_written / max(1, self.process_count)
        return max((p.bytes_written for p in self.processes), default=0) / mean if mean else 1.0


def summarize(assignments: Sequence[LeafAssignment], process_count: int, packed: Sequence[bool] = ()) -> SavePlan:
    """Per-process totals of a plan; pure.

    Args:
      assignments: `plan_writes`'s result.
      process_count: the processes of the save (processes writing nothing get zeros).
      packed: per assignment, whether the leaf's chunks go into the writers' packs
        (`_pack`): their data bytes count into one pack file per process (its data and
        a 4-byte crc32c) instead of a zarr shard file each. Default: none.
    Returns:
      The SavePlan.
    """
    written = [0] * process_count
    data = [0] * process_count
    files = [0] * process_count
    has_pack = [False] * process_count
    for i, a in enumerate(assignments):
        file_bytes = ShardFileLayout(tuple(a.chunk_shape), tuple(a.inner_chunk_shape), a.itemsize).file_bytes
        in_pack = i < len(packed) and packed[i]
        for p, w in a.writes:
            nbytes = w.box.size * a.itemsize
            data[p] += nbytes
            if in_pack:
                written[p] += nbytes + (0 if has_pack[p] else 4)
                files[p] += 0 if has_pack[p] else 1
                has_pack[p] = True
                continue
            written[p] += file_bytes
            files[p] += 1
    return SavePlan(
        process_count, tuple(assignments),
        tuple(ProcessWrites(p, written[p], data[p], files[p]) for p in range(process_count)),
    )
