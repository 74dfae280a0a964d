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

Cost of the copies, in the save job (each on its own manager, 2 local-only saves each):
blocked seconds of `save`, wall seconds until the step is local and (with peers) copied,
and process CPU seconds over that span, without and with peer_copies=1.

Orbax reads the durable directory through TensorStore, which the paced backend cannot
throttle: its row reads at page-cache speed, a lower bound.

Run:  .venv/bin/python benchmarks/peers_bench.py [--quick] [--rate 200] [--dir /tmp]
      Prints a markdown table and replaces the peers_bench section of benchmarks/RESULTS.md
      (--quick: RESULTS.md untouched unless --results).
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
    """The training job: saves steps 100 and 110 with peers, Orbax's copy, and the copies' cost."""
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
    costs = {}
    for peers in (0, 1):
        cost_dir = f"{directory}/cost-{peers}"
        with ckpt.CheckpointManager(f"{cost_dir}/durable", peer_copies=peers, **dict(kw, local_directory=f"{cost_dir}/local")) as m:
            rows = []
            for step in (1, 2):  # local-only saves (durable every 100)
                multihost_utils.sync_global_devices(f"cost-{peers}-{step}")
                c0, t0 = _cpu_s(), time.perf_counter()
                m.save(step, {**state, "step": step})
                blocked = time.perf_counter() - t0
                m.wait_until_finished()  # local commit and (with peers) the copies checked
                rows.append({"blocked_s": blocked, "wall_s": time.perf_counter() - t0, "cpu_s": _cpu_s() - c0})
            costs[peers] = rows
    local_bytes = sum(x.addressable_shards[0].data.nbytes * len(x.addressable_shards) for x in state.values())
    testing.emit(event="saved", survives={str(k): v for k, v in survives.items()}, costs=costs, local_bytes=local_bytes)


def restore_job(directory: str, mib: int, case: str, rate_mib_s: float) -> None:
    """One restart: restore as `case` says, timed."""
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

    from checkpointer import testing

    def extra(ap):
        ap.add_argument("--rate", type=float, default=200.0, help="durable write rate per process, MiB/s")

    args = C.parse_args(__doc__, extra)
    mib = 64 if args.quick else 1024
    load, t0 = C.OtherLoad(), time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="peers-bench-") as d:
        saved = testing.run_processes(save_job, PROCESSES, DEVICES, {"directory": f"{d}/run", "mib": mib,
                                                                       "rate_mib_s": args.rate}, timeout_s=1800)
        recs = [r.record("saved") for r in saved]
        wipes = {"a": [], "b": [1], "c": [1, 2], "d": [], "orbax": []}
        results = {}
        for case, wiped in wipes.items():
            run = f"{d}/{case}"
            shutil.copytree(f"{d}/run", run, ignore=shutil.ignore_patterns("cost-*"))
            for p in wiped:
                shutil.rmtree(f"{run}/local/process-{p}")
            out = testing.run_processes(restore_job, PROCESSES, DEVICES, {"directory": run, "mib": mib, "case": case,
                                                                           "rate_mib_s": args.rate},
                                        timeout_s=1800)
            results[case] = [r.record("restored") for r in out]
            shutil.rmtree(run)
    names = {"a": "(a) same nodes", "b": "(b) one node lost, k=1", "c": "(c) two nodes lost, k=1",
             "d": "(d) durable only", "orbax": "orbax, from the same durable disk"}
    d_time = max(r["elapsed_s"] for r in results["d"])
    for case, recs_ in results.items():
        slowest = max(r["elapsed_s"] for r in recs_)
        durable = [r["durable_bytes"] for r in recs_]
        sources = sorted({str(r.get("source", "-")) for r in recs_})
        rows.append([names[case], str(recs_[0]["step"]), f"{slowest:.3f} s", f"{slowest / d_time:.2f}×",
                     "n/a (TensorStore)" if durable[0] is None else f"{sum(durable) / MiB:.1f}",
                     ", ".join(sources)])
    costs = recs[0]["costs"]
    gib = recs[0]["local_bytes"] / 2**30
    cost_rows = []
    for peers in ("0", "1"):
        cs = [max(r["costs"][peers][i]["cpu_s"] for r in recs) for i in range(2)]
        cost_rows.append([f"peer_copies={peers}", C.fmt([max(r["costs"][peers][i]["blocked_s"] for r in recs) for i in range(2)]),
                          C.fmt([max(r["costs"][peers][i]["wall_s"] for r in recs) for i in range(2)]), C.fmt(cs)])
    cpu_per_gib = [(max(r["costs"]["1"][i]["cpu_s"] for r in recs) - max(r["costs"]["0"][i]["cpu_s"] for r in recs)) / gib
                   for i in range(2)]
    del costs
    body = (
        C.header_lines("Peer copies: restart after a lost node (`benchmarks/peers_bench.py`)", args,
                       time.perf_counter() - t0, load)
        + f"- {PROCESSES} processes x {DEVICES} CPU devices as 4 simulated nodes; state {mib} MiB float32, "
        f"P('data','model') on 4x2; local saves every 10 steps, durable every 100; durable writes paced to "
        f"{args.rate:g} MiB/s per process and its reads too (Orbax's not: a lower bound)\n"
        f"- saved: step 100 (durable) and 110 (local + 1 peer copy); node losses survived as status() said: "
        f"{recs[0]['survives']}\n\n"
        + C.table(["case", "step restored", "restore (slowest process)", "÷ (d)", "MiB read from durable (all processes)", "sources"], rows)
        + "\n\nCost of one local save (each process's share "
        f"{gib:.3f} GiB; max over processes, per save):\n\n"
        + C.table(["", "save blocked", "until local (+ copies checked)", "process CPU"], cost_rows)
        + f"\n\nExtra CPU of the peer copy: {C.fmt(cpu_per_gib)} per GiB of each process's share "
        "(sender and the holder's server run in every process: each sends one share and receives one).\n"
    )
    print(body)
    C.write_section(args.results, "peers_bench", body)


if __name__ == "__main__":
    main()
