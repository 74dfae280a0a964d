"""Several real JAX processes under `jax.distributed`: save, elastic restore, dedup,
failures during a save, and the manager's once-only retention.

Each test starts local processes with `tests/multiprocess.py` (CPU devices simulated by
XLA_FLAGS) running a worker script from `tests/mp_workers/`; workers report JSON records.
One checkpoint saved by 2 processes x 4 devices is shared by the restore and dedup tests.
"""

import json
import os
import sys
import time
from pathlib import Path

import pytest
from multiprocess import WORKERS, ProcessesFailed, describe_all, run_processes

import checkpointer as ckpt

sys.path.insert(0, str(WORKERS))
import _common  # noqa: E402  (the worker-side definitions of the test tree)

COMMITTED = "COMMITTED"


def _listing(root) -> list[str]:
    """Every file and folder under `root`, relative, sorted."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in dirs + files]
    return sorted(out)


def _assert_nothing_committed(directory, step: int, entries=None) -> None:
    entries = _listing(directory) if entries is None else entries
    assert not [e for e in entries if os.path.basename(e) == COMMITTED], entries
    tops = {e.split(os.sep)[0] for e in entries}
    assert not [t for t in tops if t.startswith(str(step)) and ".partial-" not in t], tops


# --- 1. save with 2 processes x 4 devices ------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint saved by 2 processes x 4 devices on a 2x4 ('data', 'model') mesh."""
    path = str(tmp_path_factory.mktemp("mp_saved") / "100")
    t0 = time.monotonic()
    results = run_processes(WORKERS / "save_worker.py", 2, 4, {"path": path}, timeout_s=120)
    return {"path": path, "results": results, "elapsed_s": time.monotonic() - t0}


