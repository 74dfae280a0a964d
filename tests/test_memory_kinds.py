"""The snapshot's one copy per shard (`_memory/_device_copy`) and memory kinds on restore,
on the CPU backend: its devices have `pinned_host` and `unpinned_host` memories, and the
accelerator routes can be forced there."""

import threading

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._memory import _buffer_pool, _device_copy
from checkpointer._save import _pipeline as _save


@pytest.fixture
def route(request, monkeypatch):
    """The snapshot route the CPU backend takes in this test (the probe's is POOL)."""
    monkeypatch.setattr(_device_copy, "_ROUTES", {"cpu": request.param})
    return request.param


@pytest.fixture
def empty_shared_pool():
    ckpt.release_host_buffers()
    yield _buffer_pool.shared_pool()
    ckpt.release_host_buffers()


def _bits(shape, dtype, seed):
    """Random bit patterns of `dtype` (NaN payloads and signed zeros included)."""
    dtype = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def _state(mesh, memory_kind=None):
    """A training state's kinds of leaves: sharded, replicated on every device, split
    over one axis and replicated over the other, a small (packed) leaf, a host array."""
    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec, memory_kind=memory_kind))
    return {
        "w": put(_bits((1024, 1024), np.float32, 1), P("data", "model")),
        "emb": put(_bits((512, 1024), jax.numpy.bfloat16, 2), P()),
        "mu": put(_bits((512, 256), np.int8, 3), P("model")),
        "step": put(_bits((4,), np.int32, 4), P()),
        "host": _bits((300, 70), np.uint16, 5),
    }


def _assert_bit_exact(out, state):
    for k, v in state.items():
        got, want = np.asarray(out[k]), np.asarray(v)
        assert got.dtype == want.dtype, k
        assert got.tobytes() == want.tobytes(), k


def _logical_bytes(state):
    return sum(np.asarray(v).nbytes for v in state.values())


def test_the_probe_keeps_one_copy_into_the_pool_on_the_cpu_backend():
    assert _device_copy.snapshot_route(jax.devices()[0]) == _device_copy.POOL


def test_a_view_of_a_pinned_host_buffer_is_told_from_a_copy():
    d = jax.devices()[0]
    p = jax.device_put(np.arange(4096, dtype=np.uint8), jax.sharding.SingleDeviceSharding(d, memory_kind="pinned_host"))
    assert _device_copy._is_view_of(np.asarray(p), p)
    assert not _device_copy._is_view_of(np.array(p), p)


@pytest.mark.parametrize("route", [_device_copy.POOL, _device_copy.PINNED_HOST, _device_copy.HOST_COPY], indirect=True)
def test_the_snapshot_copies_each_saved_byte_once(tmp_path, route):
    # Replicated leaves are copied by one device only, each byte of the state once.
    state = _state(make_mesh((2, 4), ("data", "model")))
    snap = _save.take_snapshot(str(tmp_path / "1"), state)
    try:
        assert snap.copied_bytes == _logical_bytes(state)
        record = _save.write_snapshot(snap)
    finally:
        _save.release_host(snap)
    assert record.packed and any(not leaf.meta.packed for leaf in snap.arrays)  # both encodings saved
    assert snap.copied_bytes == sum(c.data_bytes for c in record.chunks)  # packed chunks included


