"""Save planning: replica dedup across processes, the chunk grid, edge shapes.

Pure: every input is a hand-built `ShardInfo` list; no devices, no disk. The shard
lists model what JAX's `addressable_shards` report for a `NamedSharding` on a 2x4 mesh
(`data` x `model`) whose devices 0-3 live on process 0 and 4-7 on process 1.
"""

import itertools
import re

import numpy as np
import pytest

from checkpointer._box import Box
from checkpointer._errors import UnsupportedValueError
from checkpointer._save_plan import ChunkWrite, ShardInfo, chunk_shape_for, plan_leaf_write

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


def test_process_without_replica_zero_writes_nothing():
    # P('model', None): rows split over 'model', replicated over 'data'; every replica 0
    # is in mesh row 0, i.e. on process 0.
    shards = _named_shards((8, 6), MESH_2x4, ("model", None))
    p0 = plan_leaf_write("w", (8, 6), 4, (2, 6), shards, 0)
    p1 = plan_leaf_write("w", (8, 6), 4, (2, 6), shards, 1)
    assert p0.writes == tuple(ChunkWrite((i, 0), Box((2 * i, 0), (2, 6)), i) for i in range(4))
    assert p1.writes == ()
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
            # Written by a replica_id == 0 holder of exactly that box on this process.
            assert ShardInfo(w.box, w.device_id, process, 0) in shards
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


def test_fully_replicated_leaf_is_written_by_the_process_holding_replica_zero():
    # Mesh whose first device (replica 0) is device 4, on process 1.
    shards = _named_shards((8, 6), np.array([[4, 5, 6, 7], [0, 1, 2, 3]]), (None, None))
    assert [(s.device_id, s.replica_id) for s in shards if s.replica_id == 0] == [(4, 0)]
    p0 = plan_leaf_write("w", (8, 6), 4, (8, 6), shards, 0)
    p1 = plan_leaf_write("w", (8, 6), 4, (8, 6), shards, 1)
    assert p0.writes == ()
    assert p1.writes == (ChunkWrite((0, 0), Box((0, 0), (8, 6)), 4),)


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
    with pytest.raises(UnsupportedValueError, match=re.escape("'params/mlp/~/linear_0/w'")):
        plan_leaf_write("params/mlp/~/linear_0/w", (8, 6), 4, (4, 6), shards, 0)


def test_unsupported_value_error_is_a_type_error():
    shards = [ShardInfo(Box((1, 0), (4, 6)), 0, 0, 0)]
    with pytest.raises(TypeError):
        plan_leaf_write("w", (8, 6), 4, (4, 6), shards, 0)
