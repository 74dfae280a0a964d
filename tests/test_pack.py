"""Packed small leaves (`_pack`): layout, zarr-python reads, restore onto other meshes,
verify, the planner's byte ranges, the threshold, and the manifest's index checks."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import zarr
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._encoding import _pack, plan_leaf
from checkpointer._encoding._leaf_plan import PACK_GAP_BYTES, coalesce_packed
from checkpointer._format._box import Box
from checkpointer._format._leaves import ArrayMetadata, PackedBox


def _json(path):
    with open(path) as f:
        return json.load(f)


def _state(n=6):
    """n vectors replicated, n matrices column-sharded on 2x4, a large leaf, values, a key."""
    mesh = make_mesh((2, 4), ("data", "model"))
    rep, col = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "model"))
    rng = np.random.default_rng(15)
    return {
        "vec": {f"{i}": jax.device_put(rng.standard_normal(256).astype(np.float32), rep) for i in range(n)},
        "mat": {f"{i}": jax.device_put(rng.standard_normal((64, 64)).astype(np.float32), col) for i in range(n)},
        "big": jax.device_put(rng.standard_normal((512, 1024)).astype(np.float32), NamedSharding(mesh, P("data"))),
        "bf": jax.device_put(rng.standard_normal((8, 32)).astype(ml_dtypes.bfloat16), col),
        "ids": np.arange(10, dtype=np.int16),
        "key": jax.random.key(7),
        "step": 12,
    }


def _target(tree, mesh=None):
    def leaf(x):
        if not isinstance(x, jax.Array):
            return x
        s = x.sharding
        if mesh is not None and isinstance(s, NamedSharding):
            s = NamedSharding(mesh, s.spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree.map(leaf, tree)


def _assert_equal(out, state):
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(state)):
        if isinstance(b, jax.Array) and jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_small_leaves_share_one_pack_and_large_ones_keep_their_arrays(tmp_path):
    state = _state()
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    files = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
    assert "packed/process-0/zarr.json" in files and "packed/process-0/c/0" in files
    assert not any(f.startswith(("arrays/vec", "arrays/mat", "arrays/bf", "arrays/ids", "arrays/key")) for f in files)
    assert any(f.startswith("arrays/big/c/") for f in files)  # 1 MiB chunks: a zarr array of its own
    manifest = _json(f"{path}/manifest.json")
    packed_leaves = {p for p, e in manifest["leaves"].items() if e.get("packed")}
    assert packed_leaves == {f"vec/{i}" for i in range(6)} | {f"mat/{i}" for i in range(6)} | {"bf", "ids", "key"}
    [pack] = manifest["packed"]
    assert pack["array"] == "packed/process-0" and pack["key"] == "packed/process-0/c/0"
    assert pack["bytes"] == os.path.getsize(f"{path}/packed/process-0/c/0")
    # One entry per chunk: a replicated vector is one chunk, a column-sharded matrix four.
    assert sorted(b["leaf"] for b in pack["boxes"] if b["leaf"].startswith("mat/0")) == ["mat/0"] * 4
    record = _json(f"{path}/processes/0.json")
    assert record["packed"] == pack  # the record holds the same index
    assert pack["key"] in {c["key"] for c in record["chunks"]}  # and the pack as one of its chunks
    meta = ckpt.metadata(path).arrays
    assert meta["mat/0"].packed and meta["mat/0"].chunk_shape == (64, 16) and not meta["big"].packed
    assert meta["mat/0"].saved_sharding.spec == (None, "model")


def test_a_packed_leaf_reads_bit_exact_with_zarr_python_and_the_documented_index(tmp_path):
    state = _state()
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    # Only zarr-python and the index in the pack's own attributes (or the manifest's).
    pack = zarr.open_array(f"{path}/packed/process-0", mode="r")
    index = pack.attrs["checkpointer"]["packed_index"]
    manifest_index = _json(f"{path}/manifest.json")["packed"][0]["boxes"]
    assert [{k: v for k, v in b.items() if k != "dtype"} for b in index] == manifest_index
    raw = pack[...]
    for leaf, expected in [("vec/3", state["vec"]["3"]), ("ids", state["ids"]), ("bf", state["bf"])]:
        full = np.asarray(expected)
        for b in (b for b in index if b["leaf"] == leaf):
            (origin, shape), off, n = b["box"], b["offset"], b["data_bytes"]
            dtype = ml_dtypes.bfloat16 if b["dtype"] == "bfloat16" else np.dtype(b["dtype"])
            got = raw[off : off + n].view(dtype).reshape(shape)
            want = full[tuple(slice(o, o + s) for o, s in zip(origin, shape))]
            assert got.tobytes() == want.tobytes()
    # The documented one-liner, for a column block of a sharded matrix.
    b = next(b for b in index if b["leaf"] == "mat/2" and b["box"][0] == [0, 32])
    off, n = b["offset"], b["data_bytes"]
    block = zarr.open_array(f"{path}/packed/process-0", mode="r")[off : off + n].view(np.float32).reshape(64, 16)
    np.testing.assert_array_equal(block, np.asarray(state["mat"]["2"])[:, 32:48])


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2), (1, 1)])
def test_restore_onto_other_meshes_is_bit_exact_and_on_the_target_sharding(tmp_path, mesh_shape):
    state = _state()
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    mesh = make_mesh(mesh_shape, ("data", "model"))
    target = _target(state, mesh)
    stats = ckpt.RestoreStats()
    out = ckpt.restore(path, target, stats=stats)
    _assert_equal(out, state)
    assert out["mat"]["1"].sharding == target["mat"]["1"].sharding
    assert out["vec"]["0"].sharding == target["vec"]["0"].sharding
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    # Every packed chunk comes from one coalesced read of the pack (plus the large leaf's chunks),
    # and the restore reads what the plan says.
    assert len(stats.plan.pack_runs) == 1
    assert stats.bytes_read == stats.plan.bytes_read


def test_restored_devices_never_share_a_host_buffer(tmp_path):
    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    out = ckpt.restore(path, _target(state))
    for arr in (out["vec"]["0"], out["mat"]["1"]):
        ptrs = [s.data.unsafe_buffer_pointer() for s in arr.addressable_shards]
        assert len(set(ptrs)) == len(ptrs)
    # Donating one device's buffer leaves the others intact.
    x = out["vec"]["1"]
    expected = np.asarray(state["vec"]["1"])
    jax.jit(lambda a: a * 0, donate_argnums=0)(x)
    y = ckpt.restore(path, _target(state))["vec"]["1"]
    for s in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), expected)


def test_host_targets_partial_casts_and_missing_leaves(tmp_path):
    state = _state(3)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    host = ckpt.restore(path)
    np.testing.assert_array_equal(host["mat"]["2"], np.asarray(state["mat"]["2"]))
    assert host["ids"].dtype == np.int16 and host["step"] == 12
    assert jax.dtypes.issubdtype(host["key"].dtype, jax.dtypes.prng_key)
    mesh = make_mesh((4, 2), ("data", "model"))
    sub = {"mat": {"0": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))},
           "vec": {"1": None}}
    out = ckpt.restore(path, sub, partial=True)
    np.testing.assert_array_equal(np.asarray(out["mat"]["0"]), np.asarray(state["mat"]["0"]).astype(jnp.bfloat16))
    np.testing.assert_array_equal(out["vec"]["1"], np.asarray(state["vec"]["1"]))
    extra = dict(sub, new=jnp.ones(3))
    kept = ckpt.restore(path, extra, partial=True, missing="keep_target")
    assert kept["new"] is extra["new"]


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int32", "float16", "bfloat16", "float64", "complex64",
                                   "float8_e4m3fn", "uint64"])
def test_every_whole_byte_dtype_round_trips_packed(tmp_path, dtype):
    dt = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    raw = np.random.default_rng(3).integers(0, 256, 48 * dt.itemsize, dtype=np.uint8)
    x = raw.view(dt).reshape(6, 8) if dt.kind != "b" else (raw[:48] & 1).astype(bool).reshape(6, 8)
    path = str(tmp_path / "1")
    ckpt.save(path, {"x": x})
    assert ckpt.metadata(path).arrays["x"].packed
    back = ckpt.restore(path)["x"]
    assert back.dtype == x.dtype and back.tobytes() == x.tobytes()


def test_int4_is_not_packed(tmp_path):
    x = jax.device_put(jnp.arange(16, dtype=jnp.int4) % 7)
    path = str(tmp_path / "1")
    ckpt.save(path, {"x": x})
    assert not ckpt.metadata(path).arrays["x"].packed
    np.testing.assert_array_equal(np.asarray(ckpt.restore(path)["x"]), np.asarray(x))


def test_threshold_zero_writes_the_per_leaf_layout_and_both_restore(tmp_path):
    state = _state(2)
    ckpt.save(str(tmp_path / "0"), state, pack_small_leaves_bytes=0)
    assert not os.path.exists(tmp_path / "0" / "packed")
    manifest = _json(tmp_path / "0" / "manifest.json")
    assert "packed" not in manifest and not any(e.get("packed") for e in manifest["leaves"].values())
    assert os.path.exists(tmp_path / "0" / "arrays" / "vec" / "0" / "zarr.json")
    _assert_equal(ckpt.restore(str(tmp_path / "0"), _target(state)), state)
    # A threshold below a matrix chunk (4 KiB) packs only the vectors (1 KiB) and smaller.
    ckpt.save(str(tmp_path / "1"), state, pack_small_leaves_bytes=2048)
    meta = ckpt.metadata(str(tmp_path / "1")).arrays
    assert meta["vec/0"].packed and not meta["mat/0"].packed
    _assert_equal(ckpt.restore(str(tmp_path / "1"), _target(state)), state)
    with pytest.raises(ValueError, match="pack_small_leaves_bytes"):
        ckpt.save(str(tmp_path / "2"), state, pack_small_leaves_bytes=-1)


def test_manager_packs_and_restores(tmp_path):
    state = _state(2)
    with ckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        assert os.path.exists(tmp_path / "run" / "1" / "packed" / "process-0" / "c" / "0")
        _assert_equal(mgr.restore(1, _target(state)), state)


def test_verify_and_restore_name_a_damaged_packed_leaf(tmp_path):
    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    assert ckpt.verify(path).ok
    manifest = _json(f"{path}/manifest.json")
    box = next(b for b in manifest["packed"][0]["boxes"] if b["leaf"] == "mat/1")
    with open(f"{path}/packed/process-0/c/0", "r+b") as f:
        f.seek(box["offset"] + 5)
        byte = f.read(1)
        f.seek(box["offset"] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = ckpt.verify(path)
    assert not report.ok and any("['mat']['1']" in p for p in report.problems)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['mat'\]\['1'\].*crc32c mismatch"):
        ckpt.restore(path, _target(state))
    # Leaves in other parts of the pack still restore alone.
    out = ckpt.restore(path, {"vec": {"0": _target(state)["vec"]["0"]}}, partial=True)
    np.testing.assert_array_equal(np.asarray(out["vec"]["0"]), np.asarray(state["vec"]["0"]))


@pytest.mark.parametrize("lost", ["chunk_file", "whole_array"])
def test_verify_names_every_leaf_a_missing_pack_loses(tmp_path, lost):
    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    os.remove(f"{path}/packed/process-0/c/0") if lost == "chunk_file" else shutil.rmtree(f"{path}/packed/process-0")
    report = ckpt.verify(path)
    assert not report.ok
    packed = [leaf for leaf, m in ckpt.metadata(path).arrays.items() if m.packed]
    assert len(packed) == 7  # vec/0, vec/1, mat/0, mat/1, bf, ids, key
    for leaf in packed:
        assert any(f"leaf {ckpt.metadata(path).keystr(leaf)}" in p and "packed/process-0/c/0" in p for p in report.problems), (leaf, report.problems)
    assert report.bytes_checked == state["big"].nbytes  # nothing of the pack was checked


@pytest.mark.parametrize("how", ["renamed", "removed"])
def test_a_step_deleted_while_its_pack_is_read_is_not_found(tmp_path, monkeypatch, how):
    from checkpointer import _storage
    from checkpointer._commit import _directory

    run = str(tmp_path / "run")
    ckpt.save(f"{run}/1", {"a": np.arange(64.0), "b": np.ones((8, 8), np.float32)})
    storage, directory = _storage.storage_for(run)
    real, calls = _pack.read_runs, []

    def delete_then_read(*args, **kwargs):
        if not calls:
            moved = _directory.unpublish_step(storage, directory, 1)
            if how == "removed":
                storage.delete_tree(moved)
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_pack, "read_runs", delete_then_read)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="deleted"):
        ckpt.restore(f"{run}/1")
    assert calls


def test_a_truncated_pack_is_refused_before_reading(tmp_path):
    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    with open(f"{path}/packed/process-0/c/0", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"pack file packed/process-0/c/0 has 100 bytes"):
        ckpt.restore(path, _target(state))


def test_a_pack_that_cannot_be_read_names_the_leaves_in_the_read(tmp_path, monkeypatch):
    """On storage without a cheap size check (object stores) a truncated pack fails at
    its read: the error names the leaf, not only the pack file."""
    from checkpointer import _storage

    path = str(tmp_path / "1")
    ckpt.save(path, {"a": np.arange(64.0), "b": np.ones((8, 8), np.float32)})
    with open(f"{path}/packed/process-0/c/0", "r+b") as f:
        f.truncate(100)
    monkeypatch.setattr(_storage.LocalStorage, "cheap_size", False)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['a'\] in .*1: pack file packed/process-0/c/0, bytes 0..512, cannot be read"):
        ckpt.restore(path, {"a": None}, partial=True)


@pytest.mark.parametrize("damage", ["offset_past_end", "missing_box", "unknown_leaf", "box_off_grid", "str_shape",
                                    "empty_box_past_the_leaf"])
def test_a_damaged_pack_index_in_the_manifest_is_corrupt(tmp_path, damage):
    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    manifest = _json(f"{path}/manifest.json")
    boxes = manifest["packed"][0]["boxes"]
    if damage == "offset_past_end":
        boxes[0]["offset"] = manifest["packed"][0]["bytes"]
    elif damage == "missing_box":
        del boxes[-1]
    elif damage == "unknown_leaf":
        boxes[0]["leaf"] = "big"
    elif damage == "box_off_grid":
        b = next(b for b in boxes if b["leaf"] == "mat/0")
        b["box"][0][1] += 1
    elif damage == "empty_box_past_the_leaf":
        # An empty box beyond the leaf's end stands in for its last chunk: the count of
        # boxes is right, 0 bytes have crc32c 0, and verify used to call it ok.
        b = [b for b in boxes if b["leaf"] == "mat/0"][-1]
        b["box"], b["data_bytes"], b["data_crc32c"] = [[0, 64], [64, 0]], 0, 0
    else:  # a string where a size belongs must not be multiplied out (str * 2**60)
        b = next(b for b in boxes if b["leaf"] == "mat/0")
        b["box"][1] = ["x" * 8, 2**60]
    with open(f"{path}/manifest.json", "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ckpt.CorruptCheckpointError, match="packed"):
        ckpt.metadata(path)


def test_plan_and_inspect_show_packed_leaves(tmp_path, capsys):
    from checkpointer._cli._main import main

    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    plan = ckpt.plan_restore(path, _target(state, make_mesh((4, 2), ("data", "model"))))
    lp = next(lp for lp in plan.leaves if lp.leaf_path == "mat/0")
    assert lp.bytes_needed == 64 * 64 * 4 and all(b.packed and not b.reads for b in lp.boxes)
    assert "['mat']['0']" in str(plan) and "mat/0" not in str(plan)
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "['mat']['0']" in out and "packed" in out
    assert main(["inspect", path, "--json"]) == 0
    leaves = {leaf["path"]: leaf for leaf in json.loads(capsys.readouterr().out)["leaves"]}
    assert leaves["mat/0"]["packed"] is True and leaves["big"]["packed"] is False
    assert main(["plan", path, "--mesh", "4x2"]) == 0
    assert main(["verify", path]) == 0


# --- the planner, pure ----------------------------------------------------------------------


def _packed_meta():
    """A float32 [8, 8] leaf saved in column blocks of 4, packed at offsets 0 and 128 (+100 gap)."""
    boxes = (
        PackedBox("packed/process-0/c/0", 1000, Box((0, 0), (8, 4)), 100, 128, 11),
        PackedBox("packed/process-0/c/0", 1000, Box((0, 4), (8, 4)), 228, 128, 22),
    )
    return ArrayMetadata("w", (8, 8), np.dtype(np.float32), (8, 4), (8, 4), None, packed=True, pack_boxes=boxes)


def test_planner_reads_the_packed_chunks_a_box_needs_with_their_destinations():
    meta = _packed_meta()
    lp = plan_leaf(meta, [(0, Box((2, 2), (4, 4))), (1, Box((2, 2), (4, 4)))])
    [b] = lp.boxes
    assert b.device_ids == (0, 1) and b.reads == ()
    left, right = b.packed
    assert (left.offset, left.nbytes, left.crc32c, left.box, left.local_box, left.dest) == (
        100, 128, 11, Box((2, 2), (4, 2)), Box((2, 2), (4, 2)), (0, 0))
    assert (right.offset, right.box, right.local_box, right.dest) == (228, Box((2, 4), (4, 2)), Box((2, 0), (4, 2)), (0, 2))
    assert b.bytes_read == 256 and lp.bytes_needed == 64
    whole = plan_leaf(meta, [(0, Box((0, 4), (8, 4)))]).boxes[0]
    assert [(p.offset, p.dest) for p in whole.packed] == [(228, (0, 0))]


def test_coalescing_joins_neighbours_within_the_gap_and_reads_each_chunk_once():
    meta = _packed_meta()
    lp = plan_leaf(meta, [(0, Box((0, 0), (8, 8))), (1, Box((0, 0), (4, 8)))])
    assert [b.bytes_read for b in lp.boxes] == [256, 256] and lp.bytes_read == 256  # each chunk read once
    reads = [("w", p) for b in lp.boxes for p in b.packed]
    [run] = coalesce_packed(reads)
    assert (run.key, run.offset, run.nbytes) == ("packed/process-0/c/0", 100, 256)
    assert [(o, n) for o, n, _, _ in run.boxes] == [(100, 128), (228, 128)]
    far = PackedBox("packed/process-0/c/0", 10**7, Box((0, 4), (8, 4)), 228 + PACK_GAP_BYTES + 1, 128, 22)
    meta2 = ArrayMetadata("w", (8, 8), np.dtype(np.float32), (8, 4), (8, 4), None, packed=True,
                          pack_boxes=(meta.pack_boxes[0], far))
    runs = coalesce_packed(("w", p) for b in plan_leaf(meta2, [(0, Box((0, 0), (8, 8)))]).boxes for p in b.packed)
    assert [(r.offset, r.nbytes) for r in runs] == [(100, 128), (far.offset, 128)]


def test_the_rule_packs_small_whole_byte_chunks_only():
    f4 = np.dtype(np.float32)
    assert _pack.packs_leaf((1024, 1024), (256, 256), f4, 256 << 10)  # 256 KiB chunks: packed
    assert not _pack.packs_leaf((1024, 1024), (256, 512), f4, 256 << 10)
    assert not _pack.packs_leaf((0, 4), (1, 4), f4, 256 << 10)  # empty
    assert not _pack.packs_leaf((4,), (4,), np.dtype(ml_dtypes.int4), 256 << 10)  # sub-byte
    assert not _pack.packs_leaf((4,), (4,), f4, 0)


def test_a_process_record_with_a_pack_round_trips_and_keeps_unknown_fields(tmp_path):
    from checkpointer._format._json import dumps_large, loads
    from checkpointer._format._records import ProcessRecord

    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    raw = _json(f"{path}/processes/0.json")
    raw["packed"]["boxes"][0]["later"] = [1]
    raw["packed"]["later"] = "x"
    record = ProcessRecord.from_json(raw, "0.json")
    assert record.packed.boxes[0].extra == {"later": [1]} and record.packed.extra == {"later": "x"}
    assert loads(dumps_large(record.to_json()), "0.json") == raw
    raw["packed"]["boxes"][1]["offset"] = "7"
    with pytest.raises(ckpt.CorruptCheckpointError, match="packed box 1.*not a count"):
        ProcessRecord.from_json(raw, "0.json")


def test_the_write_rate_limit_paces_the_pack_as_one_write(tmp_path, monkeypatch):
    from checkpointer._storage._ratelimit import TokenBucket

    calls = []
    real = TokenBucket.acquire
    monkeypatch.setattr(TokenBucket, "acquire", lambda self, n: calls.append(n) or real(self, n))
    state = _state(2)
    ckpt.save(str(tmp_path / "1"), state, max_write_bytes_per_s=2**30)
    meta = ckpt.metadata(str(tmp_path / "1")).arrays
    packed = sum(m.nbytes for m in meta.values() if m.packed)
    big_chunks = [m.nbytes // 2 for m in meta.values() if not m.packed]  # "big": two row blocks of P("data")
    assert sorted(calls) == sorted(big_chunks * 2 + [packed])


def test_verify_progress_counts_packed_chunks_and_reaches_the_total(tmp_path):
    """An all-packed checkpoint: the progress callback must move and end at its total,
    which is the number of chunks the report says it checked."""
    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    calls = []
    report = ckpt.verify(path, progress=lambda done, total: calls.append((done, total)))
    assert report.ok and calls
    assert calls[-1] == (report.chunks_checked, report.chunks_checked)
    assert all(total == calls[-1][1] for _, total in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_read_errors_name_the_process_in_a_multi_process_job(tmp_path, monkeypatch):
    """STYLE: an error names the process. With one process there is nothing to tell apart
    (`this_process()` is None); in a multi-process job each process names itself."""
    from checkpointer import _errors

    assert _errors.this_process() is None  # this test runs one process
    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    manifest = _json(f"{path}/manifest.json")
    box = next(b for b in manifest["packed"][0]["boxes"] if b["leaf"] == "mat/1")
    with open(f"{path}/packed/process-0/c/0", "r+b") as f:
        f.seek(box["offset"])
        f.write(b"\xff\xff\xff\xff")
    monkeypatch.setattr(_errors, "this_process", lambda: 3)  # as process 3 of a larger job would
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['mat'\]\['1'\] in \S+ \(process 3\)"):
        ckpt.restore(path, _target(state))


def test_read_errors_of_an_unpacked_leaf_name_the_process_too(tmp_path, monkeypatch):
    from checkpointer import _errors

    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state, pack_small_leaves_bytes=0)
    with open(f"{path}/arrays/mat/1/c/0/0", "r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    monkeypatch.setattr(_errors, "this_process", lambda: 3)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['mat'\]\['1'\] in \S+ \(process 3\)"):
        ckpt.restore(path, _target(state))


def test_the_format_specs_zarr_recipe_for_packed_leaves_runs_as_written(tmp_path):
    """The zarr-python recipe of docs/format.md, run as a user copies it (only its path moved
    into tmp_path): it must save packed leaves and read every one back with zarr-python."""
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "format.md"), encoding="utf-8") as f:
        readme = f.read()
    start = readme.index("import numpy as np, zarr, checkpointer as ckpt\n")
    code = readme[start : readme.index("```", start)]
    assert 'path = "/tmp/small/1"' in code
    code = code.replace('"/tmp/small/1"', repr(str(tmp_path / "1")))
    scope: dict = {}
    exec(compile(code, "docs/format.md", "exec"), scope)  # noqa: S102 (the page's own snippet)
    chunks = scope["chunks"]
    assert len(chunks) == 100
    for i in range(100):
        np.testing.assert_array_equal(chunks[f"norms/{i}", (0,)], np.full(256, i, np.float32))


# --- seams: damage, the index's copies, the cooperative share (issue 19 item 4) -------------


@pytest.mark.parametrize("damage", ["truncated", "damaged"])
def test_a_damaged_or_truncated_pack_fails_the_leaves_whose_bytes_are_gone(tmp_path, damage):
    """Leaves share a pack file, not a fate: restore names the leaves whose packed bytes
    are cut off or fail their crc32c, and the others still restore."""
    tree = {"other": np.arange(16, dtype=np.float32), "w": np.arange(4096, dtype=np.float32), "z": np.ones(64, np.int32)}
    path = str(tmp_path / "1")
    ckpt.save(path, tree)
    boxes = {b["leaf"]: b for b in _json(f"{path}/manifest.json")["packed"][0]["boxes"]}
    assert boxes["other"]["offset"] < boxes["w"]["offset"] < boxes["z"]["offset"]
    pack = f"{path}/packed/process-0/c/0"
    with open(pack, "r+b") as f:
        if damage == "truncated":
            f.truncate(1280)  # inside 'w': 'other' is whole, 'w' and 'z' are gone
            expected = rf"leaf \['w'\] in {path}: pack file packed/process-0/c/0 has 1280 bytes, expected \d+ .*'z'.*verify"
        else:
            for leaf in ("w", "z"):
                f.seek(boxes[leaf]["offset"] + 8)
                f.write(b"\xff\xff\xff\xff")
            expected = rf"leaf \['w'\] in {path}: packed bytes .* crc32c mismatch.*'z'.*verify"
    with pytest.raises(ckpt.CorruptCheckpointError, match=expected) as raised:
        ckpt.restore(path)
    assert "'other'" not in str(raised.value)
    out = ckpt.restore(path, {"other": None}, partial=True)
    np.testing.assert_array_equal(out["other"], tree["other"])


def test_verify_reports_a_pack_whose_size_disagrees_with_the_manifest(tmp_path, caplog):
    """The file is whole but the manifest's `bytes` is wrong: verify says so; restore
    reads every leaf (each checked by its crc32c) and warns."""
    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    manifest = _json(f"{path}/manifest.json")
    size = manifest["packed"][0]["bytes"]
    manifest["packed"][0]["bytes"] = size + 8  # every box still fits: the manifest parses
    with open(f"{path}/manifest.json", "w") as f:
        json.dump(manifest, f)
    report = ckpt.verify(path)
    assert not report.ok
    assert any(f"pack packed/process-0/c/0 has {size} bytes, the manifest's 'packed' index says {size + 8}" in p
               for p in report.problems), report.problems
    _assert_equal(ckpt.restore(path, _target(state)), state)
    assert any(f"has {size} bytes, expected {size + 8}" in r.getMessage() for r in caplog.records), caplog.records
    # Cut one byte more than the manifest allows for: the last leaf's bytes are gone.
    with open(f"{path}/packed/process-0/c/0", "r+b") as f:
        f.truncate(size - 5)
    assert any(f"has {size - 5} bytes" in p for p in ckpt.verify(path).problems)
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"has {size - 5} bytes, expected {size + 8}"):
        ckpt.restore(path, _target(state))


@pytest.mark.parametrize("copy", ["record", "attributes"])
def test_verify_names_the_copy_and_the_entry_of_a_pack_index_that_disagrees(tmp_path, copy):
    """The manifest's `packed` index is the truth; the writer's record and the pack's
    zarr.json attributes (what zarr-python users read) must agree with it."""
    state = _state(2)
    path = str(tmp_path / "1")
    ckpt.save(path, state)
    assert ckpt.verify(path).ok
    if copy == "record":
        where, raw = f"{path}/processes/0.json", _json(f"{path}/processes/0.json")
        entries, name, field = raw["packed"]["boxes"], "processes/0.json", "data_crc32c"
    else:
        where, raw = f"{path}/packed/process-0/zarr.json", _json(f"{path}/packed/process-0/zarr.json")
        entries, name, field = raw["attributes"]["checkpointer"]["packed_index"], "packed/process-0/zarr.json", "offset"
    entry = next(b for b in entries if b["leaf"] == "mat/1" and b["box"][0] == [0, 16])
    entry[field] += 4
    with open(where, "w") as f:
        json.dump(raw, f)
    report = ckpt.verify(path)
    assert not report.ok
    [problem] = [p for p in report.problems if name in p]
    assert "['mat']['1']" in problem and "[0, 16]" in problem and f"{field} {entry[field]}" in problem, problem
    assert "manifest" in problem, problem


def test_cooperative_plan_reads_each_packed_byte_once_in_all(tmp_path, capsys):
    """A 512 KiB replicated packed leaf (one chunk), planned for 2 processes: each reads
    its half of the chunk's bytes and receives the other half."""
    from checkpointer._cli._main import main

    w = np.arange(128 * 1024, dtype=np.float32).reshape(256, 512)
    path = str(tmp_path / "1")
    ckpt.save(path, {"w": w}, pack_small_leaves_bytes=512 << 10)
    assert ckpt.metadata(path).arrays["w"].packed
    mesh = jax.sharding.AbstractMesh((8,), ("d",))
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P()))}
    for i in range(2):
        plan = ckpt.plan_restore(path, target, process_index=i, processes=2)
        assert plan.cooperative and plan.bytes_needed == 512 << 10
        assert plan.bytes_read == 256 << 10 and plan.bytes_received == 256 << 10, (plan.bytes_read, plan.bytes_received)
        assert plan.read_amplification == 0.5
        assert main(["plan", path, "--mesh", "8", "--processes", "2", "--process-index", str(i), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["bytes_read"] == 256 << 10 and doc["bytes_received"] == 256 << 10, doc


def test_crc32c_of_pieces_combines_to_the_whole():
    import crc32c

    from checkpointer._encoding import _crc

    data = np.random.default_rng(4).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    cuts = [0, 1, 1000, 1 << 20, (2 << 20) + 7, len(data)]
    pieces = [(crc32c.crc32c(data[a:b]), b - a) for a, b in zip(cuts, cuts[1:])]
    assert _crc.combine_all(pieces) == crc32c.crc32c(data)
    assert _crc.combine(crc32c.crc32c(b"ab"), crc32c.crc32c(b""), 0) == crc32c.crc32c(b"ab")


def test_a_cooperative_share_splits_a_packed_chunk_only_into_contiguous_pieces():
    import crc32c

    from checkpointer._encoding import check_pieces
    from checkpointer._encoding._leaf_plan import RestorePlan
    from checkpointer._encoding._packed import PackedEncoding, shared_chunks

    data = np.arange(64, dtype=np.float32).tobytes()
    key = "packed/process-0/c/0"
    meta = ArrayMetadata("w", (8, 8), np.dtype(np.float32), (8, 8), (8, 8), None, packed=True,
                         pack_boxes=(PackedBox(key, 1000, Box((0, 0), (8, 8)), 100, 256, crc32c.crc32c(data)),))
    enc = PackedEncoding()
    rows = {Box((0, 0), (4, 8)): frozenset({0}), Box((4, 0), (4, 8)): frozenset({1, 2})}
    [shared] = shared_chunks(meta, rows).values()
    assert shared.pieces == ((100, 128, 0), (228, 128, 1))  # the lowest holder's crc32c counts
    lp = enc.plan_share(meta, [(0, Box((0, 0), (4, 8)))], rows, 0)
    [read] = lp.boxes[0].packed
    assert (read.offset, read.nbytes, read.crc32c) == (100, 128, None) and lp.bytes_read == 128 and lp.shared == (shared,)
    # After the exchange every process checks the chunk from the pieces' crc32c.
    plan = RestorePlan("/ckpt/1", 0, (lp,))
    halves = np.array([crc32c.crc32c(data[:128]), crc32c.crc32c(data[128:])], np.uint32)
    check_pieces(plan, halves, "/ckpt/1")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['w'\] in /ckpt/1: packed bytes 100..356 of .* processes \[0, 1\]: crc32c mismatch"):
        check_pieces(plan, halves ^ np.array([0, 1], np.uint32), "/ckpt/1")
    # Column halves are strided in the chunk: not split, each process reads it whole.
    cols = {Box((0, 0), (8, 4)): frozenset({0}), Box((0, 4), (8, 4)): frozenset({1})}
    assert shared_chunks(meta, cols) == {}
    lp = enc.plan_share(meta, [(0, Box((0, 0), (8, 4)))], cols, 0)
    [read] = lp.boxes[0].packed
    assert (read.offset, read.nbytes, read.crc32c) == (100, 256, crc32c.crc32c(data)) and lp.shared == ()


def test_crc32c_combines_alike_for_a_length_combined_often():
    import crc32c

    from checkpointer._encoding import _crc

    data = np.random.default_rng(5).integers(0, 256, 64 * 4099, dtype=np.uint8).tobytes()
    pieces = [(crc32c.crc32c(data[k : k + 4099]), 4099) for k in range(0, len(data), 4099)]
    # The first few combinations of a length run the product loop, the later ones its byte tables.
    assert _crc.combine_all(pieces) == crc32c.crc32c(data)
    assert all(_crc.combine_all(pieces[:k]) == crc32c.crc32c(data[: k * 4099]) for k in range(1, 12))


def test_the_pack_zarr_json_is_the_one_tensorstore_writes(tmp_path):
    # The direct writer writes the pack's zarr.json itself: byte for byte TensorStore's.
    import tensorstore as ts

    from checkpointer._format import PackedBoxRecord

    dtypes = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.bool_), np.dtype(np.int64), np.dtype(np.complex64)]
    boxes = [PackedBoxRecord(leaf="a/%C3%A9t%C3%A9", box=Box((0, 8), (4, 8)), offset=0, data_bytes=128, data_crc32c=0),
             PackedBoxRecord(leaf="b/@int:3/0", box=Box((), ()), offset=128, data_bytes=2, data_crc32c=4294967295),
             PackedBoxRecord(leaf="", box=Box((7,), (1,)), offset=130, data_bytes=1, data_crc32c=17),
             PackedBoxRecord(leaf="c.d~e_f-g", box=Box((0,), (3,)), offset=131, data_bytes=24, data_crc32c=5),
             PackedBoxRecord(leaf="x", box=Box((0, 0, 0), (1, 1, 1)), offset=155, data_bytes=8, data_crc32c=6)]
    nbytes = 163
    attrs = [b.to_json() | {"dtype": d.name} for b, d in zip(boxes, dtypes)]
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "ts") + "/"}, "create": True,
            "metadata": _pack.zarr_metadata(nbytes, {"checkpointer": {"packed_index": attrs, "layout": _pack.LAYOUT}})}
    ts.open(spec).result()
    assert _pack.zarr_json(nbytes, boxes, dtypes) == (tmp_path / "ts" / "zarr.json").read_bytes()


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_save_s_pack_zarr_json_does_not_depend_on_the_writer(tmp_path, direct_io):
    state = {"w": np.arange(10, dtype=np.float32), "b": jnp.ones((3, 2), jnp.bfloat16), "s": np.int32(4), "f": np.bool_(True)}
    path = str(tmp_path / "c")
    try:
        ckpt.save(path, state, direct_io=direct_io)
    except ckpt.SaveError:
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    written = (tmp_path / "c" / "packed" / "process-0" / "zarr.json").read_bytes()
    index = json.loads(written)["attributes"]["checkpointer"]["packed_index"]
    record = json.loads((tmp_path / "c" / "processes" / "0.json").read_text())["packed"]["boxes"]
    assert [{k: v for k, v in e.items() if k != "dtype"} for e in index] == record
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "ts") + "/"}, "create": True,
            "metadata": {k: v for k, v in json.loads(written).items() if k not in ("node_type", "zarr_format")}}
    import tensorstore as ts

    ts.open(spec).result()
    assert written == (tmp_path / "ts" / "zarr.json").read_bytes()
    np.testing.assert_array_equal(ckpt.restore(path)["w"], state["w"])


