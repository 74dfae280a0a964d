"""Incremental saves across restarts and processes (issue 30): `incremental` switched off
and on between runs, processes that disagree about it, a process that finds no base while
another references; retention on both tiers of a two-tier manager (the local tier retires
as the durable tier does; a durable step references a retired durable step instead of
copying its chunks again)."""

import os
import sys

import jax
import numpy as np
import pytest
from incremental_steps import N, chunk_files, manifest, refs_in
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt


@pytest.fixture(scope="module")
def sharding():
    return NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))


def _tree(sharding, base, step):
    return {"base": base, "adapter": jax.device_put(np.full((N, N), float(step), np.float32), sharding)}


def _check_every_step(directory, base, steps):
    for s in steps:
        assert ckpt.verify(f"{directory}/{s}").ok, s
        out = ckpt.restore(f"{directory}/{s}")
        np.testing.assert_array_equal(out["base"], np.asarray(base))
        np.testing.assert_array_equal(out["adapter"], np.full((N, N), s, np.float32))


@pytest.mark.parametrize("tiers", [False, True], ids=["one tier", "two tiers"])
def test_incremental_switched_off_and_on_between_runs_keeps_every_reference(tmp_path, sharding, tiers):
    # Run 1 saves with references, run 2 (a restart) without, run 3 with again: retention
    # of every run follows the references the others made, whatever its own option.
    d, local = str(tmp_path / "run"), str(tmp_path / "local")
    base = jax.device_put(np.random.default_rng(0).standard_normal((N, N)).astype(np.float32), sharding)
    extra = {"local_directory": local, "keep_local": ckpt.KeepLatest(2)} if tiers else {}
    for incremental, steps in ((True, range(0, 4)), (False, range(4, 7)), (True, range(7, 11))):
        with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(2), incremental=incremental, async_save=False, **extra) as mgr:
            for step in steps:
                mgr.save(step, _tree(sharding, base, step))
                mgr.wait_until_finished()
                _check_every_step(d, base, mgr.all_steps())
            assert mgr.all_steps() == [steps[-2], steps[-1]]
    # Run 3's steps reference run 2's last step (written whole, now retired); run 1's
    # step 0 went once nothing referenced it.
    assert refs_in(f"{d}/10", "base") == {"6"} and os.path.exists(f"{d}/6/RETIRED") and not os.path.exists(f"{d}/0")
    if tiers:
        root = f"{local}/process-0"
        assert refs_in(f"{root}/10", "base") == {"6"}
        for s in (9, 10):
            assert ckpt.verify(f"{root}/{s}").ok


