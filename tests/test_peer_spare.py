"""A holder's spare (`_peer_copy.keep_spare`/`take_spare`) attacked through the put
service itself (`PeerService._handle_put`, one process, two services on a loopback
socket): copies of changing layouts written over the spare, a put that fails half way
over it, a put of a step held already under another save (a rewind)."""

import errno
import os
import shutil
import threading

import numpy as np
import pytest
import test_tier_schedules

import checkpointer as ckpt
from checkpointer import _format
from checkpointer._manage import _mesh_restart, _peer_copy, _tiers
from checkpointer._manage._peers import PeerService, step_files
from checkpointer._storage import LocalStorage

small_tmpfs = test_tier_schedules.small_tmpfs  # the fixture: a 1 MiB tmpfs (skipped where mounting is not allowed)


def _tree(kind, step):
    rng = np.random.default_rng(step)
    if kind == "wide":  # many leaves, a sharded 2-d one, packed small leaves
        return {"a": rng.standard_normal((512, 300), dtype=np.float32),
                "b": {"x": rng.integers(0, 255, (700, 33), dtype=np.uint8), "y": rng.standard_normal(999).astype(np.float16)},
                "norms": [np.full(7, i, np.float32) for i in range(6)], "step": step}
    if kind == "narrow":  # fewer leaves, one of the same name and another shape, new names
        return {"a": rng.standard_normal(77, dtype=np.float32), "z": rng.standard_normal((40, 40), dtype=np.float32),
                "step": step}
    assert kind == "deep"  # "a" a folder of leaves where it was one leaf
    return {"a": {"p": rng.standard_normal((64, 64), dtype=np.float32), "q": np.float64(step)},
            "b": {"x": rng.integers(0, 255, (700, 33), dtype=np.uint8)}, "step": step}


def _files(folder):
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), folder)] = f.read()
    return out


@pytest.fixture
def pair(tmp_path):
    """(owner, holder): the owner's steps are a two-tier manager's local steps (their
    markers local, as a restart reads them); its puts go to the holder's server."""
    mngr = ckpt.CheckpointManager(str(tmp_path / "dir"), local_directory=str(tmp_path / "o"), async_save=False,
                                  keep=ckpt.KeepLatest(100), keep_local=ckpt.KeepLatest(1))
    holder = PeerService(str(tmp_path / "h" / "process-1"), str(tmp_path / "dir"), copies=1, node="b", timeout_s=30)
    owner = PeerService(mngr._tiers.root, str(tmp_path / "dir"), copies=1, node="a", timeout_s=30)
    owner._addresses[1] = holder._address  # the owner (process 0 here) sends to the holder's server
    owner.mngr = mngr
    try:
        yield owner, holder
    finally:
        owner.close()
        holder.close()
        mngr.close()


def _put(owner, step, tree, keep, force=False):
    """Saves `step` on the owner's local tier and puts it to the holder; its folder."""
    owner.mngr.save(step, tree, force=force)
    folder = f"{owner.local_root}/{step}"
    owner._put(1, step, owner.mngr._tiers.tier.generation(step), step_files(folder), keep)
    return folder


def _assert_held_exactly(holder, step, folder, tree):
    held = holder.held(0)
    copy = f"{held.root}/{step}"
    got, want = _files(copy), _files(folder)
    assert got.pop(_peer_copy.COPY_RECORD)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))  # no file of the dropped step left behind
    assert all(got[k] == want[k] for k in want)
    assert not [d for d, sub, names in os.walk(copy) if not sub and not names]  # no empty folder of it either
    report = ckpt.verify(copy)
    assert report.ok, report.problems
    restored = ckpt.restore(copy)
    np.testing.assert_array_equal(np.asarray(restored["step"]), tree["step"])


def test_copies_of_changing_layouts_over_the_spare_hold_the_new_step_alone(pair):
    owner, holder = pair
    held = holder.held(0)
    kinds = ["wide", "narrow", "deep", "wide", "deep", "narrow", "narrow"]
    for step, kind in enumerate(kinds, start=1):
        tree = _tree(kind, step)
        folder = _put(owner, step, tree, [step])
        _assert_held_exactly(holder, step, folder, tree)
        assert held.steps() == [step]
        assert sorted(os.listdir(held.root)) == ([str(step)] if step == 1 else [str(step), _peer_copy.SPARE])
        # The spare is never a share a restart would read, nor a step of the inventory.
        shares = _mesh_restart.visible_shares(holder.local_root, "b", 1, None)
        assert [(s.owner, s.step) for s in shares] == [(0, step)]
        assert {o: list(h) for o, h in holder.inventory({}, None)["held"].items()} == {"0": [str(step)]}


