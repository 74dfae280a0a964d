"""The `checkpointer` command line, end to end on real checkpoints (in-process, plus one subprocess)."""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._cli import _main as _cli
from checkpointer._tools import _drill

PARTIAL = "4.partial-20260101000000-deadbeef"
W_BYTES, B_BYTES = 16 * 8 * 4, 8 * 4


def _state(value):
    mesh = make_mesh((2, 4), ("data", "model"))
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + value
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(jnp.full((8,), value, jnp.float32), NamedSharding(mesh, P("model"))),
        },
        "step": int(value),
    }


@pytest.fixture
def run_dir(tmp_path):
    """Committed steps 1, 2, 3 (with metrics) and the partial folder of a crashed save of step 4."""
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(10), async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step), metrics={"loss": 1.0 / step})
    os.makedirs(f"{d}/{PARTIAL}/arrays/params/w/c/0")
    Path(f"{d}/{PARTIAL}/arrays/params/w/c/0/0").write_bytes(b"x" * 100)
    return d


def run(capsys, *argv):
    """Runs the CLI in-process; returns (exit status, stdout, stderr)."""
    code = _cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def assert_one_line_error(code, out, err, expected_code=2, *fragments):
    assert code == expected_code
    assert out == ""
    assert err.startswith("checkpointer: error: ") and err.count("\n") == 1 and "Traceback" not in err
    for f in fragments:
        assert f in err


def _folder_bytes(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# --- ls -----------------------------------------------------------------------------------------


def test_ls_shows_committed_steps_and_the_crashed_partial_folder(run_dir, capsys):
    code, out, err = run(capsys, "ls", run_dir)
    assert code == 0 and err == ""
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()[:1].isdigit() and "committed," not in line}
    assert set(lines) == {"1", "2", "3", "4"}
    assert "committed" in lines["3"] and "loss=0.3333" in lines["3"] and "KiB" in lines["3"]
    assert "partial" in lines["4"] and PARTIAL in lines["4"]
    assert "3 committed, 1 partial" in out and "checkpointer gc" in out
    assert all(line == line.rstrip() for line in out.splitlines())  # no padding at line ends

    doc = run_json(capsys, "ls", run_dir)
    steps = {s["step"]: s for s in doc["steps"]}
    assert [s["state"] for s in doc["steps"]] == ["committed"] * 3 + ["partial"]
    assert steps[2]["metrics"] == {"loss": 0.5} and steps[2]["committed"] is True
    assert steps[3]["size_bytes"] == _folder_bytes(f"{run_dir}/3") > W_BYTES + B_BYTES
    assert steps[4]["size_bytes"] == 100 and steps[4]["committed"] is False and steps[4]["metrics"] == {}
    assert all(s["age_s"] >= 0 for s in doc["steps"]) and doc["manager"] is None


def test_ls_on_a_kvstore_url_takes_sizes_from_the_manifest(capsys):
    url = "memory://cli-ls/run"
    ckpt.save(f"{url}/7", _state(7), metadata={"metrics": {"acc": 0.5}})
    doc = run_json(capsys, "ls", url)
    (entry,) = doc["steps"]
    meta = ckpt.metadata(f"{url}/7")
    assert entry["step"] == 7 and entry["state"] == "committed" and entry["metrics"] == {"acc": 0.5}
    assert entry["size_bytes"] == sum(meta.process_bytes_written) > 0


# --- inspect ------------------------------------------------------------------------------------


