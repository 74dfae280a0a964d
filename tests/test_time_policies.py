"""Time-based retention and saving (issue 22 item 4): KeepEverySeconds and KeepNewerThan
(composable with `|`, times from the manifests), and save_interval_s decided by process 0."""

import json
import os
import time

import numpy as np
import pytest
from multiprocess import WORKERS, describe_all, run_processes

import checkpointer as ckpt
from checkpointer._manage import _time_policies
from checkpointer._manage._policies import KeepBest, KeepLatest

STEPS = [1, 2, 3, 4, 5, 6]
# Creation times: 0 s, 10 s, 30 s, 35 s, 100 s, 160 s after 1e9.
CREATED = {1: 1e9, 2: 1e9 + 10, 3: 1e9 + 30, 4: 1e9 + 35, 5: 1e9 + 100, 6: 1e9 + 160}


@pytest.mark.parametrize("s, expected", [(20, {1, 3, 5, 6}), (30, {1, 3, 5, 6}), (31, {1, 4, 5, 6}), (1000, {1})])
def test_keep_every_seconds_keeps_the_first_step_of_each_interval(s, expected):
    assert ckpt.KeepEverySeconds(s).keep_at(STEPS, {}, CREATED, 1e9 + 200) == expected


@pytest.mark.parametrize("s, expected", [(41, {6}), (101, {5, 6}), (171, {3, 4, 5, 6}), (1000, set(STEPS))])
def test_keep_newer_than_keeps_the_steps_younger_than_s(s, expected):
    assert ckpt.KeepNewerThan(s).keep_at(STEPS, {}, CREATED, 1e9 + 200) == expected


def test_steps_without_a_creation_time_or_from_the_future_are_kept():
    created = {**CREATED, 2: None, 3: 0.0, 4: 1e9 + 500}
    assert ckpt.KeepNewerThan(41).keep_at(STEPS, {}, created, 1e9 + 200) == {2, 3, 4, 6}
    assert ckpt.KeepEverySeconds(1000).keep_at(STEPS, {}, created, 1e9 + 200) == {1, 2, 3}


def test_time_policies_compose_with_step_policies_an_old_step_goes_only_if_none_keeps_it():
    policy = ckpt.KeepNewerThan(41) | KeepLatest(2) | KeepBest("loss") | ckpt.KeepEverySeconds(1000)
    metrics = {s: {"loss": 1.0} if s == 2 else {} for s in STEPS}
    assert policy.uses_times and not (KeepLatest(1) | KeepBest("loss")).uses_times
    assert policy.keep_at(STEPS, metrics, CREATED, 1e9 + 200) == {1, 2, 5, 6}
    # Without times (a caller that has none) nothing is known to be old.
    assert ckpt.KeepNewerThan(41).keep(STEPS, {}) == set(STEPS)


@pytest.mark.parametrize("cls", [ckpt.KeepEverySeconds, ckpt.KeepNewerThan])
@pytest.mark.parametrize("s", [0, -1, float("nan"), float("inf"), True, "60"])
def test_time_policies_reject_bad_seconds(cls, s):
    with pytest.raises(ValueError, match="seconds > 0"):
        cls(s)


def _set_created(directory, step, unix_s):
    """Rewrites the creation time in step's manifest; the files' own times say the opposite."""
    path = os.path.join(directory, str(step), "manifest.json")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    manifest["created_unix_s"] = unix_s
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    for dirpath, _, files in os.walk(os.path.join(directory, str(step))):
        for name in files:
            os.utime(os.path.join(dirpath, name), (4e9, 4e9))  # "new" file times: ignored


def test_the_manager_removes_steps_by_their_manifests_creation_time_never_file_times(tmp_path):
    d = str(tmp_path / "run")
    tree = {"w": np.zeros(4, np.float32)}
    with ckpt.CheckpointManager(d, keep=ckpt.KeepNewerThan(3600), async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, tree)
    _set_created(d, 1, time.time() - 7200)  # saved two hours ago, by its manifest
    os.utime(os.path.join(d, "3", "manifest.json"), (1.0, 1.0))  # an "old" file time: ignored
    with ckpt.CheckpointManager(d, keep=ckpt.KeepNewerThan(3600) | ckpt.KeepEvery(1000), async_save=False) as mgr:
        mgr.save(4, tree)
        assert mgr.all_steps() == [2, 3, 4]


def test_keep_every_seconds_in_a_manager_keeps_the_oldest_of_a_fast_run_and_the_newest(tmp_path):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d, keep=ckpt.KeepEverySeconds(3600), async_save=False) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, {"w": np.full(4, step, np.float32)})
        assert mgr.all_steps() == [1, 4]


def test_keep_local_refuses_a_time_policy(tmp_path):
    with pytest.raises(TypeError, match="by step"):
        ckpt.CheckpointManager(str(tmp_path / "d"), local_directory=str(tmp_path / "l"), keep_local=ckpt.KeepNewerThan(60))


