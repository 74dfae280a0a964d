"""The Orbax import against real Orbax checkpoints written here by the installed
orbax-checkpoint: a flax TrainState with optax AdamW and typed PRNG keys (StandardCheckpointer,
PyTreeCheckpointer; OCDBT on and off; zarr2 and zarr3), composite CheckpointManager steps
with JSON items and metrics, and whole manager directories, restored bit-exactly onto
another mesh."""

import json
import pathlib
import re
import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._cli import _main as _cli
from checkpointer._tools._orbax_import import MAX_KEY_DEPTH

ocp = pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")
train_state = pytest.importorskip("flax.training.train_state")

ORBAX_PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "orbax.md"


def _bits(x) -> bytes:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes()


def _spec(shape) -> P:
    return {2: P("data", "model"), 1: P("model")}.get(len(shape), P())


def _state(mesh):
    """A trained-one-step TrainState with AdamW (its opt_state holds two EmptyState()s) and
    typed PRNG keys, sharded over `mesh`."""
    rng = np.random.default_rng(0)
    params = {"dense": {"kernel": rng.standard_normal((64, 32)).astype(np.float32),
                        "bias": rng.standard_normal(32).astype(ml_dtypes.bfloat16)}}
    params = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, _spec(a.shape))), params)
    state = train_state.TrainState.create(apply_fn=lambda *a: None, params=params, tx=optax.adamw(1e-2))
    state = state.apply_gradients(grads=jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params))
    keys = jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(mesh, P("model")))
    return {"train": state, "rng": jax.random.key(42), "rngs": keys}


def _target(tree, mesh):
    """The abstract tree with every array sharded over `mesh` (by rank, as `_state`)."""
    def one(x):
        if not isinstance(x, jax.Array):
            return x
        spec = P("model") if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) and x.ndim else _spec(x.shape)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
    return jax.tree.map(one, tree)


def _assert_bit_exact(out, want, mesh_shape):
    flat_out = jax.tree_util.tree_flatten_with_path(out)[0]
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    assert [kp for kp, _ in flat_out] == [kp for kp, _ in flat_want]
    for (kp, got), (_, w) in zip(flat_out, flat_want):
        if not isinstance(w, jax.Array):
            assert got == w and type(got) is type(w), kp  # TrainState.step, a Python int
            continue
        assert got.dtype == w.dtype and got.shape == w.shape, kp
        assert _bits(got) == _bits(w), kp
        assert dict(got.sharding.mesh.shape) == mesh_shape, kp


PLACEHOLDERS = {"['train']['opt_state'][1]": "None", "['train']['opt_state'][2]": "None"}  # the EmptyState()s
LAYOUTS = {  # name -> a callable that saves `tree` at `path` as that kind of Orbax checkpoint
    "standard": lambda path, tree: _save(ocp.StandardCheckpointer(), path, tree),
    "pytree_ocdbt_zarr2": lambda path, tree: _pytree(path, tree, True, False),
    "pytree_ocdbt_zarr3": lambda path, tree: _pytree(path, tree, True, True),
    "pytree_zarr2": lambda path, tree: _pytree(path, tree, False, False),
    "pytree_zarr3": lambda path, tree: _pytree(path, tree, False, True),
}


def _save(checkpointer, path, tree):
    with checkpointer as c:
        c.save(path, tree)