def test_inspect_prints_the_tree_and_metadata(run_dir, capsys):
    code, out, err = run(capsys, "inspect", f"{run_dir}/3")
    assert code == 0 and err == ""
    w_line = next(line for line in out.splitlines() if line.startswith("['params']['w']"))
    for cell in ("(16, 8)", "float32", "P('data', 'model') on mesh data=2 x model=4", "(8, 2)", str(W_BYTES)):
        assert cell in w_line
    assert "value 3" in next(line for line in out.splitlines() if line.startswith("['step'] ") and "int" in line)
    assert f"{W_BYTES + B_BYTES}" in out and '"loss": 0.3333333333333333' in out and "jax " + jax.__version__ in out

    doc = run_json(capsys, "inspect", f"{run_dir}/3")
    assert doc["step"] == 3 and doc["process_count"] == 1 and doc["total_bytes"] == W_BYTES + B_BYTES
    assert doc["user_metadata"] == {"metrics": {"loss": 1 / 3}} and doc["jax_version"] == jax.__version__
    leaves = {leaf["path"]: leaf for leaf in doc["leaves"]}
    assert leaves["params/w"]["chunk_shape"] == [8, 2] and leaves["params/w"]["saved_spec"] == ["data", "model"]
    assert leaves["params/b"]["shape"] == [8] and leaves["params/b"]["bytes"] == B_BYTES
    assert leaves["step"] == {"path": "step", "keystr": "['step']", "type": "value", "value_type": "int", "value": 3}
    assert leaves["params/w"]["keystr"] == "['params']['w']"


def test_inspect_of_a_directory_names_its_steps(run_dir, capsys):
    assert_one_line_error(*run(capsys, "inspect", run_dir), 2, "directory of steps", f"{run_dir}/3")


# --- plan ---------------------------------------------------------------------------------------


def test_plan_default_targets_match_plan_restore(run_dir, capsys):
    path = f"{run_dir}/3"
    code, out, err = run(capsys, "plan", path, "--mesh", "4x2")
    assert code == 0 and err == ""
    assert "data=4 x model=2 (8 devices)" in out
    assert "P('data', 'model')" in next(line for line in out.splitlines() if line.startswith("['params']['w']"))
    assert next(line for line in out.splitlines() if line.startswith("total"))

    doc = run_json(capsys, "plan", path, "--mesh", "4x2")
    mesh = make_mesh((4, 2), ("data", "model"))
    target = {"params": {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P("model"))}, "step": None}
    expected = ckpt.plan_restore(path, target)
    assert doc["mesh"] == {"shape": [4, 2], "axis_names": ["data", "model"]}
    assert (doc["bytes_read"], doc["bytes_needed"]) == (expected.bytes_read, expected.bytes_needed)
    assert doc["read_amplification"] == pytest.approx(expected.read_amplification)
    leaves = {leaf["leaf"]: leaf for leaf in doc["leaves"]}
    assert leaves["params/w"]["target_spec"] == ["data", "model"] and leaves["params/w"]["boxes"] == 8
    assert leaves["params/w"]["bytes_needed"] == W_BYTES and leaves["params/b"]["target_spec"] == ["model"]


def test_plan_default_rule_replicates_what_does_not_fit_and_spec_overrides(run_dir, capsys):
    path = f"{run_dir}/3"
    # 'model' of size 3 does not divide 8: those entries become None; 'data' of size 2 stays.
    doc = run_json(capsys, "plan", path, "--mesh", "2x3")
    specs = {leaf["leaf"]: leaf["target_spec"] for leaf in doc["leaves"]}
    assert specs == {"params/w": ["data"], "params/b": []}
    # Unknown axis names: everything replicated.
    doc = run_json(capsys, "plan", path, "--mesh", "4x2", "--axes", "x,y")
    assert all(leaf["target_spec"] == [] for leaf in doc["leaves"])
    # --spec: globs on the escaped leaf path still work, the last match wins, 'none' and '+' entries.
    doc = run_json(capsys, "plan", path, "--mesh", "4x2", "--axes", "x,y",
                   "--spec", "params/*=y", "--spec", "params/w=none,x+y")
    specs = {leaf["leaf"]: leaf["target_spec"] for leaf in doc["leaves"]}
    assert specs == {"params/w": [None, ["x", "y"]], "params/b": ["y"]}
    mesh = make_mesh((4, 2), ("x", "y"))
    target = {"params": {"w": NamedSharding(mesh, P(None, ("x", "y"))), "b": NamedSharding(mesh, P("y"))}, "step": None}
    assert doc["bytes_read"] == ckpt.plan_restore(path, target).bytes_read
    # A spec that does not fit a matched leaf is a usage error naming the leaf.
    assert_one_line_error(*run(capsys, "plan", path, "--mesh", "4x2", "--spec", "params/*=data,model"), 2, "['params']['b']")
    assert_one_line_error(*run(capsys, "plan", path, "--mesh", "4x2", "--spec", "nope/*=data"), 2, "matches no array leaf")


