"""Many parties on one directory (issue 11), in one process: canonical step folders,
readers that take no lock, the writer's lazy lock, following a run, per-process state
with one process, and background failures nobody waited for."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import checkpointer as ckpt
from checkpointer._cli import _main as _cli
from checkpointer._commit import _directory
from checkpointer._storage import _kvstore as _storage


def _tree(value: float = 0.0) -> dict:
    return {"w": jax.numpy.arange(32, dtype=jax.numpy.float32).reshape(4, 8) + value, "step": int(value)}


def _cli_json(capsys, *argv):
    code = _cli.main([str(a) for a in argv] + ["--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


# --- canonical step folders ------------------------------------------------------------------


def test_step_names_are_canonical_decimals():
    assert [n for n in ("0", "7", "100000", "900000") if _directory.is_step_name(n)] == ["0", "7", "100000", "900000"]
    assert not [n for n in ("0900000", "00", "+5", "-5", "5 ", "²", "٣", "", "1e3") if _directory.is_step_name(n)]


def test_zero_padded_folder_is_foreign_to_listing_restore_retention_drill_and_gc(tmp_path, capsys):
    """The issue's small input: `run/100000` and `run/0900000` saved by hand."""
    run = str(tmp_path / "run")
    ckpt.save(f"{run}/100000", _tree(1))
    ckpt.save(f"{run}/0900000", _tree(9))
    os.makedirs(f"{run}/0900001.partial-20260101000000-deadbeef")  # foreign too, though it looks crashed
    foreign = ["0900000", "0900001.partial-20260101000000-deadbeef"]

    mgr = ckpt.CheckpointManager(run)
    assert mgr.all_steps() == [100000] and mgr.latest_step() == 100000
    assert float(mgr.restore()["w"][0, 0]) == 1.0  # the newest *step*, not the zero-padded folder
    with pytest.raises(ckpt.CheckpointNotFoundError):
        mgr.restore(900000)
    assert mgr.drill().step == 100000

    doc = _cli_json(capsys, "ls", run)
    assert [s["folder"] for s in doc["steps"]] == ["100000"] and doc["foreign"] == foreign
    code = _cli.main(["ls", run])
    out = capsys.readouterr().out
    assert code == 0 and "foreign" in out and "0900000" in out

    mgr.close()
    # Retention and recovery leave foreign entries alone.
    with ckpt.CheckpointManager(run, keep=ckpt.KeepLatest(1), async_save=False) as writer:
        for step in (100001, 100002):
            writer.save(step, _tree(step))
        assert writer.all_steps() == [100002]
    assert _cli_json(capsys, "gc", run, "--keep-latest", "1")["removed_partial"] == []
    assert sorted(n for n in os.listdir(run) if not n.startswith(".")) == ["0900000", "0900001.partial-20260101000000-deadbeef", "100002"]
    assert ckpt.metadata(f"{run}/0900000").step == 900000  # still a valid checkpoint at its own path


# --- readers take no lock, the writer's lock is taken lazily --------------------------------


def test_readers_beside_the_writer_take_no_lock_and_delete_nothing(tmp_path):
    run = str(tmp_path / "run")
    writer = ckpt.CheckpointManager(run, keep=ckpt.KeepLatest(5))
    writer.save(1, _tree(1))
    writer.wait_until_finished()
    crashed = f"{run}/2.partial-20260101000000-deadbeef"
    os.makedirs(crashed)
    reader = ckpt.CheckpointManager(run, read_only=True)
    also_reader = ckpt.CheckpointManager(run)  # any manager reads without the lock
    for mgr in (reader, also_reader):
        assert mgr.all_steps() == [1] and mgr.latest_step() == 1 and mgr.status().latest_committed_step == 1
        assert float(mgr.restore()["w"][0, 0]) == 1.0
        assert mgr.drill().ok
    assert os.path.isdir(crashed)  # readers removed nothing
    with pytest.raises(ckpt.CheckpointError, match="read_only"):
        reader.save(2, _tree(2))
    with pytest.raises(ckpt.CheckpointError, match="read_only"):
        reader.recover()
    writer.save(3, _tree(3))  # the writer goes on while readers are open
    writer.close()
    assert reader.all_steps() == [1, 3]
    reader.close()
    also_reader.close()


