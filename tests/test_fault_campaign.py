"""The short fault campaign of `make test` (issue 27): storage faults in-process (one
tier and two tiers), SIGKILL / SIGTERM of a process at a storage operation, and a peer
that stops answering (SIGSTOP) in a job of 4 processes; fails on any violation of the
invariants (tests/faults/invariants.py). The long campaign: benchmarks/fault_campaign.py."""

import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root: `tests.faults`
from tests.faults import Fault, FaultLayer, Tally, multiprocess_storage_job, process_job, storage_job, table  # noqa: E402


def _assert_no_violation(tally: Tally) -> None:
    from rich.console import Console

    console = Console(width=140, record=True)
    console.print(table(tally))
    lines = [f"{k}@{p}: {c}: {m}" for k, p, c, m in tally.violations]
    assert not tally.violations, console.export_text() + "\n" + "\n".join(lines)


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.CRITICAL, logger="checkpointer")  # the injected faults' own error lines


@pytest.mark.parametrize("two_tiers", [False, True], ids=["one_tier", "two_tiers"])
def test_storage_faults_keep_every_invariant(tmp_path, two_tiers):
    tally = storage_job(27 + two_tiers, 30, str(tmp_path), two_tiers=two_tiers)
    assert tally.faults >= 20, tally.injected  # most armed faults struck
    assert {k for k, _ in tally.injected} >= {"eio", "enospc", "fsync_eio", "slow_io"}, tally.injected
    _assert_no_violation(tally)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_storage_faults_of_4_processes_keep_every_invariant(tmp_path):
    tally = multiprocess_storage_job(4, 6, str(tmp_path), num_processes=4, two_tiers=True)
    assert tally.faults >= 4, (tally.injected, tally.missed)
    _assert_no_violation(tally)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_process_faults_keep_every_invariant(tmp_path):
    total = Tally()
    for i, (n, tiers, kind) in enumerate([(1, True, "sigterm"), (4, False, "sigkill"), (4, True, "sigstop_peer")]):
        d = tmp_path / str(i)
        d.mkdir()
        total.add(process_job(100 + i, 1, str(d), num_processes=n, two_tiers=tiers, kinds=(kind,)))
    assert {k for k, _ in total.injected} == {"sigterm", "sigkill", "sigstop_peer"}, (total.injected, total.missed)
    _assert_no_violation(total)


def test_the_layer_refuses_paths_outside_the_run(tmp_path):
    import checkpointer as ckpt
    from tests.faults import state

    layer = FaultLayer([str(tmp_path / "run")])
    with layer.installed():
        ckpt.save(str(tmp_path / "run" / "1"), state.make(1))
        with pytest.raises(OSError, match="outside the run's directories"):  # the refusal, or SaveError naming it
            ckpt.save(str(tmp_path / "elsewhere" / "1"), state.make(1))
    assert layer.outside and all("elsewhere" in p for p in layer.outside), layer.outside
    assert not (tmp_path / "elsewhere" / "1").exists()


def test_a_fault_strikes_at_its_point_and_countdown(tmp_path):
    import checkpointer as ckpt
    from tests.faults import state

    layer = FaultLayer([str(tmp_path)])
    with layer.installed():
        layer.arm(Fault("eio", "commit", countdown=1))
        with pytest.raises(ckpt.SaveError, match="injected: eio at commit"):
            ckpt.save(str(tmp_path / "1"), state.make(1))
        assert layer.fired is not None and layer.fired.path.endswith(".json") or "COMMITTED" in layer.fired.path
        ckpt.save(str(tmp_path / "1"), state.make(1))  # disarmed once struck
    assert not state.differences(ckpt.restore(str(tmp_path / "1")), 1)


# --- what the campaign found (regressions) --------------------------------------------------


def test_a_first_save_whose_directory_cannot_be_made_raises_save_error(tmp_path):
    # The manager's first save made its directory outside any error handling: an EIO
    # escaped as a bare OSError, which `save` does not document (campaign seed 2, eio@save#1).
    import checkpointer as ckpt
    from tests.faults import state

    run = str(tmp_path / "run")
    layer = FaultLayer([run])
    with layer.installed(), ckpt.CheckpointManager(run) as mgr:
        layer.arm(Fault("eio", "save", countdown=1))
        with pytest.raises(ckpt.SaveError, match=r"cannot prepare .*/run for saving \(process 0\).*Input/output error"):
            mgr.save(1, state.make(1))
        assert layer.fired is not None and layer.fired.op == "makedirs"
        mgr.save(1, state.make(1))  # the next save tries again
    assert not state.differences(ckpt.restore(f"{run}/1"), 1)


