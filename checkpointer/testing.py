"""Run a function or a script as N local JAX processes, for tests and examples.

    from . import testing

    def work(path):                    # module level; runs in every process
        ...                            # jax.distributed is already initialized
        testing.emit(event="saved", bytes=123)

    results = testing.run_processes(work, 2, 4, {"path": "/tmp/run"}, timeout_s=120)
    results[1].record("saved")         # {"event": "saved", "bytes": 123, "process": 1, ...}

Each process is a fresh Python interpreter on this machine with its own CPU device
count (`XLA_FLAGS=--xla_force_host_platform_device_count=<devices_per_process>`,
`JAX_PLATFORMS=cpu`), joined to the others by `jax.distributed` (gloo collectives, a
coordinator on a free port of 127.0.0.1 served by process 0). The harness collects each
process's output, enforces a timeout and kills every process it started before returning.

Worker side: a function target is called after `initialize()`; a script target calls
`initialize()` itself, first thing. `emit` reports JSON records to the parent and
`kill_job` ends a job by SIGKILL the way a preemption does.

Not part of the front-door API: `import checkpointer` does not import this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from ._errors import ProcessesFailed

RECORD_PREFIX = "CHECKPOINTER_RECORD "  # `emit` prefixes each JSON record line with this
TAIL_CHARS = 4000  # output shown per process when a job fails
POLL_INTERVAL_S = 0.05

# What the harness tells each process (read by `initialize`).
_ENV = "CHECKPOINTER_TESTING_"
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_T0_S = time.monotonic()
_alive_lock_fd: int | None = None  # held for the life of a worker process (see `kill_job`)


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """What one process of a job did.

    Attributes:
        process_id: Its `jax.process_index()`.
        returncode: Its exit status (negative: killed by that signal).
        stdout: Everything it printed on stdout, records included.
        stderr: Everything it printed on stderr.
        elapsed_s: Seconds from the job's start to this process's exit.
        killed_by_harness: True if the harness killed it (timeout or fail-fast).
    """

    process_id: int
    returncode: int | None
    stdout: str
    stderr: str
    elapsed_s: float
    killed_by_harness: bool = False

    @property
    def records(self) -> list[dict[str, Any]]:
        """The records the process emitted with `emit`, in order."""
        return [
            json.loads(line[len(RECORD_PREFIX):])
            for line in self.stdout.splitlines()
            if line.startswith(RECORD_PREFIX)
        ]

    def record(self, event: str) -> dict[str, Any]:
        """Returns the one record with `"event": event`.

        Raises:
            AssertionError: There is not exactly one such record (with this process's
                output in the message).
        """
        found = [r for r in self.records if r.get("event") == event]
        if len(found) != 1:
            raise AssertionError(
                f"process {self.process_id}: expected one {event!r} record, found {len(found)}\n"
                f"{self.describe()}"
            )
        return found[0]

    def describe(self) -> str:
        """How the process ended, with the tail of its stdout and stderr."""
        how = "killed by the harness" if self.killed_by_harness else f"exit {self.returncode}"
        return (
            f"--- process {self.process_id} ({how}, {self.elapsed_s:.1f} s) ---\n"
            f"stdout (tail):\n{_tail(self.stdout)}\nstderr (tail):\n{_tail(self.stderr)}"
        )


def _tail(text: str) -> str:
    return text if len(text) <= TAIL_CHARS else "..." + text[-TAIL_CHARS:]


def describe_all(results: Sequence[ProcessResult]) -> str:
    """`ProcessResult.describe` of every process, one after the other."""
    return "\n".join(r.describe() for r in results)


def free_port() -> int:
    """Returns a TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _target_command(target: str | os.PathLike | Callable[..., Any]) -> tuple[list[str], dict[str, str]]:
    """The command line (and extra environment) that runs `target` in a worker process."""
    if not callable(target):
        return [sys.executable, os.fspath(target)], {}
    module, qualname = target.__module__, target.__qualname__
    if "<" in qualname:
        raise ValueError(
            f"run_processes needs a module-level function, got {qualname!r}: a worker process "
            "imports it by name, so lambdas and nested functions cannot be run"
        )
    if module == "__main__":  # the running script: the worker loads it from its file
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        if main_file is None:
            raise ValueError(f"{qualname} is defined in an interactive session; define it in a file")
        module = os.path.abspath(main_file)
    bootstrap = "from checkpointer.testing import _run_function; _run_function()"
    return [sys.executable, "-c", bootstrap], {_ENV + "FUNCTION": f"{module}:{qualname}"}


