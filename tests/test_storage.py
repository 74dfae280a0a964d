"""Storage conformance: every backend keeps the same contract, as zarr-python's `StoreTests`.

`StorageTests` checks every method and capability of a `Storage` on a fresh location;
the subclasses run it against local files, `memory://`, S3 (the moto server of
`tests/s3server.py`) and GCS (fake-gcs-server, `tests/gcsserver.py`); a server that
cannot start skips its class, and fails it under `CI=true`. A capability a backend lacks must fail loudly (rename, locks) or
answer "unknown" (None), never pretend.
"""

import errno
import os
import time
import uuid

import numpy as np
import pytest
import tensorstore as ts

from checkpointer._commit._strategies import MarkerCommit, RenameCommit, strategy_for
from checkpointer._errors import CheckpointExistsError, LockHeldError
from checkpointer._format import _layout as _format
from checkpointer._storage._contract import FileLock
from checkpointer._storage._kvstore import KvStorage, storage_for, ts_context
from checkpointer._storage._local import LocalStorage


class StorageTests:
    """The contract of `Storage`. A subclass sets the expected capabilities and
    provides the `location` fixture: `(storage, root)` of a fresh, empty folder."""

    storage_class: type
    supports_rename: bool
    supports_locks: bool
    has_folders: bool
    cheap_size: bool
    commit_class: type

    # --- capabilities ----------------------------------------------------------------

    def test_capabilities(self, location):
        storage, _ = location
        assert type(storage) is self.storage_class
        assert storage.supports_rename is self.supports_rename
        assert storage.supports_locks is self.supports_locks
        assert storage.has_folders is self.has_folders
        assert storage.cheap_size is self.cheap_size
        assert type(strategy_for(storage)) is self.commit_class
        assert strategy_for(storage).storage is storage

    # --- small files -----------------------------------------------------------------

    def test_write_then_read(self, location):
        storage, root = location
        storage.makedirs(f"{root}/a")
        storage.write_file(f"{root}/a/x.json", b'{"k": 1}')
        assert storage.read_file(f"{root}/a/x.json") == b'{"k": 1}'
        storage.write_file(f"{root}/a/x.json", b"shorter")
        assert storage.read_file(f"{root}/a/x.json") == b"shorter"

    def test_empty_file(self, location):
        storage, root = location
        storage.write_file(f"{root}/empty", b"")
        assert storage.read_file(f"{root}/empty") == b""
        assert storage.exists(f"{root}/empty")
        assert storage.size(f"{root}/empty") == 0

    def test_read_missing_file_raises_file_not_found(self, location):
        storage, root = location
        with pytest.raises(FileNotFoundError):
            storage.read_file(f"{root}/missing")
        with pytest.raises(FileNotFoundError):
            storage.read_range(f"{root}/missing", 0, 1)
        with pytest.raises(FileNotFoundError):
            storage.size(f"{root}/missing")

    def test_read_file_with_max_bytes(self, location):
        storage, root = location
        storage.write_file(f"{root}/f", b"0123456789")
        assert storage.read_file(f"{root}/f", max_bytes=10) == b"0123456789"
        with pytest.raises(OSError) as e:
            storage.read_file(f"{root}/f", max_bytes=9)
        assert e.value.errno == errno.EFBIG

    def test_read_range(self, location):
        storage, root = location
        storage.write_file(f"{root}/f", b"0123456789")
        assert storage.read_range(f"{root}/f", 0, 3) == b"012"
        assert storage.read_range(f"{root}/f", 4, 3) == b"456"
        assert storage.read_range(f"{root}/f", 7, 10) == b"789"  # the file ends first
        assert storage.read_range(f"{root}/f", 12, 3) == b""

    def test_exists_is_for_files_only(self, location):
        storage, root = location
        storage.makedirs(f"{root}/d")
        storage.write_file(f"{root}/d/f", b"x")
        assert storage.exists(f"{root}/d/f")
        assert not storage.exists(f"{root}/d")
        assert not storage.exists(f"{root}/d/missing")

    def test_is_folder(self, location):
        storage, root = location
        storage.makedirs(f"{root}/d/e")
        storage.write_file(f"{root}/d/e/f", b"x")
        assert storage.is_folder(f"{root}/d")
        assert storage.is_folder(f"{root}/d/e")
        assert not storage.is_folder(f"{root}/d/e/f")
        assert not storage.is_folder(f"{root}/missing")

    def test_size(self, location):
        storage, root = location
        storage.makedirs(f"{root}/d")
        storage.write_file(f"{root}/d/f", b"x" * 1234)
        assert storage.size(f"{root}/d/f") == 1234
        with pytest.raises(IsADirectoryError):
            storage.size(f"{root}/d")

    # --- listing and deletion --------------------------------------------------------

    def _tree(self, storage, root):
        """Files a, d/b, d/e/c and a sibling folder dd/ whose name extends d."""
        for folder in ("d/e", "dd"):
            storage.makedirs(f"{root}/{folder}")
        for name in ("a", "d/b", "d/e/c", "dd/x"):
            storage.write_file(f"{root}/{name}", name.encode())

    def test_list_dir(self, location):
        storage, root = location
        self._tree(storage, root)
        assert storage.list_dir(root) == ["a", "d", "dd"]
        assert storage.list_dir(f"{root}/d") == ["b", "e"]
        assert storage.list_dir(f"{root}/missing") == []

    def test_list_files(self, location):
        storage, root = location
        self._tree(storage, root)
        assert storage.list_files(root) == ["a", "d/b", "d/e/c", "dd/x"]
        assert storage.list_files(f"{root}/d") == ["b", "e/c"]
        assert storage.list_files(f"{root}/missing") == []

    def test_delete_tree_removes_the_folder_and_nothing_beside_it(self, location):
        storage, root = location
        self._tree(storage, root)
        storage.delete_tree(f"{root}/d")
        assert storage.list_files(root) == ["a", "dd/x"]
        assert not storage.is_folder(f"{root}/d")
        storage.delete_tree(f"{root}/d")  # absent: no error

    def test_delete_file(self, location):
        storage, root = location
        self._tree(storage, root)
        storage.delete_file(f"{root}/d/b")
        assert not storage.exists(f"{root}/d/b")
        assert storage.list_files(f"{root}/d") == ["e/c"]
        storage.delete_file(f"{root}/d/b")  # absent: no error

    def test_folder_bytes_and_modified_time(self, location):
        storage, root = location
        self._tree(storage, root)
        size = storage.folder_bytes(f"{root}/d")
        assert size is None or size == len(b"d/b") + len(b"d/e/c")
        mtime = storage.modified_unix_s(f"{root}/d")
        assert mtime is None or abs(mtime - time.time()) < 3600
        assert storage.modified_unix_s(f"{root}/missing") is None

    def test_makedirs_is_idempotent(self, location):
        storage, root = location
        storage.makedirs(f"{root}/p/q")
        storage.makedirs(f"{root}/p/q")
        storage.write_file(f"{root}/p/q/f", b"x")
        assert storage.list_files(f"{root}/p") == ["q/f"]

    # --- ranged reader ---------------------------------------------------------------

    def test_open_reader(self, location):
        storage, root = location
        data = bytes(range(256)) * 64
        storage.write_file(f"{root}/chunk", data)
        with storage.open_reader(f"{root}/chunk") as r:
            assert r.size() in (len(data), None)
            assert r.read(0, 16) == data[:16]
            assert r.read(1000, 3000) == data[1000:4000]
            out = np.zeros(512, np.uint8)
            r.read_into(len(data) - 512, memoryview(out))
            assert out.tobytes() == data[-512:]
            buf = bytearray(5)
            r.read_into(7, buf)
            assert bytes(buf) == data[7:12]
            assert r.read(0, 0) == b""
            with pytest.raises(EOFError):
                r.read(len(data) - 4, 8)
        r.close()  # idempotent

    def test_open_reader_of_a_missing_file_raises_file_not_found(self, location):
        storage, root = location
        with pytest.raises(FileNotFoundError), storage.open_reader(f"{root}/missing") as r:  # at open or first read
            r.read(0, 1)

    def test_kvstore_spec_addresses_the_same_files(self, location):
        storage, root = location
        storage.makedirs(f"{root}/arr")
        kv = ts.KvStore.open(storage.kvstore_spec(f"{root}/arr"), context=ts_context()).result()
        kv.write("k/0", b"through tensorstore").result()
        assert storage.read_file(f"{root}/arr/k/0") == b"through tensorstore"
        storage.write_file(f"{root}/arr/mine", b"through storage")
        assert kv.read("mine").result().value == b"through storage"

    # --- locks -----------------------------------------------------------------------

    def test_locks(self, location):
        storage, root = location
        path = f"{root}/.lock"
        if not self.supports_locks:
            with pytest.raises(NotImplementedError):
                storage.lock(path)
            assert storage.lock_holder(path) is None
            return
        assert storage.lock_holder(path) is None
        lock = storage.lock(path, wait=False, holder="pid 1 on test")
        assert storage.lock_holder(path) == "pid 1 on test"
        with pytest.raises(LockHeldError) as e:
            storage.lock(path, wait=False)
        assert e.value.holder == "pid 1 on test" and isinstance(e.value, BlockingIOError)
        lock.release()
        lock.release()  # idempotent
        assert storage.lock_holder(path) is None
        assert storage.exists(path)  # a plain release keeps the file (and its note)
        again = storage.lock(path)
        assert storage.lock_holder(path) == "pid 1 on test"
        again.release(remove=True)
        assert not storage.exists(path)
        quiet = storage.lock(f"{root}/save.lock")  # no note: a save lock
        assert storage.lock_holder(f"{root}/save.lock") == "unknown holder"
        quiet.release(remove=True)


    # --- rename and the commit strategy ----------------------------------------------

    def test_rename(self, location):
        storage, root = location
        storage.makedirs(f"{root}/src")
        storage.write_file(f"{root}/src/f", b"x")
        if not self.supports_rename:
            with pytest.raises(NotImplementedError):
                storage.rename(f"{root}/src", f"{root}/dst")
            return
        storage.rename(f"{root}/src", f"{root}/dst")
        storage.sync_dir(root)
        assert storage.list_dir(root) == ["dst"]
        assert storage.read_file(f"{root}/dst/f") == b"x"

    def _save(self, storage, path, generation, files, *, overwrite=False):
        """A save as `_save` runs it: write, mark, publish, finish."""
        strategy = strategy_for(storage)
        strategy.prepare_overwrite(path)
        write = strategy.write_path(path, generation)
        storage.makedirs(write)
        for name, data in files.items():
            storage.write_file(f"{write}/{name}", data)
        storage.write_file(f"{write}/{_format.COMMITTED}", generation.encode())
        replaced = strategy.publish(write, path, generation, overwrite=overwrite)
        strategy.finish_publish(path, replaced)

    def test_commit_publishes_under_the_final_name(self, location):
        storage, root = location
        strategy = strategy_for(storage)
        path = f"{root}/7"
        assert (strategy.write_path(path, "g1") == path) is strategy.writes_in_place
        assert not strategy.target_blocked(path)
        self._save(storage, path, "g1", {"a": b"1"})
        assert storage.list_dir(root) == ["7"]
        assert sorted(storage.list_files(path)) == sorted(["a", _format.COMMITTED])

    def test_commit_replaces_an_old_step(self, location):
        storage, root = location
        path = f"{root}/7"
        self._save(storage, path, "g1", {"a": b"old", "old-only": b"x"})
        self._save(storage, path, "g2", {"a": b"new"}, overwrite=True)
        assert storage.list_dir(root) == ["7"]  # no partial or deleting folder left
        assert storage.read_file(f"{path}/a") == b"new"
        assert not storage.exists(f"{path}/old-only")
        assert storage.read_file(f"{path}/{_format.COMMITTED}") == b"g2"

    def test_unpublish_then_delete(self, location):
        storage, root = location
        path = f"{root}/7"
        self._save(storage, path, "g1", {"a": b"1"})
        left = strategy_for(storage).unpublish(path)
        assert not storage.exists(f"{path}/{_format.COMMITTED}")
        storage.delete_tree(left)
        assert storage.list_files(root) == []

    def test_discard_path_of_a_failed_save(self, location):
        storage, root = location
        strategy = strategy_for(storage)
        folder = strategy.discard_path(f"{root}/7", "g1")
        # Only a private write folder is removed at once; a save under the final name
        # leaves its objects to recovery.
        assert folder == (None if strategy.writes_in_place else strategy.write_path(f"{root}/7", "g1"))


