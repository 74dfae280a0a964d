"""The job of processes (`jax.distributed`): this process's index, the process count, and
the coordination service's client whose key-value store the rendezvous (`_rendezvous`)
uses, never a device collective, so every meeting is safe from a background thread.
"""

from __future__ import annotations

import math
import numbers
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