class _FakeClock:
    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now


def test_save_interval_s_writes_a_step_only_when_enough_time_passed(tmp_path, monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(_time_policies, "time", clock)
    d = str(tmp_path / "run")
    tree = {"w": np.zeros(4, np.float32)}
    written = []
    with ckpt.CheckpointManager(d, save_interval_s=100, async_save=False) as mgr:
        for step, now, force in [(1, 1000, False), (2, 1050, False), (3, 1100, False), (4, 1101, True), (5, 1150, False),
                                 (6, 1201, False)]:
            clock.now = now
            if mgr.save(step, tree, force=force):
                written.append(step)
    assert written == [1, 3, 4, 6]
    with pytest.raises(ValueError, match="save_interval_s needs a number of seconds > 0"):
        ckpt.CheckpointManager(d, save_interval_s=0)


def test_save_interval_s_after_the_clock_stepped_back_waits_one_interval_not_the_step(tmp_path, monkeypatch):
    # The last save's wall time was kept: a clock stepped back a day held every save back
    # for a day plus the interval.
    clock = _FakeClock()
    monkeypatch.setattr(_time_policies, "time", clock)
    tree = {"w": np.zeros(4, np.float32)}
    written = []
    with ckpt.CheckpointManager(str(tmp_path / "run"), save_interval_s=100, async_save=False) as mgr:
        for step, now in [(1, 100_000), (2, 100_050), (3, 13_600), (4, 13_650), (5, 13_700), (6, 13_750)]:
            clock.now = now  # between steps 2 and 3 the clock goes back 86,450 s
            if mgr.save(step, tree):
                written.append(step)
    assert written == [1, 5]


def test_save_interval_s_and_steps_both_must_allow_a_save(tmp_path, monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(_time_policies, "time", clock)
    tree = {"w": np.zeros(4, np.float32)}
    written = []
    with ckpt.CheckpointManager(str(tmp_path / "run"), save_interval_s=100, save_interval_steps=2, async_save=False) as mgr:
        for step in range(1, 9):
            clock.now = 1000 + 60 * step
            if mgr.save(step, tree):
                written.append(step)
    assert written == [2, 4, 6, 8]  # every even step is >= 100 s after the last one written
    written.clear()
    with ckpt.CheckpointManager(str(tmp_path / "run2"), save_interval_s=100, save_interval_steps=2, async_save=False) as mgr:
        for step in range(1, 9):
            clock.now = 1000 + 30 * step
            if mgr.save(step, tree):
                written.append(step)
    assert written == [2, 6]  # step 4 is only 60 s after step 2, step 6 is 120 s


def test_a_resumed_manager_times_its_first_save_from_the_newest_committed_step(tmp_path, monkeypatch):
    d = str(tmp_path / "run")
    tree = {"w": np.zeros(4, np.float32)}
    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        mgr.save(1, tree)
    created = ckpt.metadata(f"{d}/1").created_unix_s
    clock = _FakeClock()
    monkeypatch.setattr(_time_policies, "time", clock)
    with ckpt.CheckpointManager(d, save_interval_s=100, async_save=False) as mgr:
        clock.now = created + 50
        assert not mgr.save(2, tree)
        clock.now = created + 150
        assert mgr.save(3, tree)


def test_a_newest_step_created_in_the_future_does_not_hold_back_the_first_save(tmp_path, monkeypatch):
    d = str(tmp_path / "run")
    tree = {"w": np.zeros(4, np.float32)}
    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        mgr.save(1, tree)
    created = ckpt.metadata(f"{d}/1").created_unix_s
    clock = _FakeClock()
    monkeypatch.setattr(_time_policies, "time", clock)
    with ckpt.CheckpointManager(d, save_interval_s=100, async_save=False) as mgr:
        clock.now = created - 86400  # this host's clock a day behind the one that saved step 1
        assert mgr.save(2, tree)  # else no save for a day: the age of step 1 is unknown
        clock.now += 50
        assert not mgr.save(3, tree)


@pytest.mark.multiprocess
def test_process_0_decides_time_based_saves_and_every_process_agrees(tmp_path):
    # Process 0's clock: saves due at calls 1, 3 and 5. Process 1's clock would say every
    # call (its time jumps by 1e6 s), yet it follows process 0.
    times = {"0": [1000, 1050, 1100, 1150, 1250], "1": [1e6 * i for i in range(1, 6)]}
    results = run_processes(WORKERS / "interval_worker.py", 2, 1, {"directory": str(tmp_path / "run"), "times": times},
                            timeout_s=120)
    info = describe_all(results)
    recs = [r.record("saved") for r in results]
    assert recs[0]["returns"] == [True, False, True, False, True], info
    assert recs[1]["returns"] == recs[0]["returns"], info
    assert recs[0]["all_steps"] == [1, 3, 5] == recs[1]["all_steps"], info

