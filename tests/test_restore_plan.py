"""Restore planning: exact chunk reads, unique-box dedup, bytes and read amplification.

Pure: stored leaves are hand-built `ArrayMetadata`, target shards hand-built boxes; no
devices, no disk. Expected reads and byte counts are worked out by hand in comments.
"""

import itertools

import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from checkpointer._encoding import plan_leaf
from checkpointer._encoding._leaf_plan import ChunkRead, PeerPiece, RestorePlan
from checkpointer._format._box import Box, row_slabs
from checkpointer._format._leaves import ArrayMetadata, SavedSharding
from checkpointer._format._sharding import named_shard_boxes
from checkpointer._restore._plan import build_plan, exchange_spec
from checkpointer._restore._targets import LeafTarget, ResolvedLeaf, ResolvedTarget

F32 = np.dtype(np.float32)
N = 4096

# 4096x4096 float32 saved with P('data', 'model') on a 2x4 mesh: 8 chunks of (2048, 1024),
# inner chunks (512, 512) = 1 MiB, so 4 x 2 = 8 inner chunks per zarr shard file.
SAVED_2x4 = ArrayMetadata(
    "params/w", (N, N), F32, (2048, 1024), (512, 512),
    SavedSharding("named", ("data", "model"), (2, 4), ("data", "model"), (2048, 1024), 8),
)
INNER_1MIB = 512 * 512 * 4  # 1_048_576
INDEX_8 = 8 * 16 + 4  # shard index of 8 inner chunks, with its crc32c
READ_4_OF_8 = 4 * (INNER_1MIB + 4) + INDEX_8  # 4_194_452
READ_8_OF_8 = 8 * (INNER_1MIB + 4) + INDEX_8  # 8_388_772
WHOLE_BYTES = N * N * 4  # 67_108_864


def _target_boxes(shape, grid_shape, axis_names, spec):
    """(device id, box) of NamedSharding(mesh of ids arange(prod).reshape(grid_shape), spec):
    the library's pure sharding emulator (cross-checked against JAX in test_inputs.py)."""
    return list(enumerate(named_shard_boxes(shape, dict(zip(axis_names, grid_shape)), P(*spec))))


def _read(chunk, origin, shape, inner_chunks, bytes_read, leaf="params/w"):
    """The planned facts of a chunk read that these tests work out by hand."""
    key = f"arrays/{leaf}/c/" + "/".join(map(str, chunk)) if chunk else f"arrays/{leaf}/c"
    return (chunk, key, Box(origin, shape), inner_chunks, bytes_read)


def _brief(read: ChunkRead):
    return (read.chunk_index, read.chunk_key, read.box, read.inner_chunks, read.bytes_read)


def BoxBrief(box, device_ids, reads, bytes_needed):
    return (box, device_ids, tuple(reads), bytes_needed)


def _boxes(plan):
    """`plan.boxes` with each chunk read reduced to `_read`'s facts."""
    return tuple((b.box, b.device_ids, tuple(_brief(r) for r in b.reads), b.bytes_needed) for b in plan.boxes)


# --- exact reads -------------------------------------------------------------------------------


def test_target_boxes_helper():
    # 4x2 mesh, P('data', 'model'): device d sits at (d // 2, d % 2).
    assert _target_boxes((N, N), (4, 2), ("data", "model"), ("data", "model"))[:3] == [
        (0, Box((0, 0), (1024, 2048))),
        (1, Box((0, 2048), (1024, 2048))),
        (2, Box((1024, 0), (1024, 2048))),
    ]


