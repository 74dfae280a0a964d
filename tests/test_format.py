"""The on-disk format: inner chunking, shard file sizes, non-array values, manifest entries, names."""

import datetime
import math
import os
import re
import struct

import crc32c
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from checkpointer._errors import CorruptCheckpointError
from checkpointer._format._box import Box
from checkpointer._format._dtypes import dtype_kind, is_numeric_dtype, is_whole_byte_dtype
from checkpointer._format._json import dumps, loads
from checkpointer._format._layout import (
    chunk_key,
    deleting_name,
    generation_time,
    new_generation,
    parse_deleting_name,
    parse_partial_name,
    partial_name,
)
from checkpointer._format._leaves import MAX_ARRAY_BYTES, ArrayMetadata, SavedSharding, array_metadata_from_json
from checkpointer._format._manifest import library_version, manifest_json, parse_manifest
from checkpointer._format._records import ProcessRecord
from checkpointer._format._shard_file import ShardFileLayout
from checkpointer._format._units import format_bytes
from checkpointer._format._values import value_from_json, value_to_json
from checkpointer._format._zarr_arrays import data_crc32c, inner_chunk_shape, zarr_metadata, zarr_spec

MIB = 1 << 20


def _id(obj):
    return repr(obj)[:60]


# --- inner_chunk_shape -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "chunk, itemsize, expected",
    [
        # 8 MiB: (1024, 1024) -> (512, 1024) (dim 0 on ties) -> (512, 512) = 1 MiB.
        ((2048, 1024), 4, (512, 512)),
        ((1024, 2048), 4, (512, 512)),
        ((4096, 4096), 4, (512, 512)),
        ((4096, 4096), 2, (512, 1024)),  # bfloat16: 2 MiB -> halve dim 0
        ((4096, 64), 4, (4096, 64)),  # exactly 1 MiB: unchanged
        ((8192, 64), 4, (4096, 64)),
        ((1024, 1024, 1024), 4, (64, 64, 64)),  # 2**18 elements
        ((1 << 20,), 8, (1 << 17,)),
        ((2, 2), 1, (2, 2)),
        ((), 4, ()),
        ((0, 8), 4, (1, 8)),
        ((0,), 1, (1,)),
        ((3, 1 << 20), 4, (3, 1 << 16)),  # the 3 is never the longest: power-of-two axis halved
    ],
)
def test_inner_chunk_shape_examples_with_1mib_target(chunk, itemsize, expected):
    assert inner_chunk_shape(chunk, itemsize, target_bytes=1 << 20) == expected


@pytest.mark.parametrize(
    "chunk, itemsize, expected",
    [
        # Default target: chunk/16, clamped to [16 KiB, 1 MiB].
        ((2048, 1024), 4, (256, 512)),  # 8 MiB chunk -> 512 KiB inner chunks (16 of them)
        ((4096, 4096), 4, (512, 512)),  # 64 MiB chunk -> capped at 1 MiB
        ((512, 128), 4, (64, 64)),  # 256 KiB chunk -> 16 KiB inner chunks
        ((64, 64), 4, (64, 64)),  # 16 KiB chunk: at the floor, whole
        ((100,), 4, (100,)),
    ],
)
def test_inner_chunk_shape_default_target(chunk, itemsize, expected):
    assert inner_chunk_shape(chunk, itemsize) == expected


def test_inner_chunk_shape_explicit_target():
    # (8, 8) x 4 B = 256 B; target 64 B: (4, 8) = 128 B -> (4, 4) = 64 B.
    assert inner_chunk_shape((8, 8), 4, target_bytes=64) == (4, 4)
    # Items larger than the target: as small as it gets.
    assert inner_chunk_shape((4, 4), 16, target_bytes=8) == (1, 1)


