"""Every operation on every stored-leaf encoding (`checkpointer._encoding.ENCODINGS`).

The tests here are parametrized over the registry: an encoding added to it runs every
operation (plan, check files, restore on another mesh, verify ok and of a damaged
file, export, two-tier replication, the cooperative plan), and needs a recipe below
(how to save leaves in it and where a byte of a leaf lies). `OPERATIONS` maps each
method of `LeafEncoding` to the test that runs it, so a new method without a test
fails `test_every_method_of_the_interface_has_a_test`.
"""

import concurrent.futures
import json
import os
import pathlib
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer import _encoding, _format
from checkpointer._encoding import ENCODINGS, LeafEncoding, encoding_of
from checkpointer._format._box import Box
from checkpointer._storage._kvstore import storage_for


def _zarr_byte(path, meta):
    return _format.chunk_key(meta.path, (0,) * len(meta.shape)), 10  # inside the first inner chunk


def _packed_byte(path, meta):
    b = meta.pack_boxes[0]
    return b.key, b.offset + b.nbytes // 2


# Per encoding: the save options that store every leaf of `_state` in it, where a
# stored byte of a leaf lies (file key, offset), and the most a cooperative restore of a
# replicated leaf reads in all, over its bytes (a zarr array's grain is the inner chunk,
# read once per exchange box that cuts it, plus the shard index; packed bytes are read
# once in all).
RECIPES = {
    "zarr_array": {"save": {"pack_small_leaves_bytes": 0}, "byte_of": _zarr_byte, "coop_read": 2.05},
    "packed": {"save": {"pack_small_leaves_bytes": 1 << 20}, "byte_of": _packed_byte, "coop_read": 1.0},
}

SPECS = {"w": P("data", "model"), "rep": P(), "col": P(None, "model"), "bf": P("model"), "key": P()}


def _state():
    mesh = make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(19)

    def put(x, name):
        return jax.device_put(x, NamedSharding(mesh, SPECS[name]))

    return {
        "w": put(rng.standard_normal((64, 128)).astype(np.float32), "w"),
        "rep": put(rng.standard_normal((256, 128)).astype(np.float32), "rep"),  # 128 KiB, replicated
        "col": put(rng.standard_normal((32, 64)).astype(np.float32), "col"),
        "bf": put(rng.standard_normal(64).astype(ml_dtypes.bfloat16), "bf"),
        "key": jax.random.wrap_key_data(put(np.arange(8, dtype=np.uint32).reshape(4, 2), "key"), impl="threefry2x32"),
        "ids": np.arange(12, dtype=np.int16).reshape(3, 4),
        "step": 5,
    }


def _target(mesh):
    out = {name: NamedSharding(mesh, spec) for name, spec in SPECS.items()}
    return dict(out, ids=None, step=None)


def _assert_restored(out, state):
    for name, value in state.items():
        got = out[name]
        if name == "key":
            got, value = jax.random.key_data(got), jax.random.key_data(value)
        if name == "step":
            assert got == value
            continue
        assert np.asarray(got).tobytes() == np.asarray(value).tobytes(), name


@pytest.fixture(params=ENCODINGS, ids=lambda e: e.name)
def saved(request, tmp_path):
    enc = request.param
    state = _state()
    path = str(tmp_path / "1")
    ckpt.save(path, state, **RECIPES[enc.name]["save"])
    meta = ckpt.metadata(path)
    for m in meta.arrays.values():
        assert enc.stores(m) and encoding_of(m) is enc, m.path
        assert [e.name for e in ENCODINGS if e.stores(m)] == [enc.name]  # exactly one encoding stores a leaf
    return enc, path, state, meta


def test_every_encoding_has_a_recipe_and_a_unique_name():
    assert sorted(RECIPES) == sorted(e.name for e in ENCODINGS)
    assert len({e.name for e in ENCODINGS}) == len(ENCODINGS)


# --- the operations, on each encoding -------------------------------------------------------


