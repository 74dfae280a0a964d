"""Alerts an operator can wire (issue 22 item 3): the journal's notes of failed saves and
of the last step handed to `save`, `checkpointer status` (exit codes, --json), and the
manager's `jax.monitoring` events."""

import collections
import json
import os
import re
import threading

import jax
import numpy as np
import pytest

import checkpointer as ckpt
from checkpointer._cli import _main as _cli
from checkpointer._commit import _directory
from checkpointer._manage import _events
from checkpointer._save import _pipeline as _save

OPERATING = os.path.join(os.path.dirname(__file__), "..", "docs", "operating.md")  # the site's page "Operating a run"


def _tree(step):
    return {"w": np.full((4, 8), step, np.float32)}


def _journal(directory):
    with open(os.path.join(directory, _directory.SAVE_JOURNAL), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _status(capsys, *argv):
    code = _cli.main(["status", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _broken(snap):
    raise ckpt.SaveError(f"injected: no space left on device writing {snap.path}")


# --- the journal's notes ------------------------------------------------------------------


def test_a_failed_save_is_noted_with_step_process_and_error(tmp_path, monkeypatch):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        mgr.save(1, _tree(1))
        monkeypatch.setattr(_save, "write_snapshot", _broken)
        with pytest.raises(ckpt.SaveError):
            mgr.save(2, _tree(2))
    failed = [e for e in _journal(d) if e.get("event") == "save_failed"]
    assert len(failed) == 1
    assert failed[0]["step"] == 2 and failed[0]["process_index"] == 0
    assert failed[0]["error"].startswith("SaveError: injected: no space left on device")


def test_an_async_failure_and_a_refused_snapshot_are_noted_too(tmp_path, monkeypatch):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d) as mgr:
        mgr.save(1, _tree(1))
        with pytest.raises(ckpt.UnsupportedValueError):
            mgr.save(2, {"w": np.zeros(3), "bad": object()})
        monkeypatch.setattr(_save, "write_snapshot", _broken)
        mgr.save(3, _tree(3))
        with pytest.raises(ckpt.SaveError):
            mgr.wait_until_finished()
    failed = [(e["step"], e["error"].split(":")[0]) for e in _journal(d) if e.get("event") == "save_failed"]
    assert failed == [(2, "UnsupportedValueError"), (3, "SaveError")]


def test_the_step_handed_to_save_is_noted_at_most_every_10_s(tmp_path):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        mgr.recover()  # the writer's directory exists
        journal = mgr._journal
        for step, now in [(1, 1000.0), (2, 1005.0), (3, 1009.9), (4, 1010.0), (5, 1015.0), (6, 1031.0)]:
            journal.requested(step, now_unix_s=now)
    noted = [(e["step"], e["unix_s"]) for e in _journal(d) if e.get("event") == "save_requested"]
    assert noted == [(1, 1000.0), (4, 1010.0), (6, 1031.0)]


def test_a_step_handed_to_save_after_the_noted_one_committed_is_noted_at_once(tmp_path):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        mgr.recover()
        journal = mgr._journal
        journal.requested(1, now_unix_s=1000.0)
        journal.requested(2, now_unix_s=1001.0)  # 1 still in flight: throttled
        journal._committed_step = 1
        journal.requested(3, now_unix_s=1002.0)  # 1 committed: the journal would show no step in flight
        journal.requested(4, now_unix_s=1003.0)  # 3 in flight: throttled again
    noted = [e["step"] for e in _journal(d) if e.get("event") == "save_requested"]
    assert noted == [1, 3]


def test_the_probe_commit_lag_agrees_with_status_in_the_job_while_a_save_is_in_flight(tmp_path, monkeypatch, capsys):
    """Issue 25 item 4: steps 1-9 committed within 10 s, step 12 in flight: the probe's
    commit lag is the job's (3), not 0."""
    d = str(tmp_path / "run")
    release = threading.Event()
    real = _save.write_snapshot

    def held(snap, *a, **kw):
        if snap.step == 12:
            release.wait(60)
        return real(snap, *a, **kw)

    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(2)) as mgr:
        for step in range(1, 10):
            mgr.save(step, _tree(step))
            mgr.wait_until_finished()
        monkeypatch.setattr(_save, "write_snapshot", held)
        try:
            mgr.save(12, _tree(12))
            mgr._deleter.submit(lambda: None).result()  # the note is written off the training thread (FIFO, one thread)
            job = mgr.status()
            assert (job.latest_committed_step, job.step_in_flight, job.commit_lag_steps) == (9, 12, 3), job
            code, out, _ = _status(capsys, d, "--json", "--max-lag-steps", "2")
            doc = json.loads(out)
            assert (doc["latest_committed_step"], doc["commit_lag_steps"]) == (9, job.commit_lag_steps), doc
            assert code == 1 and doc["problems"][0].startswith("commit lag 3 steps > --max-lag-steps 2 (step 12"), doc
        finally:
            release.set()


def test_notes_do_not_disturb_the_timeline_of_the_journal(tmp_path):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d) as mgr:
        for step in (1, 2):
            mgr.save(step, _tree(step))
    assert any(e.get("event") == "save_requested" for e in _journal(d))
    assert sorted({p.step for p in ckpt.timeline(d, console=_quiet_console())}) == [1, 2]


