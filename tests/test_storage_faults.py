"""Storage faults. A save that fails (disk full, permission denied, read-only file
system, a path that is a file) raises SaveError (an OSError) saying what and where,
commits nothing, removes its partial folder where it can and leaves older committed
checkpoints restorable. Damaged files on restore raise CorruptCheckpointError naming the
leaf and chunk, and verify lists every problem.

Tests run as root, so chmod does not deny anything: permission errors are injected, and
disk full / read-only file systems are also tested for real on small tmpfs mounts (skipped
when mounting is not permitted)."""

import errno
import glob
import json
import os
import shutil
import subprocess
import uuid

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._encoding import _read, _write
from checkpointer._storage import _direct
from checkpointer._storage._local import LocalStorage

# About the per-leaf layout (each leaf its own zarr array and chunk files): small leaves
# are not packed here (tests/test_pack.py covers the packed layout).
pytestmark = pytest.mark.usefixtures("unpacked_layout")


def _tree(value=0.0):
    mesh = make_mesh((2, 4), ("a", "b"))
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + value
    return {"w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))), "b": np.full(4, value, np.float32), "step": int(value)}


def _assert_is(restored, value):
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + value)
    np.testing.assert_array_equal(restored["b"], np.full(4, value, np.float32))
    assert restored["step"] == int(value)


@pytest.fixture
def run_dir(tmp_path):
    """A directory with committed step 1 (values 1.0)."""
    d = str(tmp_path / "run")
    ckpt.save(f"{d}/1", _tree(1.0))
    return d


def _assert_nothing_committed_and_old_intact(run_dir, step, *, partial_left=False):
    names = sorted(os.listdir(run_dir))
    assert str(step) not in names
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.metadata(f"{run_dir}/{step}")
    leftovers = [n for n in names if ".partial-" in n or ".deleting-" in n]
    assert bool(leftovers) == partial_left, names
    for n in leftovers:
        assert not os.path.exists(f"{run_dir}/{n}/COMMITTED")
    _assert_is(ckpt.restore(f"{run_dir}/1"), 1.0)
    assert ckpt.verify(f"{run_dir}/1").ok


# --- fault injection ----------------------------------------------------------------------------


def _os_error(code, path):
    return OSError(code, os.strerror(code), path)


class _FailingWrite:
    def __init__(self, exc):
        self.exc = exc

    def result(self):
        raise self.exc


class _Store:
    """Wraps a TensorStore array so that every chunk write fails with `exc`."""

    def __init__(self, store, exc):
        self._store, self._exc = store, exc

    def __getitem__(self, index):
        exc = self._exc

        class _View:
            def write(self, data, **kwargs):
                return _FailingWrite(exc)

        return _View()


class _Opened:
    def __init__(self, future, exc, on_open):
        self._future, self._exc, self._on_open = future, exc, on_open

    def result(self):
        store = self._future.result()
        if self._on_open:
            raise self._exc
        return _Store(store, self._exc)


def _inject(monkeypatch, where, code):
    """Makes one storage operation of a save fail with OSError(`code`)."""
    if where in ("create_array", "chunk_write"):
        real = _write.open_array
        exc = ValueError(f"{errno.errorcode[code]}: injected: {os.strerror(code)}") if where == "create_array" else _os_error(code, "chunk")
        monkeypatch.setattr(_write, "open_array", lambda *a, **k: _Opened(real(*a, **k), exc, where == "create_array"))
        if where == "chunk_write":  # direct writes (direct_io="auto" on this file system) fail alike
            monkeypatch.setattr(_direct.DirectFile, "write_at", lambda self, offset, data: (_ for _ in ()).throw(exc))
        return
    method, suffix = {
        "makedirs": ("makedirs", ""),
        "process_record": ("write_file", "processes/0.json"),
        "manifest": ("write_file", "manifest.json"),
        "marker": ("write_file", "COMMITTED"),
        "sync_partial": ("sync_dir", ".partial-"),
        "rename": ("rename", ""),
    }[where]
    real = getattr(LocalStorage, method)

    def failing(self, path, *args):
        if suffix in path or (suffix == ".partial-" and ".partial-" in path.rsplit("/", 1)[-1]):
            raise _os_error(code, path)
        return real(self, path, *args)

    monkeypatch.setattr(LocalStorage, method, failing)


