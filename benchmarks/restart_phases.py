"""Where a two-tier restart's time goes: one run of a peers_bench restart case, with
`time.perf_counter` / `time.thread_time` spans around the phases of `restore(None)`
(rounds, votes, the peers' inventory, reads, the transfer plan, compile and run, the
destination allocator, every `preadv` and crc32c), per-thread CPU (sampled from
`/proc/self/task` every 10 ms) and each process's user/system CPU and minor faults.
A diagnostic, not a benchmark: it patches library functions in the child processes.

Setup as benchmarks/peers_bench.py (4 processes x 2 CPU devices as 4 simulated nodes,
1 GiB state, durable tier paced to 200 MiB/s per process for writes and reads).

Run:  .venv/bin/python benchmarks/restart_phases.py save DIR           (once: steps 100, 110)
      .venv/bin/python benchmarks/restart_phases.py restore DIR a|b|c [--pretouch-mib N] [--all]
      (a: same nodes; b: process 1's local folder wiped; c: processes 1 and 2 wiped).
      Prints per process the restore time, CPU, the spans over 5 ms (--all: every span)
      and the per-label totals (calls, wall summed over threads, thread CPU). The
      transfer programs run asynchronously: each has a span from its dispatch to its
      outputs being ready, and the wait after `restore` returns is a span of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import resource
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers_bench as PB  # noqa: E402

SPANS: list[tuple[str, str, float, float, float]] = []  # (label, thread, start, wall, thread CPU)
PER_CALL = ("preadv", "crc32c", "populate_destination", "tiers.read_marker", "HeldReads._read_leaf")


def _wrap(owner, name: str, label: str) -> None:
    fn = getattr(owner, name, None)
    if fn is None:  # another version of the library
        return

    @functools.wraps(fn)
    def inner(*a, **k):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            SPANS.append((label, threading.current_thread().name, t0, time.perf_counter() - t0, time.thread_time() - c0))

    setattr(owner, name, inner)


def instrument() -> None:
    """Spans around the restart's phases (patched in this process only)."""
    import types

    from checkpointer._coord import _rendezvous as rv
    from checkpointer._encoding import _read as rd, _zarr_array as za
    from checkpointer._manage import (
        _mesh_restart as mr,
        _peer_delivery as pd,
        _peer_transfer as pt,
        _peers,
        _tier_manager as tm,
        _tiers,
    )
    from checkpointer._memory import _device_destination as dd
    from checkpointer._restore import _pipeline as pl
    from checkpointer._storage import _local

    for owner, name, label in [
        (tm.LocalTier, "restore", "LocalTier.restore"), (tm.LocalTier, "_needed_keys", "LocalTier._needed_keys"),
        (tm.LocalTier, "_read_local_only", "LocalTier._read_local_only"),
        (tm.LocalTier, "_restore_local_only", "LocalTier._restore_local_only"),
        (pd, "restart", "peer_delivery.restart"), (pd, "deliver", "peer_delivery.deliver"),
        (pd, "_publish_meta", "peer_delivery._publish_meta"), (pd.Refetch, "run", "Refetch.run"),
        (_tiers, "agree", "tiers.agree"), (_tiers, "local_restore_proposal", "local_restore_proposal"),
        (_tiers, "read_marker", "tiers.read_marker"), (_peers.PeerService, "inventory", "PeerService.inventory"),
        (_peers, "choose_peer_step", "choose_peer_step"), (mr, "restart", "mesh_restart.restart"),
        (mr, "visible_shares", "mesh_restart.visible_shares"), (pl, "_restore_once", "pipeline._restore_once"),
        (rv.Round, "agree", "Round.agree"), (pt.HeldReads, "_run", "HeldReads._run"),
        (pt.HeldReads, "_read_leaf", "HeldReads._read_leaf"), (pt, "_executable", "peer_transfer._executable"),
        (_local._LocalReader, "read_into_buffers", "preadv"), (za, "_destinations", "zarr._destinations"),
        (za, "populate_destination", "populate_destination"), (dd, "_allocate_all", "allocate_all"),
    ] + [(pt, n, f"peer_transfer.{n}") for n in ("plan", "programs", "compile_programs", "run", "assemble")]:
        _wrap(owner, name, label)
    _wrap_programs(pt)
    crc = types.SimpleNamespace(crc32c=rd.crc32c.crc32c)
    _wrap(crc, "crc32c", "crc32c")
    rd.crc32c = crc  # type: ignore[assignment]


def _wrap_programs(pt) -> None:
    """A span per transfer program from its dispatch to its outputs being ready: the
    dispatch is asynchronous, so `peer_transfer.run` returns before the bytes land (a
    thread per program waits for them; no collective in that wait)."""
    run = getattr(pt, "run", None)
    if run is None or not hasattr(pt, "Compiled"):
        return

    class Timed:
        def __init__(self, exe, index: int) -> None:
            self.exe, self.index = exe, index

        def __call__(self, *args):
            import jax

            t0 = time.perf_counter()
            outs = self.exe(*args)

            def wait() -> None:
                jax.block_until_ready(outs)
                SPANS.append((f"transfer program {self.index} (dispatch to done)", "waiter", t0,
                              time.perf_counter() - t0, 0.0))

            threading.Thread(target=wait, name="sampler-waiter", daemon=True).start()
            return outs

    @functools.wraps(run)
    def timed_run(compiled, held):
        return run([dataclasses.replace(c, executable=Timed(c.executable, c.index)) for c in compiled], held)

    pt.run = timed_run