def _worker_env(
    num_processes: int,
    devices_per_process: int,
    job_dir: str,
    heartbeat_timeout_s: int,
    recoverable: bool,
    distributed: bool,
) -> dict[str, str]:
    """The environment shared by every process of a job (`initialize` reads it)."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}  # gRPC to 127.0.0.1
    other_flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    pythonpath = [_PACKAGE_ROOT, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(
        XLA_FLAGS=" ".join([*other_flags, f"{_DEVICE_COUNT_FLAG}={devices_per_process}"]),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(pythonpath),  # the workers import this very checkpointer
    )
    env.update({
        _ENV + "COORDINATOR": f"127.0.0.1:{free_port()}",
        _ENV + "NUM_PROCESSES": str(num_processes),
        _ENV + "DEVICES_PER_PROCESS": str(devices_per_process),
        _ENV + "HEARTBEAT_TIMEOUT_S": str(heartbeat_timeout_s),
        _ENV + "RECOVERABLE": "1" if recoverable else "0",
        _ENV + "DISTRIBUTED": "1" if distributed else "0",
        _ENV + "JOB_DIR": job_dir,
    })
    return env


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # each process leads its own group
    except ProcessLookupError:
        pass


class _Echo:
    """Copies the lines process 0 prints (records left out) to this process's stdout."""

    def __init__(self, file: BinaryIO):
        self._file = file
        self._pending = b""

    def pump(self, final: bool = False) -> None:
        self._pending += self._file.read()
        lines = self._pending.split(b"\n")
        self._pending = b"" if final else lines.pop()
        for line in lines:
            if line and not line.startswith(RECORD_PREFIX.encode()):
                sys.stdout.write(line.decode(errors="replace") + "\n")
        sys.stdout.flush()


def _kill_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            _kill_group(process)
            process.wait()


def _wait(
    processes: list[subprocess.Popen],
    timeout_s: float,
    expected_returncode: int,
    fail_fast_grace_s: float | None,
    echo: _Echo | None,
) -> tuple[list[float], set[int], bool]:
    """Waits for every process, killing them all at the timeout or after a failure's grace.

    Returns:
        Seconds from now to each process's end, the ids of the processes it killed, and
        whether the timeout struck.
    """
    start_s = time.monotonic()
    ended_s: dict[int, float] = {}
    killed: set[int] = set()
    first_failure_s = None
    timed_out = False
    while len(ended_s) < len(processes):
        time.sleep(POLL_INTERVAL_S)
        now_s = time.monotonic()
        for i, process in enumerate(processes):
            if i not in ended_s and process.poll() is not None:
                ended_s[i] = now_s - start_s
                if process.returncode != expected_returncode and first_failure_s is None:
                    first_failure_s = now_s
        running = [i for i in range(len(processes)) if i not in ended_s]
        timed_out = bool(running) and now_s > start_s + timeout_s
        gave_up = fail_fast_grace_s is not None and first_failure_s is not None and (
            now_s > first_failure_s + fail_fast_grace_s
        )
        if running and (timed_out or gave_up):
            for i in running:
                _kill_group(processes[i])
                processes[i].wait()
                killed.add(i)
                ended_s[i] = time.monotonic() - start_s
        if echo is not None:
            echo.pump()
    if echo is not None:
        echo.pump(final=True)
    return [ended_s[i] for i in range(len(processes))], killed, timed_out