@pytest.mark.parametrize(
    "chunk, expected",
    [
        # 1021 is prime. (1021, 1024) float32 = ~4 MiB: halving the 1024 twice gives
        # (1021, 256) = 1_045_504 B <= 1 MiB, leaving the prime dimension whole.
        ((1021, 1024), (1021, 256)),
        ((1024, 1021), (256, 1021)),
        # A prime dimension alone is left whole (splitting it would mean inner chunks of
        # one element, an index 4x the data).
        ((1_000_003,), (1_000_003,)),
    ],
)
def test_inner_chunk_shape_leaves_prime_dimensions_whole(chunk, expected):
    assert inner_chunk_shape(chunk, 4, target_bytes=1 << 20) == expected


_dims = st.one_of(st.integers(0, 5000), st.sampled_from([1 << k for k in range(14)]), st.sampled_from([1021, 4099, 6144, 3 * 1024]))


@settings(max_examples=100, deadline=None)
@given(st.lists(_dims, max_size=4), st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([64, 1000, 4096, MIB]))
def test_inner_chunk_shape_always_divides_the_chunk(chunk, itemsize, target):
    inner = inner_chunk_shape(chunk, itemsize, target_bytes=target)
    assert len(inner) == len(chunk)
    for c, i in zip(chunk, inner):
        assert i >= 1
        assert max(1, c) % i == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 13), min_size=1, max_size=4), st.sampled_from([1, 2, 4, 8]), st.integers(3, 22))
def test_inner_chunk_shape_of_power_of_two_chunks(exponents, itemsize, target_exp):
    chunk = tuple(1 << e for e in exponents)
    target = 1 << target_exp
    inner = inner_chunk_shape(chunk, itemsize, target_bytes=target)
    chunk_bytes = math.prod(chunk) * itemsize
    # Powers of two dividing the chunk.
    assert all(i & (i - 1) == 0 and c % i == 0 for c, i in zip(chunk, inner))
    inner_bytes = math.prod(inner) * itemsize
    if chunk_bytes <= target:
        assert inner == chunk
    else:
        # Halving until it fits lands exactly on the (power-of-two) target.
        assert inner_bytes == max(target, itemsize)
        # Balanced: no inner dimension is more than twice another one that was split.
        split = [i for c, i in zip(chunk, inner) if i < c]
        assert max(inner) <= 2 * min(split)


# --- ShardFileLayout.file_bytes against TensorStore ---------------------------------------------------------


@pytest.mark.parametrize(
    "shape, chunk, inner, dtype",
    [
        ((8, 12), (4, 6), (2, 3), np.float32),
        ((8,), (8,), (2,), np.int8),
        ((6, 4), (3, 4), (3, 2), np.bool_),
        ((4, 4), (4, 4), (2, 2), ml_dtypes.bfloat16),
        ((), (), (), np.float64),
        ((4,), (4,), (4,), np.complex64),
        ((4, 4), (2, 4), (1, 2), np.uint16),
    ],
)
def test_shard_file_layout_file_bytes_matches_tensorstore(tmp_path, shape, chunk, inner, dtype):
    import tensorstore as ts

    dtype = np.dtype(dtype)
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(tmp_path)},
        "metadata": zarr_metadata(shape, dtype, chunk, inner),
        "create": True,
        "store_data_equal_to_fill_value": True,
    }
    store = ts.open(spec).result()
    data = np.arange(math.prod(shape)).reshape(shape).astype(dtype)
    store.write(data).result()
    n_chunks = math.prod(s // c for s, c in zip(shape, chunk))  # chunks tile the array, as JAX shards do
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs if f != "zarr.json"]
    assert len(files) == n_chunks
    expected = ShardFileLayout(chunk, inner, dtype.itemsize).file_bytes
    assert [os.path.getsize(f) for f in files] == [expected] * n_chunks
    # And the formula itself, by hand for the first case: 4 inner chunks of 6 x 4 B + crc,
    # then 4 x 16 B of index + crc: 4 * 28 + 64 + 4.
    assert ShardFileLayout((4, 6), (2, 3), 4).file_bytes == 180
    assert np.array_equal(store.read().result(), data)


