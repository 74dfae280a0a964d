"""CheckpointManager and save_async: committed steps only, retention, errors that surface."""

import concurrent.futures
import errno
import logging
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer import _storage
from checkpointer._commit import _directory
from checkpointer._save import _pipeline as _save


def _state(value=0.0):
    mesh = make_mesh((2, 4), ("data", "model"))
    return {
        "w": jax.device_put(jnp.full((8, 16), value, jnp.float32), NamedSharding(mesh, P("data", "model"))),
        "b": jax.device_put(jnp.full((16,), value, jnp.float32), NamedSharding(mesh, P())),
    }


def test_save_async_snapshot_survives_donation_and_deletion(ckpt_dir):
    state = _state(1.0)
    expected = np.asarray(state["w"]).copy()
    handle = ckpt.save_async(f"{ckpt_dir}/1", state)
    # The caller may donate or delete the arrays as soon as save_async returns.
    donate = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x * 0 + 7, s), donate_argnums=0)
    new_state = donate(state)
    assert state["w"].is_deleted()
    handle.wait()
    assert handle.done()
    np.testing.assert_array_equal(ckpt.restore(f"{ckpt_dir}/1")["w"], expected)
    assert float(new_state["w"][0, 0]) == 7.0


def test_save_async_background_error_surfaces_in_wait(ckpt_dir, monkeypatch):
    ckpt.save(f"{ckpt_dir}/0", _state(0.5))

    write_file = _storage.LocalStorage.write_file

    def disk_full(self, path, data):
        if path.endswith("processes/0.json"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return write_file(self, path, data)

    # The chunks and the pack's zarr.json are written, then the per-process record hits a full disk.
    monkeypatch.setattr(_storage.LocalStorage, "write_file", disk_full)
    handle = ckpt.save_async(f"{ckpt_dir}/1", _state())
    with pytest.raises(ckpt.SaveError, match=r"No space left on device.*processes/0.json") as e:
        handle.wait()
    assert isinstance(e.value, OSError) and "(process 0)" in str(e.value)
    assert sorted(os.listdir(ckpt_dir)) == ["0"]  # partial folder removed, step 0 intact
    monkeypatch.undo()
    assert float(ckpt.restore(f"{ckpt_dir}/0")["w"][0, 0]) == 0.5


def test_save_async_join_waits_without_raising(ckpt_dir, monkeypatch):
    release = threading.Event()

    def blocked_then_broken(snap):
        release.wait(30)
        raise ckpt.SaveError("boom")

    monkeypatch.setattr(_save, "write_snapshot", blocked_then_broken)
    handle = ckpt.save_async(f"{ckpt_dir}/1", _state())
    assert handle.join(timeout=0) is False and not handle.done()
    release.set()
    assert handle.join() is True and handle.done()  # finished; the error is kept, not raised
    assert isinstance(handle.error, ckpt.SaveError)
    with pytest.raises(ckpt.SaveError, match="boom"):
        handle.wait()


def test_save_async_returns_a_concurrent_future_resolved_at_the_commit(ckpt_dir, monkeypatch):
    """Issue 25 item 4: the handle is a concurrent.futures.Future (as torch's async_save
    returns), keeping wait() and error."""
    handle = ckpt.save_async(f"{ckpt_dir}/1", _state(2.0))
    assert isinstance(handle, concurrent.futures.Future)
    seen = []
    handle.add_done_callback(lambda f: seen.append(f.result()))
    assert handle.cancel() is False  # a save in flight is not cancelled
    assert handle.result(timeout=60) == f"{ckpt_dir}/1" and handle.exception() is None and handle.error is None
    assert seen == [f"{ckpt_dir}/1"] and handle.done() and not handle.cancelled()
    assert float(ckpt.restore(f"{ckpt_dir}/1")["w"][0, 0]) == 2.0
    handle.wait()  # still there

    release = threading.Event()

    def blocked_then_broken(snap):
        release.wait(30)
        raise ckpt.SaveError("boom")

    monkeypatch.setattr(_save, "write_snapshot", blocked_then_broken)
    failing = ckpt.save_async(f"{ckpt_dir}/2", _state())
    with pytest.raises(TimeoutError):
        failing.result(timeout=0.01)
    release.set()
    done, _ = concurrent.futures.wait([failing, handle], timeout=60)
    assert done == {failing, handle}
    assert isinstance(failing.exception(), ckpt.SaveError) and failing.exception() is failing.error
    with pytest.raises(ckpt.SaveError, match="boom"):
        failing.result()
    later = []
    failing.add_done_callback(later.append)  # called at once when already resolved
    assert later == [failing]


def test_wait_and_join_inside_a_done_callback_on_the_save_thread(ckpt_dir, monkeypatch):
    """A done-callback runs on the save thread: wait() there raised "RuntimeError: cannot
    join current thread" (the thread joined itself)."""
    seen = []

    def callback(f):
        try:
            seen.append((f.join(), f.wait(), f.result()))
        except BaseException as e:  # noqa: BLE001 (recorded for the assert below)
            seen.append(e)

    release, write = threading.Event(), _save.write_snapshot

    def held(snap):
        release.wait(30)
        return write(snap)

    monkeypatch.setattr(_save, "write_snapshot", held)
    handle = ckpt.save_async(f"{ckpt_dir}/1", _state(2.0))
    handle.add_done_callback(callback)  # before the save ends: called on its thread
    release.set()
    handle.wait()
    assert handle.join() and seen == [(True, None, f"{ckpt_dir}/1")]


def test_manager_lists_committed_steps_only(ckpt_dir):
    with ckpt.CheckpointManager(ckpt_dir, keep=ckpt.KeepLatest(10)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3] and mgr.latest_step() == 3
    # A crashed save of step 4 (partial folder) and a folder without marker are not steps.
    os.makedirs(f"{ckpt_dir}/4.partial-20260101000000-deadbeef/arrays")
    os.makedirs(f"{ckpt_dir}/5")
    mgr = ckpt.CheckpointManager(ckpt_dir, keep=ckpt.KeepLatest(10))
    assert mgr.latest_step() == 3
    # Opening is reading: the crashed partial folder stays until the first write or recover().
    assert os.path.exists(f"{ckpt_dir}/4.partial-20260101000000-deadbeef")
    assert mgr.recover() == ["4.partial-20260101000000-deadbeef"]
    assert not os.path.exists(f"{ckpt_dir}/4.partial-20260101000000-deadbeef")
    restored = mgr.restore(None, target=_state())
    assert float(restored["w"][0, 0]) == 3.0
    mgr.close()


def test_save_interval_and_force(ckpt_dir):
    with ckpt.CheckpointManager(ckpt_dir, save_interval_steps=5, keep=ckpt.KeepLatest(10)) as mgr:
        saved = [s for s in range(12) if mgr.save(s, _state(s))]
        assert saved == [0, 5, 10]
        assert mgr.save(7, _state(7), force=True)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 5, 7, 10]
        with pytest.raises(ckpt.CheckpointExistsError, match="force=True"):
            mgr.save(5, _state(55))
        mgr.save(5, _state(55), force=True)
        mgr.wait_until_finished()
        assert float(mgr.restore(5, target=_state())["w"][0, 0]) == 55.0


