"""Object storage end to end: `s3://bucket/prefix` against a real S3-protocol server and
`gs://bucket/prefix` against a real GCS-protocol server, with the same tests.

Session-scoped servers listen on 127.0.0.1: moto (`tests/s3server.py`), which
TensorStore's `s3` kvstore driver reaches through the endpoint in `AWS_ENDPOINT_URL`, and
fake-gcs-server (`tests/gcsserver.py`), which its `gcs` driver reaches through
`TENSORSTORE_GCS_HTTP_URL` with the token `GOOGLE_AUTH_TOKEN_FOR_TESTING`. Every test
that takes `store` runs against both. Object keys are checked through each server's own
API (boto3, the GCS JSON API), independently of the library. On object stores there is
no rename: a save writes `<step>/` directly and the `COMMITTED` marker alone publishes it.
A server that cannot start skips its tests, and fails them under `CI=true`.
"""

import io
import json
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import make_mesh
from gcsserver import running_gcs_server, started_or_skipped
from jax.sharding import NamedSharding, PartitionSpec as P
from rich.console import Console
from s3server import running_s3_server

import checkpointer as ckpt
from checkpointer._cli import _main as _cli
from checkpointer._commit import _directory
from checkpointer._storage._kvstore import KvStorage, s3_spec, storage_for


@pytest.fixture(scope="session")
def s3():
    with started_or_skipped(running_s3_server) as server:
        yield server


@pytest.fixture(scope="session")
def gcs():
    with started_or_skipped(running_gcs_server) as server:
        yield server


