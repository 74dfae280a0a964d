"""Corners that lost saves (issue 27 item 1): a loop that saves only when `should_save` says
so, at the preemption step; `reached_preemption` of a step that was not saved; forked
children that inherited the preemption handler and could not be stopped; a step dated in
the future that anchored `KeepEverySeconds`; and retention of a local tier run by two
threads at once. The bounded JSON parser's cases are in tests/test_bounded_json.py."""

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from multiprocess import WORKERS, describe_all, run_processes

import checkpointer as ckpt
from checkpointer._manage import _preemption, _tier_manager, _time_policies

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def sigterm():
    """Leaves SIGTERM's handler as it found it, whatever the test does."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _tree(step):
    return {"w": np.full((8, 8), step, np.float32), "step": step}


# --- should_save and reached_preemption ------------------------------------------------------


@pytest.mark.usefixtures("sigterm")
def test_a_loop_that_saves_when_should_save_says_so_saves_the_preemption_step(tmp_path):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with ckpt.CheckpointManager(str(tmp_path / "run"), save_interval_steps=100) as mgr:
        for step in range(1, 10):
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # the notice, between two steps
            if mgr.should_save(step):
                assert mgr.save(step, _tree(step)) is True
            if mgr.reached_preemption(step):
                break
        assert step == 3 and mgr.all_steps() == [3]
        assert mgr.should_save(4) is False  # one preemption step
    np.testing.assert_array_equal(ckpt.restore(str(tmp_path / "run" / "3"))["w"], _tree(3)["w"])


@pytest.mark.multiprocess
def test_a_should_save_loop_of_two_processes_saves_the_step_jax_picks_when_one_gets_sigterm(tmp_path):
    directory = str(tmp_path / "run")
    args = {"directory": directory, "signalled": [1], "signal_at": 3, "max_steps": 2000, "pause_s": 0.01,
            "should_save": True}
    results = run_processes(WORKERS / "preempt_worker.py", 2, 2, args, timeout_s=240)  # exit 0, or it raises
    info = describe_all(results)
    got = [r.record("preempted") for r in results]
    step = got[0]["step"]
    assert got[1]["step"] == step and step >= 3, info  # JAX's sync point: the same step on both
    assert all(g["mode"] == _preemption.JAX_SYNC_POINT for g in got), info
    assert all(g["saved"] and g["committed_on_return"] for g in got), info  # should_save said True there
    assert got[0]["all_steps"] == [step], info


@pytest.mark.usefixtures("sigterm")
def test_under_jax_distributed_should_save_asks_the_sync_point_once_per_step_and_save_agrees(tmp_path, monkeypatch):
    class State:
        client = object()  # jax.distributed is initialized
        preemption_sync_manager = object()

    asked = []
    monkeypatch.setattr(_preemption, "_distributed_state", lambda: State)
    monkeypatch.setattr(_preemption, "_jax_sync_point", lambda step: asked.append(step) or step == 5)
    with ckpt.CheckpointManager(str(tmp_path / "run"), save_interval_steps=100) as mgr:
        decisions = []
        for step in range(1, 10):
            decisions.append(mgr.should_save(step))
            if decisions[-1]:
                assert mgr.save(step, _tree(step)) is True
            if mgr.reached_preemption(step):
                break
        assert step == 5 and decisions == [False, False, False, False, True] and mgr.all_steps() == [5]
    assert asked == [1, 2, 3, 4, 5]  # every step asked, once, by whichever of the three asked first


@pytest.mark.usefixtures("sigterm")
def test_reached_preemption_of_a_step_not_saved_is_false_and_warns_until_it_is_saved(tmp_path, caplog):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with ckpt.CheckpointManager(str(tmp_path / "run"), save_interval_steps=100, async_save=False) as mgr:
        mgr.save(100, _tree(100))
        os.kill(os.getpid(), signal.SIGTERM)
        with caplog.at_level(logging.WARNING, logger="checkpointer"):
            assert mgr.reached_preemption(101) is False  # the loop never called save(101)
        assert "the preemption step 101 was not saved" in caplog.text
        assert mgr.all_steps() == [100]
        assert mgr.save(101, _tree(101), force=True) is True  # the remedy the warning names
        assert mgr.reached_preemption(101) is True and mgr.all_steps() == [100, 101]


# --- forked children -----------------------------------------------------------------------


def test_a_child_forked_after_the_manager_opened_dies_on_sigterm(tmp_path):
    code = f"""
import multiprocessing, os, signal, sys, time
import checkpointer as ckpt
mgr = ckpt.CheckpointManager({str(tmp_path / "run")!r})
assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the manager's handler

def wait_dead(pid):
    for _ in range(600):  # up to 60 s: the default action ends it at once
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]

