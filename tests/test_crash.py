"""Kill a saving process with SIGKILL at many moments; a fresh one must resume cleanly."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt

WORKER = os.path.join(os.path.dirname(__file__), "crash_worker.py")

KILL_POINTS = [
    "snapshot_done:1",  # before anything is on disk
    "snapshot_done:3",  # while step 2's background write may still run
    "chunks_issued:2",  # chunks written, record not yet
    "record_written:3",  # record written, not yet committed
    "manifest_written:1",  # manifest written, marker not yet
    "manifest_written:3",
    "marker_written:2",  # committed in the partial folder, not yet renamed
    "renamed:1",  # just published the first step
    "renamed:4",  # published, retention not yet run
    "retention_renamed:1",  # retention moved a step aside, not yet deleted
    "replace_moved_old:1",  # force=True: old moved aside, new not yet in place
    "retention_renamed:2",
]


def _run(directory, kill_point, steps=5):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    return subprocess.run(
        [sys.executable, WORKER, directory, kill_point, str(steps)], env=env, capture_output=True, text=True, timeout=180
    )


@pytest.mark.slow
@pytest.mark.parametrize("kill_point", KILL_POINTS)
def test_sigkill_leaves_latest_committed_step_restorable(tmp_path, kill_point):
    directory = str(tmp_path / "run")
    res = _run(directory, kill_point)
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr[-2000:])
    assert f"killing at {kill_point.replace(':', ' #')}" in res.stdout

    with ckpt.CheckpointManager(directory) as mgr:  # a fresh process's view
        mgr.recover()  # what its first save would do first
        leftovers = [n for n in os.listdir(directory) if ".partial-" in n or ".deleting-" in n]
        assert leftovers == [], leftovers  # recovery removed or rolled forward every leftover
        steps = mgr.all_steps()
        for step in steps:
            assert os.path.exists(f"{directory}/{step}/COMMITTED")
        latest = mgr.latest_step()
        if latest is None:
            assert kill_point in ("snapshot_done:1", "manifest_written:1", "chunks_issued:2") or steps == []
            return
        mesh = make_mesh((2, 4), ("a", "b"))
        target = {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(mesh, P("b", "a"))), "step": None}
        restored = mgr.restore(target=target)
        assert restored["step"] == latest
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((64, 32), latest, np.float32))


@pytest.mark.slow
def test_resume_after_crash_continues_saving(tmp_path):
    directory = str(tmp_path / "run")
    assert _run(directory, "marker_written:3").returncode == -9
    res = _run(directory, "none", steps=3)
    assert res.returncode == 0, res.stderr[-2000:]
    with ckpt.CheckpointManager(directory) as mgr:
        steps = mgr.all_steps()
        assert len(steps) == 2 and steps[-1] >= 5
        assert sorted(n for n in os.listdir(directory) if not n.isdigit()) == [".checkpointer-journal.jsonl", ".checkpointer.lock"]
