"""Two tiers: a save commits on a node-local directory, then is replicated to the durable one.

`CheckpointManager(directory, local_directory=...)`: the local tier holds, per process,
`process-<i>/<step>/` with the files that process wrote, a manifest copy and its own
marker; `all_steps()` lists the durable tier only.
"""

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._cli import _main as _cli
from checkpointer._manage import _tiers
from checkpointer._storage import _local as _storage

CRASH_WORKER = os.path.join(os.path.dirname(__file__), "tiers_crash_worker.py")


def _state(step, mesh=None):
    mesh = make_mesh((2, 4), ("a", "b")) if mesh is None else mesh
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step
    return {"w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))), "step": step}


def _target(mesh=None):
    mesh = make_mesh((2, 4), ("a", "b")) if mesh is None else mesh
    return {"w": NamedSharding(mesh, P("a", "b")), "step": None}


def _check(restored, step):
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step
    np.testing.assert_array_equal(np.asarray(restored["w"]), w)
    assert restored["step"] == step


def _local_steps(local):
    root = os.path.join(local, "process-0")
    return sorted(int(n) for n in os.listdir(root) if n.isdigit() and os.path.exists(f"{root}/{n}/COMMITTED"))


@pytest.fixture
def dirs(tmp_path):
    return str(tmp_path / "durable"), str(tmp_path / "local")


def test_save_commits_locally_then_durably_with_the_usual_marker(dirs):
    durable, local = dirs
    with ckpt.CheckpointManager(durable, local_directory=local, keep_local=ckpt.KeepLatest(1)) as mngr:
        assert mngr.save(1, _state(1))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1]
        status = mngr.status()
        assert status.latest_local_step == 1 and status.latest_committed_step == 1
        assert status.replication_lag_steps == 0 and status.last_replication_error is None
    assert os.path.exists(f"{durable}/1/COMMITTED") and os.path.exists(f"{durable}/1/manifest.json")
    marker = _tiers.read_marker(_storage.LocalStorage(), f"{local}/process-0/1")
    assert marker is not None and marker.process_count == 1
    durable_marker = ckpt.metadata(f"{durable}/1")
    assert durable_marker.step == 1
    _check(ckpt.restore(f"{durable}/1", _target()), 1)  # the durable copy alone is a checkpoint
    assert ckpt.verify(f"{durable}/1").ok


def test_restore_from_intact_local_copy_reads_no_durable_chunk_bytes(dirs, monkeypatch):
    durable, local = dirs
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        mngr.save(3, _state(3))
        mngr.wait_until_finished()
    opened = []
    real_open, real_read, real_range = (
        _storage.LocalStorage.open_reader, _storage.LocalStorage.read_file, _storage.LocalStorage.read_range,
    )

    def note(path):
        if path.startswith(durable + "/") and ("/arrays/" in path or "/packed/" in path):  # chunk files or packs
            opened.append(path)

    def counting(real):
        def method(self, path, *a, **kw):
            note(path)
            return real(self, path, *a, **kw)

        return method

    monkeypatch.setattr(_storage.LocalStorage, "open_reader", counting(real_open))
    monkeypatch.setattr(_storage.LocalStorage, "read_file", counting(real_read))
    monkeypatch.setattr(_storage.LocalStorage, "read_range", counting(real_range))
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:  # a restart on the same node
        stats = ckpt.RestoreStats()
        _check(mngr.restore(None, _target(), stats=stats), 3)
        assert stats.bytes_read > 0
        assert mngr.status().last_restore_source == "local"
        assert mngr.status().last_restore_durable_bytes == 0
    assert opened == []


