"""A restart onto another mesh, sharding or number of processes from the local tiers, with
real processes (issue 29, item 3): one job of 4 processes x 2 devices as 4 simulated nodes
(`peer_node="node-<i>"`), peer_copies=2 (process p's copies on p+1 and p+2), saves step 100
durably and 110, 120 locally only; every case restores a copy of it.

Where the surviving local copies hold every file the target needs, nothing is read from the
durable tier (`status().last_restore_durable_bytes == 0`) and the values are bit-exact (the
worker compares every shard); otherwise the newest durable step, and the reason says which
shares are missing."""

import json
import os
import re
import shutil

import pytest
from multiprocess import WORKERS, copy_run as _copy, run_processes

WORKER = WORKERS / "peers_worker.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh-restart")
    args = {"directory": str(tmp / "durable"), "local": str(tmp / "local"), "phase": "save", "steps": [100, 110, 120],
            "peer_copies": 2, "durable_every_steps": 100}
    for r in run_processes(WORKER, 4, 2, args, timeout_s=240):
        assert r.record("saved")["survives"].get("120") == 2, r.describe()
    return tmp, args


def _restored(results, step=120):
    recs = []
    for r in results:
        rec = r.record("restored")
        assert rec["step"] == step and rec["mismatches"] == [], r.describe()
        recs.append(rec)
    return recs


def _exchanged(reason):
    """(files, bytes) the reason says travelled over the device exchange."""
    m = re.search(r"(\d+) files, (\d+) bytes over the device exchange", reason or "")
    assert m, reason
    return int(m.group(1)), int(m.group(2))


@pytest.mark.slow
def test_another_mesh_and_sharding_on_the_same_processes_reads_nothing_durable(saved):
    run = _copy(saved, "other-mesh")
    # Saved on a 4x2 mesh; restored on 2x4, one leaf with another PartitionSpec as well.
    results = run_processes(WORKER, 4, 2, dict(run, restore_mesh=[2, 4], restore_specs={"bf": [None, "data"]}),
                            timeout_s=240)
    for rec in _restored(results):
        assert rec["source"] == "local" and rec["durable_bytes"] == 0, rec
        assert _exchanged(rec["reason"])[0] > 0, rec  # processes received files they did not hold
    # Every process holds its own copy: the step is replicated to the durable tier again.
    assert os.path.exists(f"{run['directory']}/120/COMMITTED")


@pytest.mark.slow
def test_a_replaced_node_onto_another_mesh_receives_over_the_device_exchange(saved):
    run = _copy(saved, "replaced-other-mesh")
    shutil.rmtree(f"{run['local']}/process-1")  # node 1 replaced
    results = run_processes(WORKER, 4, 2, dict(run, restore_mesh=[2, 4]), timeout_s=240)
    for rec in _restored(results):
        assert rec["source"] == "local" and rec["durable_bytes"] == 0, rec
        assert _exchanged(rec["reason"])[0] > 0, rec
    assert "fetched its copy of step 120" in results[1].stderr, results[1].describe()  # afterwards, in the background
    assert os.path.exists(f"{run['local']}/process-1/120/COMMITTED")


@pytest.mark.slow
def test_onto_fewer_processes_from_the_peer_copies(saved):
    run = _copy(saved, "two-processes")
    # 2 processes x 4 devices on node-0 and node-1: their folders hold shares 0, 1 and copies of 0, 2, 3.
    results = run_processes(WORKER, 2, 4, dict(run, restore_specs={"w": ["model", "data"]}), timeout_s=240)
    for rec in _restored(results):
        assert rec["source"] == "local" and rec["durable_bytes"] == 0, rec
        assert "saved by 4 processes, the job has 2" in rec["reason"], rec
        assert _exchanged(rec["reason"])[0] > 0, rec
    # A step of 4 processes is not replicated by a job of 2.
    assert not os.path.exists(f"{run['directory']}/120")
    assert "is not replicated" in results[0].stderr, results[0].describe()


