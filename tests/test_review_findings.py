"""Found by review: a restart after a lost node and incremental saves, tried as a user
would (tests/mp_workers/review_worker.py: 2 processes x 2 devices as 2 simulated nodes,
mesh 2x2, peer_copies=1, step 100 durable, 110 and 120 local and held by the peer)."""

import glob
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from multiprocess import WORKERS, copy_run as _copy, run_processes

import checkpointer as ckpt

WORKER = WORKERS / "review_worker.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("review-peers")
    args = {"directory": str(tmp / "durable"), "local": str(tmp / "local"), "phase": "save", "steps": [100, 110, 120],
            "peer_copies": 1, "durable_every_steps": 100}
    for r in run_processes(WORKER, 2, 2, args, timeout_s=240):
        assert r.record("saved")["survives"].get("120") == 1, r.describe()
    return tmp, args


@pytest.mark.slow
def test_a_replaced_process_whose_target_differs_from_its_holders_never_receives_wrong_boxes(saved):
    # Process 1's node is replaced and its restart asks another PartitionSpec for 'w' than
    # process 0 does. The holder planned the boxes it sends from its own target, the
    # replaced process placed them by its own: process 1 got a shard of wrong values,
    # silently. Now the plans are compared in the rendezvous; differing plans make every
    # process combine the copies for its own target instead.
    run = _copy(saved, "targets-differ")
    shutil.rmtree(f"{run['local']}/process-1")
    for r in run_processes(WORKER, 2, 2, dict(run, target="per_process"), timeout_s=240):
        rec = r.record("restored")
        assert rec["step"] == 120 and rec["mismatches"] == [], r.describe()
        assert rec["source"] == "local", rec


@pytest.mark.slow
def test_a_damaged_own_copy_of_the_newest_step_is_replaced_by_the_holders_copy(saved):
    run = _copy(saved, "own-copy-damaged")
    data = [f for f in glob.glob(f"{run['local']}/process-1/120/packed/**/*", recursive=True)
            if os.path.isfile(f) and not f.endswith("zarr.json")]
    assert data
    with open(data[0], "r+b") as f:
        f.truncate(10)
    for r in run_processes(WORKER, 2, 2, run, timeout_s=240):
        rec = r.record("restored")
        assert rec["mismatches"] == [], r.describe()
        assert rec["step"] == 120 and rec["source"] == "local", rec
        assert "damaged or missing" in rec["reason"], rec
    report = ckpt.verify(f"{run['local']}/process-1/120")  # the damaged copy was replaced by the holder's
    assert report.ok and report.chunks_checked > 0, report


@pytest.mark.slow
def test_a_failed_refetch_after_a_restart_does_not_stop_the_next_saves(saved):
    # The holder's copy of process 1's step 120 lost its manifest.json (its data files are
    # whole): the restart combines step 120 from it, but the replaced process cannot re-fetch
    # the copy afterwards. That failed the replication of step 120, and the error refused
    # every later save on every process (SaveAgreementError), on each restart alike: the job
    # could never save again. Now that replication is best effort (logged, in status()).
    run = _copy(saved, "refetch-fails")
    shutil.rmtree(f"{run['local']}/process-1")
    os.remove(f"{run['local']}/process-0/peer-copies/process-1/120/manifest.json")
    results = run_processes(WORKER, 2, 2, dict(run, then_save=[130]), timeout_s=240, check=False)
    for r in results:
        rec = r.record("restored")
        assert rec["step"] == 120 and rec["mismatches"] == [], r.describe()  # the restore itself is right
    for r in results:
        assert r.returncode == 0 and 130 in r.record("then_saved")["local_steps"], r.describe()
        assert "could not fetch its copy of step 120" in r.stderr or r.process_id == 0, r.describe()


