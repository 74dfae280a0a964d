"""Restore from safetensors onto any mesh (`ckpt.restore_safetensors`): files written by
the `safetensors` package itself and by `ckpt.export`, sharded Hugging Face folders,
every dtype, the bytes each process reads, host memory, and the errors that name the
file and the tensor."""

import gc
import json
import os
import struct
import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P
from multiprocess import WORKERS, run_processes
from safetensors.numpy import save_file

import checkpointer as ckpt
from checkpointer._encoding import RestoreStats
from checkpointer._format import Box
from checkpointer._restore import RestoreOptions
from checkpointer._restore._safetensors import read_safetensors
from checkpointer._restore._safetensors_files import box_runs, dtype_codes
from checkpointer._storage import LocalStorage


def _bits(x) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes()


def _sds(shape, dtype, mesh, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _header_bytes(file) -> int:
    with open(file, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _read_with_stats(path, target, **kw):
    stats = RestoreStats()
    options = RestoreOptions(partial=kw.pop("partial", False), max_inflight_bytes=kw.pop("max_inflight_bytes", None))
    out = read_safetensors(LocalStorage(), os.path.abspath(path), target, options, stats=stats, **kw)
    return out, stats


def test_box_runs_are_the_c_order_runs_of_the_box():
    shape = (4, 6, 5)
    flat = np.arange(np.prod(shape)).reshape(shape)
    for box in [Box((0, 0, 0), shape), Box((1, 0, 0), (2, 6, 5)), Box((0, 2, 0), (4, 3, 5)), Box((1, 1, 2), (2, 3, 2)),
                Box((3, 5, 4), (1, 1, 1))]:
        run, starts = box_runs(box, shape)
        got = np.concatenate([flat.reshape(-1)[s : s + run] for s in starts])
        np.testing.assert_array_equal(got, flat[box.slices()].reshape(-1))
    assert box_runs(Box((0, 2, 0), (4, 3, 5)), shape)[0] == 15  # rows of the cut dimension times the whole last one
    assert len(box_runs(Box((1, 0, 0), (2, 6, 5)), shape)[1]) == 1  # whole trailing dims: one run


def test_a_tensor_sharded_on_a_non_leading_axis_reads_each_byte_once(tmp_path):
    """A file the `safetensors` package wrote, onto a mesh sharded on the second axis
    and replicated over the first: bit-exact, and the file's bytes read once each (the
    two devices holding each box get it from one read)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    b = rng.standard_normal(128).astype(np.float32)
    file = str(tmp_path / "model.safetensors")
    save_file({"layer.w": w, "layer.b": b}, file)
    mesh = make_mesh((2, 4), ("data", "model"))
    target = {"layer": {"w": _sds(w.shape, w.dtype, mesh, P(None, "model")), "b": _sds(b.shape, b.dtype, mesh, P())}}
    out, stats = _read_with_stats(file, target)
    assert _bits(out["layer"]["w"]) == _bits(w) and _bits(out["layer"]["b"]) == _bits(b)
    assert out["layer"]["w"].sharding == target["layer"]["w"].sharding
    for s in out["layer"]["w"].addressable_shards:
        assert _bits(s.data) == _bits(w[s.index])
    assert stats.bytes_read == os.path.getsize(file)


def test_partial_leaves_unread_tensors_unread(tmp_path):
    w, big = np.arange(12, dtype=np.int32).reshape(3, 4), np.zeros((256, 256), np.float32)
    file = str(tmp_path / "m.safetensors")
    save_file({"w": w, "big": big}, file)
    mesh = make_mesh((2, 4), ("data", "model"))
    with pytest.raises(ckpt.StructureMismatchError, match=r"(?s)tensors no target leaf names: big.*partial=True"):
        ckpt.restore_safetensors(file, {"w": _sds(w.shape, w.dtype, mesh, P())})
    out, stats = _read_with_stats(file, {"w": _sds(w.shape, w.dtype, mesh, P())}, partial=True)
    np.testing.assert_array_equal(np.asarray(out["w"]), w)
    assert stats.bytes_read == _header_bytes(file) + w.nbytes


def test_every_dtype_of_safetensors_comes_back_bit_exact(tmp_path):
    codes = dtype_codes()
    assert {"BF16", "F16", "F32", "F64", "I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL", "C64",
            "F8_E4M3", "F8_E5M2"} <= set(codes)
    rng = np.random.default_rng(1)
    tensors = {}
    for code, dtype in codes.items():
        raw = rng.integers(0, 256, size=16 * 8 * dtype.itemsize, dtype=np.uint8)
        a = raw.view(dtype).reshape(16, 8) if dtype != np.bool_ else (raw[: 16 * 8] % 2).astype(bool).reshape(16, 8)
        tensors[code.lower()] = a
    file = str(tmp_path / "all.safetensors")
    save_file(tensors, file)
    mesh = make_mesh((2, 4), ("data", "model"))
    with jax.enable_x64(True):
        target = {k: _sds(a.shape, a.dtype, mesh, P("model", "data")) for k, a in tensors.items()}
        out = ckpt.restore_safetensors(file, target)
        for k, a in tensors.items():
            assert out[k].dtype == a.dtype and _bits(out[k]) == _bits(a), k


def test_a_sharded_folder_from_export_restores_onto_another_mesh(tmp_path):
    """`ckpt.export` to a sharded Hugging Face folder (index + 3 files), then onto a
    mesh the checkpoint was not saved on, with a bfloat16 -> float32 cast, a host leaf
    and a list index in the names."""
    mesh = make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(2)
    state = {
        "embed": jax.device_put(rng.standard_normal((32, 64)).astype(ml_dtypes.bfloat16), NamedSharding(mesh, P("data", "model"))),
        "layers": [{"w": rng.standard_normal((64, 64)).astype(np.float32)} for _ in range(2)],
        "step": 3,
    }
    ckpt.save(str(tmp_path / "ck"), state)
    report = ckpt.export(str(tmp_path / "ck"), str(tmp_path / "hf"), max_shard_bytes=20000)
    assert os.path.basename(report.files[-1]) == "model.safetensors.index.json" and len(report.files) == 4
    other = make_mesh((4, 2), ("data", "model"))
    target = {
        "embed": _sds((32, 64), np.float32, other, P("model", None)),
        "layers": [{"w": _sds((64, 64), np.float32, other, P(None, ("data", "model")))}, {"w": None}],
    }
    out = ckpt.restore_safetensors(str(tmp_path / "hf"), target)
    np.testing.assert_array_equal(np.asarray(out["embed"]), np.asarray(state["embed"]).astype(np.float32))
    assert out["embed"].dtype == np.float32 and out["embed"].sharding == target["embed"].sharding
    assert _bits(out["layers"][0]["w"]) == _bits(state["layers"][0]["w"])
    assert isinstance(out["layers"][1]["w"], np.ndarray) and _bits(out["layers"][1]["w"]) == _bits(state["layers"][1]["w"])


def test_name_fn_and_separator_name_the_tensors(tmp_path):
    file = str(tmp_path / "m.safetensors")
    save_file({"model/encoder/w": np.ones((2, 2), np.float32), "model.x": np.zeros(3, np.float32)}, file)
    out = ckpt.restore_safetensors(file, {"encoder": {"w": None}, "x": None}, name_fn=lambda kp: (
        "model/encoder/w" if len(kp) == 2 else "model.x"))
    np.testing.assert_array_equal(out["encoder"]["w"], np.ones((2, 2), np.float32))
    out = ckpt.restore_safetensors(file, {"model": {"encoder": {"w": None}}}, separator="/", partial=True)
    np.testing.assert_array_equal(out["model"]["encoder"]["w"], np.ones((2, 2), np.float32))


def test_a_missing_tensor_or_a_wrong_shape_names_the_file_and_the_tensor(tmp_path):
    file = str(tmp_path / "m.safetensors")
    save_file({"a.w": np.ones((4, 8), np.float32)}, file)
    mesh = make_mesh((2, 4), ("data", "model"))
    with pytest.raises(ckpt.StructureMismatchError, match=r"(?s)m\.safetensors.*\['a'\]\['v'\] -> 'a\.v'.*the files hold: a\.w"):
        ckpt.restore_safetensors(file, {"a": {"w": None, "v": None}})
    with pytest.raises(ckpt.ShapeMismatchError, match=r"tensor 'a\.w'.*m\.safetensors.*stored shape \(4, 8\), target shape \(8, 4\)"):
        ckpt.restore_safetensors(file, {"a": {"w": _sds((8, 4), np.float32, mesh, P())}})


def _write_raw(file, header: dict, data: bytes):
    blob = json.dumps(header).encode()
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("damage, message", [
    ("truncated", r"says the file has \d+ bytes.*it has \d+; tensor 'b' ends there"),
    ("longer", r"says the file has \d+ bytes"),
    ("gap", r"tensor 'b' starts at data byte 20, the previous tensor ends at 16"),
    ("nbytes", r"tensor 'a' of shape \(4,\) and dtype F32 needs 16 bytes, its data_offsets \[0, 12\] hold 12"),
    ("dtype", r"tensor 'a' has dtype 'F99'"),
    ("header_size", r"header size says"),
])
def test_a_header_inconsistent_with_the_file_is_corrupt_naming_file_and_tensor(tmp_path, damage, message):
    file = str(tmp_path / "bad.safetensors")
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}
    data = np.arange(6, dtype=np.float32).tobytes()
    if damage == "truncated":
        data = data[:-3]
    elif damage == "longer":
        data += b"\0" * 4
    elif damage == "gap":
        header["b"]["data_offsets"] = [20, 28]
        data += b"\0" * 4
    elif damage == "nbytes":
        header["a"]["data_offsets"] = [0, 12]
        header["b"]["data_offsets"] = [12, 20]
    elif damage == "dtype":
        header["a"]["dtype"] = "F99"
    _write_raw(file, header, data)
    if damage == "header_size":
        with open(file, "r+b") as f:
            f.write(struct.pack("<Q", 1 << 40))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"bad\.safetensors.*" + message):
        ckpt.restore_safetensors(file, {"a": None, "b": None})


def test_an_index_that_disagrees_with_its_files_is_corrupt(tmp_path):
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": np.ones(2, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {"total_size": 16}, "weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"index\.json maps tensor 'a' to \S+00002\.safetensors, but \S+00002\.safetensors does not hold it"):
        ckpt.restore_safetensors(str(tmp_path), {"a": None, "b": None})
    index["weight_map"]["a"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    out = ckpt.restore_safetensors(str(tmp_path), {"a": None, "b": None})
    np.testing.assert_array_equal(out["b"], np.ones(2, np.float32))


def test_an_index_naming_a_missing_file_is_corrupt_naming_the_index_the_file_and_a_tensor(tmp_path):
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"index\.json maps tensor 'b' to \S+00002\.safetensors, which does not exist"):
        ckpt.restore_safetensors(str(tmp_path), {"a": None, "b": None})


def test_max_inflight_bytes_bounds_the_host_memory_of_a_large_tensor(tmp_path):
    """A 32 MiB tensor onto 8 devices sharded on its second axis, with 3 MiB of reads in
    flight: the process's memory grows by about the restored arrays (on CPU devices they
    live in host memory), not by a whole-file copy besides (load_file + device_put needs
    the file's bytes and the arrays at once: 64 MiB)."""
    psutil = pytest.importorskip("psutil")
    w = np.arange(4096 * 2048, dtype=np.float32).reshape(4096, 2048)
    file = str(tmp_path / "big.safetensors")
    save_file({"w": w}, file)
    del w
    mesh = make_mesh((1, 8), ("data", "model"))
    target = {"w": _sds((4096, 2048), np.float32, mesh, P(None, "model"))}
    budget = 3 << 20
    out = ckpt.restore_safetensors(file, target, max_inflight_bytes=budget)  # compiles the slab update once
    del out
    gc.collect()
    proc = psutil.Process()
    before = proc.memory_info().rss
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            done.wait(0.0005)

    t = threading.Thread(target=sample)
    t.start()
    try:
        out, stats = _read_with_stats(file, target, max_inflight_bytes=budget)
    finally:
        done.set()
        t.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    result_bytes = 4096 * 2048 * 4
    # 20 MiB of slack for allocator and interpreter noise (what ran before in this process
    # moves RSS by ~10 MiB); a whole-file copy besides the arrays would add 32 MiB more.
    assert peak[0] - before <= result_bytes + budget + (20 << 20), (peak[0] - before) / 2**20
    # Runs one row apart are read together where the gaps stay within 3% of a slab.
    assert os.path.getsize(file) <= stats.bytes_read <= 1.03 * os.path.getsize(file)
    col = np.arange(4096, dtype=np.float32) * 2048
    np.testing.assert_array_equal(np.asarray(out["w"][:, 5]), col + 5)


@pytest.mark.multiprocess
def test_each_of_two_processes_reads_only_its_own_columns(tmp_path):
    """2 processes x 4 devices: a tensor sharded over all 8 devices on its second axis is
    read half by each process (within 5%), a replicated one whole by each; counted by
    the restore and by the kernel (the process's read(2) bytes)."""
    rng = np.random.default_rng(3)
    tensors = {
        "w": rng.standard_normal((512, 2048)).astype(np.float32),
        "r": rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16),
    }
    file = str(tmp_path / "model.safetensors")
    save_file(tensors, file)
    results = run_processes(WORKERS / "safetensors_worker.py", 2, 4, {"path": file, "seed": 3}, timeout_s=180)
    header = _header_bytes(file)
    half = tensors["w"].nbytes // 2
    for r in results:
        rec = r.record("restored")
        assert rec["ok"], rec
        need = header + half + tensors["r"].nbytes
        assert need <= rec["bytes_read"] <= 1.05 * need, (rec["bytes_read"], need)
        assert rec["kernel_read_bytes"] <= 1.05 * need + (1 << 20), (rec["kernel_read_bytes"], need)


def test_a_packed_four_bit_tensor_is_refused_by_name_and_the_others_still_restore(tmp_path):
    file = str(tmp_path / "q.safetensors")
    header = {"q": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 4]},
              "s": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    _write_raw(file, header, b"\x12\x34\x56\x78" + np.float32([1.5, -2.0]).tobytes())
    with pytest.raises(ckpt.UnsupportedValueError, match=r"tensor 'q' of \S+q\.safetensors has dtype F4.*partial=True"):
        ckpt.restore_safetensors(file, {"q": None, "s": None})
    out = ckpt.restore_safetensors(file, {"s": None}, partial=True)
    np.testing.assert_array_equal(out["s"], np.float32([1.5, -2.0]))