@pytest.mark.parametrize("at", ["first", "middle", "marker"])
def test_a_put_that_fails_half_way_over_the_spare_lists_nothing_new_and_the_next_put_is_whole(pair, monkeypatch, at):
    owner, holder = pair
    held = holder.held(0)
    _put(owner, 1, _tree("wide", 1), [1])
    _put(owner, 2, _tree("deep", 2), [2])  # step 1 becomes the spare
    assert _peer_copy.SPARE in os.listdir(held.root)
    calls = {"n": 0, "failed": False}
    real = _peer_copy._CopyFile.write_at

    def failing(self, offset, view, n):
        calls["n"] += 1
        if {"first": calls["n"] == 1, "middle": calls["n"] == 4, "marker": self.path.endswith(".received")}[at]:
            calls["failed"] = True
            raise OSError(errno.EIO, "injected: the holder's disk failed")
        return real(self, offset, view, n)

    monkeypatch.setattr(_peer_copy._CopyFile, "write_at", failing)
    with pytest.raises(ckpt.CheckpointError, match="injected"):
        _put(owner, 3, _tree("narrow", 3), [3])
    monkeypatch.undo()
    assert calls["failed"]
    # The half-written spare counts as nothing: the older copy is kept and listed alone.
    assert held.steps() == [2] and sorted(os.listdir(held.root)) == ["2"]
    assert [(s.owner, s.step) for s in _mesh_restart.visible_shares(holder.local_root, "b", 1, None)] == [(0, 2)]
    tree = _tree("wide", 4)
    folder = _put(owner, 4, tree, [4])
    _assert_held_exactly(holder, 4, folder, tree)
    assert held.steps() == [4]


def test_a_holder_that_dies_half_way_over_the_spare_lists_no_step_of_it(pair, monkeypatch, tmp_path):
    """A holder killed mid-write over its spare (its partial folder copied as it is at
    that moment, put back after the failed put): the folder that was the spare, with
    some files of the new step over the old one's, is no step for the holder's listing,
    its inventory, a restart's shares; the next put is whole."""
    owner, holder = pair
    held = holder.held(0)
    _put(owner, 1, _tree("wide", 1), [1])
    _put(owner, 2, _tree("deep", 2), [2])  # step 1 becomes the spare
    real = _peer_copy._CopyFile.write_at
    calls = {"n": 0}
    frozen = str(tmp_path / "frozen")

    def dying(self, offset, view, n):
        calls["n"] += 1
        if calls["n"] == 3:
            (name,) = [n for n in os.listdir(held.root) if n.startswith("3.partial-")]
            shutil.copytree(f"{held.root}/{name}", f"{frozen}/{name}")  # what a kill here leaves
            raise RuntimeError("injected: the holder dies here")
        return real(self, offset, view, n)

    monkeypatch.setattr(_peer_copy._CopyFile, "write_at", dying)
    with pytest.raises(ConnectionError):  # no answer: the connection closes
        _put(owner, 3, _tree("wide", 3), [3])
    monkeypatch.undo()
    for name in os.listdir(frozen):
        shutil.rmtree(f"{held.root}/{name}", ignore_errors=True)
        shutil.copytree(f"{frozen}/{name}", f"{held.root}/{name}")
    left = [n for n in os.listdir(held.root) if n.startswith("3.partial-")]
    assert len(left) == 1 and os.path.exists(f"{held.root}/{left[0]}/manifest.json")  # the spare's files, half new
    assert held.steps() == [2]
    assert [(s.owner, s.step) for s in _mesh_restart.visible_shares(holder.local_root, "b", 1, None)] == [(0, 2)]
    assert {o: list(h) for o, h in holder.inventory({}, None)["held"].items()} == {"0": ["2"]}
    tree = _tree("narrow", 4)
    folder = _put(owner, 4, tree, [4])
    _assert_held_exactly(holder, 4, folder, tree)
    assert held.steps() == [4]


