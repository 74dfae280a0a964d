"""The one commit sequence (`_commit.Commit`) across processes, with threads playing the
processes over a fake key-value store (no JAX processes): reports, records, publication,
the announcement, and what every process raises when one fails or is silent."""

import json
import os
import pathlib
import time

import pytest
from test_rendezvous import FakeKV, _run, _wait_deleted

import checkpointer as ckpt
from checkpointer._commit import Commit, commit_round
from checkpointer._format import process_record_name
from checkpointer._storage import LocalStorage


def _commit(kv, path, i, n, timeout_s=5.0):
    r = commit_round("g1", path, timeout_s)
    r.index, r.count, r._client = i, n, kv
    return Commit(LocalStorage(), path, "g1", overwrite=False, round=r)


def _write_records(commit, processes):
    os.makedirs(f"{commit.write_path}/processes", exist_ok=True)
    for i in processes:
        with open(f"{commit.write_path}/{process_record_name(i)}", "w") as f:
            f.write("{}")


def test_process_0_commits_with_every_process_bytes_and_the_others_return_after(tmp_path):
    kv, path = FakeKV(), str(tmp_path / "7")
    seen = []

    def body(i):
        c = _commit(kv, path, i, 2)
        _write_records(c, [i])
        c.run(10 * (i + 1), lambda pb: seen.append(pb) or json.dumps({"process_bytes_written": pb}).encode())
        return os.path.exists(f"{path}/COMMITTED")  # committed before anyone returns

    assert _run(2, body, delays={0: 0.2}) == [("ok", True), ("ok", True)]
    assert seen == [[10, 20]] and sorted(os.listdir(tmp_path)) == ["7"]
    assert json.loads(pathlib.Path(f"{path}/COMMITTED").read_text())["generation"] == "g1"
    assert _wait_deleted(kv, "commit/g1") == []


