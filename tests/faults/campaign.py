"""The fault campaign's jobs: a training loop driven through `CheckpointManager` while
faults strike, and the tally of faults and violations per kind.

Two kinds of job (both return a `Tally`):
- `storage_job`: one process (this one), one loop; many storage faults in turn (EIO,
  ENOSPC, short writes, fsync failures, slow I/O) at the points save, commit,
  replication (two tiers), retention and restore, each followed by a clean save and the
  invariants. Cheap: hundreds of faults a minute.
- `process_job`: N real processes under `jax.distributed` (`checkpointer.testing`) run
  the loop; one of them is SIGKILLed or SIGTERMed at the n-th storage operation of an
  injection point (the fault layer signals its own process), or SIGSTOPped by this
  process (a coordination-service peer that stops answering). A fresh job then resumes
  the run from the directory. Costs a job start (5-15 s) per fault.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import signal
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import checkpointer as ckpt

from . import state as _state
from .invariants import Invariants, committed_steps, partial_folders
from .layer import POINT_KINDS, POINTS, SIGNAL_KINDS, STORAGE_KINDS, Fault, FaultLayer

PROCESS_KINDS = ("sigkill", "sigterm", "sigstop_peer")
KINDS = STORAGE_KINDS + PROCESS_KINDS
COMMIT_TIMEOUT_S = 20.0  # the manager's commit_timeout_s in the campaign's loops
ERROR_SLACK_S = 15.0  # a failing save or restore must raise within its timeout plus this


@dataclasses.dataclass
class Tally:
    """Faults injected and violations found, per kind (and per point)."""

    injected: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # (kind, point) -> n
    missed: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # armed, never struck
    violations: list[tuple[str, str, str, str]] = dataclasses.field(default_factory=list)  # (kind, point, check, message)
    # Outcomes that are not the library's but were seen (kind, point, why, message), e.g. JAX's
    # shutdown barrier after a SIGTERM that came after the last sync point.
    excused: list[tuple[str, str, str, str]] = dataclasses.field(default_factory=list)
    jobs: int = 0
    wall_s: float = 0.0

    def add(self, other: Tally) -> None:
        self.injected.update(other.injected)
        self.missed.update(other.missed)
        self.violations += other.violations
        self.excused += other.excused
        self.jobs += other.jobs
        self.wall_s += other.wall_s

    @property
    def faults(self) -> int:
        return sum(self.injected.values())

    def by_kind(self) -> dict[str, tuple[int, int, int]]:
        """kind -> (injected, armed but never reached, violations)."""
        out = {}
        for kind in KINDS:
            inj = sum(n for (k, _), n in self.injected.items() if k == kind)
            miss = sum(n for (k, _), n in self.missed.items() if k == kind)
            vio = sum(1 for v in self.violations if v[0] == kind)
            if inj or miss or vio:
                out[kind] = (inj, miss, vio)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "injected": [[k, p, n] for (k, p), n in self.injected.items()],
            "missed": [[k, p, n] for (k, p), n in self.missed.items()],
            "violations": [list(v) for v in self.violations],
            "excused": [list(v) for v in self.excused],
            "jobs": self.jobs, "wall_s": self.wall_s,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Tally:
        t = cls()
        t.injected.update({(k, p): n for k, p, n in d["injected"]})
        t.missed.update({(k, p): n for k, p, n in d["missed"]})
        t.violations = [tuple(v) for v in d["violations"]]  # type: ignore[misc]
        t.excused = [tuple(v) for v in d.get("excused", [])]  # type: ignore[misc]
        t.jobs, t.wall_s = d["jobs"], d["wall_s"]
        return t


def _documented(e: BaseException) -> bool:
    """The errors a failing save or restore may raise: the library's own (SaveError and
    its kind, CorruptCheckpointError, ...)."""
    return isinstance(e, ckpt.CheckpointError)


def _manager(run_dir: str, local_dir: str | None, **kw: Any) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(
        run_dir, keep=ckpt.KeepLatest(2), local_directory=local_dir, keep_local=ckpt.KeepLatest(1),
        commit_timeout_s=COMMIT_TIMEOUT_S, **kw,
    )


# --- storage faults, in this process --------------------------------------------------------


def storage_job(
    seed: int, faults: int, workdir: str, *, two_tiers: bool, kinds: Sequence[str] = STORAGE_KINDS,
    points: Sequence[str] = POINTS, async_save: bool = True, deadline_s: float | None = None,
) -> Tally:
    """Runs one loop in this process with `faults` storage faults, one after the other.

    Each fault: arm it (a random kind and point, at the 1st-6th operation of the point),
    save a few steps (or restore, for the point `restore`) until it strikes, wait, check
    that every error raised is a documented one within the timeout; then one clean save
    and the invariants. Every 10th fault the manager is closed and opened again (a
    restart). Points that cannot strike in this set-up (replication with one tier) are
    not drawn.

    Args:
      seed: the random seed (the job is reproducible from it).
      faults: how many faults to arm.
      workdir: an empty folder: the run's directories and the sentinel go in it.
      two_tiers: save through a local tier (`local_directory`) too.
      kinds, points: what to draw from.
      async_save: the manager's `async_save`.
      deadline_s: `time.monotonic()` after which no new fault is armed.
    """
    rng = random.Random(seed)
    run_dir = os.path.join(workdir, "run")
    local_dir = os.path.join(workdir, "local") if two_tiers else None
    inv = Invariants(run_dir, local_dir, os.path.join(workdir, "sentinel"))
    layer = FaultLayer([run_dir] + ([local_dir] if local_dir else []), durable_root=run_dir if two_tiers else None)
    points = [p for p in points if two_tiers or p != "replication"]
    tally = Tally(jobs=1)
    t0 = time.monotonic()
    step = 0
    with layer.installed():
        mgr = _manager(run_dir, local_dir, async_save=async_save)
        try:
            for i in range(faults):
                if deadline_s is not None and time.monotonic() > deadline_s:
                    break
                point = rng.choice(points)
                kind = rng.choice([k for k in kinds if k in POINT_KINDS[point]] or list(kinds))
                fault = Fault(kind, point, countdown=rng.randint(1, 6))
                where = f"seed {seed} fault #{i} {kind}@{point}#{fault.countdown} tiers={two_tiers}"
                layer.arm(fault)
                errors: list[tuple[BaseException, float]] = []
                if point == "restore":
                    step_ = _restore_under_fault(mgr, layer, errors, inv, where, tally, kind, point, rng)
                    del step_
                else:
                    for _ in range(4):  # a few saves: the point comes round at each
                        step += 1
                        _timed(errors, lambda s=step, m=mgr: m.save(s, _state.make(s)))
                        if layer.fired is not None:
                            break
                    _timed(errors, mgr.wait_until_finished)
                fired = layer.disarm()
                if fired is None:
                    tally.missed[(kind, point)] += 1
                else:
                    tally.injected[(kind, point)] += 1
                for e, took_s in errors:
                    if not _documented(e):
                        tally.violations.append((kind, point, "undocumented error", f"{where}: {type(e).__name__}: {e}"))
                    elif took_s > COMMIT_TIMEOUT_S + ERROR_SLACK_S:
                        tally.violations.append((kind, point, "error too late", f"{where}: {took_s:.1f} s: {e}"))
                    if fired is None:
                        tally.violations.append((kind, point, "error without a fault", f"{where}: {type(e).__name__}: {e}"))
                if i % 10 == 9:  # a restart: close (a pending error is raised once) and open again
                    _timed(errors := [], mgr.close)
                    for e, _ in errors:
                        if not _documented(e):
                            tally.violations.append((kind, point, "undocumented error", f"{where} (close): {e!r}"))
                    mgr = _manager(run_dir, local_dir, async_save=async_save)
                # The next clean save: it must work, and leave no partial folder behind.
                step += 1
                clean: list[tuple[BaseException, float]] = []
                _timed(clean, lambda s=step, m=mgr: m.save(s, _state.make(s)))
                _timed(clean, mgr.wait_until_finished)
                for e, _ in clean:
                    tally.violations.append((kind, point, "clean save failed", f"{where}: {type(e).__name__}: {e}"))
                before = len(inv.violations)
                if not clean:
                    inv.after_clean_save(where)
                inv.after_fault(where)
                if step not in committed_steps(run_dir) and not clean:
                    inv.violate("clean save not committed", f"{where}: step {step} missing from {committed_steps(run_dir)}")
                tally.violations += [(kind, point, c, m) for c, m in inv.violations[before:]]
                for p in layer.outside:
                    tally.violations.append((kind, point, "outside touched", f"{where}: {p}"))
                layer.outside.clear()
        finally:
            try:
                mgr.close()
            except ckpt.CheckpointError:
                pass
    tally.wall_s = time.monotonic() - t0
    return tally


def _timed(errors: list[tuple[BaseException, float]], fn: Any) -> None:
    t = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller judges it
        errors.append((e, time.monotonic() - t))


def _restore_under_fault(mgr: ckpt.CheckpointManager, layer: FaultLayer, errors: list, inv: Invariants, where: str,
                         tally: Tally, kind: str, point: str, rng: random.Random) -> int | None:
    """Restores a committed step (the newest, or an older one) with the read fault armed:
    it either raises a documented error or returns the step's values, bit-exactly."""
    steps = mgr.all_steps()
    if not steps:
        return None
    step = rng.choice(steps)
    layer.phase = "restore"
    t = time.monotonic()
    try:
        restored = mgr.restore(step)
    except Exception as e:  # noqa: BLE001
        errors.append((e, time.monotonic() - t))
        return step
    finally:
        layer.phase = None
    diff = _state.differences(restored, step)
    if diff:
        tally.violations.append((kind, point, "not bit-exact", f"{where}: restore of {step} under the fault: {diff}"))
    return step