def test_retention_policies_delete_only_after_commit(ckpt_dir):
    keep = ckpt.KeepLatest(2) | ckpt.KeepEvery(4) | ckpt.KeepBest("loss", mode="min", n=1)
    losses = {1: 5.0, 2: 0.5, 3: 4.0, 4: 3.0, 5: 2.0, 6: 1.0, 7: 1.5}
    with ckpt.CheckpointManager(ckpt_dir, keep=keep) as mgr:
        for step, loss in losses.items():
            mgr.save(step, _state(step), metrics={"loss": loss})
        mgr.wait_until_finished()
        # latest two (6, 7), every 4th (4), best loss (2)
        assert mgr.all_steps() == [2, 4, 6, 7]
    # Besides the steps: the writer's lock and the save journal (`checkpointer timeline`).
    assert sorted(os.listdir(ckpt_dir)) == [".checkpointer-journal.jsonl", ".checkpointer.lock", "2", "4", "6", "7"]


def test_keep_steps_and_newest_always_kept(ckpt_dir):
    with ckpt.CheckpointManager(ckpt_dir, keep=ckpt.KeepSteps([1]), async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
            assert mgr.latest_step() == step  # sync: committed on return
        assert mgr.all_steps() == [1, 3]


def test_background_error_raises_from_next_save_and_status(ckpt_dir, monkeypatch):
    real = _save.write_snapshot
    mgr = ckpt.CheckpointManager(ckpt_dir, keep=ckpt.KeepLatest(5))
    mgr.save(1, _state(1))
    mgr.wait_until_finished()

    def broken(snap):
        raise ckpt.SaveError(f"permission denied writing {snap.write_path} (process 0)")

    monkeypatch.setattr(_save, "write_snapshot", broken)
    mgr.save(2, _state(2))
    mgr._in_flight[-1][1].join()
    status = mgr.status()
    assert "permission denied" in status.last_error and status.latest_committed_step == 1
    assert status.commit_lag_steps == 1
    with pytest.raises(ckpt.SaveError, match="permission denied"):
        mgr.save(3, _state(3))
    monkeypatch.setattr(_save, "write_snapshot", real)
    assert mgr.save(3, _state(3))
    mgr.wait_until_finished()
    assert mgr.all_steps() == [1, 3]  # step 1 survived the failure
    mgr.close()


def test_error_raises_from_wait_until_finished_and_close(ckpt_dir, monkeypatch):
    monkeypatch.setattr(_save, "write_snapshot", lambda snap: (_ for _ in ()).throw(ckpt.SaveError("boom")))
    mgr = ckpt.CheckpointManager(ckpt_dir)
    mgr.save(1, _state())
    with pytest.raises(ckpt.SaveError, match="boom"):
        mgr.wait_until_finished()
    mgr.save(2, _state())
    with pytest.raises(ckpt.SaveError, match="boom"):
        mgr.close()


def test_one_save_in_flight_bounds_host_memory(ckpt_dir, monkeypatch):
    release = threading.Event()
    real = _save.write_snapshot
    started = []

    def slow(snap):
        started.append(snap.step)
        release.wait(30)
        return real(snap)

    monkeypatch.setattr(_save, "write_snapshot", slow)
    mgr = ckpt.CheckpointManager(ckpt_dir)
    mgr.save(1, _state(1))
    assert mgr.status().step_in_flight == 1
    t = threading.Thread(target=mgr.save, args=(2, _state(2)))
    t.start()
    t.join(0.5)
    assert t.is_alive()  # waits for step 1 to finish
    release.set()
    t.join(30)
    mgr.wait_until_finished()
    assert mgr.status().last_wait_s > 0.3
    assert mgr.all_steps() == [1, 2]
    mgr.close()


def test_second_writer_on_same_directory_fails_clearly(ckpt_dir):
    mgr = ckpt.CheckpointManager(ckpt_dir)
    mgr.recover()  # the first write or delete takes the writer's lock
    other = ckpt.CheckpointManager(ckpt_dir)  # opening (reading) needs no lock
    assert other.all_steps() == []
    with pytest.raises(ckpt.CheckpointError, match=r"another CheckpointManager in this same process \(pid \d+\)"):
        other.save(1, _state(1))
    mgr.close()
    other.save(1, _state(1))  # free again once closed
    other.close()


def test_status_and_logging(ckpt_dir, caplog):
    caplog.set_level(logging.INFO, logger="checkpointer")
    with ckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.status().latest_committed_step is None
        mgr.save(10, _state())
        mgr.wait_until_finished()
        st = mgr.status()
    assert st.latest_committed_step == 10 and st.step_in_flight is None and st.commit_lag_steps == 0
    assert st.last_snapshot_s > 0 and st.last_write_s > 0 and st.last_commit_s >= st.last_write_s
    lines = [r.getMessage() for r in caplog.records if "saved" in r.getMessage()]
    assert len(lines) == 1 and "snapshot" in lines[0] and "commit" in lines[0]


def test_recommend_interval_young_daly(ckpt_dir):
    with ckpt.CheckpointManager(ckpt_dir) as mgr:
        with pytest.raises(ValueError, match="no save measured"):
            mgr.recommend_interval(3600)
        mgr.save(1, _state())
        mgr.wait_until_finished()
        delta = mgr.status().last_snapshot_s
        commit = mgr.status().last_commit_s
        assert mgr.recommend_interval(3600.0) == pytest.approx(max((2 * delta * 3600.0) ** 0.5, commit))
        assert mgr.recommend_interval(1e-9) == pytest.approx(commit)  # never shorter than a commit


def test_restore_without_committed_step_raises(ckpt_dir):
    with ckpt.CheckpointManager(ckpt_dir) as mgr:
        with pytest.raises(ckpt.CheckpointNotFoundError, match="no committed step"):
            mgr.restore()


def test_roll_forward_of_committed_but_unrenamed_partial(ckpt_dir):
    ckpt.save(f"{ckpt_dir}/3", _state(3))
    os.rename(f"{ckpt_dir}/3", f"{ckpt_dir}/3.partial-20260101000000-cafef00d")
    partial = "3.partial-20260101000000-cafef00d"
    with ckpt.CheckpointManager(ckpt_dir) as mgr:
        # The marker is the truth: readers list step 3 and read it from the partial
        # folder, renaming nothing.
        assert mgr.all_steps() == [3] and mgr.latest_step() == 3
        assert float(mgr.restore(target=_state())["w"][0, 0]) == 3.0
        assert sorted(os.listdir(ckpt_dir)) == [partial]
        assert mgr.recover() == [partial]  # the writer's recovery renames it into place
        assert mgr.all_steps() == [3] and os.path.isdir(f"{ckpt_dir}/3")
        assert float(mgr.restore(target=_state())["w"][0, 0]) == 3.0


def test_resume_from_a_committed_but_unrenamed_step_needs_no_recover_call(ckpt_dir):
    ckpt.save(f"{ckpt_dir}/3", _state(3))
    os.rename(f"{ckpt_dir}/3", f"{ckpt_dir}/3.partial-20260101000000-cafef00d")
    with ckpt.CheckpointManager(ckpt_dir) as mgr:
        start = mgr.latest_step() + 1  # a resuming job, as the README writes it
        mgr.save(start, _state(start))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]
    assert sorted(n for n in os.listdir(ckpt_dir) if not n.startswith(".")) == ["3", "4"]