def test_notebook_reopen_after_dropping_a_manager(tmp_path):
    """A notebook cell run twice: the first manager is dropped without close()."""
    run = str(tmp_path / "run")
    mgr = ckpt.CheckpointManager(run)
    mgr.save(1, _tree(1))
    mgr.wait_until_finished()
    second = ckpt.CheckpointManager(run)
    with pytest.raises(ckpt.CheckpointError) as e:
        second.save(2, _tree(2))  # the first one still holds the writer's lock, and is referenced
    msg = str(e.value)
    del e  # its traceback refers to `second`
    assert f"this same process (pid {os.getpid()})" in msg and "close()" in msg and "del" in msg
    del mgr  # the cell runs again: the old manager is no longer referenced
    second.save(2, _tree(2))
    second.wait_until_finished()
    assert second.all_steps() == [1, 2]
    del second
    third = ckpt.CheckpointManager(run)  # garbage collection released the lock
    third.save(3, _tree(3))
    third.close()
    assert ckpt.CheckpointManager(run, read_only=True).all_steps() == [1, 2, 3]


def test_lock_of_another_process_names_it_and_is_released_at_exit(tmp_path):
    run = str(tmp_path / "run")
    code = (
        "import sys, numpy as np, checkpointer as ckpt\n"
        f"mgr = ckpt.CheckpointManager({run!r}, async_save=False)\n"
        "mgr.save(1, {'w': np.ones(4)})\n"
        "print('saved', flush=True)\n"
        "sys.stdin.readline()\n"  # holds the lock (no close) until told to exit
    )
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        try:
            assert p.stdout.readline().strip() == "saved"
            mgr = ckpt.CheckpointManager(run)
            assert mgr.all_steps() == [1]
            with pytest.raises(ckpt.CheckpointError, match=rf"another CheckpointManager is using .*pid {p.pid} "):
                mgr.save(2, _tree(2))
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.wait(60) == 0
        finally:
            p.kill()
    mgr.save(2, _tree(2))  # the exit released it
    mgr.close()


# --- following a run ---------------------------------------------------------------------------


def test_wait_for_step_and_follow(tmp_path):
    run = str(tmp_path / "run")
    reader = ckpt.CheckpointManager(run, read_only=True)
    assert reader.wait_for_step(timeout_s=0.2, poll_s=0.05) is None  # nothing yet (and no directory)
    with ckpt.CheckpointManager(run, keep=ckpt.KeepLatest(10), async_save=False) as writer:
        for step in (1, 2, 5):
            writer.save(step, _tree(step))
    assert reader.wait_for_step(timeout_s=0.2, poll_s=0.05) == 5
    assert reader.wait_for_step(after=2, timeout_s=0.2, poll_s=0.05) == 5
    assert reader.wait_for_step(after=5, timeout_s=0.2, poll_s=0.05) is None
    assert list(reader.follow(timeout_s=0.2, poll_s=0.05)) == [1, 2, 5]
    assert list(reader.follow(after=1, timeout_s=0.2, poll_s=0.05)) == [2, 5]
    with pytest.raises(ValueError, match="poll_s"):
        reader.wait_for_step(poll_s=0)