# --- process faults: real processes under jax.distributed ----------------------------------


def loop_worker(run_dir: str, local_dir: str | None, first_step: int, steps: int, victim: int, kind: str,
                point: str, countdown: int, hold_s: float) -> None:
    """One process of a `process_job` (`checkpointer.testing.run_processes` target).

    Runs the loop from `first_step` for `steps` steps (`save` every step, async), the
    victim process's fault layer armed with the signal `kind` at `point`; stops at the
    preemption step (SIGTERM). `hold_s`: seconds each save is held back (so that a
    SIGSTOP from outside lands in the middle of the run). Emits `committed` records and,
    on a failure, the `exception` record of `checkpointer.testing`.
    """
    import jax

    from checkpointer import testing

    me = jax.process_index()
    roots = [run_dir] + ([local_dir] if local_dir else [])
    layer = FaultLayer(roots, durable_root=run_dir if local_dir else None)

    def on_signal(sig: int) -> None:
        testing.emit(event="signalled", wall=time.time(), sig=int(sig), op=layer.fired.op if layer.fired else "", path=layer.fired.path if layer.fired else "")
        os.kill(os.getpid(), sig)

    layer.on_signal = on_signal
    with layer.installed():
        if me == victim and kind in SIGNAL_KINDS:
            layer.arm(Fault(kind, point, countdown))
        t0 = time.monotonic()
        mgr = _manager(run_dir, local_dir)
        try:
            for step in range(first_step, first_step + steps):
                mgr.save(step, _state.make(step))
                if mgr.reached_preemption(step):
                    testing.emit(event="preempted", step=step, elapsed_s=time.monotonic() - t0)
                    break
                if hold_s:
                    time.sleep(hold_s)
            mgr.wait_until_finished()
            if point == "restore" and me == victim:
                layer.phase = "restore"
            latest = mgr.latest_step()
            if latest is not None:
                testing.emit(event="restored", step=latest, diff=_state.differences(mgr.restore(latest), latest))
            layer.phase = None
        except BaseException as e:
            testing.emit(event="failed", wall=time.time(), type=type(e).__name__, documented=_documented(e), message=str(e)[:500],
                         elapsed_s=time.monotonic() - t0)
            raise
        finally:
            try:
                mgr.close()
            except ckpt.CheckpointError:
                pass
        testing.emit(event="done", latest=mgr.latest_step(), outside=layer.outside)


