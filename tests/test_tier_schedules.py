"""Local and durable on their own schedules (`durable_every_steps`, `durable_every_s`), each
tier with its own retention; and a full memory tier (a size-limited tmpfs)."""

import errno
import os
import subprocess
import threading

import numpy as np
import pytest

import checkpointer as ckpt
from checkpointer._manage._peers import PeerService, step_files
from checkpointer._manage._tier_manager import LocalTier


def _tree(step, n=12):
    return {"w": np.arange(n, dtype=np.float32) + step, "step": step}


def test_by_default_every_local_step_is_replicated_as_before(tmp_path):
    with ckpt.CheckpointManager(str(tmp_path / "d"), local_directory=str(tmp_path / "l"), async_save=False) as m:
        for step in (1, 2, 3):
            m.save(step, _tree(step))
        assert m.all_steps() == [1, 2, 3] and m._tiers.local_steps() == [3]


def test_local_saves_every_step_durable_every_third_and_the_newest_local_only_step_is_never_dropped(tmp_path):
    with ckpt.CheckpointManager(str(tmp_path / "d"), local_directory=str(tmp_path / "l"), async_save=False,
                                keep=ckpt.KeepLatest(5), keep_local=ckpt.KeepLatest(1), durable_every_steps=3) as m:
        for step in range(1, 8):
            m.save(step, _tree(step))
            # The local window of one step holds the newest step, durable or not.
            assert m._tiers.local_steps() == [step]
        assert m.all_steps() == [3, 6]
        assert m.restore(None)["step"] == 7 and m.status().last_restore_source == "local"
    with pytest.raises(ValueError, match="durable_every_steps"):
        ckpt.CheckpointManager(str(tmp_path / "e"), local_directory=str(tmp_path / "l2"), durable_every_steps=0)
    with pytest.raises(ValueError, match="peer_copies needs local_directory"):
        ckpt.CheckpointManager(str(tmp_path / "e"), peer_copies=1)


def test_a_durable_schedule_in_seconds_replicates_the_first_step_and_then_waits(tmp_path):
    with ckpt.CheckpointManager(str(tmp_path / "d"), local_directory=str(tmp_path / "l"), async_save=False,
                                durable_every_s=3600) as m:
        for step in (1, 2, 3):
            m.save(step, _tree(step))
        assert m.all_steps() == [1] and m._tiers.local_steps() == [3]
        m.save(4, _tree(4), force=True)  # force (and preemption) always go durable
        assert m.all_steps() == [1, 4]


