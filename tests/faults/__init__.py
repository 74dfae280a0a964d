"""The shared fault harness of issue 27 (the fault campaign; node-loss and incremental
saves put their fault tests on it).

- `layer`: `FaultLayer`, the fault-injecting wrapper of local storage and the direct
  writer (kinds `STORAGE_KINDS`, `SIGNAL_KINDS`; injection points `POINTS`, and
  `PEER_POINTS` for a holder writing a peer's copy; a `Fault` is a kind at the n-th
  operation of a point), which also refuses paths outside the run's directories.
- `invariants`: `Invariants`, the checks after each fault (newest committed step never
  back; every committed step bit-exact and verified; no `.partial-*` after a clean save;
  the `Sentinel` folder untouched).
- `state`: the loop's state, a deterministic function of the step.
- `campaign`: the jobs (`storage_job` in-process; `multiprocess_storage_job`, storage
  faults spread over the processes of one job; `process_job`, SIGKILL / SIGTERM /
  SIGSTOP of a process; real processes under `jax.distributed`), `run_campaign`, the
  `Tally` and its rich `table`.

Import it as `tests.faults` (the repository root on `sys.path`): worker processes of
`checkpointer.testing.run_processes` import `tests.faults.campaign.loop_worker` by name.
"""

from .campaign import (
    KINDS,
    PROCESS_KINDS,
    Tally,
    loop_worker,
    multiprocess_storage_job,
    process_job,
    run_campaign,
    storage_job,
    storage_loop_worker,
    table,
)
from .invariants import Invariants, Sentinel, committed_steps, partial_folders
from .layer import PEER_POINTS, POINTS, SIGNAL_KINDS, STORAGE_KINDS, Fault, FaultLayer, Fired, OutsideRootsError

__all__ = [
    "KINDS", "POINTS", "PROCESS_KINDS", "SIGNAL_KINDS", "STORAGE_KINDS", "Fault", "FaultLayer", "Fired", "Invariants",
    "OutsideRootsError", "PEER_POINTS", "Sentinel", "Tally", "committed_steps", "loop_worker", "multiprocess_storage_job",
    "partial_folders", "process_job", "run_campaign", "storage_job", "storage_loop_worker", "table",
]