def process_job(seed: int, faults: int, workdir: str, *, num_processes: int, two_tiers: bool,
                kinds: Sequence[str] = PROCESS_KINDS, points: Sequence[str] = POINTS,
                deadline_s: float | None = None) -> Tally:
    """Runs `faults` jobs of `num_processes` real processes (2 devices each) on one run,
    each with one process fault, then a clean resuming job, checking the invariants
    after each.

    A job with a fault must end within its limit: SIGKILL or SIGSTOP of a process, the
    others raise a documented error (CommitTimeoutError, SaveError) or are ended by
    `jax.distributed` (its heartbeat: SIGABRT or exit 1 with the runtime's message)
    within `COMMIT_TIMEOUT_S` plus the heartbeat timeout plus slack; SIGTERM: the
    preemption step is saved and every process exits 0; a SIGTERM that JAX has not turned
    into an agreed step by the loop's last sync point (it lands in the final restore or
    close, or JAX's protocol lags past the job's last step) has no step left to save: the
    job finishes its work and exits 0, or JAX's shutdown barrier aborts it at exit
    (`_late_sigterm_shutdown_abort`, tallied in `Tally.excused`, not a violation).
    """
    from checkpointer import testing

    rng = random.Random(seed)
    run_dir = os.path.join(workdir, "run")
    local_dir = os.path.join(workdir, "local") if two_tiers else None
    inv = Invariants(run_dir, local_dir, os.path.join(workdir, "sentinel"))
    points = [p for p in points if two_tiers or p != "replication"]
    tally = Tally()
    t0 = time.monotonic()
    heartbeat_s = 10
    peer_limit_s = COMMIT_TIMEOUT_S + heartbeat_s + ERROR_SLACK_S  # a peer's failure is noticed by then
    limit_s = peer_limit_s + 60
    step = 1
    for i in range(faults):
        if deadline_s is not None and time.monotonic() > deadline_s:
            break
        kind = rng.choice([k for k in kinds if num_processes > 1 or k != "sigstop_peer"])
        point = rng.choice(points) if kind != "sigstop_peer" else "save"
        victim = rng.randrange(num_processes)
        if point == "retention" or (point == "commit" and not two_tiers):
            victim = 0  # process 0 alone commits (one tier) and applies retention
        countdown = rng.randint(1, 8)
        where = f"seed {seed} job #{i} {kind}@{point}#{countdown} victim {victim} of {num_processes} tiers={two_tiers}"
        args = dict(run_dir=run_dir, local_dir=local_dir, first_step=step, steps=6, victim=victim, kind=kind,
                    point=point, countdown=countdown, hold_s=1.0 if kind == "sigstop_peer" else 0.0)
        stopper = None
        if kind == "sigstop_peer":
            stopper = _Stopper(victim, run_dir, step, delay_s=rng.uniform(0.0, 1.5), kill_after_s=limit_s - 10)
        jt, jt_wall = time.monotonic(), time.time()
        try:
            with (stopper or _nullcontext()):
                results = testing.run_processes(loop_worker, num_processes, 2, args, timeout_s=limit_s, fail_fast=False,
                                                check=False, heartbeat_timeout_s=heartbeat_s)
        except testing.ProcessesFailed as e:
            tally.violations.append((kind, point, "job hung past its limit", f"{where}: {str(e)[:3000]}"))
            results = []
        tally.jobs += 1
        job_s = time.monotonic() - jt
        fired = any(r.records and any(x["event"] == "signalled" for x in r.records) for r in results)
        if stopper is not None:
            fired = stopper.stopped
            if fired and (stopper.others_ended_s is None or stopper.others_ended_s > peer_limit_s):
                tally.violations.append((kind, point, "peers hung after a stop", f"{where}: the others ended "
                                         f"{stopper.others_ended_s} s after the stop (limit {peer_limit_s:.0f} s)"))
        if fired:
            tally.injected[(kind, point)] += 1
        else:
            tally.missed[(kind, point)] += 1
        struck_wall = min((x["wall"] for r in results for x in r.records if x["event"] == "signalled"), default=None)
        if stopper is not None and stopper.stopped_wall is not None:
            struck_wall = stopper.stopped_wall
        preempted = {x["step"] for r in results for x in r.records if x["event"] == "preempted"}
        late_sigterm = kind == "sigterm" and _late_sigterm_shutdown_abort(results)
        for r in results:
            # Every other process fails (or is ended by jax.distributed) within its timeout of the fault.
            ended_wall = jt_wall + r.elapsed_s
            failed = [x for x in r.records if x["event"] == "failed"]
            if failed:
                ended_wall = failed[0]["wall"]
            if (struck_wall is not None and r.returncode != 0 and not r.killed_by_harness and not late_sigterm
                    and ended_wall - struck_wall > peer_limit_s and not (stopper and r.process_id == victim)):
                tally.violations.append((kind, point, "error too late", f"{where}: process {r.process_id} ended "
                                         f"{ended_wall - struck_wall:.0f} s after the fault (limit {peer_limit_s:.0f} s)"))
            for rec in r.records:
                if rec["event"] == "restored" and rec["diff"]:
                    tally.violations.append((kind, point, "not bit-exact", f"{where}: process {r.process_id}: {rec}"))
                if rec["event"] == "failed" and not rec["documented"]:
                    tally.violations.append((kind, point, "undocumented error", f"{where}: process {r.process_id}: {rec['type']}: {rec['message']}"))
                if rec["event"] == "done" and rec["outside"]:
                    tally.violations.append((kind, point, "outside touched", f"{where}: {rec['outside']}"))
            if r.returncode not in (0, -signal.SIGKILL) and not _jax_ended_it(r) and not any(
                    rec["event"] == "failed" for rec in r.records):
                tally.violations.append((kind, point, "failed without an error", f"{where}: {r.describe()[-2000:]}"))
        if kind == "sigterm" and fired and results and any(r.returncode != 0 for r in results):
            if late_sigterm:
                tally.excused.append((kind, point, "sigterm after the last sync point: jax's shutdown barrier",
                                      f"{where}: {[r.returncode for r in results]}"))
            else:
                tally.violations.append((kind, point, "preemption not clean", f"{where}: {[r.returncode for r in results]}\n"
                                         + "\n".join(r.describe()[-1500:] for r in results if r.returncode != 0)))
        if len(preempted) > 1:
            tally.violations.append((kind, point, "preemption steps differ", f"{where}: {sorted(preempted)}"))
        for s_ in preempted:  # reached_preemption(step) said the step is committed
            if s_ not in committed_steps(run_dir):
                tally.violations.append((kind, point, "preemption step not committed",
                                         f"{where}: step {s_}, committed {committed_steps(run_dir)}"))
        if job_s > limit_s:
            tally.violations.append((kind, point, "error too late", f"{where}: the job took {job_s:.0f} s"))
        before = len(inv.violations)
        inv.after_fault(where)
        # The resuming job: clean, it must commit and leave no partial folder.
        latest = committed_steps(run_dir)
        step = max(latest[-1] if latest else 0, step) + 7
        clean = dict(args, first_step=step, steps=1, victim=-1, kind="none", hold_s=0.0)
        try:
            res = testing.run_processes(loop_worker, num_processes, 2, clean, timeout_s=limit_s, heartbeat_timeout_s=heartbeat_s)
            tally.jobs += 1
            if step not in committed_steps(run_dir):
                inv.violate("clean save not committed", f"{where}: step {step}")
            inv.after_clean_save(where + " (resumed)")
            del res
        except testing.ProcessesFailed as e:
            tally.violations.append((kind, point, "clean save failed", f"{where}: {str(e)[-3000:]}"))
        inv.after_fault(where + " (resumed)")
        step += 1
        tally.violations += [(kind, point, c, m) for c, m in inv.violations[before:]]
    tally.wall_s = time.monotonic() - t0
    return tally