def test_chunk_key():
    assert chunk_key("params/w", (1, 0)) == "arrays/params/w/c/1/0"
    assert chunk_key("count", ()) == "arrays/count/c"
    assert chunk_key("", (3,)) == "arrays/%root/c/3"
    with pytest.raises(CorruptCheckpointError):
        chunk_key("../x", (0,))


# --- non-array values ---------------------------------------------------------------------------


def _bits(v):
    """A bit-exact identity of a value: its type and its bytes."""
    if isinstance(v, float):
        return (float, struct.pack("<d", v))
    if isinstance(v, complex):
        return (complex, struct.pack("<dd", v.real, v.imag))
    if isinstance(v, np.generic):
        return (type(v), v.dtype, np.asarray(v).tobytes())
    return (type(v), v)


def _nan_with_payload():
    return struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]


VALUES = [
    None,
    True,
    False,
    0,
    -1,
    2**63,
    -(2**64) - 1,
    10**300,
    -(10**4000),
    10**5000,  # "ints of any size"
    0.0,
    -0.0,
    1.5,
    float("nan"),
    -float("nan"),
    _nan_with_payload(),
    float("inf"),
    -float("inf"),
    5e-324,
    1.7976931348623157e308,
    0.1,
    complex(1, -2),
    complex(-0.0, float("nan")),
    complex(float("inf"), -0.0),
    "",
    "héllo wörld",
    "日本語 🎉",
    "nul\x00and\nnewline\"quote",
    "\ud800",
    np.float32(-0.0),
    np.frombuffer(bytes.fromhex("0100c07f"), np.float32)[0],  # float32 NaN with payload
    np.float16(65504),
    np.float64(0.1),
    np.int8(-128),
    np.uint64(2**64 - 1),
    np.int64(-(2**63)),
    np.bool_(True),
    np.complex64(complex(1, -2)),
    np.complex128(complex(-0.0, 3)),
    ml_dtypes.bfloat16(-0.0),
    ml_dtypes.bfloat16(1.5),
    ml_dtypes.bfloat16(float("nan")),
    ml_dtypes.float8_e4m3fn(-1.5),
    ml_dtypes.int4(-3),
]


@pytest.mark.parametrize("value", VALUES, ids=[f"{type(v).__name__}-{i}" for i, v in enumerate(VALUES)])
def test_value_roundtrip_is_bit_exact(value):
    encoded = value_to_json(value)
    assert encoded is not None
    decoded = value_from_json(loads(dumps(encoded), "manifest.json"), "leaf 'x'")
    assert _bits(decoded) == _bits(value)


def test_value_json_encodings():
    assert value_to_json(None) == {"type": "none"}
    assert value_to_json(True) == {"type": "bool", "value": True}
    assert value_to_json(-7) == {"type": "int", "hex": "-7"}
    assert value_to_json(255) == {"type": "int", "hex": "ff"}
    assert value_to_json(-0.0) == {"type": "float", "hex": "0000000000000080"}
    assert value_to_json(1 + 0j) == {"type": "complex", "hex": "000000000000f03f0000000000000000"}
    assert value_to_json(np.float32(1.5)) == {"type": "numpy_scalar", "dtype": "float32", "hex": "0000c03f"}
    assert value_to_json(ml_dtypes.bfloat16(1.5)) == {"type": "numpy_scalar", "dtype": "bfloat16", "hex": "c03f"}


@pytest.mark.parametrize(
    "value", [object(), b"bytes", [1], {"a": 1}, (1,), np.datetime64("2020-01-01"), np.zeros(2), np.void(b"ab")],
    ids=["object", "bytes", "list", "dict", "tuple", "datetime64", "ndarray", "void"],
)
def test_value_to_json_refuses_other_kinds(value):
    assert value_to_json(value) is None