def run_processes(
    target: str | os.PathLike | Callable[..., Any],
    num_processes: int,
    devices_per_process: int,
    args: Mapping[str, Any] | None = None,
    timeout_s: float = 120.0,
    *,
    expected_returncode: int = 0,
    fail_fast: bool = True,
    fail_fast_grace_s: float = 20.0,
    env: Mapping[str, str] | None = None,
    heartbeat_timeout_s: int = 10,
    recoverable: bool = False,
    check: bool = True,
    echo: bool = False,
    distributed: bool = True,
) -> list[ProcessResult]:
    """Runs `target` as `num_processes` JAX processes and waits for all of them.

    Args:
        target: A module-level function, called as `target(**args)` in every process
            once `jax.distributed` is initialized (a function of the running script is
            loaded from the script's file, its `if __name__ == "__main__"` block skipped);
            or the path of a Python script that calls `initialize()` first.
        num_processes: How many JAX processes.
        devices_per_process: CPU devices each process simulates.
        args: JSON-serializable keyword arguments, the same for every process.
        timeout_s: Limit for the whole job, seconds; then every process is killed and
            `ProcessesFailed` is raised.
        expected_returncode: The exit status of a process that did its job, e.g.
            `-signal.SIGKILL` for a job that ends with `kill_job`.
        fail_fast: Once a process ends with another status, give the others
            `fail_fast_grace_s` seconds, then kill them (a peer of a dead process would
            hang in a collective until `timeout_s`). Turn off when a process is killed
            on purpose.
        fail_fast_grace_s: See `fail_fast`, seconds.
        env: Extra environment variables for every process.
        heartbeat_timeout_s: `jax.distributed`'s heartbeat timeout, i.e. how soon a
            dead peer is noticed, seconds.
        recoverable: Set `jax_enable_recoverability`, so that the job goes on after a
            peer died instead of the coordination service aborting every process.
        check: Raise `ProcessesFailed` if a process ends with another status than
            `expected_returncode`.
        echo: Copy what process 0 prints on stdout (records left out) to this
            process's stdout as it arrives, e.g. for an example's progress report.
        distributed: Join the processes with `jax.distributed` (gloo collectives).
            False runs each process as a job of its own, without it (a one-host job,
            or independent programs on one directory: a writer and an evaluation
            job); JAX then sees one process in each.

    Returns:
        One `ProcessResult` per process, by process id.

    Raises:
        ProcessesFailed: The job timed out, or (with `check`) a process ended with an
            unexpected status; the message holds every process's output tail.
        ValueError: `target` is a lambda or a nested function.
    """
    command, target_env = _target_command(target)
    with contextlib.ExitStack() as stack:
        job_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="checkpointer-testing-"))
        Path(job_dir, "args.json").write_text(json.dumps(dict(args or {})))
        base_env = _worker_env(
            num_processes, devices_per_process, job_dir, heartbeat_timeout_s, recoverable, distributed
        )
        base_env.update(target_env)
        base_env.update(env or {})
        processes: list[subprocess.Popen] = []
        stack.callback(_kill_all, processes)  # never leave a process behind, whatever happens
        outputs = []
        for i in range(num_processes):
            out = stack.enter_context(open(os.path.join(job_dir, f"{i}.out"), "w+b"))
            err = stack.enter_context(open(os.path.join(job_dir, f"{i}.err"), "w+b"))
            outputs.append((out, err))
            processes.append(subprocess.Popen(
                command, env={**base_env, _ENV + "PROCESS_ID": str(i)}, stdout=out, stderr=err,
                stdin=subprocess.DEVNULL, start_new_session=True,  # its own group, killed as a whole
            ))
        echo_to = _Echo(stack.enter_context(open(os.path.join(job_dir, "0.out"), "rb"))) if echo else None
        grace_s = fail_fast_grace_s if fail_fast else None
        ended_s, killed, timed_out = _wait(processes, timeout_s, expected_returncode, grace_s, echo_to)
        results = []
        for i, (process, (out, err)) in enumerate(zip(processes, outputs)):
            out.seek(0)
            err.seek(0)
            results.append(ProcessResult(
                i, process.returncode, out.read().decode(errors="replace"),
                err.read().decode(errors="replace"), ended_s[i], i in killed,
            ))
    name = getattr(target, "__qualname__", target)
    if timed_out:
        raise ProcessesFailed(
            f"{name}: {num_processes} processes did not finish within {timeout_s:.0f} s; all were "
            f"killed.\n{describe_all(results)}"
        )
    if check and any(r.returncode != expected_returncode for r in results):
        raise ProcessesFailed(
            f"{name}: a process did not exit with status {expected_returncode}.\n{describe_all(results)}"
        )
    return results