def test_follow_beside_a_writer_with_retention_restores_exactly_or_not_found(tmp_path):
    """A writer thread saves ten steps with KeepLatest(2); the follower restores each
    step it is shown: bit-exact, or CheckpointNotFoundError if retention was faster."""
    import threading

    run = str(tmp_path / "run")
    writer = ckpt.CheckpointManager(run, keep=ckpt.KeepLatest(2))

    def write():
        for step in range(1, 11):
            writer.save(step, _tree(step))
        writer.close()

    t = threading.Thread(target=write)
    t.start()
    restored, missing = [], []
    reader = ckpt.CheckpointManager(run, read_only=True)
    for step in reader.follow(timeout_s=60, poll_s=0.01):
        try:
            tree = reader.restore(step)
        except ckpt.CheckpointNotFoundError:
            missing.append(step)
        else:
            np.testing.assert_array_equal(tree["w"], np.asarray(_tree(step)["w"]))
            assert tree["step"] == step
            restored.append(step)
        if step == 10:
            break
    t.join(60)
    assert restored and restored[-1] == 10 and sorted(restored + missing) == sorted(set(restored + missing))
    assert reader.all_steps() == [9, 10]


@pytest.mark.parametrize("how", ["renamed", "removed"])
def test_step_deleted_while_it_is_restored_is_not_found(tmp_path, monkeypatch, how):
    """Retention renames the folder away, then removes it, in the middle of a read."""
    from checkpointer._encoding import _read

    run = str(tmp_path / "run")
    # Unpacked: the read intercepted is a zarr shard file's (packed leaves: tests/test_pack.py).
    ckpt.save(f"{run}/1", {"a": np.arange(64.0), "b": np.ones((8, 8), np.float32)}, pack_small_leaves_bytes=0)
    storage, directory = _storage.storage_for(run)
    real = _read.read_chunk_index
    calls = []

    def delete_then_read(*args, **kwargs):
        if not calls:
            moved = _directory.unpublish_step(storage, directory, 1)
            if how == "removed":
                storage.delete_tree(moved)
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_read, "read_chunk_index", delete_then_read)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="deleted"):
        ckpt.restore(f"{run}/1")
    assert calls


def test_step_deleted_while_its_manifest_is_read_is_not_found(tmp_path, monkeypatch):
    """An OSError that is not wrapped as damage (here from reading the manifest of a
    step that vanished) is reported as not found too, once the marker is gone."""
    from checkpointer._restore import _pipeline as _restore

    run = str(tmp_path / "run")
    ckpt.save(f"{run}/1", {"a": np.arange(4.0)})
    storage, directory = _storage.storage_for(run)
    real = _restore.read_metadata

    def vanish(storage_, path):
        storage.delete_tree(_directory.unpublish_step(storage, directory, 1))
        raise PermissionError(13, "Permission denied", f"{path}/manifest.json")

    monkeypatch.setattr(_restore, "read_metadata", vanish)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="deleted"):
        ckpt.restore(f"{run}/1")
    monkeypatch.setattr(_restore, "read_metadata", real)


# --- no silent failures -------------------------------------------------------------------------