@pytest.mark.parametrize("countdown, file", [(1, "COMMITTED"), (2, "manifest.json")])
@pytest.mark.parametrize("two_tiers", [False, True], ids=["one_tier", "two_tiers"])
def test_a_marker_or_manifest_that_cannot_be_read_raises_corrupt_checkpoint_error(tmp_path, countdown, file, two_tiers):
    # An EIO reading the commit marker or the manifest escaped `restore` as a bare
    # OSError (campaign seeds 27 and 28, eio@restore#1-2); a chunk that cannot be read
    # already raised CorruptCheckpointError.
    import checkpointer as ckpt
    from tests.faults import state

    run, local = str(tmp_path / "run"), str(tmp_path / "local")
    with ckpt.CheckpointManager(run, local_directory=local if two_tiers else None) as mgr:
        mgr.save(1, state.make(1))
    layer = FaultLayer([run, local])
    with layer.installed():
        layer.phase = "restore"
        layer.arm(Fault("eio", "restore", countdown=countdown))
        try:
            ckpt.restore(f"{run}/1")
        except ckpt.CorruptCheckpointError as e:
            assert "cannot be read" in str(e) and "Input/output error" in str(e)
        assert layer.fired is not None and layer.fired.path.endswith(file), layer.fired
        if two_tiers:  # the manager reads the durable marker to choose the tier first
            with ckpt.CheckpointManager(run, local_directory=local) as mgr:
                layer.arm(Fault("eio", "restore", countdown=countdown))
                try:
                    restored = mgr.restore(1)
                    assert not state.differences(restored, 1)
                except ckpt.CorruptCheckpointError as e:
                    assert "cannot be read" in str(e)
                assert layer.fired is not None


def test_a_partial_folder_whose_removal_failed_goes_at_the_next_commit(tmp_path, monkeypatch):
    # A failed save whose partial folder could not be removed (EIO) left it until the
    # next writer's recovery, past any number of clean saves (campaign: 4 processes,
    # two tiers, seed 4: eio@retention#1 on process 0 after a failed replication).
    import errno

    import checkpointer as ckpt
    from checkpointer._storage import LocalStorage
    from tests.faults import partial_folders, state

    run = str(tmp_path / "run")
    real_write, real_delete, failed = LocalStorage.write_file, LocalStorage.delete_tree, []

    def write_file(self, path, data):
        if "/2.partial-" in path and path.endswith("manifest.json"):
            raise OSError(errno.ENOSPC, "injected", path)
        return real_write(self, path, data)

    def delete_tree(self, path):
        if ".partial-" in path and not failed:
            failed.append(path)
            raise OSError(errno.EIO, "injected", path)
        return real_delete(self, path)

    with ckpt.CheckpointManager(run) as mgr:
        mgr.save(1, state.make(1))
        mgr.wait_until_finished()
        monkeypatch.setattr(LocalStorage, "write_file", write_file)
        monkeypatch.setattr(LocalStorage, "delete_tree", delete_tree)
        with pytest.raises(ckpt.SaveError, match="committing .*/2 failed"):
            mgr.save(2, state.make(2))
            mgr.wait_until_finished()
        assert partial_folders(run) == failed and len(failed) == 1
        mgr.save(3, state.make(3))
        mgr.wait_until_finished()
        assert partial_folders(run) == []
        assert mgr.all_steps() == [1, 3]


def _result(process_id, returncode, events, stderr=""):
    import json

    from checkpointer import testing

    stdout = "".join(testing.RECORD_PREFIX + json.dumps(dict(event=e, process=process_id)) + "\n" for e in events)
    return testing.ProcessResult(process_id, returncode, stdout, stderr, 35.0)


def test_a_late_sigterm_may_end_in_jaxs_shutdown_barrier_but_nothing_else_is_excused():
    """The criterion of the campaign's SIGTERM jobs (campaign seeds 1688266535, 1296936428,
    519398818): a SIGTERM after the loop's last sync point may end in JAX's shutdown
    barrier once every process is done; a preemption step reached, a process not done, or
    another abort is still a violation."""
    from tests.faults.campaign import _late_sigterm_shutdown_abort

    barrier = "F1202 client.h:80] ... INTERNAL: Shutdown barrier has failed.\nBarrier result: 'DEADLINE_EXCEEDED"
    done = ["restored", "done"]
    assert _late_sigterm_shutdown_abort([_result(i, -6, done, barrier) for i in range(4)])
    assert _late_sigterm_shutdown_abort([_result(0, 0, done), _result(1, -6, done, barrier)])
    assert not _late_sigterm_shutdown_abort([_result(0, 0, done), _result(1, 0, done)])  # clean: nothing to excuse
    assert not _late_sigterm_shutdown_abort([_result(0, -6, ["preempted"] + done, barrier), _result(1, 0, done)])
    assert not _late_sigterm_shutdown_abort([_result(0, -6, ["restored"], barrier), _result(1, 0, done)])
    assert not _late_sigterm_shutdown_abort([_result(0, -6, done, "heartbeat timeout"), _result(1, 0, done)])
    assert not _late_sigterm_shutdown_abort([_result(0, 1, done, barrier), _result(1, 0, done)])
    assert not _late_sigterm_shutdown_abort([])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_jax_aborts_a_job_whose_sigterm_comes_after_a_peer_began_its_exit():
    """What the criterion above excuses, for real, with nothing of the library in the
    processes: JAX's sync protocol on process 0 waits for process 1, already in its
    shutdown; process 0's shutdown blocks on it, the 30 s shutdown barrier expires, and
    every process is aborted after its work. If JAX fixes this (both exit 0), the
    campaign's excuse can go."""
    from checkpointer import testing
    from tests.faults.campaign import _late_sigterm_shutdown_abort, late_sigterm_worker

    results = testing.run_processes(late_sigterm_worker, 2, 1, dict(delay_s=3.0), timeout_s=150, fail_fast=False,
                                    check=False)
    assert [r.returncode for r in results] == [-6, -6], testing.describe_all(results)
    assert _late_sigterm_shutdown_abort(results), testing.describe_all(results)
