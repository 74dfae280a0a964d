"""Peer copies benchmark: restart after a lost node, 4 processes x 2 CPU devices as 4
simulated nodes (`peer_node="node-<i>"`), `jax.distributed` with gloo.

State: float32 arrays (default 1 GiB in 16 leaves; --quick: 64 MiB) sharded
P('data', 'model') on the 4x2 mesh. The save job runs a manager with
local_directory=<tmp>/local, peer_copies=1, local saves every 10 steps and durable ones
every 100 (`durable_every_steps=100`), the durable tier's writes paced to --rate MiB/s per
process (`max_write_bytes_per_s`, the library's rate limit) and its reads too (a `paced://`
backend registered with `ckpt.register_storage`: the library's token bucket on reads): it saves steps 100 (local,
peers, durable) and 110 (local and peers only), and Orbax saves the same state into
<tmp>/orbax (ocp.StandardCheckpointer, not paced: Orbax has no rate limit).

Then one restart job per case, each timed from the restore call to the restored state
(`jax.block_until_ready`), the slowest process:
  (a) same nodes           restore(None): every process reads its own local copy
  (b) one node lost        process 1's local folder wiped (its steps and the copies it held)
  (c) two nodes lost       processes 1 and 2 wiped (k = 1: process 1's share of 110 is gone)
  (d) durable only         ckpt.restore(<durable>/100) without a local tier
  orbax                    StandardCheckpointer().restore(<orbax>, target), beside (d)
Per case: the step restored (steps lost at a node loss = the failure step minus it; with
saves every 10 steps at most 10 when a copy survives), bytes read from the durable tier
(`status().last_restore_durable_bytes`, or `RestoreStats.bytes_read` for (d)).

The cost of a local save (`cost_job`, its own job; the peers_bench_cost section): the
training time lost per local save as benchmarks/train_loss_bench.py defines it (a loop
of training steps with a local save every --every steps, against the same loop without
saves), and the process CPU it takes, without and with peer_copies=1; with --baseline
another checkout of the library (e.g. /work/main) runs the same job alternately, side
by side. Where the library counts them (`PeerService.copy_cpu_s`), the CPU of the copy
threads alone (sender and the holder's server) per GiB copied too.

Orbax reads the durable directory through TensorStore, which the paced backend cannot
throttle: its row reads at page-cache speed, a lower bound.

Run:  .venv/bin/python benchmarks/peers_bench.py [--quick] [--rate 200] [--dir /tmp]
      [--pretouch-mib 400] [--only-restarts] [--only-cost] [--every 10] [--saves 3] [--baseline /work/main] [--runs N]
      Prints markdown tables and replaces the peers_bench (restarts) and peers_bench_cost
      sections of benchmarks/RESULTS.md (--quick: RESULTS.md untouched unless --results).
"""

from __future__ import annotations

import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROCESSES, DEVICES = 4, 2
MiB = 2**20


def register_paced_reads(rate_mib_s: float) -> None:
    """`paced://<path>`: a local directory whose reads (files, ranges, readers) are paced to
    `rate_mib_s` MiB/s per process by the library's token bucket; writes go through
    unpaced (the manager paces them with max_write_bytes_per_s). A backend of the
    storage registry, so the durable tier's restore reads are throttled too."""
    import checkpointer as ckpt
    from checkpointer._storage import LocalStorage, Reader, acquire, limiter_for

    bucket = limiter_for(rate_mib_s * MiB)

    class PacedReader(Reader):
        def __init__(self, inner):
            self._inner = inner

        def size(self):
            return self._inner.size()

        def read_into(self, offset, buffer):
            acquire(bucket, len(buffer))
            self._inner.read_into(offset, buffer)

        def close(self):
            self._inner.close()

    class PacedReads(LocalStorage):
        def read_file(self, path, max_bytes=None):
            data = super().read_file(path, max_bytes)
            acquire(bucket, len(data))
            return data

        def read_range(self, path, offset, length):
            data = super().read_range(path, offset, length)
            acquire(bucket, len(data))
            return data

        def open_reader(self, path):
            return PacedReader(super().open_reader(path))

    ckpt.register_storage("paced", lambda url: (PacedReads(), url[len("paced://"):].rstrip("/")), replace=True)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _state(mib: int, leaves: int = 16):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    rows = max(8, int(mib * MiB / leaves / 4 / 1024) // 8 * 8)
    make = jax.jit(lambda k: jax.random.normal(k, (rows, 1024), jnp.float32), out_shardings=sharding)
    state = {f"w{i:02d}": make(jax.random.key(i)) for i in range(leaves)}
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in state.items()}
    return state, target