def test_a_put_that_fails_half_way_on_any_error_leaves_no_partial_folder(pair, monkeypatch):
    owner, holder = pair
    held = holder.held(0)
    _put(owner, 1, _tree("wide", 1), [1])
    _put(owner, 2, _tree("wide", 2), [2])  # step 1 becomes the spare: a whole copy's bytes
    real = _peer_copy._CopyFile.write_at
    calls = {"n": 0}

    def failing(self, offset, view, n):
        calls["n"] += 1
        if calls["n"] == 2:
            raise MemoryError("injected: no memory for the holder's next step")
        return real(self, offset, view, n)

    monkeypatch.setattr(_peer_copy._CopyFile, "write_at", failing)
    with pytest.raises((ckpt.CheckpointError, OSError)):
        _put(owner, 3, _tree("wide", 3), [3])
    monkeypatch.undo()
    assert held.steps() == [2]
    # No partial folder (the spare's bytes under a name nothing lists, removes or reuses).
    assert sorted(os.listdir(held.root)) == ["2"]


def test_a_rewound_step_put_again_under_a_new_save_replaces_the_held_one(pair):
    owner, holder = pair
    held = holder.held(0)
    for step in (1, 2, 3):
        _put(owner, step, _tree("wide", step), [step])
    tree = _tree("narrow", 30)
    old = holder.held(0).generation(3)
    folder = _put(owner, 3, tree, [3], force=True)  # another save of step 3
    assert held.generation(3) != old
    assert held.steps() == [3]
    _assert_held_exactly(holder, 3, folder, tree)
    assert held.generation(3) == _tiers.read_marker(LocalStorage(), folder).generation


def test_a_copy_that_fits_beside_the_kept_one_still_fits_with_the_spare_there(tmp_path, small_tmpfs):
    """A 1 MiB memory tier holding one kept copy (~440 KiB) and the spare (~440 KiB):
    the next copy (~440 KiB, other file names) fits, as it did before the spare, because
    the spare's files the copy has not are unlinked before any byte is written; a copy
    too large for the tier is refused without touching the kept copy."""
    mngr = ckpt.CheckpointManager(str(tmp_path / "dir"), local_directory=str(tmp_path / "o"), async_save=False,
                                  keep=ckpt.KeepLatest(100), keep_local=ckpt.KeepLatest(1))
    holder = PeerService(f"{small_tmpfs}/process-1", str(tmp_path / "dir"), copies=1, node="b", timeout_s=30)
    owner = PeerService(mngr._tiers.root, str(tmp_path / "dir"), copies=1, node="a", timeout_s=30)
    owner._addresses[1] = holder._address
    owner.mngr = mngr
    try:
        held = holder.held(0)
        rng = np.random.default_rng(0)
        for step, name in enumerate("abc", start=1):
            _put(owner, step, {name: rng.standard_normal(110_000).astype(np.float32), "step": step}, [step])
            assert held.steps() == [step]
        assert sorted(os.listdir(held.root)) == ["3", _peer_copy.SPARE]
        with pytest.raises(ckpt.CheckpointError, match=os.strerror(errno.ENOSPC)):
            _put(owner, 4, {"d": rng.standard_normal(200_000).astype(np.float32), "step": 4}, [4])
        assert held.steps() == [3] and sorted(os.listdir(held.root)) == ["3"]
        tree = {"e": rng.standard_normal(110_000).astype(np.float32), "step": 5}
        folder = _put(owner, 5, tree, [5])
        _assert_held_exactly(holder, 5, folder, tree)
    finally:
        owner.close()
        holder.close()
        mngr.close()


def test_a_holder_killed_while_replacing_a_held_step_lists_a_whole_copy_of_it(pair, monkeypatch, tmp_path):
    """save(3, force=True) after a rewind puts step 3 again: the holder replaces its
    copy. Killed while the old copy is deleted (some of its files gone, its marker not
    yet: rmtree's order is the directory's), the holder must list step 3 from a whole
    folder (the old copy or the new), never one that lacks files."""
    owner, holder = pair
    held = holder.held(0)
    _put(owner, 3, _tree("wide", 3), [3])
    frozen = str(tmp_path / "frozen")
    real = shutil.rmtree

    def killed(path, *a, **k):
        name = os.path.basename(path)
        if (os.path.dirname(path) == held.root and (name == "3" or name.startswith("3.deleting-"))
                and os.path.exists(f"{path}/manifest.json")):
            os.unlink(f"{path}/manifest.json")  # the first file rmtree happened to remove
            real(frozen, ignore_errors=True)
            shutil.copytree(held.root, frozen)  # what the kill leaves
            raise RuntimeError("injected: the holder is killed here")
        return real(path, *a, **k)

    monkeypatch.setattr("checkpointer._manage._peers.shutil.rmtree", killed)
    with pytest.raises((ckpt.CheckpointError, OSError)):
        _put(owner, 3, _tree("narrow", 33), [3], force=True)
    monkeypatch.undo()
    assert os.path.isdir(frozen)  # the kill happened
    real(held.root)
    shutil.copytree(frozen, held.root)
    assert held.steps() == [3]
    report = ckpt.verify(held.step_path(3))
    assert report.ok, report.problems


