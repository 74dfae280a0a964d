"""Fuzzing the files of a checkpoint (issue 27 item 2) that tests/test_hostile.py does not
fuzz already (it fuzzes the manifest, zarr.json, the pack index and the pack file): the
process records (`processes/<i>.json`), the commit marker, the zarr shard index at the end
of a chunk file, and files replaced by symlinks out of the checkpoint; and valid trees,
which must round-trip.

Properties, for every hostile variant:
- only documented errors come out (`CheckpointError`), naming the checkpoint;
- nothing from outside the checkpoint is returned: a twin checkpoint of the same tree
  filled with 777 lies next to it, and no restore ever returns its values;
- host memory grows by less than `fuzzing.MEMORY_BOUND_BYTES` (64 MiB) when a shard index
  declares huge offsets and lengths;
- a valid tree always round-trips bit-exactly.

`make test` runs the `ci` profile (tests/fuzzing.py); the longer run:
`CHECKPOINTER_FUZZ=long .venv/bin/python -m pytest -q tests/test_fuzz_checkpoint.py`.
"""

import itertools
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from fuzzing import HUGE_INTS, bounded_memory, damage_bytes, documented, fuzz, hostile_variant
from hypothesis import given, strategies as st

import checkpointer as ckpt

W = np.arange(256 * 256, dtype=np.float32).reshape(256, 256) + 1e6
B = np.arange(8, dtype=np.int32) + 1000
OUTSIDE = 777


def _tree(fill=None):
    if fill is None:
        return {"w": W, "b": B, "n": 3}
    return {"w": np.full_like(W, fill), "b": np.full_like(B, fill), "n": fill}


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """layout -> a committed checkpoint of `_tree()`, and next to each, `outside`: the same
    tree filled with 777 (what a path or link out of the checkpoint would find)."""
    root = tmp_path_factory.mktemp("fuzz_ckpt")
    out = {}
    for layout, pack_bytes in (("unpacked", 0), ("packed", 1 << 20)):
        ckpt.save(str(root / layout / "orig"), _tree(), pack_small_leaves_bytes=pack_bytes)
        ckpt.save(str(root / layout / "outside"), _tree(OUTSIDE), pack_small_leaves_bytes=pack_bytes)
        out[layout] = str(root / layout / "orig")
    return out


_copies = itertools.count()


def _copy(originals, layout):
    """A fresh copy of the layout's checkpoint, beside its `outside` twin."""
    src = originals[layout]
    dst = os.path.join(os.path.dirname(src), f"victim-{next(_copies)}")
    shutil.copytree(src, dst)
    return dst


def _check(out):
    """A restored tree is the saved one, never the outside twin's."""
    if out is not None:
        assert np.array_equal(np.asarray(out["w"]), W) and np.array_equal(np.asarray(out["b"]), B) and out["n"] == 3


def _restores_right_or_refuses(path):
    name = os.path.basename(path)
    _check(documented(lambda: ckpt.restore(path), name))
    documented(lambda: ckpt.metadata(path), name)


@fuzz(2)
@given(data=st.data(), layout=st.sampled_from(["unpacked", "packed"]))
def test_a_hostile_process_record_gives_documented_errors_only(originals, data, layout):
    path = _copy(originals, layout)
    record = f"{path}/processes/0.json"
    with open(record, "rb") as f:
        raw = hostile_variant(data, f.read())
    with open(record, "wb") as f:
        f.write(raw)
    name = os.path.basename(path)
    _restores_right_or_refuses(path)
    documented(lambda: ckpt.per_process_state(path, 0), name)
    report = documented(lambda: ckpt.verify(path), name)
    assert report is None or isinstance(report.ok, bool)
    shutil.rmtree(path)


@fuzz(2)
@given(data=st.data(), layout=st.sampled_from(["unpacked", "packed"]))
def test_a_hostile_commit_marker_gives_documented_errors_only(originals, data, layout):
    path = _copy(originals, layout)
    marker = f"{path}/COMMITTED"
    with open(marker, "rb") as f:
        original = f.read()
    how = data.draw(st.sampled_from(["variant", "variant", "directory", "empty"]))
    if how == "directory":
        os.remove(marker)
        os.mkdir(marker)
    else:
        with open(marker, "wb") as f:
            f.write(hostile_variant(data, original) if how == "variant" else b"")
    _restores_right_or_refuses(path)
    mgr = ckpt.CheckpointManager(os.path.dirname(path), read_only=True)
    steps = documented(mgr.all_steps, os.path.dirname(path))
    assert steps is None or steps == []  # the copies are not step folders: nothing is a step
    mgr.close()
    shutil.rmtree(path)


