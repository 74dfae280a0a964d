"""One pass on the way in (issue 28 item 2): every inner chunk's crc32c is checked once,
where its bytes are placed, by every core; the inner chunk shape keeps reshards cheap."""

import collections
import dataclasses
import functools
import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._encoding import _read
from checkpointer._encoding._leaf_plan import plan_array_leaf
from checkpointer._format import Box
from checkpointer._save import _pipeline as _save_pipeline, _plan as _save_plan

pytestmark = pytest.mark.usefixtures("unpacked_layout")

MESHES = {"2x4": (2, 4), "4x2": (4, 2), "1x8": (1, 8), "8x1": (8, 1)}


def _sharding(mesh_name):
    return NamedSharding(make_mesh(MESHES[mesh_name], ("data", "model")), P("data", "model"))


def _host(shape=(1024, 1024), seed=0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def _boxes(shape, mesh):
    bs = (shape[0] // mesh[0], shape[1] // mesh[1])
    return {Box((i * bs[0], j * bs[1]), bs): [i * mesh[1] + j] for i in range(mesh[0]) for j in range(mesh[1])}


def test_inner_chunks_of_a_2x4_saved_leaf_reshard_onto_4x2_1x8_8x1_within_1_02(tmp_path):
    path = str(tmp_path / "c")
    ckpt.save(path, {"w": jax.device_put(_host(), _sharding("2x4"))})
    target = {name: {"w": jax.ShapeDtypeStruct((1024, 1024), np.float32, sharding=_sharding(name))} for name in MESHES}
    for name in MESHES:
        plan = ckpt.plan_restore(path, target[name])
        assert plan.read_amplification <= 1.02, (name, str(plan))
    # Why the inner chunks do not span the saved shard's rows (which would make every
    # inner chunk one contiguous piece of a 2x4 box): a 1x8 reshard cuts each saved
    # shard's columns in half, and a process that holds one of the halves (every other
    # column block: 2 processes) would then read every inner chunk it needs twice over.
    # (One process holding both halves reads each inner chunk once: `read_boxes`.)
    meta = ckpt.metadata(path).arrays["w"]
    rows = dataclasses.replace(meta, inner_chunk_shape=(meta.inner_chunk_shape[0] // 2, meta.chunk_shape[1]))
    boxes = _boxes(meta.shape, MESHES["1x8"])
    lp = plan_array_leaf(rows, {b: d for b, d in boxes.items() if d[0] % 2 == 0})
    assert lp.bytes_read / lp.bytes_needed > 1.9
    whole = plan_array_leaf(rows, boxes)
    assert whole.bytes_read / whole.bytes_needed < 1.02


SAVED = ["2x4", "1x8"]
INNER_TARGET_BYTES = {"default": None, "8 KiB": 8 << 10}
TARGETS = ["2x4", "4x2", "1x8", "8x1", "one device"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per (saved mesh, inner chunk target): a checkpoint of a float32 and a bfloat16 leaf."""
    host = {"f": _host((256, 512)), "h": _host((128, 1024), 1).astype(ml_dtypes.bfloat16)}
    out = {}
    mp = pytest.MonkeyPatch()
    try:
        from checkpointer._encoding import _pack

        mp.setattr(_pack, "DEFAULT_PACK_BYTES", 0)
        for mesh in SAVED:
            for inner_name, inner in INNER_TARGET_BYTES.items():
                mp.setattr(_save_plan, "inner_chunk_shape", functools.partial(_format_inner_chunk_shape, target=inner))
                mp.setattr(_save_pipeline, "_PLAN_CACHE", collections.OrderedDict())  # plans are cached per layout
                path = str(tmp_path_factory.mktemp("saved") / f"{mesh}-{inner_name.replace(' ', '')}")
                ckpt.save(path, {k: jax.device_put(v, _sharding(mesh)) for k, v in host.items()})
                out[mesh, inner_name] = path
    finally:
        mp.undo()
    return out, host


def _format_inner_chunk_shape(chunk, itemsize, target_bytes=None, *, target):
    from checkpointer._format import inner_chunk_shape

    return inner_chunk_shape(chunk, itemsize, target if target is not None else target_bytes)


@pytest.mark.parametrize("saved_on", SAVED)
@pytest.mark.parametrize("inner", list(INNER_TARGET_BYTES))
def test_every_inner_chunk_shape_and_reshard_restores_bit_exactly(saved, saved_on, inner):
    paths, host = saved
    path = paths[saved_on, inner]
    shapes = {tuple(a.inner_chunk_shape) for a in ckpt.metadata(path).arrays.values()}
    assert inner == "default" or all(np.prod(s) * 2 <= 8 << 10 for s in shapes), shapes
    for name in TARGETS:
        if name == "one device":
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[3])
        else:
            sharding = _sharding(name)
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in host.items()}
        out = ckpt.restore(path, target)
        for k, v in host.items():
            for shard in out[k].addressable_shards:
                assert np.asarray(shard.data).tobytes() == v[shard.index].tobytes(), (saved_on, inner, name, k)


def _flip_a_byte_of_an_inner_chunk(path, leaf, chunk_dir="c/0/1"):
    import pathlib

    f = pathlib.Path(path) / "arrays" / leaf / chunk_dir
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF  # inside the first inner chunk in file order (the index is at the end)
    f.write_bytes(bytes(data))
    return str(f)


@pytest.mark.parametrize("target", ["2x4", "one device"])
def test_a_corrupted_inner_chunk_is_reported_naming_leaf_and_path(tmp_path, target):
    path = str(tmp_path / "c")
    ckpt.save(path, {"w": jax.device_put(_host(), _sharding("2x4"))})
    _flip_a_byte_of_an_inner_chunk(path, "w")
    sharding = _sharding("2x4") if target == "2x4" else jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"crc32c mismatch") as e:
        ckpt.restore(path, {"w": jax.ShapeDtypeStruct((1024, 1024), np.float32, sharding=sharding)})
    assert f"leaf ['w'] in {path}: chunk arrays/w/c/0/1 inner chunk 0: crc32c mismatch" in str(e.value)


class _CountingCrc:
    def __init__(self):
        self.lengths = []
        self.lock = threading.Lock()

    def crc32c(self, data, *args, **kwargs):
        import crc32c

        with self.lock:
            self.lengths.append(len(data))
        return crc32c.crc32c(data, *args, **kwargs)


@pytest.mark.parametrize(("saved_on", "target"), [("2x4", "2x4"), ("2x4", "4x2"), ("1x8", "1x8"), ("2x4", "one device")])
def test_each_inner_chunk_is_checked_once(saved, monkeypatch, saved_on, target):
    paths, host = saved
    path = paths[saved_on, "8 KiB"]
    sharding = _sharding(target) if target != "one device" else jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tgt = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in host.items()}
    plan = ckpt.plan_restore(path, tgt)
    counter = _CountingCrc()
    monkeypatch.setattr(_read, "crc32c", counter)
    out = ckpt.restore(path, tgt)
    meta = ckpt.metadata(path).arrays
    inner_bytes = {k: int(np.prod(meta[k].inner_chunk_shape)) * np.dtype(meta[k].dtype).itemsize for k in host}
    expected = collections.Counter()
    for leaf in plan.leaves:
        # An inner chunk that two boxes of the leaf cut (4x2 from 2x4) is read and checked once.
        inner = {(r.chunk_key, i) for b in leaf.boxes for s in (b.slabs or (b,)) for r in s.reads for i in r.inner_ids}
        expected[inner_bytes[leaf.leaf_path]] += len(inner)
    assert all(n > 0 for n in expected.values())
    assert {n: counter.lengths.count(n) for n in expected} == expected
    for k, v in host.items():
        assert np.asarray(out[k]).tobytes() == v.tobytes()


def _concurrent_crc_checks(monkeypatch):
    """Makes the first two inner-chunk checks wait for each other: a restore that checks
    inner chunks on one thread only fails with BrokenBarrierError."""
    barrier, seen, lock = threading.Barrier(2, timeout=20), [], threading.Lock()
    check = _read._check_crc

    def checked(blob, what, path):
        if "inner chunk" in what:
            with lock:
                seen.append(threading.get_ident())
                first_two = len(seen) <= 2
            if first_two:
                barrier.wait()
        return check(blob, what, path)

    monkeypatch.setattr(_read, "_check_crc", checked)
    return seen


def test_the_boxes_of_one_leaf_are_read_by_several_threads(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    host = _host()
    ckpt.save(path, {"w": jax.device_put(host, _sharding("2x4"))})
    seen = _concurrent_crc_checks(monkeypatch)
    out = ckpt.restore(path, {"w": jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=_sharding("2x4"))})
    assert len(set(seen)) >= 2
    assert np.asarray(out["w"]).tobytes() == host.tobytes()


def test_one_box_of_one_chunk_is_read_by_several_threads(tmp_path, monkeypatch):
    # Saved on one device: one zarr shard file of 4 MiB (16 inner chunks, 4 requests of
    # 1 MiB), restored onto one device: one box, one chunk read, split among tasks.
    path = str(tmp_path / "c")
    host = _host()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    ckpt.save(path, {"w": jax.device_put(host, one)})
    monkeypatch.setattr(_read.os, "cpu_count", lambda: 4)
    seen = _concurrent_crc_checks(monkeypatch)
    out = ckpt.restore(path, {"w": jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=one)})
    assert len(set(seen)) >= 2
    assert np.asarray(out["w"]).tobytes() == host.tobytes()


def test_no_cyclic_collection_runs_while_chunks_are_read(tmp_path, monkeypatch):
    # A full collection over a large program's heap costs as much as checking a GiB.
    import gc

    path = str(tmp_path / "c")
    host = _host()
    ckpt.save(path, {"w": jax.device_put(host, _sharding("2x4"))})
    enabled, read = [], _read.read_chunk_index

    def reading(*args, **kwargs):
        enabled.append(gc.isenabled())
        return read(*args, **kwargs)

    monkeypatch.setattr(_read, "read_chunk_index", reading)
    assert gc.isenabled()
    out = ckpt.restore(path, {"w": jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=_sharding("4x2"))})
    assert enabled and not any(enabled)
    assert gc.isenabled()
    assert np.asarray(out["w"]).tobytes() == host.tobytes()


class _Node:
    """A GC-tracked object (instances of plain classes are)."""


def test_a_pause_promotes_its_survivors_untraversed_and_leaves_the_program_gc_on():
    # The objects a pause made that are still alive go to the oldest generation as it
    # ends (no collection over them), and the young generation starts empty again.
    import gc

    from checkpointer import _memory

    assert gc.isenabled() and gc.get_freeze_count() == 0
    with _memory.paused():
        assert not gc.isenabled()
        kept = [_Node() for _ in range(5000)]
        assert gc.get_count()[0] >= 5000
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    assert gc.get_count()[0] < 700  # no collection is due for them
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert all(id(o) in oldest for o in kept)


def test_a_pause_leaves_a_program_s_frozen_objects_frozen():
    import gc

    from checkpointer import _memory

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with _memory.paused():
            _ = [_Node() for _ in range(100)]
        assert gc.get_freeze_count() == frozen
        assert gc.isenabled()
    finally:
        gc.unfreeze()