def test_slab_fill_runs_and_short_runs():
    """`PackSlab.fill` copies runs of one dtype and shape as blocks and the rest leaf by
    leaf: every view holds its source, the views lie back to back in order, and the
    buffer's bytes are the sources' bytes in order (the pack as written)."""
    rng = np.random.default_rng(0)
    sources = (
        [rng.standard_normal(3).astype(np.float32) for _ in range(5)]  # a run
        + [rng.integers(-9, 9, (2, 2)).astype(np.int8) for _ in range(2)]  # a short run
        + [np.array(rng.standard_normal()) for _ in range(6)]  # scalars
        + [rng.standard_normal((2, 1)).astype(ml_dtypes.bfloat16) for _ in range(4)]  # a run of another dtype
        + [np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]]  # not contiguous
    )
    slab = _pack.PackSlab.fill(sources, lambda n: _pack.aligned_empty((n,), np.dtype(np.uint8), _pack.DIRECT_ALIGN))
    assert slab.nbytes == sum(s.nbytes for s in sources) and len(slab.views) == len(sources)
    offset = 0
    for src, view in zip(sources, slab.views):
        assert isinstance(view, np.ndarray) and view.shape == src.shape and view.dtype == src.dtype
        np.testing.assert_array_equal(view, src)
        assert view.ctypes.data == slab.buffer.ctypes.data + offset
        offset += src.nbytes
    expected = b"".join(np.ascontiguousarray(s).tobytes() for s in sources)
    assert slab.buffer[: slab.nbytes].tobytes() == expected
