"""Behaviours a hostile review found broken; each test fails on the code before its fix."""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import checkpointer as ckpt
from checkpointer import _directory, _restore, _storage
from conftest import make_mesh


def _tree(value=1.0):
    mesh = make_mesh((2, 4), ("data", "model"))
    return {"w": jax.device_put(np.full((16, 8), value, np.float32), NamedSharding(mesh, P("data", "model")))}


def test_save_never_replaces_a_folder_that_is_not_a_checkpoint(tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "notes.txt").write_text("notes")
    for overwrite in (False, True):
        with pytest.raises(ckpt.CheckpointExistsError, match=r"not part of a checkpoint.*notes.txt|src"):
            ckpt.save(str(project), _tree(), overwrite=overwrite)
    assert (project / "notes.txt").read_text() == "notes" and (project / "src").is_dir()
    # A manager's run directory is not a checkpoint either.
    with ckpt.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, _tree())
    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.save(str(tmp_path / "run"), _tree())
    assert (tmp_path / "run" / "1" / "COMMITTED").exists()


def test_save_never_clears_a_foreign_object_store_prefix():
    ckpt.save("memory://review/exp/run1/1", {"w": np.ones(3)})
    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.save("memory://review/exp", {"w": np.ones(3)})
    assert ckpt.metadata("memory://review/exp/run1/1").step == 1


def test_recovery_leaves_a_plain_save_in_flight_alone(tmp_path, monkeypatch):
    """gc (or a manager opening the directory) while ckpt.save_async writes must not
    remove the partial folder: its process 0 holds <partial>.lock."""
    d = tmp_path / "run"
    release, reached = threading.Event(), threading.Event()
    real = _storage.LocalStorage.write_file

    def slow_record(self, path, data):
        if path.endswith("processes/0.json"):
            reached.set()
            release.wait(30)
        real(self, path, data)

    monkeypatch.setattr(_storage.LocalStorage, "write_file", slow_record)
    handle = ckpt.save_async(str(d / "3"), _tree(3.0))
    assert reached.wait(30)
    assert _directory.recover(*_storage.storage_for(str(d))) == []  # the live save is skipped
    release.set()
    handle.wait()
    assert ckpt.verify(str(d / "3")).ok
    assert sorted(os.listdir(d)) == ["3"]  # the lock file went with the save


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


def test_last_async_save_commits_even_if_the_program_just_exits(tmp_path):
    code = textwrap.dedent(
        f"""
        import numpy as np, checkpointer as ckpt
        mgr = ckpt.CheckpointManager({str(tmp_path / "run")!r})
        mgr.save(1, {{"w": np.ones((256, 256), np.float32)}})
        mgr.save(2, {{"w": np.full((256, 256), 2, np.float32)}})
        # no wait_until_finished(), no close()
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "run" / "2" / "COMMITTED").exists()


def test_retention_of_a_symlinked_step_removes_the_link_only(tmp_path):
    archive = tmp_path / "archive" / "50"
    ckpt.save(str(archive), {"w": np.ones(3)})
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(archive, run / "50")
    with ckpt.CheckpointManager(run, keep=ckpt.KeepLatest(1), async_save=False) as mgr:
        mgr.save(60, {"w": np.ones(3)})
    assert ckpt.metadata(str(archive)).step == 50  # the archived checkpoint is intact
    with ckpt.CheckpointManager(run) as mgr:  # and the directory still opens
        assert mgr.all_steps() == [60]


def test_scalar_and_memory_kind_targets(tmp_path):
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("data")))
    ckpt.save(str(tmp_path / "1"), {"x": x, "step": jax.numpy.int32(5)})
    target = {"x": NamedSharding(mesh, P("data"), memory_kind="pinned_host"), "step": 0}  # a fresh TrainState's step
    out = ckpt.restore(str(tmp_path / "1"), target)
    assert out["x"].sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x))
    assert int(out["step"]) == 5
    with pytest.raises(ckpt.InvalidTargetError, match="leaf 'step'"):
        ckpt.restore(str(tmp_path / "1"), {"x": None, "step": "zero"})


def test_manager_accepts_numpy_steps_and_non_finite_metrics(tmp_path):
    with ckpt.CheckpointManager(tmp_path, keep=ckpt.KeepBest("loss", n=1), async_save=False) as mgr:
        mgr.save(np.int64(1), {"w": np.ones(2)}, metrics={"loss": np.float32(0.5)})
        mgr.save(jax.numpy.int32(2), {"w": np.ones(2)}, metrics={"loss": float("nan")})  # diverged
        assert mgr.all_steps() == [1, 2]  # best (1) and newest (2)
        assert ckpt.metadata(str(tmp_path / "2")).user_metadata["metrics"] == {"loss": "NaN"}
    with pytest.raises(TypeError, match="KeepLatest"):
        ckpt.CheckpointManager(tmp_path / "x", keep=2)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        ckpt.restore(str(tmp_path / "1"), max_inflight_bytes=0)


def test_folders_with_non_ascii_digits_are_not_steps(tmp_path):
    (tmp_path / "²").mkdir()
    (tmp_path / "٣").mkdir()
    with ckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == []
