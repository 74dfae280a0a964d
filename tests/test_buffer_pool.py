"""Host buffers reused between snapshots: bounded pools, the process-wide pool of
`save_async`, `release_host_buffers` (the direct writer's staging buffers too), and never one buffer in two saves in flight."""

import json
import os
import threading
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._memory import _buffer_pool, staging_buffers
from checkpointer._save import _pipeline as _save


def test_pool_reuses_a_given_back_buffer_and_never_hands_one_out_twice():
    pool = _buffer_pool.HostBufferPool()
    pool.note_snapshot(2 * 4096)
    taken = [pool.take((1024,), np.float32)]
    first = weakref.ref(taken[0])
    pool.give_back(taken)
    taken.clear()  # the caller's last reference: the pool holds the buffer now
    b = pool.take((1024,), np.float32)
    c = pool.take((1024,), np.float32)  # the pool is empty again: a new buffer
    assert b is first()
    assert not np.shares_memory(b, c)
    assert pool.free_bytes == 0
    assert b.ctypes.data % 64 == 0 and c.ctypes.data % 64 == 0


def test_a_buffer_still_referenced_elsewhere_is_dropped_not_pooled():
    pool = _buffer_pool.HostBufferPool()
    pool.note_snapshot(1 << 20)
    held = pool.take((256,), np.float32)  # e.g. TensorStore still writing from it
    pool.give_back([held])
    assert pool.free_bytes == 0
    assert pool.take((256,), np.float32) is not held


def test_pool_holds_at_most_the_largest_snapshot_dropping_the_oldest_first():
    pool = _buffer_pool.HostBufferPool()
    pool.note_snapshot(3 * 400)
    pool.note_snapshot(2 * 400)  # a smaller snapshot does not lower the bound
    assert pool.max_free_bytes == 1200
    old = [pool.take((100,), np.float32) for _ in range(2)]
    new = [pool.take((10, 10), np.float32) for _ in range(2)]
    new_refs = [weakref.ref(x) for x in new]
    pool.give_back(old)
    pool.give_back(new)  # 1600 bytes given back, 1200 kept: the oldest of `old` dropped
    del old[:], new[:]
    assert pool.free_bytes == 1200
    kept_new = [pool.take((10, 10), np.float32) for _ in range(2)]
    assert {id(x) for x in kept_new} == {id(r()) for r in new_refs}
    assert pool.free_bytes == 400


def test_pool_without_a_noted_snapshot_keeps_nothing():
    pool = _buffer_pool.HostBufferPool()
    pool.give_back([np.empty(16, np.float32)])
    assert pool.free_bytes == 0


def _tree(mesh, seed):
    x = np.arange(64 * 256, dtype=np.float32).reshape(64, 256) + seed
    return {"w": jax.device_put(x, NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(np.full((512,), seed, np.int32), NamedSharding(mesh, P()))}


@pytest.fixture
def empty_shared_pool():
    ckpt.release_host_buffers()
    yield _buffer_pool.shared_pool()
    ckpt.release_host_buffers()


def _hosts(handle):
    """Weak references to a save's host buffers (a strong one would keep them out of the
    pool): the leaves' own, and the one its packed chunks share (`Snapshot.pack_slab`,
    of which their host copies are views)."""
    snap = handle.snapshot
    buffers = [h for leaf in snap.arrays for h in leaf.host if not leaf.meta.packed]
    if snap.pack_slab is not None:
        buffers.append(snap.pack_slab.buffer)
    return [weakref.ref(b) for b in buffers]


def test_save_async_reuses_its_buffers_and_two_saves_in_flight_share_none(tmp_path, monkeypatch, empty_shared_pool):
    mesh = make_mesh((2, 4), ("data", "model"))
    release = threading.Event()
    real_write = _save.write_snapshot

    def held_write(snap):  # keeps both saves in flight until both snapshots are taken
        assert release.wait(60)
        return real_write(snap)

    monkeypatch.setattr(_save, "write_snapshot", held_write)
    first = ckpt.save_async(str(tmp_path / "1"), _tree(mesh, 1))
    second = ckpt.save_async(str(tmp_path / "2"), _tree(mesh, 2))
    first_hosts, second_hosts = _hosts(first), _hosts(second)
    assert first_hosts and second_hosts
    assert not any(np.shares_memory(a(), b()) for a in first_hosts for b in second_hosts)
    snapshot_bytes = sum(h().nbytes for h in first_hosts)
    release.set()
    first.wait()
    second.wait()
    # Both saves' buffers came back; the pool keeps one snapshot's worth.
    assert empty_shared_pool.max_free_bytes == snapshot_bytes
    assert empty_shared_pool.free_bytes == snapshot_bytes

    release.clear()
    third = ckpt.save_async(str(tmp_path / "3"), _tree(mesh, 3))
    pooled = {id(r()) for r in first_hosts + second_hosts if r() is not None}
    third_hosts = {id(r()) for r in _hosts(third)}
    release.set()
    assert third_hosts and third_hosts <= pooled  # reused, no fresh memory
    third.wait()
    for step, seed in ((1, 1), (2, 2), (3, 3)):  # reuse tore no snapshot
        out = ckpt.restore(str(tmp_path / str(step)))
        np.testing.assert_array_equal(out["w"], np.arange(64 * 256, dtype=np.float32).reshape(64, 256) + seed)
        np.testing.assert_array_equal(out["b"], np.full((512,), seed, np.int32))

    staged = staging_buffers().free_bytes  # the direct writer's (0 where the file system refuses O_DIRECT)
    assert ckpt.release_host_buffers() == snapshot_bytes + staged
    assert empty_shared_pool.free_bytes == 0
    assert ckpt.release_host_buffers() == 0


def test_release_frees_the_staging_buffers_of_direct_writes(tmp_path, empty_shared_pool):
    # A snapshot read in place is written from its own shard files (`test_one_copy`); the
    # staging buffers remain for host copies of accelerators' shards: one kept here.
    staging_buffers().give_back(staging_buffers().take(4 << 20))
    path = str(tmp_path / "1")
    ckpt.save(path, {"w": np.arange(1 << 16, dtype=np.float32)}, direct_io="auto", pack_small_leaves_bytes=0)
    if json.loads(Path(path, "processes", "0.json").read_text())["write_mode"] != "direct" and os.environ.get("CI") != "true":
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    staged = staging_buffers().free_bytes
    assert staged >= 4 << 20  # one writer thread's buffer, kept for the next save
    assert ckpt.release_host_buffers() == staged  # plain save pools no snapshot buffer: only the staging ones
    assert staging_buffers().free_bytes == 0
    assert ckpt.release_host_buffers() == 0


def test_release_during_a_save_in_flight_frees_its_buffers_when_it_ends(tmp_path, monkeypatch, empty_shared_pool):
    mesh = make_mesh((2, 4), ("data", "model"))
    release = threading.Event()
    real_write = _save.write_snapshot
    monkeypatch.setattr(_save, "write_snapshot", lambda snap: (release.wait(60), real_write(snap))[1])
    handle = ckpt.save_async(str(tmp_path / "1"), _tree(mesh, 1))
    assert ckpt.release_host_buffers() == 0  # its buffers are in use, not free
    release.set()
    handle.wait()
    assert empty_shared_pool.free_bytes == 0  # released: not kept when they came back


def test_plain_save_keeps_no_host_buffers(tmp_path, empty_shared_pool):
    mesh = make_mesh((2, 4), ("data", "model"))
    ckpt.save(str(tmp_path / "1"), _tree(mesh, 1))
    assert empty_shared_pool.free_bytes == 0
