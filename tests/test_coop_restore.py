"""Cooperative restore of replicated targets with real processes (4 x 2 CPU devices, gloo):
each process reads a disjoint share from storage and JAX exchanges the rest.

One checkpoint (a 4 MiB float32 matrix saved sharded, a 1 MiB bfloat16 matrix, a vector
and a PRNG key array, all but the first saved replicated) is saved once by this
process; the workers in `mp_workers/coop_restore_worker.py` restore it.
"""

import shutil
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from multiprocess import WORKERS, run_processes

import checkpointer as ckpt

sys.path.insert(0, str(WORKERS))
import _common  # noqa: E402

pytestmark = pytest.mark.multiprocess

REPLICATED = {"w": [], "emb": [], "b": [], "key": []}
# Replicated across the 'data' axis (across processes), sharded inside each process.
MIXED = {"w": ["model"], "emb": [None, "model"], "b": [], "key": ["model"]}


def _target(name, mesh_shape, axis_names, specs, **kw):
    return {"name": name, "mesh_shape": mesh_shape, "axis_names": axis_names, "specs": specs, **kw}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    values = _common.replicated_values()
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    rep = NamedSharding(mesh, P())
    tree = {
        "w": jax.device_put(values["w"], NamedSharding(mesh, P("data", "model"))),
        "emb": jax.device_put(values["emb"], rep),
        "b": jax.device_put(values["b"], rep),
        "key": jax.random.wrap_key_data(jax.device_put(values["key"], rep), impl="threefry2x32"),
        "step": 7,
    }
    path = str(tmp_path_factory.mktemp("coop") / "7")
    ckpt.save(path, tree)
    return {"path": path, "model_bytes": sum(v.nbytes for v in values.values())}


def test_replicated_restore_reads_the_model_once_over_four_processes(saved):
    targets = [
        _target("replicated", [4, 2], ["data", "model"], REPLICATED),
        _target("mixed-cast", [4, 2], ["data", "model"], MIXED, cast={"w": "bfloat16", "emb": "float32"}),
        _target("every-process-reads", [4, 2], ["data", "model"], REPLICATED, cooperative=False),
    ]
    results = run_processes(WORKERS / "coop_restore_worker.py", 4, 2, {"path": saved["path"], "targets": targets}, timeout_s=180)
    model, share = saved["model_bytes"], saved["model_bytes"] / 4
    got = {name: [next(x for x in r.records if x.get("name") == name) for r in results]
           for name in ("replicated", "mixed-cast", "every-process-reads")}
    for name, recs in got.items():
        for rec in recs:
            assert rec["mismatches"] == [], (name, rec)
    for name in ("replicated", "mixed-cast"):
        recs = got[name]
        read = [rec["bytes_read"] for rec in recs]
        assert all(rec["cooperative"] for rec in recs) and read == [rec["plan_bytes_read"] for rec in recs], recs
        assert sum(read) <= 1.1 * model, (name, read, model)
        assert max(read) <= 1.5 * share, (name, read, share)
    # What a process does not read, it receives: its target boxes are the whole model.
    for rec in got["replicated"]:
        assert rec["bytes_received"] == model - model // 4, rec
    # Without cooperation every process reads the whole model itself.
    plain = got["every-process-reads"]
    assert not any(rec["cooperative"] for rec in plain) and all(rec["bytes_read"] >= model for rec in plain), plain


@pytest.mark.parametrize(
    "layout",
    [
        (2, 4, [_target("2x4-replicated", [2, 4], ["data", "model"], REPLICATED),
                _target("2x4-mixed", [2, 4], ["data", "model"], MIXED)]),
        (1, 8, [_target("8-replicated", [8], ["d"], REPLICATED)]),
        (1, 1, [_target("1", [1], ["d"], REPLICATED)]),
    ],
    ids=["2x4", "1x8", "1x1"],
)
def test_cooperative_restore_is_bit_exact_on_the_reshard_matrix(saved, layout):
    n, d, targets = layout
    results = run_processes(WORKERS / "coop_restore_worker.py", n, d, {"path": saved["path"], "targets": targets}, timeout_s=180)
    for r in results:
        recs = [x for x in r.records if x["event"] == "restored"]
        assert [x["name"] for x in recs] == [t["name"] for t in targets], r.describe()
        for rec in recs:
            assert rec["mismatches"] == [] and rec["cooperative"] == (n > 1), rec
            if n == 1:
                assert rec["bytes_read"] >= saved["model_bytes"] and rec["bytes_received"] == 0, rec
            elif rec["name"] == "2x4-replicated":
                assert rec["bytes_read"] <= 1.5 * saved["model_bytes"] / n, rec


def test_a_process_that_cannot_restore_makes_every_process_raise(saved):
    """Round 1 of the agreement: a different target on the last process, a path that
    retention deleted on process 1; every process raises within seconds, then a
    matching restore still works (the processes' restore counters stay in step)."""
    args = {
        "path": saved["path"],
        "targets": [_target("before", [4, 2], ["data", "model"], REPLICATED)],
        "cases": ["other_target", "missing_path", "again"],
    }
    results = run_processes(WORKERS / "coop_restore_worker.py", 4, 2, args, timeout_s=180)
    for r in results:
        cases = {x["case"]: x for x in r.records if x["event"] == "case"}
        assert sorted(cases) == ["again", "missing_path", "other_target"], r.describe()
        other = cases["other_target"]
        assert other["type"] == "RestoreAgreementError" and "different targets" in other["message"], other
        assert "process 3" in other["message"] and other["elapsed_s"] < 20, other
        missing = cases["missing_path"]
        if r.process_id == 1:
            assert missing["type"] == "CheckpointNotFoundError", missing
        else:
            assert missing["type"] == "RestoreAgreementError", missing
            assert "process 1: CheckpointNotFoundError" in missing["message"] and missing["elapsed_s"] < 20, missing
        assert cases["again"]["type"] is None, cases["again"]


