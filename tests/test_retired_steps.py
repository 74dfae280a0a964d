"""Retired steps (issue 30): retention that removes a step newer steps reference keeps
only the chunks they reference, hides the step, and removes it once nobody does."""

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer import _cli

N = 1024  # 4 MiB float32 leaves in 8 chunks of 512 KiB on the 2x4 mesh: not packed
CHUNK_BYTES = N * N * 4 // 8


@pytest.fixture(scope="module")
def sharding():
    return NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))


def _lora(sharding, step, base, base_version=0):
    """A LoRA-shaped tree: a big frozen base, a big adapter and its optimizer state that
    change every step, 8 frozen small (packed) norms of the base and one small changing
    scale."""
    adapter = jax.device_put(np.full((N, N), float(step), np.float32), sharding)
    return {"base": base, "adapter": adapter, "opt_mu": adapter * 0.5,
            "norms": {f"n{i}": np.full(64, i + base_version, np.float32) for i in range(8)}, "scale": np.full(4, step, np.float32)}


def _chunk_files(folder):
    """(count, bytes) of the chunk files of the big leaves under `folder`."""
    out = [0, 0]
    for leaf in ("base", "adapter", "opt_mu"):
        for root, _, files in os.walk(os.path.join(folder, "arrays", leaf, "c")):
            out[0] += len(files)
            out[1] += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return tuple(out)


def test_retention_retires_the_base_step_and_frees_what_nobody_references(tmp_path, sharding, capsys):
    d = str(tmp_path / "run")
    base = jax.device_put(np.random.default_rng(0).standard_normal((N, N)).astype(np.float32), sharding)
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(2), incremental=True, async_save=False) as mgr:
        for step in range(6):
            mgr.save(step, _lora(sharding, step, base))
        # Step 0 holds the frozen base that 4 and 5 reference: retired, not kept whole.
        assert mgr.all_steps() == [4, 5] and mgr.latest_step() == 5
        mgr.wait_until_finished()
        assert sorted(n for n in os.listdir(d) if not n.startswith(".") and ".deleting-" not in n) == ["0", "4", "5"]
        with open(f"{d}/0/RETIRED") as f:
            assert json.load(f)["referenced_by"] == [1, 2]  # the steps that referenced it when it was retired
        # On disk: the base's 8 chunks once (in 0), and the adapter and optimizer state of
        # the two retained steps; none of step 0's own adapter or optimizer chunks.
        assert _chunk_files(f"{d}/0")[0] == 8 and _chunk_files(f"{d}/0")[1] >= 8 * CHUNK_BYTES
        assert _chunk_files(f"{d}/4")[0] == 16 and _chunk_files(f"{d}/5")[0] == 16
        total = sum(_chunk_files(f"{d}/{s}")[1] for s in ("0", "4", "5"))
        assert total <= 5 * N * N * 4 * 1.01  # base + 2 x (adapter + optimizer state)
        assert os.path.exists(f"{d}/0/packed")  # the pack of the frozen norms 5 references stays whole
        r = mgr.restore(5)
        want = _lora(sharding, 5, base)
        for k in ("base", "adapter", "opt_mu"):
            np.testing.assert_array_equal(np.asarray(r[k]), np.asarray(want[k]))
        np.testing.assert_array_equal(r["norms"]["n7"], want["norms"]["n7"])
        np.testing.assert_array_equal(r["scale"], want["scale"])
        assert ckpt.verify(f"{d}/5").ok and ckpt.verify(f"{d}/4").ok
        with pytest.raises(ckpt.CheckpointNotFoundError, match=r"retired.*steps 1, 2 when it was retired"):
            mgr.restore(0)
        with pytest.raises(ckpt.CheckpointNotFoundError, match="retired"):
            ckpt.restore(f"{d}/0")
        capsys.readouterr()
        assert _cli.main(["ls", d, "--json"]) == 0
        rows = {r["folder"]: r for r in json.loads(capsys.readouterr().out)["steps"]}
        assert rows["0"]["state"] == "retired" and not rows["0"]["committed"]
        assert [f for f, r in rows.items() if r["committed"]] == ["4", "5"]
        # The base changes: once the last step referencing 0 goes, 0 goes whole.
        new_base = base + 1
        for step in (6, 7):
            mgr.save(step, _lora(sharding, step, new_base, base_version=1))
        assert mgr.all_steps() == [6, 7]
        mgr.wait_until_finished()
        np.testing.assert_array_equal(np.asarray(mgr.restore(7)["base"]), np.asarray(new_base))
    assert sorted(n for n in os.listdir(d) if not n.startswith(".")) == ["6", "7"]