@pytest.mark.slow
def test_onto_fewer_processes_from_the_folders_of_the_same_machines(saved):
    run = _copy(saved, "same-machines")
    # No peer copy; the 4 process folders were 2 per machine (node.json says which).
    for p in range(4):
        shutil.rmtree(f"{run['local']}/process-{p}/peer-copies")
        with open(f"{run['local']}/process-{p}/node.json", "w") as f:
            json.dump({"node": f"node-{p // 2}"}, f)
    results = run_processes(WORKER, 2, 4, dict(run, restore_specs={"w": ["model", "data"], "ids": ["model"]}),
                            timeout_s=240)
    for rec in _restored(results):
        assert rec["source"] == "local" and rec["durable_bytes"] == 0, rec
        assert _exchanged(rec["reason"])[0] > 0, rec


@pytest.mark.slow
def test_onto_fewer_processes_without_a_share_falls_back_to_durable_and_says_which(saved):
    run = _copy(saved, "share-missing")
    shutil.rmtree(f"{run['local']}/process-0/peer-copies/process-2")  # process 2's share survives only on node 2, 3
    shutil.rmtree(f"{run['local']}/process-1/peer-copies/process-2", ignore_errors=True)
    results = run_processes(WORKER, 2, 4, run, timeout_s=240)
    for r, rec in zip(results, _restored(results, step=100)):
        assert rec["source"] == "durable" and rec["durable_bytes"] > 0, rec
        reason = rec["reason"]
        assert reason.startswith("the newest durable step 100 was restored"), reason
        assert "step 120 (saved by 4 processes, the job has 2)" in reason, reason
        assert "hold the shares of processes 0, 1, 3 (3 of 4); the share of process 2 survives in none" in reason, reason
        assert "the share of process 2 survives in none" in r.stderr, r.describe()


def test_the_device_rounds_send_every_byte_once_and_each_device_at_most_one_part_per_round():
    from checkpointer._manage._file_exchange import SPREAD_BYTES, Stream, plan_parts

    devices = {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}
    streams = [Stream(0, 1, (("a", 5), ("b", 3 * SPREAD_BYTES))), Stream(2, 1, (("c", 7),)), Stream(3, 0, (("d", 0),)),
               Stream(0, 3, (("e", 10 * SPREAD_BYTES + 1),))]
    parts = plan_parts(streams, devices, part_bytes=2 * SPREAD_BYTES)
    for i, s in enumerate(streams):  # each stream cut into consecutive parts, every byte once
        mine = sorted((p.offset, p.length) for p in parts if p.stream == i)
        assert mine[0][0] == 0 and sum(n for _, n in mine) == s.nbytes
        assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:]))
        assert {p.src_device for p in parts if p.stream == i} <= set(devices[s.src])
        assert {p.dst_device for p in parts if p.stream == i} <= set(devices[s.dst])
    assert len({p.src_device for p in parts if p.stream == 3}) == 2  # a long stream uses both device pairs
    for rnd in {p.round for p in parts}:
        group = [p for p in parts if p.round == rnd]
        assert len({p.src_device for p in group}) == len(group) == len({p.dst_device for p in group})


def test_the_candidates_are_newest_first_one_generation_each_and_say_which_shares_are_missing():
    from checkpointer._manage._mesh_restart import candidates

    inventories = [  # 2 processes now; step 120 saved by 4 (shares 0, 1, 3 survive), 110 whole
        {"shares": [[120, "g2", 4, 0, True], [120, "g2", 4, 3, False], [110, "g1", 4, 0, True], [110, "g1", 4, 2, False],
                    [110, "g1", 4, 3, False]]},
        {"shares": [[120, "g2", 4, 1, True], [110, "g1", 4, 1, True], [110, "g1", 4, 0, False]]},
    ]
    c120, c110 = candidates(inventories)
    assert (c120.step, c120.generation, c120.whole) == (120, "g2", False)
    assert (c110.step, c110.whole, dict(c110.holders)) == (110, True, {0: (0, 1), 1: (1,), 2: (0,), 3: (0,)})
    assert c120.coverage(2) == ("step 120 (saved by 4 processes, the job has 2): the local copies this job reads hold "
                                "the shares of processes 0, 1, 3 (3 of 4); the share of process 2 survives in none")