def _thread_cpu() -> dict[str, float]:
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[f"{tid}:{names.get(int(tid), 'native')}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


class ThreadCPU:
    """CPU seconds per thread name (pool threads that end meanwhile included)."""

    def __init__(self) -> None:
        self.base, self.seen, self.stop = _thread_cpu(), {}, threading.Event()
        self.thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.01):
            self.seen.update(_thread_cpu())

    def done(self) -> dict[str, float]:
        self.stop.set()
        self.thread.join()
        self.seen.update(_thread_cpu())
        out: dict[str, float] = {}
        for k, v in self.seen.items():
            name = re.sub(r"_\d+$", "", k.split(":", 1)[1])
            out[name] = round(out.get(name, 0.0) + v - self.base.get(k, 0.0), 3)
        return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 0.01}


def phases_job(directory: str, mib: int, case: str, rate_mib_s: float, pretouch_mib: int) -> None:
    """One restart (`restore(None)` with peers), its spans emitted."""
    import absl.logging
    import jax
    from jax.experimental import multihost_utils

    import checkpointer as ckpt
    from checkpointer import testing

    absl.logging.set_verbosity(absl.logging.ERROR)
    pidx = jax.process_index()
    _, target = PB._state(mib)
    PB.register_paced_reads(rate_mib_s)
    instrument()
    with ckpt.CheckpointManager(f"paced://{directory}/durable", local_directory=f"{directory}/local", peer_copies=1,
                                peer_node=f"node-{pidx}", durable_every_steps=100, read_only=True,
                                commit_timeout_s=600) as m:
        pretouch_s = PB.pretouch(pretouch_mib)
        multihost_utils.sync_global_devices(f"phases-{case}")
        r0, threads = resource.getrusage(resource.RUSAGE_SELF), ThreadCPU()
        SPANS.clear()
        t0 = time.perf_counter()
        out = m.restore(None, {**target, "step": None})
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - t0
        SPANS.append(("restore returned: block_until_ready", "MainThread", t1, elapsed - (t1 - t0), 0.0))
        per_thread, r1 = threads.done(), resource.getrusage(resource.RUSAGE_SELF)
        testing.emit(event="phases", elapsed_s=elapsed, step=int(out["step"]), source=m.status().last_restore_source,
                     pretouch_s=pretouch_s, user_s=r1.ru_utime - r0.ru_utime, sys_s=r1.ru_stime - r0.ru_stime,
                     minflt=r1.ru_minflt - r0.ru_minflt, threads=per_thread,
                     spans=[(lb, th, t - t0, d, c) for lb, th, t, d, c in SPANS])


def main() -> None:
    from checkpointer import testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["save", "restore"])
    ap.add_argument("dir")
    ap.add_argument("case", nargs="?", choices=["a", "b", "c"], default="a")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--pretouch-mib", type=int, default=0)
    ap.add_argument("--all", action="store_true", help="print every span")
    args = ap.parse_args()
    if args.command == "save":
        shutil.rmtree(args.dir, ignore_errors=True)
        testing.run_processes(PB.save_job, PB.PROCESSES, PB.DEVICES,
                              {"directory": f"{args.dir}/run", "mib": args.mib, "rate_mib_s": args.rate}, timeout_s=1800)
        return
    run = f"{args.dir}/{args.case}"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(f"{args.dir}/run", run)
    for p in {"a": [], "b": [1], "c": [1, 2]}[args.case]:
        shutil.rmtree(f"{run}/local/process-{p}")
    try:
        out = testing.run_processes(phases_job, PB.PROCESSES, PB.DEVICES,
                                    {"directory": run, "mib": args.mib, "case": args.case, "rate_mib_s": args.rate,
                                     "pretouch_mib": args.pretouch_mib}, timeout_s=1800)
    finally:
        shutil.rmtree(run, ignore_errors=True)
    for p, r in enumerate(x.record("phases") for x in out):
        print(f"--- process {p}: {r['elapsed_s']:.3f} s, step {r['step']} ({r['source']}), user {r['user_s']:.3f} s, "
              f"sys {r['sys_s']:.3f} s, {r['minflt']} minor faults, pretouch {r['pretouch_s']:.2f} s")
        print(f"    thread CPU: {json.dumps(r['threads'])}")
        totals: dict[str, list[float]] = {}
        for label, thread, start, wall, cpu in r["spans"]:
            t = totals.setdefault(label, [0, 0.0, 0.0])
            t[0], t[1], t[2] = t[0] + 1, t[1] + wall, t[2] + cpu
            if args.all or (wall > 0.005 and label not in PER_CALL):
                print(f"    {start:8.3f} +{wall:7.3f} s  cpu {cpu:6.3f}  {thread[:24]:24s} {label}")
        for label, (n, wall, cpu) in sorted(totals.items(), key=lambda kv: -kv[1][2]):
            if cpu >= 0.005 or wall >= 0.05:
                print(f"    total {label:32s} {int(n):5d} calls, wall {wall:7.3f} s, thread CPU {cpu:6.3f} s")


if __name__ == "__main__":
    main()