@pytest.mark.parametrize(
    "obj",
    [
        None,
        [],
        "none",
        3,
        {},
        {"type": "tensor"},
        {"type": None},
        {"type": ["int"]},
        {"type": "bool"},
        {"type": "bool", "value": 1},
        {"type": "bool", "value": "true"},
        {"type": "int"},
        {"type": "int", "hex": 5},
        {"type": "int", "hex": "xyz"},
        {"type": "int", "hex": "1.5"},
        {"type": "int", "hex": "1" * 1_000_000},
        {"type": "float"},
        {"type": "float", "hex": "00"},
        {"type": "float", "hex": "zz00000000000000"},
        {"type": "float", "hex": 0},
        {"type": "float", "hex": "000000000000000000"},
        {"type": "complex", "hex": "0000000000000000"},
        {"type": "str"},
        {"type": "str", "value": 5},
        {"type": "numpy_scalar", "dtype": "float32", "hex": "00"},
        {"type": "numpy_scalar", "dtype": "float32", "hex": "0000000000"},
        {"type": "numpy_scalar", "dtype": "float33", "hex": "00000000"},
        {"type": "numpy_scalar", "dtype": "Float32", "hex": "00000000"},
        {"type": "numpy_scalar", "dtype": 4, "hex": "00000000"},
        {"type": "numpy_scalar", "dtype": "object", "hex": "0000000000000000"},
        {"type": "numpy_scalar", "dtype": "datetime64", "hex": "0000000000000000"},
        {"type": "numpy_scalar", "hex": "00000000"},
        {"type": "numpy_scalar", "dtype": "float32"},
    ],
    ids=_id,
)
def test_value_from_json_rejects_malformed(obj):
    with pytest.raises(CorruptCheckpointError):
        value_from_json(obj, "leaf 'x' in /ckpt/1")


# --- array entries of the manifest ---------------------------------------------------------------


def _entry(**overrides):
    entry = {
        "type": "array",
        "kind": "jax",
        "shape": [4096, 4096],
        "dtype": "float32",
        "chunk_shape": [2048, 1024],
        "inner_chunk_shape": [512, 512],
        "saved_sharding": {
            "kind": "named",
            "mesh_axis_names": ["data", "model"],
            "mesh_shape": [2, 4],
            "spec": ["data", ["model", "x"], None],
            "shard_shape": [2048, 1024],
            "device_count": 8,
        },
        "key_impl": None,
    }
    entry.update(overrides)
    return entry


def test_array_metadata_from_json_parses_a_valid_entry():
    meta = array_metadata_from_json("params/w", _entry(), "/ckpt/1")
    assert meta == ArrayMetadata(
        "params/w",
        (4096, 4096),
        np.dtype(np.float32),
        (2048, 1024),
        (512, 512),
        SavedSharding("named", ("data", "model"), (2, 4), ("data", ("model", "x"), None), (2048, 1024), 8),
        None,
        "jax",
    )
    assert meta.nbytes == 64 * MIB
    assert meta.saved_sharding.describe() == "P('data', ('model', 'x'), None) on mesh data=2 x model=4"


@pytest.mark.parametrize(
    "meta",
    [
        ArrayMetadata("w", (8, 6), np.dtype(ml_dtypes.bfloat16), (4, 6), (2, 3), None, None, "numpy"),
        ArrayMetadata("k", (4, 2), np.dtype(np.uint32), (4, 2), (4, 2), SavedSharding("single_device", (), (), (), (4, 2), 1), "threefry2x32"),
        ArrayMetadata("c", (), np.dtype(np.int64), (), (), None),
        ArrayMetadata("e", (0, 4), np.dtype(np.bool_), (1, 4), (1, 4), None),
    ],
)
def test_array_metadata_json_roundtrip(meta):
    assert array_metadata_from_json(meta.path, loads(dumps(meta.to_json()), "m"), "/ckpt/1") == meta


def test_array_metadata_size_bound_is_inclusive():
    ok = dict(shape=[1 << 25, 1 << 25], dtype="int8", chunk_shape=[1 << 25, 1 << 25], inner_chunk_shape=[1 << 10, 1 << 10])
    assert array_metadata_from_json("w", _entry(**ok), "/c").nbytes == MAX_ARRAY_BYTES
    too_big = dict(ok, shape=[1 << 25, (1 << 25) + 1])
    with pytest.raises(CorruptCheckpointError):
        array_metadata_from_json("w", _entry(**too_big), "/c")


