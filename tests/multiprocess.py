"""Runs a worker script as N local JAX processes joined by `jax.distributed`.

    results = run_processes(WORKERS / "save_worker.py", 2, 4, {"path": p}, timeout_s=120)
    for r in results:
        assert r.returncode == 0, r.describe()
        r.records   # the JSON lines the worker printed with `_common.emit`

Each process gets its own environment: `XLA_FLAGS=--xla_force_host_platform_device_count=
<devices_per_process>`, `JAX_PLATFORMS=cpu`, and `MP_*` variables that
`tests/mp_workers/_common.py` reads to call `jax.distributed.initialize` against a
coordinator on a free local port (process 0 hosts the coordination service). A hard
timeout kills every process group and fails with each process's output tail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

WORKERS = Path(__file__).resolve().parent / "mp_workers"
RECORD_PREFIX = "MPRESULT "  # `_common.emit` prefixes every JSON record with this
TAIL_CHARS = 4000


class ProcessesFailed(AssertionError):
    """The processes timed out (all were killed) or one failed and the rest were stopped."""


@dataclasses.dataclass
class ProcessResult:
    """What one process did.

    Attributes:
      process_id: its `jax.process_index()`.
      returncode: the exit status (negative: killed by that signal), None if never reaped.
      stdout, stderr: everything it printed.
      elapsed_s: seconds from start to exit (or to being killed).
      killed_by_harness: True if the harness killed it (timeout or fail-fast).
    """

    process_id: int
    returncode: int | None
    stdout: str
    stderr: str
    elapsed_s: float
    killed_by_harness: bool = False

    @property
    def records(self) -> list[dict]:
        """The JSON records the worker emitted, in order."""
        out = []
        for line in self.stdout.splitlines():
            if line.startswith(RECORD_PREFIX):
                out.append(json.loads(line[len(RECORD_PREFIX):]))
        return out

    def record(self, event: str) -> dict:
        """The single record with `"event": event`; fails if there is not exactly one."""
        found = [r for r in self.records if r.get("event") == event]
        assert len(found) == 1, f"process {self.process_id}: expected one {event!r} record, got {found}\n{self.describe()}"
        return found[0]

    def describe(self) -> str:
        how = "killed by the harness" if self.killed_by_harness else f"exit {self.returncode}"
        return (
            f"--- process {self.process_id} ({how}, {self.elapsed_s:.1f} s) ---\n"
            f"stdout (tail):\n{_tail(self.stdout)}\nstderr (tail):\n{_tail(self.stderr)}"
        )

    def __iter__(self):  # (returncode, stdout, stderr) unpacking
        return iter((self.returncode, self.stdout, self.stderr))


def _tail(text: str, n: int = TAIL_CHARS) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def describe_all(results: Sequence[ProcessResult]) -> str:
    return "\n".join(r.describe() for r in results)


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # each process leads its own group
    except ProcessLookupError:
        pass


def run_processes(
    worker_script: str | os.PathLike,
    num_processes: int,
    devices_per_process: int,
    args: Mapping | None = None,
    timeout_s: float = 120.0,
    *,
    fail_fast: bool = True,
    fail_fast_grace_s: float = 20.0,
    env: Mapping[str, str] | None = None,
    heartbeat_timeout_s: int = 10,
    check: bool = True,
) -> list[ProcessResult]:
    """Starts `num_processes` processes of `worker_script` and waits for all of them.

    Args:
      worker_script: a Python file (usually in `tests/mp_workers/`) that calls
        `_common.init()` first.
      num_processes: how many JAX processes.
      devices_per_process: CPU devices each process simulates.
      args: JSON-serialisable arguments, given to every worker (`_common.init()` returns them).
      timeout_s: hard limit for the whole group, seconds; then every process group is
        killed and `ProcessesFailed` is raised with each process's output tail.
      fail_fast: once a process exits non-zero, give the others `fail_fast_grace_s`
        seconds, then kill them (peers of a dead process would only hang until
        timeout_s). Turn off when a test kills a process on purpose.
      env: extra environment variables for every process.
      heartbeat_timeout_s: `jax.distributed` heartbeat timeout (how soon a dead peer is noticed).
      check: raise `ProcessesFailed` if any process exits non-zero.
    Returns:
      One `ProcessResult` per process, by process id; unpacks as (returncode, stdout, stderr).
    """
    port = free_port()
    base_env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",) and not k.lower().endswith("_proxy")}
    tests_dir = str(Path(__file__).resolve().parent)
    base_env.update(
        {
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}",
            "JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([tests_dir, base_env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "MP_COORDINATOR": f"127.0.0.1:{port}",
            "MP_NUM_PROCESSES": str(num_processes),
            "MP_DEVICES_PER_PROCESS": str(devices_per_process),
            "MP_HEARTBEAT_TIMEOUT_S": str(heartbeat_timeout_s),
            "MP_ARGS": json.dumps(dict(args or {})),
        }
    )
    base_env.update(env or {})
    tmp = tempfile.TemporaryDirectory(prefix="mp-")
    procs, files, started = [], [], time.monotonic()
    ended: dict[int, float] = {}
    killed: set[int] = set()
    try:
        for i in range(num_processes):
            out = open(os.path.join(tmp.name, f"{i}.out"), "w+b")
            err = open(os.path.join(tmp.name, f"{i}.err"), "w+b")
            files.append((out, err))
            procs.append(
                subprocess.Popen(
                    [sys.executable, os.fspath(worker_script)],
                    env={**base_env, "MP_PROCESS_ID": str(i)},
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group, killed as a whole
                )
            )
        deadline = started + timeout_s
        first_failure: float | None = None
        timed_out = False
        while len(ended) < num_processes:
            now = time.monotonic()
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = now - started
                    if p.returncode != 0 and first_failure is None:
                        first_failure = now
            if len(ended) == num_processes:
                break
            if now > deadline:
                timed_out = True
            if timed_out or (fail_fast and first_failure is not None and now > first_failure + fail_fast_grace_s):
                for i, p in enumerate(procs):
                    if i not in ended:
                        _kill_group(p)
                        killed.add(i)
                for i, p in enumerate(procs):
                    if i not in ended:
                        p.wait()
                        ended[i] = time.monotonic() - started
                break
            time.sleep(0.05)
        results = []
        for i, (p, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0)
            err.seek(0)
            results.append(
                ProcessResult(
                    i, p.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"), ended[i], i in killed
                )
            )
    finally:
        for p in procs:  # never leave a process behind, whatever happened above
            if p.poll() is None:
                _kill_group(p)
                p.wait()
        for out, err in files:
            out.close()
            err.close()
        tmp.cleanup()
    if timed_out:
        raise ProcessesFailed(
            f"{worker_script}: {num_processes} processes did not finish within {timeout_s:.0f} s; all were killed.\n"
            + describe_all(results)
        )
    if check and any(r.returncode != 0 for r in results):
        raise ProcessesFailed(f"{worker_script}: a process failed.\n" + describe_all(results))
    return results
