"""Incremental saves on two tiers and packed leaves (issue 30): a local step references
local steps; its durable copy references only committed durable steps (translated) or
holds the chunk itself (materialized); local retention keeps what local steps
reference; peer copies refuse incremental saves with the fix; unchanged packed leaves
are not rewritten."""

import json
import os

import jax
import numpy as np
import pytest
from incremental_steps import N, arr, chunk_files, manifest, refs_in
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt


@pytest.fixture(scope="module")
def sharding():
    return NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))


def test_two_tiers_reference_local_steps_and_durable_copies_reference_durable_steps_or_hold_the_chunks(tmp_path, sharding):
    d, local = str(tmp_path / "run"), str(tmp_path / "local")
    lroot = f"{local}/process-0"
    base = arr(sharding, seed=1)
    # Durable every 2nd step: step 1 stays local, so durable 2 cannot reference it.
    with ckpt.CheckpointManager(d, local_directory=local, keep=ckpt.KeepLatest(3), keep_local=ckpt.KeepLatest(2),
                                durable_every_steps=2, incremental=True, async_save=True) as mgr:
        for step in range(1, 7):
            mgr.save(step, {"base": base, "adapter": arr(sharding, float(step))})
            mgr.wait_until_finished()
            if step == 3:  # local 3 references local 1 (its base's holder), on the local disk
                assert refs_in(f"{lroot}/3", "base") == {"1"} and chunk_files(f"{lroot}/3", "base") == 0
        assert mgr.all_steps() == [2, 4, 6]
        # Durable 2 holds the base itself (local 1 is not durable: materialized); durable 4
        # and 6 reference durable 2's copy; nothing references a step of the local tier.
        assert refs_in(f"{d}/2", "base") == set() and chunk_files(f"{d}/2", "base") == 8
        assert refs_in(f"{d}/4", "base") == {"2"} and chunk_files(f"{d}/4", "base") == 0
        assert refs_in(f"{d}/6", "base") == {"2"} and manifest(f"{d}/6")["format_version"] == 2
        # Local retention keeps local 1 (referenced by the local steps kept), removes the rest.
        assert sorted(int(n) for n in os.listdir(lroot) if n.isdigit()) == [1, 5, 6]
        for step in (2, 4, 6):
            assert ckpt.verify(f"{d}/{step}").ok
            out = ckpt.restore(f"{d}/{step}")
            np.testing.assert_array_equal(out["base"], np.asarray(base))
            np.testing.assert_array_equal(out["adapter"], np.full((N, N), step, np.float32))
        # The manager's restore reads step 6 from the local tier; the base it references
        # in durable 2 (a copy local 2, gone, does not hold) from the durable tier.
        tree = mgr.restore(6)
        np.testing.assert_array_equal(np.asarray(tree["base"]), np.asarray(base))
        st = mgr.status()
        assert st.last_restore_source == "local+durable" and 0 < st.last_restore_durable_bytes <= N * N * 4 + (1 << 20)


def test_a_local_only_step_restores_through_its_local_references(tmp_path, sharding):
    d, local = str(tmp_path / "run"), str(tmp_path / "local")
    base = arr(sharding, seed=2)
    with ckpt.CheckpointManager(d, local_directory=local, keep_local=ckpt.KeepLatest(2), durable_every_steps=10,
                                incremental=True, async_save=False) as mgr:
        for step in range(1, 4):
            mgr.save(step, {"base": base, "adapter": arr(sharding, float(step))})
        assert mgr.all_steps() == []  # nothing durable: steps 1..3 are local only
    with ckpt.CheckpointManager(d, local_directory=local, keep_local=ckpt.KeepLatest(2), durable_every_steps=10,
                                incremental=True) as mgr:
        tree = mgr.restore()  # the newest local-only step, its base read from local step 1
        np.testing.assert_array_equal(np.asarray(tree["base"]), np.asarray(base))
        np.testing.assert_array_equal(np.asarray(tree["adapter"]), np.full((N, N), 3.0, np.float32))