def save_job(directory: str, mib: int, rate_mib_s: float) -> None:
    """The training job: saves steps 100 and 110 with peers, and Orbax's copy."""
    import absl.logging
    import jax
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    import checkpointer as ckpt
    from checkpointer import testing

    absl.logging.set_verbosity(absl.logging.ERROR)
    pidx = jax.process_index()
    state, _ = _state(mib)
    kw = dict(local_directory=f"{directory}/local", keep_local=ckpt.KeepLatest(1), peer_node=f"node-{pidx}",
              durable_every_steps=100, max_write_bytes_per_s=rate_mib_s * MiB, commit_timeout_s=600)
    register_paced_reads(rate_mib_s)
    with ckpt.CheckpointManager(f"paced://{directory}/durable", peer_copies=1, **kw) as m:
        for step in (100, 110):
            m.save(step, {**jax.tree.map(lambda x, s=step: x + s, state), "step": step})
        m.wait_until_finished()
        multihost_utils.sync_global_devices("saved")
        survives = m.status().node_losses_survived
    orbax = ocp.StandardCheckpointer()
    orbax.save(f"{directory}/orbax", jax.tree.map(lambda x: x + 100, state))
    orbax.wait_until_finished()
    testing.emit(event="saved", survives={str(k): v for k, v in survives.items()})


def _train_step_fn():
    """A training step that reads and writes the whole state (donated, as a real step's
    update) and ends in one all-reduce over every process (the loss), so the processes
    march in step as in training: a process slowed by its save slows the job."""
    import jax
    import jax.numpy as jnp

    def step(state):
        new = {k: v - 1e-3 * jnp.tanh(v) for k, v in state.items()}
        loss = sum(jnp.mean(v * v) for v in new.values())
        return new, loss

    return jax.jit(step, donate_argnums=0)


def _copy_cpu_s(m) -> float:
    """CPU seconds of the manager's peer-copy threads (sender and server), or NaN where
    the library does not count them (a baseline checkout)."""
    peers = getattr(getattr(m, "_tiers", None), "peers", None)
    counted = getattr(peers, "copy_cpu_s", None)
    return float("nan") if counted is None else sum(counted.values())


def cost_job(directory: str, mib: int, every: int, saves: int, rounds: int) -> None:
    """Training time lost per local save, and its process CPU, with and without peer
    copies: the same loop (`saves` blocks of `every` steps) without saves, with a local
    save (manager, peer_copies=0) before each block, and with peer_copies=1; in an order
    rotated per round, after one warm-up round."""
    import os

    import absl.logging
    import jax
    from jax.experimental import multihost_utils

    import checkpointer as ckpt
    from checkpointer import testing

    absl.logging.set_verbosity(absl.logging.ERROR)
    pidx = jax.process_index()
    state, _ = _state(mib)
    train = _train_step_fn()
    managers = {peers: ckpt.CheckpointManager(f"{directory}/cost-{peers}/durable", local_directory=f"{directory}/cost-{peers}/local",
                                              keep_local=ckpt.KeepLatest(1), peer_node=f"node-{pidx}", peer_copies=peers,
                                              durable_every_steps=100_000, commit_timeout_s=600)
                for peers in (0, 1)}
    variants = ["none", "0", "1"]
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    step = 0
    for r in range(rounds + 1):
        for variant in variants[r % 3:] + variants[: r % 3]:
            m = None if variant == "none" else managers[int(variant)]
            multihost_utils.sync_global_devices(f"cost-{r}-{variant}")
            c0, t0, copy0 = _cpu_s(), time.perf_counter(), _copy_cpu_s(managers[1])
            for _ in range(saves):
                step += 1
                if m is not None:
                    m.save(step * every, state)
                for _ in range(every):
                    state, loss = train(state)
            jax.block_until_ready((state, loss))
            loop_s = time.perf_counter() - t0
            if m is not None:
                m.wait_until_finished()  # the last save's copies: untimed, inside the CPU window
            copy_s = _copy_cpu_s(managers[1]) - copy0
            if r:
                rows[variant].append({"loop_s": loop_s, "cpu_s": _cpu_s() - c0, "copy_cpu_s": copy_s})
    for m in managers.values():
        m.close()
    share = sum(s.data.nbytes for x in state.values() for s in x.addressable_shards)
    testing.emit(event="cost", rows=rows, share_bytes=share, library=os.path.dirname(os.path.abspath(ckpt.__file__)))


