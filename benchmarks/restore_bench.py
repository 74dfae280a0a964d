"""Restore benchmark: `ckpt.restore` onto several target shardings, next to orbax-checkpoint
restoring the same state onto the same targets and a plain read of the checkpoint's files.

State: 16 float32 arrays of 4096x4096 saved sharded P('data', 'model') over a 2x4 mesh of 8
host (CPU) devices, plus one float32 1024x1024 saved replicated (P()): 1 GiB + 4 MiB. It is
saved once with `ckpt.save` and once with orbax (CheckpointManager + StandardSave).

Targets (the replicated leaf goes replicated on the target's mesh, or on the one device):
  same        2x4 mesh, P('data', 'model')  (the saved layout)
  4x2 mesh    4x2 mesh, P('data', 'model')
  transposed  2x4 mesh, P('model', 'data')
  rows        2x4 mesh, P(('data', 'model'), None)  (8 row blocks)
  1 device    SingleDeviceSharding(device 0): whole arrays on one device

Per run and target, in an order rotated from run to run:
  plain read    readinto() of every file under the checkpoint's arrays/ folder into one
                preallocated buffer, one thread: the physical floor for reading those bytes.
  checkpointer  ckpt.restore(path, target), target leaves jax.ShapeDtypeStruct(shape, dtype,
                sharding=...), then jax.block_until_ready.
  orbax         mgr.restore(0, args=ocp.args.StandardRestore(target)) with the same target,
                then jax.block_until_ready.
Reported: time, GB/s (10^9 bytes/s of logical array bytes), bytes read (checkpointer's
plan_restore(...).bytes_read, and for every method the read()/pread() bytes the process did,
/proc/self/io rchar), peak RSS rise over the RSS before the call (sampled every 5 ms).
Before each call gc.collect() and malloc_trim(0) run, so each call faults in fresh memory, as
in a freshly started process. A warm-up round, not counted, also checks that every restore
returns the saved values.
Before each call both libraries' files (and the plain read's, checkpointer's own) are put in
the same page-cache state (`--page-cache`: read once, the default, or fsynced and evicted with
posix_fadvise): direct writes leave checkpointer's files uncached, orbax's are cached.

Run:  .venv/bin/python benchmarks/restore_bench.py [--runs 5] [--quick] [--dir /tmp] [--page-cache warm|cold]
      Prints a markdown table and replaces the restore_bench section of benchmarks/RESULTS.md
      (--quick: 1/8 of the state, 1 run, RESULTS.md untouched unless --results is given).
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import absl.logging  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

import checkpointer as ckpt  # noqa: E402

absl.logging.set_verbosity(absl.logging.ERROR)


def targets(state) -> dict:
    m24, m42, dev0 = C.mesh((2, 4)), C.mesh((4, 2)), SingleDeviceSharding(jax.devices()[0])

    def like(big, small):
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=small if k == "replicated" else big) for k, v in state.items()}

    return {
        "same: 2x4 P('data','model')": like(NamedSharding(m24, P("data", "model")), NamedSharding(m24, P())),
        "4x2 mesh P('data','model')": like(NamedSharding(m42, P("data", "model")), NamedSharding(m42, P())),
        "2x4 P('model','data')": like(NamedSharding(m24, P("model", "data")), NamedSharding(m24, P())),
        "2x4 P(('data','model'), None)": like(NamedSharding(m24, P(("data", "model"), None)), NamedSharding(m24, P())),
        "1 device (whole arrays)": like(dev0, dev0),
    }


def rchar() -> int:
    """Bytes this process passed through read()-like syscalls (page-cache hits included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


METHODS = ["plain read", "checkpointer", "orbax"]


def measure(fn, target):
    r0 = rchar()
    with C.Measure() as m:
        out = jax.block_until_ready(fn(target))
    return out, {"s": m.seconds, "rss": m.peak_delta, "rchar": rchar() - r0}


def check(name, tname, out, expected):
    for k, v in expected.items():
        if not np.array_equal(np.asarray(out[k]), v):
            raise SystemExit(f"{name} restored wrong values for {k!r} onto {tname}")


def report(args, res, plan, logical, disk, wall_s, load) -> str:
    rows, summary = [], []
    for tname in res:
        for name in METHODS:
            r = res[tname][name]
            s = [x["s"] for x in r]
            rows.append([tname if name == METHODS[0] else "", name, C.fmt(s), f"{logical / 1e9 / statistics.median(s):.2f}",
                         f"{plan[tname] / 2**20:.1f} MiB" if name == "checkpointer" else "—",
                         C.fmt([x["rchar"] / 2**20 for x in r], "MiB", 0), C.fmt([x["rss"] / 2**20 for x in r], "MiB", 0)])
        t = {n: [x["s"] for x in res[tname][n]] for n in METHODS}
        summary.append([tname, C.ratio(t["checkpointer"], t["orbax"]), C.ratio(t["checkpointer"], t["plain read"])])
    main = C.table(["target", "method", "time", "GB/s", "bytes read (plan)", "bytes read (rchar)", "peak RSS rise"], rows)
    ratios = C.table(["target", "checkpointer / orbax", "checkpointer / plain read"], summary)
    state_desc = (f"State: {C.N_LEAVES} × float32 {C.shapes(args.scale)[0]} saved P('data','model') on a 2x4 mesh + float32 "
                  f"{C.shapes(args.scale)[1]} saved P(); logical bytes {logical / 2**20:.0f} MiB. On disk: checkpointer "
                  f"{disk['checkpointer'] / 2**20:.0f} MiB (arrays/ {disk['plain'] / 2**20:.0f} MiB, what the plain read "
                  f"reads), orbax {disk['orbax'] / 2**20:.0f} MiB. Order of the three rotated per run, 1 warm-up round; fresh memory for each call (malloc_trim before).")
    return "\n".join([C.header_lines("Restore (`benchmarks/restore_bench.py`)", args, wall_s, load), state_desc, "", main, "",
                      "Ratios of median times:", "", ratios, "", "Against the targets (ratios of median times):", "",
                      target_table(res)])


TARGETS = (("checkpointer / orbax", "orbax", 1 / 3, "≤ 0.33× (≥ 3× faster)"),
           ("checkpointer / checkpointer same-mesh", "same", 1.3, "≤ 1.3×"),
           ("checkpointer / plain read", "plain read", 2.0, "≤ 2.0× (≥ half the GB/s)"))


def target_table(res) -> str:
    """Each target row: checkpointer's median time over the reference's, and whether the target is met."""
    same = next(iter(res))
    rows = []
    for what, ref, limit, shown in TARGETS:
        for tname in res:
            if ref == "same" and tname == same:
                continue
            num = statistics.median(x["s"] for x in res[tname]["checkpointer"])
            den = statistics.median(x["s"] for x in res[same if ref == "same" else tname]["checkpointer" if ref == "same" else ref])
            r = num / den
            rows.append([what, tname, f"{r:.2f}×", shown, "met" if r <= limit else f"missed ({r / limit:.2f}× the target)"])
    return C.table(["ratio", "target layout", "value", "target", ""], rows)


def disk_bytes(d) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())


