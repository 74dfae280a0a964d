"""The step catalog of object stores: listing in O(steps), the marker still the truth.

Runs on `memory://` and on S3 (a moto server, see tests/s3server.py); on POSIX nothing of
the catalog is written.
"""

import uuid

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._cli import _main as _cli
from checkpointer._commit import _catalog, _directory
from checkpointer._commit._publish import Commit
from checkpointer._errors import SaveError
from checkpointer._format import _layout as _format
from checkpointer._storage._kvstore import KvStorage, storage_for


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (dev extra)")
    pytest.importorskip("boto3", reason="the S3 tests need boto3 (dev extra)")
    from s3server import running_s3_server

    with running_s3_server() as server:
        yield server


@pytest.fixture(params=["memory", "s3"])
def run_dir(request):
    if request.param == "memory":
        return f"memory://catalog-{uuid.uuid4().hex[:8]}/run"
    s3 = request.getfixturevalue("s3")
    return f"s3://{s3.new_bucket('catalog')}/run"  # moto buckets are process-wide: own names


def _state(value):
    mesh = make_mesh((2, 4), ("data", "model"))
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + value
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))), "step": int(value)}


def _truth(storage, directory):
    """Committed steps by the full listing and the markers (what the catalog must equal)."""
    return sorted({e.step for e in _directory.entries(storage, directory) if e.committed and e.generation is None})


def _entries(storage, directory):
    return _catalog.catalog_steps(storage, directory, complete_only=False)


@pytest.fixture
def listed(monkeypatch):
    """Every folder the library lists (list_dir / list_files), in order."""
    paths = []
    real_dir, real_files = KvStorage.list_dir, KvStorage.list_files
    monkeypatch.setattr(KvStorage, "list_dir", lambda self, p: paths.append(p) or real_dir(self, p))
    monkeypatch.setattr(KvStorage, "list_files", lambda self, p: paths.append(p) or real_files(self, p))
    return paths


def test_steps_are_listed_through_the_catalog_and_equal_the_markers(run_dir, listed):
    with ckpt.CheckpointManager(run_dir, keep=ckpt.KeepLatest(3), async_save=False) as mgr:
        for step in (1, 2, 5, 10, 11):
            mgr.save(step, _state(step))
        storage, directory = mgr.storage, mgr.directory
        assert _entries(storage, directory) == [5, 10, 11]  # retention removed the others' entries
        listed.clear()
        assert mgr.all_steps() == [5, 10, 11] == _truth(storage, directory)
        assert mgr.latest_step() == 11
    # The readers listed the catalog prefix alone, never the run directory.
    assert set(listed[: listed.index(directory)]) == {f"{directory}/{_catalog.CATALOG}"}
    restored = ckpt.CheckpointManager(run_dir).restore()
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + 11)


def test_the_entry_is_written_before_the_marker_so_no_commit_lacks_one(run_dir, monkeypatch):
    _, directory = storage_for(run_dir)
    writes = []
    real = KvStorage.write_file
    monkeypatch.setattr(KvStorage, "write_file", lambda self, p, d: writes.append(p) or real(self, p, d))
    with ckpt.CheckpointManager(run_dir, async_save=False) as mgr:
        mgr.save(7, _state(7))
    entry, marker = f"{directory}/{_catalog.CATALOG}/7", f"{directory}/7/{_format.COMMITTED}"
    assert writes.index(entry) < writes.index(marker)


def test_a_crash_between_entry_and_marker_lists_nothing_and_repair_keeps_the_rest(run_dir, monkeypatch):
    with ckpt.CheckpointManager(run_dir, async_save=False) as mgr:
        mgr.save(1, _state(1))
        real_publish = Commit._publish

        def crash(commit, manifest, process_bytes, marker):
            raise SaveError("simulated crash after the catalog entry, before the marker")

        monkeypatch.setattr(Commit, "_publish", crash)
        with pytest.raises(SaveError, match="simulated crash"):
            mgr.save(2, _state(2))
        monkeypatch.setattr(Commit, "_publish", real_publish)
        storage, directory = mgr.storage, mgr.directory
        assert _entries(storage, directory) == [1, 2]  # an entry without marker ...
        assert mgr.all_steps() == [1] == _truth(storage, directory)  # ... is ignored
        mgr.save(3, _state(3))
        assert mgr.all_steps() == [1, 3]
    # A new writer keeps the entry while the crashed save's objects are there (it may be
    # a save in flight); once they are gone, its repair removes the entry.
    assert _directory.repair(storage, directory) == ([], [])
    storage.delete_tree(f"{directory}/2")
    assert _directory.repair(storage, directory) == ([], [2])
    assert _entries(storage, directory) == [1, 3] and ckpt.CheckpointManager(run_dir).all_steps() == [1, 3]


def test_an_entry_without_marker_is_ignored(run_dir):
    with ckpt.CheckpointManager(run_dir, async_save=False) as mgr:
        mgr.save(4, _state(4))
        storage, directory = mgr.storage, mgr.directory
        storage.write_file(f"{directory}/{_catalog.CATALOG}/99", b'{"step": 99}')
        storage.write_file(f"{directory}/{_catalog.CATALOG}/007", b"{}")  # not a canonical step name
        storage.delete_file(f"{directory}/4/{_format.COMMITTED}")  # and a step that lost its marker
        assert mgr.all_steps() == [] == _truth(storage, directory)
        assert mgr.latest_step() is None


