"""One copy on the way out (issue 28 item 1; `_encoding/_image`, `_save/_pipeline`).

Where the snapshot reads a shard in place (the CPU backend, numpy leaves) and the save
writes local files, the snapshot copies each chunk straight into its zarr shard file
(`ShardImage`), byte-identical to TensorStore's; the direct writer computes each image's
crc32c words and its record's `data_crc32c` in one pass right before it submits the buffer
as it is (off the blocking path): no staging copy, and the buffers come back to the pool
for the next save.
"""

import json
import threading
from pathlib import Path

import crc32c
import jax
import numpy as np
import pytest
import tensorstore as ts
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P
from test_direct_io import LAYOUTS, _values

import checkpointer as ckpt
from checkpointer import _encoding, _format, _memory
from checkpointer._encoding import _image, _write
from checkpointer._format import ArrayMetadata
from checkpointer._memory import _staging
from checkpointer._save import _pipeline as _save


def _tree(mesh, seed):
    x = np.arange(256 * 512, dtype=np.float32).reshape(256, 512) + seed  # 16 inner chunks per shard
    return {"w": jax.device_put(x, NamedSharding(mesh, P("data", "model"))),
            "h": np.arange(3 * 1000, dtype=np.int32).reshape(1000, 3) + seed}  # numpy, edge inner chunks


def _image_write(tmp_path, meta, values, cell, strided):
    """The chunk `cell` of `values` as TensorStore writes it, and from a `ShardImage`
    (`strided`: the image filled from a non-contiguous view): (TensorStore's bytes, the
    image's file bytes, the image, the host box)."""
    box = _format.cell_box(cell, meta.chunk_shape, meta.shape)
    host = np.array(values[box.slices()], order="C")
    src = host
    if strided and host.ndim:
        wide = np.zeros((*host.shape[:-1], host.shape[-1] * 2), host.dtype)
        wide[..., ::2] = host
        src = wide[..., ::2]
        assert not src.flags.c_contiguous or host.size <= 1
    key = _format.chunk_key(meta.path, cell)
    spec = _format.zarr_spec({"driver": "file", "path": f"{tmp_path}/ts/{_format.array_dir(meta.path)}/"}, meta, mode="create")
    ts.open(spec).result()[box.slices()].write(host).result()
    (image,) = _encoding.fill_images([(meta.layout, src)], lambda n: _memory.aligned_empty((n,), np.dtype(np.uint8), _memory.PAGE_ALIGN))
    assert not image.checksummed  # the blocking copy moves bytes only; `write_image` checksums first
    path = tmp_path / "image.bin"
    _write.write_image(str(path), image, direct=False)
    return (tmp_path / "ts" / key).read_bytes(), path.read_bytes(), image, host


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_shard_images_are_byte_identical_to_tensorstores_files(tmp_path, layout, strided):
    shape, chunk, inner, cells = LAYOUTS[layout]
    meta = ArrayMetadata("w", shape, np.dtype(np.float32), chunk, inner, None)
    values = _values(shape, np.float32, seed=len(layout))
    for i, cell in enumerate(cells):
        (tmp_path / str(i)).mkdir()
        want, got, image, host = _image_write(tmp_path / str(i), meta, values, cell, strided)
        assert got == want, (layout, cell, len(got), len(want))
        assert image.file_bytes == len(want) and image.buffer.ctypes.data % _memory.PAGE_ALIGN == 0
        assert image.data_crc32c == _format.data_crc32c(host) and image.data_bytes == host.nbytes
        # The per-inner-chunk crc32c kept from the copy: the words stored after each inner chunk.
        nc = meta.layout.inner_bytes_with_crc
        stored = [int.from_bytes(got[k * nc + nc - 4 : k * nc + nc], "little") for k in range(len(image.inner_crc32c))]
        assert image.inner_crc32c.tolist() == stored
        assert stored == [crc32c.crc32c(got[k * nc : k * nc + nc - 4]) for k in range(len(stored))]


def _chunk_files(root):
    files = [f for f in Path(root).rglob("*") if f.is_file() and "/c/" in str(f)]
    assert files
    return files


