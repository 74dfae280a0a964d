"""Replicated save benchmark: a fully replicated state saved by 4 local processes (2 CPU
devices each, `jax.distributed` with gloo) with replica-parallel writes (the default),
with the one-writer plan (every box written whole by its replica_id 0 holder, i.e.
process 0 writes everything), and with orbax-checkpoint, in the same run.

State: 16 float32 arrays of 2048x2048 (256 MiB; --quick: 1024x1024, 64 MiB), fully
replicated (P() on the 4x2 ('data', 'model') mesh of the 8 devices).

Per run, in an order rotated from run to run, every process (after a barrier) saves to
a fresh path:
  replica-parallel  ckpt.save(path, state)
  one-writer        the same with `checkpointer._save_plan._ONE_WRITER = True`, a
                    benchmark-only switch (not API) that plans the pre-replica-parallel
                    behaviour
  orbax             StandardCheckpointer().save(path, state); wait_until_finished()
  ..., capped       the first two with `max_write_bytes_per_s=256 MiB/s` per process:
                    here all processes share one disk and 2 cores, so parallel writers
                    compete for the same memory bandwidth; the cap stands in for
                    hosts that each have their own link to the storage
Reported per method: the save's time until committed as felt by the slowest process
(the job waits for it; both libraries return on every process once the commit is done),
and per process the bytes it wrote (checkpointer: `bytes_written` of its
`processes/<i>.json`, the chunk files; all methods: the `/proc/self/io` wchar rise, the
bytes its write()/pwrite() calls took, metadata included).
Checkpoints go to local disk (page cache); on a shared file system or bucket, the
slowest process's bytes are what costs.

Run:  .venv/bin/python benchmarks/replicated_save_bench.py [--runs 5] [--quick] [--dir /tmp]
      Prints a markdown table and replaces the replicated_save_bench section of
      benchmarks/RESULTS.md (--quick: 64 MiB, 1 run, RESULTS.md untouched unless --results).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CAP_BYTES_PER_S = 256 * 2**20  # the "capped" methods' per-process write rate: a host's own link
CAPPED = ("replica-parallel, capped", "one-writer, capped")
METHODS = ("replica-parallel", "one-writer", "orbax", *CAPPED)
PROCESSES, DEVICES = 4, 2


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def work(directory: str, side: int, leaves: int, runs: int) -> None:
    """One process of the job (runs under `checkpointer.testing`)."""
    import json
    import shutil

    import absl.logging
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    import checkpointer as ckpt
    from checkpointer import testing
    from checkpointer._save import _pipeline as _save, _plan as _save_plan

    absl.logging.set_verbosity(absl.logging.ERROR)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rep = NamedSharding(mesh, P())
    make = jax.jit(lambda k: jax.random.normal(k, (side, side), jnp.float32), out_shardings=rep)
    state = jax.block_until_ready({f"w{i:02d}": make(jax.random.key(i)) for i in range(leaves)})
    orbax = ocp.StandardCheckpointer()
    pidx = jax.process_index()

    def run(method, r):
        path = f"{directory}/{method.replace(', ', '-')}/{r}"
        _save_plan._ONE_WRITER = method.startswith("one-writer")
        _save._PLAN_CACHE.clear()
        w0 = _wchar()
        t0 = time.perf_counter()
        if method == "orbax":
            orbax.save(path, state)
            orbax.wait_until_finished()
        else:
            ckpt.save(path, state, max_write_bytes_per_s=CAP_BYTES_PER_S if method in CAPPED else None)
        elapsed = time.perf_counter() - t0
        wchar = _wchar() - w0
        written = None
        if method != "orbax":
            written = json.loads(Path(f"{path}/processes/{pidx}.json").read_text())["bytes_written"]
        multihost_utils.sync_global_devices(f"measured-{method}-{r}")
        if pidx == 0:
            shutil.rmtree(path)  # keep the disk (and page cache) from filling up
        return {"elapsed_s": elapsed, "bytes_written": written, "wchar": wchar}

    for r in range(runs + 1):  # round 0 warms up (compilation, orbax's first save) and is not counted
        order = METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]
        for method in order:
            multihost_utils.sync_global_devices(f"{method}-{r}")
            rec = run(method, r)
            if r > 0:
                testing.emit(event="run", method=method, run=r, **rec)
    _save_plan._ONE_WRITER = False
    testing.emit(event="done", model_bytes=sum(v.size * v.dtype.itemsize for v in state.values()))


def main() -> None:
    import _common as C

    from checkpointer import testing

    args = C.parse_args(__doc__)
    side = 1024 if args.quick else 2048
    load, t0 = C.OtherLoad(), time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="repsave-bench-") as d:
        results = testing.run_processes(work, PROCESSES, DEVICES, {"directory": d, "side": side, "leaves": 16, "runs": args.runs},
                                        timeout_s=1800)
    model = results[0].record("done")["model_bytes"]
    runs = {(m, r.process_id): [x for x in r.records if x["event"] == "run" and x["method"] == m] for m in METHODS for r in results}
    rows = []
    for m in METHODS:
        per_run_max = [max(runs[(m, p)][k]["elapsed_s"] for p in range(PROCESSES)) for k in range(args.runs)]
        if m == "orbax":
            written = "n/a (TensorStore)"
        else:
            written = " / ".join(f"{runs[(m, p)][0]['bytes_written'] / 2**20:.1f}" for p in range(PROCESSES))
        wchar = " / ".join(f"{runs[(m, p)][0]['wchar'] / 2**20:.1f}" for p in range(PROCESSES))
        rows.append([m, C.fmt(per_run_max, "s"), written, wchar])
    body = (
        C.header_lines("Replicated save (`benchmarks/replicated_save_bench.py`)", args, time.perf_counter() - t0, load)
        + f"- {PROCESSES} processes x {DEVICES} CPU devices (jax.distributed, gloo); state: 16 float32 {side}x{side} "
        f"arrays, {model / 2**20:.0f} MiB, fully replicated (P() on a 4x2 mesh)\n"
        "- time: save until committed, the slowest process, per run; MiB per process 0 / 1 / 2 / 3 (of the first "
        "measured run). one-writer: the benchmark-only `_save_plan._ONE_WRITER` switch (every box written by its "
        "replica_id 0 holder, as before replica-parallel writes); capped: `max_write_bytes_per_s` of "
        f"{CAP_BYTES_PER_S / 2**20:.0f} MiB/s per process, standing in for hosts with their own link to the storage "
        "(here all processes share one disk and 2 cores)\n\n"
        + C.table(["method", "time to committed", "MiB of chunk files written, per process",
                   "wchar MiB (write() and pwrite() bytes)"], rows)
        + "\n"
    )
    print(body)
    C.write_section(args.results, "replicated_save_bench", body)


if __name__ == "__main__":
    main()