# --- the zarr shard index -------------------------------------------------------------------

INDEX_BYTES = 16 * 16 + 4  # 4x4 inner chunks of 64x64: (offset, nbytes) as uint64 each, then crc32c
_u64 = st.sampled_from([v % 2**64 for v in HUGE_INTS]) | st.integers(0, 2**64 - 1) | st.integers(0, 300_000)


@fuzz(2)
@given(data=st.data())
def test_a_hostile_shard_index_gives_documented_errors_within_the_memory_bound(originals, data):
    path = _copy(originals, "unpacked")
    chunk = f"{path}/arrays/w/c/0/0"
    with open(chunk, "rb") as f:
        raw = f.read()
    body, index = raw[:-INDEX_BYTES], bytearray(raw[-INDEX_BYTES:])
    how = data.draw(st.sampled_from(["entries", "entries", "bytes"]))
    if how == "entries":  # hostile offsets and lengths, with or without a matching checksum
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, 15))
            struct.pack_into("<QQ", index, 16 * i, data.draw(_u64), data.draw(_u64))
        if data.draw(st.booleans()):
            import crc32c

            struct.pack_into("<I", index, INDEX_BYTES - 4, crc32c.crc32c(bytes(index[:-4])))
        damaged = body + bytes(index)
    else:
        damaged = body + damage_bytes(data, bytes(index))
    with open(chunk, "wb") as f:
        f.write(damaged)
    with bounded_memory():
        _check(documented(lambda: ckpt.restore(path), os.path.basename(path)))
    shutil.rmtree(path)


# --- links out of the checkpoint ------------------------------------------------------------


@fuzz(1)
@given(data=st.data(), layout=st.sampled_from(["unpacked", "packed"]))
def test_a_file_replaced_by_a_link_out_of_the_checkpoint_never_returns_outside_content(originals, data, layout):
    path = _copy(originals, layout)
    outside = os.path.join(os.path.dirname(path), "outside")
    files = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
    name = data.draw(st.sampled_from(files))
    linked = data.draw(st.sampled_from([name, os.path.dirname(name)]) if os.path.dirname(name) else st.just(name))
    shutil.rmtree(f"{path}/{linked}") if os.path.isdir(f"{path}/{linked}") else os.remove(f"{path}/{linked}")
    os.symlink(f"{outside}/{linked}", f"{path}/{linked}")
    _restores_right_or_refuses(path)
    shutil.rmtree(path)


# --- valid trees round-trip -----------------------------------------------------------------

DTYPES = [np.float32, np.float64, np.int8, np.int64, np.uint16, np.bool_, np.float16, ml_dtypes.bfloat16]


@st.composite
def _arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
    raw = draw(st.binary(min_size=dtype.itemsize * int(np.prod(shape)), max_size=dtype.itemsize * int(np.prod(shape))))
    a = np.frombuffer(raw, np.uint8).view(dtype).reshape(shape) if shape else np.frombuffer(raw, dtype)[0]
    return np.asarray(a != 0) if dtype == np.bool_ else a


_values = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6)
_trees = st.dictionaries(st.text(max_size=8), _arrays() | _values, min_size=1, max_size=4)


@fuzz(0.5)
@given(tree=_trees, pack=st.booleans())
def test_a_valid_tree_always_round_trips_bit_exactly(tmp_path_factory, tree, pack):
    path = str(tmp_path_factory.mktemp("roundtrip") / "ck")
    ckpt.save(path, tree, pack_small_leaves_bytes=(1 << 20) if pack else 0)
    back = ckpt.restore(path)
    assert set(back) == set(tree)
    for k, v in tree.items():
        if isinstance(v, np.ndarray | np.generic):
            got = np.asarray(back[k])
            assert got.dtype == v.dtype and got.shape == np.shape(v), k
            assert got.tobytes() == np.asarray(v).tobytes(), k
        else:
            assert back[k] == v and type(back[k]) is type(v), k
    shutil.rmtree(path)