FAULTS = [
    ("makedirs", errno.EACCES, "Permission denied"),
    ("create_array", errno.EACCES, "cannot create the zarr array.*Permission denied"),
    ("chunk_write", errno.ENOSPC, r"leaf \['(w|b)'\].*writing a chunk failed.*No space left"),
    ("process_record", errno.ENOSPC, "No space left"),
    ("manifest", errno.ENOSPC, "committing .*/2 failed.*No space left"),
    ("marker", errno.EIO, "committing .*/2 failed.*Input/output error"),
    ("sync_partial", errno.EIO, "Input/output error"),
    ("rename", errno.EACCES, "committing .*/2 failed.*Permission denied"),
]


@pytest.mark.parametrize("where, code, match", FAULTS, ids=[f[0] for f in FAULTS])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_injected_fault_raises_save_error_and_commits_nothing(run_dir, monkeypatch, where, code, match, mode):
    _inject(monkeypatch, where, code)
    with pytest.raises(ckpt.SaveError, match=match) as e:
        if mode == "sync":
            ckpt.save(f"{run_dir}/2", _tree(2.0))
        else:
            handle = ckpt.save_async(f"{run_dir}/2", _tree(2.0))
            handle.wait()
    assert isinstance(e.value, OSError) and "(process 0)" in str(e.value) and f"{run_dir}/2" in str(e.value)
    monkeypatch.undo()
    _assert_nothing_committed_and_old_intact(run_dir, 2)
    ckpt.save(f"{run_dir}/2", _tree(2.0))  # the same step saves once the fault is gone
    _assert_is(ckpt.restore(f"{run_dir}/2"), 2.0)


def test_failed_cleanup_leaves_an_uncommitted_partial_that_readers_ignore(run_dir, monkeypatch):
    _inject(monkeypatch, "manifest", errno.ENOSPC)
    monkeypatch.setattr(LocalStorage, "delete_tree", lambda self, path: (_ for _ in ()).throw(_os_error(errno.EIO, path)))
    with pytest.raises(ckpt.SaveError, match="No space left"):
        ckpt.save(f"{run_dir}/2", _tree(2.0))
    monkeypatch.undo()
    _assert_nothing_committed_and_old_intact(run_dir, 2, partial_left=True)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="uncommitted save attempts"):
        ckpt.restore(f"{run_dir}/2")


@pytest.mark.parametrize("rename_that_fails", [0, 1])
def test_failed_overwrite_keeps_the_old_checkpoint(run_dir, monkeypatch, rename_that_fails):
    real, calls = LocalStorage.rename, []

    def rename(self, src, dst):
        calls.append((src, dst))
        if len(calls) == rename_that_fails + 1:
            raise _os_error(errno.EACCES, dst)
        return real(self, src, dst)

    monkeypatch.setattr(LocalStorage, "rename", rename)
    with pytest.raises(ckpt.SaveError, match=r"committing .*/1 failed.*Permission denied"):
        ckpt.save(f"{run_dir}/1", _tree(5.0), overwrite=True)
    monkeypatch.undo()
    if rename_that_fails == 1:  # old moved aside, new not moved in: the old was put back
        assert calls[0][0] == f"{run_dir}/1" and ".deleting-" in calls[0][1]
        assert calls[-1] == (calls[0][1], calls[0][0])
    assert sorted(os.listdir(run_dir)) == ["1"]
    _assert_is(ckpt.restore(f"{run_dir}/1"), 1.0)


def test_an_overwrite_whose_old_checkpoint_cannot_be_put_back_keeps_the_new_one_for_recovery(run_dir, monkeypatch):
    # The old step moved aside, the new one not moved in, the old one not put back: the
    # failed save must not remove its (committed) partial folder as well, or recovery,
    # which removes `.deleting-` folders, would leave neither.
    real, calls = LocalStorage.rename, []

    def rename(self, src, dst):
        calls.append((src, dst))
        if len(calls) in (2, 3):
            raise _os_error(errno.EIO, dst)
        return real(self, src, dst)

    monkeypatch.setattr(LocalStorage, "rename", rename)
    with pytest.raises(ckpt.SaveError, match=r"committing .*/1 failed"):
        ckpt.save(f"{run_dir}/1", _tree(5.0), overwrite=True)
    monkeypatch.undo()
    assert len(calls) == 3 and "1" not in os.listdir(run_dir)
    with ckpt.CheckpointManager(run_dir) as mgr:
        mgr.recover()
    names = os.listdir(run_dir)
    assert "1" in names and not [n for n in names if ".partial-" in n or ".deleting-" in n], names
    _assert_is(ckpt.restore(f"{run_dir}/1"), 5.0)