def test_plan_emulates_other_processes(run_dir, capsys):
    path = f"{run_dir}/3"
    real = run_json(capsys, "plan", path, "--mesh", "4x2")
    one = run_json(capsys, "plan", path, "--mesh", "4x2", "--processes", "1")
    assert one["leaves"] == real["leaves"] and one["bytes_read"] == real["bytes_read"]
    last = run_json(capsys, "plan", path, "--mesh", "4x2", "--processes", "4", "--process-index", "3")
    leaves = {leaf["leaf"]: leaf for leaf in last["leaves"]}
    assert last["process_index"] == 3 and last["process_count"] == 4
    assert leaves["params/w"]["bytes_needed"] == W_BYTES // 4 and leaves["params/w"]["boxes"] == 2
    assert_one_line_error(*run(capsys, "plan", path, "--mesh", "4x2", "--process-index", "1"), 2, "--processes")


def test_plan_for_a_pod_runs_in_a_one_device_process(tmp_path):
    """`plan --mesh 64x128 --processes 1024` needs no devices: 8,192 of them in a 1-device process."""
    mesh = make_mesh((2, 4), ("data", "model"))
    w = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    ckpt.save(str(tmp_path / "1"), {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))), "step": 1})
    code = (
        "import sys, jax; from checkpointer._cli import main; assert len(jax.devices()) == 1; "
        "raise SystemExit(main(sys.argv[1:]))"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    argv = [sys.executable, "-c", code, "plan", str(tmp_path / "1"), "--mesh", "64x128", "--processes", "1024"]
    res = subprocess.run([*argv, "--process-index", "1023", "--json"], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(res.stdout)
    assert doc["mesh"] == {"shape": [64, 128], "axis_names": ["data", "model"]}
    assert (doc["process_index"], doc["process_count"]) == (1023, 1024)
    # Each device holds a (4, 2) box; process 1023 holds the last 8 devices of mesh row 63.
    (leaf,) = doc["leaves"]
    assert leaf["target_spec"] == ["data", "model"] and leaf["boxes"] == 8 and leaf["bytes_needed"] == 8 * 4 * 2 * 4
    expected = ckpt.plan_restore(
        str(tmp_path / "1"), {"w": NamedSharding(jax.sharding.AbstractMesh((64, 128), ("data", "model")), P("data", "model"))},
        partial=True, processes=1024, process_index=1023,
    )
    assert [b.box.origin for b in expected.leaves[0].boxes] == [(252, 240 + 2 * i) for i in range(8)]
    assert doc["bytes_read"] == expected.bytes_read
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0 and "process 0 of 1024" in res.stdout and "8192 devices" in res.stdout, res.stderr[-2000:]


def test_plan_shows_per_process_bytes_read_and_received_for_a_replicated_target(tmp_path, capsys):
    """A replicated target on 4 processes: each reads a quarter and receives the rest
    (cooperative); --no-cooperative: each reads it all."""
    mesh = make_mesh((2, 4), ("data", "model"))
    w = np.arange(1024 * 256, dtype=np.float32).reshape(1024, 256)
    ckpt.save(str(tmp_path / "1"), {"w": jax.device_put(w, NamedSharding(mesh, P()))})
    path, model = str(tmp_path / "1"), w.nbytes
    docs = [run_json(capsys, "plan", path, "--mesh", "4x2", "--spec", "w=", "--processes", "4", "--process-index", p) for p in range(4)]
    for doc in docs:
        (leaf,) = doc["leaves"]
        assert doc["cooperative"] and leaf["exchange_spec"] == ["data", None], doc
        assert doc["bytes_needed"] == model and doc["bytes_received"] == model * 3 // 4, doc
        assert model // 4 <= doc["bytes_read"] <= 1.01 * model / 4, doc
    plain = run_json(capsys, "plan", path, "--mesh", "4x2", "--spec", "w=", "--processes", "4", "--no-cooperative")
    assert not plain["cooperative"] and plain["bytes_received"] == 0 and plain["bytes_read"] >= model
    code, out, _ = run(capsys, "plan", path, "--mesh", "4x2", "--spec", "w=", "--processes", "4")
    assert code == 0 and "received" in out and f"cooperative: {model * 3 // 4} bytes come from peers" in out


def test_plan_with_too_few_devices_says_how_many(run_dir, capsys):
    code, out, err = run(capsys, "plan", f"{run_dir}/3", "--mesh", "4x4")
    assert_one_line_error(code, out, err, 2, "needs 16 devices", "8 cpu devices", "XLA_FLAGS=--xla_force_host_platform_device_count=16")


def test_plan_help_explains_the_default_rule(capsys):
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0 and "replicated" in out and "divides" in out and "last matching --spec wins" in out


def test_plan_and_drill_handle_any_tree_structure(tmp_path, capsys):
    """The target is built from leaf paths alone: int and tuple dict keys, index-keyed custom nodes."""

    class Pair:
        def __init__(self, a, b):
            self.a, self.b = a, b

    jax.tree_util.register_pytree_node(Pair, lambda p: ((p.a, p.b), None), lambda _, c: Pair(*c))
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("data", "model")))
    NT = collections.namedtuple("NT", "mu nu")
    tree = {"pair": Pair(x, 1.5), "ints": {3: x}, "tuples": {("t", 1): x}, "nt": NT(x, None), "a/b": x, "": x}
    ckpt.save(tmp_path / "odd" / "5", tree)
    doc = run_json(capsys, "plan", tmp_path / "odd" / "5", "--mesh", "2x2")
    assert len(doc["leaves"]) == 6 and doc["bytes_needed"] == 6 * 8 * 8 * 4
    report = _drill.drill(tmp_path / "odd")
    assert report.ok and report.step == 5 and report.bytes_needed == 6 * 8 * 8 * 4

    ckpt.save(tmp_path / "root" / "1", x)  # a tree that is a single array
    assert run_json(capsys, "plan", tmp_path / "root" / "1", "--mesh", "8")["leaves"][0]["leaf"] == ""