def storage_loop_worker(run_dir: str, local_dir: str | None, first_step: int, plan: list, steps_per_fault: int) -> None:
    """One process of a `multiprocess_storage_job`: the loop, with this process's storage
    faults of `plan` (`[process, kind, point, countdown]` rows) armed one after the
    other (the next once the previous struck). A save that fails with a documented
    error is recorded (`save_failed`) and the loop goes on, as a training loop that
    keeps training would; an undocumented one fails the process. At the end: one clean
    save (`clean`, which must commit) and a restore of the newest step (`restored`)."""
    import jax

    from checkpointer import testing

    me = jax.process_index()
    layer = FaultLayer([run_dir] + ([local_dir] if local_dir else []), durable_root=run_dir if local_dir else None)
    mine = [Fault(k, p, c) for proc, k, p, c in plan if proc == me]
    steps = max(1, len(plan)) * steps_per_fault
    t0 = time.monotonic()

    def attempt(fn: Any, what: str) -> bool:
        t = time.monotonic()
        try:
            fn()
            return True
        except ckpt.CheckpointError as e:
            testing.emit(event="save_failed", what=what, type=type(e).__name__, message=str(e)[:300],
                         took_s=time.monotonic() - t)
            return False
        except BaseException as e:
            testing.emit(event="failed", wall=time.time(), type=type(e).__name__, documented=False, message=str(e)[:500],
                         elapsed_s=time.monotonic() - t0)
            raise

    with layer.installed():
        if mine:
            layer.arm(mine.pop(0))
        mgr = _manager(run_dir, local_dir)
        step = first_step
        for step in range(first_step, first_step + steps):
            attempt(lambda s=step: mgr.save(s, _state.make(s)), f"save {step}")
            if layer.fired is not None:
                f = layer.fired
                testing.emit(event="struck", kind=f.fault.kind, point=f.fault.point, countdown=f.fault.countdown, op=f.op,
                             path=f.path, step=step)
                layer.fired = None
                if mine:
                    layer.arm(mine.pop(0))
        attempt(mgr.wait_until_finished, "wait")
        if layer.fired is not None:
            f = layer.fired
            testing.emit(event="struck", kind=f.fault.kind, point=f.fault.point, countdown=f.fault.countdown, op=f.op,
                         path=f.path, step=step)
        layer.disarm()
        clean_step = step + 1
        ok = attempt(lambda: (mgr.save(clean_step, _state.make(clean_step)), mgr.wait_until_finished()), "clean")
        testing.emit(event="clean", step=clean_step, ok=ok)
        latest = mgr.latest_step()
        if latest is not None:
            attempt(lambda: testing.emit(event="restored", step=latest, diff=_state.differences(mgr.restore(latest), latest)),
                    "restore")
        attempt(mgr.close, "close")
        testing.emit(event="done", latest=latest, outside=layer.outside)