def pretouch(mib: int) -> float:
    """Writes `mib` MiB of fresh memory once and frees it (before the timer); returns its
    seconds. On this VM (virtio-balloon free page reporting) fresh 2 MiB blocks are
    backed by the host only at their first touch, 2-25 s/GiB loaded: a restart's
    destination arrays then pay the VM, not the restart (docs/DESIGN-decisions.md, "The
    restart's first second"). The freed pages are reused by the restore's allocations
    within the reporting delay (~2 s)."""
    import numpy as np

    if mib <= 0:
        return 0.0
    t0 = time.perf_counter()
    junk = np.ones(mib * MiB, np.uint8)
    del junk
    return time.perf_counter() - t0


def restore_job(directory: str, mib: int, case: str, rate_mib_s: float, pretouch_mib: int = 0) -> None:
    """One restart: restore as `case` says, timed (after `pretouch(pretouch_mib)`)."""
    import absl.logging
    import jax
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    import checkpointer as ckpt
    from checkpointer import testing

    absl.logging.set_verbosity(absl.logging.ERROR)
    pidx = jax.process_index()
    _, target = _state(mib)
    register_paced_reads(rate_mib_s)
    pretouch(pretouch_mib)
    multihost_utils.sync_global_devices(f"restore-{case}")
    if case == "orbax":
        t0 = time.perf_counter()
        out = ocp.StandardCheckpointer().restore(f"{directory}/orbax", target)
        jax.block_until_ready(out)
        testing.emit(event="restored", case=case, elapsed_s=time.perf_counter() - t0, step=100, durable_bytes=None)
        return
    if case == "d":
        stats = ckpt.RestoreStats()
        t0 = time.perf_counter()
        out = ckpt.restore(f"paced://{directory}/durable/100", {**target, "step": None}, stats=stats)
        jax.block_until_ready(out)
        testing.emit(event="restored", case=case, elapsed_s=time.perf_counter() - t0, step=100,
                     durable_bytes=stats.bytes_read)
        return
    with ckpt.CheckpointManager(f"paced://{directory}/durable", local_directory=f"{directory}/local", peer_copies=1,
                                peer_node=f"node-{pidx}", durable_every_steps=100, read_only=True,
                                commit_timeout_s=600) as m:
        t0 = time.perf_counter()
        out = m.restore(None, {**target, "step": None})
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - t0
        status = m.status()
        testing.emit(event="restored", case=case, elapsed_s=elapsed, step=int(out["step"]),
                     source=status.last_restore_source, durable_bytes=status.last_restore_durable_bytes)


def main() -> None:
    import _common as C

    def extra(ap):
        ap.add_argument("--rate", type=float, default=200.0, help="durable write rate per process, MiB/s")
        ap.add_argument("--pretouch-mib", type=int, default=0,
                        help="each restart process writes and frees this much fresh memory before the timer "
                             "(e.g. 400: the VM's first touch of the restored arrays' memory out of the timer)")
        ap.add_argument("--only-restarts", action="store_true", help="only the restart cases (peers_bench)")
        ap.add_argument("--only-cost", action="store_true", help="only the cost of the local saves (peers_bench_cost)")
        ap.add_argument("--every", type=int, default=10, help="training steps per local save (default 10)")
        ap.add_argument("--saves", type=int, default=3, help="local saves per measured loop (default 3)")
        ap.add_argument("--baseline", default=None,
                        help="another checkout of the library (e.g. /work/main): its cost job runs alternately "
                             "with this one's, side by side")

    args = C.parse_args(__doc__, extra)
    mib = 64 if args.quick else 1024
    if not args.only_cost:
        restore_part(args, mib)
    if not args.only_restarts:
        cost_part(args, mib)