def _pytree(path, tree, ocdbt, zarr3):
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)) as c:
        c.save(path, args=ocp.args.PyTreeSave(tree))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`_state` on a 2x4 mesh, saved in every layout of LAYOUTS, and a manager directory of
    three composite steps (state + a JSON item + metrics) and a step still being written."""
    root = tmp_path_factory.mktemp("orbax")
    state = _state(make_mesh((2, 4), ("data", "model")))
    paths = {}
    for name, write in LAYOUTS.items():
        paths[name] = str(root / name)
        write(paths[name], state)
    run = root / "run"
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(str(run), options=options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   extra=ocp.args.JsonSave({"epoch": step, "data": "c4"})),
                     metrics={"loss": 1.0 / step})
        mgr.wait_until_finished()
    shutil.copytree(run / "3", run / "4.orbax-checkpoint-tmp-1764612345")  # a save Orbax never finalized
    return state, paths, str(run)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_orbax_train_state_restores_into_its_own_abstract_train_state_on_another_mesh(saved, tmp_path, layout):
    state, paths, _ = saved
    report = ckpt.import_orbax(paths[layout], str(tmp_path / "7"))
    mesh = make_mesh((4, 2), ("data", "model"))
    out = ckpt.restore(str(tmp_path / "7"), _target(state, mesh))  # no partial=True
    assert isinstance(out["train"], train_state.TrainState)
    assert [type(s).__name__ for s in out["train"].opt_state] == ["ScaleByAdamState", "EmptyState", "EmptyState"]
    assert jax.random.key_impl(out["rngs"]) == jax.random.key_impl(state["rngs"])  # typed keys, same impl
    _assert_bit_exact(out, state, {"data": 4, "model": 2})
    assert report.placeholders == PLACEHOLDERS
    assert report.prng_keys == ("['rng']", "['rngs']")
    assert report.step == 7 and report.items == {layout: "tree"}
    assert report.arrays == len([x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)])
    assert report.total_bytes == ckpt.metadata(str(tmp_path / "7")).total_bytes


def test_orbax_import_still_refuses_a_target_that_lacks_a_saved_leaf(saved, tmp_path):
    """The placeholders fit empty containers only: a target without `mu` is a real
    mismatch and raises without partial=True."""
    state, paths, _ = saved

    class NoMu(NamedTuple):
        count: object
        nu: object

    ckpt.import_orbax(paths["standard"], str(tmp_path / "1"))
    target = _target(state, make_mesh((4, 2), ("data", "model")))
    adam = target["train"].opt_state[0]
    bad = dict(target, train=target["train"].replace(opt_state=(NoMu(adam.count, adam.nu),) + target["train"].opt_state[1:]))
    with pytest.raises(ckpt.StructureMismatchError, match=r"in the checkpoint but not in the target \(2\): "
                       r"\['train'\]\['opt_state'\]\[0\]\['mu'\]\['dense'\]"):
        ckpt.restore(str(tmp_path / "1"), bad)
    # None target leaves where the placeholders are restore as None.
    as_none = dict(target, train=target["train"].replace(opt_state=(adam, None, None)))
    assert ckpt.restore(str(tmp_path / "1"), as_none)["train"].opt_state[1:] == (None, None)


def test_orbax_import_without_a_target_says_which_placeholders_it_holds(saved, tmp_path):
    state, paths, _ = saved
    ckpt.import_orbax(paths["pytree_ocdbt_zarr2"], str(tmp_path / "1"))
    meta = ckpt.metadata(str(tmp_path / "1"))
    assert meta.user_metadata["imported_from"]["placeholders"] == PLACEHOLDERS
    out = ckpt.restore(str(tmp_path / "1"))
    assert out["train"]["opt_state"][1] is None and out["train"]["opt_state"][2] is None  # as Orbax restores them
    assert jax.dtypes.issubdtype(out["rng"].dtype, jax.dtypes.prng_key)
    assert _bits(out["rngs"]) == _bits(state["rngs"])
    assert meta.arrays["rngs"].key_impl == str(jax.random.key_impl(state["rngs"]))


def test_orbax_composite_step_brings_every_item_and_says_what_each_became(saved, tmp_path):
    state, _, run = saved
    report = ckpt.import_orbax(f"{run}/2", str(tmp_path / "2"))
    assert isinstance(report, ckpt.ImportReport)  # public, from the front door
    assert report.items == {"extra": "user_metadata['orbax_items']['extra']", "metrics": "user_metadata['metrics']",
                            "state": "tree['state']"}
    assert report.placeholders == {f"['state']{k}": v for k, v in PLACEHOLDERS.items()}
    meta = ckpt.metadata(str(tmp_path / "2"))
    assert meta.user_metadata["orbax_items"] == {"extra": {"epoch": 2, "data": "c4"}}
    assert meta.user_metadata["metrics"] == {"loss": 0.5} == report.metrics
    mesh = make_mesh((1, 4), ("data", "model"))
    out = ckpt.restore(str(tmp_path / "2"), {"state": _target(state, mesh)})
    _assert_bit_exact(out["state"], state, {"data": 1, "model": 4})


def test_orbax_composite_step_refuses_an_item_it_cannot_read(saved, tmp_path):
    _, _, run = saved
    step = tmp_path / "9"
    shutil.copytree(f"{run}/1", step)
    meta = json.loads((step / "_CHECKPOINT_METADATA").read_text())
    meta["item_handlers"]["proto"] = "orbax.checkpoint.ProtoCheckpointHandler"
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    (step / "proto").mkdir()
    (step / "proto" / "config.pbtxt").write_text("x: 1")
    with pytest.raises(ckpt.UnsupportedValueError, match=r"item 'proto'.*ProtoCheckpointHandler"):
        ckpt.import_orbax(str(step), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_orbax_manager_directory_imports_every_finalized_step_and_resumes(saved, tmp_path):
    state, _, run = saved
    dst = str(tmp_path / "ckpt")
    calls = []
    report = ckpt.import_orbax(run, dst, progress=lambda *a: calls.append(a))
    assert [r.step for r in report.steps] == [1, 2, 3] and report.resumed == ()  # not the .orbax-checkpoint-tmp one
    assert calls == [(1, 3, 1), (2, 3, 2), (3, 3, 3)]
    reader = ckpt.CheckpointManager(dst, read_only=True)
    assert reader.all_steps() == [1, 2, 3]
    assert [ckpt.metadata(reader.step_path(s)).user_metadata["metrics"]["loss"] for s in (1, 2, 3)] == [1.0, 0.5, 1 / 3]
    # Interrupted after step 1: the rerun imports what is missing and keeps the rest.
    shutil.rmtree(f"{dst}/2")
    shutil.rmtree(f"{dst}/3")
    again = ckpt.import_orbax(run, dst)
    assert [r.step for r in again.steps] == [2, 3] and again.resumed == (1,)
    out = ckpt.CheckpointManager(dst, read_only=True).restore(3, target={"state": _target(state, make_mesh((2, 2), ("data", "model")))})
    _assert_bit_exact(out["state"], state, {"data": 2, "model": 2})
    # A step there that came from elsewhere is not silently kept.
    ckpt.save(str(tmp_path / "other" / "1"), {"w": np.ones(2)})
    with pytest.raises(ckpt.CheckpointExistsError, match="not imported from"):
        ckpt.import_orbax(run, str(tmp_path / "other"))


def test_orbax_steps_on_an_object_store_need_commit_success():
    from checkpointer._storage import storage_for
    from checkpointer._tools._orbax_run import orbax_steps

    storage, run = storage_for("memory://orbax-run")
    for step, done in [(1, True), (2, False), (3, True)]:
        storage.write_file(f"{run}/{step}/_CHECKPOINT_METADATA", b"{}")
        storage.write_file(f"{run}/{step}/state/_METADATA", b"{}")
        if done:
            storage.write_file(f"{run}/{step}/commit_success.txt", b"ok")
    storage.write_file(f"{run}/5.orbax-checkpoint-tmp-1/commit_success.txt", b"ok")
    assert [s for s, _ in orbax_steps(storage, run)] == [1, 3]


def test_orbax_steps_refuse_two_folders_of_one_step_naming_both():
    from checkpointer._storage import storage_for
    from checkpointer._tools._orbax_run import orbax_steps

    storage, run = storage_for("memory://orbax-run-twice")
    for name in ("3", "ckpt_3", "4"):  # e.g. a run restarted with step_prefix="ckpt"
        storage.write_file(f"{run}/{name}/_CHECKPOINT_METADATA", b"{}")
        storage.write_file(f"{run}/{name}/state/_METADATA", b"{}")
        storage.write_file(f"{run}/{name}/commit_success.txt", b"ok")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"step 3: .*orbax-run-twice/3\b.*orbax-run-twice/ckpt_3"):
        orbax_steps(storage, run)  # else one of them is left out without a word


def test_cli_import_orbax_of_a_manager_directory(saved, tmp_path, capsys):
    _, _, run = saved
    dst = str(tmp_path / "ckpt")
    assert _cli.main(["import-orbax", run, dst]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "3 steps imported" in out and "state -> tree['state']" in out
    assert "['state']['train']['opt_state'][1] (None)" in out
    assert _cli.main(["import-orbax", run, dst, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["resumed"] == [1, 2, 3] and doc["steps"] == []


def test_the_docs_migration_of_a_whole_run_runs_as_written(saved, tmp_path):
    state, _, run = saved
    text = ORBAX_PAGE.read_text(encoding="utf-8")
    block = re.search(r"<!-- migration-of-a-run -->\s*```python\n(.*?)```", text, re.S).group(1)
    code = block.replace("/runs/orbax", run).replace("/runs/ckpt", str(tmp_path / "ckpt"))
    abstract_state = _target(state, make_mesh((4, 2), ("data", "model")))
    scope = {"ckpt": ckpt, "abstract_state": abstract_state}
    exec(compile(code, "docs/orbax.md", "exec"), scope)
    assert [r.step for r in scope["report"].steps] == [1, 2, 3]
    _assert_bit_exact(scope["state"], state, {"data": 4, "model": 2})


def test_a_stored_none_restores_into_an_empty_container_of_the_target_and_nothing_else(tmp_path):
    path = str(tmp_path / "1")
    ckpt.save(path, {"empty": None, "w": np.arange(4.0)})
    w = None  # a host numpy array
    out = ckpt.restore(path, {"empty": optax.EmptyState(), "w": w})
    assert type(out["empty"]) is optax.EmptyState and out["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert ckpt.restore(path, {"empty": (), "w": w})["empty"] == ()
    with pytest.raises(ckpt.StructureMismatchError, match=r"in the target but not in the checkpoint \(1\): \['empty'\]\['x'\]"):
        ckpt.restore(path, {"empty": {"x": w}, "w": w})
    with pytest.raises(ckpt.StructureMismatchError, match=r"in the checkpoint but not in the target \(1\): \['empty'\]"):
        ckpt.restore(path, {"w": w})


# --- issue 25 item 2: Orbax's NNX states imported whole; numpy scalars keep their types ---

def _nnx_optimizer(n_layers, mesh=None):
    """An `nnx.Optimizer` (AdamW) over a model whose layers are an `nnx.List`; with `mesh`,
    made under `nnx.eval_shape` and returned as its natural abstract state, every leaf
    replicated over `mesh`."""
    nnx = pytest.importorskip("flax.nnx")

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(n_layers)])

    def make():
        return nnx.Optimizer(Stack(nnx.Rngs(0)), optax.adamw(1e-2), wrt=nnx.Param)

    if mesh is None:
        opt = make()
        return opt, nnx.state(opt)
    abstract = nnx.state(nnx.eval_shape(make))
    return None, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), abstract)


def test_orbax_nnx_optimizer_state_with_nnx_list_layers_restores_into_its_natural_target(tmp_path):
    """Orbax writes the integer keys of `nnx.State` (`opt_state[0]`, `layers[1]`) as '0',
    '1'; they match the target's integers without partial=True, and come back as ints."""
    _, state = _nnx_optimizer(2)
    with ocp.StandardCheckpointer() as c:
        c.save(str(tmp_path / "orbax"), state)
    ckpt.import_orbax(str(tmp_path / "orbax"), str(tmp_path / "1"))
    _, target = _nnx_optimizer(2, make_mesh((2, 4), ("data", "model")))
    out = ckpt.restore(str(tmp_path / "1"), target)
    assert type(out) is type(state)
    got, want = jax.tree_util.tree_flatten_with_path(out)[0], jax.tree_util.tree_flatten_with_path(state)[0]
    assert [kp for kp, _ in got] == [kp for kp, _ in want]  # DictKey(0), not DictKey('0')
    assert any(jax.tree_util.DictKey(1) in kp for kp, _ in got)
    for (kp, g), (_, w) in zip(got, want):
        assert g.dtype == w.dtype and _bits(g) == _bits(w), kp
    # A real mismatch still raises: a model of three layers has a layer 2 the checkpoint lacks.
    _, three = _nnx_optimizer(3, make_mesh((2, 4), ("data", "model")))
    with pytest.raises(ckpt.StructureMismatchError, match=r"in the target but not in the checkpoint \(\d+\): .*\['layers'\]\[2\]"):
        ckpt.restore(str(tmp_path / "1"), three)