@pytest.mark.usefixtures("unpacked_layout")  # damages a per-leaf chunk file (packs: tests/test_encodings.py)
def test_damaged_local_copy_is_read_from_durable(dirs):
    durable, local = dirs
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        mngr.save(1, _state(1))
        mngr.wait_until_finished()
    chunk = f"{local}/process-0/1/arrays/w/c/0/0"
    with open(chunk, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        _check(mngr.restore(None, _target()), 1)
        assert mngr.status().last_restore_source == "durable"


def test_node_loss_restores_from_durable(dirs):
    durable, local = dirs
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        mngr.save(1, _state(1))
        mngr.wait_until_finished()
    shutil.rmtree(local)
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        _check(mngr.restore(None, _target()), 1)
        assert mngr.status().last_restore_source == "durable"
        assert mngr.status().last_restore_durable_bytes > 0


def test_retention_per_tier(dirs):
    durable, local = dirs
    with ckpt.CheckpointManager(durable, local_directory=local, keep=ckpt.KeepLatest(2), keep_local=ckpt.KeepLatest(1)) as mngr:
        for step in range(1, 5):
            mngr.save(step, _state(step))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [3, 4]
    assert _local_steps(local) == [4]
    # No partial or deleting folder (node.json: the node of the folder, for a restart onto fewer processes).
    assert [n for n in os.listdir(f"{local}/process-0") if not n.isdigit()] == ["node.json"]


def _fail_durable_chunk_writes(monkeypatch, durable):
    real_write = _storage.LocalStorage.write_file

    def write_file(self, path, data):
        if path.startswith(durable + "/") and ("/arrays/" in path or "/packed/" in path):  # chunk files or packs
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write(self, path, data)

    monkeypatch.setattr(_storage.LocalStorage, "write_file", write_file)


def test_replication_error_surfaces_keeps_local_and_commits_nothing(dirs, monkeypatch):
    durable, local = dirs
    mngr = ckpt.CheckpointManager(durable, local_directory=local, keep_local=ckpt.KeepLatest(1))
    mngr.save(1, _state(1))
    mngr.wait_until_finished()
    _fail_durable_chunk_writes(monkeypatch, durable)
    assert mngr.save(2, _state(2))  # returns after the snapshot: the local commit and replication run behind
    with pytest.raises(ckpt.CheckpointError, match="No space left"):
        mngr.wait_until_finished()
    assert mngr.all_steps() == [1]
    assert [n for n in os.listdir(durable) if n.startswith("2")] == []  # nothing partial left either
    assert _local_steps(local) == [2]  # step 2 is kept: it is not durable (step 1 is, and left the window)
    status = mngr.status()
    assert "step 2" in status.last_replication_error and "No space left" in status.last_replication_error
    assert status.latest_local_step == 2 and status.replication_lag_steps == 1
    # A failure is raised by the next save() ...
    mngr.save(3, _state(3))
    deadline = time.monotonic() + 60
    while "step 3" not in (mngr.status().last_replication_error or "") and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(ckpt.CheckpointError, match="No space left"):
        mngr.save(4, _state(4))
    assert _local_steps(local) == [2, 3]
    # ... and by close().
    mngr.save(4, _state(4))
    with pytest.raises(ckpt.CheckpointError, match="No space left"):
        mngr.close()
    assert ckpt.CheckpointManager(durable).all_steps() == [1]


def test_resume_from_local_only_step_replicates_it(dirs, monkeypatch):
    durable, local = dirs
    mngr = ckpt.CheckpointManager(durable, local_directory=local, keep_local=ckpt.KeepLatest(2))
    mngr.save(1, _state(1))
    mngr.wait_until_finished()
    with monkeypatch.context() as m:
        _fail_durable_chunk_writes(m, durable)
        mngr.save(2, _state(2))
        with pytest.raises(ckpt.CheckpointError):
            mngr.close()
    with ckpt.CheckpointManager(durable, local_directory=local, keep_local=ckpt.KeepLatest(2)) as mngr:
        assert mngr.latest_step() == 1  # the durable truth
        _check(mngr.restore(None, _target()), 2)  # the newer local step, whole on every process
        assert mngr.status().last_restore_source == "local"
        mngr.wait_until_finished()  # its replication resumed
        assert mngr.all_steps() == [1, 2]
    _check(ckpt.restore(f"{durable}/2", _target()), 2)


def test_local_step_on_other_devices_is_restored_from_its_files(dirs, monkeypatch):
    durable, local = dirs
    mngr = ckpt.CheckpointManager(durable, local_directory=local, keep_local=ckpt.KeepLatest(2))
    mngr.save(1, _state(1))
    mngr.wait_until_finished()
    with monkeypatch.context() as m:
        _fail_durable_chunk_writes(m, durable)
        mngr.save(2, _state(2))
        with pytest.raises(ckpt.CheckpointError):
            mngr.close()
    monkeypatch.setattr(_tiers, "own_device_ids", lambda: (0, 1, 2, 3))  # another device assignment
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        # The local-only vote refuses a step saved on other devices; the restart onto another
        # mesh reads its files instead (one process: its share holds every chunk).
        _check(mngr.restore(None, _target()), 2)
        status = mngr.status()
        assert status.last_restore_source == "local" and status.last_restore_durable_bytes == 0
        assert "combined from the local copies" in status.last_restore_reason, status.last_restore_reason


def test_save_waits_for_replication_when_local_window_is_full(dirs, monkeypatch):
    durable, local = dirs
    release = threading.Event()
    real = _tiers.replicate

    def slow_replicate(*a, **kw):
        assert release.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(_tiers, "replicate", slow_replicate)
    with ckpt.CheckpointManager(durable, local_directory=local, keep_local=ckpt.KeepLatest(1)) as mngr:
        mngr.save(1, _state(1))
        done = threading.Event()
        t = threading.Thread(target=lambda: (mngr.save(2, _state(2)), done.set()))
        t.start()
        deadline = time.monotonic() + 60
        while not mngr.status().waiting_for_replication and time.monotonic() < deadline:
            time.sleep(0.02)
        assert mngr.status().waiting_for_replication
        assert not done.is_set() and _local_steps(local) == [1]
        release.set()
        t.join(60)
        assert done.is_set()
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2] and not mngr.status().waiting_for_replication
    assert _local_steps(local) == [2]


