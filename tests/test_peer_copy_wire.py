"""The peer copies' wire (`_manage/_peer_copy`): one copy sent and received over a local
socket pair, the owner's crc32c of its chunk files from their layout (no read for it),
the holder's checks, the files' exact bytes, the sockets' kernel timeouts."""

import os
import socket
import threading

import crc32c
import numpy as np
import pytest

import checkpointer as ckpt
from checkpointer._errors import CorruptCheckpointError
from checkpointer._manage import _peer_copy
from checkpointer._manage._peers import _commit_folder, _received_path, step_files


def _tree():
    rng = np.random.default_rng(0)
    return {
        "big": rng.standard_normal((2048, 1024), dtype=np.float32),  # 8 MiB: a shard file of 2 blocks + its tail
        "wide": rng.standard_normal((600, 1000)).astype(np.float16),  # shard files of other layouts
        "bytes": rng.integers(0, 255, (1500, 701), dtype=np.uint8),
        "odd": rng.integers(0, 255, (333, 77), dtype=np.uint8),
        "half": rng.standard_normal((100, 60)).astype(np.float16),
        "scalar": np.float64(3.5),
        "norms": [np.full(7, i, np.float32) for i in range(5)],  # small leaves: packed
        "step": 4,
    }


@pytest.fixture
def step(tmp_path):
    folder = str(tmp_path / "owner" / "4")
    ckpt.save(folder, _tree())
    return folder


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _chunk_files(files):
    return [f["key"] for f in files if "/c/" in f["key"] or f["key"].endswith("/c")]


def _copy(folder, dst, damage=None, spare=None):
    """Sends `folder` with `send_copy` and receives it into `dst` with `receive_copy`
    (a socket pair, the holder on a thread; `dst` a spare taken with `take_spare` when
    `spare` is its files); returns the holder's records or its error."""
    files = step_files(folder)
    a, b = socket.socketpair()
    for s in (a, b):
        _peer_copy.block_with_timeout(s, 30)
    out: dict = {}

    def hold():
        try:
            if spare is None:
                os.makedirs(dst)
            out["files"] = _peer_copy.receive_copy(b, dst, files, _received_path, spare)
        except Exception as e:
            out["error"] = e
            b.close()  # the owner's next send fails, as when a holder refuses

    t = threading.Thread(target=hold)
    t.start()
    try:
        _peer_copy.send_copy(a, folder, files, damage)
    except OSError:
        pass
    t.join()
    a.close()
    b.close()
    return files, out


def test_the_owner_claims_each_chunk_files_true_crc32c_from_the_manifest_alone(step):
    files = step_files(step)
    claims = _peer_copy.intact_crc32c(step, files)
    chunks = _chunk_files(files)
    assert any(k.startswith("packed/") for k in chunks) and any(k.startswith("arrays/big/") for k in chunks)
    assert sorted(claims) == sorted(chunks)  # every chunk file, no JSON file
    for key, claim in claims.items():
        assert claim.crc == crc32c.crc32c(_read(f"{step}/{key}")), key


def test_a_copy_is_byte_for_byte_and_the_owner_reads_only_the_unclaimed_files_for_their_crc32c(step, tmp_path, monkeypatch):
    summed: list[int] = []
    real = _peer_copy.crc32c.crc32c
    owner = threading.get_ident()

    def counting(data, crc=0):
        if threading.get_ident() == owner:
            summed.append(len(data))
        return real(data, crc)

    _peer_copy._expected_index.cache_clear()
    monkeypatch.setattr(_peer_copy.crc32c, "crc32c", counting)
    files, out = _copy(step, str(tmp_path / "holder"))
    owner_summed = sum(summed)
    monkeypatch.undo()
    assert "error" not in out
    dst = str(tmp_path / "holder")
    for f in files:
        assert _read(f"{step}/{f['key']}") == _read(_received_path(dst, f["key"])), f["key"]
    assert {r["key"]: r["crc32c"] for r in out["files"]} == {f["key"]: crc32c.crc32c(_read(f"{step}/{f['key']}")) for f in files}
    chunks = set(_chunk_files(files))
    unclaimed = sum(f["size"] for f in files if f["key"] not in chunks)
    # The owner read no chunk file for a crc32c; it took one of each shard layout's expected index.
    layouts = {(c.segment, c.inner) for c in _peer_copy.intact_crc32c(step, files).values() if c.inner}
    assert len(layouts) == 3 and owner_summed == unclaimed + sum(16 * inner for _, inner in layouts)


def test_a_chunk_file_damaged_on_the_owners_disk_is_refused_by_the_holder(step, tmp_path):
    key = next(k for k in _chunk_files(step_files(step)) if k.startswith("arrays/big/"))
    with open(f"{step}/{key}", "r+b") as f:  # a data byte of its second block
        f.seek(5 << 20)
        byte = f.read(1)
        f.seek(5 << 20)
        f.write(bytes([byte[0] ^ 0x40]))
    _, out = _copy(step, str(tmp_path / "holder"))
    assert isinstance(out.get("error"), CorruptCheckpointError)
    assert key in str(out["error"]) and "owner's disk" in str(out["error"])


def test_a_chunk_file_whose_index_is_not_its_layouts_is_read_again_for_its_crc32c(step, tmp_path):
    key = next(k for k in _chunk_files(step_files(step)) if k.startswith("arrays/big/"))
    size = os.path.getsize(f"{step}/{key}")
    with open(f"{step}/{key}", "r+b") as f:  # an index entry's offset: the index's crc32c no longer holds
        f.seek(size - 260)
        f.write(b"\x01")
    files, out = _copy(step, str(tmp_path / "holder"))
    assert "error" not in out  # the owner's crc32c of the bytes it read: a byte-for-byte copy
    assert _read(f"{step}/{key}") == _read(str(tmp_path / "holder" / key))