def test_the_durable_step_restores_although_its_local_copy_is_retired(tmp_path):
    # Two tiers with incremental saves: step 0 is durable, 1-3 local only and referencing
    # local step 0, which local retention retired (kept only for their chunks). Restoring
    # durable step 0 read it through its local copy, whose RETIRED marker hid the durable
    # step: CheckpointNotFoundError "durable/0 is retired". After a node loss, the fallback
    # to the newest durable step failed so on the processes holding a retired local copy
    # and succeeded on a replaced one: processes of one job went different ways.
    sh = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))
    base = jax.device_put(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32), sh)
    kw = dict(local_directory=str(tmp_path / "local"), incremental=True, durable_every_steps=10,
              keep_local=ckpt.KeepLatest(1), async_save=False, pack_small_leaves_bytes=0)
    with ckpt.CheckpointManager(str(tmp_path / "durable"), **kw) as mgr:
        for step in range(4):
            mgr.save(step, {"base": base, "ad": jax.device_put(np.full((256, 256), step, np.float32), sh)})
        assert mgr.all_steps() == [0]
    assert os.path.exists(tmp_path / "local" / "process-0" / "0" / "RETIRED")
    with ckpt.CheckpointManager(str(tmp_path / "durable"), **kw) as mgr:
        out = mgr.restore(0, {"base": sh, "ad": sh})
        np.testing.assert_array_equal(np.asarray(out["base"]), np.asarray(base))
        np.testing.assert_array_equal(np.asarray(out["ad"]), np.zeros((256, 256), np.float32))
        assert mgr.status().last_restore_source == "durable"


def test_a_forced_save_of_a_step_older_than_the_local_window_is_replicated(tmp_path):
    sh = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))

    def tree(value):
        return {"w": jax.device_put(np.full((64, 64), value, np.float32), sh)}

    with ckpt.CheckpointManager(str(tmp_path / "durable"), local_directory=str(tmp_path / "local"),
                                durable_every_steps=2, keep_local=ckpt.KeepLatest(2), keep=ckpt.KeepLatest(3),
                                async_save=False) as mgr:
        for step in range(5):
            mgr.save(step, tree(step))
        assert mgr.all_steps() == [0, 2, 4]
        mgr.save(2, tree(102.0), force=True)  # rewound to step 2: its state replaces the durable step 2
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 2, 4]
        np.testing.assert_array_equal(np.asarray(mgr.restore(2, {"w": sh})["w"]), np.full((64, 64), 102.0, np.float32))


@pytest.mark.slow
def test_verify_of_an_intact_local_step_of_a_multi_process_job_finds_no_problem(saved):
    # docs/incremental.md: `checkpointer verify` works on the steps of a local process
    # folder. A local step (and a peer's copy of one) holds the record of its own process
    # only: verify reported "process record processes/1.json is missing" for every intact
    # local step of a job of several processes (exit status 1).
    _, args = saved
    for path in (f"{args['local']}/process-0/120", f"{args['local']}/process-0/peer-copies/process-1/120"):
        report = ckpt.verify(path)
        assert report.ok and report.chunks_checked > 0, report


def test_gc_never_removes_what_a_kept_step_with_an_unreadable_manifest_references(tmp_path):
    # Steps 1-3 reference step 0's frozen chunks. While step 3's manifest cannot be read (a
    # torn read, EIO, an object store's error), `checkpointer gc --keep-latest 1` took
    # step 3 for a step without references and removed steps 0-2: once its manifest read
    # again, step 3 had lost its data. Now steps a kept step may reference are retired
    # (kept) while its manifest cannot be read.
    from checkpointer import _cli

    sh = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))
    base = jax.device_put(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32), sh)
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(10), incremental=True, async_save=False,
                                pack_small_leaves_bytes=0) as mgr:
        for step in range(4):
            mgr.save(step, {"base": base, "ad": jax.device_put(np.full((256, 256), step, np.float32), sh)})
    with open(f"{d}/3/manifest.json") as f:
        manifest = f.read()
    with open(f"{d}/3/manifest.json", "w") as f:
        f.write(manifest[: len(manifest) // 2])  # unreadable for now
    assert _cli.main(["gc", d, "--keep-latest", "1"]) == 0
    with open(f"{d}/3/manifest.json", "w") as f:
        f.write(manifest)  # readable again
    out = ckpt.restore(f"{d}/3")
    np.testing.assert_array_equal(out["base"], np.asarray(base))
    np.testing.assert_array_equal(out["ad"], np.full((256, 256), 3, np.float32))
    assert _cli.main(["gc", d, "--keep-latest", "1"]) == 0  # and once readable, what nobody references goes
    assert sorted(n for n in os.listdir(d) if n.isdigit()) == ["0", "3"]
    assert os.path.exists(f"{d}/0/RETIRED")