def _quiet_console():
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), width=200)


# --- checkpointer status -------------------------------------------------------------------


def test_status_of_a_healthy_directory_exits_0_and_json_has_every_field(tmp_path, capsys):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _tree(step))
    code, out, _ = _status(capsys, d, "--max-lag-steps", "0", "--max-age-s", "3600")
    assert code == 0, out
    assert re.search(r"newest committed\s+3 \(\d+s ago\)", out) and re.search(r"status\s+OK", out), out
    code, out, _ = _status(capsys, d, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["problems"] == []
    assert doc["latest_committed_step"] == 3 and doc["step_in_flight"] is None
    assert doc["last_requested_step"] in (1, 2, 3) and doc["commit_lag_steps"] == 0  # noted at most every 10 s while in flight
    assert doc["last_failure"] is None and doc["failing"] is False


def test_status_exits_1_on_a_failed_save_until_a_later_step_commits(tmp_path, monkeypatch, capsys):
    d = str(tmp_path / "run")
    real = _save.write_snapshot
    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        mgr.save(1, _tree(1))
        monkeypatch.setattr(_save, "write_snapshot", _broken)
        with pytest.raises(ckpt.SaveError):
            mgr.save(2, _tree(2))
        code, out, _ = _status(capsys, d)
        assert code == 1, out
        assert "ALERT: the save of step 2 failed on process 0: SaveError: injected" in out, out
        monkeypatch.setattr(_save, "write_snapshot", real)
        mgr.save(3, _tree(3))
    code, out, _ = _status(capsys, d, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["failing"] is False, doc
    assert doc["last_failure"]["step"] == 2  # still shown, no longer alerting


def test_status_exits_1_when_a_bound_is_crossed(tmp_path, capsys):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        mgr.save(1, _tree(1))
    created = ckpt.metadata(f"{d}/1").created_unix_s
    # The writer noted step 9 handed to save, 8 steps ahead of the newest committed.
    ckpt_journal = os.path.join(d, _directory.SAVE_JOURNAL)
    with open(ckpt_journal, "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": "save_requested", "step": 9, "unix_s": created + 1}) + "\n")
    code, out, _ = _status(capsys, d, "--max-lag-steps", "8")
    assert code == 0, out
    code, out, _ = _status(capsys, d, "--max-lag-steps", "7")
    assert code == 1 and "ALERT: commit lag 8 steps > --max-lag-steps 7" in out, out
    status = ckpt.read_status(d, now_unix_s=created + 100)
    assert status.latest_age_s == pytest.approx(100)
    assert status.problems(max_age_s=99.0) == ["the newest committed step 1 is 100 s old > --max-age-s 99"]
    assert status.problems(max_age_s=101.0) == []


def test_status_of_an_empty_directory_alerts_only_with_max_age(tmp_path, capsys):
    d = tmp_path / "empty"
    d.mkdir()
    assert _status(capsys, str(d))[0] == 0
    code, out, _ = _status(capsys, str(d), "--max-age-s", "60")
    assert code == 1 and "no committed step" in out


def test_status_exit_codes_for_usage_and_unreadable_directories(tmp_path, capsys):
    assert _status(capsys, str(tmp_path / "missing"))[0] == 3
    f = tmp_path / "file"
    f.write_text("x")
    code, _, err = _status(capsys, str(f))
    assert code == 3 and "cannot read" in err
    assert _status(capsys, str(tmp_path), "--max-lag-steps", "-1")[0] == 2
    assert _status(capsys, str(tmp_path), "--max-age-s", "0")[0] == 2
    ckpt.save(str(tmp_path / "one"), _tree(1))
    code, _, err = _status(capsys, str(tmp_path / "one"))
    assert code == 2 and "one checkpoint" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_status_of_a_directory_without_read_permission_exits_3(tmp_path, capsys):
    d = tmp_path / "closed"
    d.mkdir()
    d.chmod(0)
    try:
        assert _status(capsys, str(d))[0] == 3
    finally:
        d.chmod(0o755)


def test_the_docs_status_probe_runs_as_written(tmp_path, capsys):
    with open(OPERATING, encoding="utf-8") as f:
        readme = f.read()
    start = readme.index("import numpy as np\nimport checkpointer as ckpt\n\nwith ckpt.CheckpointManager(\"/tmp/questions\"")
    setup = readme[start : readme.index("```", start)]
    d = str(tmp_path / "questions")
    exec(compile(setup.replace('"/tmp/questions"', repr(d)), "docs/operating.md", "exec"), {})  # noqa: S102
    capsys.readouterr()
    probe = re.search(r"\$ checkpointer status (.*)\n((?:(?!```).*\n)*)```", readme)
    argv = probe.group(1).replace("/tmp/questions", d).split()
    assert _cli.main(["status", *argv]) == 0
    out = capsys.readouterr().out
    expected = probe.group(2).replace("/tmp/questions", d)
    assert [ln.split()[:2] for ln in out.splitlines()] == [ln.split()[:2] for ln in expected.splitlines()], out
    start = readme.index('status = ckpt.read_status("/tmp/questions")')
    code = readme[start : readme.index("```", start)].replace('"/tmp/questions"', repr(d))
    scope = {"ckpt": ckpt}
    exec(compile(code, "docs/operating.md", "exec"), scope)  # noqa: S102
    assert scope["problems"] == [] and scope["status"].latest_committed_step == 3