def test_a_forced_durable_save_restarts_the_durable_clock(tmp_path, monkeypatch):
    import checkpointer._manage._time_policies as time_policies

    now = [1_000_000.0]
    monkeypatch.setattr(time_policies.time, "time", lambda: now[0])
    with ckpt.CheckpointManager(str(tmp_path / "d"), local_directory=str(tmp_path / "l"), async_save=False,
                                durable_every_s=100) as m:
        m.save(1, _tree(1))  # the first step goes durable; the clock counts from it
        now[0] += 60
        m.save(2, _tree(2), force=True)  # durable off the schedule: the clock counts from here
        now[0] += 60  # 120 s after step 1, 60 s after the forced step 2
        m.save(3, _tree(3))
        assert m.all_steps() == [1, 2]
        now[0] += 50  # 110 s after step 2
        m.save(4, _tree(4))
        assert m.all_steps() == [1, 2, 4]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (never the machine's /dev/shm); skipped where mounting is not allowed."""
    where = tmp_path / "shm"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_memory_tier_fails_the_save_clearly_and_loses_nothing_older(tmp_path, small_tmpfs):
    with ckpt.CheckpointManager(str(tmp_path / "d"), local_directory=small_tmpfs, async_save=False,
                                durable_every_steps=100) as m:
        m.save(1, _tree(1))  # small: fits
        with pytest.raises(ckpt.CheckpointError, match="No space left on device"):
            m.save(2, _tree(2, n=1 << 19))  # 2 MiB: does not
        assert m._tiers.local_steps() == [1]
        assert not [n for n in os.listdir(m._tiers.root) if n.startswith("2")]  # no partial left
        assert m.restore(None)["step"] == 1 and m.status().last_restore_source == "local"


def test_a_holder_whose_memory_tier_is_full_refuses_the_copy_and_keeps_the_older_one(tmp_path, small_tmpfs):
    holder = PeerService(f"{small_tmpfs}/process-1", str(tmp_path / "dir"), copies=1, node="b", timeout_s=30)
    owner = PeerService(str(tmp_path / "process-0"), str(tmp_path / "dir"), copies=1, node="a", timeout_s=30)
    owner._addresses[1] = holder._address  # owner (process 0 here) sends to the holder's server
    try:
        ckpt.save(str(tmp_path / "process-0" / "1"), _tree(1))
        owner._put(1, 1, "g1", step_files(f"{tmp_path}/process-0/1"), [1])
        noise = np.random.default_rng(0).standard_normal((1200 << 10) // 4).astype(np.float32)  # 1.2 MiB > the tmpfs
        ckpt.save(str(tmp_path / "process-0" / "2"), {"w": noise, "step": 2})
        with pytest.raises(ckpt.CheckpointError, match=os.strerror(errno.ENOSPC)):
            owner._put(1, 2, "g2", step_files(f"{tmp_path}/process-0/2"), [1, 2])
        held = holder.held(0)
        assert held.steps() == [1] and held.generation(1) is not None
        assert sorted(os.listdir(held.root)) == ["1"]  # the partial copy is gone, the older one kept
    finally:
        owner.close()
        holder.close()


def test_while_durable_saves_fail_the_local_window_holds_the_newest_step_and_the_error_surfaces(tmp_path, monkeypatch):
    durable = str(tmp_path / "d")
    with ckpt.CheckpointManager(durable, local_directory=str(tmp_path / "l"), async_save=False,
                                keep_local=ckpt.KeepLatest(1), durable_every_steps=2) as m:
        m.save(0, _tree(0))
        with monkeypatch.context() as patch:
            _fail_durable_data_writes(patch, durable)
            for step in range(1, 8):  # the durable saves of 2, 4, 6 fail, and say so
                if step % 2:
                    m.save(step, _tree(step))
                else:
                    with pytest.raises(ckpt.CheckpointError, match="No space left"):
                        m.save(step, _tree(step))
            # A local tier sized for keep_local (docs/tiers_and_peers.md) is not filled by
            # failed durable saves: each newer local step supersedes the older ones.
            assert m._tiers.local_steps() == [7] and m.all_steps() == [0]
            assert "step 6" in m.status().last_replication_error
        # The durable tier is back: a restart resumes from the newest local step and replicates it.
        assert m.restore(None)["step"] == 7 and m.status().last_restore_source == "local"
        m.wait_until_finished()
        assert m.all_steps() == [0, 7] and m._tiers.local_steps() == [7]


def _fail_durable_data_writes(monkeypatch, durable):
    from checkpointer._storage import _local

    real_write = _local.LocalStorage.write_file

    def write_file(self, path, data):
        if path.startswith(durable + "/") and ("/arrays/" in path or "/packed/" in path):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write(self, path, data)

    monkeypatch.setattr(_local.LocalStorage, "write_file", write_file)


def test_keep_local_refuses_a_policy_by_metric_that_it_could_not_apply(tmp_path):
    for policy in (ckpt.KeepBest("loss", n=2), ckpt.KeepLatest(1) | ckpt.KeepBest("loss")):
        with pytest.raises(TypeError, match="keep_local must be a retention policy by step"):
            ckpt.CheckpointManager(str(tmp_path / "d"), local_directory=str(tmp_path / "l"), keep_local=policy)
    with ckpt.CheckpointManager(str(tmp_path / "d"), local_directory=str(tmp_path / "l"), async_save=False,
                                keep_local=ckpt.KeepEvery(2) | ckpt.KeepLatest(1), durable_every_steps=3) as m:
        for step in range(1, 6):
            m.save(step, _tree(step))
        assert m._tiers.local_steps() == [2, 4, 5]  # by step: kept whether durable (3) or not


def test_a_local_commit_during_restore_does_not_remove_the_local_only_step_being_read(tmp_path, monkeypatch, caplog):
    commit, blocked, done = threading.Event(), threading.Event(), threading.Event()
    run_local, apply, read = LocalTier.run_local, LocalTier.apply_retention, LocalTier._read_local_only

    def held_commit(self, snap, *args):
        if snap.step == 2:
            commit.wait()
        return run_local(self, snap, *args)

    def noted_retention(self):
        if self._retention_mu.acquire(blocking=False):  # nobody holds the tier's retention lock
            self._retention_mu.release()
        else:
            blocked.set()
        apply(self)
        done.set()

    def read_while_committing(self, step, *args):
        if step == 1 and not commit.is_set():
            commit.set()  # step 2's local commit and its retention run now
            while not (blocked.is_set() or done.is_set()):
                blocked.wait(0.01)
        return read(self, step, *args)

    with ckpt.CheckpointManager(str(tmp_path / "d"), local_directory=str(tmp_path / "l"),
                                keep_local=ckpt.KeepLatest(1), durable_every_steps=100) as m:
        m.save(0, _tree(0))
        m.save(1, _tree(1))
        m.wait_until_finished()
        monkeypatch.setattr(LocalTier, "run_local", held_commit)
        monkeypatch.setattr(LocalTier, "apply_retention", noted_retention)
        monkeypatch.setattr(LocalTier, "_read_local_only", read_while_committing)
        m.save(2, _tree(2))  # returns after the snapshot; its local commit waits for the restore's read
        assert m.restore(None)["step"] == 1 and m.status().last_restore_source == "local"
        assert "damaged" not in caplog.text  # (with more processes, their votes then differ: the durable step)
        m.wait_until_finished()
        assert m._tiers.local_steps()[-1] == 2