def multiprocess_storage_job(seed: int, faults: int, workdir: str, *, num_processes: int, two_tiers: bool,
                             kinds: Sequence[str] = STORAGE_KINDS, points: Sequence[str] = POINTS) -> Tally:
    """One job of `num_processes` real processes with `faults` storage faults spread over
    its processes (`storage_loop_worker`); then the invariants. Failures of one process's
    writes must reach every process as documented errors (`SaveError`), the processes
    must stay in step, and the clean save after the faults must commit on all."""
    from checkpointer import testing

    rng = random.Random(seed)
    run_dir = os.path.join(workdir, "run")
    local_dir = os.path.join(workdir, "local") if two_tiers else None
    inv = Invariants(run_dir, local_dir, os.path.join(workdir, "sentinel"))
    points = [p for p in points if p != "restore" and (two_tiers or p != "replication")]
    plan = []
    for _ in range(faults):
        point = rng.choice(points)
        kind = rng.choice([k for k in kinds if k in POINT_KINDS[point]])
        victim = 0 if point == "retention" or (point == "commit" and not two_tiers) else rng.randrange(num_processes)
        plan.append([victim, kind, point, rng.randint(1, 4)])
    where = f"seed {seed} {num_processes} processes tiers={two_tiers} plan {plan}"
    tally = Tally(jobs=1)
    t0 = time.monotonic()
    heartbeat_s = 10
    limit_s = 60 + faults * 3 * (COMMIT_TIMEOUT_S + ERROR_SLACK_S)
    args = dict(run_dir=run_dir, local_dir=local_dir, first_step=1, plan=plan, steps_per_fault=3)
    try:
        results = testing.run_processes(storage_loop_worker, num_processes, 2, args, timeout_s=limit_s, fail_fast=False,
                                        check=False, heartbeat_timeout_s=heartbeat_s)
    except testing.ProcessesFailed as e:
        tally.violations.append((*(plan[0][1:3] if plan else ("-", "-")), "job hung past its limit", f"{where}: {str(e)[:3000]}"))
        results = []
    struck: collections.Counter = collections.Counter()
    for r in results:
        for rec in r.records:
            if rec["event"] == "struck":
                struck[(rec["kind"], rec["point"])] += 1
    planned = collections.Counter((k, p) for _, k, p, _ in plan)
    tally.injected.update(struck)
    tally.missed.update(planned - struck)
    label = (plan[0][1], plan[0][2]) if plan else ("-", "-")
    for r in results:
        if r.returncode != 0:
            tally.violations.append((*label, "process failed", f"{where}: {r.describe()[-2500:]}"))
        for rec in r.records:
            if rec["event"] == "failed":
                tally.violations.append((*label, "undocumented error", f"{where}: process {r.process_id}: {rec}"))
            if rec["event"] == "save_failed" and rec["took_s"] > COMMIT_TIMEOUT_S + heartbeat_s + ERROR_SLACK_S:
                tally.violations.append((*label, "error too late", f"{where}: process {r.process_id}: {rec}"))
            if rec["event"] == "clean" and not rec["ok"]:
                tally.violations.append((*label, "clean save failed", f"{where}: process {r.process_id}: "
                                         + "; ".join(str(x) for x in r.records if x["event"] == "save_failed")[-1500:]))
            if rec["event"] == "restored" and rec["diff"]:
                tally.violations.append((*label, "not bit-exact", f"{where}: process {r.process_id}: {rec}"))
            if rec["event"] == "done" and rec["outside"]:
                tally.violations.append((*label, "outside touched", f"{where}: {rec['outside']}"))
    inv.after_fault(where)
    inv.after_clean_save(where)
    tally.violations += [(*label, c, m) for c, m in inv.violations]
    tally.wall_s = time.monotonic() - t0
    return tally


