"""Interop: Orbax import, safetensors and npz export, and their memory bounds."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._cli import _main as _cli

ocp = pytest.importorskip("orbax.checkpoint")


def _bits(x) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes()


def _orbax_tree(mesh):
    rng = np.random.default_rng(0)

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    return {
        "params": {
            "dense": {"kernel": put(rng.standard_normal((64, 32)).astype(np.float32), P("data", "model")),
                      "bias": put(rng.standard_normal(32).astype(ml_dtypes.bfloat16), P("model"))},
            "layers": [put(rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16), P(None, "model")),
                       {"scale": put(np.float32([1.5, -0.0, np.inf, np.nan]), P())}],
        },
        "opt": {"mu": put(rng.standard_normal((64, 32)).astype(np.float32), P("model", "data")),
                "count": put(np.int32(7), P())},
        "host": np.arange(10, dtype=np.int64),
        "step": 12,
        "lr": 0.25,
        "name": "run-a",
    }


@pytest.fixture(scope="module")
def orbax_checkpoints(tmp_path_factory):
    """The same tree saved on a 2x4 mesh by the pinned orbax-checkpoint, in three layouts."""
    root = tmp_path_factory.mktemp("orbax")
    mesh = make_mesh((2, 4), ("data", "model"))
    tree = _orbax_tree(mesh)
    paths = {}
    for name, ocdbt, zarr3 in [("ocdbt", True, False), ("zarr2", False, False), ("ocdbt_zarr3", True, True)]:
        paths[name] = str(root / name)
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)) as c:
            c.save(paths[name], args=ocp.args.PyTreeSave(tree))
    with ocp.CheckpointManager(str(root / "run")) as mgr:
        mgr.save(5, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))
        mgr.wait_until_finished()
    paths["manager_step"] = str(root / "run" / "5")
    return tree, paths


def _targets(tree, mesh):
    """Target tree on `mesh`: every device array sharded over both axes where they divide."""
    def one(x):
        if not isinstance(x, jax.Array):
            return None if isinstance(x, np.ndarray) else x
        spec = P(*(("data", "model")[: x.ndim])) if x.ndim and all(d % 4 == 0 for d in x.shape) else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
    return jax.tree.map(one, tree)


@pytest.mark.parametrize("layout", ["ocdbt", "zarr2", "ocdbt_zarr3", "manager_step"])
def test_orbax_import_restores_bit_exactly_onto_another_mesh(orbax_checkpoints, tmp_path, layout):
    tree, paths = orbax_checkpoints
    dst = str(tmp_path / "12")
    ckpt.import_orbax(paths[layout], dst)
    assert ckpt.verify(dst).ok
    meta = ckpt.metadata(dst)
    assert meta.step == 12
    assert meta.user_metadata["imported_from"]["format"] == "orbax"
    item = "state/" if layout == "manager_step" else ""  # a Composite's items are subtrees named by the item
    kernel = meta.arrays[f"{item}params/dense/kernel"]
    assert kernel.saved_sharding.mesh_shape == (2, 4) and kernel.saved_sharding.spec == ("data", "model")
    assert kernel.chunk_shape == (32, 8)  # the saved shard shape, as a native save
    mesh = make_mesh((4, 2), ("data", "model"))
    if item:
        out = ckpt.restore(dst, {"state": _targets(tree, mesh)})["state"]
    else:
        out = ckpt.restore(dst, _targets(tree, mesh))
    flat_in = jax.tree_util.tree_flatten_with_path(tree)[0]
    flat_out = dict(jax.tree_util.tree_flatten_with_path(out)[0])
    for kp, want in flat_in:
        got = flat_out[kp]
        if isinstance(want, (jax.Array, np.ndarray)):
            assert np.asarray(got).dtype == np.asarray(want).dtype, kp
            assert _bits(got) == _bits(want), kp
        else:
            assert got == want and type(got) is type(want), kp
    assert out["params"]["dense"]["kernel"].sharding.mesh.shape == {"data": 4, "model": 2}


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_orbax_import_without_a_target_gives_what_orbax_restores(orbax_checkpoints, tmp_path):
    tree, paths = orbax_checkpoints
    ckpt.import_orbax(paths["ocdbt"], str(tmp_path / "x"))
    restored = ckpt.restore(str(tmp_path / "x"))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as c:
        by_orbax = c.restore(paths["ocdbt"])
    assert jax.tree.structure(restored) == jax.tree.structure(by_orbax)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(by_orbax)):
        assert _bits(a) == _bits(b) if isinstance(b, (np.ndarray, jax.Array)) else a == b


def test_orbax_import_errors(orbax_checkpoints, tmp_path):
    _, paths = orbax_checkpoints
    with pytest.raises(ckpt.CheckpointNotFoundError, match="not an Orbax PyTree checkpoint"):
        ckpt.import_orbax(str(tmp_path), str(tmp_path / "out"))
    ckpt.import_orbax(paths["zarr2"], str(tmp_path / "out"))
    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.import_orbax(paths["zarr2"], str(tmp_path / "out"))
    ckpt.import_orbax(paths["zarr2"], str(tmp_path / "out"), overwrite=True)
    bad = tmp_path / "custom"
    bad.mkdir()
    (bad / "_METADATA").write_text(json.dumps({"tree_metadata": {"('w',)": {
        "key_metadata": [{"key": "w", "key_type": 2}], "value_metadata": {"value_type": "my.Handler"}}}}))
    with pytest.raises(ckpt.UnsupportedValueError, match=r"\['w'\].*my.Handler"):
        ckpt.import_orbax(str(bad), str(tmp_path / "out2"))
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("file, content", [
    ("_sharding", [1]),  # Orbax writes an object: {base64(param name): sharding JSON}
    ("_strings.json", "w"),
    ("_METADATA", {"tree_metadata": {"('w',)": {"key_metadata": [{"key": "w", "key_type": 2}], "value_metadata": [1]}}}),
])
def test_orbax_import_names_a_metadata_file_that_is_not_an_object(tmp_path, file, content):
    src = tmp_path / "item"
    src.mkdir()
    (src / "_METADATA").write_text(json.dumps({"tree_metadata": {}}))
    (src / file).write_text(json.dumps(content))
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"{src}/{file}.*(expected an object|not an object)"):
        ckpt.import_orbax(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_leaf_by_leaf_save_names_a_leaf_it_cannot_store_and_what_it_takes(tmp_path):
    from checkpointer._save._stream import save_leaf_by_leaf

    with pytest.raises(ckpt.UnsupportedValueError, match=r"leaf \['x'\] in .*/1: a leaf of type object cannot be stored; "
                       r"leaves must be ArraySource"):
        save_leaf_by_leaf(str(tmp_path / "1"), {"x": object()})
    assert not (tmp_path / "1").exists()


def test_cli_import_orbax(orbax_checkpoints, tmp_path, capsys):
    _, paths = orbax_checkpoints
    assert _cli.main(["import-orbax", paths["ocdbt"], str(tmp_path / "7")]) == 0
    assert "imported" in capsys.readouterr().out
    assert ckpt.metadata(str(tmp_path / "7")).step == 7
    assert _cli.main(["import-orbax", str(tmp_path / "nothing"), str(tmp_path / "8")]) == 2
    assert "not an Orbax" in capsys.readouterr().err


# --- export ---------------------------------------------------------------------------------------


def _native_tree(mesh):
    rng = np.random.default_rng(1)

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    bits = rng.integers(0, 2**32, size=(16, 8), dtype=np.uint32)
    bits[0, :4] = [0x7FC00001, 0xFFC0DEAD, 0x80000000, 0x00000001]  # NaN payloads, -0.0, a subnormal
    return {
        "params": {"dense": {"kernel": put(bits.view(np.float32), P("data", "model")),
                             "bias": put(np.arange(8, dtype=np.int32), P("model"))},
                   "layers": [{"w": put(rng.standard_normal((4, 4)), P())}, {"w": np.ones((2, 3), np.float16)}]},
        "mask": np.array([True, False, True]),
        "scalar": np.array(3.5, np.float32),
        "step": 100,
    }


def test_safetensors_export_loads_bit_exactly_in_shards_with_an_index(tmp_path):
    import safetensors.numpy

    mesh = make_mesh((2, 4), ("data", "model"))
    tree = _native_tree(mesh)
    ckpt.save(str(tmp_path / "1"), tree)
    report = ckpt.export(str(tmp_path / "1"), str(tmp_path / "st"), max_shard_bytes=600)
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    shards = sorted(f for f in os.listdir(tmp_path / "st") if f.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    loaded = {}
    for f in shards:
        loaded.update(safetensors.numpy.load_file(str(tmp_path / "st" / f)))
    want = {"params.dense.kernel": tree["params"]["dense"]["kernel"], "params.dense.bias": tree["params"]["dense"]["bias"],
            "params.layers.0.w": tree["params"]["layers"][0]["w"], "params.layers.1.w": tree["params"]["layers"][1]["w"],
            "mask": tree["mask"], "scalar": tree["scalar"]}
    assert loaded.keys() == want.keys() == report.tensors.keys()
    assert index["metadata"]["total_size"] == sum(np.asarray(v).nbytes for v in want.values()) == report.total_bytes
    for name, value in want.items():
        assert loaded[name].dtype == np.asarray(value).dtype and loaded[name].shape == np.shape(value), name
        assert _bits(loaded[name]) == _bits(value), name
    assert report.skipped == ("step",)
    # One file when everything fits (the default 5 GB), no index.
    single = ckpt.export(str(tmp_path / "1"), str(tmp_path / "one"), separator="/")
    assert [os.path.basename(f) for f in single.files] == ["model.safetensors"]
    assert "params/dense/kernel" in safetensors.numpy.load_file(single.files[0])


def test_safetensors_export_holds_bfloat16_and_refuses_int4_unless_upcast(tmp_path):
    import safetensors

    x = np.arange(-8, 8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    ckpt.save(str(tmp_path / "1"), {"w": x, "q": {"codes": np.arange(-8, 8).astype(ml_dtypes.int4)}})
    with pytest.raises(ckpt.UnsupportedValueError, match=r"'q.codes'.*int4.*upcast"):
        ckpt.export(str(tmp_path / "1"), str(tmp_path / "st"))
    report = ckpt.export(str(tmp_path / "1"), str(tmp_path / "st"), upcast=True)
    with safetensors.safe_open(report.files[0], framework="flax") as f:
        w, codes = np.asarray(f.get_tensor("w")), np.asarray(f.get_tensor("q.codes"))
    assert w.dtype == ml_dtypes.bfloat16 and _bits(w) == _bits(x)
    assert codes.dtype == np.int8 and codes.tolist() == list(range(-8, 8))


@pytest.mark.usefixtures("unpacked_layout")  # about the per-leaf files
@pytest.mark.parametrize("leaf, dtype", [("w", np.float32), ("q", ml_dtypes.int4)])  # byte-range reader / TensorStore
def test_export_of_a_damaged_leaf_is_corrupt_naming_the_leaf_and_path(tmp_path, leaf, dtype):
    path = str(tmp_path / "1")
    ckpt.save(path, {leaf: np.arange(-8, 8).astype(dtype)})
    with open(f"{path}/arrays/{leaf}/c/0", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ckpt.CorruptCheckpointError, match=rf"leaf \['{leaf}'\].*{path}"):
        ckpt.export(path, str(tmp_path / "st"), upcast=True)


def test_npz_export_is_bit_exact_and_names_what_npz_cannot_hold(tmp_path):
    mesh = make_mesh((2, 4), ("data", "model"))
    tree = _native_tree(mesh)
    tree["half"] = jax.device_put(np.linspace(-2, 2, 8).astype(ml_dtypes.bfloat16), NamedSharding(mesh, P("model")))
    ckpt.save(str(tmp_path / "1"), tree)
    with pytest.raises(ckpt.UnsupportedValueError, match=r"'half'.*bfloat16.*safetensors.*upcast"):
        ckpt.export(str(tmp_path / "1"), str(tmp_path / "a.npz"), format="npz")
    assert not (tmp_path / "a.npz").exists()
    ckpt.export(str(tmp_path / "1"), str(tmp_path / "a.npz"), format="npz", upcast=True)
    with np.load(tmp_path / "a.npz") as z:
        assert _bits(z["params.dense.kernel"]) == _bits(tree["params"]["dense"]["kernel"])
        assert z["mask"].dtype == bool and z["scalar"].shape == ()
        np.testing.assert_array_equal(z["half"], np.asarray(tree["half"]).astype(np.float32))


def test_export_refuses_two_leaves_with_one_name(tmp_path):
    ckpt.save(str(tmp_path / "1"), {"a.b": np.ones(2), "a": {"b": np.zeros(2)}})
    with pytest.raises(ckpt.UnsupportedValueError, match="separator"):
        ckpt.export(str(tmp_path / "1"), str(tmp_path / "o"), format="npz")
    ckpt.export(str(tmp_path / "1"), str(tmp_path / "o.npz"), format="npz", separator="/")
    with np.load(tmp_path / "o.npz") as z:
        assert sorted(z.files) == ["a.b", "a/b"]


def test_cli_export(tmp_path, capsys):
    ckpt.save(str(tmp_path / "1"), {"w": np.arange(6.0).reshape(2, 3)})
    assert _cli.main(["export", str(tmp_path / "1"), "--format", "npz"]) == 0
    with np.load(str(tmp_path / "1") + ".npz") as z:
        np.testing.assert_array_equal(z["w"], np.arange(6.0).reshape(2, 3))
    assert _cli.main(["export", str(tmp_path / "1"), "--format", "npz"]) == 1  # exists
    assert "--overwrite" in capsys.readouterr().err
    assert _cli.main(["export", str(tmp_path / "1"), "-o", str(tmp_path / "st"), "--max-shard-bytes", "1KiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files"][0].endswith("model.safetensors")


# --- memory -------------------------------------------------------------------------------------

_MAKE_ORBAX = textwrap.dedent("""
    import sys, jax, numpy as np, ml_dtypes
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    n = 64 << 20  # 256 MiB of float32 per leaf, 1 GiB in all
    tree = {
        "host": np.arange(n, dtype=np.float32),  # a numpy leaf: one 256 MiB zarr chunk, decoded whole
        "ints": jax.device_put(np.arange(n, dtype=np.int32).reshape(8192, 8192), NamedSharding(mesh, P(None, "model"))),
        "sharded": jax.device_put(np.ones((8192, 8192), np.float32), NamedSharding(mesh, P("data", "model"))),
        "bf16": jax.device_put(np.ones((16384, 8192), ml_dtypes.bfloat16), NamedSharding(mesh, P("model"))),
    }
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True)) as c:
        c.save(sys.argv[1], args=ocp.args.PyTreeSave(tree))