@pytest.mark.multiprocess
def test_processes_that_disagree_about_incremental_are_refused_naming_them(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from multiprocess import WORKERS, run_processes

    d = str(tmp_path / "run")
    args = {"directory": d, "incremental": [False, True], "steps": [0, 1, 2]}
    for r in run_processes(WORKERS / "incremental_toggle_worker.py", 2, 4, args, timeout_s=180):
        rec = r.record("error")
        assert rec["type"] == "SaveAgreementError", rec
        assert "process 0: incremental=False" in rec["message"] and "process 1: incremental=True" in rec["message"]
    assert not [n for n in os.listdir(d) if not n.startswith(".")]  # nothing written


@pytest.mark.multiprocess
def test_process_0_gathers_the_references_of_others_when_it_found_no_base(tmp_path):
    # Process 0 finds no base (e.g. it cannot read the newest step): it writes its chunks,
    # process 1 references its own. The manifest must list process 1's references (they
    # said so when they reported done), or the step would lack process 1's chunks.
    sys.path.insert(0, os.path.dirname(__file__))
    from multiprocess import WORKERS, run_processes

    d = str(tmp_path / "run")
    args = {"directory": d, "incremental": [True, True], "steps": [0, 1, 2], "p0_no_base": True, "keep": 2}
    for r in run_processes(WORKERS / "incremental_toggle_worker.py", 2, 4, args, timeout_s=180):
        rec = r.record("saved")
        assert rec["steps"] == [1, 2] and rec["refs"]["2"]["base"] == 4, rec  # process 1's 4 chunks
        assert all(rec["verified"].values()) and all(v is True for v in rec["restored"].values()), rec
    assert os.path.exists(f"{d}/0/RETIRED")  # process 1's base chunks live in step 0


@pytest.mark.multiprocess
def test_a_restart_without_incremental_replicates_a_local_step_saved_with_it(tmp_path):
    # Run 1 (incremental, two tiers, durable every 2nd step) leaves local step 3 not durable;
    # process 0's half of the base changes every step, so only process 1's records hold
    # references. Run 2, without incremental, resumes from local 3 and replicates it:
    # durable 3 must list process 1's references into durable 2.
    sys.path.insert(0, os.path.dirname(__file__))
    from multiprocess import WORKERS, run_processes

    d, local = str(tmp_path / "run"), str(tmp_path / "local")
    common = {"directory": d, "local": local, "keep": 2, "durable_every_steps": 2, "p0_changes": True}
    run_processes(WORKERS / "incremental_toggle_worker.py", 2, 4, dict(common, incremental=[True, True], steps=[1, 2, 3]),
                  timeout_s=180)
    args = dict(common, incremental=[False, False], steps=[], restore=True)
    for r in run_processes(WORKERS / "incremental_toggle_worker.py", 2, 4, args, timeout_s=180):
        rec = r.record("saved")
        assert rec["steps"] == [2, 3] and rec["refs"]["3"]["base"] == 4, rec
        assert all(rec["verified"].values()) and all(v is True for v in rec["restored"].values()), rec
    assert refs_in(f"{d}/3", "base") == {"2"} and manifest(f"{d}/3")["format_version"] == 2


def test_two_tiers_retire_referenced_steps_on_both_tiers_and_reference_retired_durable_steps(tmp_path, sharding):
    # Every step durable, 3 kept durable and 2 local: the step that holds the frozen base
    # is retired on both tiers (only the base's chunks kept), and later durable steps
    # reference the retired durable step instead of copying the base into a new one.
    d, local = str(tmp_path / "run"), str(tmp_path / "local")
    root = f"{local}/process-0"
    base = jax.device_put(np.random.default_rng(1).standard_normal((N, N)).astype(np.float32), sharding)
    with ckpt.CheckpointManager(d, local_directory=local, keep=ckpt.KeepLatest(3), keep_local=ckpt.KeepLatest(2),
                                incremental=True, async_save=False) as mgr:
        for step in range(8):
            mgr.save(step, _tree(sharding, base, step))
            mgr.wait_until_finished()
        assert mgr.all_steps() == [5, 6, 7] and mgr._tiers.local_steps() == [6, 7]
        for step in (5, 6, 7):  # the base lives in durable 0, retired: never copied again
            assert refs_in(f"{d}/{step}", "base") == {"0"} and chunk_files(f"{d}/{step}", "base") == 0
        for tier in (d, root):
            assert os.path.exists(f"{tier}/0/RETIRED")
            assert chunk_files(f"{tier}/0", "base") == 8 and chunk_files(f"{tier}/0", "adapter") == 0
            assert sorted(n for n in os.listdir(tier) if n.isdigit()) == (["0", "5", "6", "7"] if tier == d else ["0", "6", "7"])
        assert ckpt.verify(f"{root}/7").ok
        from checkpointer._manage import local_listing

        states = {r["step"]: r["state"] for r in local_listing(local, mgr.storage, mgr.directory)}
        assert states == {0: "retired", 6: "durable", 7: "durable"}, states  # `checkpointer ls --local`
        tree = mgr.restore(7)
        np.testing.assert_array_equal(np.asarray(tree["base"]), np.asarray(base))
    _check_every_step(d, base, [5, 6, 7])


def test_a_base_retired_and_pruned_before_the_commit_fails_the_save_never_dangles(tmp_path, sharding, monkeypatch):
    # With saves in flight (max_saves_in_flight > 1, or another process that listed the
    # directory before an earlier save published), retention may retire the base of a save
    # being written and free the chunks only that save references. Its commit checks the
    # referenced files of a retired step under the directory's guard: the save fails with a
    # SaveError, nothing committed, instead of committing a dangling reference.
    from checkpointer import _commit
    from checkpointer._save import _incremental

    d = str(tmp_path / "run")
    base = jax.device_put(np.random.default_rng(4).standard_normal((N, N)).astype(np.float32), sharding)
    adapter = jax.device_put(np.full((N, N), 1.0, np.float32), sharding)
    real_gather = _incremental.gather

    def retention_ran_meanwhile(storage, path, *args, **kwargs):  # as a concurrent retention would: retire 1, prune its adapter
        _commit.retire_step(storage, d, 1, [])
        for name in os.listdir(f"{d}/1/arrays/adapter/c"):
            for root, _, files in os.walk(f"{d}/1/arrays/adapter/c/{name}"):
                for f in files:
                    os.remove(os.path.join(root, f))
        return real_gather(storage, path, *args, **kwargs)

    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(10), incremental=True, async_save=False) as mgr:
        mgr.save(0, {"base": base, "adapter": jax.device_put(np.zeros((N, N), np.float32), sharding)})
        mgr.save(1, {"base": base, "adapter": adapter})
        monkeypatch.setattr(_incremental, "gather", retention_ran_meanwhile)
        with pytest.raises(ckpt.SaveError, match="retired the referenced checkpoint"):
            mgr.save(2, {"base": base, "adapter": adapter})  # references 1's adapter (the same array)
        assert mgr.all_steps() == [0]
    assert not os.path.exists(f"{d}/2")


