"""The restore planner against reality: amplification, bytes actually read, host memory."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._encoding import _read

# About the per-leaf layout (each leaf its own zarr array and chunk files): small leaves
# are not packed here (tests/test_pack.py covers the packed layout).
pytestmark = pytest.mark.usefixtures("unpacked_layout")

N = 4096


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Two 4096x4096 float32 leaves saved P('data','model') on 2x4, and leaves whose
    dimensions do not divide the mesh (saved replicated along those dimensions)."""
    path = str(tmp_path_factory.mktemp("big") / "1")
    mesh = make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    host = {
        "a": rng.standard_normal((N, N), dtype=np.float32),
        "b": rng.standard_normal((N, N), dtype=np.float32),
        "odd": rng.standard_normal((1001, 4096), dtype=np.float32),
        "odd_cols": rng.standard_normal((4096, 1001), dtype=np.float32),
    }
    specs = {"a": P("data", "model"), "b": P("data", "model"), "odd": P(None, "model"), "odd_cols": P("data", None)}
    tree = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    ckpt.save(path, tree)
    return path, host


def _targets(mesh, spec_2d, spec_odd, spec_odd_cols):
    return {
        "a": NamedSharding(mesh, spec_2d),
        "b": NamedSharding(mesh, spec_2d),
        "odd": NamedSharding(mesh, spec_odd),
        "odd_cols": NamedSharding(mesh, spec_odd_cols),
    }


SUITE = {
    "same mesh": lambda: _targets(make_mesh((2, 4), ("data", "model")), P("data", "model"), P(None, "model"), P("data", None)),
    "2x4 -> 4x2": lambda: _targets(make_mesh((4, 2), ("data", "model")), P("data", "model"), P(None, "model"), P("data", None)),
    "P(data,model) -> P(model,data)": lambda: _targets(
        make_mesh((2, 4), ("data", "model")), P("model", "data"), P(None, "data"), P("model", None)
    ),
    "8 devices -> 4": lambda: _targets(make_mesh((4,), ("d",)), P("d"), P(None, "d"), P("d", None)),
    "8 devices -> 1": lambda: _targets(make_mesh((1,), ("d",)), P(), P(), P()),
    "sharded -> replicated": lambda: _targets(make_mesh((2, 4), ("data", "model")), P(), P(), P()),
    "1-D mesh -> 2-D mesh": lambda: _targets(make_mesh((8,), ("d",)), P(None, "d"), P(None, "d"), P("d", None)),
}


@pytest.mark.parametrize("name", list(SUITE))
def test_read_amplification_and_bytes_actually_read(big, name):
    path, host = big
    target = SUITE[name]()
    plan = ckpt.plan_restore(path, target)
    assert plan.read_amplification <= 1.05, str(plan)
    for leaf in plan.leaves:
        assert leaf.bytes_read <= 1.05 * leaf.bytes_needed, leaf.leaf_path
    stats = ckpt.RestoreStats()
    out = ckpt.restore(path, target, stats=stats)
    # The restore executes the plan as it stands: exactly the planned bytes, the boxes of
    # one leaf reading each zarr shard file's index (and an inner chunk two boxes cut) once.
    assert stats.plan == plan
    assert stats.bytes_read == plan.bytes_read
    assert stats.chunk_reads == len({(leaf.leaf_path, r.source, r.chunk_key) for leaf in plan.leaves for b in leaf.boxes for r in b.reads})
    for k, v in host.items():
        for shard in out[k].addressable_shards[:3]:
            np.testing.assert_array_equal(np.asarray(shard.data), v[shard.index])


def test_each_unique_box_is_read_once_per_process(big):
    path, _ = big
    mesh = make_mesh((2, 4), ("data", "model"))
    target = _targets(mesh, P("data"), P(), P())  # each box held by 4 devices
    plan = ckpt.plan_restore(path, target)
    a = next(leaf for leaf in plan.leaves if leaf.leaf_path == "a")
    assert len(a.boxes) == 2 and all(len(b.device_ids) == 4 for b in a.boxes)
    assert a.bytes_needed == N * N * 4  # not 4x: replicas are read once


def test_box_larger_than_max_inflight_is_read_in_pieces(big):
    path, host = big
    mesh = make_mesh((2,), ("d",))
    target = {"a": NamedSharding(mesh, P()), "odd": NamedSharding(mesh, P(None, "d"))}
    out = ckpt.restore(path, target, partial=True, max_inflight_bytes=8 << 20)
    np.testing.assert_array_equal(np.asarray(out["a"]), host["a"])
    for shard in out["odd"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), host["odd"][shard.index])