def test_what_a_killed_put_left_is_removed_by_the_next_put(pair, monkeypatch, tmp_path):
    owner, holder = pair
    held = holder.held(0)
    _put(owner, 1, _tree("wide", 1), [1])
    _put(owner, 2, _tree("wide", 2), [2])  # step 1 becomes the spare
    frozen = str(tmp_path / "frozen")
    real = _peer_copy._CopyFile.write_at

    def dying(self, offset, view, n):
        if not os.path.exists(frozen):
            shutil.copytree(held.root, frozen)  # what a kill here leaves
        raise RuntimeError("injected: the holder dies here")

    monkeypatch.setattr(_peer_copy._CopyFile, "write_at", dying)
    with pytest.raises(ConnectionError):
        _put(owner, 3, _tree("wide", 3), [3])
    monkeypatch.setattr(_peer_copy._CopyFile, "write_at", real)
    shutil.rmtree(held.root)
    shutil.copytree(frozen, held.root)
    os.makedirs(f"{held.root}/2.deleting-gc-0badf00d/arrays")  # a kill while a replaced copy was removed
    assert len(os.listdir(held.root)) == 3 and held.steps() == [2]
    _put(owner, 4, _tree("wide", 4), [4])
    assert sorted(os.listdir(held.root)) == ["4", _peer_copy.SPARE]


def test_two_puts_taking_one_spare_at_once_both_go_on(tmp_path, monkeypatch):
    root = str(tmp_path / "held")
    os.makedirs(f"{root}/{_peer_copy.SPARE}")
    for name, data in (("COMMITTED", b"{}"), ("peer-copy.json", b'{"files": [{"key": "x", "size": 1}]}'), ("x", b"1")):
        with open(f"{root}/{_peer_copy.SPARE}/{name}", "wb") as f:
            f.write(data)
    real = _peer_copy.json.loads
    taken = {}

    def loads(raw):  # the other put takes the spare right after this one read its record
        out = real(raw)
        if not taken:
            taken["first"] = None
            taken["first"] = _peer_copy.take_spare(root, f"{root}/4.partial-a")
        return out

    monkeypatch.setattr(_peer_copy.json, "loads", loads)
    second = _peer_copy.take_spare(root, f"{root}/5.partial-b")
    monkeypatch.undo()
    assert taken["first"] == {"x": 1} and os.listdir(f"{root}/4.partial-a") == ["x"]
    assert second is None and not os.path.exists(f"{root}/5.partial-b")  # the caller makes an empty one


def test_a_copy_committed_but_not_renamed_is_served_as_it_is_listed(pair, tmp_path):
    """A holder killed between the marker's rename and the folder's (`_commit_folder`)
    leaves a committed partial folder: the inventory lists the step from it, so `get`
    must serve it from there, and the owner's restart fetches it whole."""
    owner, holder = pair
    held = holder.held(0)
    tree = _tree("wide", 5)
    folder = _put(owner, 5, tree, [5])
    generation = held.generation(5)
    os.rename(f"{held.root}/5", f"{held.root}/{_format.partial_name('5', generation)}")  # what the kill leaves
    assert holder.inventory({}, None)["held"] == {"0": {"5": generation}}  # listed ...
    shutil.rmtree(folder)  # the owner's node lost its copy
    assert owner.fetch(5, generation, [1]) is None  # ... and served
    fetched = _files(folder)
    assert fetched.pop(_peer_copy.COPY_RECORD) and fetched.keys() - _files(held.step_path(5)).keys() == set()
    assert ckpt.verify(folder).ok and owner.mngr._tiers.tier.generation(5) == generation