def test_plan_reads_what_every_box_needs(saved):
    enc, path, state, meta = saved
    mesh = make_mesh((4, 2), ("data", "model"))
    plan = ckpt.plan_restore(path, _target(mesh))
    for lp in plan.leaves:
        m = meta.arrays[lp.leaf_path]
        assert lp.bytes_needed > 0 and lp.bytes_read >= lp.bytes_needed * (1 if lp.leaf_path != "key" else 0), lp.leaf_path
        for b in lp.boxes:
            assert b.reads or b.packed, (lp.leaf_path, b.box)
        # The encoding's own plan of one box equals the registry's.
        box = lp.boxes[0].box
        assert enc.plan(m, {box: [0]}).boxes[0].box == box
    assert plan.bytes_read == sum(lp.bytes_read for lp in plan.leaves)


def test_check_files_passes_then_names_the_leaf_of_a_truncated_file(saved):
    enc, path, state, meta = saved
    storage, p = storage_for(path)
    leaves = [(m, [Box.whole(m.shape)]) for m in meta.arrays.values()]
    enc.check_files(storage, p, leaves)
    w = meta.arrays["w"]
    files = list(enc.files(w, [Box.whole(w.shape)]))
    assert files and all(os.path.getsize(f"{path}/{k}") == n for k, n in files)
    key, offset = RECIPES[enc.name]["byte_of"](path, w)
    assert key in dict(files)
    with open(f"{path}/{key}", "r+b") as f:
        f.truncate(offset)
    with pytest.raises(ckpt.CorruptCheckpointError, match=rf"leaf \['w'\] in {path}.*{key}.*has {offset} bytes, expected.*verify"):
        enc.check_files(storage, p, leaves)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['w'\]"):
        ckpt.restore(path, _target(make_mesh((2, 4), ("data", "model"))))


@pytest.mark.parametrize("shape", [(4, 2), (1, 8), (1, 1)])
def test_restore_onto_another_mesh_is_bit_exact(saved, shape):
    enc, path, state, meta = saved
    mesh = make_mesh(shape, ("data", "model"))
    stats = ckpt.RestoreStats()
    out = ckpt.restore(path, _target(mesh), stats=stats)
    _assert_restored(out, state)
    assert out["w"].sharding == NamedSharding(mesh, SPECS["w"])
    assert stats.bytes_read == stats.plan.bytes_read
    _assert_restored(ckpt.restore(path), state)  # host numpy arrays


def test_verify_is_ok_then_names_the_leaf_of_a_damaged_byte(saved):
    enc, path, state, meta = saved
    calls = []
    report = ckpt.verify(path, progress=lambda done, total: calls.append((done, total)))
    assert report.ok, report.problems
    assert report.chunks_checked == sum(enc.chunk_count(m) for m in meta.arrays.values()) == calls[-1][0] == calls[-1][1]
    assert report.bytes_checked == sum(m.nbytes for m in meta.arrays.values())
    key, offset = RECIPES[enc.name]["byte_of"](path, meta.arrays["w"])
    with open(f"{path}/{key}", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = ckpt.verify(path)
    assert not report.ok and any("'w'" in p for p in report.problems), report.problems


def test_export_and_region_reads_are_bit_exact(saved, tmp_path):
    enc, path, state, meta = saved
    report = ckpt.export(path, str(tmp_path / "out.npz"), format="npz", upcast=True)
    with np.load(report.files[0]) as npz:
        np.testing.assert_array_equal(npz["w"], np.asarray(state["w"]))
        np.testing.assert_array_equal(npz["rep"], np.asarray(state["rep"]))
        np.testing.assert_array_equal(npz["ids"], state["ids"])
    storage, p = storage_for(path)
    read = enc.region_reader(storage, p, meta.arrays["w"])
    np.testing.assert_array_equal(read(Box((3, 10), (40, 100))), np.asarray(state["w"])[3:43, 10:110])
    # The same regions straight into the caller's buffers (two boxes, one of them twice; an empty one).
    boxes = [Box((3, 10), (40, 100)), Box((0, 0), (8, 128)), Box((3, 10), (40, 100)), Box((5, 5), (0, 7))]
    outs = [np.full(b.shape, -1, meta.arrays["w"].dtype) for b in boxes]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        _encoding.read_into(storage, p, meta.arrays["w"], list(zip(boxes, outs)), pool)
    for b, out in zip(boxes, outs):
        np.testing.assert_array_equal(out, np.asarray(state["w"])[b.slices()])
    bf = np.zeros(20, ml_dtypes.bfloat16)
    _encoding.read_into(storage, p, meta.arrays["bf"], [(Box((3,), (20,)), bf)])
    np.testing.assert_array_equal(bf.view(np.uint16), np.asarray(state["bf"])[3:23].view(np.uint16))


def test_two_tier_replication_copies_the_files_the_encoding_names(saved, tmp_path):
    enc, _, state, _ = saved
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local_directory=local, **RECIPES[enc.name]["save"]) as mngr:
        mngr.save(1, state)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1]
    meta = ckpt.metadata(f"{durable}/1")
    assert all(enc.stores(m) for m in meta.arrays.values())
    record = _format.read_process_record(storage_for(durable)[0], f"{durable}/1/processes/0.json")
    files = enc.replicated_files(record)
    assert files and all(os.path.isfile(f"{durable}/1/{k}") for k in files)
    assert ckpt.verify(f"{durable}/1").ok
    _assert_restored(ckpt.restore(f"{durable}/1"), state)
    mesh = make_mesh((4, 2), ("data", "model"))
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:  # from the local copy
        _assert_restored(mngr.restore(None, _target(mesh)), state)
        assert mngr.status().last_restore_source == "local"
    shutil.rmtree(local)
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:  # the node is lost
        _assert_restored(mngr.restore(None, _target(mesh)), state)
        assert mngr.status().last_restore_source == "durable"