def test_an_integer_key_does_not_match_a_string_key_in_a_checkpoint_not_imported_from_orbax(tmp_path):
    """Our own manifests keep key types: '0' against 0 is a mismatch there."""
    ckpt.save(str(tmp_path / "1"), {"0": np.ones(2)})
    with pytest.raises(ckpt.StructureMismatchError, match=r"not in the checkpoint \(1\): \[0\]"):
        ckpt.restore(str(tmp_path / "1"), {0: None})


def test_orbax_numpy_scalars_keep_their_types_through_the_import(tmp_path):
    tree = {"f32": np.float32(1.5), "i64": np.int64(-3), "i32": np.int32(7), "py_float": 2.5, "py_int": 4,
            "w": np.arange(3, dtype=np.float32)}
    with ocp.PyTreeCheckpointer() as c:
        c.save(str(tmp_path / "orbax"), tree)
    ckpt.import_orbax(str(tmp_path / "orbax"), str(tmp_path / "1"))
    out = ckpt.restore(str(tmp_path / "1"))
    assert type(out["f32"]) is np.float32 and out["f32"] == 1.5
    assert type(out["i32"]) is np.int32 and out["i32"] == 7
    # int64 and float64 are how Orbax stores Python numbers too: without a target they are Python's.
    assert type(out["py_float"]) is float and type(out["py_int"]) is int and out["i64"] == -3
    # A target holding numpy scalars gets its own types back.
    out = ckpt.restore(str(tmp_path / "1"), {**tree, "w": None})
    for k in ("f32", "i64", "i32", "py_float", "py_int"):
        assert type(out[k]) is type(tree[k]) and out[k] == tree[k], k


