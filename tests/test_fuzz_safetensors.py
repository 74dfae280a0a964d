"""Fuzzing the safetensors reader, `ckpt.restore_safetensors` (issue 27 item 2): hostile
headers (the 8-byte length, the JSON: dtypes, shapes, offsets, nesting, noise), hostile
`model.safetensors.index.json` files, and valid files, which must round-trip.

Properties: only the documented errors come out (`CheckpointError`s, and
`FileNotFoundError` for a file that is not there), naming the file (or its folder); nothing outside the
folder is read (an index naming `../outside.safetensors`, whose tensors are 777, never
returns them); host memory grows by less than `fuzzing.MEMORY_BOUND_BYTES` whatever the
declared shapes and lengths; a valid file round-trips bit-exactly.

`make test` runs the `ci` profile (tests/fuzzing.py); the longer run:
`CHECKPOINTER_FUZZ=long .venv/bin/python -m pytest -q tests/test_fuzz_safetensors.py`.
"""

import itertools
import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from fuzzing import HUGE_INTS, bounded_memory, damage_bytes, documented, fuzz, hostile_variant
from hypothesis import given, strategies as st
from safetensors.numpy import save_file

import checkpointer as ckpt

ERRORS = (ckpt.CheckpointError, FileNotFoundError)
A = np.arange(12, dtype=np.float32).reshape(3, 4) + 1000
B = np.arange(5, dtype=np.int64) + 2000
OUTSIDE = 777


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with one valid file (`a`, `b`), and beside it `outside.safetensors`
    holding the same names filled with 777."""
    root = tmp_path_factory.mktemp("fuzz_st")
    save_file({"a": A, "b": B}, str(root / "orig.safetensors"))
    save_file({"a": np.full_like(A, OUTSIDE), "b": np.full_like(B, OUTSIDE)}, str(root / "outside.safetensors"))
    return root


_files = itertools.count()


def _header(raw):
    n = struct.unpack("<Q", raw[:8])[0]
    return raw[8 : 8 + n], raw[8 + n :]


def _never_outside(out):
    """No restored tensor is the outside file's (safetensors has no checksum: a hostile
    header may well return other bytes of its own file)."""
    if out is not None:
        for name, got in out.items():
            got = np.asarray(got)
            assert not (got.size and np.all(got == OUTSIDE)), name


_u64 = st.sampled_from([v % 2**64 for v in HUGE_INTS]) | st.integers(0, 2**64 - 1) | st.integers(0, 200)


@fuzz(3)
@given(data=st.data())
def test_a_hostile_header_gives_documented_errors_naming_the_file_within_the_memory_bound(folder, data):
    raw = (folder / "orig.safetensors").read_bytes()
    header, body = _header(raw)
    how = data.draw(st.sampled_from(["json", "json", "length", "bytes"]))
    if how == "json":  # the header's JSON edited (hostile shapes, offsets, dtypes, nesting) or damaged
        new = hostile_variant(data, header)
        raw = struct.pack("<Q", len(new)) + new + body
    elif how == "length":  # the 8-byte header length
        raw = struct.pack("<Q", data.draw(_u64)) + raw[8:]
    else:
        raw = raw[:8] + damage_bytes(data, raw[8 : 8 + len(header)]) + body  # the header only: the data has no checksum
    name = f"f{next(_files)}.safetensors"
    (folder / name).write_bytes(raw)
    target = {k: None for k in data.draw(st.sampled_from([("a",), ("a", "b")]))}
    with bounded_memory():
        _never_outside(documented(lambda: ckpt.restore_safetensors(str(folder / name), target, partial=True), name,
                                  errors=ERRORS))
    os.remove(folder / name)


@fuzz(2)
@given(data=st.data())
def test_a_hostile_index_gives_documented_errors_and_never_reads_outside_its_folder(folder, data):
    sub = folder / f"sharded{next(_files)}"
    sub.mkdir()
    os.link(folder / "orig.safetensors", sub / "model-1.safetensors")
    index = {"metadata": {"total_size": A.nbytes + B.nbytes}, "weight_map": {"a": "model-1.safetensors", "b": "model-1.safetensors"}}
    if data.draw(st.booleans()):  # names that leave the folder
        index["weight_map"][data.draw(st.sampled_from(["a", "b"]))] = data.draw(st.sampled_from(
            ["../outside.safetensors", str(folder / "outside.safetensors"), "./../outside.safetensors", "..", ".", ""]))
        raw = json.dumps(index).encode()
    else:
        raw = hostile_variant(data, json.dumps(index).encode())
    (sub / "model.safetensors.index.json").write_bytes(raw)
    with bounded_memory():
        _never_outside(documented(lambda: ckpt.restore_safetensors(str(sub), {"a": None, "b": None}),
                                  "model.safetensors.index.json", "model-1.safetensors", sub.name, errors=ERRORS))


DTYPES = [np.float32, np.float64, np.float16, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.bool_,
          ml_dtypes.bfloat16]


@st.composite
def _tensors(draw):
    out = {}
    for name in draw(st.lists(st.text(alphabet="abcxyz_.0123", min_size=1, max_size=6), min_size=1, max_size=4,
                              unique=True)):
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
        n = int(np.prod(shape)) * dtype.itemsize
        a = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), np.uint8).view(dtype).reshape(shape)
        out[name] = np.asarray(a != 0) if dtype == np.bool_ else a.copy()
    return out


@fuzz(1)
@given(tensors=_tensors())
def test_a_valid_file_always_round_trips_bit_exactly(folder, tensors):
    name = f"valid{next(_files)}.safetensors"
    save_file(tensors, str(folder / name))
    got = ckpt.restore_safetensors(str(folder / name), {k: None for k in tensors}, name_fn=lambda path: path[0].key)
    for k, want in tensors.items():
        g = np.asarray(got[k])
        assert g.dtype == want.dtype and g.shape == want.shape and g.tobytes() == want.tobytes(), k
    os.remove(folder / name)
