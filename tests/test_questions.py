"""The questions a training loop asks its manager (issue 22 item 2): best_step, metrics,
user_metadata (from the manifest alone) and delete."""

import os
import shutil
import threading

import numpy as np
import pytest

import checkpointer as ckpt
from checkpointer._save import _pipeline as _save

OPERATING = os.path.join(os.path.dirname(__file__), "..", "docs", "operating.md")  # the page that shows the questions


def _tree(step):
    return {"w": np.full((4, 8), step, np.float32), "b": np.arange(3, dtype=np.int32) + step}


def _run(directory, losses, **kw):
    """A manager run saving step i with metrics loss=losses[i] (None: no metrics)."""
    mgr = ckpt.CheckpointManager(directory, keep=ckpt.KeepLatest(100), async_save=False, **kw)
    for step, loss in losses.items():
        mgr.save(step, _tree(step), metrics=None if loss is None else {"loss": loss, "acc": -loss},
                 metadata={"epoch": step // 2, "note": f"step {step}"})
    return mgr


def test_best_step_ranks_by_min_or_max_and_ignores_steps_without_the_metric_or_with_nan(tmp_path):
    d = str(tmp_path / "run")
    with _run(d, {1: 0.9, 2: 0.3, 3: float("nan"), 4: None, 5: 0.6}) as mgr:
        assert mgr.best_step("loss") == 2
        assert mgr.best_step("loss", mode="max") == 1
        assert mgr.best_step("acc", mode="max") == 2
        with pytest.raises(ckpt.UnknownMetricError, match=r"no such metric.*the metrics saved are \['acc', 'loss'\]") as e:
            mgr.best_step("no such metric")
        assert isinstance(e.value, KeyError)
        with pytest.raises(ValueError, match="'min' or 'max'"):
            mgr.best_step("loss", mode="lowest")
    # A new manager (a resumed job) reads the same answers from the manifests.
    with ckpt.CheckpointManager(d, read_only=True) as reader:
        assert reader.best_step("loss") == 2
        assert reader.best_step("loss", mode="max") == 1


def test_best_step_ties_go_to_the_newer_step(tmp_path):
    with _run(str(tmp_path / "run"), {1: 0.5, 2: 0.5, 3: 0.7}) as mgr:
        assert mgr.best_step("loss") == 2


def test_metrics_of_a_step_as_saved_and_not_found_for_an_absent_one(tmp_path):
    d = str(tmp_path / "run")
    _run(d, {1: 0.9, 2: float("nan"), 3: None}).close()
    with ckpt.CheckpointManager(d, read_only=True) as mgr:
        assert mgr.metrics(1) == {"loss": 0.9, "acc": -0.9}
        assert mgr.metrics(2) == {"loss": "NaN", "acc": "NaN"}
        assert mgr.metrics(3) == {}
        with pytest.raises(ckpt.CheckpointNotFoundError, match=r"step 7 is not a committed step .* \[1, 2, 3\]"):
            mgr.metrics(7)


def test_user_metadata_and_metrics_are_read_without_the_arrays(tmp_path):
    d = str(tmp_path / "run")
    _run(d, {1: 0.9, 2: 0.4}).close()
    for step in (1, 2):  # only the manifest is left to read
        shutil.rmtree(os.path.join(d, str(step), "arrays"), ignore_errors=True)
        for name in os.listdir(os.path.join(d, str(step))):
            if name not in ("manifest.json", "COMMITTED"):
                path = os.path.join(d, str(step), name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    with ckpt.CheckpointManager(d, read_only=True) as mgr:
        assert mgr.user_metadata(1) == {"epoch": 0, "note": "step 1"}
        assert mgr.user_metadata() == {"epoch": 1, "note": "step 2"}  # the newest step
        assert mgr.metrics(2) == {"loss": 0.4, "acc": -0.4}
        assert mgr.best_step("loss") == 2
        with pytest.raises(ckpt.CheckpointNotFoundError):
            mgr.user_metadata(5)


def test_delete_removes_the_step_from_listings_and_storage(tmp_path):
    d = str(tmp_path / "run")
    with _run(d, {1: 0.9, 2: 0.4, 3: 0.5}) as mgr:
        assert mgr.best_step("loss") == 2
        mgr.delete(2)
        assert mgr.all_steps() == [1, 3]
        assert not os.path.exists(os.path.join(d, "2"))
        assert not [n for n in os.listdir(d) if n.startswith("2.")]  # nothing left behind
        assert mgr.best_step("loss") == 3  # not answered from the cache of a deleted step
        with pytest.raises(ckpt.CheckpointNotFoundError, match="step 2 is not a committed step"):
            mgr.metrics(2)
        with pytest.raises(ckpt.CheckpointNotFoundError, match="step 2 is not a committed step"):
            mgr.delete(2)
        mgr.delete(3)  # the newest, with no save in flight
        assert mgr.all_steps() == [1]


def test_delete_on_a_read_only_manager_raises_and_deletes_nothing(tmp_path):
    d = str(tmp_path / "run")
    _run(d, {1: 0.9, 2: 0.4}).close()
    with ckpt.CheckpointManager(d, read_only=True) as mgr:
        with pytest.raises(ckpt.CheckpointError, match="read_only"):
            mgr.delete(1)
        assert mgr.all_steps() == [1, 2]


def test_delete_refuses_the_newest_committed_step_while_a_save_is_in_flight(tmp_path, monkeypatch):
    d = str(tmp_path / "run")
    release = threading.Event()
    real = _save.write_snapshot

    def held(snap):
        release.wait(60)
        return real(snap)

    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(10)) as mgr:
        mgr.save(1, _tree(1))
        mgr.save(2, _tree(2))
        mgr.wait_until_finished()
        monkeypatch.setattr(_save, "write_snapshot", held)
        mgr.save(3, _tree(3))  # in flight until released
        try:
            with pytest.raises(ckpt.CheckpointError, match=r"step 2 is the newest committed step and step 3 is still being saved"):
                mgr.delete(2)
            mgr.delete(1)  # an older step may go meanwhile
        finally:
            release.set()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]
        mgr.delete(2)
        assert mgr.all_steps() == [3]


def test_delete_refuses_the_newest_durable_step_while_the_next_is_being_replicated(tmp_path, monkeypatch):
    from checkpointer._manage import _tiers

    release = threading.Event()
    real = _tiers.replicate

    def held(*args, **kwargs):
        release.wait(60)
        return real(*args, **kwargs)

    with ckpt.CheckpointManager(str(tmp_path / "run"), local_directory=str(tmp_path / "local"),
                                keep=ckpt.KeepLatest(10)) as mgr:
        mgr.save(1, _tree(1))
        mgr.wait_until_finished()
        monkeypatch.setattr(_tiers, "replicate", held)
        mgr.save(2, _tree(2))
        try:
            mgr._in_flight[-1][1].join()  # committed locally; its replication waits
            assert mgr.all_steps() == [1]
            with pytest.raises(ckpt.CheckpointError, match=r"step 1 is the newest committed step and step 2 is still being saved"):
                mgr.delete(1)  # else no durable resume point if the replication fails
        finally:
            release.set()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_replacement_of_a_step_leaves_its_committed_metrics(tmp_path, monkeypatch, async_save):
    def failing(snap):
        raise ckpt.SaveError(f"writing {snap.write_path} failed (process 0): OSError: disk gone")

    with ckpt.CheckpointManager(str(tmp_path / "run"), keep=ckpt.KeepLatest(10), async_save=async_save) as mgr:
        mgr.save(1, _tree(1), metrics={"loss": 2.0})
        mgr.save(2, _tree(2), metrics={"loss": 1.0})
        mgr.wait_until_finished()
        monkeypatch.setattr(_save, "write_snapshot", failing)
        with pytest.raises(ckpt.CheckpointError):
            mgr.save(1, _tree(1), metrics={"loss": 0.0}, force=True)  # fails: step 1 keeps loss 2.0
            mgr.wait_until_finished()
        monkeypatch.undo()
        assert mgr.all_steps() == [1, 2]
        assert mgr.metrics(1) == {"loss": 2.0}
        assert mgr.best_step("loss") == 2


def test_the_docs_snippet_of_the_managers_questions_runs_as_written(tmp_path):
    with open(OPERATING, encoding="utf-8") as f:
        readme = f.read()
    start = readme.index("import numpy as np\nimport checkpointer as ckpt\n\nwith ckpt.CheckpointManager(\"/tmp/questions\"")
    code = readme[start : readme.index("```", start)]
    code = code.replace('"/tmp/questions"', repr(str(tmp_path / "questions")))
    scope: dict = {}
    exec(compile(code, "docs/operating.md", "exec"), scope)  # noqa: S102 (the page's own snippet)
    assert scope["best"] == 2
    assert scope["steps"] == [2, 3]


@pytest.mark.multiprocess
def test_every_process_gets_the_same_answers_and_deletes_together(tmp_path):
    from multiprocess import WORKERS, describe_all, run_processes

    d = tmp_path / "run"
    results = run_processes(WORKERS / "questions_worker.py", 2, 1, {"directory": str(d)}, timeout_s=180)
    info = describe_all(results)
    for r in results:
        got = r.record("answers")
        assert (got["best"], got["metrics"], got["metadata"]) == (2, {"loss": 0.2}, {"epoch": 2}), info
        assert got["after_delete"] == [1, 3], info  # process 0 deleted before either returned
        assert got["absent"][0] == "CheckpointNotFoundError" and "step 7 is not a committed step" in got["absent"][1], info
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == ["1", "3"]


def test_best_step_follows_the_mode_of_the_managers_keep_best_and_an_explicit_mode_wins(tmp_path):
    """Issue 25 item 4: a manager keeping KeepBest("acc", mode="max") ranks acc by max."""
    d = str(tmp_path / "run")
    keep = ckpt.KeepLatest(5) | ckpt.KeepBest("acc", mode="max")
    with ckpt.CheckpointManager(d, keep=keep, async_save=False) as mgr:
        assert mgr.best_step("acc") is None  # nothing committed yet: no number for it, no error
        for step, acc in ((1, 0.5), (2, 0.9), (3, 0.7)):
            mgr.save(step, _tree(step), metrics={"acc": acc, "loss": 1 - acc})
        assert mgr.best_step("acc") == 2
        assert mgr.best_step("acc", mode="min") == 1
        assert mgr.best_step("loss") == 2  # no KeepBest for loss: "min"
        with pytest.raises(ckpt.UnknownMetricError, match=r"'accuracy'.*\['acc', 'loss'\]"):
            mgr.best_step("accuracy")


def test_best_step_is_none_while_no_committed_step_has_a_number_for_a_metric_that_was_passed(tmp_path):
    d = str(tmp_path / "run")
    with _run(d, {1: float("nan"), 2: None}) as mgr:
        assert mgr.best_step("loss") is None