pid = os.fork()
if pid == 0:
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        os._exit(3)
    time.sleep(60)
    os._exit(4)
os.kill(pid, signal.SIGTERM)
status = wait_dead(pid)
print("os.fork", os.WIFSIGNALED(status) and os.WTERMSIG(status), os.WIFEXITED(status) and os.WEXITSTATUS(status))

child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
child.start()
child.terminate()
child.join(60)
print("multiprocessing", child.exitcode)
child.kill()
assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the parent keeps its handler
mgr.close()
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.split("\n")
    assert f"os.fork {int(signal.SIGTERM)} False" in lines, proc.stdout + proc.stderr
    assert f"multiprocessing {-int(signal.SIGTERM)}" in lines, proc.stdout + proc.stderr
    assert "SIGTERM received" not in proc.stderr  # no child announced a save it would never make


def test_a_forked_child_gets_the_handler_the_program_had_before_the_managers(monkeypatch):
    def earlier(signum, frame):
        pass

    def first(signum, frame):  # two managers' handlers, the second chained to the first
        pass

    def second(signum, frame):
        pass

    monkeypatch.setattr(_preemption, "_INSTALLED", {second: first})
    monkeypatch.setattr(_preemption, "_CLOSED", {first: earlier})  # the first closed out of order
    set_to = []
    monkeypatch.setattr(signal, "getsignal", lambda signum: second)
    monkeypatch.setattr(signal, "signal", lambda signum, handler: set_to.append((signum, handler)))
    _preemption._after_fork_in_child()
    assert set_to == [(signal.SIGTERM, earlier)]


# --- time policies: a step dated in the future ----------------------------------------------

HOUR = 3600.0
NOW = 2e9


def test_a_step_dated_a_day_ahead_is_kept_but_never_anchors_keep_every_seconds(monkeypatch, caplog):
    monkeypatch.setattr(_time_policies, "_warned_future", False)
    created = {
        10: NOW - 6 * HOUR, 20: NOW - 5 * HOUR,
        30: NOW + 24 * HOUR,  # committed on a node whose clock was a day ahead
        40: NOW - 4.5 * HOUR,  # within the hour after 20: not an hourly point
        50: NOW - 4 * HOUR, 60: NOW - 3 * HOUR, 70: NOW - 0.5 * HOUR, 80: NOW - 0.2 * HOUR,
    }
    steps = sorted(created)
    policy = ckpt.KeepEverySeconds(3600) | ckpt.KeepNewerThan(3600)
    with caplog.at_level(logging.WARNING, logger="checkpointer"):
        kept = policy.keep_at(steps, {}, created, NOW)
        assert policy.keep_at(steps, {}, created, NOW) == kept
    assert sorted(kept) == [10, 20, 30, 50, 60, 70, 80]
    warnings = [r for r in caplog.records if "in the future" in r.getMessage()]
    assert len(warnings) == 1 and "step 30" in warnings[0].getMessage(), caplog.text  # once


def test_a_step_within_the_skew_tolerance_counts_with_its_time(monkeypatch, caplog):
    monkeypatch.setattr(_time_policies, "_warned_future", False)
    ahead = _time_policies.FUTURE_SKEW_TOLERANCE_S / 2
    created = {1: NOW - 2 * HOUR, 2: NOW + ahead, 3: NOW + ahead + 60}
    with caplog.at_level(logging.WARNING, logger="checkpointer"):
        assert ckpt.KeepEverySeconds(3600).keep_at([1, 2, 3], {}, created, NOW) == {1, 2}  # 3: 60 s after 2
    assert "in the future" not in caplog.text


# --- retention of a local tier: one call at a time ------------------------------------------


def test_apply_retention_of_one_tier_runs_one_call_at_a_time(tmp_path, monkeypatch):
    inside, most, second_in = [0], [0], threading.Event()
    mu = threading.Lock()
    real = _tier_manager.LocalTier.local_steps
    others = []

    def local_steps(self):  # the first thing apply_retention does
        with mu:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            if not others:  # the first call: start a second one, give it a chance to get in
                others.append(threading.Thread(target=self.apply_retention))
                others[0].start()
                second_in.wait(1.0)
            else:
                second_in.set()
            return real(self)
        finally:
            with mu:
                inside[0] -= 1

    with ckpt.CheckpointManager(str(tmp_path / "durable"), local_directory=str(tmp_path / "local"),
                                keep_local=ckpt.KeepLatest(1), async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, _tree(step))
        mgr.wait_until_finished()
        tier = mgr._tiers
        monkeypatch.setattr(_tier_manager.LocalTier, "local_steps", local_steps)
        tier.apply_retention()
        others[0].join(30)
        assert not others[0].is_alive()
    assert most[0] == 1  # the second call entered only after the first had finished
