"""One copy on the way out (issue 28 item 1; `_encoding/_image`, `_save/_pipeline`).

Where the snapshot reads a shard in place (the CPU backend, numpy leaves) and the save
writes local files, the snapshot copies each chunk straight into its zarr shard file
(`ShardImage`), byte-identical to TensorStore's, computing each inner chunk's crc32c in
that pass; the direct writer submits those buffers as they are: no staging copy, no
checksum while writing, and the buffers come back to the pool for the next save.
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


def test_a_direct_save_of_cpu_shards_makes_no_staging_copy_and_no_checksum_while_writing(tmp_path, monkeypatch):
    mesh = make_mesh((2, 4), ("data", "model"))
    taken = _counting(monkeypatch, _staging.StagingBuffers, "take")
    snap = _save.take_snapshot(str(tmp_path / "1"), _tree(mesh, 1), _save.SaveOptions(direct_io=True, pack_small_leaves_bytes=0))
    images = [h for leaf in snap.arrays for h in leaf.host]
    assert images and all(isinstance(h, _encoding.ShardImage) for h in images)
    # One crc32c per stored inner chunk in the snapshot's pass, none while writing.
    assert sum(len(h.inner_crc32c) for h in images) == sum(len(_image.stored_inner_chunks(leaf.meta.layout, w.box.shape))
                                                           for leaf in snap.arrays for w in leaf.plan.writes)
    checksums = _counting(monkeypatch, crc32c, "crc32c")
    _save.run_background(snap)
    assert checksums[0] == 0
    assert taken[0] == 0  # no staging buffer: the snapshot's buffers are written as they are
    assert json.loads(Path(tmp_path, "1", "processes", "0.json").read_text())["write_mode"] == "direct"
    ckpt.save(str(tmp_path / "ts"), _tree(mesh, 1), direct_io=False, pack_small_leaves_bytes=0)
    for f in _chunk_files(tmp_path / "ts"):  # byte-identical to TensorStore's chunk files
        assert Path(tmp_path, "1", f.relative_to(tmp_path / "ts")).read_bytes() == f.read_bytes(), f


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
