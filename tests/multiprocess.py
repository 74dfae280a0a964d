"""Runs a worker script of `tests/mp_workers/` as N local JAX processes.

    results = run_processes(WORKERS / "save_worker.py", 2, 4, {"path": p}, timeout_s=120)
    for r in results:
        assert r.returncode == 0, r.describe()
        r.records   # the JSON records the worker reported with `_common.emit`

A thin layer over `checkpointer.testing`, which owns the harness (environment, free port,
`jax.distributed` set-up, timeouts, killing, output collection); the demo in `examples/`
uses the same one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from checkpointer.testing import ProcessesFailed, ProcessResult, describe_all, free_port, run_processes as _run_processes

__all__ = ["WORKERS", "ProcessResult", "ProcessesFailed", "describe_all", "free_port", "run_processes"]

WORKERS = Path(__file__).resolve().parent / "mp_workers"


def run_processes(
    worker_script: str | os.PathLike,
    num_processes: int,
    devices_per_process: int,
    args: Mapping | None = None,
    timeout_s: float = 120.0,
    *,
    env: Mapping[str, str] | None = None,
    **kwargs,
) -> list[ProcessResult]:
    """`checkpointer.testing.run_processes` for a worker script.

    `env={"MP_RECOVERABLE": "1"}` is the tests' spelling of `recoverable=True`; the other
    keyword arguments (`fail_fast`, `fail_fast_grace_s`, `heartbeat_timeout_s`, `check`)
    pass through unchanged.
    """
    env = dict(env or {})
    if env.pop("MP_RECOVERABLE", "0") == "1":
        kwargs["recoverable"] = True
    return _run_processes(
        worker_script, num_processes, devices_per_process, args, timeout_s, env=env, **kwargs
    )


def copy_run(saved, name):
    """A copy of a saved run's durable and local folders under `name`, for one restore case:
    `saved` is a module fixture's `(tmp, args)`; returns the args of its restore phase."""
    tmp, args = saved
    out = dict(args, phase="restore")
    for key in ("directory", "local"):
        out[key] = str(tmp / name / key)
        shutil.copytree(args[key], out[key])
    return out