def main() -> None:
    args = C.parse_args(__doc__, C.page_cache_argument)
    t0, load = time.perf_counter(), C.OtherLoad()
    root = tempfile.mkdtemp(prefix="restore_bench_", dir=args.dir)
    try:
        state = C.make_state(args.scale)
        logical = C.logical_bytes(state)
        cpath, opath = f"{root}/ckpt/0", f"{root}/orbax"
        ckpt.save(cpath, state)
        with ocp.CheckpointManager(opath) as mgr:
            mgr.save(0, args=ocp.args.StandardSave(state))
            mgr.wait_until_finished()
        expected = {k: np.asarray(v) for k, v in state.items()}
        tgts = targets(state)
        del state
        files = sorted((str(p), p.stat().st_size) for p in Path(cpath, "arrays").rglob("*") if p.is_file())
        total = sum(n for _, n in files)
        disk = {"checkpointer": disk_bytes(cpath), "plain": total, "orbax": disk_bytes(opath)}
        plan = {t: ckpt.plan_restore(cpath, tgt).bytes_read for t, tgt in tgts.items()}
        mgr = ocp.CheckpointManager(opath)
        fns = {"plain read": lambda tgt: C.plain_read([f for f, _ in files], [n for _, n in files]),
               "checkpointer": lambda tgt: ckpt.restore(cpath, tgt),
               "orbax": lambda tgt: mgr.restore(0, args=ocp.args.StandardRestore(tgt))}
        print(f"devices: {jax.device_count()} × {jax.devices()[0].platform}; runs: {args.runs}; warm-up round first")
        res = {t: {n: [] for n in METHODS} for t in tgts}
        for run in range(-1, args.runs):
            for tname, tgt in tgts.items():
                k = run % len(METHODS)
                for name in METHODS[k:] + METHODS[:k]:
                    C.set_page_cache([cpath, opath], args.page_cache)
                    out, r = measure(fns[name], tgt)
                    if run < 0:
                        if name != "plain read":
                            check(name, tname, out, expected)
                    else:
                        res[tname][name].append(r)
                    del out
                    print(f"  run {run if run >= 0 else 'warm-up'}: {tname:30s} {name:12s} {r['s']:.3f} s, "
                          f"read {r['rchar'] / 2**20:.0f} MiB, peak RSS +{r['rss'] / 2**20:.0f} MiB", flush=True)
        mgr.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(args, res, plan, logical, disk, time.perf_counter() - t0, load)
    print("\n" + text)
    C.write_section(args.results, "restore_bench", text)


if __name__ == "__main__":
    main()
