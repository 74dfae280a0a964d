"""Replica-parallel writes with real processes (issue 12 item 1): 4 processes x 2 CPU
devices save a fully replicated state and a data-parallel x model-parallel state; each
process writes about a quarter of the bytes, every chunk once, as `plan_save` predicted;
both restore bit-exactly onto 1x8, 4x2 and 1x1. One single-process test checks that a
save reuses the tree's plan only while the shardings stay the same.
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P
from multiprocess import WORKERS, run_processes

import checkpointer as ckpt
from checkpointer._save import _pipeline as _save

STATES = ("replicated", "dpmp")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("replica_parallel")
    paths = {s: str(root / s) for s in STATES}
    results = run_processes(WORKERS / "replica_worker.py", 4, 2, {"mode": "save", "paths": paths}, timeout_s=240)
    return {"paths": paths, "planned": [r.record("saved")["planned"] for r in results]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("state", STATES)
def test_each_process_writes_a_quarter_of_the_bytes_once(saved, state):
    path = Path(saved["paths"][state])
    meta = ckpt.metadata(str(path))
    written = list(meta.process_bytes_written)
    share = sum(written) / 4
    assert len(written) == 4
    for i, b in enumerate(written):
        assert abs(b - share) <= 0.25 * share, (state, i, written)
    # Deduplicated: the leaf bytes once, plus the zarr shard indexes.
    assert meta.total_bytes <= sum(written) <= 1.02 * meta.total_bytes, (written, meta.total_bytes)
    # As planned, on every process, before the save.
    assert all(p[state] == written for p in saved["planned"]), (saved["planned"], written)
    # Every chunk file has exactly one writer, and the records match the files on disk.
    owners = {}
    for i in range(4):
        record = json.loads((path / "processes" / f"{i}.json").read_text())
        for c in record["chunks"]:
            assert c["key"] not in owners, f"{c['key']} written by {owners[c['key']]} and {i}"
            owners[c["key"]] = i
            assert (path / c["key"]).stat().st_size == c["bytes"]
    # Chunk files: zarr shard files under arrays/, and the packs of small leaves (packed/).
    on_disk = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and "/c/" in str(p.relative_to(path))}
    assert set(owners) == on_disk
    # The large replicated leaves were split: their chunks are smaller than the leaf.
    big = "a" if state == "replicated" else "w1"
    assert meta.arrays[big].chunk_shape[0] < meta.arrays[big].shape[0]
    assert {owners[k] for k in owners if k.startswith(f"arrays/{big}/")} == {0, 1, 2, 3}
    # Every chunk's checksums and the writers' records agree with the subdivided grid.
    report = ckpt.verify(str(path))
    assert report.ok, report.problems


# (processes, devices per process, mesh shape, axis names, one spec for every leaf or None = the saving specs)
LAYOUTS = {
    "1x8": (1, 8, [8], ["d"], ["d"]),
    "4x2": (4, 2, [4, 2], ["data", "model"], None),
    "1x1": (1, 1, [1], ["d"], []),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replica_parallel_checkpoints_restore_bit_exactly(saved, layout):
    n, d, shape, axes, spec = LAYOUTS[layout]
    args = {"mode": "restore", "paths": saved["paths"], "mesh_shape": shape, "axis_names": axes, "spec": spec}
    results = run_processes(WORKERS / "replica_worker.py", n, d, args, timeout_s=240)
    for r in results:
        got = {rec["state"]: rec for rec in r.records if rec["event"] == "restored"}
        assert sorted(got) == sorted(STATES), r.describe()
        for state, rec in got.items():
            assert rec["ok"] and rec["checked_shards"] > 0, (layout, state, r.process_id, rec["mismatches"])


def test_plan_is_reused_only_for_the_same_shardings(tmp_path):
    """Saves reuse the tree's plan across steps, and never a plan of other shardings."""
    mesh = make_mesh((2, 4), ("data", "model"))
    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    rows = {"x": jax.device_put(x, NamedSharding(mesh, P("data", "model")))}
    cols = {"x": jax.device_put(x, NamedSharding(mesh, P("model", "data")))}
    ckpt.save(str(tmp_path / "1"), rows)
    plan = next(reversed(_save._PLAN_CACHE.values()))
    ckpt.save(str(tmp_path / "2"), rows)
    assert next(reversed(_save._PLAN_CACHE.values())) is plan  # reused
    ckpt.save(str(tmp_path / "3"), cols)
    assert [ckpt.metadata(str(tmp_path / s)).arrays["x"].chunk_shape for s in "123"] == [(32, 8), (32, 8), (16, 16)]
    for s in "123":
        assert np.array_equal(np.asarray(ckpt.restore(str(tmp_path / s))["x"]), x)