def test_a_restarted_holder_rolls_a_committed_copy_forward_and_removes_what_killed_puts_left(pair, tmp_path):
    owner, holder = pair
    held = holder.held(0)
    _put(owner, 5, _tree("wide", 5), [5])
    generation = held.generation(5)
    os.rename(f"{held.root}/5", f"{held.root}/{_format.partial_name('5', generation)}")  # committed, not renamed
    os.makedirs(f"{held.root}/{_format.partial_name('6', 'gc-0badf00d')}/arrays")  # a put killed mid-copy
    os.makedirs(f"{held.root}/4.deleting-gc-0badf00d")  # a kill while a replaced copy was removed
    again = PeerService(holder.local_root, "unused", copies=1, node="b", timeout_s=30)  # the holder restarted
    try:
        assert sorted(os.listdir(held.root)) == ["5"]
        assert held.steps() == [5] and held.generation(5) == generation
        assert ckpt.verify(f"{held.root}/5").ok
    finally:
        again.close()


def test_two_puts_of_one_owner_take_the_spare_one_at_a_time(pair, monkeypatch, tmp_path):
    """Puts of one owner overlap on the holder after an owner's timeout. One that found
    the spare without its record (the other had just unlinked it) deleted the spare while
    the other renamed it and wrote into it. The spare is taken under the tier's lock: a
    second put does not enter `take_spare` until the first has left it."""
    owner, holder = pair
    _put(owner, 1, _tree("wide", 1), [1])
    _put(owner, 2, _tree("wide", 2), [2])  # step 1 becomes the spare
    sent = {}
    for step, kind in ((3, "wide"), (4, "narrow")):  # both saved before either put (keep_local is 1)
        owner.mngr.save(step, _tree(kind, step))
        sent[step] = (str(tmp_path / f"sent-{step}"), owner.mngr._tiers.tier.generation(step))
        shutil.copytree(f"{owner.local_root}/{step}", sent[step][0])
        owner._sending[step] = sent[step][0]  # the folder its copy is sent from
    real, order, errors = _peer_copy.take_spare, [], []
    entered = threading.Event()

    def put(step):
        owner._put(1, step, sent[step][1], step_files(sent[step][0]), [3, 4])

    def second():
        try:
            put(4)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def take_spare(root, partial, served=()):
        order.append(("enter", partial))
        if len(order) == 1:  # the first put, inside take_spare: the second put starts now
            threads.append(threading.Thread(target=second, daemon=True))
            threads[0].start()
            entered.wait(2)  # set only if the second put enters take_spare meanwhile
        else:
            entered.set()
        out = real(root, partial, served)
        order.append(("exit", partial))
        return out

    threads = []
    monkeypatch.setattr(_peer_copy, "take_spare", take_spare)
    put(3)
    threads[0].join(60)  # the second put, to its end
    assert not threads[0].is_alive() and not errors, errors
    assert [e for e, _ in order] == ["enter", "exit", "enter", "exit"], order
    held = holder.held(0)
    assert held.steps() == [3, 4] and all(ckpt.verify(held.step_path(s)).ok for s in (3, 4))


