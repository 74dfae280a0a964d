"""The transport of a restart after a lost node (`_manage/_peer_transfer`), in one process:
the plan (which device sends which box, in which round), and the holder's reads into the
buffers a program sends, run over this process's 8 devices (the senders and receivers
are all local here; tests/test_peers_multiprocess.py runs it between processes)."""

import dataclasses
import glob
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._format._box import Box
from checkpointer._manage import _peer_transfer as T


@dataclasses.dataclass
class _Target:
    sharding: object
    shape: tuple
    dtype: object = None


@dataclasses.dataclass
class _Meta:  # what the plan reads of a stored array leaf
    path: str
    keystr: str | None = None
    key_impl: str | None = None


@dataclasses.dataclass
class _Leaf:
    path: str
    meta: object
    target: object
    device_boxes: tuple


@dataclasses.dataclass
class _Resolved:
    leaves: tuple


def _resolved(device_boxes_by_leaf):
    sharding = NamedSharding(make_mesh((8,), ("x",)), P())
    return _Resolved(tuple(_Leaf(path, _Meta(path), _Target(sharding, (64, 8)), tuple(db))
                           for path, db in device_boxes_by_leaf.items()))


def _rows(i, n=8):
    return Box((8 * i, 0), (n, 8))


def test_plan_pairs_the_replaced_devices_with_the_holders_in_turn_one_box_per_device_and_round():
    by_process = {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6]}
    # Process 1 and process 3 lost, both held by process 2; process 0 lost, held by process 3 (one device).
    resolved = {
        1: _resolved({"a": [(2, _rows(0)), (3, _rows(1))], "b": [(2, _rows(2)), (3, _rows(2))]}),  # b: one box, both devices
        3: _resolved({"a": [(6, _rows(3))], "b": [(6, Box((0, 0), (0, 8)))]}),  # an empty box travels not
        0: _resolved({"a": [(0, _rows(4)), (1, _rows(5))]}),
    }
    transfers, why = T.plan(resolved, {1: 2, 3: 2, 0: 3}, by_process)
    assert why is None
    got = {(t.leaf, t.box, t.src, t.dst, t.round) for t in transfers}
    assert got == {
        ("a", _rows(0), 4, 2, 0), ("a", _rows(1), 5, 3, 0), ("b", _rows(2), 4, 2, 0),  # process 1: round 0
        ("a", _rows(3), 4, 6, 1),  # process 3, the same holder: its rounds come after
        ("a", _rows(4), 6, 0, 0), ("a", _rows(5), 6, 1, 1),  # process 0: a holder with one device, two rounds
    }
    for rnd in {t.round for t in transfers}:
        for leaf in "ab":
            ts = [t for t in transfers if t.round == rnd and t.leaf == leaf]
            assert len({t.src for t in ts}) == len({t.dst for t in ts}) == len(ts)
    progs = T.programs(transfers, {"a": np.dtype(np.float32), "b": np.dtype(np.float32)})
    # Round 0: b's boxes go between fewer pairs than a's: two programs; round 1: device 6 sends and receives.
    assert [(p.ids, p.pairs, [o.leaf for o in p.operands]) for p in progs] == [
        ((2, 4), ((4, 2),), ["b"]), ((0, 2, 3, 4, 5, 6), ((4, 2), (5, 3), (6, 0)), ["a"]), ((1, 4, 6), ((4, 6), (6, 1)), ["a"])]


def test_many_leaves_go_in_programs_of_at_most_max_operands_grouped_by_shape():
    transfers = [T.Transfer(f"l{i:03d}", Box((0,), (8 + i % 3,)), 0, 4, 0) for i in range(300)]
    progs = T.programs(transfers, {t.leaf: np.dtype(np.float32) for t in transfers})
    assert [len(p.operands) for p in progs] == [128, 128, 44]
    assert sorted(o.leaf for p in progs for o in p.operands) == sorted(t.leaf for t in transfers)
    assert [o.block for o in progs[0].operands] == [(8,)] * 100 + [(9,)] * 28  # by shape: programs repeat shapes


def test_a_program_carries_at_most_max_program_bytes_so_the_transfer_of_one_goes_on_while_the_next_is_read(monkeypatch):
    monkeypatch.setattr(T, "MAX_PROGRAM_BYTES", 3 * 2 * 64)  # three operands of two 16-float32 boxes
    transfers = [T.Transfer(f"l{i}", Box((16 * k,), (16,)), k, 4 + k, 0) for i in range(7) for k in range(2)]
    progs = T.programs(transfers, {t.leaf: np.dtype(np.float32) for t in transfers})
    assert [[o.leaf for o in p.operands] for p in progs] == [["l0", "l1", "l2"], ["l3", "l4", "l5"], ["l6"]]
    one = [T.Transfer("big", Box((0,), (1024,)), 0, 4, 0)]  # larger than the limit alone: a program of its own
    assert [len(p.operands) for p in T.programs(one, {"big": np.dtype(np.float32)})] == [1]
    monkeypatch.setattr(T, "MAX_PROGRAM_BYTES", 1)  # every operand over the limit alone
    many = [T.Transfer(f"m{i:02d}", Box((0,), (16,)), 0, 4, 0) for i in range(40)]
    progs = T.programs(many, {t.leaf: np.dtype(np.float32) for t in many})
    assert [len(p.operands) for p in progs] == [5] * T.MAX_PIPELINED_PROGRAMS  # no more programs than that