def test_a_failure_after_the_commit_is_not_reported_as_a_failed_save(run_dir, monkeypatch, caplog):
    # Once `<step>/` is in place the checkpoint is committed: failing to fsync the parent
    # or to delete the replaced checkpoint is logged, never a SaveError ("nothing committed").
    monkeypatch.setattr(LocalStorage, "delete_tree", lambda self, path: (_ for _ in ()).throw(_os_error(errno.EIO, path)))
    real_sync = LocalStorage.sync_dir
    monkeypatch.setattr(LocalStorage, "sync_dir", lambda self, p: real_sync(self, p) if ".partial-" in p else (_ for _ in ()).throw(_os_error(errno.EIO, p)))
    ckpt.save(f"{run_dir}/1", _tree(3.0), overwrite=True)
    ckpt.save(f"{run_dir}/2", _tree(2.0))
    monkeypatch.undo()
    _assert_is(ckpt.restore(f"{run_dir}/1"), 3.0)
    _assert_is(ckpt.restore(f"{run_dir}/2"), 2.0)
    assert "committed" in caplog.text and "Input/output error" in caplog.text


# --- paths that cannot be checkpoints ------------------------------------------------------------


def test_path_that_is_a_file(run_dir):
    with open(f"{run_dir}/2", "w") as f:
        f.write("not a checkpoint")
    with pytest.raises(ckpt.SaveError, match=r"cannot save to .*/2 \(process 0\): it exists and is not a folder") as e:
        ckpt.save(f"{run_dir}/2", _tree(2.0))
    assert isinstance(e.value, OSError)
    with open(f"{run_dir}/2") as f:
        assert f.read() == "not a checkpoint"
    assert sorted(os.listdir(run_dir)) == ["1", "2"]
    _assert_is(ckpt.restore(f"{run_dir}/1"), 1.0)


def test_parent_that_is_a_file(run_dir):
    with open(f"{run_dir}/notadir", "w") as f:
        f.write("x")
    with pytest.raises(ckpt.SaveError, match=r"notadir/2\.partial-.*\(process 0\).*Not a directory") as e:
        ckpt.save(f"{run_dir}/notadir/2", _tree(2.0))
    assert isinstance(e.value, OSError)
    assert sorted(os.listdir(run_dir)) == ["1", "notadir"]


def test_save_next_to_a_stale_partial_of_the_same_step(run_dir):
    stale = f"{run_dir}/2.partial-20200101000000-deadbeef"
    shutil.copytree(f"{run_dir}/1", stale)  # even a stale folder with a marker inside
    with open(f"{stale}/arrays/b/c/0", "wb") as f:
        f.write(b"garbage")
    before = {p: os.path.getmtime(p) for p in glob.glob(f"{stale}/**", recursive=True)}
    ckpt.save(f"{run_dir}/2", _tree(2.0))
    _assert_is(ckpt.restore(f"{run_dir}/2"), 2.0)
    assert ckpt.verify(f"{run_dir}/2").ok
    # The stale folder was not reused or touched (garbage collection removes it).
    assert {p: os.path.getmtime(p) for p in glob.glob(f"{stale}/**", recursive=True)} == before
    assert sorted(os.listdir(run_dir)) == ["1", "2", "2.partial-20200101000000-deadbeef"]


