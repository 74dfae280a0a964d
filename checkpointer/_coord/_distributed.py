"""The job of processes (`jax.distributed`): this process's index, the process count, and
the coordination service's client whose key-value store the rendezvous (`_rendezvous`)
uses, never a device collective, so every meeting is safe from a background thread.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from collections.abc import Callable
from typing import Any

import jax

# How long a commit waits for every process's done report, seconds (`commit_timeout_s`):
# below JAX's default heartbeat timeout (100 s), so a dead peer raises CommitTimeoutError
# before JAX's runtime aborts the job (docs/DESIGN-decisions.md, "Operating a run").
DEFAULT_COMMIT_TIMEOUT_S = 60.0

# The longest timeout a meeting takes, seconds: a week. The coordination service's
# key-value waits take whole milliseconds as a 32-bit int (2**31 ms is 24.8 days), and a
# rendezvous waits up to twice its timeout plus a margin.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_timeout_s(name: str, value: object) -> float:
    """`value` as a timeout in seconds, or ValueError naming the keyword `name`: a real
    number (not a bool), finite, above 0 and at most `MAX_TIMEOUT_S`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not 0 < float(value) <= MAX_TIMEOUT_S:
        raise ValueError(
            f"{name} must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:.0f} (a week), "
            f"got {value!r}; e.g. {name}=60"
        )
    return float(value)


def _client() -> Any:  # Any: jaxlib's DistributedRuntimeClient has no stubs
    from jax._src import distributed  # the client of jax.distributed.initialize()

    return distributed.global_state.client


def client() -> Any:
    """The coordination service's client (its key-value store), for meetings that are
    not a `Round` (e.g. an address a process advertises); None without `jax.distributed`."""
    return _client()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def records(client: Any, prefix: str) -> dict[int, Any] | None:
    """Every process's JSON record under `prefix/<process index>` in the key-value store
    (one read; a malformed entry is left out). None: no client (a job of one process),
    or the store cannot be read (jaxlib's error). Not a collective."""
    from .._format import load_json

    if client is None:
        return None
    try:
        entries = dict(client.key_value_dir_get(prefix + "/"))
    except Exception:
        return None
    out: dict[int, Any] = {}
    for key, value in entries.items():
        with contextlib.suppress(ValueError, TypeError):
            out[int(key.rsplit("/", 1)[1])] = load_json(value, what=key)
    return out


def poll(done: Callable[[], bool], deadline_monotonic: float, clock: Any = time) -> bool:
    """Calls `done` until it is true (True) or `clock.monotonic()` passes the deadline
    (False), pausing (`clock.sleep`) 5 ms, then twice as long each time, at most 0.25 s:
    for waits on the key-value store, which has no notification for a folder. `clock`:
    the caller's `time` module (tests replace it with a virtual one)."""
    pause = 0.005
    while not done():
        if clock.monotonic() >= deadline_monotonic:
            return False
        clock.sleep(pause := min(2 * pause, 0.25))
    return True