@pytest.fixture(params=["s3", "gcs"])
def store(request):
    """The object store of the test: moto's S3, then fake-gcs-server."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def bucket(store):
    return store.new_bucket()


def _state(value, mesh_shape=(2, 4)):
    mesh = make_mesh(mesh_shape, ("data", "model"))
    w = np.arange(32 * 16, dtype=np.float32).reshape(32, 16) + value
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(jnp.full((16,), value, jnp.bfloat16), NamedSharding(mesh, P("model"))),
            "e": jax.device_put(np.arange(8, dtype=np.int32) * value, NamedSharding(mesh, P())),
        },
        "step": int(value),
        "name": "run-a",
    }


def _target(mesh):
    return {
        "params": {
            "w": jax.ShapeDtypeStruct((32, 16), np.float32, sharding=NamedSharding(mesh, P("model", "data"))),
            "b": jax.ShapeDtypeStruct((16,), ml_dtypes.bfloat16, sharding=NamedSharding(mesh, P("data"))),
            "e": jax.ShapeDtypeStruct((8,), np.int32, sharding=NamedSharding(mesh, P())),
        },
        "step": None,
        "name": None,
    }


def _assert_restored(restored, value):
    w = np.arange(32 * 16, dtype=np.float32).reshape(32, 16) + value
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), w)
    np.testing.assert_array_equal(np.asarray(restored["params"]["b"]).astype(np.float32), np.full((16,), value, np.float32))
    np.testing.assert_array_equal(np.asarray(restored["params"]["e"]), np.arange(8, dtype=np.int32) * value)
    assert restored["step"] == value and restored["name"] == "run-a"


def _crash_a_save(store, bucket, prefix, step):
    """Leaves `<prefix>/<step>/` as a save that died just before its commit marker."""
    path = f"{store.scheme}://{bucket}/{prefix}/{step}"
    ckpt.save(path, _state(step))
    store.delete(bucket, f"{prefix}/{step}/COMMITTED")
    return path


# --- the endpoint ---------------------------------------------------------------------------


def test_the_endpoint_and_region_come_from_the_standard_environment(s3, monkeypatch):
    bucket = s3.new_bucket()
    spec = s3_spec(bucket)
    assert spec["endpoint"] == s3.endpoint and spec["aws_region"] == "us-east-1"
    storage, path = storage_for(f"s3://{bucket}/run/7/")
    assert isinstance(storage, KvStorage) and not storage.supports_rename and path == f"s3://{bucket}/run/7"
    kv = storage.kvstore_spec(f"{path}/arrays/w")
    assert kv["driver"] == "s3" and kv["bucket"] == bucket and kv["endpoint"] == s3.endpoint
    assert kv["path"] == "run/7/arrays/w/"
    # The service-specific variable wins, as in the AWS SDKs.
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint + "/")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert s3_spec(bucket)["endpoint"] == s3.endpoint
    # Without an endpoint TensorStore addresses AWS itself and resolves the region.
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert "endpoint" not in s3_spec(bucket) and "aws_region" not in s3_spec(bucket)


def test_gcs_is_tensorstores_gcs_driver_reached_through_its_endpoint_variable(gcs):
    """`gs://bucket/prefix` is TensorStore's `gcs` kvstore, which sends every request to
    `TENSORSTORE_GCS_HTTP_URL` (here the server on 127.0.0.1) with the token of
    `GOOGLE_AUTH_TOKEN_FOR_TESTING`; the objects land under their keys."""
    bucket = gcs.new_bucket()
    storage, path = storage_for(f"gs://{bucket}/run/7/")
    assert isinstance(storage, KvStorage) and not storage.supports_rename and path == f"gs://{bucket}/run/7"
    kv = storage.kvstore_spec(f"{path}/arrays/w")
    assert kv["driver"] == "gcs" and kv["bucket"] == bucket and kv["path"] == "run/7/arrays/w/"
    storage.write_file(f"{path}/x", b"hello")
    assert gcs.keys(bucket) == ["run/7/x"] and gcs.get(bucket, "run/7/x") == b"hello"


# --- save, restore, metadata, verify ---------------------------------------------------------


def test_save_writes_the_final_name_and_restores_onto_another_mesh(store, bucket):
    path = f"{store.scheme}://{bucket}/run/5"
    ckpt.save(path, _state(5), metadata={"note": "object store"})
    keys = store.keys(bucket)
    assert f"run/5/{'COMMITTED'}" in keys and "run/5/manifest.json" in keys and "run/5/processes/0.json" in keys
    assert not [k for k in keys if ".partial-" in k or ".deleting-" in k]  # no rename on object stores
    assert all(k.startswith("run/5/") for k in keys)
    # The marker is the commit: it names the save's generation, as the manifest does.
    marker = json.loads(store.get(bucket, "run/5/COMMITTED"))
    manifest = json.loads(store.get(bucket, "run/5/manifest.json"))
    assert marker["generation"] == manifest["generation"]

    for mesh_shape in ((4, 2), (1, 4), (1, 1)):
        mesh = make_mesh(mesh_shape, ("data", "model"))
        restored = ckpt.restore(path, _target(mesh))
        _assert_restored(restored, 5)
        assert restored["params"]["w"].sharding == NamedSharding(mesh, P("model", "data"))
    _assert_restored(ckpt.restore(path), 5)  # host numpy arrays

    meta = ckpt.metadata(path)
    assert meta.user_metadata == {"note": "object store"}
    assert meta.leaves["params/w"].shape == (32, 16) and meta.leaves["params/w"].saved_sharding.mesh_shape == (2, 4)
    report = ckpt.verify(path)
    assert report.ok, report.problems
    assert report.chunks_checked == 8 + 4 + 1


@pytest.mark.usefixtures("unpacked_layout")  # about the per-leaf files
def test_restore_fetches_only_the_planned_byte_ranges(store, bucket):
    path = f"{store.scheme}://{bucket}/run/1"
    w = np.random.default_rng(0).standard_normal((512, 256), np.float32)
    ckpt.save(path, {"w": jax.device_put(w, NamedSharding(make_mesh((2, 4), ("data", "model")), P("data", "model")))})
    mesh = make_mesh((4, 2), ("data", "model"))
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P("data", "model")))}
    plan = ckpt.plan_restore(path, target)
    assert plan.bytes_needed == w.nbytes and plan.read_amplification <= 1.01, str(plan)
    stats = ckpt.RestoreStats()
    out = ckpt.restore(path, target, stats=stats)
    assert stats.bytes_read == plan.bytes_read  # byte-range GETs, nothing more
    assert stats.plan == plan
    np.testing.assert_array_equal(np.asarray(out["w"]), w)


def test_save_async_commits_on_wait(store, bucket):
    path = f"{store.scheme}://{bucket}/run/3"
    handle = ckpt.save_async(path, _state(3))
    handle.wait(timeout=120)
    assert handle.done()
    assert "run/3/COMMITTED" in store.keys(bucket)
    _assert_restored(ckpt.restore(path, _target(make_mesh((2, 2), ("data", "model")))), 3)


def test_a_committed_path_is_not_overwritten_without_overwrite(store, bucket):
    path = f"{store.scheme}://{bucket}/run/2"
    ckpt.save(path, _state(2))
    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.save(path, _state(9))
    _assert_restored(ckpt.restore(path), 2)
    assert ckpt.verify(path).ok


# On object stores a save writes `<step>/` in place, so process 0 first clears what is
# there (marker first): an overwritten committed step, or a crashed save's leftovers.


def test_overwrite_replaces_a_committed_step(store, bucket):
    path = f"{store.scheme}://{bucket}/run/2"
    ckpt.save(path, _state(2))
    ckpt.save(path, _state(9), overwrite=True)
    restored = ckpt.restore(path)
    np.testing.assert_array_equal(restored["params"]["w"], np.arange(32 * 16, dtype=np.float32).reshape(32, 16) + 9)
    assert ckpt.verify(path).ok


def test_a_step_whose_crashed_save_awaits_gc_can_be_saved_again(store, bucket):
    d = f"{store.scheme}://{bucket}/run"
    _crash_a_save(store, bucket, "run", 3)
    with ckpt.CheckpointManager(d, async_save=False) as mgr:  # the crashed folder is kept (grace)
        mgr.save(3, _state(3))
        assert mgr.all_steps() == [3]
    assert ckpt.verify(f"{d}/3").ok


# --- only committed steps are checkpoints ------------------------------------------------------


def test_a_step_folder_without_marker_is_invisible(store, bucket):
    d = f"{store.scheme}://{bucket}/run"
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(5), async_save=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    crashed = _crash_a_save(store, bucket, "run", 3)  # newest folder, but no marker
    assert any(k.startswith("run/3/") for k in store.keys(bucket))

    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        assert mgr.all_steps() == [1, 2]
        assert mgr.latest_step() == 2
        assert mgr.status().latest_committed_step == 2
        with pytest.raises(ckpt.CheckpointNotFoundError):
            mgr.restore(3)
        _assert_restored(mgr.restore(), 2)  # the newest *committed* step
    with pytest.raises(ckpt.CheckpointNotFoundError, match="commit marker"):
        ckpt.restore(crashed)
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.restore(crashed, _target(make_mesh((2, 4), ("data", "model"))))
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.metadata(crashed)
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.verify(crashed)


# --- the manager ---------------------------------------------------------------------------


def test_manager_saves_async_keeps_the_latest_and_restores_elsewhere(store, bucket):
    d = f"{store.scheme}://{bucket}/exp/run"
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(2)) as mgr:
        for step in range(5):
            assert mgr.save(step, _state(step), metrics={"loss": 10.0 - step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]
        assert mgr.latest_step() == 4
        status = mgr.status()
        assert status.last_error is None and status.step_in_flight is None and status.commit_lag_steps == 0
    # Retention removed every object of the dropped steps, and nothing else lingers.
    steps_with_objects = {k.split("/")[2] for k in store.keys(bucket, "exp/run/") if k.split("/")[2].isdigit()}
    assert steps_with_objects == {"3", "4"}
    # Besides the steps, only the step catalog (its header and the kept steps' entries)
    # and the save journal (`checkpointer timeline`), one line per save.
    assert [k for k in store.keys(bucket, "exp/run/") if not k.split("/")[2].isdigit()] == [
        "exp/run/.checkpointer-catalog/3", "exp/run/.checkpointer-catalog/4", "exp/run/.checkpointer-catalog/catalog.json",
        "exp/run/.checkpointer-journal.jsonl",
    ]
    phases = ckpt.timeline(d, console=Console(file=io.StringIO()))
    assert {p.step for p in phases} == {3, 4} and "retention" in {p.name for p in phases}

    with ckpt.CheckpointManager(d, async_save=False) as mgr:  # a fresh job, another mesh
        assert mgr.latest_step() == 4
        _assert_restored(mgr.restore(target=_target(make_mesh((1, 4), ("data", "model")))), 4)
        _assert_restored(mgr.restore(3, target=_target(make_mesh((2, 1), ("data", "model")))), 3)
        assert ckpt.metadata(mgr.step_path(4)).user_metadata["metrics"] == {"loss": 6.0}
        with pytest.raises(ckpt.CheckpointExistsError):
            mgr.save(4, _state(4))


def test_manager_keep_best_uses_the_stored_metrics(store, bucket):
    d = f"{store.scheme}://{bucket}/best"
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 5.0}
    with ckpt.CheckpointManager(d, keep=ckpt.KeepBest("loss", n=1), async_save=False) as mgr:
        for step, loss in losses.items():
            mgr.save(step, _state(step), metrics={"loss": loss})
    with ckpt.CheckpointManager(d, keep=ckpt.KeepBest("loss", n=1)) as mgr:
        assert mgr.all_steps() == [2, 4]  # the best one and the newest one


# --- garbage collection of crashed saves ----------------------------------------------------------


def test_recovery_removes_a_marker_less_step_only_after_it_stayed_unchanged_for_the_grace(store, bucket):
    storage, d = storage_for(f"{store.scheme}://{bucket}/run")
    ckpt.save(f"{d}/1", _state(1))
    _crash_a_save(store, bucket, "run", 2)
    grace = _directory.OBJECT_STORE_GC_GRACE_S
    t0 = 1_000_000.0

    assert _directory.recover(storage, d, now=t0) == []  # first sighting: only noted
    journal = json.loads(store.get(bucket, f"run/{_directory.GC_JOURNAL}"))
    assert journal["2"]["unchanged_since_unix_s"] == t0
    assert _directory.recover(storage, d, now=t0 + grace - 1) == []
    assert _directory.plan_recovery(storage, d, now=t0 + grace - 1) == []
    # A step this caller is saving is never removed.
    assert _directory.recover(storage, d, now=t0 + grace, live_steps=frozenset({2})) == []

    # Progress (objects added) starts the clock again.
    store.put(bucket, "run/2/processes/1.json", b"{}")
    assert _directory.recover(storage, d, now=t0 + grace) == []
    assert _directory.plan_recovery(storage, d, now=t0 + 2 * grace) == [("2", "remove")]
    assert _directory.recover(storage, d, now=t0 + 2 * grace - 1) == []
    assert _directory.recover(storage, d, now=t0 + 2 * grace) == ["2"]

    assert [k for k in store.keys(bucket) if not k.startswith("run/1/")] == []  # the journal went with it
    assert _directory.committed_steps(storage, d) == [1]
    assert ckpt.verify(f"{d}/1").ok


def test_grace_zero_removes_at_once_and_committed_steps_are_never_touched(store, bucket):
    storage, d = storage_for(f"{store.scheme}://{bucket}/run")
    ckpt.save(f"{d}/1", _state(1))
    _crash_a_save(store, bucket, "run", 2)
    _crash_a_save(store, bucket, "run", 3)
    assert _directory.recover(storage, d, grace_s=0) == ["2", "3"]
    assert {k.split("/")[1] for k in store.keys(bucket)} == {"1"}
    assert _directory.recover(storage, d, grace_s=0) == []


def test_the_manager_notes_a_crashed_save_at_start_and_removes_it_at_a_later_start(store, bucket, monkeypatch):
    d = f"{store.scheme}://{bucket}/run"
    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        mgr.save(1, _state(1))
    _crash_a_save(store, bucket, "run", 2)

    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        assert mgr.recover() == []
        assert mgr.all_steps() == [1]
    assert any(k.startswith("run/2/") for k in store.keys(bucket))  # maybe another job's save in flight: kept
    assert f"run/{_directory.GC_JOURNAL}" in store.keys(bucket)

    monkeypatch.setattr(_directory, "OBJECT_STORE_GC_GRACE_S", 0.5)
    time.sleep(0.6)
    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        assert mgr.recover() == ["2"]
        assert mgr.all_steps() == [1]
        assert not any(k.startswith("run/2/") for k in store.keys(bucket))
        assert f"run/{_directory.GC_JOURNAL}" not in store.keys(bucket)
        mgr.save(2, _state(2))  # the step can be saved again, from scratch
        assert mgr.all_steps() == [1, 2]
    assert ckpt.verify(f"{d}/2").ok


def test_retention_deletes_the_marker_first(store, bucket, monkeypatch):
    """A crash in the middle of deleting a step leaves a marker-less folder, never a
    committed step with missing chunks."""
    storage, d = storage_for(f"{store.scheme}://{bucket}/run")
    ckpt.save(f"{d}/1", _state(1))
    deleted = []
    real_delete_tree = type(storage).delete_tree

    def crash_before_tree(self, path):
        deleted.append(path)
        raise OSError("crash")

    monkeypatch.setattr(type(storage), "delete_tree", crash_before_tree)
    with pytest.raises(OSError):
        _directory.delete_step(storage, d, 1)
    monkeypatch.setattr(type(storage), "delete_tree", real_delete_tree)
    assert deleted == [f"{d}/1"]
    assert _directory.committed_steps(storage, d) == []
    assert "run/1/manifest.json" in store.keys(bucket)
    assert _directory.recover(storage, d, grace_s=0) == ["1"]
    assert store.keys(bucket) == []


# --- the command line ----------------------------------------------------------------------


def _run(capsys, *argv):
    code = _cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.usefixtures("unpacked_layout")  # damages a zarr shard file
def test_cli_ls_inspect_verify_on_an_object_store(store, bucket, capsys):
    d = f"{store.scheme}://{bucket}/run"
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(5), async_save=False) as mgr:
        mgr.save(1, _state(1), metrics={"loss": 2.5})
        mgr.save(2, _state(2), metrics={"loss": 1.5})
    _crash_a_save(store, bucket, "run", 3)

    code, out, err = _run(capsys, "ls", d, "--json")
    assert code == 0, err
    rows = {r["step"]: r for r in json.loads(out)["steps"]}
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["committed"] and rows[2]["committed"] and not rows[3]["committed"]
    assert rows[3]["state"] == "no marker"
    assert rows[2]["metrics"] == {"loss": 1.5} and rows[2]["size_bytes"] > 32 * 16 * 4
    code, out, err = _run(capsys, "ls", d)
    assert code == 0 and "no marker" in out and "committed" in out

    code, out, err = _run(capsys, "inspect", f"{d}/2", "--json")
    assert code == 0, err
    info = json.loads(out)
    leaves = {leaf["path"]: leaf for leaf in info["leaves"]}
    assert info["step"] == 2 and set(leaves) == {"params/w", "params/b", "params/e", "step", "name"}
    assert leaves["params/w"]["shape"] == [32, 16] and leaves["params/w"]["dtype"] == "float32"
    assert leaves["params/w"]["chunk_shape"] == [16, 4]
    code, out, err = _run(capsys, "inspect", f"{d}/2")
    assert code == 0 and "['params']['w']" in out

    code, out, err = _run(capsys, "verify", f"{d}/2", "--json")
    assert code == 0, err
    assert json.loads(out)["ok"] is True
    code, out, err = _run(capsys, "verify", f"{d}/3")
    assert code == 2 and "commit marker" in err and "Traceback" not in err

    # Damage one zarr shard file: verify finds it and exits 1.
    key = "run/2/arrays/params/w/c/0/0"
    body = bytearray(store.get(bucket, key))
    body[10] ^= 0xFF
    store.put(bucket, key, bytes(body))
    code, out, err = _run(capsys, "verify", f"{d}/2", "--json")
    assert code == 1 and json.loads(out)["ok"] is False


# --- safetensors onto a mesh, from the bucket ---------------------------------------------


def test_restore_safetensors_from_an_object_store_reads_its_ranges_and_checks_the_end(store, bucket, tmp_path):
    """A Hugging Face folder in the bucket onto a mesh sharded on the second axis: bit-exact,
    ranged reads of about the file's bytes (no whole-object download), and a truncated
    object is corrupt, naming the tensor (on object stores the last data byte is read)."""
    from safetensors.numpy import save_file

    from checkpointer._encoding import RestoreStats
    from checkpointer._restore import RestoreOptions
    from checkpointer._restore._safetensors import read_safetensors

    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    b = rng.standard_normal(16).astype(ml_dtypes.bfloat16)
    save_file({"w": w, "b": b}, str(tmp_path / "model.safetensors"))
    blob = (tmp_path / "model.safetensors").read_bytes()
    store.put(bucket, "hf/model.safetensors", blob)
    mesh = make_mesh((2, 4), ("data", "model"))
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P(None, "model"))),
              "b": jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=NamedSharding(mesh, P()))}
    stats = RestoreStats()
    out = read_safetensors(*storage_for(f"{store.scheme}://{bucket}/hf"), target, RestoreOptions(), stats=stats)
    np.testing.assert_array_equal(np.asarray(out["w"]), w)
    assert np.asarray(out["b"]).tobytes() == b.tobytes()
    assert len(blob) <= stats.bytes_read <= 1.05 * len(blob)
    assert ckpt.restore_safetensors(f"{store.scheme}://{bucket}/hf/model.safetensors", {"w": None}, partial=True)["w"].shape == w.shape

    store.put(bucket, "cut/model.safetensors", blob[:-3])
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"cut/model\.safetensors.*ends before the end of tensor"):
        ckpt.restore_safetensors(f"{store.scheme}://{bucket}/cut", target)


def test_a_16_mib_column_sharded_tensor_comes_from_s3_in_at_most_16_gets(s3, tmp_path, monkeypatch):
    """Issue 28 item 3: the column blocks of every row are side by side in the file, so
    the eight devices' boxes are read together, not one GET per row and device (32,654
    GETs and 346 s before). GETs are counted as the kvstore's ranged reads (one each)."""
    from safetensors.numpy import save_file

    from checkpointer._storage import _kvstore

    bucket = s3.new_bucket()
    w = np.random.default_rng(6).standard_normal((4096, 1024)).astype(np.float32)  # 16 MiB
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    s3.put(bucket, "hf/model.safetensors", (tmp_path / "model.safetensors").read_bytes())
    gets: list[int] = []
    real = _kvstore.KvStorage.read_range

    def counted(self, path, offset, n):
        gets.append(n)
        if len(gets) > 64:  # a GET per row would take minutes: fail now
            raise AssertionError("more than 64 GETs")
        return real(self, path, offset, n)

    monkeypatch.setattr(_kvstore.KvStorage, "read_range", counted)
    mesh = make_mesh((1, 8), ("data", "model"))
    stats = ckpt.RestoreStats()
    from checkpointer._restore import RestoreOptions
    from checkpointer._restore._safetensors import read_safetensors

    out = read_safetensors(*storage_for(f"s3://{bucket}/hf/model.safetensors"), {"w": NamedSharding(mesh, P(None, "model"))},
                           RestoreOptions(), stats=stats)
    monkeypatch.undo()
    np.testing.assert_array_equal(np.asarray(out["w"]), w)
    assert len(gets) <= 16, gets
    assert stats.bytes_read <= 1.1 * w.nbytes