def _sharded_tree(value=1.0):
    mesh = make_mesh((2, 4), ("data", "model"))
    return {"w": jax.device_put(np.full((16, 8), value, np.float32), NamedSharding(mesh, P("data", "model")))}


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
    handle = ckpt.save_async(str(d / "3"), _sharded_tree(3.0))
    assert reached.wait(30)
    assert _directory.recover(*_storage.storage_for(str(d))) == []  # the live save is skipped
    release.set()
    handle.wait()
    assert ckpt.verify(str(d / "3")).ok
    assert sorted(os.listdir(d)) == ["3"]  # the lock file went with the save


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


def test_a_committed_partial_whose_save_holds_its_lock_is_not_listed_until_renamed(ckpt_dir):
    # Between its marker and its rename a save still holds `<partial>.lock`: a follower
    # must not start reading a folder that is about to move (it would see the step
    # vanish mid-read). Once the lock is gone (a crash), the marker makes it a step.
    from checkpointer import _storage

    ckpt.save(f"{ckpt_dir}/3", _state(3))
    partial = f"{ckpt_dir}/3.partial-20260101000000-cafef00d"
    os.rename(f"{ckpt_dir}/3", partial)
    lock = _storage.LocalStorage().lock(partial + ".lock")
    reader = ckpt.CheckpointManager(ckpt_dir, read_only=True)
    try:
        assert reader.all_steps() == []
    finally:
        lock.release(remove=True)
    assert reader.all_steps() == [3]