@pytest.mark.parametrize(
    "overrides",
    [
        # absurd shapes
        dict(shape=[1 << 62, 1], chunk_shape=[1, 1], inner_chunk_shape=[1, 1]),
        dict(shape=[1 << 40, 1 << 40]),
        dict(shape=[1 << 26, 1 << 26], dtype="int8", chunk_shape=[1, 1], inner_chunk_shape=[1, 1]),
        dict(shape=[1] * 33, chunk_shape=[1] * 33, inner_chunk_shape=[1] * 33),
        dict(shape=[-1, 4096]),
        # wrong types
        dict(shape=None),
        dict(shape="4096x4096"),
        dict(shape=[4096.0, 4096]),
        dict(shape=[True, 4096]),
        dict(shape=[[4096], 4096]),
        dict(chunk_shape=None),
        dict(inner_chunk_shape={"0": 512}),
        dict(dtype=None),
        dict(dtype=4),
        dict(dtype=["float32"]),
        dict(key_impl=3),
        dict(kind="torch"),
        dict(kind=None),
        dict(saved_sharding="P('data')"),
        dict(saved_sharding=[1, 2]),
        dict(saved_sharding={"kind": "named"}),
        dict(saved_sharding=dict(_entry()["saved_sharding"], spec=None)),
        dict(saved_sharding=dict(_entry()["saved_sharding"], mesh_shape=["two"])),
        # chunk / inner chunk mismatch
        dict(chunk_shape=[2048]),
        dict(inner_chunk_shape=[512, 512, 1]),
        dict(inner_chunk_shape=[512, 300]),
        dict(inner_chunk_shape=[4096, 512]),
        dict(chunk_shape=[0, 1024]),
        dict(inner_chunk_shape=[0, 512]),
        # unknown dtypes
        dict(dtype="float33"),
        dict(dtype="Float32"),
        dict(dtype=""),
        dict(dtype="float32 "),
        dict(dtype="<f4"),
        dict(dtype="object"),
        dict(dtype="str"),
        dict(dtype="void"),
        dict(dtype="datetime64"),
        dict(dtype="finfo"),
    ],
    ids=_id,
)
def test_array_metadata_from_json_rejects(overrides):
    with pytest.raises(CorruptCheckpointError):
        array_metadata_from_json("params/w", _entry(**overrides), "/ckpt/1")


@pytest.mark.parametrize("entry", [None, [], "array", 3])
def test_array_metadata_from_json_rejects_non_objects(entry):
    with pytest.raises(CorruptCheckpointError, match="'params/w'"):
        array_metadata_from_json("params/w", entry, "/ckpt/1")


def test_array_metadata_error_names_leaf_and_checkpoint():
    with pytest.raises(CorruptCheckpointError, match=r"'params/w' in /ckpt/1"):
        array_metadata_from_json("params/w", _entry(shape=[-1, 4]), "/ckpt/1")


# --- JSON files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"{", b"[1, 2", b"\xff\xfe", b"{'a': 1}", b"[" * 100_000])
def test_loads_rejects_malformed_json(data):
    with pytest.raises(CorruptCheckpointError, match="manifest.json"):
        loads(data, "/ckpt/1/manifest.json")


def test_dumps_refuses_nan():
    with pytest.raises(ValueError):
        dumps({"x": float("nan")})


# --- partial names --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("100.partial-abc123", ("100", "abc123")),
        ("100.partial-20240101-120000-0a1b", ("100", "20240101-120000-0a1b")),
        ("0.partial-x", ("0", "x")),
        ("ckpt.partial-a.partial-b", ("ckpt.partial-a", "b")),
        ("100", None),
        ("100.partial-", None),
        (".partial-abc", None),
        ("100.partial-ABC", None),
        ("100.partial-a_b", None),
        ("100.partial-a.b", None),
        ("100.partial-a/b", None),
        ("100.partial-abc\n", None),
        ("100.deleting-abc", None),
        ("100partial-abc", None),
    ],
)
def test_parse_partial_name(name, expected):
    assert parse_partial_name(name) == expected


