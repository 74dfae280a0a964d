"""Cooperative restore benchmark: a fully replicated state restored by 4 local processes
(2 CPU devices each, `jax.distributed` with gloo), cooperative against every process
reading all it needs, next to orbax-checkpoint restoring the same state in the same run.

State: 16 float32 arrays of 1024x1024 (64 MiB; --quick: 512x512, 16 MiB), saved fully
replicated (P() on the 4x2 ('data', 'model') mesh of the 8 devices) with `ckpt.save`
and with orbax (`ocp.StandardCheckpointer`). Restore target: the same, fully replicated.

Per run, in an order rotated from run to run, every process (after a barrier):
  cooperative          ckpt.restore(path, target)  (each reads a quarter, JAX exchanges)
  every-process-reads  ckpt.restore(path, target, cooperative=False)
  orbax                StandardCheckpointer().restore(path, target)
then jax.block_until_ready. Reported per method: the slowest process's time (the job
waits for it), per process the bytes read from the checkpoint's files (checkpointer:
`RestoreStats.bytes_read`; orbax reads through TensorStore, which the library cannot
count: its `/proc/self/io` rchar rise is shown, i.e. the bytes its read()/pread() calls
returned; TensorStore's chunk cache can keep it below the model's bytes), and for
checkpointer the bytes received from peers and the exchange's time (JAX resharding
over gloo, `RestoreStats.exchange_s`).
The files were just written: the page cache is warm, so storage bandwidth is memory
bandwidth here; on a shared file system or bucket the bytes read are what costs.

Run:  .venv/bin/python benchmarks/coop_restore_bench.py [--runs 5] [--quick] [--dir /tmp]
      Prints a markdown table and replaces the coop_restore_bench section of
      benchmarks/RESULTS.md (--quick: 16 MiB, 1 run, RESULTS.md untouched unless --results).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("cooperative", "every-process-reads", "orbax")
PROCESSES, DEVICES = 4, 2


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def work(directory: str, side: int, leaves: int, runs: int) -> None:
    """One process of the job (runs under `checkpointer.testing`)."""
    import absl.logging
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    import checkpointer as ckpt
    from checkpointer import testing

    absl.logging.set_verbosity(absl.logging.ERROR)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rep = NamedSharding(mesh, P())
    make = jax.jit(lambda k: jax.random.normal(k, (side, side), jnp.float32), out_shardings=rep)
    state = {f"w{i:02d}": make(jax.random.key(i)) for i in range(leaves)}
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep) for k, v in state.items()}
    ours, theirs = f"{directory}/checkpointer/1", f"{directory}/orbax/1"
    ckpt.save(ours, state)
    orbax = ocp.StandardCheckpointer()
    orbax.save(theirs, state)
    orbax.wait_until_finished()
    multihost_utils.sync_global_devices("saved")

    def run(method):
        stats = ckpt.RestoreStats()
        r0 = _rchar()
        t0 = time.perf_counter()
        if method == "orbax":
            out = orbax.restore(theirs, target)
        else:
            out = ckpt.restore(ours, target, stats=stats, cooperative=method == "cooperative")
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - t0
        ok = all(np.array_equal(np.asarray(out[k].addressable_shards[0].data), np.asarray(state[k].addressable_shards[0].data))
                 for k in state)
        return {"elapsed_s": elapsed, "bytes_read": stats.bytes_read if method != "orbax" else None,
                "bytes_received": stats.bytes_received, "exchange_s": stats.exchange_s, "rchar": _rchar() - r0, "ok": ok}

    for r in range(runs + 1):  # round 0 warms up (compilation) and is not counted
        order = METHODS[r % 3:] + METHODS[: r % 3]
        for method in order:
            multihost_utils.sync_global_devices(f"{method}-{r}")
            rec = run(method)
            if r > 0:
                testing.emit(event="run", method=method, run=r, **rec)
    testing.emit(event="done", model_bytes=sum(v.size * v.dtype.itemsize for v in state.values()))


def main() -> None:
    import _common as C

    from checkpointer import testing

    args = C.parse_args(__doc__)
    side = 512 if args.quick else 1024
    load, t0 = C.OtherLoad(), time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="coop-bench-") as d:
        results = testing.run_processes(work, PROCESSES, DEVICES, {"directory": d, "side": side, "leaves": 16, "runs": args.runs},
                                        timeout_s=1800)
    model = results[0].record("done")["model_bytes"]
    runs = {(m, r.process_id): [x for x in r.records if x["event"] == "run" and x["method"] == m] for m in METHODS for r in results}
    assert all(x["ok"] for v in runs.values() for x in v), "a restore returned other values than saved"
    rows = []
    for m in METHODS:
        per_run_max = [max(runs[(m, p)][k]["elapsed_s"] for p in range(PROCESSES)) for k in range(args.runs)]
        if m == "orbax":
            read = "n/a (TensorStore)"
        else:
            read = " / ".join(f"{runs[(m, p)][0]['bytes_read'] / 2**20:.1f}" for p in range(PROCESSES))
            total = sum(runs[(m, p)][0]["bytes_read"] for p in range(PROCESSES))
            read += f" (sum {total / model:.2f}× the model)"
        rchar = " / ".join(f"{runs[(m, p)][0]['rchar'] / 2**20:.1f}" for p in range(PROCESSES))
        received = " / ".join(f"{runs[(m, p)][0]['bytes_received'] / 2**20:.1f}" for p in range(PROCESSES)) if m != "orbax" else "-"
        exchange = (C.fmt([max(runs[(m, p)][k]["exchange_s"] for p in range(PROCESSES)) for k in range(args.runs)], "s")
                    if m == "cooperative" else "-")
        rows.append([m, C.fmt(per_run_max, "s"), read, received, exchange, rchar])
    body = (
        C.header_lines("Cooperative restore (`benchmarks/coop_restore_bench.py`)", args, time.perf_counter() - t0, load)
        + f"- {PROCESSES} processes x {DEVICES} CPU devices (jax.distributed, gloo); state: 16 float32 {side}x{side} "
        f"arrays, {model / 2**20:.0f} MiB, saved and restored fully replicated (P() on a 4x2 mesh)\n"
        "- time: the slowest process, per run; MiB per process 0 / 1 / 2 / 3 (of the first measured run)\n\n"
        + C.table(["method", "time", "MiB read from the checkpoint, per process", "MiB received from peers", "exchange",
                   "rchar MiB (read() and pread() bytes)"], rows)
        + "\n"
    )
    print(body)
    C.write_section(args.results, "coop_restore_bench", body)


if __name__ == "__main__":
    main()
