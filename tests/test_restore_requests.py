"""Few requests from any store (issue 28 item 3): nearby byte ranges of one file are
fetched by one request when the bytes between them cost less than another request,
within `max_over_read_ratio` and `read_chunk_bytes` (`_storage.coalesce_ranges`), for
safetensors files and zarr shard files. Requests are counted, not timed: `os.preadv`
calls for local files, kvstore reads (one GET each) for object stores."""

import os

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import save_file

import checkpointer as ckpt
from checkpointer._restore._options import RestoreOptions
from checkpointer._restore._safetensors import read_safetensors
from checkpointer._storage import _kvstore, coalesce_ranges, storage_for

MIB = 1 << 20


def _count_preadv(monkeypatch) -> list[int]:
    """Every `os.preadv` call from now on (the local reader's only read call), by bytes asked."""
    calls: list[int] = []
    real = os.preadv

    def spy(fd, buffers, offset, *rest):
        calls.append(sum(len(memoryview(b)) for b in buffers))
        return real(fd, buffers, offset, *rest)

    monkeypatch.setattr(os, "preadv", spy)
    return calls


def _count_kv_reads(monkeypatch, fail_after: int) -> list[int]:
    """Every ranged read of a kvstore (one GET on an object store); raises after
    `fail_after` of them, so that a request per row fails at once instead of in minutes."""
    calls: list[int] = []
    real = _kvstore.KvStorage.read_range

    def spy(self, path, offset, n):
        calls.append(n)
        if len(calls) > fail_after:
            raise AssertionError(f"more than {fail_after} requests")
        return real(self, path, offset, n)

    monkeypatch.setattr(_kvstore.KvStorage, "read_range", spy)
    return calls