def test_keep_best_keeps_the_step_best_step_names_with_infinite_and_bool_metrics(ckpt_dir):
    """A loss of -inf is stored as "-Infinity": KeepBest deleted that step while
    best_step ranked it first; a bool metric the reverse."""
    with ckpt.CheckpointManager(ckpt_dir, keep=ckpt.KeepBest("loss", n=1)) as mgr:
        for step, loss in [(1, 1.0), (2, float("-inf")), (3, 0.5), (4, True), (5, 0.9)]:
            mgr.save(step, _state(step), metrics={"loss": loss})
            mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 5] and mgr.best_step("loss") == 2


def test_a_done_callback_runs_even_when_the_caller_keeps_no_handle(ckpt_dir, monkeypatch):
    """`save_async(...).add_done_callback(fn)`: the save thread held its handle only weakly,
    so a handle nobody kept was collected with its callbacks and `fn` never ran (any
    concurrent.futures executor keeps its futures until resolved)."""
    import gc

    release, write = threading.Event(), _save.write_snapshot

    def held(snap):
        release.wait(30)
        return write(snap)

    monkeypatch.setattr(_save, "write_snapshot", held)
    seen = threading.Event()
    got = []
    ckpt.save_async(f"{ckpt_dir}/1", _state(3.0)).add_done_callback(lambda f: (got.append(f.result()), seen.set()))
    gc.collect()
    release.set()
    assert seen.wait(60) and got == [f"{ckpt_dir}/1"]


def test_a_save_below_committed_steps_warns_once_that_a_restart_would_resume_from_them(tmp_path, caplog):
    # After a rewind (restore an older step, train on), restore(None) still picks the newest
    # committed step by number: the save says so, once per newer step, naming the steps.
    with ckpt.CheckpointManager(str(tmp_path), async_save=False) as m:
        for step in (100, 110, 120):
            m.save(step, {"w": np.full(4, step, np.float32)})
        assert not [r for r in caplog.records if "rewind" in r.getMessage()]
        with caplog.at_level(logging.WARNING, logger="checkpointer"):
            m.save(105, {"w": np.full(4, 105, np.float32)})
            m.save(110, {"w": np.full(4, 1110, np.float32)}, force=True)
        warned = [r.getMessage() for r in caplog.records if "rewind" in r.getMessage()]
        assert len(warned) == 1, warned
        assert "step 105" in warned[0] and "110, 120" in warned[0] and "resumes from step 120" in warned[0]
        assert "CheckpointManager.delete" in warned[0] and str(tmp_path) in warned[0]
        m.delete(120)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="checkpointer"):
            m.save(115, {"w": np.full(4, 115, np.float32)})  # 110 is this run's own (forced): nothing newer
        assert not [r for r in caplog.records if "rewind" in r.getMessage()]
        assert m.restore(None)["w"][0] == 115