def test_leaves_are_named_by_their_key_path_never_the_escaped_file_name(tmp_path, capsys):
    """A Haiku key `mlp/~/linear_0` is stored as `mlp%2F~%2Flinear_0`; users see `['mlp/~/linear_0']`."""
    mesh = make_mesh((2, 4), ("data", "model"))
    w = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("data", "model")))
    path = str(tmp_path / "1")
    ckpt.save(path, {"mlp/~/linear_0": {"w": w, "b": np.zeros(8, np.float32)}, "step": 2})
    # ckpt.metadata: leaves stays keyed by the storage path; each entry carries its key string.
    meta = ckpt.metadata(path)
    assert list(meta.leaves) == ["mlp%2F~%2Flinear_0/b", "mlp%2F~%2Flinear_0/w", "step"]
    assert [m.keystr for m in meta.leaves.values()] == ["['mlp/~/linear_0']['b']", "['mlp/~/linear_0']['w']", "['step']"]
    assert meta.keystr("mlp%2F~%2Flinear_0/w") == "['mlp/~/linear_0']['w']"
    # inspect: the table and --json.
    code, out, err = run(capsys, "inspect", path)
    assert code == 0 and "%2F" not in out
    assert "8, 8" in next(line for line in out.splitlines() if line.startswith("['mlp/~/linear_0']['w']"))
    doc = run_json(capsys, "inspect", path)
    assert {leaf["keystr"] for leaf in doc["leaves"]} == {"['mlp/~/linear_0']['b']", "['mlp/~/linear_0']['w']", "['step']"}
    # plan: the table, --json and --spec globs in the key-path form (brackets are literal) ...
    code, out, err = run(capsys, "plan", path, "--mesh", "4x2", "--spec", "['mlp/~/linear_0']['w']=model")
    assert code == 0 and "%2F" not in out
    assert "P('model')" in next(line for line in out.splitlines() if line.startswith("['mlp/~/linear_0']['w']"))
    w, b = "['mlp/~/linear_0']['w']", "['mlp/~/linear_0']['b']"
    for glob, want in [("['mlp/~/linear_0']['w']", {w: ["model"], b: []}), ("*linear_0'?['w']", {w: ["model"], b: []}),
                       ("*['?']", {w: ["model"], b: ["model"]}), ("mlp%2F~%2Flinear_0/w", {w: ["model"], b: []}),
                       ("mlp%2F*", {w: ["model"], b: ["model"]})]:
        doc = run_json(capsys, "plan", path, "--mesh", "4x2", "--spec", f"{glob}=model")
        assert {leaf["keystr"]: leaf["target_spec"] for leaf in doc["leaves"]} == want, glob
    # ... a glob that matches nothing lists the leaves by key path.
    assert_one_line_error(*run(capsys, "plan", path, "--mesh", "4x2", "--spec", "nope*=data"), 2,
                          "matches no array leaf", "['mlp/~/linear_0']['b']")