# ----------------------------------------------------------------------------------------
# Worker side: what runs inside the processes `run_processes` starts.
# ----------------------------------------------------------------------------------------


def process_id() -> int:
    """This worker's process id, from the harness (usable before JAX is initialized)."""
    return int(os.environ[_ENV + "PROCESS_ID"])


def initialize() -> dict[str, Any]:
    """Joins this worker to its job; call it first in a worker script.

    Selects gloo CPU collectives and initializes `jax.distributed` against process 0's
    coordinator (60 s to connect, 30 s for the shutdown barrier, the heartbeat timeout
    the harness was given) unless the job runs with `distributed=False`. Reports an
    uncaught exception as an `"exception"` record before the traceback, and sends what
    native code prints on stdout (gloo's connection lines) to stderr, so that stdout
    holds only what Python prints.

    Returns:
        The `args` given to `run_processes`.

    Raises:
        KeyError: Not started by `run_processes` (its environment variables are absent).
        RuntimeError: JAX sees another process or device count than the harness asked
            for (JAX was initialized before this call with other `XLA_FLAGS`).

    Multi-process: every process of the job calls it.
    """
    num_processes = int(os.environ[_ENV + "NUM_PROCESSES"])
    devices_per_process = int(os.environ[_ENV + "DEVICES_PER_PROCESS"])
    import jax

    _hold_alive_lock()  # before the first collective, so before process 0 can wait on it
    _divert_native_stdout()
    if os.environ[_ENV + "DISTRIBUTED"] == "1":
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except AttributeError:  # option absent in this jax version
            pass
        if os.environ[_ENV + "RECOVERABLE"] == "1":
            jax.config.update("jax_enable_recoverability", True)
        jax.distributed.initialize(
            coordinator_address=os.environ[_ENV + "COORDINATOR"],
            num_processes=num_processes,
            process_id=process_id(),
            initialization_timeout=60,
            heartbeat_timeout_seconds=int(os.environ[_ENV + "HEARTBEAT_TIMEOUT_S"]),
            shutdown_timeout_seconds=30,
        )
        if process_id() == 0 and num_processes > 1:
            _shut_service_down_last(num_processes)
    # Without jax.distributed each process is a job of its own (e.g. a writer and a
    # separate evaluation job): JAX sees one process there.
    jax_processes = num_processes if os.environ[_ENV + "DISTRIBUTED"] == "1" else 1
    if jax.process_count() != jax_processes or jax.local_device_count() != devices_per_process:
        raise RuntimeError(
            f"process {process_id()}: expected {num_processes} processes x {devices_per_process} devices, "
            f"JAX sees {jax.process_count()} x {jax.local_device_count()}; was JAX initialized before "
            "initialize() with other XLA_FLAGS?"
        )
    sys.excepthook = _report_exception
    return json.loads(Path(os.environ[_ENV + "JOB_DIR"], "args.json").read_text())


def _divert_native_stdout() -> None:
    """Points file descriptor 1 at stderr; `sys.stdout` keeps the original stdout."""
    sys.stdout.flush()
    python_stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(python_stdout, "w", buffering=1)


def _report_exception(exc_type, exc, tb) -> None:
    emit(event="exception", type=exc_type.__name__, message=str(exc),
         traceback="".join(traceback.format_exception(exc_type, exc, tb)))
    sys.__excepthook__(exc_type, exc, tb)