def test_cooperative_plan_splits_a_replicated_leaf_among_processes(saved):
    enc, path, state, meta = saved
    mesh = AbstractMesh((8,), ("d",))
    target = {"rep": jax.ShapeDtypeStruct((256, 128), np.float32, sharding=NamedSharding(mesh, P()))}
    plans = [ckpt.plan_restore(path, target, process_index=i, processes=2, partial=True) for i in range(2)]
    nbytes = meta.arrays["rep"].nbytes
    for plan in plans:
        assert plan.cooperative and plan.bytes_needed == nbytes
        assert plan.bytes_received == nbytes // 2
    read = [plan.bytes_read for plan in plans]
    assert nbytes <= sum(read) <= RECIPES[enc.name]["coop_read"] * nbytes, read


# Each method of the interface → the test above that runs it on every encoding.
def test_direct_and_buffered_writes_store_the_same_bytes(saved, tmp_path):
    # `saved` wrote with direct_io="auto" (direct on this file system); write the same
    # state buffered and compare every file the encoding names, and the records.
    enc, path, state, meta = saved
    buffered = str(tmp_path / "buffered" / "1")
    ckpt.save(buffered, state, direct_io=False, **RECIPES[enc.name]["save"])
    records = [json.loads(pathlib.Path(f"{p}/processes/0.json").read_text()) for p in (path, buffered)]
    assert [r["write_mode"] for r in records] == ["direct", "buffered"], records[0].get("write_mode_reason")
    assert records[0]["chunks"] == records[1]["chunks"]
    compared = 0
    for m in meta.arrays.values():
        for key, _ in enc.files(m, [Box.whole(m.shape)]):
            with open(f"{path}/{key}", "rb") as a, open(f"{buffered}/{key}", "rb") as b:
                assert a.read() == b.read(), (m.path, key)
            compared += 1
    assert compared >= len(meta.arrays)


OPERATIONS = {
    "stores": "saved (fixture)",
    "plan": test_plan_reads_what_every_box_needs,
    "plan_share": test_cooperative_plan_splits_a_replicated_leaf_among_processes,
    "files": test_check_files_passes_then_names_the_leaf_of_a_truncated_file,
    "check_files": test_check_files_passes_then_names_the_leaf_of_a_truncated_file,
    "start_restore": test_restore_onto_another_mesh_is_bit_exact,
    "chunk_count": test_verify_is_ok_then_names_the_leaf_of_a_damaged_byte,
    "verify": test_verify_is_ok_then_names_the_leaf_of_a_damaged_byte,
    "region_reader": test_export_and_region_reads_are_bit_exact,
    "replicated_files": test_two_tier_replication_copies_the_files_the_encoding_names,
    "start_write": test_direct_and_buffered_writes_store_the_same_bytes,
}


def test_every_method_of_the_interface_has_a_test():
    assert sorted(OPERATIONS) == sorted(LeafEncoding.__abstractmethods__)
    for enc in ENCODINGS:  # and every encoding implements every one of them itself
        for name in LeafEncoding.__abstractmethods__:
            assert getattr(type(enc), name) is not getattr(LeafEncoding, name), (enc.name, name)