def _counting(monkeypatch, module, name):
    calls = [0]
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_direct_save_of_cpu_shards_checksums_each_image_once_off_the_blocking_path_and_stages_nothing(tmp_path, monkeypatch):
    mesh = make_mesh((2, 4), ("data", "model"))
    taken = _counting(monkeypatch, _staging.StagingBuffers, "take")
    passes = _counting(monkeypatch, _image, "_checksum")
    snap = _save.take_snapshot(str(tmp_path / "1"), _tree(mesh, 1), _save.SaveOptions(direct_io=True, pack_small_leaves_bytes=0))
    written = [(leaf.meta, w, h) for leaf in snap.arrays for w, h in zip(leaf.plan.writes, leaf.host)]
    images = [h for _, _, h in written]
    assert images and all(isinstance(h, _encoding.ShardImage) for h in images)
    assert passes[0] == 0 and not any(h.checksummed for h in images)  # the blocking snapshot only copies
    _save.run_background(snap)
    assert passes[0] == len(images) and all(h.checksummed for h in images)  # one pass per image, by the writer
    assert taken[0] == 0  # no staging buffer: the snapshot's buffers are written as they are
    records = {c["key"]: c for c in json.loads(Path(tmp_path, "1", "processes", "0.json").read_text())["chunks"]}
    for meta, w, image in written:  # the words in the files are the crc32c of what precedes them, the record's of the box
        key, nc = _format.chunk_key(meta.path, w.chunk_index), meta.layout.inner_bytes_with_crc
        got = Path(tmp_path, "1", key).read_bytes()
        words = [int.from_bytes(got[k * nc + nc - 4 : k * nc + nc], "little") for k in range(len(image.inner_crc32c))]
        assert words == image.inner_crc32c.tolist() == [crc32c.crc32c(got[k * nc : k * nc + nc - 4]) for k in range(len(words))]
        assert records[key]["data_crc32c"] == image.data_crc32c
    assert json.loads(Path(tmp_path, "1", "processes", "0.json").read_text())["write_mode"] == "direct"
    ckpt.save(str(tmp_path / "ts"), _tree(mesh, 1), direct_io=False, pack_small_leaves_bytes=0)
    for f in _chunk_files(tmp_path / "ts"):  # byte-identical to TensorStore's chunk files
        assert Path(tmp_path, "1", f.relative_to(tmp_path / "ts")).read_bytes() == f.read_bytes(), f