def _late_sigterm_shutdown_abort(results: Sequence[Any]) -> bool:
    """A SIGTERM that came after the loop's last preemption sync point, answered by JAX at
    exit: no process reached a preemption step (no `preempted` record), every process
    finished its work (`done`: loop, restore and close), and each that did not exit 0
    was aborted by `jax.distributed`'s shutdown barrier.

    Why that is JAX's outcome, not the library's (tests/faults/campaign.py, seeds
    1688266535, 1296936428, 519398818; docs/DESIGN-decisions.md, "A SIGTERM after the
    last sync point"): the notice reaches every process through the coordination
    service; a process that gets it before its exit starts JAX's sync protocol, which
    waits (3 min, holding the sync manager's lock) at a barrier for every process's step;
    a process that had already begun `jax.distributed.shutdown()` never joins it. The
    waiting process's own shutdown blocks on that lock, the others' 30 s shutdown
    barrier expires, and the service aborts every process (SIGABRT), after all the work
    was committed. There is no step left to save: the library documents the preemption
    save for a SIGTERM that a later `save(step)` can still answer."""
    if not results or any(x["event"] == "preempted" for r in results for x in r.records):
        return False
    for r in results:
        if not any(x["event"] == "done" for x in r.records):
            return False
        if r.returncode != 0 and not (r.returncode == -signal.SIGABRT and "Shutdown barrier has failed" in r.stderr):
            return False
    return any(r.returncode != 0 for r in results)


