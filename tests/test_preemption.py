"""Saving on preemption (issue 22 item 1): `CheckpointManager(save_on_preemption=True)`
and `mgr.reached_preemption(step)`.

Real processes: SIGTERM to process 1 only of a 2-process job (JAX's preemption sync
point), and to a one-process job (the manager's SIGTERM handler); both save the same
step, exit 0, and the step restores on another mesh. In this process: the handler's
chaining and restoring, the main-thread rule, JAX's sync point asked once per step, and
the preemption-aware loop of docs/operating.md run as written.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P
from multiprocess import WORKERS, describe_all, run_processes

import checkpointer as ckpt
from checkpointer._manage import _preemption

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def sigterm():
    """Leaves SIGTERM's handler as it found it, whatever the test does."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _tree(step):
    return {"w": np.full((8, 8), step, np.float32), "step": step}


def _check_restores_on_another_mesh(directory, step):
    mesh = make_mesh((4, 2), ("x", "y"))
    target = {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(mesh, P("y", "x"))), "step": None}
    got = ckpt.CheckpointManager(directory, read_only=True).restore(step, target)
    want = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step
    np.testing.assert_array_equal(np.asarray(got["w"]), want)
    assert got["w"].sharding == NamedSharding(mesh, P("y", "x")) and got["step"] == step


# --- real processes ------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_sigterm_to_process_1_only_makes_both_processes_save_the_same_step_and_exit_0(tmp_path):
    directory = str(tmp_path / "run")
    args = {"directory": directory, "signalled": [1], "signal_at": 3, "max_steps": 2000, "pause_s": 0.01}
    results = run_processes(WORKERS / "preempt_worker.py", 2, 2, args, timeout_s=240)  # exit 0, or it raises
    info = describe_all(results)
    got = [r.record("preempted") for r in results]
    step = got[0]["step"]
    assert got[1]["step"] == step and step >= 3, info  # the sync point: the same step on both
    assert all(g["mode"] == _preemption.JAX_SYNC_POINT for g in got), info  # JAX's notifier owned SIGTERM
    assert all(g["saved"] and g["committed_on_return"] for g in got), info  # off the interval, committed
    assert got[0]["all_steps"] == [step], info
    _check_restores_on_another_mesh(directory, step)


@pytest.mark.multiprocess
def test_sigterm_to_a_one_process_job_saves_that_step_and_exits_0(tmp_path):
    directory = str(tmp_path / "run")
    args = {"directory": directory, "signalled": [0], "signal_at": 3, "max_steps": 2000, "pause_s": 0.0}
    results = run_processes(WORKERS / "preempt_worker.py", 1, 4, args, timeout_s=240, distributed=False)
    got = results[0].record("preempted")
    assert got["mode"] == _preemption.SIGTERM_HANDLER, describe_all(results)
    assert got["step"] == 3 and got["saved"] and got["committed_on_return"], got  # the first step asked after it
    assert got["all_steps"] == [3], got
    _check_restores_on_another_mesh(directory, 3)


# --- this process: the SIGTERM handler -----------------------------------------------------


@pytest.mark.usefixtures("sigterm")
def test_the_sigterm_handler_chains_to_an_earlier_python_handler_and_close_restores_it(tmp_path):
    calls = []

    def earlier(signum, frame):
        calls.append(signum)

    signal.signal(signal.SIGTERM, earlier)
    mgr = ckpt.CheckpointManager(str(tmp_path / "run"), save_interval_steps=100)
    assert signal.getsignal(signal.SIGTERM) is not earlier
    assert mgr.save(1, _tree(1)) is False and mgr.reached_preemption(1) is False  # off the interval
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == [signal.SIGTERM]  # the earlier handler ran too
    assert mgr.save(7, _tree(7)) is True  # off the interval, written because of the notice
    assert mgr.all_steps() == [7]  # committed before save returned (async_save is on)
    assert mgr.reached_preemption(7) is True and mgr.reached_preemption(8) is False
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) is earlier


@pytest.mark.usefixtures("sigterm")
def test_the_sigterm_handler_never_calls_the_default_action(tmp_path):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with ckpt.CheckpointManager(str(tmp_path / "run"), save_interval_steps=100) as mgr:
        os.kill(os.getpid(), signal.SIGTERM)  # the default action would end this test's process
        assert mgr.save(5, _tree(5)) and mgr.reached_preemption(5)
        assert mgr.all_steps() == [5]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.usefixtures("sigterm")
def test_a_manager_opened_off_the_main_thread_installs_no_handler(tmp_path, caplog):
    before = signal.getsignal(signal.SIGTERM)
    made = []
    thread = threading.Thread(target=lambda: made.append(ckpt.CheckpointManager(str(tmp_path / "run"))))
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGTERM) is before
    assert made[0]._preemption.mode == _preemption.OFF
    assert "main thread" in caplog.text
    made[0].close()