def test_leaves_under_a_train_state_and_nnx_state_print_as_keystr(tmp_path):
    """Attribute keys (`TrainState.params`, namedtuple fields) print as `.name`, dict keys of
    custom nodes (`nnx.State`) as `['name']`, exactly as jax.tree_util.keystr does."""
    optax = pytest.importorskip("optax")
    train_state = pytest.importorskip("flax.training.train_state")
    nnx = pytest.importorskip("flax.nnx")
    params = {"dense": {"kernel": jnp.ones((2, 3))}}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    tree = {"ts": state, "nnx": nnx.state(model)}
    ckpt.save(str(tmp_path / "1"), tree)
    meta = ckpt.metadata(str(tmp_path / "1"))
    expected = [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert [m.keystr for m in meta.leaves.values()] == expected
    assert "['ts'].params['dense']['kernel']" in expected and "['nnx']['kernel'].value" in expected


# --- verify -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("unpacked_layout")  # about the per-leaf files
def test_verify_ok_then_a_deleted_chunk_file_fails_naming_it(run_dir, capsys):
    path = f"{run_dir}/3"
    code, out, err = run(capsys, "verify", path)
    assert code == 0 and f"{path}: OK" in out and err == ""
    assert run_json(capsys, "verify", path)["ok"] is True

    os.remove(f"{path}/arrays/params/w/c/1/2")
    code, out, err = run(capsys, "verify", path)
    assert code == 1 and "1 problem(s)" in out and "arrays/params/w/c/1/2" in out and "params/w" in out
    code, out, _ = run(capsys, "verify", path, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and len(doc["problems"]) == 1 and "arrays/params/w/c/1/2" in doc["problems"][0]


# --- gc -----------------------------------------------------------------------------------------


def test_gc_dry_run_then_removes_the_partial_folder_and_old_steps(run_dir, capsys):
    before = sorted(os.listdir(run_dir))
    code, out, err = run(capsys, "gc", run_dir, "--keep-latest", "2", "--dry-run")
    assert code == 0 and err == "" and "would remove" in out and PARTIAL in out and "kept steps: 2, 3" in out
    assert sorted(os.listdir(run_dir)) == before

    code, out, err = run(capsys, "gc", run_dir, "--keep-latest", "2")
    assert code == 0 and err == ""
    assert f"removed   {PARTIAL}" in out and "removed   1 " in out and "kept steps: 2, 3" in out
    with ckpt.CheckpointManager(run_dir) as mgr:
        assert mgr.all_steps() == [2, 3]
    doc = run_json(capsys, "ls", run_dir)
    assert [s["folder"] for s in doc["steps"]] == ["2", "3"]
    # Nothing left: a second gc removes nothing; --keep-latest 1 never removes the newest.
    doc = run_json(capsys, "gc", run_dir, "--keep-latest", "1")
    freed = doc.pop("freed_bytes")  # what step 2's own files held
    assert doc == {"directory": run_dir, "dry_run": False, "removed_partial": [], "rolled_forward": [],
                   "removed_steps": [2], "kept_steps": [3], "kept_for_references": {}, "retired_steps": {}}
    assert freed > 0


def test_gc_without_keep_latest_removes_only_crashed_saves(run_dir, capsys):
    doc = run_json(capsys, "gc", run_dir)
    assert doc["removed_partial"] == [PARTIAL] and doc["removed_steps"] == [] and doc["kept_steps"] == [1, 2, 3]


def test_gc_rolls_forward_a_committed_unrenamed_step(run_dir, capsys):
    os.rename(f"{run_dir}/3", f"{run_dir}/3.partial-20260101000000-cafebabe")  # crash between the two renames
    states = {s["folder"]: s["state"] for s in run_json(capsys, "ls", run_dir)["steps"]}
    assert states["3.partial-20260101000000-cafebabe"] == "committed, not renamed"
    doc = run_json(capsys, "gc", run_dir)
    assert doc["rolled_forward"] == ["3.partial-20260101000000-cafebabe"] and doc["kept_steps"] == [1, 2, 3]
    assert ckpt.metadata(f"{run_dir}/3").step == 3


def test_gc_refuses_while_a_manager_holds_the_directory(run_dir, capsys):
    with ckpt.CheckpointManager(run_dir, keep=ckpt.KeepLatest(10)) as mgr:
        mgr.recover()  # takes the writer's lock (and cleans up the partial)
        os.makedirs(f"{run_dir}/{PARTIAL}")
        assert_one_line_error(*run(capsys, "gc", run_dir, "--keep-latest", "1"), 1, "CheckpointManager is using")
        assert os.path.isdir(f"{run_dir}/{PARTIAL}") and os.path.isdir(f"{run_dir}/1")
        assert "pid" in run_json(capsys, "ls", run_dir)["manager"]
        code, out, _ = run(capsys, "gc", run_dir, "--dry-run")
        assert code == 0 and "would refuse" in out


# --- drill --------------------------------------------------------------------------------------


def test_drill_restores_the_newest_step_and_verifies(run_dir, capsys):
    code, out, err = run(capsys, "drill", run_dir)
    assert code == 0 and err == "" and "(step 3): OK" in out and "time to restored state" in out
    doc = run_json(capsys, "drill", run_dir)
    assert doc["step"] == 3 and doc["ok"] is True and doc["problems"] == []
    assert doc["mesh_shape"] == [2, 4] and doc["mesh_axis_names"] == ["data", "model"]  # the saved mesh
    assert doc["bytes_needed"] == W_BYTES + B_BYTES and doc["restore_s"] > 0 and doc["verify_s"] > 0
    assert doc["read_amplification"] == pytest.approx(doc["bytes_read"] / doc["bytes_needed"])
    doc = run_json(capsys, "drill", run_dir, "--mesh", "2x2")
    assert doc["mesh_shape"] == [2, 2] and doc["mesh_axis_names"] == ["data", "model"] and doc["ok"]


@pytest.mark.usefixtures("unpacked_layout")  # about the per-leaf files
def test_drill_reports_damage_as_a_finding(run_dir, capsys):
    os.remove(f"{run_dir}/3/arrays/params/w/c/0/0")
    report = _drill.drill(run_dir, (4,), axis_names=("data",))
    assert not report.ok and report.restore_s is None and report.step == 3 and report.mesh_shape == (4,)
    assert report.problems[0].startswith("restore failed") and "params/w" in report.problems[0]
    assert any("arrays/params/w/c/0/0" in p for p in report.problems[1:])
    code, out, _ = run(capsys, "drill", run_dir)
    assert code == 1 and "FAILED" in out and "arrays/params/w/c/0/0" in out


def test_drill_of_a_directory_without_committed_steps(tmp_path, capsys):
    os.makedirs(tmp_path / "empty" / PARTIAL)
    assert_one_line_error(*run(capsys, "drill", tmp_path / "empty"), 2, "no committed step")


# --- errors and the console script --------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["inspect", "{d}/9"], "no committed checkpoint"),
        (["ls", "{d}/missing"], "is not a directory"),
        (["plan", "{d}/3", "--mesh", "4by2"], "--mesh"),
        (["plan", "{d}/3", "--mesh", "4x2", "--axes", "data"], "--axes"),
        (["plan", "{d}/3", "--mesh", "4x2", "--spec", "params/w=data,nope"], "no axis 'nope'"),
        (["gc", "{d}", "--keep-latest", "0"], "--keep-latest"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_errors_are_one_line_without_traceback(run_dir, capsys, argv, fragment):
    assert_one_line_error(*run(capsys, *[a.format(d=run_dir) for a in argv]), 2, fragment)


def test_installed_console_script(run_dir):
    script = Path(sys.executable).with_name("checkpointer")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "checkpointer._cli"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    ok = subprocess.run(cmd + ["inspect", f"{run_dir}/3", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["step"] == 3
    bad = subprocess.run(cmd + ["verify", f"{run_dir}/{PARTIAL}"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("checkpointer: error: no committed checkpoint") and bad.stderr.count("\n") == 1


def test_drill_restores_host_numpy_leaves_as_numpy(tmp_path):
    """A float64 numpy leaf cannot go on a device with jax_enable_x64 off; the drill
    restores it on the host instead of failing."""
    from checkpointer._tools._drill import drill

    d = tmp_path / "run"
    ckpt.save(str(d / "3"), {"w": np.ones((8, 8), np.float32), "stats": np.linspace(0, 1, 5)})
    report = drill(str(d))
    assert report.ok, report.problems
    assert report.step == 3


def test_plan_save_shows_each_process_writing_its_share(tmp_path, capsys):
    # A 4 MiB leaf replicated over the 4 processes of a 4x2 mesh: a quarter each.
    mesh = make_mesh((2, 4), ("data", "model"))
    w = np.zeros((1024, 1024), np.float32)
    ckpt.save(str(tmp_path / "1"), {"w": jax.device_put(w, NamedSharding(mesh, P())), "step": 1})
    doc = run_json(capsys, "plan-save", tmp_path / "1", "--mesh", "4x2", "--processes", "4")
    assert [p["data_bytes"] for p in doc["processes"]] == [1 << 20] * 4
    assert doc["leaves"][0]["chunk_shape"] == [256, 1024] and doc["leaves"][0]["writers"] == 4
    code, out, err = run(capsys, "plan-save", tmp_path / "1", "--mesh", "4x2", "--processes", "4")
    assert code == 0 and err == "" and "1.000x the mean" in out
    code, out, err = run(capsys, "plan-save", tmp_path / "1", "--mesh", "4x2", "--processes", "3")
    assert_one_line_error(code, out, err, 2, "--processes 3 must divide the mesh's 8 devices")


def test_python_dash_m_checkpointer_is_the_command_line(run_dir):
    """A new user's first guess, `python -m checkpointer`, runs the command line (it was
    'No module named checkpointer.__main__')."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    ok = subprocess.run([sys.executable, "-m", "checkpointer", "inspect", f"{run_dir}/3", "--json"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["step"] == 3
