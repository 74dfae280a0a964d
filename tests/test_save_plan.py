"""Save planning: replica dedup and replica-parallel writes across processes, the chunk
grid, edge shapes.

Pure: every input is a hand-built `ShardInfo` list; no devices, no disk. The shard
lists model what JAX's `addressable_shards` report for a `NamedSharding` on a 2x4 mesh
(`data` x `model`) whose devices 0-3 live on process 0 and 4-7 on process 1.
"""

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._errors import UnsupportedValueError
from checkpointer._format._box import Box, cell_box
from checkpointer._format._sharding import named_shard_boxes
from checkpointer._save._plan import (
    ChunkWrite,
    LeafShards,
    ShardInfo,
    chunk_shape_for,
    plan_leaf_write,
    plan_writes,
    split_rule,
)

MESH_2x4 = np.arange(8).reshape(2, 4)  # data x model, device ids in mesh order
AXES = ("data", "model")


def _process_of(device_id):
    return device_id // 4


def _named_shards(shape, device_grid, spec):
    """The shards JAX reports for NamedSharding(Mesh(device_grid, AXES), P(*spec)).

    Each spec entry is None, an axis name or a tuple of axis names; the shard index along
    a dimension is the mixed-radix index of the device's coordinates on those axes, and
    replica_id numbers the devices holding the same box in mesh order (JAX's rule).
    """
    grid = np.asarray(device_grid)
    sizes = dict(zip(AXES, grid.shape))
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    out, replicas = [], {}
    for coords in itertools.product(*(range(n) for n in grid.shape)):
        pos = dict(zip(AXES, coords))
        origin, extent = [], []
        for dim, entry in zip(shape, spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            parts, idx = 1, 0
            for a in axes:
                idx, parts = idx * sizes[a] + pos[a], parts * sizes[a]
            origin.append(idx * (dim // parts))
            extent.append(dim // parts)
        box = Box(tuple(origin), tuple(extent))
        rid = replicas.get(box, 0)
        replicas[box] = rid + 1
        device = int(grid[coords])
        out.append(ShardInfo(box, device, _process_of(device), rid))
    return out


# --- replica dedup ---------------------------------------------------------------------------


# P('data', None) on the 2x4 mesh, global shape (8, 6): rows split over 'data', replicated
# over 'model'; replica_id is the device's 'model' coordinate.
REPLICATED_OVER_MODEL = [
    ShardInfo(Box((0, 0), (4, 6)), 0, 0, 0),
    ShardInfo(Box((0, 0), (4, 6)), 1, 0, 1),
    ShardInfo(Box((0, 0), (4, 6)), 2, 0, 2),
    ShardInfo(Box((0, 0), (4, 6)), 3, 0, 3),
    ShardInfo(Box((4, 0), (4, 6)), 4, 1, 0),
    ShardInfo(Box((4, 0), (4, 6)), 5, 1, 1),
    ShardInfo(Box((4, 0), (4, 6)), 6, 1, 2),
    ShardInfo(Box((4, 0), (4, 6)), 7, 1, 3),
]


def test_hand_built_shards_match_the_jax_model():
    assert _named_shards((8, 6), MESH_2x4, ("data", None)) == REPLICATED_OVER_MODEL


@pytest.mark.parametrize(
    "process, expected",
    [
        (0, (ChunkWrite((0, 0), Box((0, 0), (4, 6)), 0),)),
        (1, (ChunkWrite((1, 0), Box((4, 0), (4, 6)), 4),)),
    ],
)
def test_each_process_writes_only_its_replica_zero_shards(process, expected):
    local = [s for s in REPLICATED_OVER_MODEL if s.process_index == process]
    plan = plan_leaf_write("params/w", (8, 6), 4, (4, 6), local, process)
    assert plan.writes == expected
    assert plan.leaf_path == "params/w"
    assert plan.shape == (8, 6)
    assert plan.chunk_shape == (4, 6)


@pytest.mark.parametrize("process", [0, 1])
def test_shards_of_other_processes_are_ignored(process):
    local = [s for s in REPLICATED_OVER_MODEL if s.process_index == process]
    everything = plan_leaf_write("w", (8, 6), 4, (4, 6), REPLICATED_OVER_MODEL, process)
    only_local = plan_leaf_write("w", (8, 6), 4, (4, 6), local, process)
    assert everything.writes == only_local.writes
    assert all(_process_of(w.device_id) == process for w in everything.writes)


def test_small_boxes_held_by_two_processes_are_spread_over_both():
    # P('model', None): rows split over 'model', replicated over 'data' (across the two
    # processes); 48-byte boxes are below the split floor, so whole boxes alternate.
    shards = _named_shards((8, 6), MESH_2x4, ("model", None))
    p0 = plan_leaf_write("w", (8, 6), 4, (2, 6), shards, 0)
    p1 = plan_leaf_write("w", (8, 6), 4, (2, 6), shards, 1)
    assert p0.writes == tuple(ChunkWrite((i, 0), Box((2 * i, 0), (2, 6)), i) for i in (0, 2))
    assert p1.writes == tuple(ChunkWrite((i, 0), Box((2 * i, 0), (2, 6)), 4 + i) for i in (1, 3))
    assert p1.chunk_shape == (2, 6)


@pytest.mark.parametrize(
    "spec, shard_shape",
    [
        (("data", None), (4, 8)),
        ((None, "data"), (8, 4)),
        (("model", None), (2, 8)),
        ((None, "model"), (8, 2)),
        (("data", "model"), (4, 2)),
        (("model", "data"), (2, 4)),
        ((("data", "model"), None), (1, 8)),
        ((None, ("model", "data")), (8, 1)),
        ((None, None), (8, 8)),
    ],
)
@pytest.mark.parametrize(
    "grid",
    [MESH_2x4, np.array([[4, 5, 6, 7], [0, 1, 2, 3]]), np.array([[0, 2, 4, 6], [1, 3, 5, 7]])],
    ids=["in-order", "process-1-first", "interleaved"],
)
def test_union_over_processes_writes_every_chunk_exactly_once(spec, shard_shape, grid):
    shape = (8, 8)
    shards = _named_shards(shape, grid, spec)
    writes = []
    for process in (0, 1):
        plan = plan_leaf_write("w", shape, 4, shard_shape, shards, process)
        assert plan.chunk_shape == shard_shape
        for w in plan.writes:
            # Written from a device of this process holding exactly that box.
            assert any(s.box == w.box and s.device_id == w.device_id and s.process_index == process for s in shards)
        writes += plan.writes
    cells = [w.chunk_index for w in writes]
    grid_cells = list(itertools.product(range(8 // shard_shape[0]), range(8 // shard_shape[1])))
    assert sorted(cells) == grid_cells  # none missing, none twice
    for w in writes:
        assert w.box == Box((w.chunk_index[0] * shard_shape[0], w.chunk_index[1] * shard_shape[1]), shard_shape)


def test_fully_replicated_leaf_is_written_once_in_total():
    shards = [ShardInfo(Box((0, 0), (8, 6)), d, _process_of(d), d) for d in range(8)]
    p0 = plan_leaf_write("step_scale", (8, 6), 4, (8, 6), shards, 0)
    p1 = plan_leaf_write("step_scale", (8, 6), 4, (8, 6), shards, 1)
    assert p0.writes == (ChunkWrite((0, 0), Box((0, 0), (8, 6)), 0),)
    assert p1.writes == ()


def test_tiny_replicated_leaf_goes_to_the_lowest_process_from_its_lowest_replica():
    # Mesh whose first device (replica 0) is device 4, on process 1; with equal loads
    # the tie goes to process 0, which copies its own lowest replica (device 0, replica 4).
    shards = _named_shards((8, 6), np.array([[4, 5, 6, 7], [0, 1, 2, 3]]), (None, None))
    assert [(s.device_id, s.replica_id) for s in shards if s.process_index == 0] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    p0 = plan_leaf_write("w", (8, 6), 4, (8, 6), shards, 0)
    p1 = plan_leaf_write("w", (8, 6), 4, (8, 6), shards, 1)
    assert p0.writes == (ChunkWrite((0, 0), Box((0, 0), (8, 6)), 0),)
    assert p1.writes == ()


# --- chunk grid --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, shard_shape",
    [((8, 8), (4, 2)), ((16,), (2,)), ((4, 6, 10), (2, 6, 5)), ((3, 5), (3, 5))],
)
def test_chunk_shape_is_the_shard_shape(shape, shard_shape):
    shards = [ShardInfo(Box((0,) * len(shape), shard_shape), 0, 0, 0)]
    plan = plan_leaf_write("w", shape, 4, shard_shape, shards, 0)
    assert plan.chunk_shape == shard_shape
    assert plan.writes == (ChunkWrite((0,) * len(shape), Box((0,) * len(shape), shard_shape), 0),)


def test_inner_chunk_shape_of_a_large_shard():
    # (2048, 1024) float32 = 8 MiB; halving the longest axis (dim 0 on ties) down to
    # the default target of 8 MiB / 16 = 512 KiB: (1024, 1024) -> (512, 1024) ->
    # (512, 512) -> (256, 512).
    shards = [ShardInfo(Box((0, 0), (2048, 1024)), 0, 0, 0)]
    plan = plan_leaf_write("w", (4096, 4096), 4, (2048, 1024), shards, 0)
    assert plan.inner_chunk_shape == (256, 512)


def test_inner_target_bytes_override():
    # (8, 8) float32 = 256 B; target 64 B: (4, 8) = 128 B -> (4, 4) = 64 B.
    shards = [ShardInfo(Box((0, 0), (8, 8)), 0, 0, 0)]
    assert plan_leaf_write("w", (8, 8), 4, (8, 8), shards, 0).inner_chunk_shape == (8, 8)
    assert plan_leaf_write("w", (8, 8), 4, (8, 8), shards, 0, inner_target_bytes=64).inner_chunk_shape == (4, 4)


def test_writes_are_in_chunk_order():
    shards = list(reversed(_named_shards((8, 8), MESH_2x4, ("data", "model"))))
    plan = plan_leaf_write("w", (8, 8), 4, (4, 2), shards, 0)
    assert [w.chunk_index for w in plan.writes] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert [w.device_id for w in plan.writes] == [0, 1, 2, 3]


# --- edge shapes ----------------------------------------------------------------------------


@pytest.mark.parametrize("process, expected", [(0, (ChunkWrite((), Box((), ()), 0),)), (1, ())])
def test_zero_dimensional_array(process, expected):
    shards = [ShardInfo(Box((), ()), d, _process_of(d), d) for d in range(8)]
    plan = plan_leaf_write("opt/count", (), 4, (), shards, process)
    assert plan.shape == ()
    assert plan.chunk_shape == ()
    assert plan.inner_chunk_shape == ()
    assert plan.writes == expected


def test_zero_dimensional_host_array():
    plan = plan_leaf_write("scale", (), 8, (), [ShardInfo(Box((), ()), -1, 0, 0)], 0)
    assert plan.writes == (ChunkWrite((), Box((), ()), -1),)


@pytest.mark.parametrize(
    "shape, spec, shard_shape, chunk_shape",
    [
        ((0, 8), ("data", "model"), (0, 2), (1, 2)),
        ((4, 0), ("data", None), (2, 0), (2, 1)),
        ((0, 0), (None, None), (0, 0), (1, 1)),
    ],
)
@pytest.mark.parametrize("process", [0, 1])
def test_size_zero_dimensions_give_chunk_dims_of_one_and_no_writes(shape, spec, shard_shape, chunk_shape, process):
    shards = _named_shards(shape, MESH_2x4, spec)
    assert all(s.box.size == 0 for s in shards)
    plan = plan_leaf_write("emb", shape, 4, shard_shape, shards, process)
    assert plan.shape == shape
    assert plan.chunk_shape == chunk_shape
    assert plan.inner_chunk_shape == chunk_shape
    assert plan.writes == ()


def test_size_zero_host_array():
    plan = plan_leaf_write("empty", (0,), 4, (0,), [ShardInfo(Box((0,), (0,)), -1, 0, 0)], 0)
    assert plan.chunk_shape == (1,)
    assert plan.writes == ()


def test_chunk_shape_for():
    assert chunk_shape_for((8, 6), (4, 6)) == (4, 6)
    assert chunk_shape_for((0, 6), (0, 3)) == (1, 3)
    assert chunk_shape_for((), ()) == ()


# --- shardings off the grid --------------------------------------------------------------


@pytest.mark.parametrize(
    "box",
    [
        Box((1, 0), (4, 6)),  # shifted origin
        Box((0, 0), (2, 6)),  # smaller than the shard shape
        Box((0, 3), (4, 3)),  # a column block of a row-sharded grid
        Box((4, 0), (3, 6)),  # short at the array's edge although the shape divides
    ],
)
def test_shard_off_the_chunk_grid_raises_naming_the_leaf(box):
    shards = [ShardInfo(Box((0, 0), (4, 6)), 0, 0, 0), ShardInfo(box, 1, 0, 0)]
    with pytest.raises(UnsupportedValueError, match=re.escape("['params']['mlp']['~']['linear_0']['w']")):
        plan_leaf_write("params/mlp/~/linear_0/w", (8, 6), 4, (4, 6), shards, 0)


def test_unsupported_value_error_is_a_type_error():
    shards = [ShardInfo(Box((1, 0), (4, 6)), 0, 0, 0)]
    with pytest.raises(TypeError):
        plan_leaf_write("w", (8, 6), 4, (4, 6), shards, 0)


# --- replica-parallel writes -----------------------------------------------------------------

MiB = 1 << 20


def _mesh_shards(shape, mesh_shape, spec, devices_per_process):
    """Every device's ShardInfo for NamedSharding(mesh, spec), devices numbered in mesh
    order, `devices_per_process` consecutive devices per process, replica ids in device
    order (JAX's numbering)."""
    boxes = named_shard_boxes(shape, mesh_shape, P(*spec))
    seen = {}
    out = []
    for device, box in enumerate(boxes):
        out.append(ShardInfo(box, device, device // devices_per_process, seen.get(box, 0)))
        seen[box] = seen.get(box, 0) + 1
    return tuple(out)


def _leaf(path, shape, itemsize, mesh_shape, spec, per_process):
    shards = _mesh_shards(shape, mesh_shape, spec, per_process)
    shard_shape = shards[0].box.shape
    return LeafShards(path, tuple(shape), itemsize, tuple(shard_shape), shards)


def _process_bytes(assignments):
    out = {}
    for a in assignments:
        for p, w in a.writes:
            out[p] = out.get(p, 0) + w.box.size * a.itemsize
    return out


def _check_partition(assignment, spec):
    """Every element written exactly once, by a process holding it, from a device holding it."""
    covered = np.zeros(assignment.shape, dtype=np.int32)
    cells = set()
    for p, w in assignment.writes:
        covered[w.box.slices()] += 1
        assert w.chunk_index not in cells
        cells.add(w.chunk_index)
        # Regular grid: the chunk is its grid cell, clipped at the array's edge.
        assert w.box == cell_box(w.chunk_index, assignment.chunk_shape, assignment.shape)
        source = w.shard_box if w.shard_box is not None else w.box
        assert any(s.box == source and s.device_id == w.device_id and s.process_index == p for s in spec.shards)
        assert w.box.intersect(source) == w.box
    if all(d > 0 for d in assignment.shape):
        assert (covered == 1).all()
    for c, s in zip(assignment.chunk_shape, spec.shard_shape):
        assert s % c == 0 or s == 0


@pytest.mark.parametrize(
    "shard_shape, itemsize, replicas, floor, expected",
    [
        ((1024, 1024), 4, 1, MiB, (None, 1)),  # one process: today's layout
        ((1024, 1024), 4, 4, MiB, (0, 4)),  # 4 MiB / 4 = 1 MiB, the floor itself
        ((6, 1 << 18), 4, 4, MiB, (1, 4)),  # (a): 4 divides only dimension 1
        ((4096, 12), 4, 3, 1, (1, 3)),  # (a): the first dimension R divides, not the largest
        ((4096, 1024), 4, 3, MiB, (0, 16)),  # (b): 3 divides nothing; smallest divisor >= 12 is 16
        ((1021, 1021), 4, 2, 1, (0, 1021)),  # (b): prime; the only divisor >= 8 is the whole length
        ((1024, 1024), 4, 8, MiB, (0, 4)),  # (c): 8 chunks would be 512 KiB; 4 are 1 MiB
        ((1024, 1024), 4, 3, MiB, (0, 2)),  # (c): 16 chunks of 256 KiB are too small; 2 of 2 MiB
        ((512, 1024), 4, 4, MiB, (0, 2)),  # (c): 2 MiB: two chunks of 1 MiB for four holders
        ((1021, 1021), 4, 4, MiB, (None, 1)),  # no divisor fits: written whole
        ((256, 1024), 4, 4, MiB, (None, 1)),  # 1 MiB: no chunk would reach the floor
        ((0, 64), 4, 4, 1, (None, 1)),  # empty
        ((), 4, 4, 1, (None, 1)),  # scalar
    ],
)
def test_split_rule(shard_shape, itemsize, replicas, floor, expected):
    assert split_rule(shard_shape, itemsize, replicas, floor) == expected


def test_replicated_leaf_over_four_processes_is_split_into_one_chunk_each():
    # 4 processes x 2 devices, fully replicated (1024, 1024) float32 = 4 MiB.
    spec = _leaf("w", (1024, 1024), 4, {"data": 4, "model": 2}, (None, None), 2)
    (a,) = plan_writes([spec])
    assert (a.chunk_shape, a.split_dim, a.split_factor, a.replicas) == ((256, 1024), 0, 4, 4)
    assert a.writes == tuple(
        (p, ChunkWrite((p, 0), Box((256 * p, 0), (256, 1024)), 2 * p, Box((0, 0), (1024, 1024)))) for p in range(4)
    )
    _check_partition(a, spec)


def test_data_x_model_parallel_leaf_splits_each_model_shard_over_its_data_replicas():
    # data=4 across processes, model=2 inside each; P(None, 'model') on (2048, 1024)
    # float32: shards (2048, 512) = 4 MiB, each held by all 4 processes -> 4 x 1 MiB.
    spec = _leaf("w", (2048, 1024), 4, {"data": 4, "model": 2}, (None, "model"), 2)
    (a,) = plan_writes([spec])
    assert a.chunk_shape == (512, 512) and a.split_factor == 4
    assert _process_bytes([a]) == {p: 2 * MiB for p in range(4)}
    mine = a.for_process(1).writes
    assert [w.chunk_index for w in mine] == [(1, 0), (1, 1)]
    assert [w.device_id for w in mine] == [2, 3]  # the column shard's own device on process 1
    _check_partition(a, spec)


def test_model_sharded_across_processes_is_not_split():
    # model=4 across processes (each box held by one process): the layout of today.
    spec = _leaf("w", (2048, 1024), 4, {"model": 4, "data": 2}, (None, "model"), 2)
    (a,) = plan_writes([spec])
    assert a.split_factor == 1 and a.chunk_shape == (2048, 256) and a.replicas == 1
    assert [(p, w.chunk_index, w.shard_box) for p, w in a.writes] == [(p, (0, p), None) for p in range(4)]


def test_single_process_layout_is_unchanged():
    spec = _leaf("w", (2048, 1024), 4, {"data": 2, "model": 4}, ("data", "model"), 8)
    (a,) = plan_writes([spec])
    assert a.chunk_shape == (1024, 256) and a.split_factor == 1
    assert [w.device_id for _, w in a.writes] == list(range(8))
    assert all(p == 0 and w.shard_box is None for p, w in a.writes)


@pytest.mark.parametrize("processes", [2, 3, 4, 8])
def test_thousands_of_small_replicated_leaves_are_spread_by_bytes(processes):
    sizes = [(i * 37) % 500 + 1 for i in range(2000)]  # 4 .. 2000 bytes each, float32
    leaves = [_leaf(f"l{i}", (n,), 4, {"d": 24}, (None,), 24 // processes) for i, n in enumerate(sizes)]
    plan = plan_writes(leaves)
    assert all(a.split_factor == 1 for a in plan)
    loads = _process_bytes(plan)
    assert sorted(loads) == list(range(processes))
    assert sum(loads.values()) == 4 * sum(sizes)
    # Greedy, largest first: no process more than one largest leaf above the least.
    assert max(loads.values()) - min(loads.values()) <= 4 * max(sizes)
    assert plan_writes(leaves) == plan  # deterministic


def test_spreading_counts_bytes_already_assigned_by_splits_and_single_holders():
    # Process 0 alone holds a large box; the small replicated leaves go to the others first.
    big = LeafShards("big", (4096,), 4, (4096,), (ShardInfo(Box((0,), (4096,)), 0, 0, 0),))
    small = [_leaf(f"s{i}", (64,), 4, {"d": 4}, (None,), 1) for i in range(30)]
    plan = plan_writes([big, *small])
    loads = _process_bytes(plan)
    assert loads[0] == 4096 * 4  # nothing small landed on process 0: 30 x 256 B fit on 1..3
    assert loads[1] == loads[2] == loads[3] == 10 * 256


def test_uneven_split_rotates_chunks_over_the_holders():
    # 3 processes x 1 device; (3 * 1024, 4096) would divide by 3, so take (4096, 4096)
    # float32 = 64 MiB, replicated: 3 divides nothing; k = 16 chunks of 4 MiB.
    spec = _leaf("w", (4096, 4096), 4, {"d": 3}, (None, None), 1)
    (a,) = plan_writes([spec])
    assert (a.split_dim, a.split_factor) == (0, 16)
    counts = [sum(1 for p, _ in a.writes if p == q) for q in range(3)]
    assert counts == [6, 5, 5]  # within 25 % of 16 / 3
    _check_partition(a, spec)


MESHES = [
    ({"data": 4, "model": 2}, 2),
    ({"data": 2, "model": 4}, 2),
    ({"data": 8, "model": 1}, 2),
    ({"data": 2, "model": 4}, 4),
    ({"data": 4, "model": 2}, 1),
    ({"data": 8, "model": 1}, 8),
]
SPECS = [(None, None), ("data", None), (None, "model"), ("data", "model"), (("data", "model"), None), ("model", "data")]


@pytest.mark.parametrize("mesh_shape, per_process", MESHES)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape, itemsize", [((512, 256), 4), ((64, 8), 2), ((1024, 2048), 2)])
def test_every_element_is_written_once_by_a_holder(mesh_shape, per_process, spec, shape, itemsize):
    leaf = _leaf("w", shape, itemsize, mesh_shape, spec, per_process)
    (a,) = plan_writes([leaf], split_floor_bytes=4096)
    _check_partition(a, leaf)
    # Deduplicated: the bytes written over all processes are the leaf's bytes.
    assert sum(_process_bytes([a]).values()) == math.prod(shape) * itemsize
    holders = {s.box: {t.process_index for t in leaf.shards if t.box == s.box} for s in leaf.shards}
    r = max(len(h) for h in holders.values())
    assert a.replicas == r
    if a.split_factor > 1 and a.split_factor % r == 0:  # an even split: exactly 1/R each
        loads = _process_bytes([a])
        assert len(set(loads.values())) == 1


# --- plan_save (abstract trees, any process count) --------------------------------------------


def _abstract(shape, dtype, mesh, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))


def test_plan_save_of_an_abstract_tree_for_1024_processes():
    mesh = jax.sharding.AbstractMesh((128, 64), ("data", "fsdp"))
    tree = {
        "w": _abstract((8192, 8192), jnp.bfloat16, mesh, ("fsdp", None)),  # 2 MiB shards, 128 holders each
        "scale": _abstract((8192,), jnp.float32, mesh, ()),
        "host": np.zeros((4,), np.float32),
        "step": 3,
    }
    plan = ckpt.plan_save(tree, processes=1024)
    assert plan.process_count == 1024 and len(plan.processes) == 1024
    by_path = {a.leaf_path: a for a in plan.leaves}
    w, host = by_path["w"], by_path["host"]
    # 8 devices per process: each fsdp box is held by 128 processes (the data axis); its
    # 2 MiB shard splits in two chunks of 1 MiB (rule (c)), spread over the holders.
    assert (w.replicas, w.split_factor, w.chunk_shape) == (128, 2, (64, 8192))
    assert len({p for p, _ in w.writes}) == 128
    assert host.writes[0][0] == 0
    assert plan.data_bytes == 8192 * 8192 * 2 + 8192 * 4 + 16
    assert plan.files == 128 + 1 + 1


def test_plan_save_needs_a_process_count_for_an_abstract_mesh():
    mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
    with pytest.raises(ckpt.MeshError, match="processes"):
        ckpt.plan_save({"w": _abstract((8, 8), jnp.float32, mesh, ())})
    with pytest.raises(ckpt.MeshError, match="3 processes do not divide"):
        ckpt.plan_save({"w": _abstract((8, 8), jnp.float32, mesh, ())}, processes=3)


def test_plan_save_of_concrete_arrays_in_one_process_is_todays_layout():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    x = jax.device_put(np.zeros((1024, 1024), np.float32), NamedSharding(mesh, P()))
    plan = ckpt.plan_save({"x": x})
    assert plan.process_count == 1
    (leaf,) = plan.leaves
    assert leaf.chunk_shape == (1024, 1024) and leaf.split_factor == 1
    assert plan.processes[0].data_bytes == 4 << 20 and plan.processes[0].files == 1
    # The same arrays planned as 4 processes of 2 devices: one MiB each.
    four = ckpt.plan_save({"x": x}, processes=4)
    assert [p.data_bytes for p in four.processes] == [1 << 20] * 4


def test_shared_leaf_shards_take_their_paths():
    """Leaves of one layout may share one `LeafShards` (the save does): each assignment
    carries the path given beside it, and the plan is the one of separate specs."""
    shards = (ShardInfo(Box((0,), (8,)), 0, 0, 0),)
    shared = LeafShards("a", (8,), 4, (8,), shards)
    paths = ["a", "b", "c"]
    together = plan_writes([shared] * 3, paths=paths)
    apart = plan_writes([LeafShards(p, (8,), 4, (8,), shards) for p in paths])
    assert [a.leaf_path for a in together] == paths
    assert together == apart