def emit(**record: Any) -> None:
    """Reports one JSON record to the parent (`ProcessResult.records`).

    The record gets `"process"` (this process id) and `"t"` (seconds since the worker
    started) unless given.

    Args:
        **record: JSON-serializable fields; by convention `event` names the record.
    """
    record.setdefault("process", process_id())
    record.setdefault("t", round(time.monotonic() - _T0_S, 3))
    sys.stdout.write(RECORD_PREFIX + json.dumps(record) + "\n")
    sys.stdout.flush()


def _alive_lock_path(process: int) -> str:
    return os.path.join(os.environ[_ENV + "JOB_DIR"], f"{process}.alive")


def _hold_alive_lock() -> None:
    """Locks this process's `alive` file; the kernel releases the lock when it dies."""
    global _alive_lock_fd
    _alive_lock_fd = os.open(_alive_lock_path(process_id()), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(_alive_lock_fd, fcntl.LOCK_EX)


class _ServiceShutDownLast:
    """Stands in for process 0's coordination service in `jax.distributed`'s state so
    that, at exit, the service is destroyed only once every other process of the job
    has exited (or after `_PEERS_EXIT_WAIT_S`). JAX's exit hook shuts the client down
    (the shutdown barrier) and then the service at once; a peer still disconnecting
    from it then aborted process 0 inside grpc's server destructor (SIGABRT in
    `DistributedRuntimeService::Shutdown`), after its work was done (CI, 1 run in many)."""

    _PEERS_EXIT_WAIT_S = 10.0

    def __init__(self, service: Any, num_processes: int) -> None:
        self._service = service
        self._num_processes = num_processes

    def shutdown(self) -> None:
        deadline_s = time.monotonic() + self._PEERS_EXIT_WAIT_S
        for other in range(1, self._num_processes):
            try:
                _wait_until_dead(other, deadline_s)
            except TimeoutError:
                break  # a peer that hangs: shut the service down anyway, as JAX would
        self._service.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)


def _shut_service_down_last(num_processes: int) -> None:
    from jax._src import distributed

    state = distributed.global_state
    if getattr(state, "service", None) is not None:
        state.service = _ServiceShutDownLast(state.service, num_processes)


def _wait_until_dead(process: int, deadline_s: float) -> None:
    fd = os.open(_alive_lock_path(process), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline_s:
                    raise TimeoutError(
                        f"process {process} is still alive after kill_job(); did it call kill_job() too?"
                    ) from None
                time.sleep(0.001)
    finally:
        os.close(fd)


def kill_job(timeout_s: float = 60.0) -> NoReturn:
    """Ends this job with SIGKILL on every process, as a preemption does; nothing cleans up.

    Every process but 0 kills itself at once. Process 0 first waits until the others
    are dead, then kills itself: it hosts `jax.distributed`'s coordination service, and
    a process that loses the service aborts (SIGABRT) instead of dying by the signal.
    Run the job with `expected_returncode=-signal.SIGKILL`.

    Args:
        timeout_s: How long process 0 waits for the others to die, seconds.

    Raises:
        TimeoutError: Process 0 only: another process is still alive after `timeout_s`
            (it did not call `kill_job`).

    Multi-process: every process of the job calls it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if process_id() != 0:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline_s = time.monotonic() + timeout_s
    for other in range(1, int(os.environ[_ENV + "NUM_PROCESSES"])):
        _wait_until_dead(other, deadline_s)
    os.kill(os.getpid(), signal.SIGKILL)
    while True:  # SIGKILL cannot be caught; this only waits for it to land
        time.sleep(1)


def _run_function() -> None:
    """Entry point of a worker whose target is a function: initialize, import it, call it."""
    location, _, qualname = os.environ[_ENV + "FUNCTION"].rpartition(":")
    args = initialize()
    if location.endswith(".py"):  # a function of the parent's main script
        sys.path.insert(0, os.path.dirname(location))  # as if the script had been run
        function = runpy.run_path(location, run_name="__mp_main__")[qualname]
    else:
        function = getattr(importlib.import_module(location), qualname)
    function(**args)