# Onto a 4x2 mesh with P('data', 'model'): target shards (1024, 2048). A target box covers
# half the rows of one chunk row and two whole chunk columns: 2 reads of a (1024, 1024)
# region each, i.e. 2 x 2 = 4 of the 8 inner chunks.
EXPECTED_4x2_PROCESS_0 = (
    BoxBrief(Box((0, 0), (1024, 2048)), (0,), (
        _read((0, 0), (0, 0), (1024, 1024), 4, READ_4_OF_8),
        _read((0, 1), (0, 1024), (1024, 1024), 4, READ_4_OF_8),
    ), 1024 * 2048 * 4),
    BoxBrief(Box((0, 2048), (1024, 2048)), (1,), (
        _read((0, 2), (0, 2048), (1024, 1024), 4, READ_4_OF_8),
        _read((0, 3), (0, 3072), (1024, 1024), 4, READ_4_OF_8),
    ), 1024 * 2048 * 4),
    BoxBrief(Box((1024, 0), (1024, 2048)), (2,), (
        _read((0, 0), (1024, 0), (1024, 1024), 4, READ_4_OF_8),
        _read((0, 1), (1024, 1024), (1024, 1024), 4, READ_4_OF_8),
    ), 1024 * 2048 * 4),
    BoxBrief(Box((1024, 2048), (1024, 2048)), (3,), (
        _read((0, 2), (1024, 2048), (1024, 1024), 4, READ_4_OF_8),
        _read((0, 3), (1024, 3072), (1024, 1024), 4, READ_4_OF_8),
    ), 1024 * 2048 * 4),
)
EXPECTED_4x2_PROCESS_1 = (
    BoxBrief(Box((2048, 0), (1024, 2048)), (4,), (
        _read((1, 0), (2048, 0), (1024, 1024), 4, READ_4_OF_8),
        _read((1, 1), (2048, 1024), (1024, 1024), 4, READ_4_OF_8),
    ), 1024 * 2048 * 4),
    BoxBrief(Box((2048, 2048), (1024, 2048)), (5,), (
        _read((1, 2), (2048, 2048), (1024, 1024), 4, READ_4_OF_8),
        _read((1, 3), (2048, 3072), (1024, 1024), 4, READ_4_OF_8),
    ), 1024 * 2048 * 4),
    BoxBrief(Box((3072, 0), (1024, 2048)), (6,), (
        _read((1, 0), (3072, 0), (1024, 1024), 4, READ_4_OF_8),
        _read((1, 1), (3072, 1024), (1024, 1024), 4, READ_4_OF_8),
    ), 1024 * 2048 * 4),
    BoxBrief(Box((3072, 2048), (1024, 2048)), (7,), (
        _read((1, 2), (3072, 2048), (1024, 1024), 4, READ_4_OF_8),
        _read((1, 3), (3072, 3072), (1024, 1024), 4, READ_4_OF_8),
    ), 1024 * 2048 * 4),
)


