"""A restore in a fresh process (issue 15 item 1): what `import checkpointer` loads, and
the destination buffers the reader fills."""

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
from checkpointer._memory._restore_memory import HUGE_PAGE_BYTES, host_buffer

# Packages a process that only restores local files must never load (the layers above
# restore, and the save side; tests/test_layout.py checks that each of them exists).
NOT_FOR_RESTORE = (
    "checkpointer._save", "checkpointer._manage", "checkpointer._tools", "checkpointer._cli",
    "tensorstore",
)


def _fresh_modules(code: str) -> set[str]:
    """The names in sys.modules after running `code` in a new interpreter."""
    script = textwrap.dedent(code) + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    return set(out.stdout.split())


def test_import_checkpointer_loads_only_the_errors():
    mods = _fresh_modules("import checkpointer")
    assert {m for m in mods if m.startswith("checkpointer")} == {"checkpointer", "checkpointer._errors"}


def test_restore_of_local_files_loads_no_save_manager_cli_or_tensorstore(tmp_path):
    path = str(tmp_path / "1")
    ckpt.save(path, {"w": np.arange(16.0)})
    mods = _fresh_modules(f"""
        import checkpointer, numpy as np
        out = checkpointer.restore({path!r})
        assert np.array_equal(out["w"], np.arange(16.0)), out
    """)
    assert "checkpointer._restore" in mods and "checkpointer._restore._pipeline" in mods
    assert not mods & set(NOT_FOR_RESTORE), sorted(mods & set(NOT_FOR_RESTORE))


def test_every_public_name_resolves_and_star_import_works():
    namespace: dict = {}
    exec("from checkpointer import *", namespace)
    assert set(ckpt.__all__) <= set(namespace)
    assert set(ckpt.__all__) <= set(dir(ckpt))
    from checkpointer._manage._manager import CheckpointManager
    from checkpointer._restore._pipeline import restore

    assert ckpt.restore is restore and ckpt.CheckpointManager is CheckpointManager
    assert isinstance(ckpt.__version__, str)


def test_unknown_attribute_raises_attribute_error():
    try:
        ckpt.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("checkpointer.no_such_name did not raise")


# --- destination buffers and reads straight into them ---------------------------------

def test_direct_destination_is_the_contiguous_bytes_of_a_whole_inner_chunk():
    out = np.empty((8, 6), np.float32)
    base = out.ctypes.data
    # rows 2..3, every column: contiguous, whole inner chunk (2, 6)
    view = _read.direct_destination(out, (2, 6), ((0, 2, 2), (0, 0, 6)))
    assert view is not None and len(view) == 2 * 6 * 4
    assert np.frombuffer(view, np.uint8).ctypes.data == base + 2 * 6 * 4
    # one row, a part of its columns: contiguous too
    view = _read.direct_destination(out, (1, 3), ((0, 5, 1), (0, 3, 3)))
    assert view is not None and np.frombuffer(view, np.uint8).ctypes.data == base + (5 * 6 + 3) * 4
    # two rows of half the columns: strided in `out`
    assert _read.direct_destination(out, (2, 3), ((0, 0, 2), (0, 0, 3))) is None
    # a cut inner chunk (source does not start at 0, or is shorter than the inner chunk)
    assert _read.direct_destination(out, (2, 6), ((1, 0, 1), (0, 0, 6))) is None
    assert _read.direct_destination(out, (4, 6), ((0, 0, 2), (0, 0, 6))) is None
    # a big-endian destination (the stored bytes are little-endian: they need a conversion)
    assert _read.direct_destination(np.empty((8, 6), ">f4"), (2, 6), ((0, 2, 2), (0, 0, 6))) is None
    # a destination that is not C-contiguous
    assert _read.direct_destination(out.T, (3, 8), ((0, 0, 3), (0, 0, 8))) is None


