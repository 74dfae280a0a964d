"""Few requests from an object store (issue 28 item 3), against a real S3-protocol server
(moto, `tests/s3server.py`): a column-sharded restore of a zarr checkpoint and of a
safetensors file onto 1x8. Requests are counted, not timed: the GETs the server logs
(werkzeug's request log), and the library's ranged kvstore reads."""

import logging
import time

import numpy as np
import pytest
from gcsserver import started_or_skipped
from s3server import running_s3_server
from safetensors.numpy import save
from test_restore_requests import _count_kv_reads, _reshard_1x8

import checkpointer as ckpt
from checkpointer._restore._options import RestoreOptions
from checkpointer._restore._safetensors import read_safetensors
from checkpointer._storage import storage_for


@pytest.fixture(scope="module")
def s3():
    with started_or_skipped(running_s3_server) as server:
        yield server


def _gets(caplog, bucket: str) -> int:
    """GET requests of objects of `bucket` the server logged."""
    return sum(1 for r in caplog.records if r.name == "werkzeug" and f"GET /{bucket}/" in r.getMessage())


def _settled_gets(caplog, prefix: str, expected: int) -> int:
    """GET requests of objects under `prefix` the server logged, once its log settles: the
    server's thread logs a request after answering it, so the last lines of the restore may
    arrive after it returns (and the save's, after `caplog.clear()`: hence the prefix)."""
    count = lambda: sum(1 for r in caplog.records if r.name == "werkzeug" and f"GET /{prefix}" in r.getMessage())  # noqa: E731
    deadline = time.monotonic() + 5
    while count() < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    return count()


def test_a_column_reshard_of_zarr_shard_files_takes_two_gets_per_file(s3, monkeypatch, caplog):
    bucket = s3.new_bucket()
    path = f"s3://{bucket}/run/1"
    x, target = _reshard_1x8(path)
    calls = _count_kv_reads(monkeypatch, fail_after=200)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="werkzeug"):
        out = ckpt.restore(path, target)
    monkeypatch.undo()
    gets = _settled_gets(caplog, f"{bucket}/run/1/arrays/w/c/", 16)
    assert np.asarray(out["w"]).tobytes() == x.tobytes()
    # Per zarr shard file its index, then every inner chunk (both boxes' share): 16 GETs
    # in all; each box read alone took 144 (an index and 8 inner chunks per box and file).
    assert len(calls) <= 16, sorted(calls)
    assert sum(calls) <= 1.01 * x.nbytes
    assert gets == 16, gets  # of the shard files; the manifest and markers are not counted


def test_a_16_mib_column_sharded_safetensors_tensor_takes_at_most_16_gets(s3, monkeypatch, caplog):
    from conftest import make_mesh
    from jax.sharding import NamedSharding, PartitionSpec as P

    w = np.random.default_rng(2).standard_normal((4096, 1024), dtype=np.float32)
    bucket = s3.new_bucket()
    s3.put(bucket, "model/model.safetensors", save({"w": w}))
    target = {"w": NamedSharding(make_mesh((1, 8), ("data", "model")), P(None, "model"))}
    calls = _count_kv_reads(monkeypatch, fail_after=200)
    stats = ckpt.RestoreStats()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="werkzeug"):
        out = read_safetensors(*storage_for(f"s3://{bucket}/model/model.safetensors"), target, RestoreOptions(), stats=stats)
    monkeypatch.undo()
    gets = _gets(caplog, bucket)
    assert np.asarray(out["w"]).tobytes() == w.tobytes()
    data = [n for n in calls if n > 64 << 10]  # the tensor's reads, not the header's
    assert len(data) <= 16 and len(calls) <= 16 + 3, sorted(calls)  # before: 32,654 GETs
    assert gets <= 16 + 3, gets
    assert stats.bytes_read <= 1.1 * w.nbytes + (64 << 10)
