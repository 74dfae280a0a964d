"""Damaged checkpoints: restore names the leaf and chunk, verify lists every problem."""

import os

import crc32c
import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt

# About the per-leaf layout (each leaf its own zarr array and chunk files): small leaves
# are not packed here (tests/test_pack.py covers the packed layout).
pytestmark = pytest.mark.usefixtures("unpacked_layout")


@pytest.fixture
def saved(ckpt_dir):
    mesh = make_mesh((2, 4), ("data", "model"))
    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    tree = {"params": {"w": jax.device_put(x, NamedSharding(mesh, P("data", "model")))}, "b": np.ones(4, np.int32)}
    ckpt.save(f"{ckpt_dir}/1", tree)
    return f"{ckpt_dir}/1", x


def _target():
    mesh = make_mesh((4,), ("d",))
    return {"params": {"w": NamedSharding(mesh, P("d"))}, "b": None}


def test_verify_passes_on_intact_checkpoint(saved):
    report = ckpt.verify(saved[0])
    assert report.ok and report.problems == () and report.chunks_checked == 9
    assert report.bytes_checked == 64 * 32 * 4 + 16


def test_deleted_chunk_raises_and_verify_lists_it(saved):
    path, _ = saved
    os.remove(f"{path}/arrays/params/w/c/1/2")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['params'\]\['w'\].*c/1/2") as e:
        ckpt.restore(path, _target())
    assert isinstance(e.value, ValueError)
    report = ckpt.verify(path)
    assert not report.ok and len(report.problems) == 1 and "arrays/params/w/c/1/2" in report.problems[0]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_chunk_never_returns_wrong_values(saved, damage):
    path, _ = saved
    chunk = f"{path}/arrays/params/w/c/0/3"
    data = bytearray(_read(chunk))
    if damage == "flip":
        data[17] ^= 0x40
    else:
        data = data[: len(data) // 2]
    with open(chunk, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['params'\]\['w'\]"):
        ckpt.restore(path, _target())
    os.remove(f"{path}/arrays/b/c/0")
    report = ckpt.verify(path)
    assert len(report.problems) == 2
    assert any("c/0/3" in p for p in report.problems) and any("arrays/b/c/0" in p for p in report.problems)


def test_a_checksum_mismatch_shows_stored_and_read_crc_and_the_fix(saved):
    path, _ = saved
    chunk = f"{path}/arrays/params/w/c/0/3"
    data = bytearray(_read(chunk))
    data[17] ^= 0x40
    with open(chunk, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"c/0/3 inner chunk \d+: crc32c mismatch \(stored 0x[0-9a-f]{8}, "
                       r"the bytes read give 0x[0-9a-f]{8}\).*checkpointer verify"):
        ckpt.restore(path, _target())


def test_a_bad_index_entry_shows_what_it_holds_and_the_fix(saved):
    path, _ = saved
    chunk = f"{path}/arrays/params/w/c/0/3"
    layout = ckpt.metadata(path).arrays["params/w"].layout
    data = bytearray(_read(chunk))
    start = layout.index_offset
    entries = np.frombuffer(bytes(data[start : start + layout.index_bytes - 4]), "<u8").reshape(-1, 2).copy()
    entries[0, 1] = 0  # inner chunk 0: 0 bytes, under an index whose own crc32c is right
    raw = entries.tobytes()
    data[start : start + len(raw) + 4] = raw + crc32c.crc32c(raw).to_bytes(4, "little")
    with open(chunk, "wb") as f:
        f.write(bytes(data))
    want = rf"c/0/3: index entry 0 is missing or out of range \(offset \d+, 0 bytes; expected {layout.inner_bytes_with_crc} bytes"
    with pytest.raises(ckpt.CorruptCheckpointError, match=want + ".*checkpointer verify"):
        ckpt.restore(path, _target())


def _read(p):
    with open(p, "rb") as f:
        return f.read()