class TestLocalStorage(StorageTests):
    storage_class = LocalStorage
    supports_rename = supports_locks = has_folders = cheap_size = True
    commit_class = RenameCommit

    @pytest.fixture
    def location(self, tmp_path):
        storage, root = storage_for(tmp_path / "root")
        storage.makedirs(root)
        return storage, root

    def test_file_url(self, tmp_path):
        storage, root = storage_for(f"file://{tmp_path}/x")
        assert isinstance(storage, LocalStorage) and root == f"{tmp_path}/x"

    def test_makedirs_over_a_file(self, location):
        storage, root = location
        storage.write_file(f"{root}/f", b"x")
        with pytest.raises(NotADirectoryError):
            storage.makedirs(f"{root}/f")

    def test_delete_tree_of_a_symlink_removes_the_link_only(self, location, tmp_path):
        storage, root = location
        (tmp_path / "archive").mkdir()
        (tmp_path / "archive" / "f").write_bytes(b"x")
        os.symlink(tmp_path / "archive", f"{root}/7")
        storage.delete_tree(f"{root}/7")
        assert not os.path.lexists(f"{root}/7") and (tmp_path / "archive" / "f").read_bytes() == b"x"

    def test_a_file_blocks_a_rename_commit(self, location):
        storage, root = location
        storage.write_file(f"{root}/7", b"not a checkpoint")
        os.symlink(f"{root}/nowhere", f"{root}/8")
        assert strategy_for(storage).target_blocked(f"{root}/7")
        assert strategy_for(storage).target_blocked(f"{root}/8")

    def test_rename_commit_refuses_a_step_committed_meanwhile(self, location):
        storage, root = location
        path = f"{root}/7"
        self._save(storage, path, "g1", {"a": b"1"})
        with pytest.raises(CheckpointExistsError):
            self._save(storage, path, "g2", {"a": b"2"})
        assert storage.read_file(f"{path}/a") == b"1"

    def test_lock_is_held_across_processes(self, location):
        """The lock of a child process blocks this one, and dies with the child."""
        import subprocess
        import sys

        _, root = location
        path = f"{root}/.lock"
        code = (
            "import sys; from checkpointer._storage import FileLock; "
            f"FileLock.acquire({path!r}, holder='child'); print('locked', flush=True); sys.stdin.read()"
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) as child:
            try:
                assert child.stdout.readline().strip() == b"locked"
                assert FileLock.holder(path) == "child"
                with pytest.raises(LockHeldError, match="child"):
                    FileLock.acquire(path, wait=False)
            finally:
                child.stdin.close()  # the child returns from stdin.read() and exits
                child.wait(60)
        assert FileLock.holder(path) is None
        FileLock.acquire(path, wait=False).release()


