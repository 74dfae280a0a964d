"""Faults a training loop meets, found by a hostile review ("nothing lost under any
fault"): forked children of a process that holds a manager, preemption notices around
saves, clocks, bounded parsing, crashes and background errors. Real processes where the
fault needs them."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import checkpointer as ckpt
from checkpointer._format import _json
from checkpointer._manage import _mesh_restart, _peer_copy

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}


def _tree(step):
    return {"w": np.full((8, 8), step, np.float32), "step": step}


def _python(code, tmp_path, timeout=240):
    """Runs `code` in a fresh interpreter; its output goes through a file (a child it forks
    and leaves running must not hold a pipe that `subprocess.run` waits for)."""
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.txt"
    with open(out, "w") as f:
        proc = subprocess.run([sys.executable, "-c", code], env=ENV, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    return proc.returncode, out.read_text()


# --- forked children ---------------------------------------------------------------------------


def test_a_child_forked_by_a_killed_trainer_does_not_keep_the_next_run_from_saving(tmp_path):
    """A data-loader worker forked after the manager took its lock outlives the trainer
    (killed with SIGKILL: nothing ends its children). The restarted job must save."""
    directory = str(tmp_path / "run")
    code = f"""
import multiprocessing, os, signal, time
import numpy as np
import checkpointer as ckpt
mgr = ckpt.CheckpointManager({directory!r})
mgr.save(1, {{"w": np.ones(4, np.float32)}})
mgr.wait_until_finished()
worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True)
worker.start()
print("worker", worker.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies; its worker lives on
"""
    rc, out = _python(code, tmp_path)
    assert rc == -signal.SIGKILL, out
    worker = int(out.split("worker ")[1].split()[0])
    try:
        with ckpt.CheckpointManager(directory) as mgr:  # the restarted job
            assert mgr.latest_step() == 1
            assert mgr.save(2, _tree(2)) is True
        assert ckpt.CheckpointManager(directory).all_steps() == [1, 2]
    finally:
        os.kill(worker, signal.SIGKILL)


def test_a_manager_reopened_beside_a_live_forked_child_takes_the_lock(tmp_path):
    """A trainer closes its manager and opens a new one on the same directory while a
    worker it forked (holding nothing of the library's on purpose) still runs."""
    directory = str(tmp_path / "run")
    code = f"""
import os, signal, time
import numpy as np
import checkpointer as ckpt
mgr = ckpt.CheckpointManager({directory!r})
mgr.save(1, {{"w": np.ones(4, np.float32)}})
pid = os.fork()
if pid == 0:
    time.sleep(120)
    os._exit(0)
try:
    mgr.close()
    with ckpt.CheckpointManager({directory!r}) as again:
        again.save(2, {{"w": np.ones(4, np.float32)}})
    print("saved", ckpt.CheckpointManager({directory!r}).all_steps())
finally:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
"""
    rc, out = _python(code, tmp_path)
    assert rc == 0, out
    assert "saved [1, 2]" in out, out


# --- bounded parsing ---------------------------------------------------------------------------

DEEP = "[" * 5000 + "]" * 5000  # within any size bound; beyond Python's recursion limit


def test_a_deeply_nested_node_file_of_a_neighbour_folder_is_unreadable_not_a_recursion_error(tmp_path):
    """`node.json` of a process folder beside this one (two tiers: which folders of the
    local directory are on this node) is read at every restart; a damaged one says
    "no node" (the documented None), never lets a builtin escape the restore."""
    root = tmp_path / "local" / "process-1"
    root.mkdir(parents=True)
    (root / _mesh_restart.NODE_FILE).write_text(DEEP)
    assert _mesh_restart.read_node(str(root)) is None


def test_a_spare_peer_copy_with_a_deeply_nested_record_is_dropped_not_a_recursion_error(tmp_path):
    """A held peer copy dropped by retention (the spare, written over by the next copy
    received) whose record is damaged: the documented answer is "no spare" (it is
    deleted), never a RecursionError out of the peer server's put."""
    root = tmp_path / "held"
    spare = root / _peer_copy.SPARE
    spare.mkdir(parents=True)
    (spare / _peer_copy.COPY_RECORD).write_text(DEEP)
    assert _peer_copy.take_spare(str(root), str(root / "7.partial-x")) is None
    assert not spare.exists()


# --- the same step saved twice ---------------------------------------------------------------


def test_a_second_save_of_a_step_still_in_flight_is_refused_at_once(tmp_path, monkeypatch):
    """`save(5)` twice while the first is still writing (two saves in flight allowed): the
    second must be refused by `save` itself, as for a committed step, not accepted
    (returning True), written in full, and then failed in the background, its error
    raised by a later call (here `close`) and noted as a failed save of step 5."""
    from checkpointer._storage import _local

    gate = threading.Event()
    real = _local.LocalStorage.write_file

    def write_file(self, path, data):  # the first save's record waits for the gate
        gate.wait(120)
        return real(self, path, data)

    monkeypatch.setattr(_local.LocalStorage, "write_file", write_file)
    mgr = ckpt.CheckpointManager(str(tmp_path / "run"), max_saves_in_flight=2)
    try:
        assert mgr.save(5, _tree(5)) is True
        with pytest.raises(ckpt.CheckpointExistsError, match="5"):
            mgr.save(5, _tree(55))
    finally:
        gate.set()
    mgr.close()  # nothing failed in the background
    assert mgr.status().last_error is None
    assert ckpt.CheckpointManager(str(tmp_path / "run"), read_only=True).all_steps() == [5]
    np.testing.assert_array_equal(ckpt.restore(str(tmp_path / "run" / "5"))["w"], _tree(5)["w"])


# --- a step the library itself could not read back ---------------------------------------------


@pytest.mark.parametrize("what", ["metadata", "per_process_state"])
def test_a_save_whose_manifest_or_record_readers_would_refuse_commits_nothing(tmp_path, monkeypatch, what):
    """Readers refuse a manifest or process record larger than `MAX_MANIFEST_BYTES` (1 GiB;
    lowered here to 1 MiB, as a data loader's state of a shuffled 300M-sample permutation
    would pass the real one). A save that writes one must fail and commit nothing:
    committed, it became the newest step, which `restore(None)` then refused forever (and
    retention had deleted the older steps a resume needed)."""
    monkeypatch.setattr(_json, "MAX_MANIFEST_BYTES", 1 << 20)
    big = {"perm": list(range(300_000))}  # ~2 MiB of JSON
    directory = str(tmp_path / "run")
    mgr = ckpt.CheckpointManager(directory, keep=ckpt.KeepLatest(1))
    mgr.save(1, _tree(1))
    mgr.wait_until_finished()
    mgr.save(2, _tree(2), **{what: big})
    with pytest.raises(ckpt.SaveError, match=r"(manifest|processes/0)\.json.*1048576"):
        mgr.wait_until_finished()
    mgr.close()
    reader = ckpt.CheckpointManager(directory, read_only=True)
    assert reader.all_steps() == [1]
    np.testing.assert_array_equal(reader.restore(None)["w"], _tree(1)["w"])


def test_a_forked_childs_copy_of_the_manager_neither_deletes_nor_saves_nor_closes_the_parents_run(tmp_path):
    """A child forked from a process with a manager (a pool worker whose code reaches the
    manager, or an `os.fork` child leaving a `with` block) holds a copy of it. The copy
    is the parent's: it must refuse to delete or save with the library's own error, and
    its `close()` must neither mark the run finished nor touch what the parent holds."""
    directory = str(tmp_path / "run")
    code = f"""
import os, signal, time
import numpy as np
import checkpointer as ckpt
mgr = ckpt.CheckpointManager({directory!r})
mgr.save(1, {{"w": np.ones(4, np.float32)}})
mgr.wait_until_finished()
pid = os.fork()
if pid == 0:
    out = []
    for name, call in (("delete", lambda: mgr.delete(1)), ("save", lambda: mgr.save(2, {{"w": np.ones(4, np.float32)}})),
                       ("close_finished", lambda: mgr.close(finished=True)), ("close", mgr.close)):
        try:
            call()
            out.append(name + ":done")
        except ckpt.CheckpointError as e:
            out.append(name + ":refused" + (":forked" if "forked" in str(e) else ""))
    print("child", " ".join(out), flush=True)
    os._exit(0)
for _ in range(1200):  # a bound, not a measure: a child that hangs is killed
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.1)
else:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("child hung")
mgr.save(3, {{"w": np.ones(4, np.float32)}})
mgr.close()
print("steps", ckpt.CheckpointManager({directory!r}, read_only=True).all_steps())
print("finished mark", os.path.exists({directory!r} + "/.checkpointer-finished.json"))
"""
    rc, out = _python(code, tmp_path)
    assert rc == 0, out
    assert "child delete:refused:forked save:refused:forked close_finished:refused:forked close:done" in out, out
    assert "steps [1, 3]" in out, out
    assert "finished mark False" in out, out


# --- two tiers: a step saved again while its replication reads it ---------------------------------


def _gate_replication(monkeypatch):
    """Holds every durable replication until `gate` is set; `entered` is set once one
    waits (its local save has ended: the replication joins it first)."""
    from checkpointer._manage import _tiers

    entered, gate = threading.Event(), threading.Event()
    real = _tiers.replicate
    unreadable = []  # durable steps a replication committed that cannot be restored

    def replicate(target, *args, **kwargs):
        entered.set()
        gate.wait(120)
        out = real(target, *args, **kwargs)
        try:
            ckpt.restore(target.durable_path)
        except ckpt.CheckpointError as e:
            unreadable.append(f"{target.durable_path}: {e}")
        return out

    monkeypatch.setattr(_tiers, "replicate", replicate)
    return entered, gate, unreadable


@pytest.mark.parametrize("force", [False, True])
def test_a_step_saved_again_while_its_replication_runs_never_commits_a_mixed_durable_step(tmp_path, monkeypatch, force):
    """Two tiers: step 5 is committed locally and its replication to the durable tier is
    under way when the loop saves step 5 again (by mistake, or `force=True`, e.g. the
    remedy `reached_preemption` names). The second local save replaced the local folder
    the replication was reading, and the durable step 5 was committed with the first
    save's marker and the second save's manifest: CorruptCheckpointError on restore (the
    newest step: no resume). The second save must wait for the replication; then it is
    refused (committed, no `force`) or replaces step 5 atomically (`force`)."""
    entered, gate, unreadable = _gate_replication(monkeypatch)
    mgr = ckpt.CheckpointManager(str(tmp_path / "durable"), local_directory=str(tmp_path / "local"))

    def release_once_the_save_waits():
        for _ in range(3000):  # a bound, not a measure
            if mgr.status().waiting_for_replication:
                break
            threading.Event().wait(0.01)
        gate.set()

    mgr.save(5, _tree(5))
    assert entered.wait(120)  # committed locally; its replication is under way
    releaser = threading.Thread(target=release_once_the_save_waits)
    releaser.start()
    try:
        if force:
            assert mgr.save(5, _tree(55), force=True) is True
        else:
            with pytest.raises(ckpt.CheckpointExistsError, match="5"):
                mgr.save(5, _tree(55))
    finally:
        releaser.join()
    mgr.close()  # no background error
    assert unreadable == []  # no replication committed a mixed step, even for a moment
    np.testing.assert_array_equal(ckpt.restore(str(tmp_path / "durable" / "5"))["w"], _tree(55 if force else 5)["w"])


def test_a_replication_whose_local_step_was_replaced_commits_nothing(tmp_path, monkeypatch):
    """The safety net behind the wait above: if the local folder of a step holds another
    save of it when its replication commits (a race the manager does not foresee), the
    durable commit must fail (nothing committed) rather than pair this save's marker
    with another save's manifest."""
    import shutil

    other = tmp_path / "other"
    with ckpt.CheckpointManager(str(other / "durable"), local_directory=str(other / "local")) as m:
        m.save(5, _tree(55))  # another save of step 5, whose local folder replaces ours below
    from checkpointer._manage import _tiers

    real = _tiers.replicate

    def replicate(target, *args, **kwargs):
        shutil.rmtree(target.local_path)
        shutil.copytree(other / "local" / "process-0" / "5", target.local_path)
        return real(target, *args, **kwargs)

    monkeypatch.setattr(_tiers, "replicate", replicate)
    mgr = ckpt.CheckpointManager(str(tmp_path / "durable"), local_directory=str(tmp_path / "local"))
    mgr.save(5, _tree(5))
    with pytest.raises(ckpt.CheckpointError, match="5"):
        mgr.wait_until_finished()
    mgr.close()
    assert ckpt.CheckpointManager(str(tmp_path / "durable"), read_only=True).all_steps() == []


# --- a number too large for a float in a file the library reads -----------------------------------

HUGE = 10**400  # valid JSON, parsed as a Python int; float() of it raises OverflowError


def _damage(path, edit):
    raw = json.loads(Path(path).read_text())
    edit(raw)
    Path(path).write_text(json.dumps(raw))


def test_a_manifest_dated_with_a_huge_integer_is_corrupt_and_retention_goes_on(tmp_path, caplog):
    """`created_unix_s` of 10**400 (a damaged or hostile manifest): `metadata`/`restore`
    raise the documented CorruptCheckpointError naming the manifest (not OverflowError), and
    the retention after each later commit still runs (it read the metrics through the
    same parse, and the OverflowError stopped it at every save: steps piled up)."""
    directory = str(tmp_path / "run")
    keep = ckpt.KeepLatest(1) | ckpt.KeepBest("loss")
    with ckpt.CheckpointManager(directory, keep=keep) as mgr:
        mgr.save(1, _tree(1), metrics={"loss": 0.5})
    _damage(tmp_path / "run" / "1" / "manifest.json", lambda raw: raw.update(created_unix_s=HUGE))
    for read in (ckpt.metadata, ckpt.restore):
        with pytest.raises(ckpt.CorruptCheckpointError, match="manifest of .*created_unix_s"):
            read(str(tmp_path / "run" / "1"))
    with ckpt.CheckpointManager(directory, keep=keep) as mgr:
        mgr.save(2, _tree(2), metrics={"loss": 0.1})
        mgr.save(3, _tree(3), metrics={"loss": 0.9})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]  # 1: no readable metrics, not the latest


@pytest.mark.parametrize("where", ["journal", "finished mark"])
def test_a_huge_integer_time_in_the_journal_or_finished_mark_is_never_an_overflow_error(tmp_path, where):
    """The same number in a journal line of a failed save (read by the status probe) and
    in the finished mark (read by followers): the documented outcome of each (the time
    unknown), never OverflowError out of the probe or the follower."""
    from checkpointer._manage import _follow

    directory = str(tmp_path / "run")
    with ckpt.CheckpointManager(directory) as mgr:
        mgr.save(1, _tree(1))
        mgr.wait_until_finished()
        mgr.close(finished=True)
    run = tmp_path / "run"
    if where == "journal":
        with open(run / ".checkpointer-journal.jsonl", "a") as f:
            f.write(json.dumps({"event": "save_failed", "step": 2, "process_index": 0, "error": "x", "unix_s": HUGE}) + "\n")
        status = ckpt.read_status(directory)
        assert status.latest_committed_step == 1 and status.last_failure.step == 2
    else:
        _damage(run / ".checkpointer-finished.json", lambda raw: raw.update(finished_unix_s=HUGE))
        mark = _follow.read_finished(ckpt.CheckpointManager(directory, read_only=True).storage, directory)
        assert mark is not None and mark.step == 1


def test_a_huge_integer_metric_is_refused_on_save_and_never_ranked_when_read(tmp_path):
    """`metrics={"loss": 10**400}` is a metric the rule cannot store as a float: the
    documented UnsupportedValueError, nothing saved. Read from a (damaged) manifest, such a
    metric is no number to rank: `KeepBest` and `best_step` skip it, and the retention
    after each commit goes on (OverflowError stopped it at every save)."""
    directory = str(tmp_path / "run")
    keep = ckpt.KeepLatest(1) | ckpt.KeepBest("loss")
    with ckpt.CheckpointManager(directory, keep=keep) as mgr:
        with pytest.raises(ckpt.UnsupportedValueError, match="loss"):
            mgr.save(1, _tree(1), metrics={"loss": HUGE})
        mgr.save(1, _tree(1), metrics={"loss": 0.5})
    _damage(tmp_path / "run" / "1" / "manifest.json", lambda raw: raw["user_metadata"]["metrics"].update(loss=HUGE))
    with ckpt.CheckpointManager(directory, keep=keep) as mgr:
        mgr.save(2, _tree(2), metrics={"loss": 0.9})
        mgr.save(3, _tree(3), metrics={"loss": 0.1})
        mgr.wait_until_finished()
        assert mgr.best_step("loss") == 3
        assert mgr.all_steps() == [3]  # 1: no metric to rank; 2: worse than 3


def test_plot_run_draws_a_run_whose_manifest_holds_a_huge_integer_metric(tmp_path):
    """`ckpt.plot_run` of a run with such a metric (a damaged manifest) leaves it out of the
    metric lines, as any value that is no finite number, instead of raising OverflowError."""
    pytest.importorskip("matplotlib")
    directory = str(tmp_path / "run")
    with ckpt.CheckpointManager(directory) as mgr:
        mgr.save(1, _tree(1), metrics={"loss": 0.5})
        mgr.save(2, _tree(2), metrics={"loss": 0.4})
    _damage(tmp_path / "run" / "1" / "manifest.json", lambda raw: raw["user_metadata"]["metrics"].update(loss=HUGE))
    assert ckpt.plot_run(directory) is not None


def test_a_save_crashed_beside_a_live_forked_child_is_recognised_and_cleaned_up(tmp_path):
    """The trainer forks a worker while a save is in flight (holding the save's lock,
    `<partial>.lock`), then is killed: the restart must see a crashed save, not one in
    flight (the status probe), and its first save removes the partial folder."""
    directory = str(tmp_path / "run")
    code = f"""
import multiprocessing, os, signal, time
import numpy as np
import checkpointer as ckpt
from checkpointer._storage import _local

real = _local.LocalStorage.write_file

def write_file(self, path, data):  # step 2's record: fork a worker, then die
    if path.endswith("processes/0.json") and "/2.partial-" in path:
        worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True)
        worker.start()
        print("worker", worker.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, path, data)

_local.LocalStorage.write_file = write_file
mgr = ckpt.CheckpointManager({directory!r})
mgr.save(1, {{"w": np.ones(4, np.float32)}})
mgr.wait_until_finished()
mgr.save(2, {{"w": np.ones(4, np.float32)}})
mgr.wait_until_finished()
"""
    rc, out = _python(code, tmp_path)
    assert rc == -signal.SIGKILL, out
    worker = int(out.split("worker ")[1].split()[0])
    try:
        assert [n for n in os.listdir(directory) if ".partial-" in n and not n.endswith(".lock")]  # the crashed save
        assert ckpt.read_status(directory).step_in_flight is None  # crashed, not in flight
        with ckpt.CheckpointManager(directory) as mgr:
            assert mgr.latest_step() == 1
            mgr.save(3, _tree(3))
        assert not [n for n in os.listdir(directory) if ".partial-" in n]
        assert ckpt.CheckpointManager(directory, read_only=True).all_steps() == [1, 3]
    finally:
        os.kill(worker, signal.SIGKILL)