@pytest.mark.parametrize("direct_io", [True, False])  # the direct writer and TensorStore, from read-only views
@pytest.mark.parametrize("route", [_device_copy.PINNED_HOST], indirect=True)
def test_the_pinned_host_route_keeps_its_copies_out_of_the_pool_and_aliases_nothing(
    tmp_path, route, direct_io, monkeypatch, empty_shared_pool
):
    mesh = make_mesh((2, 4), ("data", "model"))
    state = _state(mesh)
    expected = {k: np.array(v) for k, v in state.items()}
    release = threading.Event()
    real_write = _save.write_snapshot
    monkeypatch.setattr(_save, "write_snapshot", lambda snap: (release.wait(60), real_write(snap))[1])
    handle = ckpt.save_async(str(tmp_path / "1"), state, direct_io=direct_io)
    snap = handle.snapshot
    device_bytes = sum(np.asarray(state[k]).nbytes for k in ("w", "emb", "mu", "step"))
    assert snap.copy_route_bytes == {_device_copy.PINNED_HOST: device_bytes, _device_copy.POOL: state["host"].nbytes}
    sources = [np.asarray(s.data) for k in ("w", "emb", "mu", "step") for s in state[k].addressable_shards]
    pinned = [h for leaf in snap.arrays if leaf.meta.path != "['host']" for h in leaf.host]
    assert pinned and not any(np.shares_memory(h, s) for h in pinned for s in sources)
    del sources, pinned
    for k in ("w", "emb", "mu", "step"):  # the caller may delete (or donate) its arrays at once
        state[k].delete()
    release.set()
    handle.wait()
    assert snap.result.write_mode == ("direct" if direct_io else "buffered")
    assert empty_shared_pool.free_bytes == state["host"].nbytes  # only the numpy leaf's pool buffer came back
    _assert_bit_exact(ckpt.restore(str(tmp_path / "1")), expected)


@pytest.mark.parametrize("route", [_device_copy.HOST_COPY], indirect=True)
def test_a_host_array_that_is_the_shard_itself_is_copied_into_the_pool(tmp_path, route):
    # On CPU (and for shards in host memory anywhere) jax's "host copy" is the device
    # buffer itself: adopting it would let the caller's donation change the snapshot.
    state = _state(make_mesh((2, 4), ("data", "model")))
    snap = _save.take_snapshot(str(tmp_path / "1"), state)
    try:
        assert snap.copy_route_bytes == {_device_copy.POOL: _logical_bytes(state)}
        sources = [np.asarray(s.data) for k in ("w", "emb", "mu", "step") for s in state[k].addressable_shards]
        assert not any(np.shares_memory(h, s) for leaf in snap.arrays for h in leaf.host for s in sources)
    finally:
        _save.release_host(snap)


@pytest.mark.parametrize("memory_kind", ["pinned_host", "unpinned_host"])
def test_a_target_memory_kind_is_kept_on_restore_for_array_and_packed_leaves(tmp_path, memory_kind):
    mesh = make_mesh((2, 4), ("data", "model"))
    state = _state(mesh)
    ckpt.save(str(tmp_path / "1"), state)
    meta = ckpt.metadata(str(tmp_path / "1")).arrays
    assert not meta["w"].packed and meta["step"].packed  # both encodings are exercised
    target = {k: (NamedSharding(mesh, v.sharding.spec, memory_kind=memory_kind) if isinstance(v, jax.Array) else None)
              for k, v in state.items()}  # e.g. optimizer state offloaded to host memory
    out = ckpt.restore(str(tmp_path / "1"), target)
    for k in ("w", "emb", "mu", "step"):
        assert out[k].sharding.memory_kind == memory_kind, k
        assert out[k].sharding.is_equivalent_to(target[k], out[k].ndim), k
    _assert_bit_exact(out, state)


@pytest.mark.parametrize("route", [_device_copy.POOL, _device_copy.PINNED_HOST], indirect=True)
def test_a_state_living_in_pinned_host_memory_saves_and_restores_bit_exactly(tmp_path, route):
    mesh = make_mesh((2, 4), ("data", "model"))
    state = _state(mesh, memory_kind="pinned_host")
    assert state["w"].sharding.memory_kind == "pinned_host"
    ckpt.save(str(tmp_path / "1"), state)
    target = {k: (v.sharding if isinstance(v, jax.Array) else None) for k, v in state.items()}
    out = ckpt.restore(str(tmp_path / "1"), target)
    assert all(out[k].sharding.memory_kind == "pinned_host" for k in ("w", "emb", "mu", "step"))
    _assert_bit_exact(out, state)
    _assert_bit_exact(ckpt.restore(str(tmp_path / "1")), state)  # and onto host numpy arrays