def restore_part(args, mib: int) -> None:
    """The restart cases (a)-(d) and Orbax: the peers_bench section."""
    import statistics

    import _common as C

    from checkpointer import testing

    load, t0 = C.OtherLoad(), time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="peers-bench-") as d:
        saved = testing.run_processes(save_job, PROCESSES, DEVICES, {"directory": f"{d}/run", "mib": mib,
                                                                       "rate_mib_s": args.rate}, timeout_s=1800)
        recs = [r.record("saved") for r in saved]
        wipes = {"a": [], "b": [1], "c": [1, 2], "d": [], "orbax": []}
        results: dict[str, list[list[dict]]] = {case: [] for case in wipes}
        cases = list(wipes)
        for run_i in range(args.runs):  # every case once per run, the order rotated per run
            for case in cases[run_i % len(cases):] + cases[:run_i % len(cases)]:
                run = f"{d}/{case}"
                shutil.copytree(f"{d}/run", run, ignore=shutil.ignore_patterns("cost-*"))
                for p in wipes[case]:
                    shutil.rmtree(f"{run}/local/process-{p}")
                out = testing.run_processes(restore_job, PROCESSES, DEVICES, {"directory": run, "mib": mib, "case": case,
                                                                               "rate_mib_s": args.rate,
                                                                               "pretouch_mib": args.pretouch_mib},
                                            timeout_s=1800)
                results[case].append([r.record("restored") for r in out])
                shutil.rmtree(run)
    names = {"a": "(a) same nodes", "b": "(b) one node lost, k=1", "c": "(c) two nodes lost, k=1",
             "d": "(d) durable only", "orbax": "orbax, from the same durable disk"}

    def slowest(runs: list[list[dict]]) -> list[float]:  # per run, the slowest process
        return [max(r["elapsed_s"] for r in recs_) for recs_ in runs]

    d_median = statistics.median(slowest(results["d"]))
    for case, runs in results.items():
        times = slowest(runs)
        steps = sorted({str(recs_[0]["step"]) for recs_ in runs})
        durable = [[r["durable_bytes"] for r in recs_] for recs_ in runs]
        sources = sorted({str(r.get("source", "-")) for recs_ in runs for r in recs_})
        mib_read = sorted({f"{sum(x) / MiB:.1f}" for x in durable}) if durable[0][0] is not None else ["n/a (TensorStore)"]
        rows.append([names[case], ", ".join(steps), C.fmt(times), f"{statistics.median(times) / d_median:.2f}×",
                     ", ".join(mib_read), ", ".join(sources)])
    body = (
        C.header_lines("Peer copies: restart after a lost node (`benchmarks/peers_bench.py`)", args,
                       time.perf_counter() - t0, load)
        + f"- {PROCESSES} processes x {DEVICES} CPU devices as 4 simulated nodes; state {mib} MiB float32, "
        f"P('data','model') on 4x2; local saves every 10 steps, durable every 100; durable writes paced to "
        f"{args.rate:g} MiB/s per process and its reads too (Orbax's not: a lower bound)\n"
        + (f"- each restart process wrote and freed {args.pretouch_mib} MiB of fresh memory before the timer "
           "(--pretouch-mib: the VM's first touch of the restored arrays' memory out of the timer)\n"
           if args.pretouch_mib else "")
        + f"- saved: step 100 (durable) and 110 (local + 1 peer copy); node losses survived as status() said: "
        f"{recs[0]['survives']}\n"
        + f"- each case restored {args.runs} time(s) from a fresh copy of the saved run, the cases' order rotated per "
        "run; a cell: the slowest process per run, median (min–max) over the runs; ÷ (d): ratio of medians\n\n"
        + C.table(["case", "step restored", "restore (slowest process)", "÷ (d)", "MiB read from durable (all processes)", "sources"], rows)
        + "\n\nThe cost of the local saves with and without peer copies: the peers_bench_cost section.\n"
    )
    print(body)
    C.write_section(args.results, "peers_bench", body)