def test_a_process_that_fails_alone_while_the_others_restore_plainly_keeps_the_numbering_in_step(saved):
    """Process 1 cannot restore (its path is gone) a target that shares no box across
    processes, so process 0 restores it plainly, without a rendezvous; then process 0
    alone restores such a target. The next cooperative restore still meets: a restore
    number is taken only by restores that share a box, and a process that fails before
    planning decides that from its target (process 1's refusal used to take a number
    that process 0 never took, and the next restore then met the old refusal)."""
    args = {
        "path": saved["path"],
        "targets": [_target("before", [2, 4], ["data", "model"], REPLICATED)],
        "cases": ["unshared_missing_path", "alone_unshared", "again"],
    }
    results = run_processes(WORKERS / "coop_restore_worker.py", 2, 4, args, timeout_s=180)
    for r in results:
        cases = {x["case"]: x for x in r.records if x["event"] == "case"}
        assert sorted(cases) == ["again", "alone_unshared", "unshared_missing_path"], r.describe()
        assert cases["alone_unshared"]["type"] is None, cases["alone_unshared"]
        first = cases["unshared_missing_path"]
        assert first["type"] == (None if r.process_id == 0 else "CheckpointNotFoundError"), first
        assert cases["again"]["type"] is None and cases["again"]["elapsed_s"] < 20, cases["again"]


def test_cooperative_restore_agreement_names_the_differing_leaf(saved):
    """Processes that restore onto different targets are told which leaf differs (its
    key string) and how on each process (dtype, shape, spec, mesh), not a digest; the
    other leaves, equal everywhere, are not named, and every process gets one message."""
    args = {
        "path": saved["path"],
        "targets": [_target("before", [2, 4], ["data", "model"], REPLICATED)],
        "cases": ["other_target"],
    }
    results = run_processes(WORKERS / "coop_restore_worker.py", 2, 4, args, timeout_s=180)
    cases = [next(x for x in r.records if x["event"] == "case") for r in results]
    assert all(c["type"] == "RestoreAgreementError" for c in cases), cases
    message = cases[0]["message"]
    assert cases[1]["message"] == message  # process 0's verdict, on every process
    assert saved["path"] in message and "different targets" in message, message
    assert "leaf ['w']:" in message, message
    assert "process 0: float32[1024, 1024] P() over mesh (data=2, model=4)" in message, message
    assert "process 1: float32[1024, 1024] P('model',) over mesh (data=2, model=4)" in message, message
    assert "['emb']" not in message and "['b']" not in message and "digest" not in message, message


def test_cooperative_restore_of_a_replicated_packed_leaf_reads_each_packed_byte_once_in_all(tmp_path):
    """A 512 KiB packed leaf (one chunk, replicated) restored replicated over 2 processes:
    each reads its half of the chunk's bytes and receives the other half; the chunk's
    crc32c is checked after the exchange from the halves', so a damaged byte in either
    half fails the restore on both processes, naming the leaf."""
    values = _common.packed_values()
    path = str(tmp_path / "1")
    ckpt.save(path, values, pack_small_leaves_bytes=512 << 10)
    assert ckpt.metadata(path).arrays["w"].packed
    damaged = str(tmp_path / "damaged" / "1")
    shutil.copytree(path, damaged)
    (box,) = ckpt.metadata(damaged).arrays["w"].pack_boxes
    with open(f"{damaged}/{box.key}", "r+b") as f:  # a byte of the second half: process 1's piece
        f.seek(box.offset + box.nbytes * 3 // 4)
        byte = f.read(1)
        f.seek(box.offset + box.nbytes * 3 // 4)
        f.write(bytes([byte[0] ^ 0x01]))
    cases = [{"name": "intact", "path": path}, {"name": "damaged", "path": damaged}]
    results = run_processes(WORKERS / "coop_packed_worker.py", 2, 4, {"cases": cases}, timeout_s=180)
    nbytes = values["w"].nbytes
    for r in results:
        intact = next(x for x in r.records if x.get("name") == "intact")
        assert intact["event"] == "restored" and intact["mismatches"] == [], intact
        assert intact["cooperative"] and intact["shared"] >= 1, intact
        # Half of 'w' each (the small leaf, 128 bytes, adds its own half), as planned.
        assert intact["bytes_read"] == intact["plan_bytes_read"] == (nbytes + values["small"].nbytes) // 2, intact
        assert intact["bytes_received"] == (nbytes + values["small"].nbytes) // 2, intact
        bad = next(x for x in r.records if x.get("name") == "damaged")
        assert bad["event"] == "failed" and bad["type"] == "CorruptCheckpointError", bad
        assert "leaf ['w']" in bad["message"] and "crc32c mismatch" in bad["message"] and "processes [0, 1]" in bad["message"], bad
