"""Local steps held by peers, with real processes: 4 processes x 2 devices as 4 simulated
nodes (`peer_node="node-<i>"`), local saves every 10 steps and durable ones every 100.

A node loss is its local folder wiped (`LOCAL/process-<i>/`: its own steps and the copies
it held of others'). Holders of process p's copies (k = 1): process p+1 (mod 4); k = 2:
p+1 and p+2."""

import collections
import glob
import json
import os
import shutil

import pytest
from multiprocess import WORKERS, run_processes

import checkpointer as ckpt

WORKER = WORKERS / "peers_worker.py"
STEPS = [100, 110, 120]  # 100 durable (durable_every_steps=100), 110 and 120 local + peers


def _save(tmp_path, k, **extra):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    args = {"directory": durable, "local": local, "phase": "save", "steps": STEPS, "peer_copies": k,
            "durable_every_steps": 100, **extra}
    results = run_processes(WORKER, 4, 2, args, timeout_s=240)
    return args, results


def _restore(args, processes=4, devices=2, **extra):
    return run_processes(WORKER, processes, devices, dict(args, phase="restore", **extra), timeout_s=240)


def _copy(args, tmp_path, name, lost=()):
    """A copy of the saved run (durable and local folders) for one scenario, the nodes of
    the processes in `lost` replaced: their local folders (their own steps and the copies
    they held of others') wiped."""
    out = dict(args)
    for key in ("directory", "local"):
        out[key] = str(tmp_path / name / key)
        shutil.copytree(args[key], out[key])
    for p in lost:
        shutil.rmtree(f"{out['local']}/process-{p}")
    return out