def test_an_orbax_key_path_nested_too_deeply_is_refused_naming_the_file_not_a_recursion_error(tmp_path):
    # _METADATA's key_metadata of 600 (or 5000) keys: the import's nesting recursed per
    # level and raised RecursionError (the contract: the documented error naming the file).
    src = tmp_path / "orbax"
    with ocp.PyTreeCheckpointer() as c:
        c.save(str(src), {"w": np.arange(3, dtype=np.float32)})
    meta = json.loads((src / "_METADATA").read_text())
    for depth in (600, 5000):
        keys = [{"key": f"k{i}", "key_type": 2} for i in range(depth)]
        meta["tree_metadata"]["deep"] = {"key_metadata": keys, "value_metadata": {"value_type": "None", "skip_deserialize": True}}
        (src / "_METADATA").write_text(json.dumps(meta))
        with pytest.raises(ckpt.UnsupportedValueError, match=rf"_METADATA: the leaf \['k0'\]\['k1'\].* is {depth} keys deep"):
            ckpt.import_orbax(str(src), str(tmp_path / "1"))
        assert not (tmp_path / "1").exists()
    depth = MAX_KEY_DEPTH  # deep, but within what jax's tree functions take
    keys = [{"key": f"k{i}", "key_type": 2} for i in range(depth)]
    meta["tree_metadata"]["deep"] = {"key_metadata": keys, "value_metadata": {"value_type": "None", "skip_deserialize": True}}
    (src / "_METADATA").write_text(json.dumps(meta))
    ckpt.import_orbax(str(src), str(tmp_path / "1"))
    node = ckpt.restore(str(tmp_path / "1"))
    for i in range(depth):
        node = node[f"k{i}"]
    assert node is None