# --- jax.monitoring events -------------------------------------------------------------------


@pytest.fixture
def events():
    seen = collections.Counter()

    def on_duration(event, duration, **kw):
        if event.startswith("/checkpointer/"):
            assert duration >= 0
            seen[event] += 1

    def on_scalar(event, value, **kw):
        if event.startswith("/checkpointer/"):
            seen[event] += 1

    def on_event(event, **kw):
        if event.startswith("/checkpointer/"):
            seen[event] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_scalar_listener(on_scalar)
    jax.monitoring.register_event_listener(on_event)
    yield seen
    jax.monitoring.unregister_event_duration_listener(on_duration)
    jax.monitoring.unregister_scalar_listener(on_scalar)
    jax.monitoring.unregister_event_listener(on_event)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_each_event_fires_once_per_save_and_restore(tmp_path, monkeypatch, events, async_save):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d, async_save=async_save) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _tree(step))
        mgr.wait_until_finished()
        save_events = {n for n, (kind, _, _) in _events.EVENTS.items() if n.startswith("/checkpointer/save/")}
        assert {n: events[n] for n in save_events - {_events.SAVE_FAILURE}} == dict.fromkeys(save_events - {_events.SAVE_FAILURE}, 3)
        assert events[_events.SAVE_FAILURE] == 0
        restored = mgr.restore()
        np.testing.assert_array_equal(restored["w"], _tree(3)["w"])
        assert events[_events.RESTORE_S] == 1 and events[_events.RESTORE_BYTES] == 1
        monkeypatch.setattr(_save, "write_snapshot", _broken)
        try:
            mgr.save(4, _tree(4))
            mgr.wait_until_finished()
        except ckpt.SaveError:
            pass
        assert events[_events.SAVE_FAILURE] == 1
        assert events[_events.SAVE_WRITE_S] == 3  # a failed save records no commit figures


def test_every_event_is_in_the_docs_beside_orbaxs_nearest():
    with open(OPERATING, encoding="utf-8") as f:
        readme = f.read()
    rows = dict(re.findall(r"^\| `(/checkpointer/[^`]+)` \| \w+ \| `(/jax/[^`]+)` \|$", readme, re.M))
    assert rows == {name: orbax for name, (_, orbax, _) in _events.EVENTS.items()}


def test_orbaxs_nearest_events_exist_in_the_installed_orbax():
    import importlib.util

    spec = importlib.util.find_spec("orbax")  # its sources are read, not imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("orbax is not installed")
    root = list(spec.submodule_search_locations)[0]
    text = ""
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                    text += f.read()
    for name, (_, nearest, _) in _events.EVENTS.items():
        assert f"'{nearest}'" in text, (name, nearest)


# --- a probe beside a running multi-process writer -----------------------------------------


@pytest.mark.multiprocess
def test_status_probes_a_directory_while_a_two_process_writer_runs(tmp_path):
    from multiprocess import WORKERS, describe_all, run_processes

    results = run_processes(WORKERS / "status_worker.py", 2, 1, {"directory": str(tmp_path / "run")}, timeout_s=240,
                            check=False)
    info = describe_all(results)
    probes = results[0].record("probes")
    flight = probes["in_flight"]
    assert flight["code"] == 0, (flight, info)
    doc = flight["doc"]
    assert (doc["latest_committed_step"], doc["step_in_flight"], doc["last_requested_step"], doc["commit_lag_steps"]) == (1, 2, 2, 1), doc
    assert doc["latest_age_s"] >= 0 and doc["failing"] is False
    bounded = probes["in_flight_bounded"]
    assert bounded["code"] == 1 and bounded["doc"]["problems"][0].startswith("commit lag 1 steps > --max-lag-steps 0"), bounded
    failing = probes["failing"]
    assert failing["code"] == 1 and failing["doc"]["failing"], failing
    assert failing["doc"]["last_failure"]["step"] == 3 and failing["doc"]["latest_committed_step"] == 2, failing
    assert failing["doc"]["step_in_flight"] is None, failing
    assert results[0].record("failures")["processes"] == [0, 1], info  # each process noted its own failure
    recovered = probes["recovered"]
    assert recovered["code"] == 0 and recovered["doc"]["latest_committed_step"] == 4, recovered
    assert recovered["doc"]["last_failure"]["step"] == 3 and not recovered["doc"]["failing"], recovered
    for r in results:
        assert r.record("done")["all_steps"] == [1, 2, 4], info