# --- real file systems: tmpfs disk full, read-only ---------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_for_real(small_tmpfs):
    run = f"{small_tmpfs}/run"
    ckpt.save(f"{run}/1", _tree(1.0))
    big = {"w": np.ones((3 << 20) // 4, np.float32), "v": np.ones((3 << 20) // 4, np.float32), "x": np.ones((4 << 20) // 4, np.float32)}
    for _attempt in range(2):  # twice: the first failure must have freed its space
        with pytest.raises(ckpt.SaveError, match=r"No space left on device") as e:
            ckpt.save(f"{run}/2", big)
        assert isinstance(e.value, OSError) and f"{run}/2.partial-" in str(e.value) and "(process 0)" in str(e.value)
        _assert_nothing_committed_and_old_intact(run, 2)
    ckpt.save(f"{run}/3", _tree(3.0))  # a save that fits still works
    _assert_is(ckpt.restore(f"{run}/3"), 3.0)


def test_disk_full_in_the_background_surfaces_from_wait(small_tmpfs):
    run = f"{small_tmpfs}/run"
    ckpt.save(f"{run}/1", _tree(1.0))
    handle = ckpt.save_async(f"{run}/2", {"x": np.ones((10 << 20) // 4, np.float32)})
    with pytest.raises(ckpt.SaveError, match="No space left on device"):
        handle.wait()
    assert handle.done()
    _assert_nothing_committed_and_old_intact(run, 2)


def test_read_only_file_system_for_real(small_tmpfs):
    run = f"{small_tmpfs}/run"
    ckpt.save(f"{run}/1", _tree(1.0))
    subprocess.run(["mount", "-o", "remount,ro", small_tmpfs], check=True)
    with pytest.raises(ckpt.SaveError, match=r"Read-only file system") as e:
        ckpt.save(f"{run}/2", _tree(2.0))
    assert isinstance(e.value, OSError) and f"{run}/2" in str(e.value)
    with pytest.raises(ckpt.SaveError, match=r"Read-only file system"):
        ckpt.save(f"{run}/1", _tree(2.0), overwrite=True)
    # Reading needs no write access: restore, metadata and verify work on a read-only mount.
    assert sorted(os.listdir(run)) == ["1"]
    _assert_is(ckpt.restore(f"{run}/1"), 1.0)
    assert ckpt.verify(f"{run}/1").ok and ckpt.metadata(f"{run}/1").step == 1


def test_read_only_directory_for_real(small_tmpfs):
    run = f"{small_tmpfs}/run"
    ckpt.save(f"{run}/1", _tree(1.0))
    res = subprocess.run(["mount", "--bind", "-o", "ro", run, run], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount: {res.stderr.strip()}")
    try:
        with pytest.raises(ckpt.SaveError, match=r"Read-only file system"):
            ckpt.save(f"{run}/2", _tree(2.0))
        ckpt.save(f"{small_tmpfs}/elsewhere/2", _tree(2.0))  # the rest of the file system is writable
    finally:
        subprocess.run(["umount", run], check=False)
    _assert_nothing_committed_and_old_intact(run, 2)


# --- damaged checkpoints on restore ------------------------------------------------------------


def _rd(path):
    with open(path, "rb") as f:
        return f.read()


def _wr(path, data):
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def _chunks(path, leaf="w"):
    return sorted(glob.glob(f"{path}/arrays/{leaf}/c/*/*"))


def _target():
    return {"w": NamedSharding(make_mesh((4,), ("d",)), P("d")), "b": None, "step": None}


@pytest.mark.parametrize(
    "damage",
    ["flip_data", "flip_crc", "flip_index", "flip_index_crc", "truncate", "append", "empty", "directory", "delete"],
)
def test_every_kind_of_chunk_damage_is_caught_and_named(run_dir, damage):
    path = f"{run_dir}/1"
    chunk = _chunks(path)[5]
    key = os.path.relpath(chunk, path)
    data = bytearray(_rd(chunk))
    meta = ckpt.metadata(path).arrays["w"]
    n_inner = int(np.prod([c // i for c, i in zip(meta.chunk_shape, meta.inner_chunk_shape)]))
    n_index = n_inner * 16 + 4
    if damage == "flip_data":
        data[3] ^= 0x01
    elif damage == "flip_crc":
        data[int(np.prod(meta.inner_chunk_shape)) * 4 + 1] ^= 0x80  # the first inner chunk's crc32c
    elif damage == "flip_index":
        data[-n_index + 2] ^= 0x10
    elif damage == "flip_index_crc":
        data[-1] ^= 0xFF
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "append":
        data += b"\0"
    elif damage == "empty":
        data = b""
    os.remove(chunk)
    if damage == "directory":
        os.mkdir(chunk)
    elif damage != "delete":
        with open(chunk, "wb") as f:
            f.write(bytes(data))
    for target in (_target(), None):
        with pytest.raises(ckpt.CorruptCheckpointError, match=rf"leaf \['w'\] in {path}.*chunk {key}") as e:
            ckpt.restore(path, target)
        assert isinstance(e.value, ValueError)
    report = ckpt.verify(path)
    assert not report.ok and len(report.problems) == 1 and key in report.problems[0] and "leaf ['w']" in report.problems[0]


def test_verify_lists_every_damaged_chunk(run_dir):
    path = f"{run_dir}/1"
    chunks = _chunks(path)
    for c in chunks:
        data = bytearray(_rd(c))
        data[0] ^= 0xFF
        _wr(c, bytes(data))
    report = ckpt.verify(path)
    assert len(report.problems) == len(chunks) == 8
    assert sorted(p.split("chunk ")[1].split(":")[0].split(" ")[0] for p in report.problems) == sorted(os.path.relpath(c, path) for c in chunks)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "delete", "not_an_object"])
def test_damaged_manifest(run_dir, damage):
    path = f"{run_dir}/1"
    m = f"{path}/manifest.json"
    raw = _rd(m)
    if damage == "delete":
        os.remove(m)
    else:
        new = {"truncate": raw[: len(raw) // 2], "garbage": os.urandom(64), "empty": b"", "not_an_object": b"[1, 2]"}[damage]
        _wr(m, new)
    for call in (ckpt.metadata, ckpt.restore, ckpt.verify, lambda p: ckpt.restore(p, _target())):
        with pytest.raises(ckpt.CorruptCheckpointError, match=rf"{path}"):
            call(path)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete", "other_dtype"])
def test_damaged_zarr_json(run_dir, damage):
    path = f"{run_dir}/1"
    z = f"{path}/arrays/w/zarr.json"
    raw = _rd(z)
    if damage == "delete":
        os.remove(z)
    elif damage == "other_dtype":  # same item size: decoding with it would reinterpret the bytes
        doc = json.loads(raw)
        doc["data_type"] = "int32"
        _wr(z, json.dumps(doc))
    else:
        _wr(z, raw[: len(raw) // 2] if damage == "truncate" else os.urandom(64))
    # Restore reads float32 chunks by the manifest's layout and checks every crc32c: the
    # data is intact, so it is still restored bit-exact.
    _assert_is(ckpt.restore(path, _target()), 1.0)
    # But the array is no longer readable by TensorStore alone: verify lists every chunk.
    report = ckpt.verify(path)
    assert not report.ok and len(report.problems) == 8
    assert all("leaf ['w']" in p and "arrays/w/c/" in p for p in report.problems)


def test_missing_or_damaged_process_record(run_dir):
    path = f"{run_dir}/1"
    os.remove(f"{path}/processes/0.json")
    _assert_is(ckpt.restore(path), 1.0)  # restore does not need the records
    report = ckpt.verify(path)
    missing, *orphans = report.problems  # the record itself, then each chunk it would have listed
    assert missing.startswith("process record processes/0.json is missing (process 0 of 1; 0 records found)")
    assert len(orphans) == 9 and all("is not in any process record" in p for p in orphans)
    with open(f"{path}/processes/0.json", "w") as f:
        f.write('{"chunks": 5')
    report = ckpt.verify(path)
    assert any("process record 0.json is malformed" in p for p in report.problems)
    with open(f"{path}/processes/0.json", "w") as f:
        json.dump({"chunks": [{"key": "arrays/b/c/0", "data_crc32c": 1}]}, f)
    report = ckpt.verify(path)
    assert any("arrays/b/c/0 decodes to bytes whose crc32c differs" in p for p in report.problems)


def test_missing_commit_marker_is_not_a_checkpoint(run_dir):
    os.remove(f"{run_dir}/1/COMMITTED")
    for call in (ckpt.metadata, ckpt.restore, ckpt.verify):
        with pytest.raises(ckpt.CheckpointNotFoundError, match="commit marker"):
            call(f"{run_dir}/1")


@pytest.mark.parametrize("where, code", [("open", errno.EACCES), ("read", errno.EIO)])
def test_read_faults_on_restore_name_the_leaf_and_chunk(run_dir, monkeypatch, where, code):
    path = f"{run_dir}/1"
    target_file = f"{path}/arrays/w/c/1/2"
    real_open, real_read = os.open, _read._ChunkFile.read

    def fake_open(p, *a, **k):
        if os.fspath(p) == target_file and where == "open":
            raise _os_error(code, p)
        return real_open(p, *a, **k)

    def fake_read(self, offset, n):
        if self.location == target_file and where == "read":
            raise _os_error(code, target_file)
        return real_read(self, offset, n)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(_read._ChunkFile, "read", fake_read)
    with pytest.raises(ckpt.CorruptCheckpointError, match=rf"leaf \['w'\] in {path}.*c/1/2.*{os.strerror(code)}") as e:
        ckpt.restore(path, _target())
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == code