@pytest.mark.parametrize("process, expected", [(0, EXPECTED_4x2_PROCESS_0), (1, EXPECTED_4x2_PROCESS_1)])
def test_2x4_to_4x2_exact_reads(process, expected):
    boxes = _target_boxes((N, N), (4, 2), ("data", "model"), ("data", "model"))
    local = [(d, b) for d, b in boxes if d // 4 == process]
    plan = plan_leaf(SAVED_2x4, local)
    assert plan.leaf_path == "params/w"
    assert plan.shape == (N, N)
    assert plan.dtype == F32
    assert _boxes(plan) == expected
    assert plan.bytes_needed == 4 * 1024 * 2048 * 4  # 32 MiB, half the array
    # 8 chunk reads of 4 files (two boxes each): each file's index is read once.
    assert plan.bytes_read == 8 * READ_4_OF_8 - 4 * (8 * 16 + 4)


def test_2x4_to_one_device_exact_reads():
    plan = plan_leaf(SAVED_2x4, {0: Box((0, 0), (N, N))})
    expected_reads = tuple(
        _read((i, j), (2048 * i, 1024 * j), (2048, 1024), 8, READ_8_OF_8) for i in range(2) for j in range(4)
    )
    assert _boxes(plan) == (BoxBrief(Box((0, 0), (N, N)), (0,), expected_reads, WHOLE_BYTES),)
    assert plan.bytes_read == 67_110_176  # 8 x 8_388_772
    assert plan.bytes_needed == 67_108_864


def test_chunk_keys_use_the_escaped_leaf_path():
    meta = ArrayMetadata("mlp%2F~%2Flinear_0/w", (4, 4), F32, (2, 4), (2, 4), None, None, "numpy")
    plan = plan_leaf(meta, {0: Box((0, 0), (4, 4))})
    assert [r.chunk_key for r in plan.boxes[0].reads] == ["arrays/mlp%2F~%2Flinear_0/w/c/0/0", "arrays/mlp%2F~%2Flinear_0/w/c/1/0"]


def test_root_leaf_chunk_key():
    meta = ArrayMetadata("", (4,), F32, (4,), (4,), None, None, "numpy")
    plan = plan_leaf(meta, {0: Box((0,), (4,))})
    assert plan.boxes[0].reads[0].chunk_key == "arrays/%root/c/0"


def test_zero_dimensional_leaf():
    meta = ArrayMetadata("opt/count", (), np.dtype(np.int64), (), (), None)
    plan = plan_leaf(meta, {0: Box((), ()), 1: Box((), ())})
    # One inner chunk of 8 B + crc32c, an index of one entry + crc32c: 12 + 16 + 4.
    assert _boxes(plan) == (BoxBrief(Box((), ()), (0, 1), (_read((), (), (), 1, 32, leaf="opt/count"),), 8),)


def test_size_zero_leaf_reads_nothing():
    meta = ArrayMetadata("emb", (0, 8), F32, (1, 2), (1, 2), None)
    plan = plan_leaf(meta, {0: Box((0, 0), (0, 2)), 1: Box((0, 2), (0, 2))})
    assert [b.reads for b in plan.boxes] == [(), ()]
    assert plan.bytes_needed == 0
    assert plan.bytes_read == 0
    assert RestorePlan("/ckpt", 0, (plan,)).read_amplification == 1.0


def test_empty_restore_plan():
    plan = RestorePlan("/ckpt", 0, ())
    assert plan.reads == ()
    assert (plan.bytes_needed, plan.bytes_read, plan.read_amplification) == (0, 0, 1.0)


# --- unique boxes --------------------------------------------------------------------------------


def test_devices_holding_the_same_box_share_one_read():
    # P('data', None) on a 2x4 mesh: process 0's four devices all hold rows [0, 2048).
    boxes = _target_boxes((N, N), (2, 4), ("data", "model"), ("data", None))
    local = [(d, b) for d, b in boxes if d < 4]
    plan = plan_leaf(SAVED_2x4, local)
    expected_reads = tuple(_read((0, j), (0, 1024 * j), (2048, 1024), 8, READ_8_OF_8) for j in range(4))
    assert _boxes(plan) == (BoxBrief(Box((0, 0), (2048, N)), (0, 1, 2, 3), expected_reads, 2048 * N * 4),)
    assert plan.bytes_needed == WHOLE_BYTES // 2


def test_device_ids_sorted_and_boxes_in_box_order_whatever_the_input_order():
    a, b = Box((2048, 0), (2048, N)), Box((0, 0), (2048, N))
    plan = plan_leaf(SAVED_2x4, [(7, a), (3, b), (5, a), (1, b), (2, b)])
    assert [(x.box, x.device_ids) for x in plan.boxes] == [(b, (1, 2, 3)), (a, (5, 7))]


def test_mapping_and_pairs_give_the_same_plan():
    pairs = _target_boxes((N, N), (2, 4), ("data", "model"), ("model", "data"))
    assert plan_leaf(SAVED_2x4, dict(pairs)) == plan_leaf(SAVED_2x4, pairs)


def test_fully_replicated_target_reads_each_chunk_once():
    boxes = _target_boxes((N, N), (2, 4), ("data", "model"), ())
    plan = plan_leaf(SAVED_2x4, boxes)
    assert len(plan.boxes) == 1
    assert plan.boxes[0].device_ids == tuple(range(8))
    assert [r.chunk_index for r in plan.boxes[0].reads] == [(i, j) for i in range(2) for j in range(4)]
    assert plan.bytes_needed == WHOLE_BYTES


@pytest.mark.parametrize(
    "dtype, itemsize",
    [(np.float32, 4), (ml_dtypes.bfloat16, 2), (np.int8, 1), (np.complex128, 16), (np.bool_, 1)],
)
def test_bytes_needed_is_box_bytes(dtype, itemsize):
    meta = ArrayMetadata("x", (64, 64), np.dtype(dtype), (32, 64), (32, 64), None)
    plan = plan_leaf(meta, {0: Box((8, 0), (16, 32)), 1: Box((0, 0), (64, 64))})
    assert [b.bytes_needed for b in plan.boxes] == [64 * 64 * itemsize, 16 * 32 * itemsize]
    assert plan.bytes_needed == (64 * 64 + 16 * 32) * itemsize


# --- bytes read --------------------------------------------------------------------------------


# (8, 8) float32 in chunks of (4, 8) with inner chunks (2, 4): 2 x 2 = 4 inner chunks of
# 32 B per shard file, whose index is 4 * 16 + 4 = 68 B. A chunk read costs
# (inner chunks touched) * (32 + 4) + 68.
SMALL = ArrayMetadata("small", (8, 8), F32, (4, 8), (2, 4), None)


def test_bytes_read_small_case_by_hand():
    plan = plan_leaf(SMALL, {0: Box((1, 0), (4, 8)), 1: Box((0, 3), (8, 2)), 2: Box((5, 5), (1, 1))})
    assert _boxes(plan) == (
        # Columns 3-4 straddle both inner columns; rows 0-3 both inner rows: 4 + 4.
        BoxBrief(Box((0, 3), (8, 2)), (1,), (
            ((0, 0), "arrays/small/c/0/0", Box((0, 3), (4, 2)), 4, 4 * 36 + 68),
            ((1, 0), "arrays/small/c/1/0", Box((4, 3), (4, 2)), 4, 4 * 36 + 68),
        ), 8 * 2 * 4),
        # Rows 1-3 of chunk 0 touch inner rows 0 and 1 (x 2 columns); row 4 is inner row 0
        # of chunk 1 (x 2 columns).
        BoxBrief(Box((1, 0), (4, 8)), (0,), (
            ((0, 0), "arrays/small/c/0/0", Box((1, 0), (3, 8)), 4, 4 * 36 + 68),
            ((1, 0), "arrays/small/c/1/0", Box((4, 0), (1, 8)), 2, 2 * 36 + 68),
        ), 4 * 8 * 4),
        # Element (5, 5): chunk 1, local (1, 5), inner chunk (0, 1) only.
        BoxBrief(Box((5, 5), (1, 1)), (2,), (
            ((1, 0), "arrays/small/c/1/0", Box((5, 5), (1, 1)), 1, 36 + 68),
        ), 4),
    )
    assert [b.bytes_read for b in plan.boxes] == [424, 352, 104]
    rp = RestorePlan("/ckpt/7", 0, (plan,))
    assert rp.bytes_needed == 196
    # The leaf's boxes are read together: each file's index and each inner chunk once
    # (2 files x (4 inner chunks + index)), not once per box (880).
    assert rp.bytes_read == 2 * (4 * 36 + 68) == 424
    assert rp.read_amplification == 424 / 196
    assert len(rp.reads) == 5


def test_bytes_read_with_non_square_inner_chunks_and_wide_items():
    # complex128 (16 B), chunk (6, 4), inner (3, 2): 2 x 2 = 4 inner chunks of 96 B,
    # index 4 * 16 + 4 = 68 B. Box rows 2-3, cols 1-2 touches inner rows 0 and 1 and
    # inner cols 0 and 1: 4 inner chunks.
    meta = ArrayMetadata("c", (6, 4), np.dtype(np.complex128), (6, 4), (3, 2), None)
    plan = plan_leaf(meta, {0: Box((2, 1), (2, 2))})
    assert tuple(map(_brief, plan.boxes[0].reads)) == (_read((0, 0), (2, 1), (2, 2), 4, 4 * 100 + 68, leaf="c"),)
    assert plan.bytes_needed == 4 * 16


# --- read amplification ------------------------------------------------------------------------


def _saved(chunk, inner):
    return ArrayMetadata("w", (N, N), F32, chunk, inner, None)


# Each case: saved chunk and inner chunk shapes, the target sharding (mesh shape, axis
# names, spec) restored by one process holding every target device, and by hand: the number
# of chunk reads, inner chunks each read touches, inner chunks per shard file, and the
# bytes of unique target boxes.
AMPLIFICATION_CASES = {
    # (2048, 1024) chunks; target (1024, 2048): 8 boxes x 2 chunks, 2 x 2 inner each.
    "P(data,model)->P(model,data)": ((2048, 1024), (512, 512), ((2, 4), ("data", "model"), ("model", "data")), 16, 4, 8, WHOLE_BYTES),
    "2x4->4x2": ((2048, 1024), (512, 512), ((4, 2), ("data", "model"), ("data", "model")), 16, 4, 8, WHOLE_BYTES),
    # 8 -> 4 devices: target (2048, 2048), 4 boxes x 2 whole chunks.
    "8->4 devices": ((2048, 1024), (512, 512), ((2, 2), ("data", "model"), ("data", "model")), 8, 8, 8, WHOLE_BYTES),
    "8->1 device": ((2048, 1024), (512, 512), ((1,), ("x",), ()), 8, 8, 8, WHOLE_BYTES),
    # Saved on 4 devices (2048, 2048): inner (512, 512), 16 per file; onto 1 device.
    "4->1 device": ((2048, 2048), (512, 512), ((1,), ("x",), ()), 4, 16, 16, WHOLE_BYTES),
    # Sharded -> replicated on 8 devices: one unique box, 8 whole chunks.
    "sharded->replicated": ((2048, 1024), (512, 512), ((2, 4), ("data", "model"), ()), 8, 8, 8, WHOLE_BYTES),
    # 1-D mesh P('x') (512, 4096) chunks -> 2x4 P('data','model') (2048, 1024): 8 boxes x
    # 4 chunks, each a (512, 1024) region = 2 inner chunks.
    "1-D->2-D mesh": ((512, N), (512, 512), ((2, 4), ("data", "model"), ("data", "model")), 32, 2, 8, WHOLE_BYTES),
    # Column-sharded (4096, 512) -> row-sharded (512, 4096): 8 boxes x 8 chunks of one inner chunk.
    "P(None,x)->P(x,None)": ((N, 512), (512, 512), ((8,), ("x",), ("x", None)), 64, 1, 8, WHOLE_BYTES),
}


@pytest.mark.parametrize("case", list(AMPLIFICATION_CASES), ids=list(AMPLIFICATION_CASES))
def test_aligned_power_of_two_resharding_reads_only_index_overhead(case):
    chunk, inner, (grid, axes, spec), n_reads, touched, n_inner, needed = AMPLIFICATION_CASES[case]
    plan = RestorePlan("/ckpt", 0, (plan_leaf(_saved(chunk, inner), _target_boxes((N, N), grid, axes, spec)),))
    assert len(plan.reads) == n_reads
    assert all(r.inner_chunks == touched for r in plan.reads)
    files = len({r.chunk_key for r in plan.reads})  # each file's index is read once
    overhead = n_reads * touched * 4 + files * (n_inner * 16 + 4)  # crc32c per inner chunk + index + its crc32c
    assert plan.bytes_needed == needed
    assert plan.bytes_read == needed + overhead  # not one data byte more than needed
    assert plan.read_amplification == 1.0 + overhead / needed
    assert plan.read_amplification < 1.05


def test_restore_plan_totals_over_leaves():
    a = plan_leaf(SMALL, {0: Box((1, 0), (4, 8))})
    b = plan_leaf(SAVED_2x4, {0: Box((0, 0), (N, N))})
    plan = RestorePlan("/ckpt", 3, (a, b))
    assert plan.bytes_needed == 128 + WHOLE_BYTES
    assert plan.bytes_read == 352 + 67_110_176
    assert len(plan.reads) == 2 + 8
    assert plan.read_amplification == (352 + 67_110_176) / (128 + WHOLE_BYTES)


# --- __str__ --------------------------------------------------------------------------------------


def test_str_lists_leaves_and_totals():
    small = plan_leaf(SMALL, {0: Box((1, 0), (4, 8)), 1: Box((0, 3), (8, 2)), 2: Box((5, 5), (1, 1))})
    big = plan_leaf(SAVED_2x4, {0: Box((0, 0), (N, N))})
    root = plan_leaf(ArrayMetadata("", (), F32, (), (), None), {0: Box((), ())})
    text = str(RestorePlan("/ckpt/100", 1, (small, big, root)))
    lines = text.splitlines()
    assert lines[0] == "RestorePlan for /ckpt/100 (process 1)"
    rows = {line.split()[0]: line.split() for line in lines[1:] if not set(line) <= {"-", " "}}
    assert rows["['small']"] == ["['small']", "8x8", "float32", "3", "5", "196", "B", "424", "B", "2.163"]  # by key string
    assert rows["['params']['w']"] == ["['params']['w']", "4096x4096", "float32", "1", "8", "64.0", "MiB", "64.0", "MiB", "1.000"]
    # The 0-d root leaf: 4 B needed, 4 + 4 + 16 + 4 = 28 B read.
    assert rows["<root>"] == ["<root>", "()", "float32", "1", "1", "4", "B", "28", "B", "7.000"]
    # Totals: 13 + 1 reads; 196 + 64 MiB + 4 needed.
    assert rows["total"] == ["total", "14", "64.0", "MiB", "64.0", "MiB", "1.000"]


# --- what a chunk read carries for the reader -----------------------------------------------------


def test_chunk_read_names_storage_and_destination_by_hand():
    # SMALL, box rows 1-4 (all columns): chunk 0 gives rows 1-3, chunk-local (1, 0)-(4, 8).
    # Inner grid (2, 2) of (2, 4): rows 1-3 touch inner rows 0 (row 1) and 1 (rows 2-3),
    # columns 0-7 touch inner columns 0 and 1: ids 0, 1, 2, 3 in C order.
    plan = plan_leaf(SMALL, {0: Box((1, 0), (4, 8))})
    r0, r1 = plan.boxes[0].reads
    assert r0.local_box == Box((1, 0), (3, 8))
    assert (r0.file_bytes, r0.index_offset, r0.index_bytes, r0.inner_bytes_with_crc) == (4 * 36 + 68, 144, 68, 36)
    assert r0.inner_ids == (0, 1, 2, 3)
    # (source start in the inner chunk, destination start in the box buffer, length)
    assert r0.spans == (((1, 0, 1), (0, 1, 2)), ((0, 0, 4), (0, 4, 4)))
    # Chunk 1 gives row 4 (its local row 0): inner row 0 only, into box row 3.
    assert r1.local_box == Box((0, 0), (1, 8))
    assert r1.inner_ids == (0, 1)
    assert r1.spans == (((0, 3, 1),), ((0, 0, 4), (0, 4, 4)))


def test_chunk_read_spans_rebuild_the_box_exactly():
    # Executing the spans with numpy, as the reader does, gives the box of the global array.
    rng = np.random.default_rng(0)
    meta = ArrayMetadata("x", (12, 10), F32, (6, 8), (3, 4), None)  # edge chunks hold 2 of 8 columns
    whole = rng.standard_normal(meta.shape).astype(np.float32)
    layout_grid = (2, 2)
    for box in (Box((1, 2), (9, 7)), Box((5, 0), (2, 10)), Box((0, 9), (12, 1))):
        out = np.full(box.shape, np.nan, np.float32)
        for r in plan_leaf(meta, {0: box}).boxes[0].reads:
            origin = tuple(c * s for c, s in zip(r.chunk_index, meta.chunk_shape))
            padded = np.zeros(meta.chunk_shape, np.float32)
            stored = whole[tuple(slice(o, o + s) for o, s in zip(origin, meta.chunk_shape))]
            padded[: stored.shape[0], : stored.shape[1]] = stored
            for inner_id, spans in zip(r.inner_ids, itertools.product(*r.spans)):
                cell = np.unravel_index(inner_id, layout_grid)
                inner = padded[tuple(slice(c * i, (c + 1) * i) for c, i in zip(cell, meta.inner_chunk_shape))]
                out[tuple(slice(d, d + n) for _, d, n in spans)] = inner[tuple(slice(s_, s_ + n) for s_, _, n in spans)]
        np.testing.assert_array_equal(out, whole[box.slices()])


def test_slabs_are_planned_within_the_bound_and_cover_the_box():
    plan = plan_leaf(SAVED_2x4, {0: Box((0, 0), (N, N))}, slab_bytes=10 << 20)
    (box,) = plan.boxes
    rows = (10 << 20) // (N * 4)  # 640 rows of 16 KiB
    assert [s.box for s in box.slabs] == [Box((r, 0), (min(rows, N - r), N)) for r in range(0, N, rows)]
    assert all(s.bytes_needed <= 10 << 20 and s.device_ids == (0,) and not s.slabs for s in box.slabs)
    assert sum(s.bytes_needed for s in box.slabs) == box.bytes_needed
    # A slab's reads are relative to the slab: the first read of slab 1 lands at row 0.
    assert box.slabs[1].reads[0].spans[0][0][1] == 0
    assert box.bytes_read == sum(s.bytes_read for s in box.slabs) > sum(r.bytes_read for r in box.reads)
    assert plan_leaf(SAVED_2x4, {0: Box((0, 0), (N, N))}, slab_bytes=64 << 20).boxes[0].slabs == ()


# --- cooperative plans (boxes several processes need, split among them) ------------------------

OWNERS_4x2 = [0, 0, 1, 1, 2, 2, 3, 3]  # 4 processes x 2 devices, consecutive in mesh order


@pytest.mark.parametrize(
    "shape, mesh, spec, owners, expected",
    [
        # Fully replicated on 4 processes x 2 devices: 'data' spans processes, 'model' does not.
        ((4096, 4096), {"data": 4, "model": 2}, P(), OWNERS_4x2, P("data", None)),
        # Replicated over 'data' only: to the dimension with the larger per-device extent.
        ((4096, 4096), {"data": 4, "model": 2}, P("model"), OWNERS_4x2, P("model", "data")),
        # ... which may be the one 'model' already splits: 'data' becomes its minor axis.
        ((4096, 64), {"data": 4, "model": 2}, P("model"), OWNERS_4x2, P(("model", "data"), None)),
        # The dimension with the largest per-device extent takes it.
        ((64, 4096), {"data": 4, "model": 2}, P(None, "model"), OWNERS_4x2, P(None, ("model", "data"))),
        ((8, 64), {"data": 4, "model": 2}, P(), OWNERS_4x2, P(None, "data")),
        # One axis of 8 devices over 4 processes.
        ((4096,), {"d": 8}, P(), OWNERS_4x2, P("d")),
        # 2 x 4 mesh, processes inside rows: 'model' spans processes.
        ((4096, 16), {"data": 2, "model": 4}, P("data"), OWNERS_4x2, P(("data", "model"), None)),
        # Already sharded across processes: nothing to share.
        ((4096, 16), {"data": 4, "model": 2}, P("data"), OWNERS_4x2, None),
        # Indivisible, or a scalar: read by every process.
        ((3, 5), {"data": 4, "model": 2}, P(), OWNERS_4x2, None),
        ((), {"data": 4, "model": 2}, P(), OWNERS_4x2, None),
        # One process: nothing spans processes.
        ((4096,), {"d": 8}, P(), [0] * 8, None),
    ],
)
def test_exchange_spec(shape, mesh, spec, owners, expected):
    assert exchange_spec(shape, mesh, spec, owners) == expected


def _resolved(meta, mesh_shape, spec, process, processes):
    """A hand-built cooperative `ResolvedTarget` on an abstract mesh (devices = mesh positions)."""
    mesh = AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape))
    n = int(np.prod(list(mesh_shape.values())))
    per = n // processes
    boxes = named_shard_boxes(meta.shape, mesh_shape, spec)
    every = tuple((i, i // per, b) for i, b in enumerate(boxes))
    mine = tuple((i, b) for i, p, b in every if p == process)
    leaf = ResolvedLeaf(meta.path, meta, LeafTarget(NamedSharding(mesh, spec), meta.shape, None), mine, every)
    return ResolvedTarget(None, (leaf,), process)


def test_replicated_target_on_4_processes_reads_a_quarter_each_and_receives_the_rest():
    # SAVED_2x4 (chunks 2048x1024, inner 512x512) onto P() over 4 processes x 2 devices:
    # process p reads rows [1024p, 1024p + 1024), i.e. half the rows of each of the 4
    # chunks of its chunk row: 4 chunk reads of 4 inner chunks each.
    total_read = 0
    for p in range(4):
        plan = build_plan(_resolved(SAVED_2x4, {"data": 4, "model": 2}, P(), p, 4), "/ckpt", cooperative=True)
        (leaf,) = plan.leaves
        assert leaf.exchange_spec == P("data", None) and plan.cooperative
        (b,) = leaf.boxes
        assert b.box == Box((1024 * p, 0), (1024, N)) and b.device_ids == (2 * p, 2 * p + 1)
        assert b.receivers == tuple(q for q in range(4) if q != p)
        assert b.bytes_read == 4 * READ_4_OF_8 and leaf.bytes_needed == WHOLE_BYTES
        assert leaf.target_boxes == (Box((0, 0), (N, N)),)
        assert leaf.received == tuple(PeerPiece(Box((1024 * q, 0), (1024, N)), q) for q in range(4) if q != p)
        assert plan.bytes_received == WHOLE_BYTES * 3 // 4
        total_read += plan.bytes_read
    assert total_read == 16 * READ_4_OF_8 and total_read <= 1.001 * WHOLE_BYTES


def test_cooperative_plan_without_a_shared_box_is_the_plain_plan():
    spec = P("data", "model")
    for p in range(4):
        resolved = _resolved(SAVED_2x4, {"data": 4, "model": 2}, spec, p, 4)
        assert build_plan(resolved, "/ckpt", cooperative=True) == build_plan(resolved, "/ckpt")
    # One process holding everything shares nothing either.
    resolved = _resolved(SAVED_2x4, {"data": 4, "model": 2}, P(), 0, 1)
    assert not build_plan(resolved, "/ckpt", cooperative=True).cooperative


def test_cooperative_pieces_tile_every_target_box_exactly_once():
    """Over all processes: what a process reads plus what it receives is each of its target
    boxes, without overlap; every piece is read by exactly one process."""
    meta = ArrayMetadata("x", (96, 40), F32, (48, 40), (16, 8), None)
    for mesh, spec in [({"data": 4, "model": 2}, P(None, "model")), ({"data": 2, "model": 4}, P("data")), ({"d": 8}, P())]:
        read_by = {}
        for p in range(4):
            (leaf,) = build_plan(_resolved(meta, mesh, spec, p, 4), "/ckpt", cooperative=True).leaves
            assert leaf.exchange_spec is not None, (mesh, spec)
            for b in leaf.boxes:
                assert read_by.setdefault(b.box, p) == p, (mesh, spec, b.box)
            for t in leaf.target_boxes:
                got = [b.box.intersect(t) for b in leaf.boxes] + [r.box for r in leaf.received if r.box.intersect(t)]
                got = [g for g in got if g is not None]
                assert sum(g.size for g in got) == t.size, (mesh, spec, p, t)
                cover = np.zeros(t.shape, int)
                for g in got:
                    cover[g.relative_to(t)] += 1
                assert (cover == 1).all(), (mesh, spec, p, t)
        assert sum(b.size for b in read_by) == 96 * 40, (mesh, spec)


@pytest.mark.parametrize("box, itemsize, max_bytes, rows", [
    (Box((3, 1), (10, 4)), 4, 48, [3, 3, 3, 1]),  # 16-byte rows: 3 per slab
    (Box((0, 0), (4, 100)), 8, 10, [1, 1, 1, 1]),  # a row above the bound: one row each
    (Box((0,), (5,)), 2, 1 << 20, [5]),
])
def test_row_slabs_tile_the_box_in_order_within_the_bound(box, itemsize, max_bytes, rows):
    slabs = row_slabs(box, itemsize, max_bytes)
    assert [s.shape[0] for s in slabs] == rows
    assert all(s.shape[1:] == box.shape[1:] and s.origin[1:] == box.origin[1:] for s in slabs)
    assert [s.origin[0] for s in slabs] == [box.origin[0] + sum(rows[:i]) for i in range(len(rows))]
    assert row_slabs(Box((), ()), 4, 1) == [Box((), ())] and row_slabs(Box((2, 0), (0, 3)), 4, 1) == []