def test_the_boxes_arrive_whole_over_several_programs_each_run_once_its_blocks_are_read(saved, monkeypatch):
    path, state = saved
    monkeypatch.setattr(T, "MAX_PROGRAM_BYTES", 1)  # one operand per program
    transfers = _transfers(state)
    progs = T.programs(transfers, {k: np.dtype(v.dtype) for k, v in state.items()})
    assert len(progs) == 3
    held = T.HeldReads(progs, {9: path}, {4: 9, 5: 9})
    for p in (0, 2):  # a program's blocks (program, operand, sending device) are read when it asks for them
        assert {(p, 0, 0), (p, 0, 1)} <= set(held.ready(p))
    received, error = T.run(T.compile_programs(progs), held)
    assert error is None
    for t in transfers:
        np.testing.assert_array_equal(np.asarray(received[(t.leaf, t.dst)]), state[t.leaf][t.box.slices()])


def test_plan_says_why_a_target_is_not_covered():
    by_process = {0: [0, 1], 1: [2, 3]}
    r = _resolved({"a": [(2, _rows(0))]})
    host = dataclasses.replace(r.leaves[0], target=_Target(None, (64, 8)))
    assert T.plan({1: _Resolved((host,))}, {1: 0}, by_process)[1] == "a: a host target"
    assert T.plan({1: r}, {1: 0}, {0: [], 1: [2, 3]})[1] == "process 0 has no device"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("held") / "1")
    mesh = make_mesh((8,), ("x",))
    rng = np.random.default_rng(3)
    state = {"a": rng.standard_normal((64, 16)).astype(np.float32),
             "b": rng.standard_normal((32,)).astype(ml_dtypes.bfloat16),
             "c": np.arange(64 * 16, dtype=np.int32).reshape(64, 16)}
    ckpt.save(path, {k: jax.device_put(v, NamedSharding(mesh, P("x"))) for k, v in state.items()}, pack_small_leaves_bytes=0)
    return path, state


def _transfers(state):
    out = []
    for leaf, v in state.items():
        rows = v.shape[0] // 2
        for k in range(2):  # devices 0, 1 send to devices 4, 5 (one program, every leaf an operand)
            out.append(T.Transfer(leaf, Box((rows * k, *[0] * (v.ndim - 1)), (rows, *v.shape[1:])), k, 4 + k, 0))
    return out


def test_the_holder_reads_the_boxes_it_sends_and_each_device_receives_its_box(saved):
    path, state = saved
    transfers = _transfers(state)
    progs = T.programs(transfers, {k: np.dtype(v.dtype) for k, v in state.items()})
    assert len(progs) == 1 and [o.leaf for o in progs[0].operands] == ["b", "a", "c"]  # by dtype, shape, leaf
    held = T.HeldReads(progs, {9: path}, {4: 9, 5: 9})
    received, error = T.run(T.compile_programs(progs), held)
    assert error is None
    assert sorted(received) == [(leaf, d) for leaf in ("a", "b", "c") for d in (4, 5)]
    for t in transfers:
        got = received[(t.leaf, t.dst)]
        assert got.devices() == {jax.devices()[t.dst]} and got.dtype == state[t.leaf].dtype
        np.testing.assert_array_equal(np.asarray(got), state[t.leaf][t.box.slices()])


def test_the_boxes_are_cast_to_the_target_dtype(saved):
    path, state = saved
    transfers = [t for t in _transfers(state) if t.leaf == "c"]
    progs = T.programs(transfers, {"c": np.dtype(np.float32)})
    received, error = T.run(T.compile_programs(progs), T.HeldReads(progs, {9: path}, {4: 9, 5: 9}))
    assert error is None
    for t in transfers:
        got = received[(t.leaf, t.dst)]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(got), state["c"][t.box.slices()].astype(np.float32))


def test_a_scalar_travels_as_one_element_and_arrives_as_a_scalar(tmp_path):
    path = str(tmp_path / "1")
    mesh = make_mesh((8,), ("x",))
    ckpt.save(path, {"s": jax.device_put(np.float32(3.5), NamedSharding(mesh, P()))})
    transfers = [T.Transfer("s", Box((), ()), 1, 6, 0)]
    progs = T.programs(transfers, {"s": np.dtype(np.float32)})
    assert progs[0].operands[0].block == (1,)
    received, error = T.run(T.compile_programs(progs), T.HeldReads(progs, {9: path}, {6: 9}))
    assert error is None and received[("s", 6)].shape == () and float(received[("s", 6)]) == 3.5