@pytest.fixture(scope="module")
def saved_k1(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k1")
    args, results = _save(tmp, 1, count_retention=True)
    return tmp, args, results


@pytest.mark.slow
def test_with_one_peer_copy_a_lost_node_resumes_from_the_newest_local_step_reading_nothing_durable(saved_k1, capsys):
    tmp, args, results = saved_k1
    for r in results:
        saved = r.record("saved")
        # Only step 100 is durable; the newest local step survives one node loss in the whole job.
        assert saved["all_steps"] == [100] and saved["local_steps"] == [120], r.describe()
        assert saved["survives"].get("120") == 1 and saved["peer_error"] is None, r.describe()
    # The holder of process 1's copies is process 2 (the next node).
    assert glob.glob(f"{args['local']}/process-2/peer-copies/process-1/120/COMMITTED")
    # The probe reports the same from the journal.
    assert ckpt.read_status(args["directory"]).node_losses_survived == {120: 1}
    from checkpointer._cli import _main as cli

    assert cli.main(["status", args["directory"]]) == 0
    out = capsys.readouterr().out
    assert "node losses survived" in out and "step 120: 1" in out, out
    run = _copy(args, tmp, "one-lost", lost=[1])  # node 1 replaced: its own steps and the copies it held
    for r in _restore(run):
        rec = r.record("restored")
        assert rec["step"] == 120 and rec["mismatches"] == [], r.describe()
        assert rec["durable_bytes"] == 0 and rec["source"] == "local", r.describe()


@pytest.mark.slow
def test_with_peer_copies_local_retention_runs_once_per_event_that_can_free_a_step(saved_k1):
    # Local saves 100 (durable), 110 and 120, one peer copy each. The local tier's retention
    # runs after each local commit (it drops what is durable already before the new step's
    # copy goes out, so the holders drop their copies too), after each step's copies are
    # checked (a local-only step goes only once a newer one survives as many node losses,
    # which only that run knows) and after each durable commit: twice per local-only save.
    _, _, results = saved_k1
    for r in results:
        runs = r.record("saved")["retention_runs"]
        assert collections.Counter(run["after"] for run in runs) == {"run_local": 3, "_peer_copied": 3, "_replicate": 1}, runs
        removed_by = {s: run["after"] for run in runs for s in run["removed"]}
        assert set(removed_by) == {100, 110} and removed_by[110] == "_peer_copied", runs


@pytest.mark.slow
def test_with_one_peer_copy_two_adjacent_lost_nodes_fall_back_to_the_newest_durable_step(saved_k1):
    tmp, args, _ = saved_k1
    run = _copy(args, tmp, "two-lost", lost=[1, 2])  # process 1's share of step 120 was on nodes 1 and 2 only
    for r in _restore(run):
        rec = r.record("restored")
        assert rec["step"] == 100 and rec["mismatches"] == [] and rec["source"] == "durable", r.describe()


@pytest.mark.slow
def test_processes_whose_copies_are_of_different_saves_fail_fast_the_same_way(saved_k1):
    tmp, args, _ = saved_k1
    run = _copy(args, tmp, "disagree")
    marker = f"{run['local']}/process-2/120/COMMITTED"
    with open(marker) as f:
        obj = json.load(f)
    obj["generation"] = "20260101T000000Z-otherattempt"
    with open(marker, "w") as f:
        json.dump(obj, f)
    results = _restore(run)
    errors = {r.record("refused")["error"] for r in results}
    assert len(errors) == 1, errors  # the same error on every process
    (error,) = errors
    assert error.startswith("RestoreAgreementError") and "step 120" in error and "process 2" in error, error


def _flip_a_byte(path, offset=0):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _flip_a_chunk_byte(folder):
    patterns = [f"{folder}/arrays/**/c/**", f"{folder}/packed/*/c/0"]  # chunk files, the pack
    chunks = sorted(p for pattern in patterns for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    assert chunks, f"no chunk file in {folder}"
    _flip_a_byte(chunks[0])


def _tcp_fallback_reason(results):
    """Why the processes fetched their copies of step 120 over TCP instead of receiving
    their boxes in the restore: one reason, the same on every process."""
    reasons = set()
    for r in results:
        line = next((x for x in r.stderr.splitlines() if "fetch their copies of step 120 over TCP instead" in x), None)
        assert line is not None, r.describe()
        reasons.add(line.split("instead of receiving their boxes in the restore: ", 1)[1])
    (reason,) = reasons
    return reason


@pytest.mark.slow
def test_with_one_peer_copy_a_damaged_copy_of_a_lost_node_falls_back_to_the_durable_step(saved_k1):
    tmp, args, _ = saved_k1
    run = _copy(args, tmp, "damaged-only-copy", lost=[1])
    _flip_a_chunk_byte(f"{run['local']}/process-2/peer-copies/process-1/120")  # fails its crc32c when fetched
    for r in _restore(run):
        rec = r.record("restored")
        assert rec["step"] == 100 and rec["mismatches"] == [] and rec["source"] == "durable", r.describe()


@pytest.fixture(scope="module")
def saved_k2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k2")
    args, results = _save(tmp, 2)
    for r in results:
        assert r.record("saved")["survives"].get("120") == 2, r.describe()
    return tmp, args


@pytest.mark.slow
def test_with_two_peer_copies_a_damaged_copy_is_skipped_for_the_next_one_and_a_late_replacement_is_waited_for(saved_k2):
    tmp, args = saved_k2
    run = _copy(args, tmp, "damaged-next", lost=[1])
    _flip_a_chunk_byte(f"{run['local']}/process-2/peer-copies/process-1/120")  # the first holder's copy
    # The replacement process joins its manager 5 s after the others.
    for r in _restore(run, late_s={"1": 5}):
        rec = r.record("restored")
        assert rec["step"] == 120 and rec["mismatches"] == [], r.describe()
        assert rec["durable_bytes"] == 0 and rec["source"] == "local", r.describe()


@pytest.mark.slow
def test_a_holder_whose_copy_fails_its_crc32c_in_one_leaf_of_several_makes_every_process_fall_back_alike(saved_k2):
    # The first holder's copy of process 1's step 120 is whole but for one leaf ("w"): its
    # reads of the other leaves succeed (and those boxes travel), that one fails its
    # crc32c. What was received is dropped on every process, every process falls back the
    # same way (process 1 fetches the next holder's copy over TCP), and the step restored
    # is whole: nothing from the damaged copy, nothing of another step.
    tmp, args = saved_k2
    run = _copy(args, tmp, "damaged-mid-stream", lost=[1])
    held = f"{run['local']}/process-2/peer-copies/process-1/120"
    arrays = ckpt.metadata(held).arrays
    assert len(arrays) > 1, sorted(arrays)
    (b, *_) = arrays["w"].pack_boxes  # the small leaves are packed: a byte inside w's entry of the pack
    _flip_a_byte(f"{held}/{b.key}", b.offset + b.nbytes // 2)
    results = _restore(run)
    for r in results:
        rec = r.record("restored")
        assert rec["step"] == 120 and rec["mismatches"] == [], r.describe()
        assert rec["durable_bytes"] == 0 and rec["source"] == "local", r.describe()
        assert "received their boxes from the processes holding their copies" not in r.stderr, r.describe()
    reason = _tcp_fallback_reason(results)
    assert reason.startswith("process 2: CorruptCheckpointError") and "crc32c" in reason, reason


@pytest.mark.slow
def test_a_process_killed_while_sending_its_copy_leaves_no_copy_that_counts(tmp_path):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    args = {"directory": durable, "local": local, "phase": "save", "steps": STEPS, "peer_copies": 1,
            "durable_every_steps": 100, "kill_sending": [1, 120]}
    results = run_processes(WORKER, 4, 2, args, timeout_s=240, check=False, fail_fast_grace_s=3)
    assert results[1].returncode == -9, results[1].describe()
    # Half of process 1's copy reached process 2, which dropped it when the connection broke
    # and kept the checked copy of step 110 (the older copy is never lost to a newer one; 100
    # too when the copy of 110 went out before the owner's local retention dropped 100).
    held = sorted(os.listdir(f"{local}/process-2/peer-copies/process-1"))
    assert "110" in held and not [n for n in held if n.startswith("120")], held
    for r in _restore(dict(args, phase="restore", kill_sending=None)):
        rec = r.record("restored")
        assert rec["step"] == 120 and rec["mismatches"] == [] and rec["durable_bytes"] == 0, r.describe()


@pytest.mark.slow
def test_a_node_lost_before_its_copy_of_the_newest_step_was_checked_resumes_from_the_step_before(tmp_path):
    # Process 1's copy of step 120 fails (its holder's tier is full): step 120 survives no node
    # loss in the whole job, so every process keeps step 110 (which survives one), and losing
    # node 1 resumes from 110: the local tiers and process 1's copy on process 2, nothing durable.
    args = {"directory": str(tmp_path / "durable"), "local": str(tmp_path / "local"), "phase": "save",
            "steps": STEPS, "peer_copies": 1, "durable_every_steps": 100, "enospc_holder": [2, 120]}
    for r in run_processes(WORKER, 4, 2, args, timeout_s=240):
        assert r.record("saved")["survives"].get("120") == 0, r.describe()
    for r in _restore(_copy(args, tmp_path, "node-1-lost", lost=[1])):
        rec = r.record("restored")
        assert rec["step"] == 110 and rec["mismatches"] == [] and rec["durable_bytes"] == 0, r.describe()


@pytest.mark.slow
def test_a_restart_onto_another_process_count_reads_the_durable_step_and_says_why(saved_k1):
    tmp, args, _ = saved_k1
    run = _copy(args, tmp, "two-processes")
    results = run_processes(WORKER, 2, 4, dict(run, phase="restore"), timeout_s=240)
    for r in results:
        rec = r.record("restored")
        assert rec["step"] == 100 and rec["mismatches"] == [] and rec["source"] == "durable", r.describe()
        assert "saved by 4 processes, the job has 2" in r.stderr, r.describe()
        # k = 1: the 2 processes' folders hold shares 0, 1 and copies of 3, 0 (tests/test_mesh_restart.py: k = 2 covers).
        assert "the share of process 2 survives in none" in rec["reason"], rec


def test_a_replaced_process_receives_its_boxes_from_its_holder_inside_the_restore(tmp_path):
    # 2 processes x 2 devices as 2 nodes (mesh 2x2: process p holds row p), k = 1: each
    # holds the other's copy. Process 1's node is replaced: its boxes of step 120 travel
    # from process 0's copy over the device interconnect, within the restore call.
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    args = {"directory": durable, "local": local, "phase": "save", "steps": STEPS, "peer_copies": 1,
            "durable_every_steps": 100, "mesh": [2, 2]}
    for r in run_processes(WORKER, 2, 2, args, timeout_s=240):
        assert r.record("saved")["survives"].get("120") == 1, r.describe()
    shutil.rmtree(f"{local}/process-1")
    results = run_processes(WORKER, 2, 2, dict(args, phase="restore"), timeout_s=240)
    for r in results:
        rec = r.record("restored")
        assert rec["step"] == 120 and rec["mismatches"] == [], r.describe()
        assert rec["durable_bytes"] == 0 and rec["source"] == "local", r.describe()
        received = r.stderr.find("received their boxes from the processes holding their copies")
        assert received >= 0, r.describe()
        # Nothing over TCP before the restore; afterwards the replaced process's local tier gets
        # the step again, fetched in the background.
        assert r.stderr.find("fetched its copy of step 120") in (-1, *range(received, len(r.stderr))), r.describe()
    assert os.path.exists(f"{local}/process-1/120/COMMITTED")


@pytest.fixture(scope="module")
def saved_two_zarr(tmp_path_factory):
    # As above, every leaf in a zarr array of its own (the holder reads each box straight
    # into the device buffer it sends).
    tmp = tmp_path_factory.mktemp("two-zarr")
    args = {"directory": str(tmp / "durable"), "local": str(tmp / "local"), "phase": "save", "steps": STEPS,
            "peer_copies": 1, "durable_every_steps": 100, "mesh": [2, 2], "pack_small_leaves_bytes": 0}
    for r in run_processes(WORKER, 2, 2, args, timeout_s=240):
        assert r.record("saved")["survives"].get("120") == 1, r.describe()
    assert not glob.glob(f"{args['local']}/process-0/peer-copies/process-1/120/packed")
    return tmp, args


@pytest.mark.slow
def test_a_replaced_process_receives_its_boxes_of_leaves_in_their_own_zarr_arrays(saved_two_zarr):
    tmp, args = saved_two_zarr
    run = _copy(args, tmp, "zarr-received", lost=[1])
    for r in _restore(run, processes=2, devices=2):
        rec = r.record("restored")
        assert rec["step"] == 120 and rec["mismatches"] == [] and rec["durable_bytes"] == 0, r.describe()
        assert "received their boxes from the processes holding their copies" in r.stderr, r.describe()


@pytest.mark.slow
def test_a_holder_whose_zarr_copy_fails_its_crc32c_in_one_leaf_makes_every_process_fall_back_alike(saved_two_zarr):
    # The holder reads "bf" and "ids" into the buffers it sends, a chunk of "w" fails its
    # crc32c: what was received is dropped on both processes, the TCP fetch of the only
    # copy fails too, and both restore the durable step, whole.
    tmp, args = saved_two_zarr
    run = _copy(args, tmp, "zarr-damaged", lost=[1])
    held = f"{run['local']}/process-0/peer-copies/process-1/120"
    assert sorted(ckpt.metadata(held).arrays) == ["bf", "ids", "w"]
    (chunk, *_) = sorted(p for p in glob.glob(f"{held}/arrays/w/c/**", recursive=True) if os.path.isfile(p))
    _flip_a_byte(chunk)
    results = _restore(run, processes=2, devices=2)
    for r in results:
        rec = r.record("restored")
        assert rec["step"] == 100 and rec["mismatches"] == [] and rec["source"] == "durable", r.describe()
    reason = _tcp_fallback_reason(results)
    assert reason.startswith("process 0: CorruptCheckpointError") and "crc32c" in reason and "'w'" in reason, reason


@pytest.mark.slow
def test_a_holder_whose_tier_is_full_refuses_the_copy_clearly_keeps_the_older_one_and_the_next_copy_counts(tmp_path):
    """ENOSPC injected by the fault harness (tests/faults, point `peer_copy`) in process 2
    while it writes process 1's copy of step 120."""
    args = {"directory": str(tmp_path / "durable"), "local": str(tmp_path / "local"), "phase": "save",
            "steps": [100, 110, 120, 130], "peer_copies": 1, "durable_every_steps": 100, "enospc_holder": [2, 120]}
    results = run_processes(WORKER, 4, 2, args, timeout_s=240)
    after = [r.record("after_fault") for r in results]
    assert after[2]["fired"] and "/peer-copies/process-1/" in after[2]["fired"], after[2]
    # The owner says why its step survives no node loss: the holder, the step, the error.
    error = after[1]["peer_error"] or ""
    assert "process 2 could not hold step 120 of process 1" in error and "No space left on device" in error, error
    assert after[1]["survives"].get("120") == 0, after[1]
    # The holder kept its checked copy of step 110 and left no partial folder of 120.
    assert after[2]["held"]["process-1"][-1] == "110" and not [n for n in after[2]["held"]["process-1"]
                                                              if n.startswith("120")], after[2]
    for r in results:  # the job went on: the next copy is held and checked
        saved = r.record("saved")
        assert saved["local_steps"] == [130] and saved["survives"].get("130") == 1, r.describe()
    held = sorted(os.listdir(f"{args['local']}/process-2/peer-copies/process-1"))
    assert "130" in held and not [n for n in held if n.startswith("120")], held  # 110 while the owner keeps it