def test_an_orbax_checkpoint_rewritten_at_the_same_path_imports_again_in_the_same_process(tmp_path):
    # The import kept one TensorStore context (with its OCDBT cache) for the whole process:
    # after Orbax saved a new checkpoint at the same path (force=True, a new OCDBT database),
    # the next import read the cached manifest and failed with CorruptCheckpointError
    # ("Configuration mismatch on uuid") on a healthy checkpoint.
    src, dst = str(tmp_path / "orbax"), str(tmp_path / "1")
    for i in range(2):
        with ocp.PyTreeCheckpointer() as c:
            c.save(src, {"w": np.arange(3.0) + i}, force=True)
        ckpt.import_orbax(src, dst, overwrite=True)
        assert np.array_equal(ckpt.restore(dst)["w"], np.arange(3.0) + i)


def test_orbax_custom_metadata_comes_over_as_user_metadata_and_round_trips(tmp_path):
    # `save(..., custom_metadata=...)` (StandardCheckpointer, CheckpointManager) is the
    # user's own data (epoch, data position, config); the import dropped it without a word,
    # so ckpt.save(metadata=) -> export (custom_metadata) -> import lost it too.
    tree = {"w": np.arange(3, dtype=np.float32)}
    custom = {"epoch": 3, "config": {"lr": 0.1, "layers": [1, 2]}, "metrics": "a clash with the import's own key"}
    with ocp.StandardCheckpointer() as c:
        c.save(str(tmp_path / "one"), tree, custom_metadata=custom)
    ckpt.import_orbax(str(tmp_path / "one"), str(tmp_path / "1"))
    user = ckpt.metadata(str(tmp_path / "1")).user_metadata
    assert user["epoch"] == 3 and user["config"] == {"lr": 0.1, "layers": [1, 2]}
    assert "metrics" not in user and user["orbax_custom_metadata"] == {"metrics": custom["metrics"]}
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")  # metrics are written
    with ocp.CheckpointManager(str(tmp_path / "run"), options=options) as mgr:
        for step in (1, 2):
            mgr.save(step, args=ocp.args.StandardSave(tree), metrics={"loss": 1.0 / step}, custom_metadata={"epoch": step})
    ckpt.import_orbax(str(tmp_path / "run"), str(tmp_path / "imported"))
    for step in (1, 2):
        user = ckpt.metadata(str(tmp_path / "imported" / str(step))).user_metadata
        assert user["epoch"] == step and user["metrics"] == {"loss": 1.0 / step}
    ckpt.save(str(tmp_path / "native"), tree, metadata={"note": "kept", "epoch": 7})
    ckpt.export(str(tmp_path / "native"), str(tmp_path / "exported"), format="orbax")
    ckpt.import_orbax(str(tmp_path / "exported"), str(tmp_path / "back"))
    user = ckpt.metadata(str(tmp_path / "back")).user_metadata
    assert user["note"] == "kept" and user["epoch"] == 7 and user["exported_from"]["format"] == "checkpointer"


