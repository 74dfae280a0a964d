"""The fault campaign (issue 27): a real training loop through `CheckpointManager`, faults
injected at random points of save, commit, replication, retention and restore, the
invariants checked after each one; prints faults injected and violations per kind.

Faults:
  storage (in this process, through `tests.faults.FaultLayer`, which wraps every
  `Storage` operation of local files and the system calls of the direct writer):
    eio, enospc        an operation fails with OSError(EIO / ENOSPC)
    short_write        a write(2)/pwrite(2) takes half the bytes (the caller must loop)
    fsync_eio          fsync(2) of a file or folder fails with EIO
    slow_io            an operation stalls 0.3 s
  process (jobs of 1 and 4 real processes, 2 devices each, under jax.distributed):
    sigkill, sigterm   a process signals itself at the n-th operation of a point
                       (SIGTERM is a preemption: the loop must save and stop cleanly)
    sigstop_peer       a process stops answering (SIGSTOP) after the job's first commit;
                       the others must fail with a documented error (or be ended by
                       jax.distributed's heartbeat) within the commit timeout + slack
  storage faults in jobs of 4 processes too (spread over the processes, 15 a job): a
  process's failed write must reach every process as a documented error, the loop goes
  on (as a training loop that keeps training would) and a clean save must commit on all.
  Each in one tier and two tiers (`local_directory`), the process-fault jobs resumed by
  a fresh clean job after each fault.

Invariants, after each fault (a violation is counted per failed check):
  - the newest committed step never goes back;
  - every committed step restores bit-exactly (the state is a function of the step)
    and passes `ckpt.verify`;
  - no `.partial-*` folder survives the next clean save (which must commit);
  - nothing outside the run's directories is touched (the layer refuses and records
    such paths; a sentinel sibling folder is compared by hash and mtime);
  - every failure raises a documented error (a `CheckpointError`) within its timeout.

Run (the long campaign, >= 1,000 faults, about 1-2 h on 2 cores):
  PYTHONPATH=. .venv/bin/python benchmarks/fault_campaign.py --seed 27 --faults 1500 --process-share 0.1 --minutes 110 --json /tmp/campaign.json

A medium one (about 5 minutes):
  PYTHONPATH=. .venv/bin/python benchmarks/fault_campaign.py --seed 1 --faults 150 --process-share 0.1

Options: --seed (reproducible up to timing), --faults N, --minutes budget (stops arming
new faults then), --process-share (share of process faults, default 0.05: each costs a
job start and a resuming job), --mp-storage-share (share of the storage faults injected
in jobs of 4 processes, default 0.3), --json FILE (the tally, violations included). Exit status 1 when any
violation was found; each violation prints with its seed, job, kind, point and countdown
(`Fault(kind, point, countdown)`), enough to replay it with `storage_job` or `process_job`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root: `tests.faults`

import logging  # noqa: E402

from rich.console import Console  # noqa: E402

from tests.faults import run_campaign, table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=150, help="faults to arm in all")
    parser.add_argument("--minutes", type=float, default=None, help="stop arming new faults after this long")
    parser.add_argument("--process-share", type=float, default=0.05, help="share of process faults (SIGKILL, SIGTERM, SIGSTOP)")
    parser.add_argument("--mp-storage-share", type=float, default=0.3, help="share of the storage faults in jobs of 4 processes")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 4], help="process counts of the process jobs")
    parser.add_argument("--json", default=None, help="write the tally (with every violation) to this file")
    parser.add_argument("--workdir", default=None, help="where the runs' temporary folders go")
    args = parser.parse_args(argv)
    logging.getLogger("checkpointer").setLevel(logging.CRITICAL)  # the faults' own log lines are expected
    console = Console()
    t0 = time.monotonic()

    def progress(t):
        console.print(f"[{time.monotonic() - t0:6.0f} s] {t.faults} faults injected, "
                      f"{sum(t.missed.values())} not reached, {len(t.violations)} violations, {t.jobs} jobs")

    tally = run_campaign(args.seed, args.faults, minutes=args.minutes, storage_share=1.0 - args.process_share,
                         multiprocess_storage_share=args.mp_storage_share,
                         workdir=args.workdir, process_counts=args.processes, progress=progress)
    tally.wall_s = time.monotonic() - t0
    console.print(table(tally, title=f"fault campaign: seed {args.seed}, --faults {args.faults}"))
    for kind, point, why, message in tally.excused:  # seen, not the library's (see Tally.excused)
        console.print(f"excused {kind}@{point}: {why}: {message}", markup=False, highlight=False)
    for kind, point, check, message in tally.violations:
        console.print(f"[red]VIOLATION[/red] {kind}@{point}: {check}: {message}", markup=True, highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tally.to_json(), seed=args.seed, faults=args.faults, argv=sys.argv), f, indent=1)
    return 1 if tally.violations else 0


if __name__ == "__main__":
    sys.exit(main())