@pytest.fixture
def column_model(tmp_path):
    """A 16 MiB f32 tensor and its bias in one safetensors file, and targets that shard
    their columns over 1x8 devices."""
    rng = np.random.default_rng(0)
    tensors = {"w": rng.standard_normal((4096, 1024), dtype=np.float32), "b": rng.standard_normal(1024, dtype=np.float32)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    mesh = make_mesh((1, 8), ("data", "model"))
    target = {"w": NamedSharding(mesh, P(None, "model")), "b": NamedSharding(mesh, P("model"))}
    return path, tensors, target


def test_a_column_sharded_safetensors_tensor_is_read_in_at_most_one_call_per_mib(column_model, monkeypatch):
    path, tensors, target = column_model
    needed = sum(t.nbytes for t in tensors.values())
    calls = _count_preadv(monkeypatch)
    stats = ckpt.RestoreStats()
    out = read_safetensors(*storage_for(path), target, RestoreOptions(), stats=stats)
    monkeypatch.undo()
    for k, v in tensors.items():
        np.testing.assert_array_equal(np.asarray(out[k]), v)
    # Before: one call per row of each device's column block (32,768 calls of 512 bytes).
    assert len(calls) <= needed // MIB, (len(calls), sorted(calls)[:8])
    header = os.path.getsize(path) - needed
    assert stats.bytes_read <= 1.1 * needed + header


def test_read_chunk_bytes_bounds_each_request(column_model, monkeypatch):
    path, tensors, target = column_model
    calls = _count_preadv(monkeypatch)
    out = ckpt.restore_safetensors(path, target, read_chunk_bytes=MIB)
    monkeypatch.undo()
    np.testing.assert_array_equal(np.asarray(out["w"]), tensors["w"])
    data = [n for n in calls if n > 8 << 10]  # the tensors' reads, not the header's
    assert len(data) >= 16 and max(data) <= MIB + tensors["w"].shape[1] * 4


def test_bytes_between_ranges_are_read_when_a_request_costs_more_within_the_ratio():
    starts = np.array([0, 100, 200, 10_000, 10_100], np.int64)
    ends = starts + 90  # gaps 10, 10, 9710, 10
    cost = dict(request_cost_bytes=1000, read_chunk_bytes=1 << 30)
    # Gaps cheaper than a request are taken, the long one is not.
    np.testing.assert_array_equal(coalesce_ranges(starts, ends, max_over_read_ratio=2.0, **cost), [0, 3])
    # Within the ratio: 450 bytes needed, 1.05 allows 22 bytes of gaps: two of the three 10s
    # (the first two: equal gaps are taken in file order).
    np.testing.assert_array_equal(coalesce_ranges(starts, ends, max_over_read_ratio=1.05, **cost), [0, 3, 4])
    # 1.0: gaps never, adjacent or overlapping ranges always.
    np.testing.assert_array_equal(coalesce_ranges(np.array([0, 90, 100]), np.array([90, 100, 150]),
                                                  max_over_read_ratio=1.0, **cost), [0])
    # read_chunk_bytes cuts a request where a range starts past it.
    np.testing.assert_array_equal(coalesce_ranges(np.arange(0, 1000, 100), np.arange(100, 1100, 100), max_over_read_ratio=1.0,
                                                  request_cost_bytes=0, read_chunk_bytes=300), [0, 3, 6, 9])
    assert len(coalesce_ranges(np.zeros(0, np.int64), np.zeros(0, np.int64), max_over_read_ratio=1.0, **cost)) == 0


@pytest.mark.parametrize("bad", [{"max_over_read_ratio": 0.9}, {"max_over_read_ratio": "2"}, {"max_over_read_ratio": float("nan")},
                                 {"read_chunk_bytes": 0}, {"read_chunk_bytes": 1.5}])
def test_read_options_are_checked(tmp_path, bad):
    path = str(tmp_path / "1")
    ckpt.save(path, {"w": np.arange(4.0)})
    for call in (lambda: ckpt.restore(path, **bad), lambda: ckpt.plan_restore(path, None, **bad),
                 lambda: ckpt.restore_safetensors(str(tmp_path / "x.safetensors"), None, **bad)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            call()


def _reshard_1x8(path: str):
    """Saves a 16 MiB f32 (2048, 2048) array on 2x4 at `path`: 8 zarr shard files of
    (1024, 512) with inner chunks of (128, 256); returns it and a 1x8 column target, whose
    boxes (2048, 256) need every other inner chunk of 2 files, 2 boxes per file."""
    mesh = make_mesh((2, 4), ("data", "model"))
    x = np.random.default_rng(1).standard_normal((2048, 2048)).astype(np.float32)
    ckpt.save(path, {"w": jax.device_put(x, NamedSharding(mesh, P("data", "model")))})
    return x, {"w": NamedSharding(make_mesh((1, 8), ("data", "model")), P(None, "model"))}


def test_the_boxes_of_one_leaf_read_each_local_zarr_shard_file_once(tmp_path, monkeypatch):
    path = str(tmp_path / "1")
    x, target = _reshard_1x8(path)
    file_bytes = ckpt.metadata(path).arrays["w"].layout.file_bytes
    calls = _count_preadv(monkeypatch)
    stats = ckpt.RestoreStats()
    out = ckpt.restore(path, target, stats=stats)
    monkeypatch.undo()
    assert np.asarray(out["w"]).tobytes() == x.tobytes()
    # Before: each box read its own inner chunks (8 per file, not adjacent) and the index:
    # 144 calls. Now per file: the index, then 2 MiB of inner chunks in reads of at most
    # the local reader's 1 MiB (cache-sized, each inner chunk's crc32c checked as it lands).
    assert stats.chunk_reads == 8
    assert len(calls) <= 8 * 3, sorted(calls)
    assert stats.bytes_read <= 8 * file_bytes


def test_the_boxes_of_one_leaf_read_each_zarr_shard_file_in_two_requests_from_a_kvstore(monkeypatch):
    path = "memory://requests/boxes"
    x, target = _reshard_1x8(path)
    calls = _count_kv_reads(monkeypatch, fail_after=1000)
    stats = ckpt.RestoreStats()
    out = ckpt.restore(path, target, stats=stats)
    monkeypatch.undo()
    assert np.asarray(out["w"]).tobytes() == x.tobytes()
    assert len(calls) <= 8 * 2, sorted(calls)  # per file: its index, then all its inner chunks (before: 144)
    assert stats.bytes_read == x.nbytes + 8 * (8 * 2 * 4 + 16 * 16 + 4)  # each inner chunk and index once


def test_zarr_inner_chunks_apart_in_a_shard_file_are_one_request_within_the_ratio(monkeypatch):
    # Half the boxes of the 1x8 reshard (as a process holding every other column block
    # reads): each needs every other inner chunk of its files.
    from checkpointer._encoding import _read

    path = "memory://requests/1"
    x, target = _reshard_1x8(path)
    meta = ckpt.metadata(path).arrays["w"]
    boxes = ckpt.plan_restore(path, target).leaves[0].boxes[::2]
    storage, root = storage_for(path)
    counts = {}
    for ratio in (1.0, 2.0):
        calls = _count_kv_reads(monkeypatch, fail_after=1000)
        stats = ckpt.RestoreStats()
        outs = [np.zeros(b.box.shape, np.float32) for b in boxes]
        _read.read_boxes(storage, root, meta, list(zip(boxes, outs, strict=True)), stats, ratio)
        monkeypatch.undo()
        for b, out in zip(boxes, outs, strict=True):
            np.testing.assert_array_equal(out, x[b.box.slices()])
        counts[ratio] = (len(calls), stats.bytes_read, sum(b.bytes_read for b in boxes))
    (n1, read1, plan1), (n2, read2, plan2) = counts[1.0], counts[2.0]
    assert read1 == plan1  # 1.0: exactly the planned inner chunks
    assert n1 == 8 * 9 and n2 == 8 * 2 and plan2 < read2 <= 2 * plan2, counts


def test_a_cast_reshard_reads_each_zarr_shard_file_together_too(tmp_path, monkeypatch):
    # A target dtype other than the stored one: the boxes are read together into host
    # buffers, then cast into their device buffers.
    path = str(tmp_path / "1")
    x, target = _reshard_1x8(path)
    sharding = target["w"]
    calls = _count_preadv(monkeypatch)
    out = ckpt.restore(path, {"w": jax.ShapeDtypeStruct(x.shape, np.float16, sharding=sharding)})
    monkeypatch.undo()
    assert out["w"].dtype == np.float16 and out["w"].sharding == sharding
    assert np.asarray(out["w"]).tobytes() == x.astype(np.float16).tobytes()
    assert len(calls) <= 8 * 3, sorted(calls)
