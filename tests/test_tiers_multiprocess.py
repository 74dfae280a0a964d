"""Two tiers with two JAX processes: each keeps its own local tier (`process-<i>/`)."""

import os
import shutil

import pytest
from multiprocess import WORKERS, run_processes


@pytest.mark.slow
def test_two_processes_restore_bit_exactly_when_one_local_tier_is_wiped(tmp_path):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    args = {"directory": durable, "local": local, "phase": "save", "steps": [1, 2]}
    for r in run_processes(WORKERS / "tiers_worker.py", 2, 4, args, timeout_s=300):
        saved = r.record("saved")
        assert saved["all_steps"] == [1, 2] and saved["local_step"] == 2, r.describe()
    # Every process replicated its own files, its pack (and the pack's zarr.json) among them;
    # the durable manifest indexes every process's pack.
    import checkpointer as ckpt

    report = ckpt.verify(f"{durable}/2")
    assert report.ok, report.problems
    assert os.path.isfile(f"{durable}/2/packed/process-1/zarr.json")
    shutil.rmtree(f"{local}/process-1")  # process 1's node was replaced
    results = run_processes(WORKERS / "tiers_worker.py", 2, 4, dict(args, phase="restore"), timeout_s=300)
    restored = [r.record("restored") for r in results]
    for r, rec in zip(results, restored):
        assert rec["step"] == 2 and rec["mismatches"] == [], r.describe()
    # Process 0 reads its local copy (chunks another process wrote, if any, from the durable tier).
    assert restored[0]["source"] in ("local", "local+durable")
    assert restored[1]["source"] == "durable" and restored[1]["durable_bytes"] > 0


@pytest.mark.slow
def test_a_local_only_step_split_by_replica_parallel_writes_is_restored_from_both_processes_copies(tmp_path):
    # Replica-parallel writes give each replicated box's chunks to one holder each
    # ('emb', 'rep', 'bf' are replicated across the two processes), so neither process's
    # local copy of step 2 holds every chunk its devices need: the local-only vote refuses
    # it (reading it would give fill values). Both processes' folders are on this machine
    # (one node): the restart combines them (`_mesh_restart`), bit-exactly, reading
    # nothing durable.
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    args = {"directory": durable, "local": local, "phase": "save", "steps": [1, 2]}
    for r in run_processes(WORKERS / "tiers_worker.py", 2, 4, args, timeout_s=300):
        assert r.record("saved")["local_step"] == 2, r.describe()
    shutil.rmtree(f"{durable}/2")  # step 2 never became durable (replication cut short)
    results = run_processes(WORKERS / "tiers_worker.py", 2, 4, dict(args, phase="restore"), timeout_s=300)
    for r in results:
        rec = r.record("restored")
        assert rec["step"] == 2 and rec["mismatches"] == [] and rec["source"] == "local", r.describe()
        assert rec["durable_bytes"] == 0, r.describe()


@pytest.mark.slow
def test_two_processes_restore_bit_exactly_when_one_local_copy_fails_its_checksums(tmp_path):
    # A bit flipped in one of process 1's local chunk files (or its pack): process 1 alone falls back
    # to the durable tier, process 0 keeps reading its local copy, and nobody waits on
    # the other (restores with a local tier never cooperate).
    import glob
    import os

    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    args = {"directory": durable, "local": local, "phase": "save", "steps": [1, 2]}
    for r in run_processes(WORKERS / "tiers_worker.py", 2, 4, args, timeout_s=300):
        assert r.record("saved")["local_step"] == 2, r.describe()
    data_files = [f"{local}/process-1/2/arrays/**/c/**", f"{local}/process-1/2/packed/*/c/0"]  # chunk files, its pack
    chunks = sorted(p for pattern in data_files for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    assert chunks, "process 1 wrote no chunk to its local tier"
    with open(chunks[0], "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0x01]))
    results = run_processes(WORKERS / "tiers_worker.py", 2, 4, dict(args, phase="restore"), timeout_s=300)
    restored = [r.record("restored") for r in results]
    for r, rec in zip(results, restored):
        assert rec["step"] == 2 and rec["mismatches"] == [], r.describe()
    assert restored[0]["source"] in ("local", "local+durable")
    assert restored[1]["source"] == "durable"