def test_replacing_a_local_step_that_its_base_references_writes_the_chunks_again(tmp_path, sharding):
    # Local 2 references local 1; step 1 saved again (force=True, only durable 2 exists,
    # which holds its own copy): its base, local 2, must not lend it a reference to itself.
    d, local = str(tmp_path / "run"), str(tmp_path / "local")
    base = arr(sharding, seed=3)
    with ckpt.CheckpointManager(d, local_directory=local, keep_local=ckpt.KeepLatest(3), durable_every_steps=2,
                                incremental=True, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"base": base, "adapter": arr(sharding, float(step))})
        mgr.save(1, {"base": base, "adapter": arr(sharding, 7.0)}, force=True)
        assert "1" not in refs_in(f"{local}/process-0/1", "base") and chunk_files(f"{local}/process-0/1", "base") == 8
        out = mgr.restore(1)
        np.testing.assert_array_equal(np.asarray(out["base"]), np.asarray(base))
        np.testing.assert_array_equal(np.asarray(out["adapter"]), np.full((N, N), 7.0, np.float32))


@pytest.mark.multiprocess
def test_a_peer_copy_carries_the_chunks_its_step_references_and_a_lost_node_resumes_from_it(tmp_path):
    # 4 processes as 4 nodes, one peer copy each; steps 100 (durable), 110, 120 (local
    # and peers). 'ids' and 'bf' never change: local 120 references local 100 for them.
    import glob
    import shutil
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from multiprocess import WORKERS, run_processes

    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    args = {"directory": durable, "local": local, "phase": "save", "steps": [100, 110, 120], "peer_copies": 1,
            "durable_every_steps": 100, "incremental": True, "pack_small_leaves_bytes": 0}
    for r in run_processes(WORKERS / "peers_worker.py", 4, 2, args, timeout_s=240):
        saved = r.record("saved")
        assert saved["local_steps"] == [120] and saved["survives"].get("120") == 1, r.describe()
    assert refs_in(f"{local}/process-1/120", "ids") == {"100"}  # the local step references
    assert os.path.exists(f"{local}/process-1/100/RETIRED")  # retired: kept for what local 120 references
    copy = f"{local}/process-2/peer-copies/process-1/120"  # the copy process 2 holds: standalone
    assert manifest(copy)["format_version"] == 1 and not refs_in(copy, "ids") and chunk_files(copy, "ids") > 0
    assert not glob.glob(f"{local}/process-1/.peer-send-*")  # the hard-linked folder it was sent from is gone
    shutil.rmtree(f"{local}/process-1")  # node 1 replaced: its own steps and the copies it held
    for r in run_processes(WORKERS / "peers_worker.py", 4, 2, dict(args, phase="restore"), timeout_s=240):
        rec = r.record("restored")
        assert rec["step"] == 120 and rec["mismatches"] == [] and rec["durable_bytes"] == 0, r.describe()


@pytest.mark.multiprocess
def test_a_peer_copy_carries_the_packs_its_step_references(tmp_path):
    # As above with every leaf packed (small): local 120 references local 100's pack for
    # 'ids' and 'bf'; the copy a peer holds carries that pack as its own.
    import shutil
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from multiprocess import WORKERS, run_processes

    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    args = {"directory": durable, "local": local, "phase": "save", "steps": [100, 110, 120], "peer_copies": 1,
            "durable_every_steps": 100, "incremental": True}
    for r in run_processes(WORKERS / "peers_worker.py", 4, 2, args, timeout_s=240):
        assert r.record("saved")["survives"].get("120") == 1, r.describe()
    assert _pack_refs(f"{local}/process-1/120") == {"packed/process-1/c/0": "100"}
    copy = f"{local}/process-2/peer-copies/process-1/120"
    assert manifest(copy)["format_version"] == 1 and not _pack_refs(copy)
    assert {p["key"] for p in manifest(copy)["packed"]} == {"packed/process-1/c/0", "packed/process-1.from-100/c/0"}
    assert os.path.exists(f"{copy}/packed/process-1.from-100/c/0")
    shutil.rmtree(f"{local}/process-1")  # node 1 replaced
    for r in run_processes(WORKERS / "peers_worker.py", 4, 2, dict(args, phase="restore"), timeout_s=240):
        rec = r.record("restored")
        assert rec["step"] == 120 and rec["mismatches"] == [] and rec["durable_bytes"] == 0, r.describe()
    # Its replication (the restart resumed it) carries the copied pack to the durable tier.
    assert ckpt.verify(f"{durable}/120").ok


