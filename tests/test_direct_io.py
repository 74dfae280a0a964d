"""Direct local writes (issue 20 item 1; `_encoding/_write`, `_storage/_direct`).

The conformance tests write the same chunks with TensorStore and with the direct writer
and compare every byte of every file: every dtype the library stores, one inner chunk,
many, edge chunks the array's shape cuts (padded and missing inner chunks), replica-
parallel split grids (real processes) and packs; TensorStore and zarr-python read the
direct files. The mode choice: `auto` takes the direct path here (under `CI=true` the
test fails where it cannot), falls back to TensorStore where `O_DIRECT` is refused
(`EINVAL` and `EOPNOTSUPP` injected at the open and at the write), and `True` refuses to fall back.
Durability: every direct file and every folder it created is fsynced before the
process record is written. A failed direct save stops its writer's threads.
"""

import errno
import json
import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P
from multiprocess import WORKERS, run_processes

import checkpointer as ckpt
from checkpointer import _format
from checkpointer._encoding import _write
from checkpointer._errors import SaveError
from checkpointer._format import ArrayMetadata, zarr_supports_dtype
from checkpointer._storage import _direct

_CANDIDATES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
    *(getattr(ml_dtypes, n) for n in (
        "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
        "float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "int4", "uint4", "int2", "uint2", "float4_e2m1fn",
    ) if hasattr(ml_dtypes, n)),
]
# Every dtype the library stores as a zarr array (those TensorStore's zarr3 driver has).
DTYPES = [np.dtype(d) for d in _CANDIDATES if zarr_supports_dtype(np.dtype(d))]
# Format files whose bytes depend only on what was saved (records and the manifest
# carry timings and the generation).
_VOLATILE = (_format.PROCESSES, _format.MANIFEST, _format.COMMITTED)


def _values(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if dtype.kind in "iu":  # every bit pattern
        return rng.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8).view(dtype).reshape(shape)
    if dtype.name.startswith(("int", "uint")):  # ml_dtypes' sub-byte integers
        info = ml_dtypes.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max), shape, endpoint=True).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _files(path) -> dict[str, bytes]:
    root = Path(path)
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] not in _VOLATILE
    }


def _assert_same_files(direct, buffered):
    a, b = _files(direct), _files(buffered)
    assert sorted(a) == sorted(b)
    differ = [k for k in a if a[k] != b[k]]
    assert not differ, f"files that differ: {differ[:5]}"
    assert any("/c" in k for k in a)  # chunk files were compared, not only metadata


def _record(path, process=0):
    return json.loads(Path(path, _format.PROCESSES, f"{process}.json").read_text())


# --- one chunk file, direct writer against TensorStore -------------------------------------


def _write_both(tmp_path, meta: ArrayMetadata, values: np.ndarray, chunk_index):
    """The chunk `chunk_index` of `values` as TensorStore writes it, and as the direct
    writer does: (TensorStore's bytes, direct bytes, direct record)."""
    box = _format.cell_box(chunk_index, meta.chunk_shape, meta.shape)
    host = np.array(values[box.slices()], order="C")  # a copy, 0-d kept
    key = _format.chunk_key(meta.path, chunk_index)
    ts_root = tmp_path / "ts"
    spec = _format.zarr_spec({"driver": "file", "path": f"{ts_root}/{_format.array_dir(meta.path)}/"}, meta, mode="create")
    store = ts.open(spec).result()
    store[box.slices()].write(host).result()
    direct_root = str(tmp_path / "direct")
    os.makedirs(direct_root, exist_ok=True)
    writer = _write.DirectWriter(direct_root)
    path = f"{direct_root}/{key}"
    writer.makedirs(path.rsplit("/", 1)[0])
    record = writer.submit(_write.write_shard_file, writer, path, meta, chunk_index, box, host).result()
    writer.close(sync=True)
    return (ts_root / key).read_bytes(), Path(path).read_bytes(), record, host