def test_sync_save_returns_durable(dirs):
    durable, local = dirs
    with ckpt.CheckpointManager(durable, local_directory=local, async_save=False) as mngr:
        mngr.save(5, _state(5))
        assert mngr.all_steps() == [5]


def test_cli_ls_shows_both_tiers(dirs, capsys):
    durable, local = dirs
    with ckpt.CheckpointManager(durable, local_directory=local, keep_local=ckpt.KeepLatest(2)) as mngr:
        mngr.save(1, _state(1))
        mngr.save(2, _state(2))
    shutil.rmtree(f"{durable}/2")
    assert _cli.main(["ls", durable, "--local", local]) == 0
    out = capsys.readouterr().out
    assert "local tier" in out and "process-0" in out
    assert "2" in out and "not durable" in out


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (dev extra)")
    pytest.importorskip("boto3", reason="the S3 tests need boto3 (dev extra)")
    from s3server import running_s3_server

    with running_s3_server() as server:
        yield server


def test_replication_to_s3_commits_with_the_marker(s3, tmp_path):
    bucket = s3.new_bucket()
    durable, local = f"s3://{bucket}/run", str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local_directory=local, keep=ckpt.KeepLatest(1)) as mngr:
        mngr.save(1, _state(1))
        mngr.save(2, _state(2))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2]
        _check(mngr.restore(None, _target()), 2)
        assert mngr.status().last_restore_source == "local"
    keys = s3.keys(bucket, "run/")
    assert "run/2/COMMITTED" in keys and "run/2/manifest.json" in keys and "run/2/processes/0.json" in keys
    assert "run/1/COMMITTED" not in keys  # durable retention (keep=KeepLatest(1))
    assert any(k.startswith(("run/2/arrays/w/c/", "run/2/packed/process-0/c/")) for k in keys)
    shutil.rmtree(local)
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        _check(mngr.restore(None, _target()), 2)
        assert mngr.status().last_restore_source == "durable"
    assert ckpt.verify(f"{durable}/2").ok


def _crash(durable, local):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.run([sys.executable, CRASH_WORKER, durable, local], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_sigkill_during_replication_resumes_from_local_on_the_same_node(dirs):
    durable, local = dirs
    res = _crash(durable, local)
    assert res.returncode == -9, (res.stdout, res.stderr[-2000:])
    assert "killing during replication" in res.stdout
    assert ckpt.CheckpointManager(durable).all_steps() == [1]  # durable without step 2
    assert _local_steps(local) == [1, 2]  # local with it
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        _check(mngr.restore(None, _target()), 2)
        assert mngr.status().last_restore_source == "local"
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
    assert [n for n in os.listdir(durable) if ".partial-" in n] == []
    _check(ckpt.restore(f"{durable}/2", _target()), 2)


@pytest.mark.slow
def test_sigkill_during_replication_then_node_loss_resumes_from_previous_durable(dirs):
    durable, local = dirs
    res = _crash(durable, local)
    assert res.returncode == -9, (res.stdout, res.stderr[-2000:])
    shutil.rmtree(local)
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        _check(mngr.restore(None, _target()), 1)
        assert mngr.status().last_restore_source == "durable"
        mngr.save(2, _state(2))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]


@pytest.mark.usefixtures("unpacked_layout")  # a packed complex leaf is read from its pack, not by TensorStore
def test_tensorstore_path_leaves_read_from_durable_and_say_so(dirs):
    durable, local = dirs
    c = (np.arange(12) + 1j * np.arange(12)).astype(np.complex64).reshape(3, 4)  # not on the byte-range path
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        mngr.save(1, dict(_state(1), c=c))
        mngr.wait_until_finished()
        restored = mngr.restore(None, dict(_target(), c=None))
        _check(restored, 1)
        np.testing.assert_array_equal(restored["c"], c)
        assert mngr.status().last_restore_source == "local+durable"


