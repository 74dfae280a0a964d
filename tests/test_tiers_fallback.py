"""Two tiers, a damaged local-only step (issue 22 item 6): `restore(step=None)` falls back
to the newest intact step, agreed through the restore vote, with a warning naming the
damaged copy; errors name the copy they read (the local path, the process)."""

import errno
import os

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._storage import _local as _storage

pytestmark = pytest.mark.usefixtures("unpacked_layout")  # damages a per-leaf chunk file


def _state(step):
    mesh = make_mesh((2, 4), ("a", "b"))
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step
    return {"w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))), "step": step}


def _target():
    return {"w": NamedSharding(make_mesh((2, 4), ("a", "b")), P("a", "b")), "step": None}


def _fail_durable_chunk_writes(monkeypatch, durable):
    real_write = _storage.LocalStorage.write_file

    def write_file(self, path, data):
        if path.startswith(durable + "/") and "/arrays/" in path:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write(self, path, data)

    monkeypatch.setattr(_storage.LocalStorage, "write_file", write_file)


def _save(durable, local, durable_steps, local_only_steps, monkeypatch):
    """Saves `durable_steps` on both tiers, then `local_only_steps` whose replication fails."""
    mgr = ckpt.CheckpointManager(durable, local_directory=local, keep_local=ckpt.KeepLatest(5))
    for step in durable_steps:
        mgr.save(step, _state(step))
    mgr.wait_until_finished()
    with monkeypatch.context() as m:
        _fail_durable_chunk_writes(m, durable)
        for step in local_only_steps:
            mgr.save(step, _state(step))
            with pytest.raises(ckpt.CheckpointError, match="No space left"):
                mgr.wait_until_finished()
        mgr.close()


def _damage(local, step):
    with open(f"{local}/process-0/{step}/arrays/w/c/0/0", "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)


@pytest.fixture
def dirs(tmp_path):
    return str(tmp_path / "durable"), str(tmp_path / "local")


def test_a_damaged_local_only_step_falls_back_to_the_newest_durable_step_with_a_warning(dirs, monkeypatch, caplog):
    durable, local = dirs
    _save(durable, local, [1], [2], monkeypatch)
    _damage(local, 2)
    with caplog.at_level("WARNING", logger="checkpointer"), \
            ckpt.CheckpointManager(durable, local_directory=local) as mgr:
        got = mgr.restore(None, _target())
        for _ in range(2):  # every restart, the same answer
            assert mgr.restore(None, _target())["step"] == 1
    assert got["step"] == 1
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(_state(1)["w"]))
    assert f"the local copy {local}/process-0/2 of step 2 (process 0, not on {durable}) is damaged" in caplog.text


def test_a_damaged_local_only_step_falls_back_to_an_older_intact_local_only_step(dirs, monkeypatch):
    durable, local = dirs
    _save(durable, local, [1], [2, 3], monkeypatch)
    _damage(local, 3)
    with ckpt.CheckpointManager(durable, local_directory=local) as mgr:
        got = mgr.restore(None, _target())
        assert got["step"] == 2 and mgr.status().last_restore_source == "local"
        mgr.wait_until_finished()  # its replication resumed
        assert mgr.all_steps() == [1, 2]


def test_with_no_intact_step_the_error_names_the_damaged_local_copy_and_the_process(dirs, monkeypatch):
    durable, local = dirs
    _save(durable, local, [], [1], monkeypatch)
    _damage(local, 1)
    with ckpt.CheckpointManager(durable, local_directory=local) as mgr:
        with pytest.raises(ckpt.CorruptCheckpointError) as info:
            mgr.restore(None, _target())
    message = str(info.value)
    assert f"{local}/process-0/1" in message and "process 0" in message, message
    assert f"verify {durable}/1" not in message, message  # no step 1 exists there


@pytest.mark.multiprocess
def test_two_processes_agree_to_skip_a_local_only_step_damaged_on_process_1_only(tmp_path):
    import glob
    import shutil

    from multiprocess import WORKERS, describe_all, run_processes

    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    args = {"directory": durable, "local": local, "phase": "save"}
    for r in run_processes(WORKERS / "tiers_fallback_worker.py", 2, 4, args, timeout_s=300):
        assert r.record("saved")["all_steps"] == [1, 2], r.describe()
    shutil.rmtree(f"{durable}/2")  # step 2 never became durable: local-only on both processes
    chunk = sorted(glob.glob(f"{local}/process-1/2/arrays/w/c/**/*", recursive=True))
    chunk = [c for c in chunk if os.path.isfile(c)][0]
    with open(chunk, "r+b") as f:  # process 1's copy only
        f.seek(64)
        f.write(b"\xff" * 16)
    results = run_processes(WORKERS / "tiers_fallback_worker.py", 2, 4, dict(args, phase="restore"), timeout_s=300)
    info = describe_all(results)
    got = [r.record("restored") for r in results]
    assert [g["step"] for g in got] == [1, 1] and all(g["exact"] for g in got), info  # the same step on both
    assert f"{local}/process-1/2" in info and "is damaged" in info, info  # the warning names the copy


def test_the_reason_for_falling_back_names_the_damaged_local_copy_not_a_folder_gone_since(dirs, monkeypatch):
    durable, local = dirs
    _save(durable, local, [1], [2], monkeypatch)
    _damage(local, 2)
    with ckpt.CheckpointManager(durable, local_directory=local) as mgr:
        assert mgr.restore(None, _target())["step"] == 1
        reason = mgr.status().last_restore_reason
    assert reason.startswith("the newest durable step 1 was restored: step 2") and "crc32c mismatch" in reason, reason
    assert f"{local}/process-0/2" in reason and f"{local}/restart-" not in reason, reason