def cost_part(args, mib: int) -> None:
    """Training time lost per local save and its process CPU, with and without peer
    copies (`cost_job`), per library checkout (this one, and --baseline alternately):
    the peers_bench_cost section."""
    import os
    import statistics

    import _common as C

    from checkpointer import testing

    here = str(Path(__file__).resolve().parent.parent)
    libs = {"this checkout": here} | ({f"baseline {args.baseline}": args.baseline} if args.baseline else {})
    load, t0 = C.OtherLoad(), time.perf_counter()
    per: dict[str, dict[str, list[float]]] = {name: {} for name in libs}
    share_gib = 0.0
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="peers-cost-") as d:
        for run in range(args.runs):
            for j, (name, lib) in enumerate(libs.items()):
                env = {"PYTHONPATH": os.pathsep.join([lib, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
                cwd = os.getcwd()
                os.chdir(lib)  # the workers run `python -c`: the working directory comes first on their path
                try:
                    out = testing.run_processes(cost_job, PROCESSES, DEVICES, {
                        "directory": f"{d}/{run}-{j}", "mib": mib,
                        "every": args.every, "saves": args.saves, "rounds": 2}, timeout_s=1800, env=env)
                finally:
                    os.chdir(cwd)
                where = {r.record("cost")["library"] for r in out}
                assert where == {os.path.join(os.path.abspath(lib), "checkpointer")}, (lib, where)
                recs = [r.record("cost") for r in out]
                share_gib = recs[0]["share_bytes"] / 2**30
                for i in range(len(recs[0]["rows"]["none"])):
                    loop = {v: max(r["rows"][v][i]["loop_s"] for r in recs) for v in ("none", "0", "1")}  # lockstep
                    cpu = {v: statistics.mean(r["rows"][v][i]["cpu_s"] for r in recs) for v in ("none", "0", "1")}
                    got = per[name]
                    for k in ("0", "1"):
                        got.setdefault(f"lost_{k}", []).append((loop[k] - loop["none"]) / args.saves)
                        got.setdefault(f"cpu_{k}", []).append((cpu[k] - cpu["none"]) / args.saves)
                    got.setdefault("per_gib", []).append((got["cpu_1"][-1] - got["cpu_0"][-1]) / share_gib)
                    got.setdefault("loop_none", []).append(loop["none"] / args.saves)
                    copy = statistics.mean(r["rows"]["1"][i]["copy_cpu_s"] for r in recs) / args.saves / share_gib
                    if copy == copy:  # not NaN: the library counts its copy threads' CPU
                        got.setdefault("copy_per_gib", []).append(copy)
    rows = []
    for name, got in per.items():
        for k in ("0", "1"):
            rows.append([name, f"peer_copies={k}", C.fmt(got[f"lost_{k}"]), C.fmt(got[f"cpu_{k}"])])
        without = statistics.median(got["lost_0"])
        ratio = f"{statistics.median(got['lost_1']) / without:.2f}×" if without > 0.05 else "n/a (none lost without)"
        rows.append([name, "with ÷ without peers (medians) / extra per GiB copied", ratio,
                     C.fmt(got["per_gib"], unit="CPU-s/GiB")])
        if got.get("copy_per_gib"):
            rows.append([name, "the copy threads alone (sender + server) per GiB copied", "",
                         C.fmt(got["copy_per_gib"], unit="CPU-s/GiB")])
    body = (
        C.header_lines("Peer copies: the cost of a local save (`benchmarks/peers_bench.py`)", args,
                       time.perf_counter() - t0, load)
        + f"- {PROCESSES} processes x {DEVICES} CPU devices as 4 simulated nodes; state {mib} MiB float32 "
        f"(each process's share {share_gib:.3f} GiB); a training step that reads and writes the whole state "
        "(donated) and ends in an all-reduce over every process (the processes march in step)\n"
        f"- one loop: {args.saves} blocks of {args.every} steps, a local save (CheckpointManager, "
        "durable_every_steps=100000) before each block; the same loop without saves, with peer_copies=0 and with "
        "peer_copies=1 in a rotated order, 2 measured rounds after a warm-up per run; the last save's copies "
        "awaited untimed, inside the CPU window\n"
        "- training time lost per local save = (loop − the same round's loop without saves) / saves, the slowest "
        "process; process CPU per local save = (CPU − the same round's CPU without saves) / saves, mean over "
        "processes (every process sends one share and receives one); extra per GiB copied = (CPU with peers − "
        "without) per save / the share\n"
        f"- loop without saves: {C.fmt(next(iter(per.values()))['loop_none'])} per block of {args.every} steps\n"
        "- targets (issue 29): peer copies add at most 0.3 CPU-s per GiB copied, and at most 1.5× the training "
        "time lost per local save without them\n\n"
        + C.table(["library", "", "training time lost / local save", "process CPU / local save"], rows)
        + "\n"
    )
    print(body)
    C.write_section(args.results, "peers_bench_cost", body)


if __name__ == "__main__":
    main()