@pytest.mark.multiprocess
def test_two_processes_on_two_tiers_durable_references_of_every_process_are_gathered(tmp_path):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from multiprocess import WORKERS, run_processes

    d, local = str(tmp_path / "run"), str(tmp_path / "local")
    results = run_processes(WORKERS / "incremental_worker.py", 2, 4, {"directory": d, "local": local}, timeout_s=180)
    for r in results:
        rec = r.record("saved")
        assert rec["steps"] == [2, 4] and rec["base_ok"] and rec["adapter"] == 4.0, r.describe()
        # Process 0's half of the base changes every step, process 1's does not. Durable 2
        # holds the base (local 1 never became durable: process 1 copied its chunks in);
        # durable 4 references durable 2 for process 1's 4 chunks, which process 0, whose
        # local manifest copy has no references, gathered from process 1's durable record.
        assert rec["refs"]["2"] == {"base": 0, "adapter": 0} and rec["refs"]["4"] == {"base": 4, "adapter": 0}
    for step in (2, 4):
        assert ckpt.verify(f"{d}/{step}").ok
    assert "references" not in manifest(f"{local}/process-0/4")["leaves"]["base"]
    with open(f"{d}/2/processes/1.json") as f:
        assert sum("materialized_from" in c for c in json.load(f)["chunks"]) == 4


def _written(path):
    return manifest(path)["process_bytes_written"]


def _pack_refs(path):
    """{pack key: folder} of the packs of other steps the manifest references."""
    return {p["key"]: p["in"] for p in manifest(path).get("packed", []) if "in" in p}


def _small_tree(step, n=200):
    """200 frozen packed leaves of 1 KiB (a model's norms and biases) and a small adapter
    (4 KiB) that changes every step."""
    return {"frozen": {f"norm{i}": np.full(256, i, np.float32) for i in range(n)}, "lora": np.full((64, 16), step, np.float32)}


def test_on_two_tiers_unchanged_packed_leaves_are_referenced_not_rewritten_on_either_tier(tmp_path):
    d, local = str(tmp_path / "run"), str(tmp_path / "local")
    root = f"{local}/process-0"
    lora_bytes = 64 * 16 * 4
    with ckpt.CheckpointManager(d, local_directory=local, keep=ckpt.KeepLatest(3), keep_local=ckpt.KeepLatest(2),
                                incremental=True, async_save=False) as mgr:
        for step in range(6):
            mgr.save(step, _small_tree(step))
            mgr.wait_until_finished()
            if step:  # each tier writes the adapter and its pack's crc32c: not the 200 frozen leaves (800 KiB)
                assert _written(f"{root}/{step}") == _written(f"{d}/{step}") == [lora_bytes + 4], step
                assert _pack_refs(f"{root}/{step}") == _pack_refs(f"{d}/{step}") == {"packed/process-0/c/0": "0"}
        # Step 0 holds the frozen pack: retired on both tiers, its pack kept whole.
        assert mgr.all_steps() == [3, 4, 5] and mgr._tiers.local_steps() == [4, 5]
        for tier in (d, root):
            assert os.path.exists(f"{tier}/0/RETIRED") and os.path.exists(f"{tier}/0/packed/process-0/c/0")
            assert ckpt.verify(f"{tier}/5").ok
        out = mgr.restore(5)  # from the local tier, the frozen leaves from local 0's pack
        # Read from the durable tier: durable 0's marker and manifest (the reference's check), no data.
        assert mgr.status().last_restore_durable_bytes <= os.path.getsize(f"{d}/0/manifest.json") + 1024
    np.testing.assert_array_equal(np.asarray(out["frozen"]["norm7"]), np.full(256, 7, np.float32))
    np.testing.assert_array_equal(np.asarray(out["lora"]), np.full((64, 16), 5, np.float32))
    back = ckpt.restore(f"{d}/5")
    np.testing.assert_array_equal(back["frozen"]["norm199"], np.full(256, 199, np.float32))
    # A damaged referenced pack on the local tier: verify of the step that references it says so.
    with open(f"{root}/0/packed/process-0/c/0", "r+b") as f:
        f.seek(7 * 1024 + 3)
        f.write(b"\xff")
    report = ckpt.verify(f"{root}/5")
    assert not report.ok and any("process-0/0/packed/process-0/c/0" in p for p in report.problems), report.problems


