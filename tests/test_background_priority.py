"""The background save thread runs at a lower CPU priority (`BACKGROUND_NICE` added to
its nice value, Linux), and the direct writer's threads it starts inherit it, so a
training loop that keeps the cores busy keeps them; a blocking `save` runs its writes
at the caller's priority."""

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
    assert recorded["submitters"] == {want} and recorded["workers"] == {want}, recorded
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