def test_threads_asking_for_an_images_checksums_at_once_share_one_pass(monkeypatch):
    shape, chunk, inner, _ = LAYOUTS["large"]  # inner chunks that cut the rows: the gathered data crc32c
    meta = ArrayMetadata("w", shape, np.dtype(np.float32), chunk, inner, None)
    host = _values(shape, np.float32, seed=3)
    (image,) = _encoding.fill_images([(meta.layout, host)], lambda n: _memory.page_aligned_empty((n,), np.dtype(np.uint8)))
    passes = _counting(monkeypatch, _image, "_checksum")
    start = threading.Barrier(4)
    got: list[int] = []
    threads = [threading.Thread(target=lambda: (start.wait(), got.append(image.data_crc32c))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert passes[0] == 1 and got == [_format.data_crc32c(host)] * 4
    nc, n = meta.layout.inner_bytes_with_crc, meta.layout.inner_bytes
    buf = image.buffer
    assert image.inner_crc32c.tolist() == [crc32c.crc32c(buf[k * nc : k * nc + n].data) for k in range(len(image.inner_crc32c))]


def test_an_incremental_save_checks_and_writes_from_one_checksum_pass_per_image(tmp_path, monkeypatch):
    mesh = make_mesh((2, 4), ("data", "model"))
    ckpt.save(str(tmp_path / "0"), _tree(mesh, 0), incremental=True, pack_small_leaves_bytes=0)
    passes = _counting(monkeypatch, _image, "_checksum")
    tree = _tree(mesh, 0)
    tree["w"] = tree["w"] + 1  # changed: checked by its crc32c, then written; "h" unchanged: referenced
    handle = ckpt.save_async(str(tmp_path / "1"), tree, incremental=True, pack_small_leaves_bytes=0)
    handle.wait()
    stats = handle.snapshot.result.incremental
    assert stats.chunks_changed == 8 and stats.bytes_hashed == 3000 * 4  # "h": XXH3 after its crc32c matched
    assert passes[0] == 9  # 8 shards of "w" and "h": each checksummed once, for the check and the write
    out = ckpt.restore(str(tmp_path / "1"))
    np.testing.assert_array_equal(out["w"], np.arange(256 * 512, dtype=np.float32).reshape(256, 512) + 1)
    np.testing.assert_array_equal(out["h"], np.arange(3000, dtype=np.int32).reshape(1000, 3))


def test_the_manager_reuses_the_shard_file_buffers_of_its_last_snapshot(tmp_path, monkeypatch):
    mesh = make_mesh((2, 4), ("data", "model"))
    addresses: list[set[int]] = []
    real_fill = _encoding.fill_images

    def recorded(requests, take):
        images = real_fill(requests, take)
        addresses.append({image.buffer.ctypes.data for image in images})
        return images

    monkeypatch.setattr(_encoding, "fill_images", recorded)
    with ckpt.CheckpointManager(str(tmp_path / "run"), pack_small_leaves_bytes=0) as m:
        for step in (1, 2, 3):
            m.save(step, _tree(mesh, step))
            m.wait_until_finished()
    assert len(addresses) == 3 and all(addresses)
    assert addresses[1] == addresses[0] and addresses[2] == addresses[0]  # reused, no fresh memory
    out = ckpt.restore(str(tmp_path / "run" / "3"))
    np.testing.assert_array_equal(out["w"], np.arange(256 * 512, dtype=np.float32).reshape(256, 512) + 3)
    np.testing.assert_array_equal(out["h"], np.arange(3000, dtype=np.int32).reshape(1000, 3) + 3)


def test_two_saves_in_flight_never_share_a_shard_file_buffer(tmp_path, monkeypatch):
    ckpt.release_host_buffers()
    mesh = make_mesh((2, 4), ("data", "model"))
    release = threading.Event()
    real_write = _save.write_snapshot
    monkeypatch.setattr(_save, "write_snapshot", lambda snap: (release.wait(60), real_write(snap))[1])
    first = ckpt.save_async(str(tmp_path / "1"), _tree(mesh, 1), pack_small_leaves_bytes=0)
    second = ckpt.save_async(str(tmp_path / "2"), _tree(mesh, 2), pack_small_leaves_bytes=0)
    bufs = [[h.buffer for leaf in s.snapshot.arrays for h in leaf.host] for s in (first, second)]
    assert all(bufs) and not any(np.shares_memory(a, b) for a in bufs[0] for b in bufs[1])
    del bufs
    release.set()
    first.wait(), second.wait()
    for step in (1, 2):
        out = ckpt.restore(str(tmp_path / str(step)))
        np.testing.assert_array_equal(out["w"], np.arange(256 * 512, dtype=np.float32).reshape(256, 512) + step)
    ckpt.release_host_buffers()


def test_a_file_system_refusing_o_direct_gets_the_same_files_through_the_page_cache(tmp_path, monkeypatch):
    mesh = make_mesh((2, 4), ("data", "model"))
    monkeypatch.setattr(_write, "probe_direct", lambda root: "the file system refuses O_DIRECT (injected)")
    ckpt.save(str(tmp_path / "1"), _tree(mesh, 1), pack_small_leaves_bytes=0)
    record = json.loads(Path(tmp_path, "1", "processes", "0.json").read_text())
    assert record["write_mode"] == "buffered"
    ckpt.save(str(tmp_path / "ts"), _tree(mesh, 1), direct_io=False, pack_small_leaves_bytes=0)
    assert record["chunks"] == json.loads(Path(tmp_path, "ts", "processes", "0.json").read_text())["chunks"]
    for f in _chunk_files(tmp_path / "ts"):
        assert Path(tmp_path, "1", f.relative_to(tmp_path / "ts")).read_bytes() == f.read_bytes(), f


def test_object_stores_and_direct_io_false_copy_boxes_not_shard_files(tmp_path):
    mesh = make_mesh((2, 4), ("data", "model"))
    for path, opts in (("memory://onecopy/1", {}), (str(tmp_path / "1"), {"direct_io": False})):
        snap = _save.take_snapshot(path, _tree(mesh, 1), _save.SaveOptions(pack_small_leaves_bytes=0, **opts))
        assert not any(isinstance(h, _encoding.ShardImage) for leaf in snap.arrays for h in leaf.host)
        _save.run_background(snap)
        np.testing.assert_array_equal(ckpt.restore(path)["h"], np.arange(3000, dtype=np.int32).reshape(1000, 3) + 1)


def test_a_snapshot_is_an_immutable_plan_and_its_write_fills_a_result(tmp_path):
    import dataclasses

    snap = _save.take_snapshot(str(tmp_path / "1"), {"h": np.arange(3000, dtype=np.int32)}, _save.SaveOptions())
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.step = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.arrays[0].meta = None
    assert set(snap.result.phases_unix_s) == {"wait_for_arrays", "snapshot"} and snap.result.write_mode is None
    _save.run_background(snap)
    assert snap.result.write_mode in ("direct", "buffered") and snap.result.bytes_written > 0 and snap.result.write_s > 0
    assert {"write", "durable", "commit"} <= set(snap.result.phases_unix_s) and snap.result.lock is None
    assert not snap.arrays[0].host  # the host copies were released once durable


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_a_contiguous_boxs_data_crc32c_comes_from_the_fill_and_the_writer_does_not_gather_it(strided):
    """Inner chunks that cut the box's rows: from a C-contiguous box the fill checksums
    each band's rows right after copying them (hot), so the writer's pass only checksums
    the inner chunks; a strided box (its rows not contiguous) is gathered by the writer."""
    shape, chunk, inner, _ = LAYOUTS["large"]
    meta = ArrayMetadata("w", shape, np.dtype(np.float32), chunk, inner, None)
    host = _values(shape, np.float32, seed=5)
    src = host
    if strided:
        wide = np.zeros((*host.shape[:-1], host.shape[-1] * 2), host.dtype)
        wide[..., ::2] = host
        src = wide[..., ::2]
    assert not _image.row_bands(meta.layout, tuple(shape))
    (image,) = _encoding.fill_images([(meta.layout, src)], lambda n: _memory.page_aligned_empty((n,), np.dtype(np.uint8)))
    gathers = [0]
    real = _image._gathered
    _image._gathered = lambda *a: (gathers.__setitem__(0, gathers[0] + 1), real(*a))[1]
    try:
        assert image.data_crc32c == _format.data_crc32c(host)
    finally:
        _image._gathered = real
    assert gathers[0] == (1 if strided else 0)
    nc, n = meta.layout.inner_bytes_with_crc, meta.layout.inner_bytes
    buf = image.buffer
    assert image.inner_crc32c.tolist() == [crc32c.crc32c(buf[k * nc : k * nc + n].data) for k in range(len(image.inner_crc32c))]