# The hooks count both tiers' retention: the local tier retires and prunes first (after
# each local commit), the durable tier after each replication.
LOCAL_KILL_POINTS = ["retired:1", "pruned:1", "retention_renamed:2"]


@pytest.mark.parametrize("kill_point", LOCAL_KILL_POINTS)
def test_a_crash_at_any_point_of_retention_on_two_tiers_leaves_no_dangling_reference(tmp_path, kill_point):
    # tests/incremental_crash_worker.py with a local tier: the kill lands in the retention
    # of either tier (the local one retires too). Every committed step of both tiers still
    # verifies, and the next run finishes the job.
    import subprocess

    from checkpointer import _commit
    from checkpointer._storage import storage_for

    worker = os.path.join(os.path.dirname(__file__), "incremental_crash_worker.py")
    d, local = str(tmp_path / "run"), str(tmp_path / "local")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")

    def every_step_verifies():
        storage, root = storage_for(f"{local}/process-0")
        for tier, steps in ((root, _commit.committed_folders(storage, root)), (d, ckpt.CheckpointManager(d, read_only=True).all_steps())):
            assert steps, tier
            for step in steps:
                assert ckpt.verify(f"{tier}/{step}").ok, (tier, step)

    res = subprocess.run([sys.executable, worker, d, kill_point, local], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr[-2000:])
    every_step_verifies()
    res = subprocess.run([sys.executable, worker, d, "none", local], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    every_step_verifies()
    # Retired local steps hold exactly the chunks the listed local steps reference.
    root = f"{local}/process-0"
    listed = [n for n in os.listdir(root) if n.isdigit() and not os.path.exists(f"{root}/{n}/RETIRED")]
    wanted: dict[str, set] = {}
    for n in listed:
        for leaf in ("base", "adapter"):
            for r in manifest(f"{root}/{n}")["leaves"][leaf].get("references", []):
                wanted.setdefault(r["in"], set()).add((leaf, tuple(r["chunk"])))
    retired = [n for n in os.listdir(root) if os.path.exists(f"{root}/{n}/RETIRED")]
    assert retired and set(retired) <= set(wanted), (retired, wanted)
    for name in retired:
        assert sum(chunk_files(f"{root}/{name}", leaf) for leaf in ("base", "adapter")) == len(wanted[name]), name