def test_gc_retires_reports_what_it_freed_and_finishes_an_interrupted_retirement(tmp_path, sharding, capsys):
    d = str(tmp_path / "run")
    base = jax.device_put(np.random.default_rng(1).standard_normal((N, N)).astype(np.float32), sharding)
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(10), incremental=True, async_save=False) as mgr:
        for step in range(3):
            mgr.save(step, _lora(sharding, step, base))
    capsys.readouterr()
    assert _cli.main(["gc", d, "--keep-latest", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["removed_steps"] == [1] and report["kept_steps"] == [2]
    retired = report["retired_steps"]["0"]
    assert retired["referenced_by"] == [2] and retired["freed_bytes"] >= 2 * N * N * 4  # adapter + opt_mu of 0
    assert retired["kept_bytes"] >= N * N * 4  # the base 2 references
    assert ckpt.CheckpointManager(d, read_only=True).all_steps() == [2]
    # A crash after the marker, before any chunk went: a rerun of gc frees them.
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(10), incremental=True, async_save=False) as mgr:
        mgr.save(3, _lora(sharding, 3, base))
    os.makedirs(f"{d}/0/arrays/adapter/c/9", exist_ok=True)  # stands for a chunk of 0 nobody references
    open(f"{d}/0/arrays/adapter/c/9/9", "wb").close()
    with open(f"{d}/2/RETIRED", "w") as f:  # 2 retired by a gc that crashed before deleting anything
        json.dump({"referenced_by": [3]}, f)
    assert ckpt.CheckpointManager(d, read_only=True).all_steps() == [3]
    np.testing.assert_array_equal(np.asarray(ckpt.restore(f"{d}/3")["base"]), np.asarray(base))
    assert _cli.main(["gc", d, "--json"]) == 0
    assert not os.path.exists(f"{d}/2")  # 3 references nothing of 2: removed whole
    assert not os.path.exists(f"{d}/0/arrays/adapter/c/9/9") and _chunk_files(f"{d}/0")[0] == 8  # the base stays
    assert ckpt.verify(f"{d}/3").ok


def test_object_stores_retire_alike(sharding):
    d = "memory://retired-test/run"
    base = jax.device_put(np.random.default_rng(2).standard_normal((N, N)).astype(np.float32), sharding)
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(1), incremental=True, async_save=False) as mgr:
        for step in range(3):
            mgr.save(step, _lora(sharding, step, base))
        assert mgr.all_steps() == [2]
        with pytest.raises(ckpt.CheckpointNotFoundError, match="retired"):
            mgr.restore(0)
        np.testing.assert_array_equal(np.asarray(mgr.restore(2)["base"]), np.asarray(base))
    from checkpointer._storage import storage_for

    storage, path = storage_for(d)
    files = storage.list_files(f"{path}/0")
    assert "RETIRED" in files and not [f for f in files if f.startswith("arrays/adapter/c")]
    assert len([f for f in files if f.startswith("arrays/base/c")]) == 8
    assert ckpt.verify(f"{d}/2").ok
    assert ckpt.CheckpointManager(d, read_only=True).all_steps() == [2]  # the catalog hides it too
