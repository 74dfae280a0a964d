"""The direct writer's threads of a background save run at a lower CPU priority
(`BACKGROUND_NICE` added to their nice value, Linux), so a training loop that keeps the
cores busy keeps them; the background thread itself keeps the caller's (the pools it
may start are process-wide), and a blocking `save` runs its writes at the caller's
priority."""

import os
import sys
import threading

import jax.numpy as jnp
import pytest

import checkpointer as ckpt
from checkpointer._encoding import _write
from checkpointer._save._async import BACKGROUND_NICE

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.fixture
def recorded(monkeypatch):
    seen = {"submitters": set(), "workers": set()}
    submit = _write.DirectWriter.submit

    def recording_submit(self, fn, *args):
        seen["submitters"].add(_nice())

        def run(*a):
            seen["workers"].add(_nice())
            return fn(*a)

        return submit(self, run, *args)

    monkeypatch.setattr(_write.DirectWriter, "submit", recording_submit)
    return seen


def test_save_async_writes_at_a_lower_priority_than_the_caller(tmp_path, recorded):
    caller = _nice()
    handle = ckpt.save_async(str(tmp_path / "1"), {"w": jnp.ones((256, 256)), "b": jnp.zeros(8)}, direct_io=True)
    handle.wait()
    want = min(19, caller + BACKGROUND_NICE)
    assert recorded["submitters"] == {caller} and recorded["workers"] == {want}, recorded
    assert _nice() == caller  # the caller's own priority is untouched
    assert ckpt.restore(str(tmp_path / "1"))["w"].tolist() == [[1.0] * 256] * 256


def test_the_manager_saves_in_the_background_at_a_lower_priority(tmp_path, recorded):
    caller = _nice()
    with ckpt.CheckpointManager(str(tmp_path / "run"), direct_io=True) as mgr:
        mgr.save(1, {"w": jnp.ones((128, 128))})
        mgr.wait_until_finished()
    assert recorded["workers"] == {min(19, caller + BACKGROUND_NICE)}, recorded


def test_a_blocking_save_writes_at_the_callers_priority(tmp_path, recorded):
    caller = _nice()
    ckpt.save(str(tmp_path / "1"), {"w": jnp.ones((256, 256))}, direct_io=True)
    assert recorded["workers"] == {caller} and recorded["submitters"] == {caller}, recorded


_FRESH_PROCESS = r"""
import glob, os, sys, tempfile, threading
import jax.numpy as jnp
import checkpointer as ckpt

def lowered():
    out = []
    for task in glob.glob("/proc/self/task/*"):
        try:
            stat, name = open(task + "/stat").read(), open(task + "/comm").read().strip()
        except OSError:
            continue
        nice = int(stat[stat.rindex(")") + 2:].split()[16])
        if nice != 0 and name != "checkpointer-direct":
            out.append((name, nice))
    return out

tmp = tempfile.mkdtemp()
state = {"w": jnp.ones((512, 512)), "b": jnp.zeros(8)}
# The process's first TensorStore work runs on the background save thread.
ckpt.save_async(f"{tmp}/1", state, direct_io=sys.argv[1] == "direct", pack_small_leaves_bytes=0).wait()
ckpt.save(f"{tmp}/2", state, direct_io=False, pack_small_leaves_bytes=0)
ckpt.restore(f"{tmp}/2")
print(sorted(set(lowered())))
"""


@pytest.mark.parametrize("direct", ["direct", "buffered"])
def test_a_background_save_leaves_no_process_wide_thread_at_its_priority(tmp_path, direct):
    # Threads are created at their creator's nice value: process-wide pools that the
    # background thread starts (TensorStore's workers, which every later blocking save
    # and restore uses) must not be left at BACKGROUND_NICE.
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, direct], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