def test_packs_of_local_only_steps_are_copied_into_a_durable_step_once(tmp_path):
    # Durable every 2nd step, the first save local only (step 1): durable 2 cannot reference
    # local 1's pack, so it holds a copy of it (`packed/process-0.from-1`); durable 4 and 6
    # reference that copy instead of copying it again.
    d, local = str(tmp_path / "run"), str(tmp_path / "local")
    with ckpt.CheckpointManager(d, local_directory=local, keep=ckpt.KeepLatest(2), keep_local=ckpt.KeepLatest(2),
                                durable_every_steps=2, incremental=True, async_save=False) as mgr:
        for step in range(1, 7):
            mgr.save(step, _small_tree(step))
            mgr.wait_until_finished()
        assert mgr.all_steps() == [4, 6]
    m2 = manifest(f"{d}/2")
    assert m2["format_version"] == 1 and {p["key"] for p in m2["packed"]} == {"packed/process-0/c/0", "packed/process-0.from-1/c/0"}
    with open(f"{d}/2/processes/0.json") as f:
        origin = json.load(f)["packed_materialized"][0]["materialized_from"]
    assert origin == ["1", manifest(f"{local}/process-0/1")["generation"], "packed/process-0/c/0"]
    for step in (4, 6):
        assert _pack_refs(f"{d}/{step}") == {"packed/process-0.from-1/c/0": "2"} and _written(f"{d}/{step}") == [64 * 16 * 4 + 4]
        assert ckpt.verify(f"{d}/{step}").ok
        out = ckpt.restore(f"{d}/{step}")
        np.testing.assert_array_equal(out["frozen"]["norm3"], np.full(256, 3, np.float32))
        np.testing.assert_array_equal(out["lora"], np.full((64, 16), step, np.float32))
    assert os.path.exists(f"{d}/2/RETIRED")  # kept for its copy of local 1's pack


def test_verify_and_gc_of_a_local_tier_follow_its_references(tmp_path, sharding, capsys):
    # `checkpointer verify` and `checkpointer gc` run on a local tier's process folder as
    # on any directory of steps: verify reads every referenced chunk and pack where it lies
    # (an earlier local step), gc retires the step the kept one references and reports it.
    from checkpointer import _cli

    d, local = str(tmp_path / "run"), str(tmp_path / "local")
    root = f"{local}/process-0"
    base = arr(sharding, seed=3)
    with ckpt.CheckpointManager(d, local_directory=local, keep=ckpt.KeepLatest(2), keep_local=ckpt.KeepLatest(4),
                                incremental=True, async_save=False) as mgr:
        for step in range(4):
            mgr.save(step, {"base": base, "adapter": arr(sharding, float(step)), **_small_tree(step)})
    assert refs_in(f"{root}/3", "base") == {"0"} and _pack_refs(f"{root}/3") == {"packed/process-0/c/0": "0"}
    capsys.readouterr()
    assert _cli.main(["verify", f"{root}/3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # 8 base chunks read in local 0, 8 adapter chunks, 200 frozen packed leaves in local 0's pack, the lora.
    assert report["ok"] and report["chunks_checked"] == 8 + 8 + 200 + 1, report
    assert _cli.main(["gc", root, "--keep-latest", "1", "--json"]) == 0
    gc = json.loads(capsys.readouterr().out)
    assert gc["removed_steps"] == [1, 2] and gc["kept_steps"] == [3], gc
    retired = gc["retired_steps"]["0"]
    assert retired["referenced_by"] == [3] and retired["freed_bytes"] >= 8 * (N * N // 8) * 4  # local 0's adapter
    assert retired["kept_bytes"] >= N * N * 4 + 200 * 1024  # the base and the frozen pack local 3 references
    assert chunk_files(f"{root}/0", "adapter") == 0 and chunk_files(f"{root}/0", "base") == 8
    assert _cli.main(["verify", f"{root}/3"]) == 0
    with open(f"{root}/0/arrays/base/c/1/1", "r+b") as f:  # damage a chunk local 3 references
        f.seek(100)
        f.write(b"\xff\xff")
    capsys.readouterr()
    assert _cli.main(["verify", f"{root}/3", "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert any("process-0/0" in p and "base" in p for p in problems), problems
