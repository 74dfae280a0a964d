"""`checkpointer timeline`: the phases of each save, from the records the saves wrote."""

import json
import os
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._cli import _main as _cli
from checkpointer._commit import _directory
from checkpointer._format._records import ProcessRecord
from checkpointer._storage._kvstore import storage_for
from checkpointer._tools import _timeline

FIXTURE = Path(__file__).parent / "fixtures" / "v0.1.0"


def _state(value):
    mesh = make_mesh((2, 4), ("data", "model"))
    return {
        "w": jax.device_put(jnp.full((64, 32), value, jnp.float32), NamedSharding(mesh, P("data", "model"))),
        "b": jax.device_put(jnp.full((32,), value, jnp.float32), NamedSharding(mesh, P())),
    }


@pytest.fixture(params=[True, False], ids=["async", "sync"])
def run_dir(request, tmp_path):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(2), async_save=request.param) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(float(step)))
    return d


def test_manager_run_timeline_phases_are_ordered_and_disjoint(run_dir):
    # Step 1 was removed by retention; its journal line stays, the committed steps are drawn.
    phases = _timeline.read_timeline(run_dir)
    assert sorted({p.step for p in phases}) == [2, 3]
    for step in (2, 3):
        mine = [p for p in phases if p.step == step and p.process_index == 0]
        assert [p.name for p in mine] == list(_timeline.PHASES)
        for p in mine:
            assert p.end_unix_s >= p.start_unix_s, p
        for before, after in zip(mine, mine[1:]):
            assert after.start_unix_s >= before.end_unix_s, (before, after)
    # The snapshots happen in step order, each save after the previous one's snapshot.
    snaps = [p for p in phases if p.name == "snapshot"]
    assert snaps[0].end_unix_s <= snaps[1].start_unix_s
    lines = Path(run_dir, _directory.SAVE_JOURNAL).read_text().splitlines()
    phase_lines = [json.loads(line) for line in lines if "phases_unix_s" in json.loads(line)]  # beside the manager's notes
    assert [entry["step"] for entry in phase_lines] == [1, 2, 3]
    assert _directory.foreign_entries(storage_for(run_dir)[0], run_dir) == []  # the journal is the directory's own


def test_timeline_of_one_checkpoint_and_last(run_dir):
    one = _timeline.read_timeline(f"{run_dir}/3")
    assert {p.step for p in one} == {3}
    assert "retention" in {p.name for p in one}  # the parent's journal is read too
    assert {p.step for p in _timeline.read_timeline(run_dir, last=1)} == {3}


def test_plain_save_timeline_ends_with_the_marker(tmp_path):
    path = str(tmp_path / "c")
    ckpt.save(path, _state(1.0))
    phases = _timeline.read_timeline(path)
    assert [p.name for p in phases] == ["wait_for_arrays", "snapshot", "write", "durable", "wait", "commit"]
    marker = json.loads(Path(path, "COMMITTED").read_text())
    assert phases[-1].end_unix_s == pytest.approx(marker["committed_unix_s"], abs=1e-5)


def test_checkpoints_without_timestamps_have_no_phases(tmp_path):
    for path in FIXTURE.iterdir():
        if (path / "COMMITTED").exists():
            assert _timeline.read_timeline(path) == []
            return
    pytest.fail(f"no committed checkpoint in {FIXTURE}")


def _record(pidx, snapshot, write, durable):
    return ProcessRecord(process_index=pidx, chunks=(), phases_unix_s={"snapshot": snapshot, "write": write,
                                                                       "durable": durable})


def test_other_processes_wait_until_process_0_released_them():
    records = {0: _record(0, (0, 1), (1, 2), (2, 3)), 1: _record(1, (0, 1), (1, 4), (4, 6))}
    phases = _timeline.save_phases(5, records, {"wait": (3.01, 6.2)}, 6.5, {"commit": (6.2, 6.6), "retention": (6.6, 7)})
    by = {(p.process_index, p.name): (p.start_unix_s, p.end_unix_s) for p in phases}
    assert by[(0, "wait")] == (3.01, 6.2)  # from its report (its record was written from 3 to 3.01)
    assert by[(1, "wait")] == (6, 7)  # until the commit announcement, after retention
    assert (1, "commit") not in by
    summary = _timeline.step_summary(phases)
    assert summary.slowest_process == 1
    assert summary.commit_lag_s == pytest.approx(5.6)
    assert summary.blocking_s == 1