def test_a_damaged_box_stops_the_reads_reports_it_and_nothing_unread_travels(saved, tmp_path):
    path, state = saved
    copy = str(tmp_path / "1")
    shutil.copytree(path, copy)
    (chunk, *_) = sorted(p for p in glob.glob(f"{copy}/arrays/b/c/**", recursive=True) if os.path.isfile(p))
    with open(chunk, "r+b") as f:
        f.write(b"\xff\xff")
    transfers = _transfers(state)
    progs = T.programs(transfers, {k: np.dtype(v.dtype) for k, v in state.items()})
    held = T.HeldReads(progs, {9: copy}, {4: 9, 5: 9})
    received, error = T.run(T.compile_programs(progs), held)
    assert error is not None and error.startswith("CorruptCheckpointError") and "crc32c" in error, error
    for d in (4, 5):  # the damaged leaf's boxes (one of them read whole, the other not): zeros travel
        assert not np.asarray(received[("b", d)]).astype(np.float32).any(), d


def test_assemble_places_a_box_received_once_on_every_device_that_holds_it_and_makes_empty_boxes(tmp_path):
    from checkpointer._format import read_metadata
    from checkpointer._restore import resolve_tree
    from checkpointer._storage import LocalStorage

    path = str(tmp_path / "1")
    mesh = make_mesh((4, 2), ("data", "model"))
    state = {"rows": np.arange(64, dtype=np.float32).reshape(8, 8), "empty": np.zeros((0, 8), np.float32)}
    specs = {"rows": P("data"), "empty": P(None, "model")}
    ckpt.save(path, {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in state.items()})
    meta = read_metadata(LocalStorage(), path)
    target = {k: NamedSharding(mesh, specs[k]) for k in state}
    resolved = resolve_tree(meta, target, partial=False, process_index=0)
    received = {}  # "rows": each box of two devices received by the first of them only
    for leaf in resolved.leaves:
        if leaf.path == "rows":
            first = {}
            for device, box in leaf.device_boxes:
                first.setdefault(box, device)
            received.update({("rows", d): jax.device_put(state["rows"][b.slices()], jax.devices()[d]) for b, d in first.items()})
    assert len(received) == 4
    out = T.assemble(meta, resolved, received)
    for name, value in state.items():
        assert out[name].sharding == target[name] and out[name].shape == value.shape
        for shard in out[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


class _BlockingReads:
    """Stands in for `HeldReads`: reads until stopped, as a held copy's reads of large boxes
    would still be going on when a round or a transfer fails."""

    made: list = []

    def __init__(self, *_):
        import threading
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.stopped.wait, daemon=True)
        self.thread.start()
        _BlockingReads.made.append(self)

    def stop(self):
        self.stopped.set()
        self.thread.join()


@pytest.mark.parametrize("fails", ["transfer", "round"])
def test_no_read_of_a_held_copy_outlives_a_failed_delivery(monkeypatch, tmp_path, fails):
    """`restart` releases the tiers' locks once `deliver` returns or raises: a put may then
    replace a held copy. So when the round after the plans or the transfers raise, the
    background reads of held copies and the own read must be over before the error leaves."""
    import threading
    import types

    from checkpointer._manage import _peer_delivery as D
    from checkpointer._restore import RestoreOptions

    _BlockingReads.made = []
    own_done = threading.Event()

    def read_own():
        own_done.wait(0.2)  # the own read, still going when the delivery fails
        own_done.set()

    def boom(*_):
        raise RuntimeError("the transfer failed")

    calls = []

    def agree(f):
        calls.append(f())
        if fails == "round":
            raise RuntimeError("the round timed out")
        return calls[-1:]

    monkeypatch.setattr(D, "_publish_meta", lambda *a: None)
    monkeypatch.setattr(D, "read_metadata", lambda *a: None)
    monkeypatch.setattr(D, "resolve_tree", lambda *a, **k: types.SimpleNamespace(leaves=()))
    monkeypatch.setattr(T, "plan", lambda *a: ([], None))
    monkeypatch.setattr(T, "programs", lambda *a: [])
    monkeypatch.setattr(T, "compile_programs", lambda *a: [])
    monkeypatch.setattr(T, "HeldReads", _BlockingReads)
    monkeypatch.setattr(T, "run", boom)
    peers = types.SimpleNamespace(local_root=str(tmp_path), timeout_s=1.0, _key=lambda *a: "/".join(map(str, a)),
                                  held=lambda r: types.SimpleNamespace(root=str(tmp_path / f"held-{r}")))
    sources = [[], [0]]  # this process (0) reads its own copy and holds process 1's
    with pytest.raises(RuntimeError, match="timed out" if fails == "round" else "transfer failed"):
        D.deliver(peers, 7, "g", sources, None, RestoreOptions(), read_own, agree)
    (held,) = _BlockingReads.made
    assert held.stopped.is_set() and not held.thread.is_alive()
    assert own_done.is_set()