LAYOUTS = {
    # name: (shape, chunk shape, inner chunk shape, chunk indexes to write)
    "one_inner_chunk": ((8, 6), (8, 6), (8, 6), [(0, 0)]),
    "many_inner_chunks": ((64, 96), (64, 96), (16, 24), [(0, 0)]),
    "scalar": ((), (), (), [()]),
    # Edge chunks of an uneven sharding: the last chunk holds 2 of 8 rows and 2 of 8
    # columns, so inner chunks are padded (zeros) or lie wholly outside (not stored).
    "edge_chunks": ((10, 10), (8, 8), (2, 4), [(0, 0), (0, 1), (1, 0), (1, 1)]),
    "edge_1d_whole_inner": ((10,), (8,), (8,), [(1,)]),
    # Inner chunks that are bands of whole rows (the record's crc32c combines from
    # theirs), in edge chunks cut inside a band (1 of 2 rows) and after it.
    "edge_row_bands": ((11, 8), (4, 8), (2, 8), [(0, 0), (2, 0)]),
    "edge_row_bands_one_row": ((9, 3), (4, 3), (2, 3), [(2, 0)]),
    # A replica-parallel split grid: a (256, 64) shard cut into 4 chunks of 64 rows.
    "split_grid": ((256, 64), (64, 64), (16, 64), [(0, 0), (3, 0)]),
    # Inner chunks larger than one staging buffer's 4 MiB, and files over several.
    "large": ((1024, 2048), (1024, 2048), (512, 1024), [(0, 0)]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_shard_files_are_byte_identical_to_tensorstores_for_every_layout(tmp_path, layout):
    shape, chunk, inner, cells = LAYOUTS[layout]
    meta = ArrayMetadata("w", shape, np.dtype(np.float32), chunk, inner, None)
    values = _values(shape, np.float32, seed=len(layout))
    for i, cell in enumerate(cells):
        want, got, record, host = _write_both(tmp_path / str(i), meta, values, cell)
        assert got == want, (layout, cell, len(got), len(want))
        assert record.data_crc32c == _format.data_crc32c(host)
        assert record.key == _format.chunk_key("w", cell)


def test_an_edge_chunk_stores_no_inner_chunk_outside_the_shape(tmp_path):
    shape, chunk, inner, _ = LAYOUTS["edge_chunks"]
    meta = ArrayMetadata("w", shape, np.dtype(np.float32), chunk, inner, None)
    _, got, _, _ = _write_both(tmp_path, meta, _values(shape, np.float32), (1, 1))
    layout = meta.layout
    index = np.frombuffer(got[-layout.index_bytes : -4], "<u8").reshape(-1, 2)
    missing = int((index == layout.MISSING).all(axis=1).sum())
    # Of 4 x 2 inner chunks (2 x 4 elements) the chunk at (8, 8) of a 10 x 10 array keeps
    # one: row blocks 1-3 start at row 10 or below, column block 1 at column 12.
    assert missing == 7
    assert len(got) == layout.file_bytes - missing * layout.inner_bytes_with_crc


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shard_files_are_byte_identical_to_tensorstores_for_every_dtype(tmp_path, dtype):
    meta = ArrayMetadata("x", (12, 10), dtype, (8, 8), (4, 4), None)
    values = _values(meta.shape, dtype, seed=3)
    if not _write.direct_supported(dtype):
        pytest.skip(f"{dtype} chunks are written by TensorStore in both modes (sub-byte)")
    for cell in [(0, 0), (1, 1)]:
        want, got, _, _ = _write_both(tmp_path / str(cell), meta, values, cell)
        assert got == want, (dtype, cell)


# --- whole saves: direct against buffered --------------------------------------------------


def _dtype_tree():
    """`{"np": a numpy leaf of every dtype (one chunk each), "jax": JAX arrays on a 2 x 4
    mesh: sharded, replicated, odd shapes}`, and its leaves as `(leaf path, value)`."""
    mesh = make_mesh((2, 4), ("data", "model"))
    host = {d.name: _values((24, 40), d, seed=i) for i, d in enumerate(DTYPES)}
    host["scalar"] = np.array(2.5, np.float32)  # a 0-d array leaf
    host["empty"] = np.zeros((0, 3), np.float32)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    dev = {
        "w": put(_values((256, 512), np.float32, 1), P("data", "model")),  # 16 inner chunks per shard
        "rep": put(_values((64, 128), np.float32, 2), P()),
        "bf16": put(_values((512, 64), ml_dtypes.bfloat16, 3), P("model")),
        "odd": put(_values((7, 13), np.int32, 4), P()),
        "tall": put(_values((1000, 3), np.int32, 5), P("model")),
    }
    tree = {"np": host, "jax": dev}
    return tree, [(f"{g}/{k}", v) for g, leaves in tree.items() for k, v in leaves.items()]


@pytest.mark.parametrize("pack", [0, None], ids=["unpacked", "packed"])
def test_a_direct_save_writes_the_files_a_buffered_save_writes(tmp_path, pack):
    tree, leaves = _dtype_tree()
    direct, buffered = str(tmp_path / "d" / "1"), str(tmp_path / "b" / "1")
    ckpt.save(direct, tree, direct_io=True, pack_small_leaves_bytes=pack)
    ckpt.save(buffered, tree, direct_io=False, pack_small_leaves_bytes=pack)
    assert _record(direct)["write_mode"] == "direct" and _record(buffered)["write_mode"] == "buffered"
    assert _record(buffered)["write_mode_reason"] == "direct_io=False"
    _assert_same_files(direct, buffered)
    assert [c["key"] for c in _record(direct)["chunks"]] == [c["key"] for c in _record(buffered)["chunks"]]
    assert _record(direct)["chunks"] == _record(buffered)["chunks"]  # sizes and crc32c as the buffered path records them
    if pack is None:
        assert _record(direct)["packed"] == _record(buffered)["packed"]
        assert any(k.startswith("packed/") for k in _files(direct))
    out = ckpt.restore(direct)
    for name, value in leaves:
        group, key = name.split("/")
        assert np.asarray(out[group][key]).tobytes() == np.asarray(value).tobytes(), name
    assert ckpt.verify(direct).ok


def test_tensorstore_and_zarr_python_read_direct_files(tmp_path):
    import zarr

    tree, leaves = _dtype_tree()
    path = str(tmp_path / "1")
    ckpt.save(path, tree, direct_io=True, pack_small_leaves_bytes=0)
    for name, value in leaves:
        want = np.asarray(value)
        if want.size == 0:
            continue
        folder = f"{path}/{_format.array_dir(name)}"
        got = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": folder + "/"}}).result().read().result()
        assert np.asarray(got).tobytes() == want.tobytes(), name
        if want.dtype.type.__module__ != "ml_dtypes":  # zarr-python reads numpy-native dtypes
            got = zarr.open_array(folder, mode="r")[...]
            assert np.asarray(got).tobytes() == want.tobytes(), name


@pytest.mark.multiprocess
def test_replica_parallel_split_grids_and_packs_are_byte_identical(tmp_path):
    paths = {"direct": str(tmp_path / "d" / "3"), "buffered": str(tmp_path / "b" / "3")}
    results = run_processes(WORKERS / "direct_worker.py", 2, 2, {"paths": paths}, timeout_s=240)
    assert [r.record("saved")["modes"] for r in results] == [{"direct": "direct", "buffered": "buffered"}] * 2
    meta = ckpt.metadata(paths["direct"])
    assert meta.arrays["rep"].chunk_shape[0] < meta.arrays["rep"].shape[0]  # the replicated leaf was split
    writers = {i for i in range(2) for c in _record(paths["direct"], i)["chunks"] if c["key"].startswith("arrays/rep/")}
    assert writers == {0, 1}
    _assert_same_files(paths["direct"], paths["buffered"])
    assert {k for k in _files(paths["direct"]) if k.startswith("packed/") and k.endswith("/c/0")} == {
        "packed/process-0/c/0", "packed/process-1/c/0",
    }


# --- the mode ---------------------------------------------------------------------------


def test_auto_writes_direct_where_the_file_system_takes_o_direct(tmp_path):
    path = str(tmp_path / "1")
    ckpt.save(path, {"w": np.arange(4096, dtype=np.float32)}, pack_small_leaves_bytes=0)
    record = _record(path)
    if record["write_mode"] != "direct" and os.environ.get("CI") != "true":
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT: {record['write_mode_reason']}")
    assert record["write_mode"] == "direct", record["write_mode_reason"]
    assert "accepts O_DIRECT" in record["write_mode_reason"]


def _refuse_o_direct(monkeypatch, at, code=errno.EINVAL):
    """Makes the file system refuse O_DIRECT with `code` (EINVAL): at `open` or at the write."""
    real_open, real_pwrite = os.open, os.pwrite
    direct_fds = set()

    def fake_open(path, flags, *args, **kw):
        if flags & os.O_DIRECT and at == "open":
            raise OSError(code, os.strerror(code), path)
        fd = real_open(path, flags, *args, **kw)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fake_pwrite(fd, data, offset):
        if fd in direct_fds:
            raise OSError(code, os.strerror(code))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(_direct.os, "open", fake_open)
    monkeypatch.setattr(_direct.os, "pwrite", fake_pwrite)


@pytest.mark.parametrize("code", ["EINVAL", "EOPNOTSUPP"])
@pytest.mark.parametrize("at", ["open", "write"])
def test_auto_falls_back_to_tensorstore_where_o_direct_is_refused(tmp_path, monkeypatch, at, code):
    _refuse_o_direct(monkeypatch, at, getattr(errno, code))
    tree = {"w": np.arange(1 << 14, dtype=np.float32).reshape(128, 128), "b": np.ones(8, np.float32)}
    path = str(tmp_path / "1")
    ckpt.save(path, tree)
    record = _record(path)
    assert record["write_mode"] == "buffered"
    assert code in record["write_mode_reason"] and "auto" in record["write_mode_reason"]
    out = ckpt.restore(path)
    assert np.array_equal(out["w"], tree["w"]) and np.array_equal(out["b"], tree["b"])
    assert not any(".direct-io-probe" in k for k in _files(path))  # the probe leaves nothing behind


def test_direct_io_true_refuses_to_fall_back(tmp_path, monkeypatch):
    _refuse_o_direct(monkeypatch, "open")
    path = str(tmp_path / "1")
    with pytest.raises(SaveError, match=r"direct_io=True.*EINVAL.*direct_io='auto'"):
        ckpt.save(path, {"w": np.arange(16, dtype=np.float32)}, direct_io=True)
    assert not os.path.exists(path)  # nothing committed
    assert os.listdir(tmp_path) == []  # and the partial folder removed


def test_a_probe_failure_that_is_no_refusal_is_raised(tmp_path, monkeypatch):
    _refuse_o_direct(monkeypatch, "open", errno.EACCES)
    with pytest.raises(OSError) as e:
        _direct.probe(str(tmp_path))
    assert e.value.errno == errno.EACCES


def test_direct_io_true_refuses_a_kvstore():
    with pytest.raises(SaveError, match="not a local POSIX path"):
        ckpt.save("memory://direct/1", {"w": np.arange(16, dtype=np.float32)}, direct_io=True)


@pytest.mark.parametrize("bad", ["yes", 1, None, "AUTO"])
def test_direct_io_takes_only_auto_true_or_false(tmp_path, bad):
    with pytest.raises(ValueError, match="direct_io must be 'auto', True or False"):
        ckpt.save(str(tmp_path / "1"), {"w": np.ones(2)}, direct_io=bad)
    with pytest.raises(ValueError, match="direct_io must be"):
        ckpt.CheckpointManager(str(tmp_path / "m"), direct_io=bad)


def test_the_manager_status_says_which_mode_and_why(tmp_path):
    state = {"w": np.arange(1 << 12, dtype=np.float32)}
    with ckpt.CheckpointManager(str(tmp_path / "buffered"), direct_io=False) as m:
        assert m.status().last_write_mode is None
        m.save(1, state)
        m.wait_until_finished()
        assert (m.status().last_write_mode, m.status().last_write_mode_reason) == ("buffered", "direct_io=False")
    with ckpt.CheckpointManager(str(tmp_path / "direct"), direct_io=True, async_save=False) as m:
        m.save(1, state)
        assert (m.status().last_write_mode, m.status().last_write_mode_reason) == ("direct", "direct_io=True")


def test_the_local_tier_writes_direct(tmp_path):
    state = {"w": np.arange(1 << 14, dtype=np.float32).reshape(128, 128)}
    local = tmp_path / "local"
    with ckpt.CheckpointManager(str(tmp_path / "durable"), local_directory=str(local), direct_io=True, async_save=False) as m:
        m.save(1, state)
        assert m.status().last_write_mode == "direct"
    assert _record(local / "process-0" / "1")["write_mode"] == "direct"
    out = ckpt.restore(str(tmp_path / "durable" / "1"))
    assert np.array_equal(out["w"], state["w"])


def test_every_direct_file_and_its_folders_are_synced_before_the_record(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(_direct.os, "fsync", recording_fsync)
    mesh = make_mesh((2, 4), ("data", "model"))
    tree = {"w": jax.device_put(_values((1024, 1024), np.float32), NamedSharding(mesh, P("data", "model"))), "b": np.ones(8, np.float32)}
    path = str(tmp_path / "1")
    ckpt.save(path, tree, direct_io=True)
    record_at = next(i for i, p in enumerate(synced) if "/processes/0.json" in p)  # LocalStorage.write_file's fsync
    before = {p.split(".partial-", 1)[1].split("/", 1)[-1] for p in synced[:record_at] if ".partial-" in p}
    chunk_files = {k for k in _files(path) if "/c/" in k}
    assert len(chunk_files) == 9  # 8 shards of w, the pack
    assert chunk_files <= before
    folders = {k.rsplit("/", 1)[0] for k in chunk_files}
    for f in list(folders):
        while "/" in f:
            f = f.rsplit("/", 1)[0]
            folders.add(f)
    assert folders <= before, sorted(folders - before)


def _direct_threads():
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("checkpointer-direct")]


def test_a_failed_direct_save_leaves_no_writer_threads_and_no_folder(tmp_path, monkeypatch):
    written = []

    def failing_write_at(self, offset, data):  # the device fails after the probe succeeded
        written.append(self.path)
        raise OSError(errno.EIO, "Input/output error", self.path)

    monkeypatch.setattr(_direct.DirectFile, "write_at", failing_write_at)
    mesh = make_mesh((2, 4), ("data", "model"))
    tree = {"w": jax.device_put(_values((256, 256), np.float32), NamedSharding(mesh, P("data", "model")))}
    before = _direct_threads()
    for step in range(3):
        with pytest.raises(SaveError, match=r"leaf \['w'\].*process 0.*Input/output error"):
            ckpt.save(str(tmp_path / str(step)), tree, direct_io=True, pack_small_leaves_bytes=0)
    assert written  # the chunk writes ran on the direct writer
    assert _direct_threads() == before  # every failed save stopped its writer's threads
    assert os.listdir(tmp_path) == []  # and removed its partial folder


def test_a_direct_writer_starts_threads_only_when_it_writes(tmp_path):
    writer = _write.DirectWriter(str(tmp_path))
    before = _direct_threads()
    writer.close(sync=True)  # a save that failed before its first write
    assert _direct_threads() == before
    writer = _write.DirectWriter(str(tmp_path))
    assert writer.submit(lambda: 7).result() == 7
    assert len(_direct_threads()) > len(before)
    writer.close(sync=True)
    assert _direct_threads() == before