@pytest.mark.usefixtures("sigterm")
def test_save_on_preemption_false_and_read_only_managers_install_no_handler(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with ckpt.CheckpointManager(str(tmp_path / "a"), save_on_preemption=False) as mgr:
        assert signal.getsignal(signal.SIGTERM) is before and not mgr.reached_preemption(0)
    with ckpt.CheckpointManager(str(tmp_path / "b"), read_only=True):
        assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.usefixtures("sigterm")
def test_under_jax_distributed_jax_owns_sigterm_and_its_sync_point_is_asked_once_per_step(tmp_path, monkeypatch):
    class State:
        client = object()  # jax.distributed is initialized
        preemption_sync_manager = object()

    asked = []
    monkeypatch.setattr(_preemption, "_distributed_state", lambda: State)
    monkeypatch.setattr(_preemption, "_jax_sync_point", lambda step: asked.append(step) or step == 5)
    before = signal.getsignal(signal.SIGTERM)
    with ckpt.CheckpointManager(str(tmp_path / "run"), save_interval_steps=100) as mgr:
        assert signal.getsignal(signal.SIGTERM) is before  # no handler of the library's
        for step in range(1, 10):
            mgr.save(step, _tree(step))
            if mgr.reached_preemption(step):
                break
        assert step == 5 and mgr.all_steps() == [5]
    assert asked == [1, 2, 3, 4, 5]  # save and reached_preemption of one step: one question


@pytest.mark.usefixtures("sigterm")
def test_a_preempted_save_with_two_tiers_is_durable_when_save_returns(tmp_path):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local_directory=local, save_interval_steps=100) as mgr:
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.save(3, _tree(3)) and mgr.reached_preemption(3)
        assert mgr.all_steps() == [3]  # replicated and committed on the durable tier already
    assert ckpt.restore(f"{durable}/3")["step"] == 3


# --- the docs' loop (docs/operating.md), as written ---------------------------------------------------------


def _readme_loop(directory: str) -> str:
    readme = (ROOT / "docs" / "operating.md").read_text()
    imports = re.search(r"^import jax, numpy as np, checkpointer as ckpt$", readme, re.M).group(0)
    start = readme.index('state = {"w": np.zeros((256, 256), np.float32), "step": 0}\n')
    code = readme[start: readme.index("```", start)]
    assert '"/tmp/preemptible"' in code and "mgr.reached_preemption(step)" in code
    return imports + "\n" + code.replace('"/tmp/preemptible"', repr(directory))


def _run_until_preempted(code: str, directory: str, committed_before: int, log_path: Path) -> None:
    """Runs `code` in a fresh interpreter, sends it SIGTERM once a step newer than
    `committed_before` is committed, and waits for it to exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    with open(log_path, "wb") as out, subprocess.Popen([sys.executable, "-c", code], env=env, stdout=out,
                                                       stderr=subprocess.STDOUT) as proc:
        reader = ckpt.CheckpointManager(directory, read_only=True)
        deadline = time.monotonic() + 180
        while (reader.latest_step() or -1) <= committed_before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=180)
    text = log_path.read_text(errors="replace")
    assert proc.returncode == 0, text  # stopped by the loop, not killed by the signal
    assert "SIGTERM received" in text, text  # by the preemption, not the end of the range


def test_the_docs_preemption_loop_runs_as_written_and_resumes(tmp_path):
    directory = str(tmp_path / "run")
    code = _readme_loop(directory)
    _run_until_preempted(code, directory, -1, tmp_path / "first.log")
    reader = ckpt.CheckpointManager(directory, read_only=True)
    first = reader.latest_step()
    assert first is not None and first < 999_999
    got = reader.restore(first)
    assert got["step"] == first and np.all(np.asarray(got["w"]) == first + 1)  # the state of that step
    _run_until_preempted(code, directory, first, tmp_path / "second.log")  # a resumed job, preempted again
    second = reader.latest_step()
    got = reader.restore(second)
    assert second > first and got["step"] == second
    assert np.all(np.asarray(got["w"]) == second + 1)  # it went on from the restored state


@pytest.mark.usefixtures("sigterm")
def test_two_managers_closed_in_opening_order_give_sigterm_back_its_earlier_handler(tmp_path):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    first = ckpt.CheckpointManager(str(tmp_path / "a"))
    second = ckpt.CheckpointManager(str(tmp_path / "b"))
    first.close()  # not the newest handler: stays, chained from the second's
    second.close()
    # Else the first's closed handler is back, and it swallows every later SIGTERM.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_manager_closed_off_the_main_thread_lets_the_next_sigterm_end_the_process(tmp_path):
    code = f"""
import os, signal, threading
import checkpointer as ckpt
mgr = ckpt.CheckpointManager({str(tmp_path / "run")!r})
closer = threading.Thread(target=mgr.close)  # its handler cannot be restored from there
closer.start()
closer.join()
os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends here
print("survived SIGTERM", flush=True)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert "closed off the main thread" in proc.stderr