@pytest.mark.multiprocess
def test_save_with_two_processes_commits_one_checkpoint(saved):
    path = saved["path"]
    records = [r.record("saved") for r in saved["results"]]
    # Process 0 holds devices 0-3 (mesh row data=0), process 1 the others.
    assert records[0]["local_devices"] != records[1]["local_devices"]
    # What each process holds with replica_id 0: replicated leaves only on process 0.
    assert records[1]["replica0_origins"]["emb"] == [] and records[1]["replica0_origins"]["rep"] == []
    assert len(records[0]["replica0_origins"]["w"]) == len(records[1]["replica0_origins"]["w"]) == 4
    # Per-process state round-trips: each process gets its own record back.
    states = [_common.loader_state(i) for i in range(2)]
    assert [r["own_state"] for r in records] == states and all(r["all_states"] == states for r in records)

    parent = os.path.dirname(path)
    assert sorted(os.listdir(parent)) == ["100"]  # renamed into place, no partial folder left
    for name in ("manifest.json", COMMITTED, "processes/0.json", "processes/1.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["process_count"] == 2 and manifest["step"] == 100

    meta = ckpt.metadata(path)
    g = _common.global_arrays()
    for name in _common.SAVE_SPECS:
        a = meta.arrays[name]
        assert a.shape == g[name].shape and a.dtype == g[name].dtype, name
        assert a.saved_sharding.mesh_shape == (2, 4) and a.saved_sharding.mesh_axis_names == ("data", "model")
    # The whole tree, read back in this (single) process as host arrays.
    host = ckpt.restore(path)
    for name, want in g.items():
        assert _common.same_bits(host[name], want), name
    for k, v in _common.VALUES.items():
        assert host[k] == v and type(host[k]) is type(v)


# --- 2. restore onto other process counts and meshes ---------------------------------------

SAME = dict(_common.SAVE_SPECS)
SWAPPED = {"w": ["model", "data"], "emb": [None, "data"], "rep": [], "bf": ["model", None], "ids": ["model"]}
REPLICATED = {k: [] for k in SAME}
ONE_D = {"w": ["d"], "emb": [None, "d"], "rep": ["d"], "bf": [None, "d"], "ids": ["d"]}

# (processes, devices per process, targets)
LAYOUTS = {
    "1x8": (1, 8, [("4x2", [4, 2], ["data", "model"], SAME), ("8", [8], ["d"], ONE_D)]),
    "1x4": (1, 4, [("2x2", [2, 2], ["data", "model"], SAME)]),
    "4x2": (4, 2, [("4x2", [4, 2], ["data", "model"], SAME), ("2x4-swapped", [2, 4], ["data", "model"], SWAPPED)]),
    "1x1": (1, 1, [("1", [1], ["d"], REPLICATED)]),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_restore_onto_other_process_counts_is_bit_exact(saved, layout):
    n, d, targets = LAYOUTS[layout]
    args = {
        "path": saved["path"],
        "targets": [{"name": t, "mesh_shape": s, "axis_names": a, "specs": sp} for t, s, a, sp in targets],
    }
    results = run_processes(WORKERS / "restore_worker.py", n, d, args, timeout_s=120)
    for r in results:
        got = {rec["name"]: rec for rec in r.records if rec["event"] == "restored"}
        assert sorted(got) == sorted(t[0] for t in targets), r.describe()
        for name, rec in got.items():
            assert rec["ok"] and rec["mismatches"] == [], (layout, name, r.process_id, rec["mismatches"])
            assert rec["checked_shards"] >= len(_common.ARRAY_LEAVES) * d
            # The plan of each process covers exactly its own devices' unique boxes.
            assert rec["bytes_needed"] == rec["expected_bytes"], (layout, name, r.process_id, rec)
            if n > 1:  # and so, with several processes, not the whole checkpoint
                assert rec["bytes_needed"] < rec["total_bytes"], (layout, name, r.process_id, rec)
            else:
                assert rec["bytes_needed"] == rec["total_bytes"]
        # Per-process state saved by 2 processes, read by n: the documented rule.
        states = r.record("per_process_state")
        assert states["all"] == [_common.loader_state(0), _common.loader_state(1)], r.describe()
        assert states["own_error"] == "ProcessCountMismatchError" and states["own"] is None, states
        assert states["by_index"] == _common.loader_state(r.process_id % 2), states


# --- 3. on-disk dedup ------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_replicas_are_written_once(saved):
    path = Path(saved["path"])
    # Chunk files: zarr shard files under arrays/ and each process's pack of small leaves under packed/.
    chunk_files = {
        str(p.relative_to(path)): p.stat().st_size
        for p in path.rglob("*")
        if p.is_file() and p.relative_to(path).parts[0] in ("arrays", "packed") and "/c/" in f"/{p.relative_to(path).as_posix()}"
    }
    leaf_bytes = sum(g.nbytes for g in _common.global_arrays().values())
    on_disk = sum(chunk_files.values())
    assert leaf_bytes <= on_disk <= leaf_bytes * 1.02, (on_disk, leaf_bytes)

    keys = {}
    for i in range(2):
        with open(path / "processes" / f"{i}.json") as f:
            record = json.load(f)
        assert record["process_index"] == i
        for c in record["chunks"]:
            assert c["key"] not in keys, f"chunk {c['key']} written by processes {keys[c['key']]} and {i}"
            keys[c["key"]] = i
            assert chunk_files.get(c["key"]) == c["bytes"], (c, chunk_files.get(c["key"]))
    assert set(keys) == set(chunk_files), (sorted(set(keys) ^ set(chunk_files)))
    # Both processes wrote something: the sharded leaves are split between them.
    assert set(keys.values()) == {0, 1}
    # The tree's leaves are small (chunks <= 256 KiB): each process packed the chunks it
    # owns into its own pack (tests/test_pack.py; restores of it: the tests above).
    assert {k: i for k, i in keys.items() if k.startswith("packed/")} == {"packed/process-0/c/0": 0, "packed/process-1/c/0": 1}


# --- 4. a process dies during an async save ------------------------------------------------

# mode: (extra env for the workers, jax.distributed heartbeat timeout, commit_timeout_s)
KILL_MODES = {
    # jax_enable_recoverability: the coordination service tolerates the dead peer, so
    # process 0 lives on and its commit times out, naming process 1.
    "recoverable": ({"MP_RECOVERABLE": "1"}, 10, 10),
    # Default runtime, heartbeat timeout longer than the commit timeout: the commit
    # times out first (the worker exits right after, before the heartbeat would fire).
    "heartbeat_after_commit_timeout": ({}, 40, 10),
    # Default runtime, heartbeat timeout shorter than the commit timeout: jax.distributed
    # aborts process 0 (SIGABRT) once it notices the dead peer, before the commit timeout.
    "heartbeat_first": ({}, 5, 60),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", list(KILL_MODES))
def test_killed_process_during_async_save_commits_nothing(tmp_path, mode):
    env, heartbeat_s, commit_timeout_s = KILL_MODES[mode]
    path = str(tmp_path / "run" / "5")
    args = {"path": path, "victim": 1, "commit_timeout_s": commit_timeout_s, "wait_timeout_s": commit_timeout_s + 60}
    results = run_processes(
        WORKERS / "kill_worker.py", 2, 4, args, timeout_s=commit_timeout_s + 60, fail_fast=False, check=False,
        env=env, heartbeat_timeout_s=heartbeat_s,
    )
    p0, p1 = results
    info = describe_all(results)
    assert p1.returncode == -9, info  # SIGKILL, after its snapshot
    p1.record("snapshot_taken")
    p0.record("snapshot_taken")
    _assert_nothing_committed(tmp_path / "run", 5)

    if mode == "heartbeat_first":
        # jax.distributed terminates process 0; nothing reaches wait(). The runtime's
        # message names the dead process (task 1).
        assert p0.returncode not in (0, None), info
        assert not [r for r in p0.records if r["event"] in ("wait_raised", "wait_returned")], info
        assert "stopped sending heartbeats" in p0.stderr and "\n1\n" in p0.stderr, info
        assert p0.elapsed_s < commit_timeout_s, info  # long before the commit timeout
        return

    assert p0.returncode == 0, info
    raised = p0.record("wait_raised")
    assert raised["is_checkpoint_error"], raised
    assert raised["type"] in ("CommitTimeoutError", "SaveError"), raised
    assert "[1]" in raised["message"] or "process 1" in raised["message"], raised
    assert raised["elapsed_s"] < commit_timeout_s + 10, raised
    # Process 0 removed its partial folder after the failure: nothing is left at all.
    _assert_nothing_committed(tmp_path / "run", 5, p0.record("listing")["entries"])
    assert p0.record("listing")["entries"] == [], raised


# --- 5. write failures are reported to every process at once -------------------------------

FAIL_CASES = {
    # Process 0's own write fails: the others learn it as soon as they finish writing,
    # instead of waiting for the commit timeout. (Process 1 writes 3 s late so that it does
    # not write while process 0 removes the partial folder, which fails its write with an
    # unrelated FileNotFoundError; see the note at the end of the test.)
    "process0": (2, {"failer": 0, "slow": {"1": 3}}),
    # Process 2 fails while process 1 is still writing: process 0 raises without waiting
    # for process 1 first.
    "process2-while-1-writes": (3, {"failer": 2, "slow": {"1": 8}}),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(FAIL_CASES))
def test_write_failure_is_raised_everywhere_promptly(tmp_path, case):
    n, extra = FAIL_CASES[case]
    commit_timeout_s = 30
    args = {"path": str(tmp_path / "run" / "5"), "commit_timeout_s": commit_timeout_s, **extra}
    # check=False: what is tested is what each process's wait() raised (its records);
    # after a peer's failure, jax.distributed's shutdown barrier may abort a process on
    # its way out (SIGABRT in the runtime's destructor), which is not the library's doing.
    results = run_processes(WORKERS / "fail_worker.py", n, 4, args, timeout_s=90, check=False)
    failer = extra["failer"]
    for r in results:
        raised = r.record("wait_raised")
        assert raised["is_checkpoint_error"] and raised["type"] == "SaveError", r.describe()
        assert f"process {failer}" in raised["message"] or r.process_id == failer, raised
    # Process 0 raises within seconds of the failure, long before the commit timeout.
    assert results[0].record("wait_raised")["elapsed_s"] < 5, describe_all(results)
    if case == "process0":
        assert results[1].record("wait_raised")["elapsed_s"] < 10, describe_all(results)
    # Nothing is committed. (A `.partial-*` folder may be left behind: process 0 removes
    # it while slower processes may still write into it; garbage collection removes it.)
    _assert_nothing_committed(tmp_path / "run", 5)


# --- 6. the manager's retention runs once, on process 0 -----------------------------------


@pytest.mark.multiprocess
def test_manager_retention_runs_once_on_process_0(tmp_path):
    directory = str(tmp_path / "run")
    results = run_processes(
        WORKERS / "manager_worker.py", 2, 4, {"directory": directory, "steps": [1, 2, 3, 4], "keep": 2}, timeout_s=120
    )
    info = describe_all(results)
    assert results[0].record("deleted")["steps"] == [1, 2], info
    assert results[1].record("deleted")["steps"] == [], info
    done0, done1 = results[0].record("done"), results[1].record("done")
    assert done0["all_steps"] == [3, 4] and done0["latest_step"] == 4, info
    # Process 1 may still list a step process 0 is about to delete (retention runs after
    # the commit is announced), but never misses a committed one.
    assert done1["latest_step"] == 4 and {3, 4} <= set(done1["all_steps"]), info
    assert done0["restored_step"] == done1["restored_step"] == 4 and done0["w_ok"] and done1["w_ok"], info
    assert [e for e in results[0].record("listing")["entries"] if not e.startswith(".")] == ["3", "4"]
    assert sorted(e for e in os.listdir(directory) if not e.startswith(".")) == ["3", "4"]
    with ckpt.CheckpointManager(directory) as mngr:  # a fresh manager agrees
        assert mngr.all_steps() == [3, 4]


# --- the harness itself -----------------------------------------------------------------


@pytest.mark.multiprocess
def test_harness_kills_hung_processes_and_reports_their_output(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import sys, time\nprint('started', flush=True)\nprint('oops', file=sys.stderr, flush=True)\ntime.sleep(600)\n")
    t0 = time.monotonic()
    with pytest.raises(ProcessesFailed) as e:
        run_processes(script, 2, 1, {}, timeout_s=3)
    assert time.monotonic() - t0 < 15
    msg = str(e.value)
    assert "did not finish within 3 s" in msg and msg.count("started") == 2 and msg.count("oops") == 2
    assert "process 1 (killed by the harness" in msg



# --- 7. processes that disagree fail fast, before anything is written ----------------------

DISAGREEMENTS = ["steps", "directories", "trees", "values", "refused", "refused0"]


@pytest.mark.multiprocess
def test_processes_that_disagree_raise_within_seconds_and_write_nothing(tmp_path):
    cases = DISAGREEMENTS + ["agreed", "absent"]
    args = {"directory": str(tmp_path), "cases": cases, "agreement_timeout_s": 3}
    results = run_processes(WORKERS / "agreement_worker.py", 2, 2, args, timeout_s=150)
    info = describe_all(results)
    got = [{rec["case"]: rec for rec in r.records if rec["event"] == "case"} for r in results]
    assert all(sorted(g) == sorted(cases) for g in got), info
    for case in DISAGREEMENTS:
        for i, rec in enumerate(g[case] for g in got):
            assert rec["elapsed_s"] < 10, (case, i, rec)
            refuser = {"refused": 1, "refused0": 0}.get(case)
            if i == refuser:  # its own reason, raised before the agreement
                assert rec["type"] == "UnsupportedValueError" and "'extra'" in rec["message"], rec
                continue
            assert rec["type"] == "SaveAgreementError", (case, i, rec)
            if refuser is None:
                assert "process 0" in rec["message"] and "process 1" in rec["message"], (case, i, rec)
            else:
                assert f"process {refuser} (" in rec["message"] and "UnsupportedValueError" in rec["message"], (case, i, rec)
    msgs = {case: got[0][case]["message"] for case in DISAGREEMENTS}
    assert f"{tmp_path}/steps/1 (step 1)" in msgs["steps"] and f"{tmp_path}/steps/2 (step 2)" in msgs["steps"]
    assert f"{tmp_path}/dir-0/1" in msgs["directories"] and f"{tmp_path}/dir-1/1" in msgs["directories"]
    assert "leaf ['w']" in msgs["trees"] and "float32[8, 4]" in msgs["trees"] and "float32[16, 4]" in msgs["trees"]
    assert "leaf ['epoch']" in msgs["values"] and "process 0: 1" in msgs["values"] and "process 1: 2" in msgs["values"]
    assert got[1]["values"]["message"] == msgs["values"]  # every process gets the same verdict
    # Nothing was written for any disagreement: no commit marker, no partial folder (the
    # manager's own lock and its journal, which records the failed save, may be there).
    own = {".checkpointer.lock", ".checkpointer-journal.jsonl"}
    for case_dir in ("steps", "dir-0", "dir-1", "trees", "values", "refused", "refused0"):
        left = [e for e in _listing(tmp_path / case_dir) if e not in own] if (tmp_path / case_dir).exists() else []
        assert left == [], (case_dir, left)
    # The saves after the failures still line up, and commit.
    assert got[0]["agreed"]["type"] is None and got[1]["agreed"]["type"] is None, info
    assert ckpt.verify(str(tmp_path / "agreed" / "1")).ok
    # A process that never arrives is named, after the agreement timeout.
    absent = got[0]["absent"]
    assert absent["type"] == "SaveAgreementError" and "processes [1] did not arrive within 3 s" in absent["message"], absent
    assert 3 <= absent["elapsed_s"] < 10, absent
    assert not (tmp_path / "absent").exists() or _listing(tmp_path / "absent") == []


@pytest.mark.multiprocess
def test_a_process_that_fails_before_the_managers_snapshot_refuses_and_later_saves_stay_in_step(tmp_path):
    """Process 1 fails in `CheckpointManager.save`'s own checks (a metadata value), before
    the snapshot that numbers the save: process 0 raises at once naming it, and the
    next save still pairs with the same save on process 1 and commits."""
    args = {"directory": str(tmp_path), "cases": ["manager_refused", "agreed"], "agreement_timeout_s": 3}
    results = run_processes(WORKERS / "agreement_worker.py", 2, 2, args, timeout_s=150)
    got = [{rec["case"]: rec for rec in r.records if rec["event"] == "case"} for r in results]
    info = describe_all(results)
    refused0, refused1 = got[0]["manager_refused"], got[1]["manager_refused"]
    assert refused1["type"] == "UnsupportedValueError" and "metadata['extra']" in refused1["message"], (refused1, info)
    assert refused0["type"] == "SaveAgreementError" and "process 1 (" in refused0["message"], (refused0, info)
    assert "UnsupportedValueError" in refused0["message"] and "did not arrive" not in refused0["message"], refused0
    assert [g["agreed"]["type"] for g in got] == [None, None], info
    assert ckpt.verify(str(tmp_path / "agreed" / "1")).ok


# --- 8. an evaluation job follows a writer --------------------------------------------------


@pytest.mark.multiprocess
def test_evaluation_process_follows_a_writer_with_retention(tmp_path):
    steps = 10
    args = {"directory": str(tmp_path / "run"), "steps": steps, "pause_s": 0.5}
    results = run_processes(WORKERS / "follow_worker.py", 2, 1, args, timeout_s=240, distributed=False)
    info = describe_all(results)
    assert results[0].record("written")["all_steps"] == [steps - 1, steps], info
    seen = [rec for rec in results[1].records if rec["event"] == "seen"]
    outcomes = {rec["step"]: rec["outcome"] for rec in seen}
    assert [rec["step"] for rec in seen] == sorted(outcomes), info  # ascending, each once
    assert set(outcomes.values()) <= {"exact", "not found"}, outcomes
    assert sum(o == "exact" for o in outcomes.values()) >= 8 and outcomes[steps] == "exact", outcomes
    results[1].record("done")


# --- 9. every meeting of the processes is one rendezvous round, deleted once finished ------


@pytest.mark.multiprocess
def test_finished_rounds_leave_no_keys_in_the_coordination_service(tmp_path):
    results = run_processes(WORKERS / "rounds_worker.py", 2, 4, {"directory": str(tmp_path)}, timeout_s=180)
    recs = [r.record("rounds") for r in results]
    assert recs[0]["refused_type"] == "SaveAgreementError" and recs[1]["refused_type"] == "UnsupportedValueError", recs
    assert recs[0]["leftover"] == [], recs[0]
    assert ckpt.verify(str(tmp_path / "run" / "1")).ok