def test_a_process_error_fails_the_commit_at_once_on_every_process(tmp_path):
    kv, path = FakeKV(), str(tmp_path / "7")

    def body(i):
        c = _commit(kv, path, i, 3, timeout_s=30)
        if i == 2:
            c.fail(OSError("disk full"))
            return "failed"
        _write_records(c, [i])
        c.run(1, lambda pb: b"{}")

    t0 = time.monotonic()
    got = _run(3, body)
    assert time.monotonic() - t0 < 10
    message = f"process 2 failed to write its shards of {path}: OSError: disk full\nNothing was committed."
    assert got == [("SaveError", message), ("SaveError", message), ("ok", "failed")]
    deadline = time.monotonic() + 5  # process 0 removes the partial folder once every process reported
    while os.listdir(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.listdir(tmp_path) == []


def test_silent_processes_are_named_at_the_timeout(tmp_path):
    kv, path = FakeKV(), str(tmp_path / "7")
    c = _commit(kv, path, 0, 3, timeout_s=0.1)
    _write_records(c, [0])
    with pytest.raises(ckpt.CommitTimeoutError, match=r"processes \[1, 2\] did not report done within 0.1 s \(commit_timeout_s\)"):
        c.run(1, lambda pb: b"{}")
    assert os.listdir(tmp_path) == []  # taken for dead: the folder goes at once


def test_a_failed_publication_is_announced_to_the_others(tmp_path):
    kv, path = FakeKV(), str(tmp_path / "7")
    ckpt.save(path, {"x": 1})  # committed meanwhile by another save

    def body(i):
        c = _commit(kv, path, i, 2)
        _write_records(c, [i])
        c.run(1, lambda pb: b"{}")

    got = _run(2, body)
    assert got[0][0] == "CheckpointExistsError" and "was committed by another save" in got[0][1]
    assert got[1][0] == "SaveError" and got[1][1].startswith(f"process 0 could not commit {path}: CheckpointExistsError:")


def test_a_missing_record_commits_nothing(tmp_path):
    kv, path = FakeKV(), str(tmp_path / "7")

    def body(i):
        c = _commit(kv, path, i, 2)
        _write_records(c, [0])  # process 1 wrote elsewhere (saves called in another order)
        c.run(1, lambda pb: b"{}")

    got = _run(2, body)
    assert got[0][0] == "SaveError" and got[1] == ("SaveError", f"process 0 could not commit {path}: SaveError: {got[0][1]}"), got
    assert "processes [1] reported their shards durable but" in got[0][1] and "nothing was committed" in got[0][1]
    assert not os.path.exists(path)


def test_alone_it_commits_without_any_store(tmp_path):
    path = str(tmp_path / "7")
    c = Commit(LocalStorage(), path, "g1", overwrite=True, process_index=3)
    _write_records(c, [3])
    c.run(5, lambda pb: json.dumps(pb).encode(), marker={"generation": "g1", "tier": "local"})
    assert json.loads(pathlib.Path(f"{path}/manifest.json").read_text()) == [5]
    assert json.loads(pathlib.Path(f"{path}/COMMITTED").read_text()) == {"generation": "g1", "tier": "local"}
    c2 = Commit(LocalStorage(), path, "g2", overwrite=True, process_index=3)
    _write_records(c2, [3])
    c2.run(6, lambda pb: b"{}")  # a replacement is atomic: old moved aside, then removed
    assert json.loads(pathlib.Path(f"{path}/COMMITTED").read_text())["generation"] == "g2" and os.listdir(tmp_path) == ["7"]


def test_a_damaged_peer_record_at_commit_is_a_save_error_and_commits_nothing(tmp_path):
    """Process 0 reads the others' records for the pack index (`packs_of_save`): a
    damaged one fails the save as SaveError (what save documents), not as a
    CorruptCheckpointError escaping the commit, and every process learns it."""
    from checkpointer._encoding import packs_of_save

    kv, path = FakeKV(), str(tmp_path / "7")

    def body(i):
        c = _commit(kv, path, i, 2)
        _write_records(c, [0])
        if i == 1:
            pathlib.Path(f"{c.write_path}/{process_record_name(1)}").write_text('{"packed": {"file"')
        c.run(1, lambda pb: json.dumps(len(packs_of_save(c.storage, c.write_path, 0, None, 2))).encode())

    got = _run(2, body)
    assert got[0][0] == "SaveError", got
    assert f"committing {path} failed (process 0): a process record in" in got[0][1] and "Nothing was committed" in got[0][1]
    assert "processes/1.json" in got[0][1]
    assert got[1] == ("SaveError", f"process 0 could not commit {path}: SaveError: {got[0][1]}"), got
    assert not os.path.exists(path)


def _late_commit(kv, path, i, n):
    c = _commit(kv, path, i, 2, timeout_s=0.3)
    c.round.verdict_margin_s = 0.2  # process 1 gives up 0.5 s after process 0 arrived
    return c


def test_a_verdict_later_than_the_timeout_after_the_commit_is_a_success_everywhere(tmp_path):
    """Process 0 committed (the marker names this generation), then its verdict came
    after process 1's timeout (slow retention, slow storage): process 1 finds the
    commit in storage and returns as process 0 does, instead of raising an error
    that says nothing was committed."""
    kv, path = FakeKV(), str(tmp_path / "7")

    def body(i):
        c = _late_commit(kv, path, i, 2)
        _write_records(c, [i])
        c.run(1, lambda pb: b"{}", after_publish=lambda: time.sleep(1.5))

    assert _run(2, body) == [("ok", None), ("ok", None)]
    assert json.loads(pathlib.Path(f"{path}/COMMITTED").read_text())["generation"] == "g1"


def test_a_verdict_later_than_the_timeout_before_the_commit_does_not_say_nothing_was_committed(tmp_path):
    """Process 0 is still writing the manifest when process 1 gives up: process 1's
    CommitTimeoutError says the step may still be committed and how to tell (it is,
    once process 0 finishes), not "Nothing was committed"."""
    kv, path = FakeKV(), str(tmp_path / "7")

    def slow_manifest(pb):
        time.sleep(1.5)
        return b"{}"

    def body(i):
        c = _late_commit(kv, path, i, 2)
        _write_records(c, [i])
        c.run(1, slow_manifest)

    got = _run(2, body)
    assert got[0] == ("ok", None), got
    assert got[1][0] == "CommitTimeoutError" and "process 0 arrived but gave no verdict" in got[1][1], got
    assert f"so {path} may still be committed: it is if it has a COMMITTED marker" in got[1][1], got
    assert "Nothing was committed" not in got[1][1], got
    assert os.path.exists(f"{path}/COMMITTED")
