"""How cost grows with the work (issue 28, item 4): save until committed and fresh-process
restore against state size, leaf count and process count, checkpointer beside orbax-checkpoint
in the same run.

Every measurement runs in fresh processes (children of this script, or a job of
`checkpointer.testing.run_processes` for the process series). A child builds its input before
the timer (device arrays for a save, `jax.ShapeDtypeStruct` targets for a restore; the library
is imported before the timer too, its import time reported separately), then times one
operation: wall time and the process's user + system CPU seconds (getrusage, every thread).

  save          checkpointer: one small warm-up save, `release_host_buffers()`, then
                `ckpt.save(path, state)` until it returns (committed). orbax: a warm-up save,
                then `CheckpointManager(path, async).save(0, StandardSave(state))` +
                `wait_until_finished()` (construction and close not timed).
  restore       checkpointer: `ckpt.restore(path, target)`; orbax:
                `CheckpointManager(path).restore(0, args=StandardRestore(target))`; until
                `jax.block_until_ready`.
  plain read    `readinto()` of every file the library wrote for the arrays (checkpointer:
                `arrays/` and `packed/`; orbax: its step folder) into one new buffer, one
                thread: the floor for reading those bytes into fresh memory, beside each
                restore.
  batched floor (leaf series) save: `jax.device_get` of all leaves and a `np.array` copy of
                each (their host copy); restore: `jax.device_put` of the same leaves as
                numpy arrays onto the device, until ready. (Size series) save: a numpy copy
                of every replica_id 0 shard, save_bench.py's plain copy.

Per point and run the libraries alternate (order rotated from run to run); each save goes
into a new folder that the restores of that run read, removed afterwards. Before every
restore both libraries' files are read once (warm page cache: checkpointer's direct writes
leave its files uncached). Cells are medians of `--runs` (3).

Series:
  size       16 float32 leaves (rows x 4096) P('data', 'model') on a 2x4 mesh of 8 host
             devices: 64 MiB, 256 MiB, 1 GiB, 4 GiB, 8 GiB; a size whose save or restore
             does not fit in the available memory (2.4x the state + 1 GiB) or disk is
             skipped, and the reason printed.
  leaves     10, 1,000, 10,000, 100,000 float32[256] leaves on one device (orbax up to
             10,000), with the batched floor beside.
  processes  1, 2, 4, 8 processes of 1 CPU device each under jax.distributed (gloo) on
             127.0.0.1, 16 float32 leaves P('data') over all devices, a fixed size per
             process (256 MiB); time as felt by the slowest process, CPU summed over all.
             No target: all processes share this machine's cores.

Before the first measurement the free memory is touched once (`_common.touch_free_memory`):
on these VMs the first touch of a page costs ~1.8 s/GiB against ~0.2 s/GiB afterwards.

Targets: checkpointer's cost per byte (save and restore time) at the largest size within 1.1x
of the 1 GiB cost; its per-leaf cost at 100,000 leaves within 2x of the batched floor.

Run:  make scale   (= .venv/bin/python benchmarks/scale_bench.py)
      [--series size|leaves|processes] [--max-size 4GiB] [--runs 3] [--quick] [--dir /tmp]
      [--out-dir DIR] [--no-touch]
      Writes benchmarks/scale_{size,leaves,processes}.png and replaces the scale_bench section
      of benchmarks/RESULTS.md. --quick (16 and 64 MiB, 10 and 1,000 leaves, 1 and 2
      processes of 32 MiB, 1 run) writes its PNGs to /tmp/scale_bench_quick and leaves
      RESULTS.md alone unless --results is given.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MiB, GiB = 1 << 20, 1 << 30
N_BIG = 16  # leaves of the size and process series
COLS = 4096
SIZES = [64 * MiB, 256 * MiB, 1 * GiB, 4 * GiB, 8 * GiB]
LEAF_COUNTS = [10, 1_000, 10_000, 100_000]
ORBAX_MAX_LEAVES = 10_000
PROCESS_COUNTS = [1, 2, 4, 8]
PER_PROCESS = 256 * MiB
QUICK = {"sizes": [16 * MiB, 64 * MiB], "leaves": [10, 1_000], "processes": [1, 2], "per_process": 32 * MiB}
SIZE_TARGET, LEAF_TARGET = 1.1, 2.0
# A point runs when available memory >= MEMORY_FACTOR x its bytes + 1 GiB: the save child
# holds the state and its snapshot, the restore child the restored arrays and its read
# buffers; each child's peak RSS rise over its RSS once jax is imported (input included),
# over the state's bytes, is printed to check it.
MEMORY_FACTOR = 2.4
CK, OB, PLAIN, FLOOR = "checkpointer", "orbax", "plain read", "batched floor"
SERIES = ("size", "leaves", "processes")


# ---------------------------------------------------------------------------------------------
# Inputs (built in the children)

def _rows(nbytes: int, leaves: int = N_BIG) -> int:
    return max(1, nbytes // (leaves * COLS * 4))


def _leaf_builder(shape, sharding):
    """jit(seed -> the leaf `_common._fill(shape, seed)` would give), one leaf per call, so
    the build's temporaries stay one leaf's (a 16-output program's peak is ~2x the state)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def fill(offset):
        x = lax.iota(jnp.uint32, shape[0] * shape[1]).reshape(shape) * jnp.uint32(2654435761)
        x = x + offset
        x = x ^ (x >> 15)
        x = x * jnp.uint32(0x2C1B3C6D)
        x = x ^ (x >> 12)
        return lax.bitcast_convert_type((x >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0

    return jax.jit(fill, out_shardings=sharding)


def size_state(nbytes: int) -> dict:
    """16 float32 (rows, 4096) leaves P('data', 'model') on the 2x4 mesh, `nbytes` in all."""
    import _common as C
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    build = _leaf_builder((_rows(nbytes), COLS), NamedSharding(C.mesh(), P("data", "model")))
    return {f"w{k:02d}": jax.block_until_ready(build(np.uint32((k * 0x9E3779B9) & 0xFFFFFFFF))) for k in range(N_BIG)}


def size_target(nbytes: int) -> dict:
    import _common as C
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    sh = NamedSharding(C.mesh(), P("data", "model"))
    return {f"w{k:02d}": jax.ShapeDtypeStruct((_rows(nbytes), COLS), np.float32, sharding=sh) for k in range(N_BIG)}


def leaves_host(n: int) -> dict:
    import numpy as np

    base = (np.arange(n * 256, dtype=np.float32) % 65521).reshape(n, 256)
    return {f"l{i:06d}": base[i].copy() for i in range(n)}


def leaves_state(n: int) -> dict:
    import jax

    host = leaves_host(n)
    dev = jax.devices()[0]
    return dict(zip(host, jax.block_until_ready(jax.device_put(list(host.values()), dev))))


def leaves_target(n: int) -> dict:
    import jax
    import numpy as np

    sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return {f"l{i:06d}": jax.ShapeDtypeStruct((256,), np.float32, sharding=sh) for i in range(n)}


def checksum(tree) -> float:
    import jax
    import numpy as np

    return float(sum(np.asarray(x, np.float64).sum() for x in jax.tree.leaves(tree)))


def plain_read_files(root: str, library: str) -> list[Path]:
    """The files a plain read reads: the array bytes the library wrote."""
    if library == CK:
        dirs = [Path(root, d) for d in ("arrays", "packed") if Path(root, d).exists()]
    else:
        dirs = [Path(root)]
    return sorted(p for d in dirs for p in d.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------
# One measurement in a fresh process

def _orbax():
    import absl.logging
    import orbax.checkpoint as ocp

    absl.logging.set_verbosity(absl.logging.ERROR)
    return ocp


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(spec: dict) -> dict:
    """Runs one measurement (spec: op, lib, series, n, path) and returns its record."""
    import gc

    import _common as C
    import jax
    import numpy as np

    op, lib, series, n, path = spec["op"], spec["lib"], spec["series"], spec["n"], spec["path"]
    rss_base = _status_kib("VmRSS")  # jax imported (not ru_maxrss: exec keeps the parent's)
    t_imp = time.perf_counter()
    if lib == CK:
        import checkpointer as ckpt

        _ = ckpt.save, ckpt.restore, ckpt.release_host_buffers  # the names load on first use (PEP 562)
    elif lib == OB:
        ocp = _orbax()
    import_s = time.perf_counter() - t_imp
    out: dict = {"import_s": import_s}
    if op == "save":
        state = size_state(n) if series == "size" else leaves_state(n)
        warm = {"x": jax.device_put(np.ones(1 << 12, np.float32))}
        if lib == CK:
            ckpt.save(path + ".warmup", warm)
            ckpt.release_host_buffers()
        elif lib == OB:
            with ocp.CheckpointManager(path + ".warmup") as m:
                m.save(0, args=ocp.args.StandardSave(warm))
                m.wait_until_finished()
        shutil.rmtree(path + ".warmup", ignore_errors=True)
        gc.collect()
        C._malloc_trim()
        if lib == OB:
            mgr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if lib == CK:
            ckpt.save(path, state)
        elif lib == OB:
            mgr.save(0, args=ocp.args.StandardSave(state))
            mgr.wait_until_finished()
        elif series == "leaves":  # the batched floor: the leaves' host copy (device_get is a view on CPU)
            host = [np.array(h) for h in jax.device_get(list(state.values()))]
        else:  # save_bench's plain copy: every replica_id 0 shard into new host memory
            host = [np.array(sh.data, copy=True) for x in state.values() for sh in x.addressable_shards if sh.replica_id == 0]
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        if lib == OB:
            mgr.close()
        if lib == FLOOR:
            del host
        if spec.get("check"):  # after the measurement: np.asarray caches a host copy on each jax.Array
            if lib == CK:
                ckpt.release_host_buffers()
            out["checksum"] = checksum(state)
    else:
        if lib == FLOOR:
            src = list(leaves_host(n).values())
            dev = jax.devices()[0]
        elif lib == PLAIN:
            files = plain_read_files(path, spec["of"])
        else:
            target = size_target(n) if series == "size" else leaves_target(n)
        gc.collect()
        C._malloc_trim()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if lib == CK:
            res = jax.block_until_ready(ckpt.restore(path, target))
        elif lib == OB:
            mgr = ocp.CheckpointManager(path)
            res = jax.block_until_ready(mgr.restore(0, args=ocp.args.StandardRestore(target)))
        elif lib == FLOOR:
            res = jax.block_until_ready(jax.device_put(src, dev))
        else:
            res = C.plain_read(files)
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        if lib == OB:
            mgr.close()
        if lib == FLOOR:
            # On CPU device_put may adopt a suitably aligned numpy buffer without copying.
            out["aliased"] = sum(r.unsafe_buffer_pointer() == h.ctypes.data for r, h in zip(res, src)) / len(src)
        if lib == PLAIN:
            out["bytes"] = int(res.nbytes)
        elif spec.get("check"):
            out["checksum"] = checksum(res)
    out.update(s=t1 - t0, user_s=r1.ru_utime - r0.ru_utime, sys_s=r1.ru_stime - r0.ru_stime,
               minflt=r1.ru_minflt - r0.ru_minflt, peak_rise=(_status_kib("VmHWM") - rss_base) << 10)
    return out


# ---------------------------------------------------------------------------------------------
# The process series: one job of real processes per measurement

def proc_work(op: str, lib: str, per_process: int, path: str, check: bool) -> None:
    """One process of a save or restore job (runs under `checkpointer.testing`)."""
    import gc

    sys.path.insert(0, str(HERE))
    import _common as C
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from checkpointer import testing

    t_imp = time.perf_counter()
    if lib == CK:
        import checkpointer as ckpt

        _ = ckpt.save, ckpt.restore, ckpt.release_host_buffers  # the names load on first use (PEP 562)
    else:
        ocp = _orbax()
    import_s = time.perf_counter() - t_imp
    n = jax.process_count()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sh = NamedSharding(mesh, P("data"))
    rows = _rows(per_process) * n
    names = [f"w{k:02d}" for k in range(N_BIG)]
    rec: dict = {"import_s": import_s}
    if op == "save":
        build = _leaf_builder((rows, COLS), sh)
        state = {k: jax.block_until_ready(build(np.uint32((i * 0x9E3779B9) & 0xFFFFFFFF))) for i, k in enumerate(names)}
        warm = {"x": jax.device_put(np.ones((n, 1024), np.float32), sh)}
        if lib == CK:
            ckpt.save(path + ".warmup", warm)
            ckpt.release_host_buffers()
        else:
            with ocp.CheckpointManager(path + ".warmup") as m:
                m.save(0, args=ocp.args.StandardSave(warm))
                m.wait_until_finished()
            mgr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
        gc.collect()
        C._malloc_trim()
        multihost_utils.sync_global_devices("start")
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if lib == CK:
            ckpt.save(path, state)
        else:
            mgr.save(0, args=ocp.args.StandardSave(state))
            mgr.wait_until_finished()
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        if lib == OB:
            mgr.close()
        if check:
            rec["checksum"] = float(sum(np.asarray(s.data, np.float64).sum() for x in state.values() for s in x.addressable_shards))
    else:
        target = {k: jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=sh) for k in names}
        if lib == OB:
            mgr = ocp.CheckpointManager(path)
        gc.collect()
        C._malloc_trim()
        multihost_utils.sync_global_devices("start")
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if lib == CK:
            res = jax.block_until_ready(ckpt.restore(path, target))
        else:
            res = jax.block_until_ready(mgr.restore(0, args=ocp.args.StandardRestore(target)))
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        if lib == OB:
            mgr.close()
        if check:
            rec["checksum"] = float(sum(np.asarray(s.data, np.float64).sum() for x in res.values() for s in x.addressable_shards))
    multihost_utils.sync_global_devices("end")
    if op == "save" and jax.process_index() == 0:
        shutil.rmtree(path + ".warmup", ignore_errors=True)
    rec.update(s=t1 - t0, user_s=r1.ru_utime - r0.ru_utime, sys_s=r1.ru_stime - r0.ru_stime,
               minflt=r1.ru_minflt - r0.ru_minflt)
    testing.emit(event="m", **rec)


def run_job(op: str, lib: str, nproc: int, per_process: int, path: str, check: bool) -> dict:
    """One job of `nproc` fresh processes: time of the slowest, CPU and faults summed."""
    from checkpointer import testing

    results = testing.run_processes(proc_work, nproc, 1, {"op": op, "lib": lib, "per_process": per_process,
                                                          "path": path, "check": check}, timeout_s=1800)
    recs = [r.record("m") for r in results]
    out = {"s": max(r["s"] for r in recs), "user_s": sum(r["user_s"] for r in recs),
           "sys_s": sum(r["sys_s"] for r in recs), "minflt": sum(r["minflt"] for r in recs),
           "import_s": max(r["import_s"] for r in recs)}
    if check:
        out["checksum"] = sum(r["checksum"] for r in recs)
    return out


# ---------------------------------------------------------------------------------------------
# Driving the series

def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([MG])(?:i?B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 512MiB or 4GiB")
    return int(float(m.group(1)) * (MiB if m.group(2).upper() == "M" else GiB))


def label(series: str, n: int) -> str:
    if series == "size":
        return f"{n // GiB} GiB" if n >= GiB else f"{n // MiB} MiB"
    return f"{n:,}"


def fits(nbytes: int, d: str) -> str | None:
    """Why a state of `nbytes` cannot be measured now, or None."""
    import psutil

    need = int(MEMORY_FACTOR * nbytes) + GiB
    avail = psutil.virtual_memory().available
    if avail < need:
        return (f"needs ~{need / GiB:.1f} GiB of available memory (state + snapshot or restored copy + "
                f"margin), {avail / GiB:.1f} GiB available")
    free = shutil.disk_usage(d).free
    if free < 2.2 * nbytes + GiB:
        return f"needs ~{(2.2 * nbytes + GiB) / GiB:.1f} GiB of free disk under {d}, {free / GiB:.1f} GiB free"
    return None


def measure_point(series: str, n: int, args, root: str, log) -> dict:
    """All runs of one point: {(op, method): [record, ...]}; plain reads under "plain read (LIB's files)"."""
    import _common as C

    libs = [CK, OB]
    if series == "leaves" and n > ORBAX_MAX_LEAVES:
        libs = [CK]
    nproc = n if series == "processes" else None
    res: dict = {}
    for run in range(args.runs):
        k = run % len(libs)
        order = libs[k:] + libs[:k]
        paths = {lib: f"{root}/{series}-{n}-{run}-{lib}" for lib in order}
        sums: dict = {}
        check = run == 0
        for lib in order:  # saves
            path = paths[lib]
            spec = {"op": "save", "lib": lib, "series": series, "n": n, "path": path, "check": check}
            r = run_job("save", lib, nproc, args.per_process, path, check) if nproc else C.run_child(__file__, spec)
            sums[lib] = r.get("checksum")
            res.setdefault(("save", lib), []).append(r)
            log(series, n, run, "save", lib, r)
        if series in ("size", "leaves"):
            spec = {"op": "save", "lib": FLOOR, "series": series, "n": n, "path": "", "check": False}
            r = C.run_child(__file__, spec)
            res.setdefault(("save", FLOOR), []).append(r)
            log(series, n, run, "save", FLOOR, r)
        ordered = order if run % 2 == 0 else order[::-1]
        for lib in ordered:  # restores, each beside the plain read of the same files
            store = paths[lib] + ("/0" if lib == OB else "")
            C.set_page_cache([paths[lib]], "warm")
            spec = {"op": "restore", "lib": lib, "series": series, "n": n, "path": paths[lib], "check": check}
            r = run_job("restore", lib, nproc, args.per_process, paths[lib], check) if nproc else C.run_child(__file__, spec)
            if check and sums.get(lib) is not None and abs(r["checksum"] - sums[lib]) > 1e-6 * max(1.0, abs(sums[lib])):
                raise SystemExit(f"{lib} restored other values at {series}={n}: checksum {r['checksum']} != {sums[lib]}")
            res.setdefault(("restore", lib), []).append(r)
            log(series, n, run, "restore", lib, r)
            C.set_page_cache([paths[lib]], "warm")
            spec = {"op": "restore", "lib": PLAIN, "series": series, "n": n, "path": store, "of": lib}
            r = C.run_child(__file__, spec)
            res.setdefault(("restore", f"{PLAIN} ({lib}'s files)"), []).append(r)
            log(series, n, run, "restore", f"{PLAIN} ({lib}'s files)", r)
        if series == "leaves":
            spec = {"op": "restore", "lib": FLOOR, "series": series, "n": n, "path": ""}
            r = C.run_child(__file__, spec)
            res.setdefault(("restore", FLOOR), []).append(r)
            log(series, n, run, "restore", FLOOR, r)
        for p in paths.values():
            shutil.rmtree(p, ignore_errors=True)
    return res


def med(rs, key="s") -> float:
    return statistics.median(r[key] for r in rs)


def cpu(rs) -> float:
    return statistics.median(r["user_s"] + r["sys_s"] for r in rs)


def unit_of(series: str, n: int, args) -> tuple[float, str]:
    """(divisor, unit name) of the per-unit cost."""
    if series == "size":
        return n / GiB, "GiB"
    if series == "leaves":
        return n / 1e6, "leaf (µs)"
    return n * args.per_process / GiB, "GiB"


def bends(series: str, points: dict, key: tuple, args) -> list[str]:
    """Per-unit cost from each point to the next, the largest change marked."""
    ns = [n for n in points if key in points[n]]
    if len(ns) < 2:
        return []
    cost = {n: med(points[n][key]) / unit_of(series, n, args)[0] for n in ns}
    steps = [(a, b, cost[b] / cost[a]) for a, b in zip(ns, ns[1:])]
    worst = max(steps, key=lambda s: abs(s[2] - 1) if s[2] >= 1 else abs(1 / s[2] - 1))
    return [f"{label(series, a)} → {label(series, b)}: ×{r:.2f}" + (" ← largest change" if (a, b, r) == worst else "")
            for a, b, r in steps]


def series_table(series: str, points: dict, args) -> str:
    import _common as C

    keys = []
    for pt in points.values():
        for k in pt:
            if k not in keys:
                keys.append(k)
    per = {"size": "s/GiB", "leaves": "µs/leaf", "processes": "s/GiB"}[series]
    rows = []
    for op, lib in keys:
        for n, pt in points.items():
            if (op, lib) not in pt:
                continue
            rs = pt[(op, lib)]
            div = unit_of(series, n, args)[0]
            rows.append([op, lib, label(series, n), C.fmt([r["s"] for r in rs]), f"{med(rs) / div:.3f}",
                         f"{cpu(rs):.2f} s", f"{cpu(rs) / div:.3f}", f"{med(rs, 'minflt') / 1e3:.0f} k"])
    what = {"size": "state size", "leaves": "leaves", "processes": "processes"}[series]
    return C.table(["op", "method", what, "time", f"time {per}", "CPU (user+sys)", f"CPU {per}", "faults"], rows)


def targets(results: dict, args) -> list[list[str]]:
    out = []
    sz = results.get("size", {})
    if sz:
        ref = GiB if GiB in sz else min(sz)
        top = max(sz)
        for op in ("save", "restore"):
            if top == ref:
                out.append([f"size: {op} time per byte at {label('size', top)} / at {label('size', ref)}", "—",
                            f"≤ {SIZE_TARGET}×", "not evaluated (one size measured)"])
                continue
            r = (med(sz[top][(op, CK)]) / top) / (med(sz[ref][(op, CK)]) / ref)
            out.append([f"size: checkpointer {op} time per byte at {label('size', top)} / at {label('size', ref)}",
                        f"{r:.2f}×", f"≤ {SIZE_TARGET}×",
                        "met" if r <= SIZE_TARGET else f"missed ({r / SIZE_TARGET:.2f}× the target)"])
    lv = results.get("leaves", {})
    if lv:
        top = max(lv)
        for op, floor in (("save", "host copy"), ("restore", "jax.device_put")):
            r = med(lv[top][(op, CK)]) / med(lv[top][(op, FLOOR)])
            out.append([f"leaves: checkpointer {op} per leaf at {top:,} / batched floor ({floor})", f"{r:.2f}×",
                        f"≤ {LEAF_TARGET}×", "met" if r <= LEAF_TARGET else f"missed ({r / LEAF_TARGET:.2f}× the target)"])
    return out


def plot(series: str, points: dict, args, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = list(points)
    keys = []
    for pt in points.values():
        keys += [k for k in pt if k not in keys]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    unit = {"size": "seconds per GiB", "leaves": "µs per leaf", "processes": "seconds per GiB (all processes)"}[series]
    colors = {CK: "tab:blue", OB: "tab:orange", FLOOR: "tab:green", f"{PLAIN} ({CK}": "tab:purple",
              f"{PLAIN} ({OB}": "tab:gray"}
    for ax, (what, f) in zip(axes, (("time", med), ("process CPU (user + sys)", cpu))):
        for op, lib in keys:
            xs = [n for n in ns if (op, lib) in points[n]]
            ys = [f(points[n][(op, lib)]) / unit_of(series, n, args)[0] for n in xs]
            xv = [n / MiB if series == "size" else n for n in xs]
            color = next(v for k, v in sorted(colors.items(), key=lambda kv: -len(kv[0])) if lib.startswith(k))
            ax.plot(xv, ys, "-" if op == "save" else "--", color=color, marker="o" if op == "save" else "s",
                    label=f"{op}: {lib}")
        ax.set_xscale("log", base=2 if series != "leaves" else 10)
        ax.set_xticks([n / MiB if series == "size" else n for n in ns], [label(series, n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel({"size": "state size", "leaves": "leaves (float32[256] each, one device)",
                       "processes": f"processes (1 CPU device, {label('size', args.per_process)} each)"}[series], fontsize=11)
        ax.set_ylabel(f"{what}, {unit}", fontsize=11)
        ax.set_title(f"{what} per unit of work", fontsize=12)
        ax.grid(True, alpha=0.3)
        if series == "leaves":  # fixed costs make the per-leaf cost span decades
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=9, loc="best")
    fig.suptitle(f"checkpointer beside orbax-checkpoint: cost against {series} (median of {args.runs})", fontsize=13)
    fig.tight_layout()
    path = out / f"scale_{series}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    import _common as C
    import psutil

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--series", choices=SERIES, action="append", help="run this series only (repeatable; default all)")
    ap.add_argument("--max-size", type=parse_size, default=None, help="largest state size of the size series, e.g. 4GiB")
    ap.add_argument("--runs", type=int, default=3, help="measured runs per point (default 3)")
    ap.add_argument("--quick", action="store_true", help="small sizes, few leaves, 1-2 processes, 1 run; PNGs to "
                                                          "/tmp/scale_bench_quick, RESULTS.md untouched unless --results")
    ap.add_argument("--dir", default=None, help="parent of the temporary checkpoint folders (default: the system temp dir)")
    ap.add_argument("--out-dir", default=None, help="where the PNGs go (default benchmarks/; --quick: /tmp/scale_bench_quick)")
    ap.add_argument("--results", default=None, help="markdown file to update (default benchmarks/RESULTS.md)")
    ap.add_argument("--no-touch", action="store_true", help="do not touch the free memory first")
    args = ap.parse_args()
    args.page_cache = "warm"
    if args.quick:
        args.runs = 1
    sizes = QUICK["sizes"] if args.quick else SIZES
    if args.max_size:
        sizes = [s for s in sizes if s <= args.max_size]
    counts = QUICK["leaves"] if args.quick else LEAF_COUNTS
    procs = QUICK["processes"] if args.quick else PROCESS_COUNTS
    args.per_process = QUICK["per_process"] if args.quick else PER_PROCESS
    out = Path(args.out_dir) if args.out_dir else (Path("/tmp/scale_bench_quick") if args.quick else HERE)
    out.mkdir(parents=True, exist_ok=True)
    results_md = Path(args.results) if args.results else (None if args.quick else C.RESULTS)
    series = args.series or list(SERIES)

    t_start, load = time.perf_counter(), C.OtherLoad()
    touch = "not touched (--no-touch)"
    if not args.no_touch:
        limit = 2 * GiB if args.quick else None
        done, s = C.touch_free_memory(limit_bytes=limit)
        touch = (f"{done / GiB:.1f} GiB of free memory touched once before the first measurement, {s:.1f} s "
                 f"({s / max(done / GiB, 1e-9):.2f} s/GiB)")
        print(touch, flush=True)
    root = tempfile.mkdtemp(prefix="scale_bench_", dir=args.dir)

    def log(series, n, run, op, lib, r):
        alias = "" if "aliased" not in r else f"  (device_put adopted {r['aliased']:.0%} of the numpy leaves without a copy)"
        alias += f"  ({r['bytes'] / MiB:.1f} MiB read)" if "bytes" in r else ""
        if series == "size" and "peak_rise" in r:
            alias += f"  peak RSS rise {r['peak_rise'] / n:.2f}x the state"
        print(f"  {series} {label(series, n):>8s} run {run}: {op:7s} {lib:34s} {r['s']:8.3f} s  CPU "
              f"{r['user_s'] + r['sys_s']:7.2f} s  {r['minflt'] / 1e3:6.0f} k faults{alias}", flush=True)

    results: dict = {}
    skipped: list[str] = []
    walls: dict = {}
    try:
        for sname in series:
            t0 = time.perf_counter()
            pts = {"size": sizes, "leaves": counts, "processes": procs}[sname]
            results[sname] = {}
            for n in pts:
                if sname == "size":
                    why = fits(n, root)
                    if why:
                        skipped.append(f"{label('size', n)} skipped: {why}")
                        print(f"  size {label('size', n)}: skipped: {why}", flush=True)
                        continue
                if sname == "processes":
                    why = fits(n * args.per_process, root)
                    if why:
                        skipped.append(f"{n} processes skipped: {why}")
                        print(f"  processes {n}: skipped: {why}", flush=True)
                        continue
                results[sname][n] = measure_point(sname, n, args, root, log)
            walls[sname] = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)

    parts = [C.header_lines("How cost grows with the work (`benchmarks/scale_bench.py`, `make scale`)", args,
                            time.perf_counter() - t_start, load).rstrip("\n"),
             f"- Memory: {touch}; {psutil.virtual_memory().total / GiB:.1f} GiB in all",
             "- Wall time per series: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()), ""]
    parts.append("Every figure from fresh processes: the input is built and the library imported before the timer; "
                 "time is the operation's wall time, CPU the process's user + system seconds over it (the process "
                 "series: time of the slowest process, CPU and faults summed over all). Saves until committed, each "
                 "after a small warm-up save in the same process; restores until `block_until_ready`, the files read "
                 "once before (warm page cache), each beside the plain read of the same files into a new buffer.")
    pngs = []
    for sname, points in results.items():
        if not points:
            continue
        desc = {"size": f"{N_BIG} float32 (rows × {COLS}) leaves P('data', 'model') on a 2x4 mesh of 8 host devices; "
                        "batched floor of the save: a numpy copy of every replica_id 0 shard.",
                "leaves": f"float32[256] leaves on one device; orbax up to {ORBAX_MAX_LEAVES:,} leaves; batched floor: "
                          "save = `jax.device_get` of all leaves + a numpy copy of each, restore = `jax.device_put` "
                          "of the numpy leaves (one call; on CPU it may adopt an aligned numpy buffer without a copy: "
                          "share adopted " + ", ".join(f"{label('leaves', n)} {statistics.median(r['aliased'] for r in pt[('restore', FLOOR)]):.0%}"
                                                       for n, pt in points.items() if ("restore", FLOOR) in pt) + ").",
                "processes": f"N processes × 1 CPU device under jax.distributed (gloo, 127.0.0.1), {N_BIG} float32 "
                             f"leaves P('data') over all devices, {label('size', args.per_process)} per process. "
                             f"No target: every process shares this machine's {os.cpu_count()} cores."}[sname]
        png = plot(sname, points, args, out)
        pngs.append(png)
        imports = {lib: [r["import_s"] for pt in points.values() for (op, m), rs in pt.items() if m == lib for r in rs]
                   for lib in (CK, OB)}
        imp = ", ".join(f"{lib} {statistics.median(v):.2f} s" for lib, v in imports.items() if v)
        parts += ["", f"### Series: {sname}", "", desc, "", series_table(sname, points, args), "",
                  f"Library import before the timer (not in the figures above; median over the children): {imp}.", ""]
        bend_lines = []
        for key in (("save", CK), ("restore", CK), ("save", OB), ("restore", OB)):
            b = bends(sname, points, key, args)
            if b:
                bend_lines.append(f"- {key[0]} {key[1]}, per-unit time from point to point: " + "; ".join(b))
        parts += ["Where the curve bends (ratio of the per-unit time of each point to the previous one):", "", *bend_lines, ""]
        rel = os.path.relpath(png, results_md.parent) if results_md is not None else str(png)
        parts.append(f"![cost against {sname}]({rel})")
    tg = targets(results, args)
    if tg:
        parts += ["", "### Targets (issue 28, item 4; ratios of medians)", "", C.table(["figure", "value", "target", ""], tg)]
    if skipped:
        parts += ["", "Skipped: " + "; ".join(skipped) + "."]
    text = "\n".join(parts) + "\n"
    print("\n" + text)
    for p in pngs:
        print(f"wrote {p}")
    C.write_section(results_md, "scale_bench", text)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        import _common as C

        C.print_result(child(json.loads(sys.argv[2])))
    else:
        main()