def test_an_orbax_checkpoint_without_arrays_imports(tmp_path):
    # Orbax writes no OCDBT database when no leaf is an array (empty nodes, None, strings):
    # the import required manifest.ocdbt and called the healthy checkpoint unfinished.
    tree = {"config": {"name": "run-1", "opt": None}, "empty": {}, "layers": []}
    with ocp.PyTreeCheckpointer() as c:
        c.save(str(tmp_path / "orbax"), tree)
    assert not (tmp_path / "orbax" / "manifest.ocdbt").exists()
    ckpt.import_orbax(str(tmp_path / "orbax"), str(tmp_path / "1"))
    assert ckpt.restore(str(tmp_path / "1"), {"config": {"name": "", "opt": None}, "empty": {}, "layers": []}) == tree


def test_an_import_into_the_orbax_checkpoint_itself_is_refused(tmp_path):
    # Accepted: the checkpoint was written inside the Orbax step 1 (or item folder), which
    # Orbax's retention deletes with the step, and which changed an Orbax checkpoint.
    run, one = tmp_path / "run", tmp_path / "one"
    with ocp.CheckpointManager(str(run)) as mgr:
        for step in (1, 2):
            mgr.save(step, args=ocp.args.StandardSave({"w": np.full(2, step, np.float32)}))
    with ocp.PyTreeCheckpointer() as c:
        c.save(str(one), {"w": np.ones(2)})
    for src, dst in [(run, run / "1" / "ckpt"), (run / "2", run / "2" / "ckpt"), (one, one / "ckpt")]:
        with pytest.raises(ckpt.CheckpointExistsError, match=f"{dst} is inside the Orbax checkpoint .*nothing was written"):
            ckpt.import_orbax(str(src), str(dst))
        assert not dst.exists()
    ckpt.import_orbax(str(run), str(run / "imported"))  # beside the steps: Orbax lists only its steps
    assert sorted(p.name for p in (run / "imported").iterdir()) == ["1", "2"]
    assert ocp.CheckpointManager(str(run)).all_steps() == [1, 2]


def test_a_sharding_entry_that_is_not_a_string_is_an_unreadable_sharding_not_a_type_error(tmp_path, caplog):
    # `_sharding` maps base64(param) -> a JSON *string*; an entry of another JSON type (a
    # damaged file) raised TypeError ('int' object is not subscriptable) from the warning
    # meant for unreadable shardings, which otherwise fall back to "other" and import.
    src = tmp_path / "orbax"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)).save(
        str(src), args=ocp.args.PyTreeSave({"w": jnp.arange(6.0)}))
    (src / "_sharding").write_text(json.dumps({"dw==": 5}))  # base64("w")
    with caplog.at_level("WARNING", logger="checkpointer"):
        ckpt.import_orbax(str(src), str(tmp_path / "1"))
    assert "unreadable Orbax sharding 5" in caplog.text
    assert np.array_equal(ckpt.restore(str(tmp_path / "1"))["w"], np.arange(6.0))
