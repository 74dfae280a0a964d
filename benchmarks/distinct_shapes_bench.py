"""Distinct leaf shapes in a fresh process (issue 28 item 2): a tree of 300 leaves of
distinct shapes against the same number of leaves and about the same bytes in one shape,
each restored in a new Python process, checkpointer beside Orbax.

States (float32, saved P('data', 'model') on a 2x4 mesh of 8 host (CPU) devices, restored
onto the same sharding):
  distinct  300 leaves of (2 * (64 + i), 256) for i < 300: 128 ... 726 rows (125 MiB;
            --quick: 32 columns, 16 MiB)
  one shape 300 leaves of (428, 256) (the mean rows rounded to an even number; 125 MiB)
checkpointer saves with `pack_small_leaves_bytes=0`, so every leaf is its own zarr array:
the route whose XLA-owned destination buffers cost a compile per distinct box shape
before (the packed route compiles nothing per shape).

Each measurement runs in a fresh child process (`--child`): it imports jax and numpy and
builds the target (devices initialised) before the timer; the timer covers
`import checkpointer` / `import orbax.checkpoint` and the restore until
`jax.block_until_ready`. The child reports wall time, user and system CPU seconds and the
XLA backend compiles during the timed part (`jax.monitoring`, event
'/jax/core/compile/backend_compile_duration'). A warm-up round, not counted, checks every
restore's values (per-leaf sums). Page cache warm (every file read once before each run).

Run:  .venv/bin/python benchmarks/distinct_shapes_bench.py [--runs 3] [--quick] [--dir /tmp]
      Prints a markdown table and replaces the distinct_shapes_bench section of
      benchmarks/RESULTS.md (--quick: 1/8 of the bytes, 1 run, RESULTS.md untouched unless
      --results is given).
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

N_LEAVES = 300
METHODS = ["checkpointer", "orbax"]
STATES = ["distinct", "one shape"]
LIMIT = 1.5  # distinct / one shape, checkpointer (issue 28 item 2)


def _shapes(state: str, cols: int) -> dict[str, tuple[int, int]]:
    if state == "distinct":
        return {f"l{i:03d}": (2 * (64 + i), cols) for i in range(N_LEAVES)}
    return {f"l{i:03d}": (428, cols) for i in range(N_LEAVES)}


def _target(shapes: dict) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    return {k: jax.ShapeDtypeStruct(tuple(s), np.float32, sharding=sharding) for k, s in shapes.items()}


def child(spec: dict) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import absl.logging
    import jax
    import jax.monitoring
    import numpy as np

    absl.logging.set_verbosity(absl.logging.ERROR)
    tgt = _target(spec["shapes"])
    compiles: list[float] = []

    def listen(event: str, duration_s: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration_s)

    jax.monitoring.register_event_duration_secs_listener(listen)
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if spec["method"] == "checkpointer":
        import checkpointer as ckpt

        out = jax.block_until_ready(ckpt.restore(spec["ckpt"], tgt))
    else:
        import orbax.checkpoint as ocp

        mgr = ocp.CheckpointManager(spec["orbax"])
        out = jax.block_until_ready(mgr.restore(0, args=ocp.args.StandardRestore(tgt)))
    t1, ru1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    res = {"s": t1 - t0, "user_s": ru1.ru_utime - ru0.ru_utime, "sys_s": ru1.ru_stime - ru0.ru_stime,
           "compiles": len(compiles), "compile_s": sum(compiles)}
    if spec["check"]:
        res["sums"] = {k: float(np.asarray(v, np.float64).sum()) for k, v in out.items()}
    if spec["method"] == "orbax":
        mgr.close()
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    import _common as C
    import absl.logging
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import checkpointer as ckpt

    absl.logging.set_verbosity(absl.logging.ERROR)
    args = C.parse_args(__doc__)
    cols = 256 // args.scale
    t0, load = time.perf_counter(), C.OtherLoad()
    root = tempfile.mkdtemp(prefix="distinct_shapes_bench_", dir=args.dir)
    res = {s: {m: [] for m in METHODS} for s in STATES}
    nbytes, paths, shapes, sums = {}, {}, {}, {}
    try:
        sharding = NamedSharding(C.mesh(), P("data", "model"))
        rng = np.random.default_rng(0)
        for s in STATES:
            shapes[s] = _shapes(s, cols)
            state = {k: jax.device_put(rng.standard_normal(v, dtype=np.float32), sharding) for k, v in shapes[s].items()}
            nbytes[s] = sum(v.nbytes for v in state.values())
            sums[s] = {k: float(np.asarray(v, np.float64).sum()) for k, v in state.items()}
            paths[s] = (f"{root}/{s.replace(' ', '_')}/ckpt/0", f"{root}/{s.replace(' ', '_')}/orbax")
            ckpt.save(paths[s][0], state, pack_small_leaves_bytes=0)
            with ocp.CheckpointManager(paths[s][1]) as mgr:
                mgr.save(0, args=ocp.args.StandardSave(state))
                mgr.wait_until_finished()
            del state
        print(f"devices: {jax.device_count()} × {jax.devices()[0].platform}; runs: {args.runs}; warm-up round first")
        for run in range(-1, args.runs):
            for s in STATES:
                k = run % len(METHODS)
                for m in METHODS[k:] + METHODS[:k]:
                    spec = {"method": m, "state": s, "shapes": shapes[s], "ckpt": paths[s][0], "orbax": paths[s][1], "check": run < 0}
                    C.set_page_cache(paths[s], "warm")
                    r = C.run_child(__file__, spec, f"{root}/pycache")
                    if run < 0 and r["sums"] != sums[s]:
                        raise SystemExit(f"{m} restored wrong values for {s}")
                    if run >= 0:
                        res[s][m].append(r)
                    print(f"  run {run if run >= 0 else 'warm-up'}: {s:9s} {m:12s} {r['s']:.3f} s (user {r['user_s']:.2f} s, "
                          f"sys {r['sys_s']:.2f} s, {r['compiles']} compiles, {r['compile_s']:.2f} s)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for s in STATES:
        for m in METHODS:
            r = res[s][m]
            rows.append([s if m == METHODS[0] else "", f"{nbytes[s] / 2**20:.1f} MiB", m, C.fmt([x["s"] for x in r]),
                         C.fmt([x["user_s"] for x in r], "s", 2), C.fmt([x["sys_s"] for x in r], "s", 2),
                         f"{statistics.median(x['compiles'] for x in r):.0f}", C.fmt([x["compile_s"] for x in r], "s", 2)])
    med = {(s, m): statistics.median(x["s"] for x in res[s][m]) for s in STATES for m in METHODS}
    ratio = med["distinct", "checkpointer"] / med["one shape", "checkpointer"]
    text = "\n".join([
        C.header_lines("Distinct leaf shapes, fresh process (`benchmarks/distinct_shapes_bench.py`)", args,
                       time.perf_counter() - t0, load),
        f"{N_LEAVES} float32 leaves saved and restored P('data','model') on a 2x4 mesh, each restore in a fresh process "
        "(timer: library import + restore until block_until_ready); checkpointer saved with pack_small_leaves_bytes=0. "
        "compiles: XLA backend compiles in the timed part (median), and their seconds.", "",
        C.table(["state", "bytes", "method", "time", "user", "sys", "compiles", "compile time"], rows), "",
        f"- checkpointer distinct / one shape: {ratio:.2f}× (target ≤ {LIMIT}×: {'met' if ratio <= LIMIT else 'missed'})",
        f"- orbax distinct / one shape: {med['distinct', 'orbax'] / med['one shape', 'orbax']:.2f}×",
        f"- checkpointer / orbax: distinct {med['distinct', 'checkpointer'] / med['distinct', 'orbax']:.2f}×, "
        f"one shape {med['one shape', 'checkpointer'] / med['one shape', 'orbax']:.2f}×",
    ])
    print("\n" + text)
    C.write_section(args.results, "distinct_shapes_bench", text)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