class _Watched:
    """A lock that calls `on_wait` when an acquire has to wait for another holder."""

    def __init__(self, lock, on_wait):
        self.lock, self.on_wait = lock, on_wait

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            self.on_wait()
            self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def test_puts_wait_while_a_restart_reads_the_copy_they_would_drop_and_write_over(tmp_path, monkeypatch):
    """restore(None) reads the copies this process holds of other processes' steps (here a
    replaced process with no step of its own: `_mesh_restart` stages the held copy of
    process 0's step 1 by hard links and reads it). Meanwhile the owner put step 2 (the
    copy of step 1 became the spare) and step 3 (written over the spare's files in place):
    the restore read step 3's bytes under step 1's manifest. The restore now holds the held
    tiers' retention lock (`PeerService.holding`), which the puts take: they wait for it."""
    owner_mngr = ckpt.CheckpointManager(str(tmp_path / "dir"), local_directory=str(tmp_path / "o"), async_save=False,
                                        keep=ckpt.KeepLatest(100), keep_local=ckpt.KeepLatest(3))
    mngr = ckpt.CheckpointManager(str(tmp_path / "dir-r"), local_directory=str(tmp_path / "r"), async_save=False)
    holder = PeerService(mngr._tiers.root, str(tmp_path / "dir"), copies=1, node="b", timeout_s=60)
    owner = PeerService(owner_mngr._tiers.root, str(tmp_path / "dir"), copies=1, node="a", timeout_s=60)
    owner._addresses[1], owner.mngr = holder._address, owner_mngr
    trees = {s: _tree("wide", s) for s in (1, 2, 3)}  # one layout: step 3's files are written over step 1's
    _put(owner, 1, trees[1], [1])
    for s in (2, 3):
        owner_mngr.save(s, trees[s])
    state = {"waiting": False, "done": False}
    cond, errors = threading.Condition(), []
    held = holder.held(0)

    def on_wait():
        with cond:
            state["waiting"] = True
            cond.notify_all()

    held.retention_mu = _Watched(held.retention_mu, on_wait)

    def puts():
        try:
            for s in (2, 3):
                owner._put(1, s, owner_mngr._tiers.tier.generation(s), step_files(f"{owner.local_root}/{s}"), [s])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        with cond:
            state["done"] = True
            cond.notify_all()

    putting = threading.Thread(target=puts)
    real_stage, seen = _mesh_restart._stage, {}

    def stage(tmp, c, folders, received):  # the copy is staged; its read comes next
        records = real_stage(tmp, c, folders, received)
        putting.start()
        with cond:  # the puts wait for the lock, or (before) ran to their end
            cond.wait_for(lambda: state["waiting"] or state["done"], timeout=120)
            seen.update(state)
        return records

    monkeypatch.setattr(_mesh_restart, "_stage", stage)
    mngr._tiers.peers = holder  # this process holds process 0's copies
    try:
        restored = mngr.restore()
        putting.join()
    finally:
        mngr._tiers.peers = None
        for s in (owner, holder):
            s.close()
        owner_mngr.close()
        mngr.close()
    assert seen == {"waiting": True, "done": False}, seen
    np.testing.assert_array_equal(restored["a"], trees[1]["a"])
    np.testing.assert_array_equal(restored["b"]["x"], trees[1]["b"]["x"])
    assert int(np.asarray(restored["step"])) == 1
    assert not errors, errors
    assert held.steps() == [3] and ckpt.verify(held.step_path(3)).ok  # the puts went on after the read


def test_a_copy_a_get_is_sending_is_neither_dropped_nor_written_over_by_puts_meanwhile(pair, monkeypatch):
    """After a restart, a replaced process fetches its copy in the background (`Refetch`)
    while it trains on and puts newer steps to the same holder. Gets take no lock (a
    restart holds the tiers' locks while replaced processes fetch), so the puts' retention
    made the copy being sent the spare and the next put wrote over its files: the fetch
    failed its crc32c check, or found files gone."""
    from checkpointer._manage import _peers

    owner, holder = pair
    folder = _put(owner, 1, _tree("wide", 1), [1])
    want, generation = _files(folder), holder.held(0).generation(1)
    sending, go_on = threading.Event(), threading.Event()
    stream = _peers.stream_files

    def paused(sock, src, files):  # the first file sent, then the others once the puts are done
        stream(sock, src, files[:1])
        sending.set()
        assert go_on.wait(60)
        stream(sock, src, files[1:])

    monkeypatch.setattr(_peers, "stream_files", paused)
    shutil.rmtree(folder)  # the owner's node lost its copy of step 1
    fetched = []
    fetch = threading.Thread(target=lambda: fetched.append(owner.fetch(1, generation, [1])))
    fetch.start()
    assert sending.wait(60)
    for step in (2, 3):  # without the fix: 2 makes 1 the spare, 3 writes over it
        _put(owner, step, _tree("wide", step), [step])
    go_on.set()
    fetch.join(120)
    assert fetched == [None]
    got = _files(f"{owner.local_root}/1")
    assert got.pop(_peer_copy.COPY_RECORD) and got == want
    assert holder.held(0).steps() == [1, 3]  # 1 stays until no get sends it; the next put drops it
    _put(owner, 4, _tree("wide", 4), [4])
    assert holder.held(0).steps() == [4]


def test_the_spare_is_not_taken_while_a_get_may_be_sending_its_step(pair):
    """A get registers its step before it looks the folder up; a put's retention that ran
    just before may have made that folder the spare: the next put leaves it as it is."""
    owner, holder = pair
    _put(owner, 1, _tree("wide", 1), [1])
    _put(owner, 2, _tree("wide", 2), [2])  # 1 is the spare now
    root = holder.held(0).root
    spare = _files(f"{root}/{_peer_copy.SPARE}")
    assert _peer_copy.take_spare(root, f"{root}/x.partial", served={1}) is None
    assert _files(f"{root}/{_peer_copy.SPARE}") == spare and not os.path.exists(f"{root}/x.partial")
    assert _peer_copy.take_spare(root, f"{root}/x.partial", served={2}) is not None  # another step: taken
