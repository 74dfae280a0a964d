"""Followers that know the run is over (issue 22 item 5): `close(finished=True)` marks a
run finished in `DIR/.checkpointer-finished.json` (one of the library's own names); the
next writer's first save removes it; `follow()` ends after yielding every step up to the
marked one, and counts and logs the steps retention removed before it could yield them.
"""

import os

import numpy as np
import pytest
from multiprocess import WORKERS, describe_all, run_processes

import checkpointer as ckpt
from checkpointer import _commit
from checkpointer._cli import _main as _cli
from checkpointer._storage._local import LocalStorage

MARK = ".checkpointer-finished.json"


def _tree(step):
    return {"w": np.full((4, 4), step, np.float32)}


def _write(directory, steps, **kwargs):
    mgr = ckpt.CheckpointManager(directory, **kwargs)
    for step in steps:
        mgr.save(step, _tree(step))
    return mgr


def test_follow_ends_after_the_marked_step_of_a_run_closed_with_finished(tmp_path):
    directory = str(tmp_path / "run")
    _write(directory, [1, 2, 3]).close(finished=True)
    assert os.path.isfile(os.path.join(directory, MARK))
    followed = ckpt.CheckpointManager(directory, read_only=True).follow(timeout_s=60, poll_s=0.01)
    assert list(followed) == [1, 2, 3]
    assert followed.finished and followed.finished_step == 3 and followed.removed_steps == []


def test_a_plain_close_does_not_end_followers(tmp_path):
    directory = str(tmp_path / "run")
    _write(directory, [1, 2]).close()  # e.g. a preempted job: it closes cleanly too
    assert not os.path.exists(os.path.join(directory, MARK))
    followed = ckpt.CheckpointManager(directory, read_only=True).follow(timeout_s=0.3, poll_s=0.05)
    assert list(followed) == [1, 2] and not followed.finished  # ended by the timeout


def test_the_finished_mark_is_the_librarys_own_name_and_the_next_writers_first_save_removes_it(tmp_path, capsys):
    directory = str(tmp_path / "run")
    _write(directory, [1]).close(finished=True)
    assert _commit.foreign_entries(LocalStorage(), directory) == []
    assert _cli.main(["ls", directory]) == 0
    assert "Foreign entries" not in capsys.readouterr().out
    mgr = ckpt.CheckpointManager(directory)
    assert os.path.exists(os.path.join(directory, MARK))  # opening a manager deletes nothing
    mgr.save(2, _tree(2))
    assert not os.path.exists(os.path.join(directory, MARK))  # the run goes on
    mgr.close()


def test_follow_counts_and_logs_steps_retention_removed_before_it_could_yield_them(tmp_path, caplog):
    directory = str(tmp_path / "run")
    _write(directory, [1, 2, 3, 4, 5], keep=ckpt.KeepLatest(1), async_save=False).close(finished=True)
    with caplog.at_level("WARNING", logger="checkpointer"):
        followed = ckpt.CheckpointManager(directory, read_only=True).follow(poll_s=0.01)
        assert list(followed) == [5]
    assert followed.removed_steps == [1, 2, 3, 4] and followed.finished_step == 5
    assert "step 3 was committed and removed by retention before it could be yielded" in caplog.text


def test_follow_after_a_step_counts_only_newer_removed_steps(tmp_path):
    directory = str(tmp_path / "run")
    _write(directory, [1, 2, 3, 4], keep=ckpt.KeepLatest(2), async_save=False).close(finished=True)
    followed = ckpt.CheckpointManager(directory, read_only=True).follow(after=1, poll_s=0.01)
    assert list(followed) == [3, 4] and followed.removed_steps == [2]


def test_close_finished_on_a_read_only_manager_is_refused(tmp_path):
    directory = str(tmp_path / "run")
    _write(directory, [1]).close()
    with pytest.raises(ckpt.CheckpointError, match="only the writer marks its run finished"):
        ckpt.CheckpointManager(directory, read_only=True).close(finished=True)


@pytest.mark.multiprocess
def test_an_evaluation_job_ends_when_the_writer_closes_with_finished(tmp_path):
    steps = 12
    args = {"directory": str(tmp_path / "run"), "steps": steps, "pause_s": 0.1, "poll_s": 0.7}
    results = run_processes(WORKERS / "finish_worker.py", 2, 1, args, timeout_s=240, distributed=False)
    info = describe_all(results)
    assert results[0].record("written")["all_steps"] == [steps], info
    got = results[1].record("followed")
    assert got["finished"] and got["finished_step"] == steps, info
    assert got["yielded"][-1] == steps and got["yielded"] == sorted(got["yielded"]), info
    # Every step was either yielded or counted as removed by retention, never both.
    assert sorted(got["yielded"] + got["removed"]) == list(range(1, steps + 1)), info


def test_follow_does_not_count_a_failed_save_as_a_step_retention_removed(tmp_path):
    directory = str(tmp_path / "run")
    mgr = _write(directory, [1], async_save=False)
    with pytest.raises(ckpt.CheckpointError):
        mgr.save(2, {"w": object()})  # fails before anything is written; the journal notes it
    mgr.save(3, _tree(3))
    mgr.close(finished=True)
    followed = ckpt.CheckpointManager(directory, read_only=True).follow(poll_s=0.01)
    assert list(followed) == [1, 3]
    assert followed.removed_steps == []  # step 2 was never committed
