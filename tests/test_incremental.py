"""Incremental saves (issue 30): unchanged chunks stored as references to an earlier
committed step, the format that says so, every reader following them, hostile
references refused, and retention that keeps what is referenced."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy
from incremental_steps import N, arr, chunk_files, manifest
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer import _cli, _format


@pytest.fixture(scope="module")
def sharding():
    return NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("a", "b"))


def _write_manifest(path, m):
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(m, f)


def _refs(path, leaf):
    return manifest(path)["leaves"][leaf].get("references", [])


def test_unchanged_chunks_are_references_and_every_reader_follows_them(tmp_path, sharding):
    base, adapter = arr(sharding, seed=1), arr(sharding, 1.0)
    d = str(tmp_path)
    ckpt.save(f"{d}/0", {"base": base, "adapter": adapter, "n": 3}, incremental=True)
    assert manifest(f"{d}/0")["format_version"] == 1  # nothing to reference: readable by older releases
    adapter1 = adapter + 1
    ckpt.save(f"{d}/1", {"base": base, "adapter": adapter1, "n": 3}, incremental=True)  # base: by identity
    m = manifest(f"{d}/1")
    assert m["format_version"] == _format.FORMAT_VERSION_REFERENCES
    assert {r["in"] for r in _refs(f"{d}/1", "base")} == {"0"} and len(_refs(f"{d}/1", "base")) == 8
    assert _refs(f"{d}/1", "adapter") == [] and chunk_files(f"{d}/1", "base") == 0
    assert sum(m["process_bytes_written"]) < (N * N * 4) * 1.05  # the adapter's bytes only
    # By content: a fresh copy of the base (first proven by comparison, then by the kept XXH3-128).
    ckpt.save(f"{d}/2", {"base": jax.device_put(np.asarray(base), sharding), "adapter": adapter1, "n": 3}, incremental=True)
    assert {r["in"] for r in _refs(f"{d}/2", "base")} == {"0"}  # flat: to where the bytes lie
    assert {r["in"] for r in _refs(f"{d}/2", "adapter")} == {"1"}
    assert all(r.get("xxh3_128") for r in _refs(f"{d}/2", "base"))
    changed = np.asarray(base).copy()
    changed[0, 0] += 1  # one chunk changes
    ckpt.save(f"{d}/3", {"base": jax.device_put(changed, sharding), "adapter": adapter1, "n": 3}, incremental=True)
    assert len(_refs(f"{d}/3", "base")) == 7 and chunk_files(f"{d}/3", "base") == 1
    # restore (host and sharded), plan, verify, export
    for step, want in [(1, np.asarray(base)), (2, np.asarray(base)), (3, changed)]:
        r = ckpt.restore(f"{d}/{step}")
        np.testing.assert_array_equal(r["base"], want)
        np.testing.assert_array_equal(r["adapter"], np.asarray(adapter1))
        assert r["n"] == 3
    r = ckpt.restore(f"{d}/3", {"base": sharding, "adapter": sharding, "n": None})
    np.testing.assert_array_equal(np.asarray(r["base"]), changed)
    plan = ckpt.plan_restore(f"{d}/3", {"base": sharding, "adapter": sharding, "n": None})
    sources = plan.bytes_read_by_source
    assert set(sources) == {None, "0", "1"} and f"{d}/0" in str(plan)
    report = ckpt.verify(f"{d}/3")
    assert report.ok, report
    ckpt.export(f"{d}/3", f"{tmp_path}/out.npz", format="npz")
    with np.load(f"{tmp_path}/out.npz") as z:
        np.testing.assert_array_equal(next(z[k] for k in z.files if "base" in k), changed)
    ckpt.export(f"{d}/2", f"{tmp_path}/st", format="safetensors")
    tensors = {}
    for name in os.listdir(f"{tmp_path}/st"):
        if name.endswith(".safetensors"):
            tensors.update(safetensors.numpy.load_file(f"{tmp_path}/st/{name}"))
    np.testing.assert_array_equal(tensors["base"], np.asarray(base))
    assert ckpt.metadata(f"{d}/3").referenced_bytes == 15 * (N * N * 4) // 8


def test_a_save_without_references_keeps_format_version_1(tmp_path, sharding):
    d = str(tmp_path)
    ckpt.save(f"{d}/0", {"w": arr(sharding, 1.0)}, incremental=True)
    ckpt.save(f"{d}/1", {"w": arr(sharding, 2.0)}, incremental=True)  # everything changed
    assert manifest(f"{d}/1")["format_version"] == 1
    ckpt.save(f"{d}/2", {"w": arr(sharding, 2.0)})  # incremental off: a full save
    assert manifest(f"{d}/2")["format_version"] == 1 and chunk_files(f"{d}/2", "w") == 8


def _two_steps(d, sharding):
    base = arr(sharding, seed=2)
    ckpt.save(f"{d}/0", {"base": base}, incremental=True)
    ckpt.save(f"{d}/1", {"base": base}, incremental=True)
    return np.asarray(base)


@pytest.mark.parametrize("case", ["leaves", "self", "missing", "generation", "chain", "version1", "outside"])
def test_hostile_references_are_corrupt_checkpoint_errors_naming_both_steps(tmp_path, sharding, case):
    d = str(tmp_path)
    _two_steps(d, sharding)
    m = manifest(f"{d}/1")
    refs = m["leaves"]["base"]["references"]
    if case == "leaves":
        refs[0]["in"] = "../elsewhere"
    elif case == "self":
        refs[0]["in"] = "1"
    elif case == "missing":
        refs[0]["in"] = "7"
    elif case == "generation":
        refs[0]["generation"] = "20000101000000-00000000"
    elif case == "chain":  # step 0 references step 1 for the same chunk: a cycle
        m0 = manifest(f"{d}/0")
        m0["format_version"] = 2
        m0["leaves"]["base"]["references"] = [dict(refs[0], **{"in": "1", "generation": m["generation"]})]
        _write_manifest(f"{d}/0", m0)
    elif case == "version1":
        m["format_version"] = 1
    elif case == "outside":
        refs[0]["chunk"] = [9, 0]
    _write_manifest(f"{d}/1", m)
    with pytest.raises(ckpt.CorruptCheckpointError) as e:
        ckpt.restore(f"{d}/1")
    text = str(e.value)
    assert f"{d}/1" in text and "leaf ['base']" in text  # the leaf as jax.tree_util.keystr prints it
    if case in ("missing", "generation", "chain"):
        assert (f"{d}/7" if case == "missing" else f"{d}/0") in text
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.verify(f"{d}/1")


def test_verify_checks_the_referenced_bytes(tmp_path, sharding):
    d = str(tmp_path)
    _two_steps(d, sharding)
    m = manifest(f"{d}/1")
    m["leaves"]["base"]["references"][3]["data_crc32c"] ^= 1  # the reference names other bytes than step 0 holds
    _write_manifest(f"{d}/1", m)
    report = ckpt.verify(f"{d}/1")
    assert not report.ok and any("referenced in" in p and "crc32c" in p for p in report.problems), report
    assert ckpt.verify(f"{d}/0").ok


def test_a_deleted_referenced_step_is_reported_not_misread(tmp_path, sharding):
    d = str(tmp_path)
    _two_steps(d, sharding)
    os.remove(f"{d}/0/COMMITTED")
    with pytest.raises(ckpt.CorruptCheckpointError, match="not a committed checkpoint"):
        ckpt.restore(f"{d}/1")


def test_overwriting_a_referenced_step_refuses_naming_the_steps(tmp_path, sharding):
    d = str(tmp_path)
    _two_steps(d, sharding)
    with pytest.raises(ckpt.CheckpointExistsError, match=r"\['1'\]"):
        ckpt.save(f"{d}/0", {"base": arr(sharding, 5.0)}, overwrite=True)
    ckpt.restore(f"{d}/1")  # still whole


def test_manager_retention_keeps_referenced_steps_until_nobody_references_them(tmp_path, sharding):
    d = str(tmp_path / "run")
    base = arr(sharding, seed=3)
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(2), incremental=True, async_save=True) as mgr:
        for step in range(5):
            mgr.save(step, {"base": base, "adapter": arr(sharding, float(step))})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]  # 0 is retired: it holds only the frozen base 3 and 4 reference
        assert os.path.exists(f"{d}/0/RETIRED")
        with pytest.raises(ckpt.CheckpointExistsError, match="reference"):
            mgr.save(0, {"base": base, "adapter": arr(sharding, 9.0)}, force=True)
        new_base = arr(sharding, seed=4)
        for step in (5, 6):
            mgr.save(step, {"base": new_base, "adapter": arr(sharding, float(step))})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [5, 6]  # nobody references 0 any more
        np.testing.assert_array_equal(np.asarray(mgr.restore(6)["base"]), np.asarray(new_base))
    assert not [n for n in os.listdir(d) if n == "0"]


def test_gc_reports_what_it_freed_and_what_it_kept_for_whom(tmp_path, sharding, capsys):
    d = str(tmp_path / "run")
    base = arr(sharding, seed=5)
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(10), incremental=True, async_save=False) as mgr:
        for step in range(4):
            mgr.save(step, {"base": base, "adapter": arr(sharding, float(step))})
    capsys.readouterr()
    assert _cli.main(["gc", d, "--keep-latest", "1", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kept_for_references"] == {"0": [3]}
    assert _cli.main(["gc", d, "--keep-latest", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["removed_steps"] == [1, 2] and report["kept_for_references"] == {"0": [3]}
    assert report["freed_bytes"] >= 2 * N * N * 4
    assert ckpt.verify(f"{d}/3").ok


WORKER = os.path.join(os.path.dirname(__file__), "incremental_crash_worker.py")
# Every storage operation of retention: the references read, the step moved aside
# (unpublished), its bytes removed; at the first and a later retention.
KILL_POINTS = ["refs_read:3", "retention_renamed:1", "retention_deleted:1", "retention_renamed:3", "retention_deleted:4",
               "retired:1", "retired:2", "pruned:1", "pruned:3"]  # retiring: the marker, the chunks nobody references


@pytest.mark.parametrize("kill_point", KILL_POINTS)
def test_a_crash_at_any_point_of_retention_leaves_no_dangling_reference(tmp_path, kill_point):
    d = str(tmp_path / "run")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    res = subprocess.run([sys.executable, WORKER, d, kill_point], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr[-2000:])
    reader = ckpt.CheckpointManager(d, read_only=True)
    steps = reader.all_steps()
    assert steps
    # Every committed step restores whole: no reference dangles. Through the manager: the
    # kill (on the deleter thread) may land between the next step's marker and its rename,
    # leaving a committed `<step>.partial-*` that the manager reads until recovery renames it.
    for step in steps:
        r = reader.restore(step)
        assert r["step"] == step and float(r["adapter"].reshape(-1)[0]) == step - step % 2
        assert r["base"].shape == (256, 256)
    # The next writer's retention finishes the job.
    res = subprocess.run([sys.executable, WORKER, d, "none"], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    steps = ckpt.CheckpointManager(d, read_only=True).all_steps()
    for step in steps:
        assert ckpt.verify(f"{d}/{step}").ok
    # Retired steps hold exactly the chunks the listed steps reference (the rerun finished the job).
    wanted: dict[str, set] = {}
    for step in steps:
        for leaf in ("base", "adapter"):
            for r in _refs(f"{d}/{step}", leaf):
                wanted.setdefault(r["in"], set()).add((leaf, tuple(r["chunk"])))
    retired = [n for n in os.listdir(d) if os.path.exists(f"{d}/{n}/RETIRED")]
    assert set(retired) <= set(wanted)
    for name in retired:
        assert sum(chunk_files(f"{d}/{name}", leaf) for leaf in ("base", "adapter")) == len(wanted[name]), name


def test_ls_shows_owned_and_shared_bytes_and_pictures_show_references(tmp_path, sharding, capsys):
    d = str(tmp_path / "run")
    base = arr(sharding, seed=6)
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(10), incremental=True, async_save=False) as mgr:
        for step in range(2):
            mgr.save(step, {"base": base, "adapter": arr(sharding, float(step))})
    capsys.readouterr()
    assert _cli.main(["ls", d, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows[0]["shared_bytes"] == 0 and rows[1]["shared_bytes"] == N * N * 4 and rows[1]["shared_from"] == ["0"]
    assert _cli.main(["ls", d]) == 0
    assert "shares" in capsys.readouterr().out
    chunks = ckpt.shard_chunks(f"{d}/1", "['base']")
    assert len(chunks) == 8 and {c.referenced_in for c in chunks} == {"0"}


def test_a_leaf_that_stops_changing_is_referenced_again_within_the_recheck_interval(tmp_path, sharding, monkeypatch):
    from checkpointer._save import _incremental

    monkeypatch.setattr(_incremental, "RECHECK_EVERY", 3)
    for direct_io, want in [(False, [0, 0, 8, 8]), ("auto", [8, 8, 8, 8])]:
        d = str(tmp_path / str(direct_io))
        for step in range(2):  # changes: the second save checks it and finds every chunk changed
            ckpt.save(f"{d}/{step}", {"w": arr(sharding, float(step))}, incremental=True, direct_io=direct_io)
        found = []
        for step in range(2, 6):  # stops changing (a fresh copy each time: by content)
            ckpt.save(f"{d}/{step}", {"w": arr(sharding, 1.0)}, incremental=True, direct_io=direct_io)
            found.append(len(_refs(f"{d}/{step}", "w")))
        # Host arrays (direct_io=False): skipped twice without the crc32c pass, then rechecked.
        # Shard images: their crc32c came with the snapshot, so checked (and referenced) at once.
        assert found == want, (direct_io, found)
        np.testing.assert_array_equal(ckpt.restore(f"{d}/5")["w"], np.full((N, N), 1.0, np.float32))


def _check_stats(d, step, tree, direct_io):
    handle = ckpt.save_async(f"{d}/{step}", tree, incremental=True, direct_io=direct_io)
    handle.wait()
    return handle.snapshot.result.incremental


def test_the_check_takes_the_crc32c_of_shard_images_from_the_snapshot(tmp_path, sharding, monkeypatch):
    from checkpointer._save import _incremental

    monkeypatch.setattr(_incremental, "RECHECK_EVERY", 1)  # host arrays checked on every save too
    nbytes = N * N * 4
    for direct_io, crc_pass in [("auto", 0), (False, nbytes)]:
        d = str(tmp_path / str(direct_io))
        ckpt.save(f"{d}/0", {"w": arr(sharding, 0.0)}, incremental=True, direct_io=direct_io)
        changed = _check_stats(d, 1, {"w": arr(sharding, 1.0)}, direct_io)
        assert changed.chunks_changed == 8 and changed.bytes_hashed == crc_pass, (direct_io, changed)
        # Unchanged (a fresh copy): the crc32c matches, then XXH3-128 of the bytes, compared
        # with the base's bytes read back once; the next save by the kept hash alone.
        same = _check_stats(d, 2, {"w": arr(sharding, 1.0)}, direct_io)
        assert same.chunks_by_comparison == 8 and same.bytes_hashed == crc_pass + nbytes, (direct_io, same)
        again = _check_stats(d, 3, {"w": arr(sharding, 1.0)}, direct_io)
        assert again.chunks_by_hash == 8 and again.bytes_compared == 0 and again.bytes_referenced == nbytes
        np.testing.assert_array_equal(ckpt.restore(f"{d}/3")["w"], np.full((N, N), 1.0, np.float32))


def test_a_shard_image_is_checked_between_its_checksum_pass_and_its_write(tmp_path, sharding, monkeypatch):
    """Each image is checksummed once, on the writer's thread, and checked right there,
    before its write (no pass over every image before the first write, which cost a
    pretraining loop ~0.1 CPU-s/GiB); an unchanged chunk leaves neither file nor folder."""
    from checkpointer._encoding import _image, _write

    events = []
    checksum, write = _image._checksum, _write.write_image
    monkeypatch.setattr(_image, "_checksum", lambda image, *a: (events.append(("checksum", id(image))), checksum(image, *a))[1])
    monkeypatch.setattr(_write, "write_image", lambda path, image, direct: (events.append(("write", id(image))), write(path, image, direct))[1])
    monkeypatch.setattr(_write, "_THREADS", 1)  # one writer thread: the order of its tasks is the order of events
    paced, acquire = [], _write.acquire
    monkeypatch.setattr(_write, "acquire", lambda limiter, n: (paced.append(n) if limiter is not None else None, acquire(limiter, n))[1])
    d = str(tmp_path)
    ckpt.save(f"{d}/0", {"frozen": arr(sharding, 2.0), "w": arr(sharding, 0.0)}, incremental=True)
    events.clear()
    ckpt.save(f"{d}/1", {"frozen": arr(sharding, 2.0), "w": arr(sharding, 1.0)}, incremental=True,  # frozen: a fresh copy
              max_write_bytes_per_s=1 << 40)
    assert sum(paced) == N * N * 4  # only w's chunks, written, are paced
    kinds = [e for e, _ in events]
    assert kinds == ["checksum"] * 8 + ["checksum", "write"] * 8, kinds  # frozen's chunks referenced, w's written
    assert all(events[k][1] == events[k + 1][1] for k in range(8, 24, 2))  # each write right after its own checksum
    assert not os.path.exists(os.path.join(d, "1", "arrays", "frozen", "c")) and chunk_files(f"{d}/1", "w") == 8
    assert len(_refs(f"{d}/1", "frozen")) == 8
    out = ckpt.restore(f"{d}/1")
    np.testing.assert_array_equal(out["frozen"], np.full((N, N), 2.0, np.float32))
    np.testing.assert_array_equal(out["w"], np.full((N, N), 1.0, np.float32))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_a_shard_images_data_reads_back_as_the_chunks_c_order_bytes(strided):
    from test_direct_io import LAYOUTS, _values

    from checkpointer import _encoding, _memory
    from checkpointer._format import ArrayMetadata

    for name, (shape, chunk, inner, cells) in sorted(LAYOUTS.items()):
        meta = ArrayMetadata("w", shape, np.dtype(np.float32), chunk, inner, None)
        values = _values(shape, np.float32, seed=len(name))
        for cell in cells:
            box = _format.cell_box(cell, meta.chunk_shape, meta.shape)
            host = np.array(values[box.slices()], order="C")
            src = host
            if strided and host.ndim:
                wide = np.zeros((*host.shape[:-1], host.shape[-1] * 2), host.dtype)
                wide[..., ::2] = host
                src = wide[..., ::2]
            (image,) = _encoding.fill_images([(meta.layout, src)], lambda n: _memory.page_aligned_empty((n,), np.dtype(np.uint8)))
            pieces = _encoding.image_data(image, meta.layout, tuple(box.shape), meta.dtype)
            assert b"".join(p.tobytes() for p in pieces) == host.tobytes(), (name, cell)


@pytest.mark.multiprocess
def test_two_processes_reference_their_own_chunks_and_process_0_gathers_them(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from multiprocess import WORKERS, run_processes

    d = str(tmp_path / "run")
    results = run_processes(WORKERS / "incremental_worker.py", 2, 4, {"directory": d}, timeout_s=120)
    for r in results:
        rec = r.record("saved")
        assert rec["steps"] == [1, 2] and rec["base_ok"] and rec["adapter"] == 2.0  # 0 retired: it holds the base
        # Both processes' chunks of the base (4 each) are references in the manifest.
        assert rec["refs"]["2"] == {"base": 8, "adapter": 0} and rec["refs"]["1"] == {"base": 8, "adapter": 0}
        assert rec["cooperative"] and "0" in rec["sources"]  # the cooperative plan reads the base from step 0
    assert ckpt.verify(f"{d}/2").ok and os.path.exists(f"{d}/0/RETIRED")


@pytest.mark.parametrize("tiers", [False, True], ids=["one tier", "two tiers"])
def test_two_processes_reference_their_packed_chunks_and_restore_them_cooperatively(tmp_path, tiers):
    sys.path.insert(0, os.path.dirname(__file__))
    from multiprocess import WORKERS, run_processes

    d = str(tmp_path / "run")
    args = {"directory": d, "local": str(tmp_path / "local")} if tiers else {"directory": d}
    for r in run_processes(WORKERS / "incremental_packs_worker.py", 2, 4, args, timeout_s=120):
        rec = r.record("saved")
        # The third save wrote each process's half of the adapter (8x64 float32 split over
        # the processes) and its pack's crc32c: no frozen small leaf.
        assert rec["written"] == [4 * 64 * 4 + 4] * 2 and rec["refs"] == 6 * 2 + 1, rec
        assert rec["ok"] and rec["cooperative"] and "0" in rec["sources"], rec
    assert ckpt.verify(f"{d}/2").ok


# The object store's own windows: the marker deleted with the catalog entry still there,
# and both gone with the objects still there (reading references and removing the bytes
# are the local test's points, the same code on every backend).
S3_KILL_POINTS = ["catalog:1", "unpublished:1", "retired:1"]


@pytest.fixture(scope="module")
def s3():
    from gcsserver import started_or_skipped
    from s3server import running_s3_server

    with started_or_skipped(running_s3_server) as server:
        yield server


@pytest.mark.parametrize("kill_point", S3_KILL_POINTS)
def test_a_crash_at_any_point_of_retention_on_an_object_store_leaves_no_dangling_reference(s3, kill_point):
    # On an object store retention deletes the step's marker, then its catalog entry, then
    # its objects (moto's S3 over HTTP; the worker is killed between any two).
    d = f"s3://{s3.new_bucket('incr-crash')}/run"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    res = subprocess.run([sys.executable, WORKER, d, kill_point], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr[-2000:])
    reader = ckpt.CheckpointManager(d, read_only=True)
    steps = reader.all_steps()
    assert steps
    for step in steps:
        r = reader.restore(step)
        assert r["step"] == step and float(r["adapter"].reshape(-1)[0]) == step - step % 2
    res = subprocess.run([sys.executable, WORKER, d, "none"], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    for step in ckpt.CheckpointManager(d, read_only=True).all_steps():
        assert ckpt.verify(f"{d}/{step}").ok


def test_object_stores_reference_and_retain_alike(sharding):
    d = "memory://incremental-test/run"  # written in place, the commit marker decides
    base = arr(sharding, seed=7)
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(1), incremental=True, async_save=False) as mgr:
        for step in range(3):
            mgr.save(step, {"base": base, "adapter": arr(sharding, float(step))})
        assert mgr.all_steps() == [2]  # 0 retired: hidden, its base kept for 2
        np.testing.assert_array_equal(np.asarray(mgr.restore(2)["base"]), np.asarray(base))
        with pytest.raises(ckpt.CheckpointNotFoundError, match="retired"):
            mgr.restore(0)
    assert ckpt.metadata(f"{d}/2").referenced_bytes == N * N * 4
    assert ckpt.verify(f"{d}/2").ok


def test_a_base_with_a_dangling_reference_gives_a_full_save_not_a_failed_one(tmp_path, sharding, caplog):
    d = str(tmp_path)
    base = arr(sharding, seed=8)
    for step in range(3):
        ckpt.save(f"{d}/{step}", {"base": base}, incremental=True)
    os.remove(f"{d}/0/COMMITTED")  # step 1 and 2 now dangle (damage from outside the library)
    ckpt.save(f"{d}/3", {"base": base}, incremental=True)
    assert _refs(f"{d}/3", "base") == [] and manifest(f"{d}/3")["format_version"] == 1
    assert "cannot read the base" in caplog.text
    np.testing.assert_array_equal(ckpt.restore(f"{d}/3")["base"], np.asarray(base))


def _lora(sharding, step, big):
    """A LoRA-shaped tree: 40 frozen small leaves (norms and biases of the base), 4
    small adapters that change every step, and a big frozen leaf (not packed)."""
    frozen = {f"norm{i}": np.full(256, i, np.float32) for i in range(40)}
    adapters = {f"lora{i}": np.full((64, 16), step * 10 + i, np.float32) for i in range(4)}
    return {"base": {"w": big, **frozen}, "adapters": adapters}


def _packed_refs(path):
    return [p for p in manifest(path).get("packed", []) if "in" in p]


def test_unchanged_packed_leaves_are_referenced_not_rewritten(tmp_path, sharding):
    d = str(tmp_path)
    big = arr(sharding, seed=7)
    for step in range(3):
        ckpt.save(f"{d}/{step}", _lora(sharding, step, big), incremental=True)
    adapter_bytes = 4 * 64 * 16 * 4
    m = manifest(f"{d}/2")
    assert m["format_version"] == _format.FORMAT_VERSION_REFERENCES
    # The third save wrote the adapters' packed bytes (and the pack's crc32c) only: no byte
    # of a frozen small leaf, no chunk of the big one.
    assert sum(m["process_bytes_written"]) == adapter_bytes + 4
    assert os.path.getsize(f"{d}/2/packed/process-0/c/0") == adapter_bytes + 4
    refs = _packed_refs(f"{d}/2")
    assert {p["in"] for p in refs} == {"0"}  # flat: to the pack that holds the bytes
    assert sorted(b["leaf"] for p in refs for b in p["boxes"]) == sorted(f"base/norm{i}" for i in range(40))
    assert all(b.get("xxh3_128") for p in refs for b in p["boxes"])
    assert ckpt.metadata(f"{d}/2").referenced_bytes == N * N * 4 + 40 * 256 * 4
    replicated = NamedSharding(sharding.mesh, P())
    target = jax.tree.map(lambda _: replicated, _lora(sharding, 2, big))
    target["base"]["w"] = sharding
    by_source = ckpt.plan_restore(f"{d}/2", target).bytes_read_by_source
    assert set(by_source) == {None, "0"} and by_source[None] == adapter_bytes, by_source  # packs where they lie
    chunks = ckpt.shard_chunks(f"{d}/2", "base/norm3")
    assert [(c.packed, c.referenced_in) for c in chunks] == [(True, "0")]
    for step in range(3):
        r = ckpt.restore(f"{d}/{step}")
        want = _lora(sharding, step, big)
        np.testing.assert_array_equal(r["base"]["norm7"], want["base"]["norm7"])
        np.testing.assert_array_equal(r["adapters"]["lora3"], want["adapters"]["lora3"])
        np.testing.assert_array_equal(r["base"]["w"], np.asarray(big))
        assert ckpt.verify(f"{d}/{step}").ok
    ckpt.export(f"{d}/2", f"{tmp_path}/out.npz", format="npz")
    with np.load(f"{tmp_path}/out.npz") as z:
        np.testing.assert_array_equal(next(z[k] for k in z.files if k.endswith("norm39")), np.full(256, 39, np.float32))
    with pytest.raises(ckpt.CheckpointExistsError, match=r"\['1', '2'\]"):
        ckpt.save(f"{d}/0", _lora(sharding, 9, big), overwrite=True)


def test_retention_keeps_the_step_whose_pack_is_referenced(tmp_path, sharding):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(1), incremental=True, async_save=False) as mgr:
        for step in range(3):
            tree = _lora(sharding, step, None)
            del tree["base"]["w"]  # small leaves only: nothing but the pack references keeps step 0
            mgr.save(step, tree)
        assert mgr.all_steps() == [2]  # 1 deleted; 0 retired: its pack holds the frozen small leaves 2 references
        r = mgr.restore(2)
    np.testing.assert_array_equal(np.asarray(r["base"]["norm5"]), np.full(256, 5, np.float32))
    np.testing.assert_array_equal(np.asarray(r["adapters"]["lora0"]), np.full((64, 16), 20, np.float32))
    assert ckpt.verify(f"{d}/2").ok


def test_a_corrupted_or_hostile_referenced_pack_names_both_steps(tmp_path, sharding):
    d = str(tmp_path)
    big = arr(sharding, seed=9)
    for step in range(2):
        ckpt.save(f"{d}/{step}", _lora(sharding, step, big), incremental=True)
    box = next(b for p in _packed_refs(f"{d}/1") for b in p["boxes"] if b["leaf"] == "base/norm3")
    with open(f"{d}/0/packed/process-0/c/0", "r+b") as f:  # damage norm3's bytes in step 0's pack
        f.seek(box["offset"])
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(ckpt.CorruptCheckpointError) as e:
        ckpt.restore(f"{d}/1")
    assert f"{d}/1" in str(e.value) and f"{d}/0/packed" in str(e.value) and "['norm3']" in str(e.value)
    report = ckpt.verify(f"{d}/1")
    assert not report.ok and any(f"{d}/0/packed" in p and "['norm3']" in p for p in report.problems), report
    m = manifest(f"{d}/1")
    for case in ("generation", "offset", "self"):
        hostile = json.loads(json.dumps(m))
        p = next(p for p in hostile["packed"] if "in" in p)
        if case == "generation":
            p["generation"] = "20000101000000-00000000"
        elif case == "offset":
            p["boxes"][0]["offset"] += 4
        else:
            p["in"] = "1"
        _write_manifest(f"{d}/1", hostile)
        with pytest.raises(ckpt.CorruptCheckpointError) as e:
            ckpt.metadata(f"{d}/1")
        assert f"{d}/1" in str(e.value) and (case == "self" or f"{d}/0" in str(e.value)), (case, str(e.value))
