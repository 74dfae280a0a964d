"""End-to-end save and restore across meshes, dtypes, shapes and trees (one process)."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._commit import _directory
from checkpointer._restore import _pipeline as _restore


def _load_json(path):
    with open(path) as f:
        return json.load(f)


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _sds(x, mesh, spec, dtype=None):
    return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=NamedSharding(mesh, spec))


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def _assert_same_bits(a, b):
    assert np.asarray(a).shape == np.asarray(b).shape
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))


MESH_2x4 = ((2, 4), ("data", "model"))

# (target mesh shape, axis names, spec) for a 2-D leaf saved with P('data', 'model') on 2x4.
RESHARDINGS = [
    ((2, 4), ("data", "model"), P("data", "model")),  # same mesh
    ((4, 2), ("data", "model"), P("data", "model")),  # 2x4 -> 4x2
    ((2, 4), ("data", "model"), P("model", "data")),  # axes swapped
    ((4, 2), ("x", "y"), P("y", "x")),  # other names and order
    ((4,), ("d",), P("d")),  # 8 -> 4 devices, 2-D -> 1-D mesh
    ((1,), ("d",), P()),  # 1 device
    ((8,), ("d",), P(None, "d")),  # 1-D mesh of 8, other dim
    ((2, 4), ("data", "model"), P()),  # sharded -> replicated
    ((3,), ("d",), P("d")),  # boxes not aligned with saved chunks
    ((6,), ("d",), P(None, "d")),
]


@pytest.mark.parametrize("mesh_shape,names,spec", RESHARDINGS)
def test_restore_onto_other_mesh_is_bit_exact(ckpt_dir, mesh_shape, names, spec):
    x = np.random.default_rng(0).standard_normal((48, 24)).astype(np.float32)
    src = _put(x, make_mesh(*MESH_2x4), P("data", "model"))
    ckpt.save(f"{ckpt_dir}/1", {"w": src})
    mesh = make_mesh(mesh_shape, names)
    out = ckpt.restore(f"{ckpt_dir}/1", {"w": _sds(x, mesh, spec)})
    assert out["w"].sharding == NamedSharding(mesh, spec)
    _assert_same_bits(out["w"], x)
    for shard in out["w"].addressable_shards:
        _assert_same_bits(shard.data, x[shard.index])


def test_replicated_back_to_sharded(ckpt_dir):
    x = np.arange(64 * 8, dtype=np.int32).reshape(64, 8)
    ckpt.save(f"{ckpt_dir}/1", {"w": _put(x, make_mesh((8,), ("d",)), P())})
    meta = ckpt.metadata(f"{ckpt_dir}/1").arrays["w"]
    assert meta.chunk_shape == (64, 8)  # one chunk: the whole replicated array
    mesh = make_mesh((2, 4), ("a", "b"))
    out = ckpt.restore(f"{ckpt_dir}/1", {"w": _sds(x, mesh, P("b", "a"))})
    _assert_same_bits(out["w"], x)


DTYPES = [np.float32, ml_dtypes.bfloat16, np.int32, np.bool_, np.float16, np.uint8, np.int8, np.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_dtypes_round_trip_bit_exact(ckpt_dir, dtype):
    rng = np.random.default_rng(1)
    if np.dtype(dtype).kind == "b":
        x = rng.integers(0, 2, (16, 8)).astype(np.bool_)
    elif np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, (16, 8), endpoint=True).astype(dtype)
    elif np.dtype(dtype).kind == "c":
        x = (rng.standard_normal((16, 8)) + 1j * rng.standard_normal((16, 8))).astype(dtype)
    else:
        x = rng.standard_normal((16, 8)).astype(dtype)
        x[0, :4] = np.array([np.nan, -0.0, np.inf, -np.inf]).astype(dtype)
    src = _put(x, make_mesh(*MESH_2x4), P("data", "model"))
    ckpt.save(f"{ckpt_dir}/1", {"x": src})
    assert ckpt.metadata(f"{ckpt_dir}/1").arrays["x"].dtype == np.dtype(dtype)
    out = ckpt.restore(f"{ckpt_dir}/1", {"x": _sds(x, make_mesh((4,), ("d",)), P("d"))})
    _assert_same_bits(out["x"], x)
    _assert_same_bits(ckpt.restore(f"{ckpt_dir}/1")["x"], x)


def test_nan_payload_and_subnormals_survive(ckpt_dir):
    raw = np.array([0x7FC00001, 0x7F800123, 0x00000001, 0x80000000], dtype=np.uint32)
    x = raw.view(np.float32)
    ckpt.save(f"{ckpt_dir}/1", {"x": _put(x, make_mesh((4,), ("d",)), P("d"))})
    out = ckpt.restore(f"{ckpt_dir}/1", {"x": _sds(x, make_mesh((2,), ("d",)), P("d"))})
    np.testing.assert_array_equal(np.asarray(out["x"]).view(np.uint32), raw)


def test_cast_on_restore_within_a_kind(ckpt_dir):
    x = np.linspace(-2, 2, 32, dtype=np.float32).reshape(4, 8)
    ckpt.save(f"{ckpt_dir}/1", {"x": _put(x, make_mesh((2,), ("d",)), P("d"))})
    out = ckpt.restore(f"{ckpt_dir}/1", {"x": _sds(x, make_mesh((4,), ("d",)), P("d"), dtype=jnp.bfloat16)})
    assert out["x"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["x"]), x.astype(ml_dtypes.bfloat16))


def test_cast_across_kinds_is_refused(ckpt_dir):
    x = np.ones((4, 8), np.float32)
    ckpt.save(f"{ckpt_dir}/1", {"layer": {"x": _put(x, make_mesh((2,), ("d",)), P("d"))}})
    with pytest.raises(ckpt.DTypeMismatchError, match=r"leaf \['layer'\]\['x'\].*float32.*int32"):
        ckpt.restore(f"{ckpt_dir}/1", {"layer": {"x": _sds(x, make_mesh((2,), ("d",)), P("d"), dtype=jnp.int32)}})


def test_shape_mismatch_names_leaf_and_fix(ckpt_dir):
    x = np.ones((4, 8), np.float32)
    ckpt.save(f"{ckpt_dir}/1", {"a": {"w": _put(x, make_mesh((2,), ("d",)), P("d"))}})
    bad = {"a": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(make_mesh((2,), ("d",)), P("d")))}}
    with pytest.raises(ckpt.ShapeMismatchError, match=r"leaf \['a'\]\['w'\].*\(4, 8\).*\(8, 8\)") as e:
        ckpt.restore(f"{ckpt_dir}/1", bad)
    assert isinstance(e.value, ValueError) and ckpt_dir in str(e.value)


def test_structure_mismatch_lists_missing_and_extra(ckpt_dir):
    mesh = make_mesh((2,), ("d",))
    tree = {f"layer_{i}": {"w": _put(np.ones((2, 2), np.float32), mesh, P())} for i in range(12)}
    ckpt.save(f"{ckpt_dir}/1", tree)
    target = {f"layer_{i}": {"w": NamedSharding(mesh, P())} for i in range(16)}
    with pytest.raises(ckpt.StructureMismatchError) as e:
        ckpt.restore(f"{ckpt_dir}/1", target)
    msg = str(e.value)
    assert "in the target but not in the checkpoint (4)" in msg
    for i in range(12, 16):
        assert f"['layer_{i}']['w']" in msg
    # A subset restores with partial=True and reads only what it names.
    sub = ckpt.restore(f"{ckpt_dir}/1", {"layer_3": {"w": NamedSharding(mesh, P())}}, partial=True)
    assert list(sub) == ["layer_3"]
    with pytest.raises(ckpt.StructureMismatchError, match="partial=True"):
        ckpt.restore(f"{ckpt_dir}/1", {"layer_3": {"w": NamedSharding(mesh, P())}})


def test_target_sharding_that_does_not_divide_is_a_clear_error(ckpt_dir):
    ckpt.save(f"{ckpt_dir}/1", {"b": np.ones(5, np.float32)})
    with pytest.raises(ckpt.InvalidTargetError, match=r"leaf \['b'\].*divide"):
        ckpt.restore(f"{ckpt_dir}/1", {"b": NamedSharding(make_mesh((2,), ("d",)), P("d"))})


def test_target_kinds_sharding_array_none(ckpt_dir):
    mesh = make_mesh(*MESH_2x4)
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    ckpt.save(f"{ckpt_dir}/1", {"a": _put(x, mesh, P("data")), "b": _put(x, mesh, P("model")), "c": _put(x, mesh, P())})
    like = _put(np.zeros_like(x), make_mesh((4,), ("d",)), P(None, "d"))
    out = ckpt.restore(f"{ckpt_dir}/1", {"a": NamedSharding(mesh, P("model")), "b": like, "c": None})
    assert out["a"].sharding.spec == P("model") and out["b"].sharding == like.sharding
    assert isinstance(out["c"], np.ndarray)
    for v in out.values():
        _assert_same_bits(v, x)


def test_uneven_and_odd_shapes(ckpt_dir):
    mesh = make_mesh(*MESH_2x4)
    tree = {
        "odd": _put(np.arange(7 * 13, dtype=np.float32).reshape(7, 13), mesh, P()),
        "tall": _put(np.arange(1000 * 3, dtype=np.int32).reshape(1000, 3), mesh, P("model")),
        "scalar": _put(np.float32(3.5), mesh, P()),
        "empty": _put(np.zeros((0, 4), np.float32), mesh, P()),
        "long": _put(np.arange(1 << 20, dtype=np.float32), mesh, P(("data", "model"))),
    }
    ckpt.save(f"{ckpt_dir}/1", tree)
    m3 = make_mesh((3,), ("d",))
    target = {
        "odd": NamedSharding(m3, P()),
        "tall": NamedSharding(make_mesh((5,), ("d",)), P("d")),
        "scalar": NamedSharding(m3, P()),
        "empty": NamedSharding(m3, P()),
        "long": NamedSharding(make_mesh((6,), ("d",)), P()),
    }
    out = ckpt.restore(f"{ckpt_dir}/1", target)
    for k in tree:
        _assert_same_bits(out[k], np.asarray(tree[k]))


def test_single_scalar_tree_and_prng_keys(ckpt_dir):
    ckpt.save(f"{ckpt_dir}/1", jnp.float32(2.0))
    assert float(ckpt.restore(f"{ckpt_dir}/1")) == 2.0
    key = jax.random.key(42)
    ckpt.save(f"{ckpt_dir}/2", {"key": key})
    mesh = make_mesh((2,), ("d",))
    out = ckpt.restore(f"{ckpt_dir}/2", {"key": jax.ShapeDtypeStruct((), key.dtype, sharding=NamedSharding(mesh, P()))})
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(key))
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(make_mesh((8,), ("d",)), P("d")))
    ckpt.save(f"{ckpt_dir}/3", {"keys": keys})
    out = ckpt.restore(f"{ckpt_dir}/3", {"keys": NamedSharding(make_mesh((4,), ("d",)), P("d"))})
    np.testing.assert_array_equal(jax.random.key_data(out["keys"]), jax.random.key_data(keys))
    assert float(jax.random.uniform(out["keys"][3])) == float(jax.random.uniform(keys[3]))


def test_tree_kinds_and_non_array_leaves(ckpt_dir):
    optax = pytest.importorskip("optax")
    tree = {
        "opt": (0, optax.EmptyState(), 1),
        "a": None,
        "b": {},
        "c": (),
        "d": [],
        "test/test": 42,
        "mlp/~/linear_0": {"w": np.ones((5, 2), np.float32)},
        "..": "dots",
        "ünï cödé": 2**100,
        "f": -0.0,
        "np_scalar": np.float32(1.5),
        "flag": True,
        3: "int key",
    }
    tree = {str(k): v for k, v in tree.items() if not isinstance(k, int)}  # one key type per dict
    tree["ints"] = {1: "one", 2: "two"}
    ckpt.save(f"{ckpt_dir}/1", tree, pack_small_leaves_bytes=0)  # the per-leaf layout
    assert not any(".." == p for p in os.listdir(f"{ckpt_dir}/1/arrays"))
    back = ckpt.restore(f"{ckpt_dir}/1")
    assert back["opt"][0] == 0 and back["opt"][2] == 1 and back["a"] is None
    assert back["b"] == {} and back["c"] == () and back["d"] == []
    assert back["test/test"] == 42 and back[".."] == "dots" and back["ünï cödé"] == 2**100
    assert np.signbit(back["f"]) and back["flag"] is True
    assert back["np_scalar"] == np.float32(1.5) and back["np_scalar"].dtype == np.float32
    assert back["ints"] == {1: "one", 2: "two"}
    np.testing.assert_array_equal(back["mlp/~/linear_0"]["w"], np.ones((5, 2), np.float32))
    # With a target, the target's own node types come back.
    target = jax.tree_util.tree_map(lambda x: None, tree, is_leaf=lambda x: x is None)
    again = ckpt.restore(f"{ckpt_dir}/1", target)
    assert type(again["opt"][1]) is optax.EmptyState


def test_train_state_with_adamw_round_trips_onto_other_mesh(ckpt_dir):
    optax = pytest.importorskip("optax")
    train_state = pytest.importorskip("flax.training.train_state")
    mesh = make_mesh(*MESH_2x4)
    params = {"dense": {"kernel": jnp.ones((16, 32)), "bias": jnp.zeros((32,))}}

    def spec_for(x):
        return P(None, "model") if x.ndim == 2 else P()

    params = jax.tree_util.tree_map(lambda x: _put(x, mesh, spec_for(x)), params)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-3))
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    state = state.apply_gradients(grads=grads)
    ckpt.save(f"{ckpt_dir}/1", state)
    mesh2 = make_mesh((2, 2), ("data", "model"))
    abstract = jax.eval_shape(lambda: state)
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh2, spec_for(x))), abstract
    )
    out = ckpt.restore(f"{ckpt_dir}/1", target)
    assert type(out) is type(state) and type(out.opt_state[0]) is type(state.opt_state[0])
    assert out.step == 1
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(state)):
        _assert_same_bits(a, b)
        if np.ndim(a) == 2:
            assert a.sharding.mesh.shape == mesh2.shape


def test_layout_on_disk_and_commit_marker(ckpt_dir):
    mesh = make_mesh(*MESH_2x4)
    x = _put(np.ones((8, 8), np.float32), mesh, P("data", "model"))
    r = _put(np.ones((4,), np.float32), mesh, P())
    ckpt.save(f"{ckpt_dir}/5", {"x": x, "r": r}, metadata={"loss": 1.25}, pack_small_leaves_bytes=0)
    assert sorted(os.listdir(ckpt_dir)) == ["5"]  # the partial folder was renamed
    assert sorted(os.listdir(f"{ckpt_dir}/5")) == ["COMMITTED", "arrays", "manifest.json", "processes", "zarr.json"]
    zarr_json = _load_json(f"{ckpt_dir}/5/arrays/x/zarr.json")
    assert zarr_json["chunk_grid"]["configuration"]["chunk_shape"] == [4, 2]
    assert zarr_json["codecs"][0]["name"] == "sharding_indexed"
    assert {"name": "crc32c"} in zarr_json["codecs"][0]["configuration"]["codecs"]
    record = _load_json(f"{ckpt_dir}/5/processes/0.json")
    keys = sorted(c["key"] for c in record["chunks"])
    assert keys == sorted([f"arrays/x/c/{i}/{j}" for i in range(2) for j in range(4)] + ["arrays/r/c/0"])
    for c in record["chunks"]:
        assert os.path.getsize(f"{ckpt_dir}/5/{c['key']}") == c["bytes"]
    meta = ckpt.metadata(f"{ckpt_dir}/5")
    assert meta.step == 5 and meta.user_metadata == {"loss": 1.25} and meta.process_count == 1
    assert meta.arrays["x"].saved_sharding.spec == ("data", "model")
    assert meta.arrays["x"].saved_sharding.mesh_shape == (2, 4)


def test_readable_by_zarr_python(ckpt_dir):
    zarr = pytest.importorskip("zarr")
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    ckpt.save(f"{ckpt_dir}/1", {"x": _put(x, make_mesh(*MESH_2x4), P("data", "model"))}, pack_small_leaves_bytes=0)
    np.testing.assert_array_equal(zarr.open_array(f"{ckpt_dir}/1/arrays/x", mode="r")[...], x)


def test_uncommitted_folder_is_not_a_checkpoint(ckpt_dir):
    ckpt.save(f"{ckpt_dir}/1", {"x": np.ones(3)})
    os.remove(f"{ckpt_dir}/1/COMMITTED")
    with pytest.raises(ckpt.CheckpointNotFoundError, match="commit marker"):
        ckpt.restore(f"{ckpt_dir}/1")
    with pytest.raises(FileNotFoundError):
        ckpt.metadata(f"{ckpt_dir}/1")


def test_overwrite_requires_flag_and_replaces(ckpt_dir):
    ckpt.save(f"{ckpt_dir}/1", {"x": np.zeros(3)})
    with pytest.raises(ckpt.CheckpointExistsError, match="overwrite=True"):
        ckpt.save(f"{ckpt_dir}/1", {"x": np.ones(3)})
    ckpt.save(f"{ckpt_dir}/1", {"x": np.ones(3)}, overwrite=True)
    np.testing.assert_array_equal(ckpt.restore(f"{ckpt_dir}/1")["x"], np.ones(3))
    assert sorted(os.listdir(ckpt_dir)) == ["1"]


def test_unsupported_leaf_names_its_path(ckpt_dir):
    with pytest.raises(ckpt.UnsupportedValueError, match=r"leaf \['a'\]\['fn'\].*function"):
        ckpt.save(f"{ckpt_dir}/1", {"a": {"fn": lambda: 0}})
    assert not os.path.exists(f"{ckpt_dir}/1")


def test_metadata_readable_with_fewer_devices(ckpt_dir, tmp_path):
    x = _put(np.ones((16, 8), np.float32), make_mesh(*MESH_2x4), P("data", "model"))
    ckpt.save(f"{ckpt_dir}/7", {"x": x})
    code = textwrap.dedent(
        f"""
        import jax, checkpointer as ckpt, numpy as np
        assert jax.device_count() == 1
        m = ckpt.metadata({f"{ckpt_dir}/7"!r})
        a = m.arrays["x"]
        print(m.step, a.shape, a.saved_sharding.mesh_shape, a.saved_sharding.device_count)
        out = ckpt.restore({f"{ckpt_dir}/7"!r}, {{"x": jax.sharding.SingleDeviceSharding(jax.devices()[0])}})
        print(float(np.asarray(out["x"]).sum()))
        """
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["7 (16, 8) (2, 4) 8", "128.0"]


def _sharded_tree(value=1.0):
    mesh = make_mesh((2, 4), ("data", "model"))
    return {"w": jax.device_put(np.full((16, 8), value, np.float32), NamedSharding(mesh, P("data", "model")))}


def test_save_never_replaces_a_folder_that_is_not_a_checkpoint(tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "notes.txt").write_text("notes")
    for overwrite in (False, True):
        with pytest.raises(ckpt.CheckpointExistsError, match=r"not part of a checkpoint.*notes.txt|src"):
            ckpt.save(str(project), _sharded_tree(), overwrite=overwrite)
    assert (project / "notes.txt").read_text() == "notes" and (project / "src").is_dir()
    # A manager's run directory is not a checkpoint either.
    with ckpt.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, _sharded_tree())
    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.save(str(tmp_path / "run"), _sharded_tree())
    assert (tmp_path / "run" / "1" / "COMMITTED").exists()


def test_save_never_clears_a_foreign_object_store_prefix():
    ckpt.save("memory://review/exp/run1/1", {"w": np.ones(3)})
    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.save("memory://review/exp", {"w": np.ones(3)})
    assert ckpt.metadata("memory://review/exp/run1/1").step == 1


def test_restore_during_overwrite_returns_one_save_not_a_mix(tmp_path, monkeypatch):
    path = str(tmp_path / "7")
    ckpt.save(path, {"a": np.full(4, 1.0), "b": np.full(4, 1.0)})
    real = _restore._restore_once
    calls = []

    def replaced_midway(*args, **kwargs):
        out = real(*args, **kwargs)
        if not calls:  # the first read finishes just as another job replaces the step
            ckpt.save(path, {"a": np.full(4, 2.0), "b": np.full(4, 2.0)}, overwrite=True)
        calls.append(1)
        return out

    monkeypatch.setattr(_restore, "_restore_once", replaced_midway)
    out = ckpt.restore(path)
    assert len(calls) == 2 and float(out["a"][0]) == float(out["b"][0]) == 2.0


def test_restore_of_a_step_deleted_while_reading_says_so(tmp_path, monkeypatch):
    path = str(tmp_path / "5")
    ckpt.save(path, {"a": np.ones(4)})
    real = _restore._restore_once

    def deleted_midway(storage, p, *args, **kwargs):
        _directory.delete_step(storage, str(tmp_path), 5)
        return real(storage, p, *args, **kwargs)

    monkeypatch.setattr(_restore, "_restore_once", deleted_midway)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="deleted"):
        ckpt.restore(path)


def test_a_save_that_lost_the_race_for_its_path_names_the_process_and_the_fix(tmp_path):
    from checkpointer._save import _pipeline as _save

    path = str(tmp_path / "1")
    late = _save.take_snapshot(path, {"x": np.ones(3)})  # planned while the path was free
    ckpt.save(path, {"x": np.zeros(3)})
    with pytest.raises(ckpt.CheckpointExistsError, match=r"committed by another save while this one was writing "
                       r"\(process 0\): this save committed nothing\. Pass overwrite=True"):
        _save.run_background(late)
    np.testing.assert_array_equal(ckpt.restore(path)["x"], np.zeros(3))
    assert sorted(os.listdir(tmp_path)) == ["1"]  # the late save's partial folder is gone