def test_failed_save_async_nobody_waited_on_is_logged_at_exit(tmp_path):
    """The issue's small input: save_async, no wait(), the write fails, the program exits."""
    (tmp_path / "a-file").write_text("")
    code = (
        "import numpy as np, checkpointer as ckpt\n"
        f"handle = ckpt.save_async({str(tmp_path / 'a-file' / '1')!r}, {{'w': np.ones(4)}})\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "failed and nobody called wait()" in res.stderr and "a-file/1" in res.stderr, res.stderr
    assert "SaveError" in res.stderr, res.stderr


def test_failed_save_async_is_logged_once_when_dropped_and_never_when_waited(tmp_path, caplog):
    import gc
    import logging

    (tmp_path / "a-file").write_text("")
    caplog.set_level(logging.ERROR, logger="checkpointer")
    handle = ckpt.save_async(str(tmp_path / "a-file" / "1"), {"w": np.ones(4)})
    with pytest.raises(ckpt.SaveError):
        handle.wait()
    del handle
    gc.collect()
    assert not [r for r in caplog.records if "nobody called wait()" in r.getMessage()]

    handle = ckpt.save_async(str(tmp_path / "a-file" / "2"), {"w": np.ones(4)})
    handle._thread.join(60)
    del handle  # dropped without wait()
    gc.collect()
    logged = [r for r in caplog.records if "nobody called wait()" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR and "a-file/2" in logged[0].getMessage()


def test_failed_save_async_dropped_while_running_is_logged_when_it_fails(tmp_path, caplog, monkeypatch):
    import logging
    import threading

    from checkpointer._save import _pipeline as _save

    release = threading.Event()

    def failing_write(snap):
        release.wait(30)
        raise ckpt.SaveError(f"injected failure writing {snap.path}: No space left on device")

    monkeypatch.setattr(_save, "write_snapshot", failing_write)
    caplog.set_level(logging.ERROR, logger="checkpointer")
    handle = ckpt.save_async(str(tmp_path / "3"), {"w": np.ones(4)})
    thread = handle._thread
    del handle  # collected at once: the thread refers to it only weakly
    release.set()
    thread.join(60)
    logged = [r.getMessage() for r in caplog.records if "nobody called wait()" in r.getMessage()]
    assert len(logged) == 1 and "No space left on device" in logged[0], logged


# --- per-process state (one process; the multi-process rule is in test_multiprocess) ----------


def test_per_process_state_round_trips_in_the_process_record(tmp_path):
    loader = {"epoch": 3, "position": 12345, "files": ["a", "b"], "seed": (7, 8)}
    ckpt.save(str(tmp_path / "1"), _tree(1), per_process_state=loader)
    want = dict(loader, seed=[7, 8])  # JSON: tuples come back as lists
    assert ckpt.per_process_state(str(tmp_path / "1")) == want
    assert ckpt.per_process_state(str(tmp_path / "1"), process_index=0) == want
    assert ckpt.per_process_state(str(tmp_path / "1"), all_processes=True) == [want]
    with open(tmp_path / "1" / "processes" / "0.json") as f:
        assert json.load(f)["per_process_state"] == want
    with open(tmp_path / "1" / "manifest.json") as f:
        assert "12345" not in f.read()  # never in the manifest
    assert set(ckpt.restore(str(tmp_path / "1"))) == {"w", "step"}  # restore returns the tree only
    with pytest.raises(ValueError, match=r"process_index must be an int in \[0, 1\)"):
        ckpt.per_process_state(str(tmp_path / "1"), process_index=1)

    ckpt.save(str(tmp_path / "2"), _tree(2))  # none given: None, and no field in the record
    assert ckpt.per_process_state(str(tmp_path / "2")) is None
    with pytest.raises(ckpt.UnsupportedValueError, match="per_process_state .* not JSON-serialisable"):
        ckpt.save(str(tmp_path / "3"), _tree(3), per_process_state={"it": object()})
    assert not os.path.exists(tmp_path / "3")
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.per_process_state(str(tmp_path / "3"))

    with ckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(10, _tree(10), per_process_state={"position": 10})
        mgr.save(20, _tree(20), per_process_state={"position": 20})
        mgr.wait_until_finished()
        assert mgr.per_process_state() == {"position": 20} and mgr.per_process_state(10) == {"position": 10}
        assert mgr.per_process_state(10, all_processes=True) == [{"position": 10}]


def test_a_process_record_of_another_process_is_corrupt_naming_both(tmp_path):
    path = str(tmp_path / "1")
    ckpt.save(path, _tree(1), per_process_state={"position": 1})
    with open(f"{path}/processes/0.json") as f:
        record = json.load(f)
    record["process_index"] = 3
    with open(f"{path}/processes/0.json", "w") as f:
        json.dump(record, f)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"processes/0.json is the record of process 3, expected process 0"):
        ckpt.per_process_state(path)
    os.remove(f"{path}/processes/0.json")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"has no processes/0.json.*checkpointer verify"):
        ckpt.per_process_state(path)
