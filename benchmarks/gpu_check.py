"""Snapshot and restore on one GPU: save blocking and restore time beside Orbax and the plain copies.

Issue 20 item 5. For a state of `--gib` GiB (default 16: float32 leaves of up to 256 MiB
sharded over the local devices, one GPU in the issue's set-up, plus a scalar step), each
run on a freshly computed state (np.asarray caches a host copy on the array, so no
method may see an array another one already copied):

  plain copy      copy_to_host_async() of every shard, then np.asarray of every shard
                  (the device-to-host copy of the same bytes into new host memory)
  checkpointer    ckpt.save_async(path, state): the time until it returns (the
                  snapshot), then the commit awaited untimed
  orbax           ocp.CheckpointManager(async).save(0, StandardSave(state)): the time
                  until it returns, then wait_until_finished untimed
  device_put      jax.device_put of host numpy arrays of the same bytes onto the same
                  shardings, until ready
  restore         ckpt.restore(path, target) / orbax restore(StandardRestore(target))
                  onto the same shardings, until ready; both checkpoints read once
                  untimed first (the same page-cache state: the direct writes leave
                  this library's files uncached, Orbax's buffered ones cached)

Targets: save blocking <= 1.2x the plain copy, restore <= 1.2x device_put, both
<= 0.5x Orbax. Prints a markdown table; on a GPU it writes it into the `gpu_check`
section of benchmarks/RESULTS.md (`--results` another file, `--no-results` none). On the
CPU backend it exits 0 saying so, unless `--allow-cpu` (then it runs, to exercise the
code path, and never writes RESULTS.md). Not part of `make bench` (that machine has no
GPU). Runs in well under 8 minutes on one H200 with the defaults (3 runs).

Wheels to bring to a GPU machine beyond jax (with its CUDA plugin: jax-cuda12-plugin,
jax-cuda12-pjrt and the nvidia-* wheels they pull), tensorstore, flax, optax and
orbax-checkpoint (with absl-py and their own needs): this library's dependencies
zarr (with donfig, pyyaml, google-crc32c, numcodecs, packaging, typing-extensions),
crc32c, ml_dtypes, numpy, rich (with markdown-it-py, mdurl, pygments) and
safetensors, and psutil for benchmarks/_common.py. Versions: constraints.txt.

  python benchmarks/gpu_check.py [--gib 16] [--runs 3] [--dir /local/disk]
  python benchmarks/gpu_check.py --allow-cpu --gib 0.25 --runs 1   # the code path on CPU
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import absl.logging  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402
from checkpointer._memory import snapshot_route  # noqa: E402

absl.logging.set_verbosity(absl.logging.ERROR)

_COLS = 4096  # float32 columns per leaf row: 16 KiB rows
_LEAF_BYTES = 256 << 20


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16.0, help="state size, GiB (default 16)")
    ap.add_argument("--runs", type=int, default=3, help="measured runs of each method (default 3)")
    ap.add_argument("--dir", default=None, help="parent of the temporary checkpoint folders (default: the system temp dir)")
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU backend too (never writes RESULTS.md)")
    ap.add_argument("--results", default=None, help=f"markdown file to update on a GPU (default {C.RESULTS})")
    ap.add_argument("--no-results", action="store_true", help="write no results file")
    return ap.parse_args()


def _layout(gib: float, n_devices: int) -> list[tuple[int, int]]:
    """Leaf shapes of a `gib` GiB state: float32 [rows, 4096], rows a multiple of the
    device count, leaves of up to 256 MiB."""
    total = int(gib * 2**30)
    row_bytes = _COLS * 4
    leaf_rows = max(n_devices, (min(_LEAF_BYTES, total) // row_bytes) // n_devices * n_devices)
    n_leaves, rest = divmod(total // row_bytes, leaf_rows)
    shapes = [(leaf_rows, _COLS)] * n_leaves
    rest = rest // n_devices * n_devices
    if rest:
        shapes.append((rest, _COLS))
    return shapes


def _builder(shapes, mesh):
    sharding = NamedSharding(mesh, P("data"))
    out = {"params": {f"w{k:03d}": sharding for k in range(len(shapes))}, "step": NamedSharding(mesh, P())}

    def build(seed):
        leaves = {f"w{k:03d}": jax.random.uniform(jax.random.fold_in(seed, k), s, jnp.float32) for k, s in enumerate(shapes)}
        return {"params": leaves, "step": jnp.int32(7)}

    return jax.jit(build, out_shardings=out)


def _shards(state):
    return [s.data for x in jax.tree.leaves(state) for s in x.addressable_shards if s.replica_id == 0]


def main() -> None:
    args = _args()
    backend = jax.default_backend()
    if backend == "cpu" and not args.allow_cpu:
        print("gpu_check: no GPU here (jax.default_backend() == 'cpu'); nothing measured. "
              "Run it on a machine with a GPU (or pass --allow-cpu to exercise the code path).")
        return
    import orbax.checkpoint as ocp

    load, t_start = C.OtherLoad(), time.perf_counter()
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    shapes = _layout(args.gib, len(devices))
    build = _builder(shapes, mesh)
    counter = iter(range(1, 1 << 30))

    def fresh():
        return jax.block_until_ready(build(jax.random.key(next(counter))))

    probe = fresh()
    logical = C.logical_bytes(probe)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), probe)
    route = snapshot_route(devices[0])
    print(f"backend {backend}, {len(devices)} device(s) ({devices[0].device_kind}), state {logical / 2**30:.2f} GiB in "
          f"{len(shapes)} leaves, snapshot route {route!r}", flush=True)
    del probe
    root = tempfile.mkdtemp(prefix="gpu_check_", dir=args.dir)
    res: dict[str, list[float]] = {k: [] for k in ("plain copy", "checkpointer save", "orbax save", "device_put",
                                                   "checkpointer restore", "orbax restore")}
    commit: dict[str, list[float]] = {"checkpointer": [], "orbax": []}
    copied: list[int] = []
    try:
        cpath, opath = f"{root}/ckpt", f"{root}/orbax"
        # Warm-up (untimed): compiles, the snapshot route's probe, the save plan, XLA's
        # pinned host allocator, Orbax's handlers.
        state = fresh()
        ckpt.save_async(f"{cpath}/warm", state).wait()
        shutil.rmtree(f"{cpath}/warm")
        del state
        for run in range(args.runs):
            state = fresh()
            t0 = time.perf_counter()
            for d in _shards(state):
                d.copy_to_host_async()
            host = [np.asarray(d) for d in _shards(state)]
            res["plain copy"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            jax.block_until_ready(jax.device_put(host, [d.sharding for d in _shards(state)]))
            res["device_put"].append(time.perf_counter() - t0)
            del host, state
            gc.collect()

            state = fresh()
            shutil.rmtree(cpath, ignore_errors=True)
            t0 = time.perf_counter()
            h = ckpt.save_async(f"{cpath}/0", state)
            res["checkpointer save"].append(time.perf_counter() - t0)
            h.wait()
            commit["checkpointer"].append(time.perf_counter() - t0)
            copied.append(h.snapshot.copied_bytes)
            del h, state
            gc.collect()

            state = fresh()
            shutil.rmtree(opath, ignore_errors=True)
            mgr = ocp.CheckpointManager(opath, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
            t0 = time.perf_counter()
            mgr.save(0, args=ocp.args.StandardSave(state))
            res["orbax save"].append(time.perf_counter() - t0)
            mgr.wait_until_finished()
            commit["orbax"].append(time.perf_counter() - t0)
            mgr.close()
            del mgr, state
            gc.collect()
            print(f"run {run + 1}/{args.runs} saves done", flush=True)

        def ck_restore():
            return jax.block_until_ready(ckpt.restore(f"{cpath}/0", target))

        def ob_restore():
            with ocp.CheckpointManager(opath) as m:
                return jax.block_until_ready(m.restore(0, args=ocp.args.StandardRestore(target)))

        for fn in (ck_restore, ob_restore):  # the same page-cache state: both read once
            fn()
        for _run in range(args.runs):
            for name, fn in (("checkpointer restore", ck_restore), ("orbax restore", ob_restore)):
                t0 = time.perf_counter()
                out = fn()
                res[name].append(time.perf_counter() - t0)
                del out
                gc.collect()
        print("restores done", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    text = _report(args, backend, devices, route, logical, len(shapes), res, commit, copied, time.perf_counter() - t_start, load)
    print("\n" + text)
    if backend == "cpu" or args.no_results:
        print("\n(not writing RESULTS.md: " + ("CPU backend)" if backend == "cpu" else "--no-results)"))
        return
    C.write_section(Path(args.results) if args.results else C.RESULTS, "gpu_check", text)


def _report(args, backend, devices, route, logical, n_leaves, res, commit, copied, wall_s, load) -> str:
    med = {k: statistics.median(v) for k, v in res.items()}
    gib = logical / 2**30

    def row(name, ours, base, base_name, base_target, orbax):
        r_base, r_orbax = med[ours] / med[base], med[ours] / med[orbax]
        ok = r_base <= base_target and r_orbax <= 0.5
        return [name, C.fmt(res[ours]), f"{C.fmt(res[base])} ({base_name})", C.fmt(res[orbax]),
                f"{r_base:.2f}× (≤ {base_target}×)", f"{r_orbax:.2f}× (≤ 0.5×)", "met" if ok else "missed"]

    rows = [row("save: blocking (until `save_async` returns)", "checkpointer save", "plain copy", "np.asarray", 1.2, "orbax save"),
            row("restore (until ready)", "checkpointer restore", "device_put", "device_put", 1.2, "orbax restore")]
    cmd = " ".join(["python", *sys.argv])
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    share = load.share()
    lines = [
        "## GPU check (issue 20 item 5): snapshot and restore on one accelerator",
        "",
        f"- Command: `{cmd}`, {now}, script wall time {wall_s:.0f} s",
        f"- Machine: {C.machine()}; backend {backend}, {len(devices)} × {devices[0].device_kind}",
        f"- Other processes used {share:.0%} of the CPU time of all cores during the script",
        f"- State: {gib:.2f} GiB, {n_leaves} float32 leaves sharded over the devices + a scalar; snapshot route "
        f"`{route}` (`_memory.snapshot_route`); the snapshot copied {statistics.median(copied) / 2**30:.2f} GiB per save",
        f"- Cells: median (min–max) of {args.runs} run(s), each on a freshly computed state; restores after one untimed "
        "read of each checkpoint (same page-cache state)",
        "",
        C.table(["figure", "checkpointer", "baseline", "orbax", "/ baseline (target)", "/ orbax (target)", "targets"], rows),
        "",
        f"Until committed (save call to commit, for reference): checkpointer {C.fmt(commit['checkpointer'])}, "
        f"orbax {C.fmt(commit['orbax'])}.",
    ]
    if backend == "cpu":
        lines += ["", "CPU backend (`--allow-cpu`): `np.asarray` of a shard and `device_put` of an aligned host array are "
                  "views there, not copies, so both baselines are near zero and the ratios say nothing; this run only "
                  "exercises the code path."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