def late_sigterm_worker(delay_s: float) -> None:
    """A job of 2 processes (`checkpointer.testing.run_processes` target) with nothing of
    the library in it: process 1 ends at once; process 0 gets SIGTERM `delay_s` later, once
    1 is in `jax.distributed.shutdown()`, and then ends (JAX's notifier owns SIGTERM: the
    process lives on). JAX aborts both at exit (see `_late_sigterm_shutdown_abort`)."""
    import jax

    from checkpointer import testing

    if jax.process_index() == 0:
        time.sleep(delay_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
    testing.emit(event="done")


def _jax_ended_it(r: Any) -> bool:
    """`jax.distributed` ended the process (a dead or stopped peer: its heartbeat or the
    coordination service), a documented outcome (`CheckpointManager`'s commit_timeout_s)."""
    text = r.stderr
    return r.returncode in (-signal.SIGABRT, 1, -signal.SIGSTOP) and any(
        s in text for s in ("heartbeat", "coordination service", "Coordination", "UNAVAILABLE", "DEADLINE_EXCEEDED",
                            "Terminating process", "unhealthy"))


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


class _Stopper:
    """A coordination-service peer that stops answering: once the job's first step is
    committed in `run_dir`, waits `delay_s`, then sends SIGSTOP to process `victim` of
    the job (found by its environment). The stopped process is SIGKILLed (as a
    scheduler ends a hung node) once every other process of the job has ended, or
    after `kill_after_s`; `others_ended_s` is how long after the stop the others took
    to end (None: they had not when it was killed)."""

    def __init__(self, victim: int, run_dir: str, first_step: int, delay_s: float, kill_after_s: float) -> None:
        import threading

        self.victim, self.run_dir, self.first_step = victim, run_dir, first_step
        self.delay_s, self.kill_after_s = delay_s, kill_after_s
        self.stopped = False
        self.stopped_wall: float | None = None
        self.others_ended_s: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Stopper:
        self._thread.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._done.set()
        self._thread.join()

    def _job(self) -> dict[int, Any]:
        import psutil

        found = {}
        for p in psutil.Process(os.getpid()).children(recursive=True):
            try:
                pid = p.environ().get("CHECKPOINTER_TESTING_PROCESS_ID")
            except (psutil.Error, OSError):
                continue
            if pid is not None:
                found[int(pid)] = p
        return found

    def _run(self) -> None:
        import psutil

        while not any(s >= self.first_step for s in committed_steps(self.run_dir)):
            if self._done.wait(0.05):
                return
        if self._done.wait(self.delay_s):
            return
        job = self._job()
        victim = job.pop(self.victim, None)
        if victim is None:
            return
        try:
            victim.send_signal(signal.SIGSTOP)
        except psutil.Error:
            return
        self.stopped, self.stopped_wall = True, time.time()
        t = time.monotonic()
        while time.monotonic() - t < self.kill_after_s and not self._done.is_set():
            if not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in job.values()):
                self.others_ended_s = time.monotonic() - t
                break
            time.sleep(0.05)
        try:
            victim.kill()
            victim.send_signal(signal.SIGCONT)
        except psutil.Error:
            pass