def test_host_buffer_is_huge_page_aligned_when_large_and_adopted_by_the_cpu_device():
    big = host_buffer((HUGE_PAGE_BYTES // 4 + 1024,), np.float32)
    assert big.ctypes.data % HUGE_PAGE_BYTES == 0 and big.flags.c_contiguous and big.flags.writeable
    small = host_buffer((3, 5), np.int16)
    assert small.ctypes.data % 64 == 0 and small.shape == (3, 5) and small.dtype == np.int16
    big[:] = 7
    on_device = jax.device_put(big, jax.devices()[0])
    assert on_device.unsafe_buffer_pointer() == big.ctypes.data  # no copy on the CPU backend
    del big
    assert float(np.asarray(on_device).sum()) == 7.0 * on_device.size  # the mapping lives on with the array


@pytest.fixture
def rows_layout(ckpt_dir):
    """Leaves whose inner chunks are whole rows of a saved shard (1-D, and 2-D with few
    columns), so a target on the saved layout reads them straight into its buffers."""
    mesh = make_mesh((2, 4), ("data", "model"))
    host = {
        "bias": np.arange(1 << 18, dtype=np.float32),
        "tall": np.random.default_rng(1).standard_normal((8192, 64)).astype(np.float32),
        "wide": np.random.default_rng(2).standard_normal((64, 8192)).astype(np.float32),
    }
    specs = {"bias": P("model"), "tall": P("data"), "wide": P("data", "model")}
    shardings = {k: NamedSharding(mesh, specs[k]) for k in host}
    ckpt.save(f"{ckpt_dir}/1", {k: jax.device_put(v, shardings[k]) for k, v in host.items()})
    return f"{ckpt_dir}/1", host, shardings


def _count_direct_runs(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = _read._read_run_direct

    def spy(f, start, run, what, path):
        calls.append(len(run))
        return real(f, start, run, what, path)

    monkeypatch.setattr(_read, "_read_run_direct", spy)
    return calls


def test_inner_chunks_contiguous_in_the_destination_are_read_straight_into_it(rows_layout, monkeypatch):
    path, host, shardings = rows_layout
    calls = _count_direct_runs(monkeypatch)
    stats = ckpt.RestoreStats()
    out = ckpt.restore(path, shardings, stats=stats)
    for k, v in host.items():
        np.testing.assert_array_equal(np.asarray(out[k]), v)
        assert out[k].sharding == shardings[k]
    assert calls, "no inner chunk was read straight into its destination"
    assert stats.bytes_read == stats.plan.bytes_read  # the same bytes counted as through the scratch buffer


def test_a_resharded_target_mixes_direct_and_scratch_reads_exactly(rows_layout):
    path, host, _ = rows_layout
    mesh = make_mesh((4, 2), ("data", "model"))
    target = {"bias": NamedSharding(mesh, P("data")), "tall": NamedSharding(mesh, P(None, "model")),
              "wide": NamedSharding(mesh, P("model", "data"))}
    out = ckpt.restore(path, target)
    for k, v in host.items():
        np.testing.assert_array_equal(np.asarray(out[k]), v)


def test_a_damaged_inner_chunk_read_straight_into_the_destination_raises(rows_layout, monkeypatch):
    path, _, shardings = rows_layout
    chunk = f"{path}/arrays/tall/c/0/0"
    with open(chunk, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x10]))
    calls = _count_direct_runs(monkeypatch)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['tall'\].*c/0/0 inner chunk 0: crc32c mismatch.*checkpointer verify"):
        ckpt.restore(path, shardings)
    assert calls


def test_scatter_reads_through_a_kvstore_give_the_same_values(rows_layout, monkeypatch):
    path, host, shardings = rows_layout
    mem = "memory://fresh_restore_scatter/1"
    ckpt.save(mem, {k: jax.device_put(v, shardings[k]) for k, v in host.items()})
    calls = _count_direct_runs(monkeypatch)
    out = ckpt.restore(mem, shardings)
    for k, v in host.items():
        np.testing.assert_array_equal(np.asarray(out[k]), v)
    assert calls


@pytest.mark.parametrize("where", ["local", "memory"])
def test_scatter_read_fills_every_buffer_in_order_past_iov_max_and_raises_at_eof(tmp_path, where):
    from checkpointer._storage._kvstore import storage_for

    data = bytes(range(256)) * 40  # 10240 bytes
    location = str(tmp_path / "f") if where == "local" else "memory://fresh_restore_scatter_unit/f"
    storage, location = storage_for(location)
    storage.write_file(location, data)
    sizes = [3, 0, 5] * 600  # 1800 buffers (more than one preadv takes), 4800 bytes
    bufs = [bytearray(n) for n in sizes]
    with storage.open_reader(location) as reader:
        reader.read_into_buffers(100, [memoryview(b) for b in bufs])
        assert b"".join(bufs) == data[100 : 100 + sum(sizes)]
        with pytest.raises(EOFError):
            reader.read_into_buffers(len(data) - 4, [memoryview(bytearray(3)), memoryview(bytearray(3))])