""")

_MEASURE = textwrap.dedent("""
    import json, sys, time
    import psutil
    import checkpointer as ckpt
    import safetensors, zarr  # everything the call imports, before the baseline
    ckpt.import_orbax, ckpt.export  # the library's lazy names load their modules (and jax, tensorstore)
    kind, src, dst = sys.argv[1:4]
    base = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    if kind == "import":
        ckpt.import_orbax(src, dst)
    else:
        ckpt.export(src, dst, format=kind, upcast=True)
    # VmHWM: this process's own peak. (ru_maxrss keeps the parent's peak across fork +
    # exec, so a big pytest parent would show as growth.)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"growth_bytes": peak - base, "elapsed_s": time.perf_counter() - t0}))
""")


def _run(args, env_extra=None):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(ckpt.__file__))),
                                         env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc (Linux)")
def test_import_and_export_of_1_gib_stay_within_the_largest_leaf_plus_256_mib(tmp_path):
    """Peak RSS growth of a fresh process importing a 1 GiB Orbax checkpoint (4 leaves of
    256 MiB) and exporting it, against the bound of issue 14: largest leaf + 256 MiB."""
    orbax_path, path = str(tmp_path / "orbax"), str(tmp_path / "1")
    _run([_MAKE_ORBAX, orbax_path])
    bound = (256 << 20) + (256 << 20)
    growth = {}
    for kind, src, dst in [("import", orbax_path, path), ("safetensors", path, str(tmp_path / "st")),
                           ("npz", path, str(tmp_path / "a.npz"))]:
        result = json.loads(_run([_MEASURE, kind, src, dst]).strip().splitlines()[-1])
        print(kind, result)
        growth[kind] = result["growth_bytes"]
    assert all(g <= bound for g in growth.values()), {k: f"{g / 2**20:.0f} MiB" for k, g in growth.items()}
    assert ckpt.metadata(path).total_bytes == 1 << 30
    assert os.path.getsize(tmp_path / "st" / "model.safetensors") > 1 << 30  # one file: the default 5 GB limit


# --- CLI polish -----------------------------------------------------------------------------------


@pytest.mark.parametrize("json_mode", [False, True])
def test_cli_output_into_a_pipe_closed_early_exits_quietly(tmp_path, json_mode):
    path = str(tmp_path / "1")
    ckpt.save(path, {f"layer_{i:04d}": {"w": np.zeros(2, np.float32), "b": 1} for i in range(1500)})
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(ckpt.__file__))))
    cmd = [sys.executable, "-m", "checkpointer._cli", "inspect", path] + (["--json"] if json_mode else [])
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as proc:
        proc.stdout.close()  # the reader is gone before the first write (`| head -0`)
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141
    assert stderr == ""


def test_ls_footer_tells_crashed_saves_from_saves_in_flight(tmp_path, capsys):
    from checkpointer._storage._local import LocalStorage

    run = tmp_path / "run"
    ckpt.save(str(run / "1"), {"w": np.ones(2)})
    for gen in ("20260101000000-aaaaaaaa", "20260101000000-bbbbbbbb"):
        (run / f"2.partial-{gen}" / "arrays").mkdir(parents=True)
    storage = LocalStorage()
    lock = storage.lock(str(run / "2.partial-20260101000000-bbbbbbbb.lock"))  # a save in flight
    try:
        assert _cli.main(["ls", str(run)]) == 0
        out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    finally:
        lock.release(remove=True)
    assert "1 partial folder(s) are saves in flight" in out
    assert "1 partial folder(s) are crashed saves: readers never remove them" in out
    assert f"checkpointer gc {run}" in out