# --- the campaign ---------------------------------------------------------------------------


def run_campaign(seed: int, faults: int, *, minutes: float | None = None, storage_share: float = 0.9,
                 multiprocess_storage_share: float = 0.3, workdir: str | None = None,
                 process_counts: Sequence[int] = (1, 4), storage_faults_per_job: int = 50,
                 multiprocess_faults_per_job: int = 15, progress: Any = None) -> Tally:
    """The campaign: `faults` faults armed (or until `minutes` run out).

    - `storage_share` of them are storage faults: `multiprocess_storage_share` of those
      in jobs of the largest process count (`multiprocess_storage_job`, 15 faults a
      job), the rest in this process (`storage_job`, 50 a job); tiers off and on in turn;
    - the rest are process faults (SIGKILL, SIGTERM, SIGSTOP: `process_job`, 2 a job)
      over `process_counts` x (one tier, two tiers).

    Deterministic in `seed` (up to timing)."""
    rng = random.Random(seed)
    deadline_s = None if minutes is None else time.monotonic() + minutes * 60
    n_storage = round(faults * storage_share)
    n_mp_storage = round(n_storage * multiprocess_storage_share) if max(process_counts) > 1 else 0
    n_storage -= n_mp_storage
    n_process = faults - n_storage - n_mp_storage
    total = Tally()

    def armed(t: Tally) -> int:
        return t.faults + sum(t.missed.values())

    def late() -> bool:
        return deadline_s is not None and time.monotonic() > deadline_s

    with tempfile.TemporaryDirectory(prefix="fault-campaign-", dir=workdir) as tmp:
        part = Tally()
        j = 0
        while armed(part) < n_storage and not late():
            d = os.path.join(tmp, f"storage-{j}")
            os.makedirs(d)
            t = storage_job(rng.randrange(2**31), min(storage_faults_per_job, n_storage - armed(part)), d,
                            two_tiers=j % 2 == 1, async_save=j % 3 != 2, deadline_s=deadline_s)
            part.add(t)
            total.add(t)
            j += 1
            if progress:
                progress(total)
        part = Tally()
        while armed(part) < n_mp_storage and not late():
            d = os.path.join(tmp, f"mp-storage-{j}")
            os.makedirs(d)
            t = multiprocess_storage_job(rng.randrange(2**31), min(multiprocess_faults_per_job, n_mp_storage - armed(part)),
                                         d, num_processes=max(process_counts), two_tiers=j % 2 == 1)
            part.add(t)
            total.add(t)
            j += 1
            if progress:
                progress(total)
        combos = [(n, tiers) for n in process_counts for tiers in (False, True)]
        k = 0
        done = 0
        while done < n_process and not late():
            n, tiers = combos[k % len(combos)]
            d = os.path.join(tmp, f"process-{k}")
            os.makedirs(d)
            batch = min(2, n_process - done)
            t = process_job(rng.randrange(2**31), batch, d, num_processes=n, two_tiers=tiers, deadline_s=deadline_s)
            total.add(t)
            done += batch
            k += 1
            if progress:
                progress(total)
    return total


def table(tally: Tally, title: str = "fault campaign") -> Any:
    """A rich Table: per kind, faults injected, armed but not reached, violations."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("kind", "injected", "not reached", "violations", "points (injected)"):
        t.add_column(col, justify="right" if col in ("injected", "not reached", "violations") else "left")
    for kind, (inj, miss, vio) in tally.by_kind().items():
        pts = ", ".join(f"{p} {tally.injected[(kind, p)]}" for p in POINTS if tally.injected[(kind, p)])
        t.add_row(kind, str(inj), str(miss), str(vio), pts)
    t.add_row("total", str(tally.faults), str(sum(tally.missed.values())), str(len(tally.violations)),
              f"{tally.jobs} jobs, {tally.wall_s:.0f} s")
    return t


__all__ = ["KINDS", "PROCESS_KINDS", "Tally", "loop_worker", "multiprocess_storage_job", "partial_folders", "process_job",
           "run_campaign", "storage_job", "storage_loop_worker", "table"]