@pytest.mark.parametrize("name, generation", [("100", "abc"), ("run.v2", "0-1-z"), ("7", "7")])
def test_partial_name_roundtrip(name, generation):
    assert partial_name(name, generation) == f"{name}.partial-{generation}"
    assert parse_partial_name(partial_name(name, generation)) == (name, generation)


@pytest.mark.parametrize("name, expected", [("3.deleting-20260101000000-0a1b2c3d", ("3", "20260101000000-0a1b2c3d")),
                                            ("3.deleting-gc-0a1b2c3d", ("3", "gc-0a1b2c3d")), ("3.deleting-", None),
                                            ("3.partial-abc", None), ("3", None)])
def test_parse_deleting_name(name, expected):
    assert parse_deleting_name(name) == expected
    if expected:
        assert deleting_name(*expected) == name


# --- generations -------------------------------------------------------------------------------


def test_new_generation_is_utc_time_then_8_hex_and_parses_as_a_partial_name():
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    generation = new_generation(now)
    assert re.fullmatch(r"20260102010405-[0-9a-f]{8}", generation)  # 03:04:05 at +02:00 is 01:04:05 UTC
    assert generation != new_generation(now)  # 32 random bits tell same-second attempts apart
    assert generation_time(generation) == now
    assert parse_partial_name(partial_name("5", generation)) == ("5", generation)
    assert generation_time("abc123") is None


# --- process records (processes/<i>.json) ---------------------------------------------------------

V010 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "v0.1.0", "7")


def test_process_record_of_0_1_0_round_trips_byte_for_byte():
    with open(f"{V010}/processes/0.json", "rb") as f:
        raw = f.read()
    record = ProcessRecord.from_json(loads(raw, "0.json"), "0.json")
    assert record.process_index == 0 and record.chunks and all(isinstance(c.box, Box) for c in record.chunks)
    assert record.bytes_written == sum(c.file_bytes for c in record.chunks)
    assert dumps(record.to_json()) == raw


def test_process_record_keeps_unknown_fields_and_reads_a_minimal_one():
    obj = {"process_index": 1, "chunks": [{"key": "arrays/w/c/0", "data_crc32c": 7, "later": [1]}], "later": {"x": 1}}
    record = ProcessRecord.from_json(obj, "1.json")
    assert record.extra == {"later": {"x": 1}} and record.chunks[0].extra == {"later": [1]}
    assert record.generation is None and record.chunks[0].data_crc32c == 7
    assert record.to_json() == obj


@pytest.mark.parametrize(
    "obj, match",
    [
        ([], "expected a JSON object"),
        ({}, "'chunks' is missing"),
        ({"chunks": 5}, "'chunks'"),
        ({"chunks": [5]}, "chunk 0: expected a JSON object"),
        ({"chunks": [{"data_crc32c": 1}]}, "'key' is missing"),
        ({"chunks": [{"key": 1}]}, "'key'"),
        ({"chunks": [{"key": "k", "box": [[0], [1, 2]]}]}, "'box'"),
        ({"chunks": [{"key": "k", "bytes": -1}]}, "'bytes'"),
        ({"chunks": [], "process_index": True}, "'process_index'"),
        ({"chunks": [], "write_s": "1"}, "'write_s'"),
    ],
)
def test_malformed_process_record_is_corrupt_and_names_the_field(obj, match):
    with pytest.raises(CorruptCheckpointError, match=rf"/ckpt/processes/0\.json: .*{match}"):
        ProcessRecord.from_json(obj, "/ckpt/processes/0.json")


# --- manifest.json: the writer reproduces what the reader read ---------------------------------


