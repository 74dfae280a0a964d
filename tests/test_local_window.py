"""The local window without peer copies (issue 29 item 2): with a durable schedule, a
process drops an older local-only step (newer than the newest durable one) only once
every process has committed the newer local step (`_manage/_local_commits.py`)."""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from multiprocess import WORKERS, run_processes

import checkpointer as ckpt
from checkpointer._manage import _local_commits


class _KeyValues:
    """The coordination service's key-value store, as `LocalCommits` uses it."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_local_retention_keeps_the_older_local_only_step_until_every_process_recorded_the_newer(tmp_path):
    # One process stands for process 0 of a job of two: process 1 never records its commits.
    sh = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))
    kv = _KeyValues()
    with ckpt.CheckpointManager(str(tmp_path / "durable"), local_directory=str(tmp_path / "local"),
                                durable_every_steps=10, keep_local=ckpt.KeepLatest(1), async_save=False) as mgr:
        tier = mgr._tiers
        tier._commits = _local_commits.LocalCommits(tier.directory, 0.05, client=kv, process_index=0, process_count=2)
        for step in (10, 11, 12):
            mgr.save(step, {"w": jax.device_put(np.full((64, 64), step, np.float32), sh)})
        mgr.wait_until_finished()  # the waits for process 1 time out
        assert mgr.all_steps() == [10]
        assert tier.local_steps() == [11, 12]  # 10 is durable; 11 is all that process 1 may hold
        (own,) = kv.values
        kv.values[own[:-1] + "1"] = kv.values[own]  # process 1 records the same commits
        assert tier.apply_retention() == [11]
        assert tier.local_steps() == [12]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("steps", [[10, 11, 12], [10, 11, 12, 13]], ids=["one-local-step", "two-local-steps"])
def test_a_process_killed_before_its_local_commit_leaves_the_older_local_step_whole_on_every_process(tmp_path, steps):
    # Step 10 durable, the others local only. Process 1 dies while writing the last step,
    # before its local commit; process 0 commits it and keeps the step before (the newest
    # one every process committed): the restart resumes from that one. Before, process 0
    # dropped it as soon as it alone had committed the last step, no local step was whole
    # on every process, and the job resumed from durable step 10. With two local steps,
    # each process first dropped 11 once every process had committed 12 (the window holds).
    *_, kept, last = steps
    args = {"directory": str(tmp_path / "durable"), "local": str(tmp_path / "local"), "phase": "save",
            "steps": steps, "commit_timeout_s": 30}
    p0, p1 = run_processes(WORKERS / "window_worker.py", 2, 2, args, timeout_s=120, fail_fast=False, check=False,
                           env={"MP_RECOVERABLE": "1"})
    assert p1.returncode == -9 and p0.returncode == 0, p0.describe() + p1.describe()
    for r in (p0, p1):
        assert r.record("before_kill")["local_steps"] == [kept], r.describe()
    assert p0.record("saved")["local_steps"] == [kept, last], p0.describe()
    for r in run_processes(WORKERS / "window_worker.py", 2, 2, dict(args, phase="restore"), timeout_s=120):
        rec = r.record("restored")
        assert rec["step"] == kept and rec["mismatches"] == [] and rec["source"] == "local", r.describe()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_with_peer_copies_no_holder_took_the_older_local_step_stays_whole_on_every_process(tmp_path):
    # The kill scenario above with peer_copies=1, both processes on one node: no process
    # can hold a copy, every step's job-wide count is 0. Before, local retention let 12 (0
    # copies) supersede 11 (0 copies) on process 0 as soon as process 0 alone had
    # committed 12: 11 was lost for the job and the restart resumed from durable step 10.
    # The copy counts decide only where they say more; a newer step supersedes an older
    # one only once every process has committed it, with peer copies too.
    args = {"directory": str(tmp_path / "durable"), "local": str(tmp_path / "local"), "phase": "save",
            "steps": [10, 11, 12], "commit_timeout_s": 30, "peer_copies": 1}
    p0, p1 = run_processes(WORKERS / "window_worker.py", 2, 2, args, timeout_s=120, fail_fast=False, check=False,
                           env={"MP_RECOVERABLE": "1"})
    assert p1.returncode == -9 and p0.returncode == 0, p0.describe() + p1.describe()
    assert p0.record("saved")["local_steps"] == [11, 12], p0.describe()
    for r in run_processes(WORKERS / "window_worker.py", 2, 2, dict(args, phase="restore"), timeout_s=120):
        rec = r.record("restored")
        assert rec["step"] == 11 and rec["mismatches"] == [] and rec["source"] == "local", r.describe()


class _Clock:
    """Virtual time for `_local_commits` (its `time`): a sleep advances it at once."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.now += s


def _held_back_waits(monkeypatch):
    """(commits, key-value store, clock, gate): a `LocalCommits` of process 0 of two, on
    virtual time, whose background waits start only once `gate` is set."""
    clock, kv = _Clock(), _KeyValues()
    monkeypatch.setattr(_local_commits, "time", clock)
    commits = _local_commits.LocalCommits("/dir", 60.0, client=kv, process_index=0, process_count=2)
    gate = threading.Event()
    commits._waiter.submit(gate.wait)  # the one waiter thread is busy until the records are in place
    return commits, kv, clock, gate


def test_a_wait_ends_once_a_newer_step_is_recorded_everywhere(monkeypatch):
    # Process 0 commits 10, 11 and 12 and no longer holds 10 at 12 (10 went durable and
    # left the window); process 1 did the same, so its record too names 11 and 12 only.
    # The wait after 10 can never see 10 everywhere. Before, it ran out its timeout
    # (commit_timeout_s) while the waits after 11 and 12 queued behind it on the one
    # waiter thread; in a job whose loop saves more often than that, every later wait
    # then started after its own step had left the records too, timed out in turn, and
    # `wait_until_finished`/`close` waited one timeout per save.
    commits, kv, clock, gate = _held_back_waits(monkeypatch)
    ran = []
    commits.committed(10, "g10", [10], lambda: ran.append(10))
    commits.committed(11, "g11", [10, 11], lambda: ran.append(11))
    commits.committed(12, "g12", [11, 12], lambda: ran.append(12))
    ((key, record),) = kv.values.items()
    kv.values[key[:-1] + "1"] = record  # process 1 records 11 and 12 too
    gate.set()
    commits.close()
    assert ran == [10, 11, 12]  # retention ran after each: 12 is whole on every process
    assert clock.now < commits.timeout_s, "a wait ran out its timeout although a newer step was recorded everywhere"


def test_the_waits_for_a_process_that_never_records_share_one_timeout(monkeypatch):
    # Process 1 records nothing (it died). close() waits for the waits in flight: each
    # gives up `timeout_s` after its commit, so close() waits one timeout, not one per
    # commit queued on the waiter thread (before: three timeouts, one after another).
    commits, kv, clock, gate = _held_back_waits(monkeypatch)
    ran = []
    for step in (10, 11, 12):
        commits.committed(step, f"g{step}", [10, 11, 12], lambda s=step: ran.append(s))
    gate.set()
    commits.close()
    assert ran == []  # nothing was recorded everywhere: retention never ran for these
    assert clock.now < 2 * commits.timeout_s, f"close() waited {clock.now:.0f} virtual s for three commits"