@pytest.mark.slow
def test_peak_host_memory_stays_within_target_plus_inflight(tmp_path):
    """Restore 256 MiB onto one device with 32 MiB in flight, in a fresh process."""
    mesh = make_mesh((2, 4), ("data", "model"))
    ckpt.save(str(tmp_path / "big"), {"w": jax.device_put(np.ones((8192, 8192), np.float32), NamedSharding(mesh, P("data", "model")))})
    ckpt.save(str(tmp_path / "small"), {"w": np.ones((64, 64), np.float32)})
    code = textwrap.dedent(
        f"""
        import resource, jax, psutil, checkpointer as ckpt
        from jax.sharding import SingleDeviceSharding
        dev = SingleDeviceSharding(jax.devices()[0])
        # Warm up: compile the slab update once, so only the restore is measured.
        jax.block_until_ready(ckpt.restore({str(tmp_path / "small")!r}, {{"w": dev}}, max_inflight_bytes=3000))
        base = max(psutil.Process().memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        out = ckpt.restore({str(tmp_path / "big")!r}, {{"w": dev}}, max_inflight_bytes=32 << 20)
        jax.block_until_ready(out)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print((peak - base) >> 20, float(out["w"].sum()))
        """
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rise_mib, total = res.stdout.split()
    assert float(total) == 8192 * 8192
    # target 256 MiB + 32 MiB in flight + a constant (allocator arenas, thread stacks)
    assert int(rise_mib) <= 256 + 32 + 96, res.stdout


def test_replicated_restore_gives_each_device_its_own_buffer(tmp_path):
    """The first device may adopt the host buffer; the others must not share it, or
    donating one device's buffer in a train step would change the others."""
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    ckpt.save(str(tmp_path / "1"), {"x": x})
    mesh = make_mesh((4,), ("d",))
    out = ckpt.restore(str(tmp_path / "1"), {"x": NamedSharding(mesh, P())})["x"]
    pointers = {s.data.unsafe_buffer_pointer() for s in out.addressable_shards}
    assert len(pointers) == 4
    datas = [s.data for s in out.addressable_shards]
    del out
    donate = jax.jit(lambda a: a * 0 - 1, donate_argnums=0)
    result = donate(datas[0])
    assert datas[0].is_deleted() and float(result[0, 0]) == -1.0
    for d in datas[1:]:
        np.testing.assert_array_equal(np.asarray(d), x)


def test_box_larger_than_max_inflight_is_read_as_the_plan_slabs_it(big):
    path, host = big
    target = {"a": NamedSharding(make_mesh((2,), ("d",)), P())}
    plan = ckpt.plan_restore(path, target, partial=True, max_inflight_bytes=8 << 20)
    (box,) = plan.leaves[0].boxes
    rows = (8 << 20) // 3 // (N * 4)  # slabs of whole rows, at most a third of the bound: 170 rows
    assert [s.box.shape[0] for s in box.slabs] == [rows] * (N // rows) + [N % rows]
    assert sum(s.bytes_needed for s in box.slabs) == box.bytes_needed
    stats = ckpt.RestoreStats()
    out = ckpt.restore(path, target, partial=True, max_inflight_bytes=8 << 20, stats=stats)
    assert stats.plan == plan and stats.bytes_read == plan.bytes_read
    np.testing.assert_array_equal(np.asarray(out["a"]), host["a"])


def test_a_bug_in_the_reader_is_not_reported_as_a_damaged_checkpoint(big, monkeypatch):
    path, _ = big

    def buggy(*args, **kwargs):
        raise TypeError("a bug in our code")

    monkeypatch.setattr(_read, "read_chunk_index", buggy)
    target = {"a": NamedSharding(make_mesh((2,), ("d",)), P("d"))}
    with pytest.raises(TypeError, match="a bug in our code") as info:
        ckpt.restore(path, target, partial=True)
    assert not isinstance(info.value, ckpt.CorruptCheckpointError)


def test_shard_file_layout_matches_the_files_tensorstore_writes(tmp_path):
    import crc32c

    from checkpointer._format._shard_file import ShardFileLayout

    x = np.arange(512 * 256, dtype=np.int32).astype(np.int16).reshape(512, 256)  # chunks of 64 KiB
    ckpt.save(str(tmp_path / "1"), {"x": jax.device_put(x, NamedSharding(make_mesh((2, 2), ("a", "b")), P("a", "b")))})
    meta = ckpt.metadata(str(tmp_path / "1")).arrays["x"]
    layout = ShardFileLayout(meta.chunk_shape, meta.inner_chunk_shape, meta.dtype.itemsize)
    assert layout.inner_chunks > 1
    blob = (tmp_path / "1" / "arrays" / "x" / "c" / "1" / "0").read_bytes()
    assert len(blob) == layout.file_bytes == layout.index_offset + layout.index_bytes
    data, crc = ShardFileLayout.split_crc(blob[layout.index_offset :])
    assert crc32c.crc32c(data) == crc
    index = np.frombuffer(data, "<u8").reshape(-1, 2)
    assert len(index) == layout.inner_chunks and set(index[:, 1]) == {layout.inner_bytes_with_crc}
    assert sorted(index[:, 0]) == [k * layout.inner_bytes_with_crc for k in range(layout.inner_chunks)]