def test_a_committed_step_without_entry_is_listed_again_once_the_writer_repairs(run_dir):
    # No save of this release commits without an entry; a writer of an earlier release
    # (or a hand-deleted entry) does. The next writer (its first save or `recover()`, or
    # `checkpointer gc`) repairs.
    with ckpt.CheckpointManager(run_dir, async_save=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        storage, directory = mgr.storage, mgr.directory
    storage.delete_file(f"{directory}/{_catalog.CATALOG}/2")
    with ckpt.CheckpointManager(run_dir, read_only=True) as reader:
        assert reader.all_steps() == [1]  # readers never repair
    with ckpt.CheckpointManager(run_dir) as mgr:
        mgr.recover()
        assert mgr.all_steps() == [1, 2] == _truth(storage, directory)
    assert _entries(storage, directory) == [1, 2]
    storage.delete_file(f"{directory}/{_catalog.CATALOG}/2")
    assert _cli.main(["gc", run_dir]) == 0
    assert _entries(storage, directory) == [1, 2]


def test_a_directory_without_catalog_falls_back_to_the_full_listing(run_dir, listed):
    # Checkpoints saved without a manager (or by an earlier release): no catalog.
    for step in (3, 30):
        ckpt.save(f"{run_dir}/{step}", _state(step))
    storage, directory = storage_for(run_dir)
    assert _entries(storage, directory) == []
    listed.clear()
    assert _directory.committed_steps(storage, directory) == [3, 30]
    assert directory in listed  # the full listing
    # The writer builds the catalog from that listing with its clean-up (first save or recover()).
    with ckpt.CheckpointManager(run_dir, async_save=False) as mgr:
        assert _entries(storage, directory) == []  # opening a manager writes nothing
        mgr.recover()
        assert _entries(storage, directory) == [3, 30]
        assert storage.exists(f"{directory}/{_catalog.CATALOG}/{_catalog.HEADER}")
        listed.clear()
        assert mgr.all_steps() == [3, 30]
        assert directory not in listed
    # A catalog whose header is missing (a repair that did not finish) is not trusted.
    storage.delete_file(f"{directory}/{_catalog.CATALOG}/{_catalog.HEADER}")
    storage.delete_file(f"{directory}/{_catalog.CATALOG}/30")
    assert _directory.committed_steps(storage, directory) == [3, 30]


def test_saves_into_a_catalogued_directory_without_the_manager_are_entered(run_dir):
    with ckpt.CheckpointManager(run_dir) as mgr:
        mgr.recover()  # the writer's clean-up creates the catalog
    ckpt.save(f"{run_dir}/8", _state(8))
    ckpt.save(f"{run_dir}/elsewhere", _state(9))  # not a step name: no entry
    storage, directory = storage_for(run_dir)
    assert _entries(storage, directory) == [8]
    assert _directory.committed_steps(storage, directory) == [8]


def test_retention_removes_the_entry_after_the_marker_and_before_the_objects(run_dir, monkeypatch):
    events = []
    real_delete_file, real_delete_tree = KvStorage.delete_file, KvStorage.delete_tree
    monkeypatch.setattr(KvStorage, "delete_file", lambda self, p: events.append(("file", p)) or real_delete_file(self, p))
    monkeypatch.setattr(KvStorage, "delete_tree", lambda self, p: events.append(("tree", p)) or real_delete_tree(self, p))
    with ckpt.CheckpointManager(run_dir, keep=ckpt.KeepLatest(1), async_save=False) as mgr:
        mgr.save(1, _state(1))
        events.clear()
        mgr.save(2, _state(2))
        storage, directory = mgr.storage, mgr.directory
    step1 = [e for e in events if e[1].startswith(f"{directory}/1") or e[1] == f"{directory}/{_catalog.CATALOG}/1"]
    assert step1 == [
        ("file", f"{directory}/1/{_format.COMMITTED}"),
        ("file", f"{directory}/{_catalog.CATALOG}/1"),
        ("tree", f"{directory}/1"),
    ]
    assert _entries(storage, directory) == [2] and _truth(storage, directory) == [2]


def test_a_failed_entry_write_commits_nothing(run_dir, monkeypatch):
    with ckpt.CheckpointManager(run_dir, async_save=False) as mgr:
        storage, directory = mgr.storage, mgr.directory
        real = KvStorage.write_file

        def failing(self, path, data):
            if f"/{_catalog.CATALOG}/" in path and not path.endswith(_catalog.HEADER):
                raise ValueError("simulated: service unavailable")
            return real(self, path, data)

        monkeypatch.setattr(KvStorage, "write_file", failing)
        with pytest.raises(SaveError, match="step catalog"):
            mgr.save(5, _state(5))
        assert not storage.exists(f"{directory}/5/{_format.COMMITTED}")
        assert mgr.all_steps() == []


def test_posix_directories_keep_no_catalog(tmp_path):
    with ckpt.CheckpointManager(str(tmp_path / "run"), async_save=False) as mgr:
        mgr.save(1, _state(1))
        assert mgr.all_steps() == [1]
    assert not (tmp_path / "run" / _catalog.CATALOG).exists()