def test_manifest_writer_rewrites_the_0_1_0_manifest_it_parses():
    with open(f"{V010}/manifest.json", "rb") as f:
        raw = loads(f.read(), "manifest.json")
    meta = parse_manifest(raw, V010)
    values = {p: value_to_json(m.value) for p, m in meta.leaves.items() if not isinstance(m, ArrayMetadata)}
    written = manifest_json(
        step=meta.step, generation=raw["generation"], process_count=meta.process_count,
        process_bytes_written=meta.process_bytes_written, structure=meta.structure, arrays=list(meta.arrays.values()),
        values=values, user_metadata=meta.user_metadata, created_unix_s=meta.created_unix_s,
    )
    versions = ("library_version", "jax_version")
    assert {k: v for k, v in written.items() if k not in versions} == {k: v for k, v in raw.items() if k not in versions}
    assert list(written) == list(raw)  # same fields, same order
    assert written["library_version"] == library_version()


def test_manifest_with_the_snapshots_entries_is_the_same():
    """`array_entries` (a save's per-layout entries) give the manifest `to_json` gives."""
    with open(f"{V010}/manifest.json", "rb") as f:
        raw = loads(f.read(), "manifest.json")
    meta = parse_manifest(raw, V010)
    arrays = list(meta.arrays.values())
    common = dict(step=meta.step, generation=raw["generation"], process_count=meta.process_count,
                  process_bytes_written=meta.process_bytes_written, structure=meta.structure, arrays=arrays,
                  values={}, user_metadata=meta.user_metadata, created_unix_s=meta.created_unix_s)
    given = manifest_json(**common, array_entries=[m.to_json() for m in arrays])
    assert given == manifest_json(**common) and list(given["leaves"]) == [m.path for m in arrays]


def test_library_version_is_the_installed_distributions():
    import importlib.metadata

    import checkpointer

    assert library_version() == checkpointer.__version__ == importlib.metadata.version("checkpointer")


# --- small shared helpers ----------------------------------------------------------------------


@pytest.mark.parametrize("n, text", [(None, "-"), (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                     (64 << 20, "64.0 MiB"), (3 << 30, "3.0 GiB"), (5 << 40, "5.0 TiB"),
                                     (3 << 50, "3072.0 TiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    "dtype, numeric, kind, whole_bytes",
    [
        (np.bool_, True, "b", True),
        (np.int8, True, "i", True),
        (np.uint64, True, "i", True),
        (np.float16, True, "f", True),
        (np.complex64, True, "c", True),
        (ml_dtypes.bfloat16, True, "f", True),
        (ml_dtypes.float8_e4m3fn, True, "f", True),
        (ml_dtypes.int4, True, "i", False),
        (ml_dtypes.float4_e2m1fn, True, "f", False),
        (np.dtype("U3"), False, None, False),
        (np.dtype("O"), False, None, False),
        (np.dtype([("a", np.int32)]), False, None, False),
    ],
)
def test_dtype_predicates(dtype, numeric, kind, whole_bytes):
    assert is_numeric_dtype(dtype) == numeric
    assert dtype_kind(dtype) == kind
    assert is_whole_byte_dtype(dtype) == whole_bytes


def test_zarr_spec_modes():
    meta = ArrayMetadata("w", (8, 4), np.dtype(np.float32), (4, 4), (2, 4), None)
    kv = {"driver": "memory", "path": "w/"}
    create, write, read = (zarr_spec(kv, meta, mode=m) for m in ("create", "write", "read"))
    for spec in (create, write, read):
        assert spec["driver"] == "zarr3" and spec["kvstore"] == kv
        assert spec["metadata"] == zarr_metadata((8, 4), np.float32, (4, 4), (2, 4))
    assert create["create"] and write["assume_metadata"] and "create" not in write
    assert create["store_data_equal_to_fill_value"] and write["store_data_equal_to_fill_value"]
    assert read["open"] and read["fill_missing_data_reads"] is False and "create" not in read
    with pytest.raises(ValueError, match="mode"):
        zarr_spec(kv, meta, mode="append")


def test_data_crc32c_is_of_the_c_order_bytes():
    a = np.arange(12, dtype=np.int16).reshape(3, 4)
    assert data_crc32c(a) == data_crc32c(np.asfortranarray(a)) == crc32c.crc32c(a.tobytes())
    assert data_crc32c(np.zeros((0, 4), np.float32)) == 0