def test_a_copy_damaged_on_the_way_is_refused_naming_the_file(step, tmp_path):
    key = next(k for k in _chunk_files(step_files(step)) if k.startswith("arrays/big/"))

    def flip(k, block):
        if k == key:
            block[len(block) // 2] ^= 1

    _, out = _copy(step, str(tmp_path / "holder"), damage=flip)
    assert isinstance(out.get("error"), CorruptCheckpointError) and key in str(out["error"])


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, (4 << 20) + 68, (8 << 20) - 1])
def test_files_of_any_size_arrive_whole_without_padding(tmp_path, size):
    folder = str(tmp_path / "owner")
    os.makedirs(f"{folder}/d")
    data = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8).tobytes()
    with open(f"{folder}/d/f", "wb") as f:
        f.write(data)
    with open(f"{folder}/COMMITTED", "w") as f:
        f.write("{}")
    files, out = _copy(folder, str(tmp_path / "holder"))
    assert "error" not in out and out["files"][0] == {"key": "d/f", "size": size, "crc32c": crc32c.crc32c(data)}
    assert _read(str(tmp_path / "holder" / "d" / "f")) == data


def test_a_peer_that_sends_nothing_times_out_on_the_kernels_timeout():
    a, b = socket.socketpair()
    with a, b:
        _peer_copy.block_with_timeout(b, 0.2)
        assert b.gettimeout() is None or not hasattr(socket, "SO_RCVTIMEO")
        with pytest.raises(TimeoutError, match="no bytes"):
            _peer_copy.recv_exact(b, 4)
        view = memoryview(bytearray(8))
        with pytest.raises(TimeoutError):
            with _peer_copy.timeouts_named():
                b.recv_into(view, 8, socket.MSG_WAITALL)


@pytest.mark.parametrize("when", ["open", "write"])
def test_a_holder_whose_file_system_refuses_direct_io_writes_through_the_page_cache(step, tmp_path, monkeypatch, when):
    import fcntl

    real_open, real_pwrite, refusals = os.open, os.pwrite, []

    def refusing_open(path, flags, *a):
        if flags & os.O_DIRECT and "/holder/" in str(path) and when == "open":
            refusals.append(path)
            raise OSError(22, "Invalid argument", path)
        return real_open(path, flags, *a)

    def refusing_pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refusals.append(fd)
            raise OSError(22, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(_peer_copy.os, "open", refusing_open)
    monkeypatch.setattr(_peer_copy.os, "pwrite", refusing_pwrite)
    files, out = _copy(step, str(tmp_path / "holder"))
    monkeypatch.undo()
    assert "error" not in out, out
    assert len(refusals) == 1  # the first refusal holds for the rest of the copy
    for f in files:
        assert _read(f"{step}/{f['key']}") == _read(_received_path(str(tmp_path / "holder"), f["key"])), f["key"]


def _other_tree():
    rng = np.random.default_rng(1)
    return {
        "big": rng.standard_normal((1000, 999), dtype=np.float32),  # the same key, another size
        "bytes": rng.integers(0, 255, (1500, 701), dtype=np.uint8),  # the same key and size
        "new": rng.standard_normal((3000, 700), dtype=np.float32),  # a key the other has not
        "norms": [np.full(9, i, np.float32) for i in range(3)],
        "step": 5,
    }


def _tree_files(folder):
    return {os.path.relpath(os.path.join(d, n), folder): _read(os.path.join(d, n))
            for d, _, names in os.walk(folder) for n in names}


@pytest.mark.parametrize("order", ["grow", "shrink"])
def test_a_copy_written_over_a_dropped_copy_is_byte_for_byte_the_new_step_alone(tmp_path, order):
    first, second = str(tmp_path / "owner" / "4"), str(tmp_path / "owner" / "5")
    ckpt.save(first, _tree() if order == "grow" else _other_tree())
    ckpt.save(second, _other_tree() if order == "grow" else _tree())
    root = str(tmp_path / "holder")
    files, out = _copy(first, f"{root}/4.partial-a")
    _commit_folder(f"{root}/4.partial-a", f"{root}/4", {"files": out["files"]})
    assert _peer_copy.keep_spare(root, f"{root}/4") and os.listdir(root) == [_peer_copy.SPARE]
    os.makedirs(f"{root}/3")
    assert not _peer_copy.keep_spare(root, f"{root}/3")  # one spare: the caller deletes the others
    spare = _peer_copy.take_spare(root, f"{root}/5.partial-b")
    assert spare == {f["key"]: f["size"] for f in files}
    # No marker in the partial folder while it is written (a committed partial counts).
    assert not os.path.exists(f"{root}/5.partial-b/COMMITTED") and not os.path.exists(f"{root}/{_peer_copy.SPARE}")
    files, out = _copy(second, f"{root}/5.partial-b", spare=spare)
    assert "error" not in out, out
    got = _tree_files(f"{root}/5.partial-b")
    want = _tree_files(second)
    want["COMMITTED.received"] = want.pop("COMMITTED")
    assert got.keys() == want.keys() and all(got[k] == want[k] for k in want)
    empty = [d for d, sub, names in os.walk(f"{root}/5.partial-b") if not sub and not names]
    assert not empty  # the dropped step's folders the new one has not are gone
    assert _peer_copy.take_spare(root, f"{root}/6.partial-c") is None and not os.path.exists(f"{root}/6.partial-c")
