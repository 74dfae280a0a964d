"""The Orbax export against the installed orbax-checkpoint: what `export(..., format="orbax")`
writes (through TensorStore, without Orbax) restores bit-exactly with Orbax's
StandardCheckpointer, CheckpointManager (`args.StandardRestore`) and the v1 `load_pytree`,
onto another mesh with sharded abstract targets: every dtype both store, typed PRNG keys, a
flax linen TrainState with optax and an NNX state; a manager directory becomes a
CheckpointManager directory with its metrics; Orbax -> import -> export -> Orbax is
bit-exact; the command line; errors that name the path and the leaf."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._cli import _main as _cli
from checkpointer._tools._orbax_export import REGION_BYTES, write_chunk_shape

ocp = pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")
train_state = pytest.importorskip("flax.training.train_state")
nnx = pytest.importorskip("flax.nnx")
v1 = pytest.importorskip("orbax.checkpoint.experimental.v1")

# Every dtype of ml_dtypes that both libraries store (zarr3 through TensorStore), with numpy's.
DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2", "float8_e5m2fnuz",
          "float8_e3m4", "float8_e8m0fnu", "float4_e2m1fn", "int4", "int2", "float16", "float32", "float64", "int8",
          "uint8", "int16", "uint32", "int64", "bool", "complex64"]


def _bits(x) -> bytes:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes()


def _values(name: str, shape) -> np.ndarray:
    dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
    rng = np.random.default_rng(len(name))
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu" or "int" in name:
        info = ml_dtypes.iinfo(dtype) if "int" in name and dtype.kind not in "iu" else np.iinfo(dtype)
        return rng.integers(max(info.min, -8), min(info.max, 8) + 1, shape).astype(dtype)
    x = rng.standard_normal(shape) * 4
    if dtype.kind == "c":
        return (x + 1j * x[::-1]).astype(dtype)
    x = x.astype(dtype)
    if np.isnan(np.asarray(np.nan, dtype)):  # NaN and -0.0 where the type has them
        x.reshape(-1)[:1] = np.nan
    return x


def _abstract(tree, mesh, spec_of):
    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec_of(x)))
        return x
    return jax.tree.map(one, tree)


def _assert_bit_exact(got, want, mesh=None):
    flat_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
    flat_want, tree_want = jax.tree_util.tree_flatten_with_path(want)
    assert tree_got == tree_want
    for (kp, g), (_, w) in zip(flat_got, flat_want):
        name = jax.tree_util.keystr(kp)
        if isinstance(w, jax.Array):
            assert isinstance(g, jax.Array) and g.dtype == w.dtype and g.shape == w.shape, name
            if mesh is not None:
                assert g.sharding.mesh.shape == mesh.shape, name
        elif isinstance(w, np.ndarray):
            assert isinstance(g, np.ndarray) and g.dtype == w.dtype, name
        else:
            assert g == w and type(g) is type(w), name
        assert _bits(g) == _bits(w), name


def _spec(x) -> P:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return P("data") if x.ndim else P()
    return {2: P("data", "model"), 1: P("model")}.get(x.ndim, P())


def test_every_dtype_and_typed_keys_restore_bit_exactly_in_orbax_onto_another_mesh(tmp_path):
    mesh = make_mesh((2, 4), ("data", "model"))
    tree = {name: jax.device_put(_values(name, (8, 16)), NamedSharding(mesh, P("data", "model"))) for name in DTYPES}
    tree["keys"] = jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(mesh, P("data")))
    tree["rbg"] = jax.random.key(7, impl="rbg")
    tree["host"] = {"ids": np.arange(6, dtype=np.int32), "empty": {}, "none": None}
    tree["scalars"] = [3, -1.5, True]
    src, out = str(tmp_path / "ckpt"), str(tmp_path / "orbax")
    ckpt.save(src, tree)
    report = ckpt.export(src, out, format="orbax")
    assert report.files == (out,) and report.dropped == () and report.steps == ()
    assert set(report.tensors) >= {"bfloat16", "keys", "host.ids", "scalars.0"}
    other = make_mesh((4, 2), ("data", "model"))
    target = _abstract(tree, other, _spec)
    _assert_bit_exact(ocp.StandardCheckpointer().restore(out, target), tree, other)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 0.12.8 names it load; both are the same function
        _assert_bit_exact(v1.load_pytree(out, target), tree, other)
    _assert_bit_exact(v1.load(out, target), tree, other)
    with pytest.warns(UserWarning, match="Sharding info not provided"):  # target-less: from `_sharding`
        bare = ocp.PyTreeCheckpointer().restore(out)
    assert bare["bfloat16"].sharding.mesh.shape == {"data": 2, "model": 4} and _bits(bare["keys"]) == _bits(tree["keys"])
    assert bare["scalars"] == [3, -1.5, True] and bare["host"]["none"] is None


def _train_state(mesh):
    rng = np.random.default_rng(0)
    params = {"dense": {"kernel": rng.standard_normal((16, 8)).astype(np.float32),
                        "bias": rng.standard_normal(8).astype(ml_dtypes.bfloat16)}}
    params = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, _spec(a))), params)
    state = train_state.TrainState.create(apply_fn=lambda *a: None, params=params, tx=optax.adamw(1e-2))
    return state.apply_gradients(grads=jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params))


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
        self.out = nnx.Linear(8, 4, rngs=rngs)


def test_a_linen_train_state_and_an_nnx_optimizer_state_restore_in_orbax_into_their_own_targets(tmp_path):
    mesh = make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        model = _Model(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    tree = {"linen": _train_state(mesh), "nnx": nnx.state(optimizer)}
    src, out = str(tmp_path / "ckpt"), str(tmp_path / "orbax")
    ckpt.save(src, tree)
    ckpt.export(src, out, format="orbax")
    other = make_mesh((1, 4), ("data", "model"))
    abstract_opt = nnx.eval_shape(lambda: nnx.Optimizer(_Model(nnx.Rngs(0)), optax.adam(1e-3), wrt=nnx.Param))
    target = {"linen": _abstract(tree["linen"], other, _spec), "nnx": nnx.state(abstract_opt)}
    target["nnx"] = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(other, _spec(s))),
                                 target["nnx"])
    got = ocp.StandardCheckpointer().restore(out, target)
    _assert_bit_exact(got, tree, other)
    assert isinstance(got["linen"], train_state.TrainState) and isinstance(got["nnx"], nnx.State)


def _run(tmp_path, mesh):
    run = str(tmp_path / "run")
    with ckpt.CheckpointManager(run, keep=ckpt.KeepLatest(5), async_save=False) as mgr:
        for step in (1, 2, 3):
            tree = {"w": jax.device_put(jnp.full((8, 8), step, jnp.bfloat16), NamedSharding(mesh, P("data", "model"))),
                    "step": step}
            mgr.save(step, tree, metrics={"loss": 1.0 / step, "acc": float("nan") if step == 2 else 0.5},
                     metadata={"note": "exported"}, per_process_state={"position": step * 10})
    return run


def test_a_manager_directory_becomes_an_orbax_checkpoint_manager_directory_with_its_metrics(tmp_path):
    mesh = make_mesh((2, 4), ("data", "model"))
    run, out = _run(tmp_path, mesh), str(tmp_path / "orbax_run")
    with pytest.warns(UserWarning, match=r"per-process state of process 0") as w:
        report = ckpt.export(run, out, format="orbax")
    assert report.steps == (1, 2, 3) and len(report.dropped) == 3 and f"{run}/2" in str(w[0].message)
    mgr = ocp.CheckpointManager(out, options=ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min"))
    assert mgr.all_steps() == [1, 2, 3] and mgr.latest_step() == 3 and mgr.best_step() == 3
    assert mgr.metrics(1) == {"loss": 1.0, "acc": 0.5} and np.isnan(mgr.metrics(2)["acc"])
    assert mgr.metadata(2).custom_metadata["note"] == "exported"
    other = make_mesh((4, 2), ("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16, sharding=NamedSharding(other, P("model"))), "step": 0}
    for step in (1, 3):
        got = mgr.restore(step, args=ocp.args.StandardRestore(target))
        want = ckpt.restore(f"{run}/{step}")
        _assert_bit_exact(got, {"w": jax.device_put(want["w"], target["w"].sharding), "step": step}, other)
    assert v1.load(f"{out}/2", target)["step"] == 2  # a step folder: v1 finds its `default` item
    mgr.close()


def test_orbax_to_import_to_export_to_orbax_is_bit_exact(tmp_path):
    mesh = make_mesh((2, 4), ("data", "model"))
    tree = {"train": _train_state(mesh), "rng": jax.random.key(42),
            "rngs": jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(mesh, P("model")))}
    orbax_in, imported, orbax_out = (str(tmp_path / n) for n in ("orbax_in", "imported", "orbax_out"))
    with ocp.StandardCheckpointer() as c:
        c.save(orbax_in, tree)
    ckpt.import_orbax(orbax_in, imported)
    ckpt.export(imported, orbax_out, format="orbax")
    other = make_mesh((4, 2), ("data", "model"))
    target = _abstract(tree, other, _spec)
    want = ocp.StandardCheckpointer().restore(orbax_in, target)
    _assert_bit_exact(ocp.StandardCheckpointer().restore(orbax_out, target), want, other)
    meta_in = json.loads(pathlib.Path(f"{orbax_in}/_METADATA").read_text())["tree_metadata"]
    meta_out = json.loads(pathlib.Path(f"{orbax_out}/_METADATA").read_text())["tree_metadata"]
    assert {k: [v["key_metadata"], v["value_metadata"]["value_type"]] for k, v in meta_in.items()} == \
           {k: [v["key_metadata"], v["value_metadata"]["value_type"]] for k, v in meta_out.items()}


def test_cli_export_format_orbax_of_a_run_lists_what_it_left_out(tmp_path, capsys):
    mesh = make_mesh((2, 4), ("data", "model"))
    run, out = _run(tmp_path, mesh), str(tmp_path / "orbax_run")
    assert _cli.main(["export", run, "--format", "orbax", "-o", out]) == 0
    text = capsys.readouterr().out
    assert "exported 3 steps" in text and out in text and "per-process state of process 0" in text
    assert ocp.CheckpointManager(out).all_steps() == [1, 2, 3]
    assert _cli.main(["export", run, "--format", "orbax", "-o", out]) == 1  # out exists
    assert out in capsys.readouterr().err
    assert _cli.main(["export", f"{run}/2", "--json", "--format", "orbax", "-o", str(tmp_path / "one"), "--overwrite"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["steps"] == [] and "w" in obj["params"] and len(obj["dropped"]) == 1


def test_export_refuses_an_existing_out_and_leaves_orbax_cannot_hold_naming_them(tmp_path):
    src, out = str(tmp_path / "ckpt"), str(tmp_path / "orbax")
    ckpt.save(src, {"a": {"b": np.ones(3)}, "a.b": np.zeros(2)})
    with pytest.raises(ckpt.UnsupportedValueError, match=r"\['a'\]\['b'\].*\['a\.b'\].*'a\.b'"):
        ckpt.export(src, out, format="orbax")
    assert not os.path.exists(out) and os.listdir(tmp_path) == ["ckpt"]
    ckpt.save(src, {"big": 2**70, "w": np.ones(3)}, overwrite=True)
    with pytest.raises(ckpt.UnsupportedValueError, match=r"leaf \['big'\] of .*ckpt holds 1180591620717411303424 \(int\)"):
        ckpt.export(src, out, format="orbax")
    ckpt.save(src, np.ones(3), overwrite=True)
    with pytest.raises(ckpt.UnsupportedValueError, match=r"holds one leaf .* as its whole tree"):
        ckpt.export(src, out, format="orbax")
    os.makedirs(out)
    ckpt.save(src, {"w": np.ones(3)}, overwrite=True)
    with pytest.raises(ckpt.CheckpointExistsError, match=f"{out} exists"):
        ckpt.export(src, out, format="orbax")
    ckpt.export(src, out, format="orbax", overwrite=True)
    assert np.array_equal(ocp.StandardCheckpointer().restore(out)["w"], np.ones(3))
    with pytest.raises(ValueError, match="leaves.*format='orbax'"):
        ckpt.export(src, str(tmp_path / "x"), format="orbax", leaves="w")


def test_the_export_imports_nothing_of_orbax(tmp_path):
    src = str(tmp_path / "ckpt")
    ckpt.save(src, {"w": np.ones(3, np.float32)})
    code = (f"import sys, checkpointer as ckpt; ckpt.export({src!r}, {str(tmp_path / 'o')!r}, format='orbax'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('orbax', 'flax', 'optax')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "XLA_FLAGS": ""})
    assert done.stdout.strip() == "[]"


def test_chunks_written_hold_at_most_one_region():
    assert write_chunk_shape((8, 16), (4, 4), 4) == (4, 4)  # small: the checkpoint's own chunks
    big = write_chunk_shape((1 << 16, 1 << 12), (1 << 15, 1 << 12), 4)
    assert big == (REGION_BYTES // (4 << 12), 1 << 12)
    huge_row = write_chunk_shape((2, 1 << 26), (2, 1 << 26), 2)
    assert huge_row[0] == 1 and huge_row[1] * 2 <= REGION_BYTES
    assert write_chunk_shape((), (), 8) == ()


def test_export_refuses_an_out_that_is_or_holds_the_source_even_with_overwrite(tmp_path):
    # An `out` that was the checkpoint, or the run holding it, was replaced after the write
    # with overwrite=True: the source checkpoint (or the whole run) was deleted.
    run = str(tmp_path / "run")
    for step in (1, 2):
        ckpt.save(f"{run}/{step}", {"w": np.full(3, step, np.float32)})
    for src, out in [(f"{run}/2", f"{run}/2"), (f"{run}/2", run), (run, run), (run, str(tmp_path))]:
        with pytest.raises(ckpt.CheckpointExistsError, match="would delete the source"):
            ckpt.export(src, out, format="orbax", overwrite=True)
    with pytest.raises(ckpt.CheckpointExistsError, match="inside the checkpoint"):
        ckpt.export(f"{run}/2", f"{run}/2/orbax", format="orbax")
    assert sorted(os.listdir(run)) == ["1", "2"] and float(ckpt.restore(f"{run}/2")["w"][0]) == 2.0
    ckpt.export(run, f"{run}/orbax", format="orbax")  # beside the steps: allowed, the run keeps its steps
    assert ocp.CheckpointManager(f"{run}/orbax").all_steps() == [1, 2] and ckpt.verify(f"{run}/2").ok


def test_a_manifest_claiming_a_billion_processes_is_refused_not_read_a_billion_times(tmp_path):
    # The export skipped missing process records one by one: process_count 10**9 in a
    # hostile manifest meant 10**9 reads (a hang); a missing record is now refused at once.
    src = str(tmp_path / "ckpt")
    ckpt.save(src, {"w": np.ones(3, np.float32)})
    manifest = json.loads(pathlib.Path(src, "manifest.json").read_text())
    manifest["process_count"] = 10**9
    pathlib.Path(src, "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"processes/1\.json is missing: process 1 of 1000000000"):
        ckpt.export(src, str(tmp_path / "o"), format="orbax")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("key", ["_METADATA", "commit_success.txt", "_CHECKPOINT_METADATA", "..", "x/../y", "/abs", "a//b"])
def test_a_key_that_cannot_be_an_orbax_param_folder_is_refused_before_writing(tmp_path, key):
    # The param's zarr array is the folder <item>/<param>: these escaped as IsADirectoryError
    # (colliding with the item's own files) or TensorStore's ValueError, mid-export.
    src, out = str(tmp_path / "ckpt"), str(tmp_path / "orbax")
    ckpt.save(src, {key: np.arange(4.0), "w": np.ones(2)})
    with pytest.raises(ckpt.UnsupportedValueError, match=r"would be the Orbax param .*nothing was written"):
        ckpt.export(src, out, format="orbax")
    assert os.listdir(tmp_path) == ["ckpt"]


def test_keys_with_slashes_and_item_file_names_below_the_top_still_export(tmp_path):
    src, out = str(tmp_path / "ckpt"), str(tmp_path / "orbax")
    tree = {"ok/fine": np.arange(4.0), "sub": {"_METADATA": np.ones(2)}, "_METADATA": "a string makes no folder"}
    ckpt.save(src, tree)
    ckpt.export(src, out, format="orbax")
    got = ocp.PyTreeCheckpointer().restore(out)
    assert np.array_equal(got["ok/fine"], tree["ok/fine"]) and np.array_equal(got["sub"]["_METADATA"], np.ones(2))
    assert got["_METADATA"] == tree["_METADATA"]


def test_a_run_exported_over_a_one_checkpoint_export_replaces_it(tmp_path):
    # overwrite=True kept the earlier export's _METADATA, w/ ... beside the steps: the folder
    # still restored as that old checkpoint (PyTreeCheckpointer().restore(out)).
    run, out = str(tmp_path / "run"), str(tmp_path / "orbax")
    for step in (1, 2):
        ckpt.save(f"{run}/{step}", {"w": np.full(3, step, np.float32)})
    ckpt.export(f"{run}/2", out, format="orbax")
    ckpt.export(run, out, format="orbax", overwrite=True)
    assert sorted(os.listdir(out)) == ["1", "2"] and ocp.CheckpointManager(out).all_steps() == [1, 2]


@pytest.mark.parametrize("existing", [False, True])
def test_a_run_export_that_fails_half_way_leaves_no_step_orbax_would_list(tmp_path, monkeypatch, existing):
    # The steps were published one by one: an export that failed at step 2 left step 1,
    # and Orbax's CheckpointManager listed the folder as a run whose latest step was 1.
    from checkpointer._tools import _orbax_export

    run, out = str(tmp_path / "run"), str(tmp_path / "orbax")
    for step in (1, 2, 3):
        ckpt.save(f"{run}/{step}", {"w": np.full(3, step, np.float32), "v": np.arange(2) + step})
    if existing:  # an earlier complete export, replaced with overwrite=True
        ckpt.export(run, out, format="orbax")
    real, calls = _orbax_export._write_array, []

    def failing(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:  # the first leaf of step 2
            raise OSError("No space left on device (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(_orbax_export, "_write_array", failing)
    with pytest.raises(OSError, match="No space left") as raised:
        ckpt.export(run, out, format="orbax", overwrite=existing)
    assert f"the unfinished Orbax export {out} was removed" in "".join(raised.value.__notes__)
    assert not os.path.exists(out)
    assert sorted(os.listdir(tmp_path)) == ["run"] and sorted(os.listdir(run)) == ["1", "2", "3"]


def test_a_run_export_into_one_of_its_own_steps_is_refused(tmp_path):
    # Accepted: the Orbax run was written into the committed step 2, and the manager's
    # retention deleted it with step 2 two saves later, without a word.
    run = str(tmp_path / "run")
    with ckpt.CheckpointManager(run, keep=ckpt.KeepLatest(2), async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(3, step, np.float32)})
    with pytest.raises(ckpt.CheckpointExistsError, match=f"{run}/2/orbax is inside the step {run}/2 of {run}"):
        ckpt.export(run, f"{run}/2/orbax", format="orbax")
    assert not os.path.exists(f"{run}/2/orbax") and ckpt.verify(f"{run}/2").ok


@pytest.mark.parametrize("tree", [{"a": np.arange(4.0), "a/zarr.json": np.ones(2)}, {"a": np.arange(4.0), "a/c/0": np.ones(2)},
                                  {"a": 1.5, "a/c": np.ones(2)}], ids=["zarr.json", "chunk", "scalar-chunk"])
def test_a_key_inside_another_leafs_zarr_files_is_refused_before_writing(tmp_path, tree):
    # Param `a/zarr.json` is the folder `<item>/a/zarr.json/`, where `a`'s own zarr.json is
    # a file (and `a/c/0`, `a/c` the files of `a`'s chunks): the export failed half-way with
    # TensorStore's FAILED_PRECONDITION "Not a directory", naming neither leaf nor a fix.
    src, out = str(tmp_path / "ckpt"), str(tmp_path / "orbax")
    ckpt.save(src, tree)
    with pytest.raises(ckpt.UnsupportedValueError, match=r"leaf \['a/.*'\] of .* would be the Orbax param 'a/.*'.*"
                                                         r"zarr files .* of the param 'a'.*nothing was written"):
        ckpt.export(src, out, format="orbax")
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_key_beside_another_leafs_zarr_files_still_exports(tmp_path):
    src, out = str(tmp_path / "ckpt"), str(tmp_path / "orbax")
    tree = {"a": np.arange(4.0), "a/c": np.ones(2), "a/b": np.zeros(3), "m": np.ones((2, 2)), "m/c/x": np.ones(1)}
    ckpt.save(src, tree)
    ckpt.export(src, out, format="orbax")
    got = ocp.PyTreeCheckpointer().restore(out)
    assert all(np.array_equal(got[k], v) for k, v in tree.items())


@pytest.mark.parametrize("tree", [{"": 1.5, "c": np.ones(2)}, {"": np.arange(4.0), "zarr.json": np.ones(2)},
                                  {"": np.arange(4.0), "c/0": np.ones(2)}], ids=["scalar-chunk", "zarr.json", "chunk"])
def test_a_key_inside_the_root_params_zarr_files_is_refused_before_writing(tmp_path, tree):
    # A top-level key '' is the Orbax param '', whose zarr array is the item folder itself
    # (`<item>/zarr.json`, chunks `<item>/c/...`, as Orbax writes it): the keys 'c' (beside a
    # scalar ''), 'zarr.json' and 'c/0' failed half-way with TensorStore's error.
    src, out = str(tmp_path / "ckpt"), str(tmp_path / "orbax")
    ckpt.save(src, tree)
    with pytest.raises(ckpt.UnsupportedValueError, match=r"zarr files .* of the param ''.*nothing was written"):
        ckpt.export(src, out, format="orbax")
    assert os.listdir(tmp_path) == ["ckpt"]


def test_the_command_line_says_that_a_failed_run_export_was_removed(tmp_path, monkeypatch, capsys):
    from checkpointer._tools import _orbax_export

    run, out = str(tmp_path / "run"), str(tmp_path / "orbax")
    for step in (1, 2):
        ckpt.save(f"{run}/{step}", {"w": np.full(3, step, np.float32)})
    real, calls = _orbax_export._write_array, []

    def failing(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise OSError("No space left on device (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(_orbax_export, "_write_array", failing)
    assert _cli.main(["export", run, "--format", "orbax", "-o", out]) == 1
    err = capsys.readouterr().err
    assert "No space left" in err and f"the unfinished Orbax export {out} was removed" in err and len(err.splitlines()) == 1


def test_the_command_line_exports_the_current_folder_beside_it(tmp_path, monkeypatch, capsys):
    # `export . --format orbax` named its default output '..orbax' (the path plus
    # '.orbax'): inside the checkpoint itself, so the export was refused.
    src = tmp_path / "run" / "7"
    ckpt.save(str(src), {"w": np.arange(3.0)})
    monkeypatch.chdir(src)
    assert _cli.main(["export", ".", "--format", "orbax"]) == 0, capsys.readouterr().err
    assert np.array_equal(ocp.PyTreeCheckpointer().restore(str(tmp_path / "run" / "7.orbax"))["w"], np.arange(3.0))
    monkeypatch.chdir(tmp_path / "run")
    assert _cli.main(["export", "7/", "--format", "npz"]) == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "7.npz").exists()


def test_a_param_name_longer_than_a_file_name_is_refused_before_writing_naming_the_leaf(tmp_path):
    # Orbax joins the keys with '.' into one folder name: 120 + 1 + 140 bytes pass as two
    # folders here but not as one there (NAME_MAX 255); the export failed half-way with
    # TensorStore's "Failed to open", naming no leaf and no fix.
    src, out = str(tmp_path / "ckpt"), str(tmp_path / "orbax")
    ckpt.save(src, {"a" * 120: {"b" * 140: np.ones(3)}, "w": np.zeros(2)})
    with pytest.raises(ckpt.UnsupportedValueError, match=r"leaf \['a+'\]\['b+'\] of .* would be the Orbax param .*261 bytes.*"
                                                         r"255.*nothing was written"):
        ckpt.export(src, out, format="orbax")
    assert os.listdir(tmp_path) == ["ckpt"]
    ckpt.save(src, {"a" * 120: {"b" * 134: np.ones(3)}}, overwrite=True)  # 255 bytes: a file name still
    ckpt.export(src, out, format="orbax")
    assert np.array_equal(ocp.PyTreeCheckpointer().restore(out)["a" * 120]["b" * 134], np.ones(3))


def test_overwrite_replaces_an_out_that_is_a_file(tmp_path):
    # Without overwrite the export says "pass --overwrite to replace it"; with it, the
    # rename onto the file (or the run's makedirs) failed with NotADirectoryError.
    src, run = str(tmp_path / "ckpt"), str(tmp_path / "run")
    ckpt.save(src, {"w": np.arange(3.0)})
    ckpt.save(f"{run}/1", {"w": np.arange(3.0)})
    for source in (src, run):
        out = tmp_path / "out"
        out.write_text("not an export")
        with pytest.raises(ckpt.CheckpointExistsError, match="pass --overwrite"):
            ckpt.export(source, str(out), format="orbax")
        ckpt.export(source, str(out), format="orbax", overwrite=True)
        item = out if source == src else out / "1" / "default"
        assert np.array_equal(ocp.PyTreeCheckpointer().restore(str(item))["w"], np.arange(3.0))
        shutil.rmtree(out)


@pytest.fixture(scope="module")
def s3_server():
    from gcsserver import started_or_skipped
    from s3server import running_s3_server

    with started_or_skipped(running_s3_server) as server:
        yield server


def test_an_export_from_local_files_to_an_object_store_and_back(tmp_path, s3_server):
    # write_item read the source checkpoint through the output's storage: local -> s3://
    # raised "... is not under s3://...", s3:// -> local called a healthy checkpoint
    # corrupt ("chunk arrays/big/c/0 is missing. Run `checkpointer verify`").
    bucket = s3_server.new_bucket()
    tree = {"big": np.arange(1 << 17, dtype=np.float32), "w": np.arange(3.0), "step": 4}  # unpacked and packed leaves
    src, run = str(tmp_path / "ckpt"), str(tmp_path / "run")
    ckpt.save(src, tree)
    for step in (1, 2):
        ckpt.save(f"{run}/{step}", {**tree, "step": step})
    ckpt.export(src, f"s3://{bucket}/one", format="orbax")
    ckpt.export(run, f"s3://{bucket}/run", format="orbax")
    for orbax_src, dst in [(f"s3://{bucket}/one", "one"), (f"s3://{bucket}/run", "run_back")]:
        ckpt.import_orbax(orbax_src, str(tmp_path / dst))
    got = ckpt.restore(str(tmp_path / "one"))
    assert np.array_equal(got["big"], tree["big"]) and np.array_equal(got["w"], tree["w"]) and got["step"] == 4
    assert ckpt.restore(str(tmp_path / "run_back" / "2"))["step"] == 2
    ckpt.save(f"s3://{bucket}/ckpt", tree)
    ckpt.export(f"s3://{bucket}/ckpt", str(tmp_path / "from_s3"), format="orbax")
    got = ocp.PyTreeCheckpointer().restore(str(tmp_path / "from_s3"))
    assert np.array_equal(got["big"], tree["big"]) and got["step"] == 4


def test_a_run_at_the_top_of_a_bucket_exports_to_another_bucket(tmp_path, s3_server):
    # export(s3://b/run) first asks whether the folder is one checkpoint; for its
    # partial folders read_metadata lists the parent, the bucket `s3://b`, and KvStorage
    # (rooted at `s3://b/`) raised "s3://b is not under s3://b/" instead of "not found".
    b1, b2 = s3_server.new_bucket(), s3_server.new_bucket()
    with ckpt.CheckpointManager(f"s3://{b1}/run") as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(3, step, np.float32)})
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.metadata(f"s3://{b1}/run")
    assert ckpt.export(f"s3://{b1}/run", f"s3://{b2}/orbax", format="orbax").steps == (1, 2)
    ckpt.import_orbax(f"s3://{b2}/orbax", str(tmp_path / "back"))
    assert np.array_equal(ckpt.restore(str(tmp_path / "back" / "2"))["w"], np.full(3, 2, np.float32))


@pytest.mark.parametrize("fmt", ["orbax", "safetensors"])
def test_an_export_named_like_a_step_of_a_run_is_refused(tmp_path, fmt):
    # `export(run, run/500)` or `export(run/1, run/600)` was accepted: the folder, without a
    # commit marker, is listed by `checkpointer ls` as "no marker", and gc removes such
    # folders once they stayed unchanged for an hour (a save of step 500 would collide too).
    run = str(tmp_path / "run")
    with ckpt.CheckpointManager(run, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(3, step, np.float32)})
    sources = [f"{run}/1"] if fmt == "safetensors" else [run, f"{run}/1"]
    for src in sources:
        with pytest.raises(ckpt.CheckpointExistsError, match=f"{run}/600 is named like a step of the run {run}.*gc"):
            ckpt.export(src, f"{run}/600", format=fmt)
    assert sorted(os.listdir(run)) == [".checkpointer-journal.jsonl", ".checkpointer.lock", "1", "2"]
    ckpt.export(f"{run}/1", f"{run}/1.{fmt}", format=fmt)  # the command line's default name: fine


def test_an_export_with_overwrite_onto_another_committed_step_is_refused_and_keeps_it(tmp_path):
    # `export(run/1, run/2, format="orbax", overwrite=True)` replaced the committed step 2
    # with an Orbax checkpoint (step 2 was gone: "no committed checkpoint at run/2").
    run = str(tmp_path / "run")
    with ckpt.CheckpointManager(run, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(3, step, np.float32)})
    with pytest.raises(ckpt.CheckpointExistsError, match="named like a step of the run"):
        ckpt.export(f"{run}/1", f"{run}/2", format="orbax", overwrite=True)
    assert np.array_equal(ckpt.restore(f"{run}/2")["w"], np.full(3, 2, np.float32))