def _small_state(step):
    mesh = make_mesh((2, 4), ("a", "b"))
    return {
        "w": jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step, NamedSharding(mesh, P("a", "b"))),
        "norm": jax.device_put(np.full(256, step, np.float32), NamedSharding(mesh, P())),  # 1 KiB
        "big": jax.device_put(np.ones((64, 64), np.float32) * step, NamedSharding(mesh, P())),  # 16 KiB
        "step": step,
    }


def _packed_leaves(path):
    return sorted(p for p, m in ckpt.metadata(path).arrays.items() if m.packed)


def test_two_tiers_pack_small_leaves_like_a_direct_save(dirs):
    durable, local = dirs
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        mngr.save(1, _small_state(1))
        mngr.wait_until_finished()
    ckpt.save(os.path.join(os.path.dirname(durable), "direct", "1"), _small_state(1))
    assert _packed_leaves(f"{durable}/1") == _packed_leaves(os.path.join(os.path.dirname(durable), "direct", "1")) == ["big", "norm", "w"]
    for root in (f"{durable}/1", f"{local}/process-0/1"):
        assert os.path.isfile(f"{root}/packed/process-0/c/0") and os.path.isfile(f"{root}/packed/process-0/zarr.json"), root
    assert not os.path.exists(f"{durable}/1/arrays/w")
    assert ckpt.verify(f"{durable}/1").ok
    with open(f"{durable}/1/manifest.json") as f:
        manifest = json.load(f)
    assert "packed_processes" not in manifest and len(manifest["packed"]) == 1
    with open(f"{local}/process-0/1/manifest.json") as f:
        assert json.load(f)["packed_processes"] == [0]  # the local copy indexes its own pack
    _check(ckpt.restore(f"{durable}/1", dict(_target(), norm=None, big=None)), 1)
    with ckpt.CheckpointManager(durable, local_directory=local) as mngr:
        out = mngr.restore(None, dict(_target(), norm=None, big=None))
        _check(out, 1)
        np.testing.assert_array_equal(out["norm"], np.full(256, 1, np.float32))
        assert mngr.status().last_restore_source == "local"


@pytest.mark.parametrize("threshold, packed", [(2048, ["norm", "w"]), (0, [])])
def test_two_tiers_honour_pack_small_leaves_bytes(dirs, threshold, packed):
    durable, local = dirs
    with ckpt.CheckpointManager(durable, local_directory=local, pack_small_leaves_bytes=threshold) as mngr:
        mngr.save(1, _small_state(1))
        mngr.wait_until_finished()
        _check(mngr.restore(None, dict(_target(), norm=None, big=None)), 1)
    assert _packed_leaves(f"{durable}/1") == packed
    assert ckpt.verify(f"{durable}/1").ok


@contextlib.contextmanager
def _step_2_replication_held(dirs, monkeypatch):
    """A two-tier manager with steps 1 (durable) and 2 (committed locally, its replication
    held until the gate is set): yields (manager, gate)."""
    durable, local = dirs
    gate, real = threading.Event(), _tiers.replicate

    def held(target, *args, **kwargs):
        if target.step == 2:
            gate.wait()
        return real(target, *args, **kwargs)

    monkeypatch.setattr(_tiers, "replicate", held)
    with ckpt.CheckpointManager(durable, local_directory=local, keep_local=ckpt.KeepLatest(2)) as mngr:
        mngr.save(1, _state(1))
        mngr.wait_until_finished()
        mngr.save(2, _state(2))
        deadline = time.monotonic() + 60
        while 2 not in mngr._tiers.local_steps() and time.monotonic() < deadline:
            time.sleep(0.01)
        yield mngr, gate


def test_restoring_a_local_step_whose_replication_is_in_flight_does_not_replicate_it_twice(dirs, monkeypatch):
    with _step_2_replication_held(dirs, monkeypatch) as (mngr, gate):
        _check(mngr.restore(None, _target()), 2)  # e.g. a rollback in the training loop
        gate.set()
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2] and mngr.status().last_replication_error is None


def test_a_replication_committing_while_restore_none_starts_is_not_queued_again(dirs, monkeypatch):
    with _step_2_replication_held(dirs, monkeypatch) as (mngr, gate):
        listing, first = type(mngr).latest_step, mngr._tiers._jobs[2]

        def listed_then_replicated(self):
            newest = listing(self)  # the restore's listing: step 2 is not durable yet
            monkeypatch.undo()  # once
            gate.set()
            first.result(timeout=60)  # its replication commits (and is over) right after
            return newest

        monkeypatch.setattr(type(mngr), "latest_step", listed_then_replicated)
        _check(mngr.restore(None, _target()), 2)
        assert gate.is_set() and first.done()
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2] and mngr.status().last_replication_error is None