def test_process_record_keeps_phases_and_old_readers_keep_them_as_extra():
    rec = _record(0, (1.5, 2.0), (2.0, 2.5), (2.5, 3.25))
    obj = rec.to_json()
    assert obj["phases_unix_s"] == {"snapshot": [1.5, 2.0], "write": [2.0, 2.5], "durable": [2.5, 3.25]}
    assert ProcessRecord.from_json(obj, "x").phases_unix_s == rec.phases_unix_s
    with pytest.raises(ckpt.CorruptCheckpointError, match="phases_unix_s"):
        ProcessRecord.from_json({**obj, "phases_unix_s": {"write": [1]}}, "x")


def test_cli_timeline_text_json_and_png(run_dir, capsys):
    png = os.path.join(os.path.dirname(run_dir), "t.png")
    code = _cli.main(["timeline", run_dir, "--png", png])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "step 2:" in out and "step 3:" in out and "commit lag" in out
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _cli.main(["timeline", run_dir, "--json", "--last", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {p["step"] for p in doc["phases"]} == {3}
    shutil.rmtree(run_dir)
    assert _cli.main(["timeline", run_dir]) == 2


def test_waiting_for_a_slow_computation_is_its_own_phase_before_the_snapshot(tmp_path, monkeypatch):
    # JAX dispatches asynchronously: the save is called while a leaf is still being
    # computed. The wait is recorded apart; the snapshot (what blocks training) starts
    # once the leaves are ready, before their host copy.
    from checkpointer._save import _copy as _save  # where the save calls the host copy

    copies = []

    def snapshot_to_host(datas, pool=None):
        copies.append((time.time(), all(d.is_ready() for d in datas if isinstance(d, jax.Array))))
        return real(datas, pool)

    real = _save.snapshot_to_host
    monkeypatch.setattr(_save, "snapshot_to_host", snapshot_to_host)
    slow = jax.jit(lambda a: jax.lax.fori_loop(0, 200, lambda i, b: jnp.tanh(b @ a), a))
    a = jnp.eye(512, dtype=jnp.float32) * 0.5
    jax.block_until_ready(slow(a))  # compiled; the next call only dispatches
    y = slow(a)
    dispatched = time.time()
    assert not y.is_ready()  # the save below has to wait for it
    path = str(tmp_path / "c")
    ckpt.save(path, {"y": y, "b": _state(1.0)["b"]})
    phases = {p.name: p for p in _timeline.read_timeline(path)}
    wait, snap = phases["wait_for_arrays"], phases["snapshot"]
    [(copied_at, ready_at_copy)] = copies
    assert ready_at_copy
    assert dispatched <= wait.start_unix_s < wait.end_unix_s <= snap.start_unix_s <= copied_at <= snap.end_unix_s
    rec = json.loads(Path(path, "processes", "0.json").read_text())
    assert set(rec["phases_unix_s"]) == {"wait_for_arrays", "snapshot", "write", "durable"}
    summary = _timeline.step_summary(list(phases.values()))
    assert summary.wait_for_arrays_s == pytest.approx(wait.duration_s)
    assert summary.blocking_s == pytest.approx(snap.duration_s)
    assert (ckpt.restore(path)["y"] == y).all()


def test_records_without_the_wait_for_arrays_phase_still_draw(tmp_path):
    from rich.console import Console

    records = {0: _record(0, (0, 1), (1, 2), (2, 3))}  # as written before the phase existed
    phases = _timeline.save_phases(4, records, {"wait": (3.01, 3.5)}, 3.6, {})
    assert "wait_for_arrays" not in {p.name for p in phases}
    summary = _timeline.step_summary(phases)
    assert summary.wait_for_arrays_s is None and summary.blocking_s == 1
    console = Console(record=True, width=140)
    _timeline.render_text(phases, console)
    text = console.export_text()
    assert "step 4: training blocked 1.000 s" in text and "waited for the arrays" not in text
    png = tmp_path / "old.png"
    _timeline.render_png(phases, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- records it cannot draw (issue 22 item 7) ------------------------------------------------


def _edit_phases(run_dir, step, pidx, phases):
    path = Path(run_dir, str(step), "processes", f"{pidx}.json")
    rec = json.loads(path.read_text())
    rec["phases_unix_s"] = {**rec["phases_unix_s"], **phases}
    path.write_text(json.dumps(rec))


@pytest.mark.parametrize("value", [1e308, -1e308, 1e300])
def test_cli_timeline_shows_a_timestamp_it_cannot_draw_as_such(run_dir, capsys, value):
    _edit_phases(run_dir, 3, 0, {"snapshot": [value, value]})
    png = os.path.join(os.path.dirname(run_dir), "odd.png")
    code = _cli.main(["timeline", run_dir, "--png", png])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "step 2:" in out and "step 3:" in out  # both still drawn
    assert f"step 3, process 0: snapshot [{value!r}, {value!r}] cannot be drawn" in out, out
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _cli.main(["timeline", run_dir, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [value, value] in [[p["start_unix_s"], p["end_unix_s"]] for p in doc["phases"]]  # listed as read


def test_a_step_whose_every_phase_is_undrawable_is_named_and_the_others_drawn():
    from rich.console import Console

    odd = [_timeline.Phase(7, 0, name, 1e308, 1e308) for name in ("snapshot", "write")]
    ok = _timeline.save_phases(8, {0: _record(0, (10, 11), (11, 12), (12, 13))}, {}, None, {})
    console = Console(record=True, width=160)
    _timeline.render_text(odd + ok, console)
    text = console.export_text()
    assert "step 7: no phase can be drawn" in text
    assert "step 7, process 0: write [1e+308, 1e+308] cannot be drawn" in text
    assert "step 8: training blocked 1.000 s" in text
    with pytest.raises(ValueError, match="no save phases to draw"):
        _timeline.render_png(odd, "unused.png")


def test_two_threads_noting_the_journal_of_an_object_store_at_once_lose_no_line():
    import threading

    from checkpointer._storage import storage_for
    from checkpointer._tools import _timeline

    storage, directory = storage_for("memory://journal-two-threads")
    storage.write_file(f"{directory}/{_timeline.JOURNAL}", b"")
    real_read, other = storage.read_file, []

    def read_file(path, *args, **kwargs):
        data = real_read(path, *args, **kwargs)
        if not other:  # the first note has read the journal: a second one starts meanwhile
            other.append(threading.Thread(target=_timeline.append_journal_line,
                                          args=(storage, directory, {"event": "second"})))
            other[0].start()
            other[0].join(timeout=0.5)  # finishes here unless it must wait for the first
        return data

    storage.read_file = read_file
    _timeline.append_journal_line(storage, directory, {"event": "first"})
    other[0].join()
    lines = real_read(f"{directory}/{_timeline.JOURNAL}").decode().splitlines()
    assert sorted(json.loads(line)["event"] for line in lines) == ["first", "second"]


def test_a_local_journal_grown_past_its_read_limit_still_gives_its_newest_phases(tmp_path, monkeypatch):
    from checkpointer._storage import LocalStorage

    monkeypatch.setattr(_timeline, "MAX_JOURNAL_BYTES", 4096)  # a long run's journal: appended, never cut
    storage, directory = LocalStorage(), str(tmp_path)
    for i in range(100):
        _timeline.append_journal(storage, directory, step=i, generation=f"g{i}", phases_unix_s={"commit": (i, i + 0.5)})
    assert os.path.getsize(tmp_path / _timeline.JOURNAL) > 4096
    got = _timeline.read_journal(storage, directory)  # was: CheckpointError "cannot read the save journal"
    assert "g99" in got and got["g99"]["commit"] == (99, 99.5)
    assert "g0" not in got and len(got) < 100
