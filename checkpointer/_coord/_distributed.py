"""The job of processes (`jax.distributed`): this process's index, the process count, and
the coordination service's client whose key-value store the rendezvous (`_rendezvous`)
uses, never a device collective, so every meeting is safe from a background thread.
"""

from __future__ import annotations

from typing import Any

import jax

# How long a commit waits for every process's done report, seconds (`commit_timeout_s`):
# below JAX's default heartbeat timeout (100 s), so a dead peer raises CommitTimeoutError
# before JAX's runtime aborts the job (docs/DESIGN-decisions.md, "Operating a run").
DEFAULT_COMMIT_TIMEOUT_S = 60.0


def _client() -> Any:  # Any: jaxlib's DistributedRuntimeClient has no stubs
    from jax._src import distributed  # the client of jax.distributed.initialize()

    return distributed.global_state.client


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()