class TestMemoryStorage(StorageTests):
    storage_class = KvStorage
    supports_rename = supports_locks = has_folders = cheap_size = False
    commit_class = MarkerCommit

    @pytest.fixture
    def location(self):
        return storage_for(f"memory://storage-tests-{uuid.uuid4().hex}")

    def test_a_path_outside_the_store_is_refused(self, location):
        from checkpointer._errors import CheckpointError

        storage, _ = location
        with pytest.raises(CheckpointError, match="is not under memory://"):
            storage.read_file("s3://elsewhere/x")


class TestS3Storage(StorageTests):
    storage_class = KvStorage
    supports_rename = supports_locks = has_folders = cheap_size = False
    commit_class = MarkerCommit

    @pytest.fixture(scope="class")
    def s3(self):
        from gcsserver import started_or_skipped
        from s3server import running_s3_server

        with started_or_skipped(running_s3_server) as server:
            yield server

    @pytest.fixture
    def location(self, s3):
        return storage_for(f"s3://{s3.new_bucket('storage')}/run")

    def test_objects_land_under_their_keys(self, location, s3):
        storage, root = location
        assert storage.kvstore_spec(root)["driver"] == "s3"
        storage.write_file(f"{root}/d/f", b"x")
        bucket = root.split("/")[2]
        assert s3.keys(bucket) == ["run/d/f"]


class TestGcsStorage(StorageTests):
    storage_class = KvStorage
    supports_rename = supports_locks = has_folders = cheap_size = False
    commit_class = MarkerCommit

    @pytest.fixture(scope="class")
    def gcs(self):
        from gcsserver import running_gcs_server, started_or_skipped

        with started_or_skipped(running_gcs_server) as server:
            yield server

    @pytest.fixture
    def location(self, gcs):
        return storage_for(f"gs://{gcs.new_bucket('storage')}/run")

    def test_objects_land_under_their_keys(self, location, gcs):
        storage, root = location
        assert storage.kvstore_spec(root)["driver"] == "gcs"
        storage.write_file(f"{root}/d/f", b"x")
        bucket = root.split("/")[2]
        assert gcs.keys(bucket) == ["run/d/f"]


def test_an_object_store_server_that_cannot_start_fails_under_ci_and_skips_elsewhere(monkeypatch):
    from gcsserver import started_or_skipped

    def broken():
        raise RuntimeError("fake-gcs-server exited with 1")

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"did not start under CI=true: RuntimeError: fake-gcs-server exited"):
        with started_or_skipped(broken):
            pass
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="did not start"):
        with started_or_skipped(broken):
            pass
