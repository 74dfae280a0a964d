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


def test_zarr_inner_chunks_apart_in_a_shard_file_are_one_request_within_the_ratio(monkeypatch):
    # Saved on 2x4: inner chunks of 128x256 in chunks of 1024x512, so a 256-column block
    # of the target needs every other inner chunk of a shard file.
    mesh = make_mesh((2, 4), ("data", "model"))
    x = np.random.default_rng(1).standard_normal((2048, 2048)).astype(np.float32)
    path = "memory://requests/1"
    ckpt.save(path, {"w": jax.device_put(x, NamedSharding(mesh, P("data", "model")))})
    target = {"w": NamedSharding(make_mesh((8,), ("m",)), P(None, "m"))}
    counts = {}
    for ratio in (1.0, 2.0):
        calls = _count_kv_reads(monkeypatch, fail_after=1000)
        stats = ckpt.RestoreStats()
        out = ckpt.restore(path, target, stats=stats, max_over_read_ratio=ratio)
        monkeypatch.undo()
        np.testing.assert_array_equal(np.asarray(out["w"]), x)
        counts[ratio] = (len(calls), stats.bytes_read, stats.plan.bytes_read)
    (n1, read1, plan1), (n2, read2, plan2) = counts[1.0], counts[2.0]
    assert read1 == plan1  # 1.0: exactly the planned inner chunks
    assert n2 <= n1 // 4 and plan2 < read2 <= 2 * plan2, counts
