"""Save CPU per GiB until committed, and blocking time, in the steady state (host buffers
reused) of `save_async` and of a `CheckpointManager`, without Orbax: for comparing two
commits of the library on one machine (issue 28 item 1). The state is save_bench.py's:
16 x float32[4096, 4096] P('data','model') on a 2x4 mesh plus a replicated
float32[1024, 1024] (1 GiB + 4 MiB). Each mode makes 2 warm-up saves, then `--saves`
measured ones; each is timed from the call to committed (process CPU: user + system,
every thread, `getrusage`). Prints one line per mode: median CPU-seconds per GiB, median
blocking ms, median wall s until committed. Run alternately with `PYTHONPATH` at each
commit's tree:

    for k in 1 2; do PYTHONPATH=$BEFORE python benchmarks/save_cpu_check.py before
                     PYTHONPATH=$AFTER python benchmarks/save_cpu_check.py after; done
"""

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("label", nargs="?", default="checkpointer")
    ap.add_argument("--saves", type=int, default=5)
    args = ap.parse_args()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    tree = {f"w{i}": jax.device_put(jnp.full((4096, 4096), i, jnp.float32), NamedSharding(mesh, P("data", "model"))) for i in range(16)}
    tree["r"] = jax.device_put(jnp.ones((1024, 1024)), NamedSharding(mesh, P()))
    jax.block_until_ready(tree)
    gib = sum(a.nbytes for a in tree.values()) / 2**30
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        for mode in ("save_async", "manager"):
            cpu, blocking, wall = [], [], []
            mgr = ckpt.CheckpointManager(f"{d}/run", keep=ckpt.KeepLatest(1)) if mode == "manager" else None
            for i in range(2 + args.saves):
                c0, t0 = _cpu_s(), time.perf_counter()
                if mgr is None:
                    handle = ckpt.save_async(f"{d}/{i}", tree)
                    t1 = time.perf_counter()
                    handle.wait()
                else:
                    mgr.save(i, tree)
                    t1 = time.perf_counter()
                    mgr.wait_until_finished()
                t2, c1 = time.perf_counter(), _cpu_s()
                if i >= 2:
                    cpu.append((c1 - c0) / gib)
                    blocking.append(t1 - t0)
                    wall.append(t2 - t0)
                if mgr is None:
                    shutil.rmtree(f"{d}/{i}")
            if mgr is not None:
                mgr.close()
            ckpt.release_host_buffers()
            print(f"{args.label} {mode}: CPU {statistics.median(cpu):.3f} s/GiB until committed "
                  f"({', '.join(f'{c:.2f}' for c in cpu)}), blocking {1000 * statistics.median(blocking):.0f} ms, "
                  f"committed {statistics.median(wall):.3f} s", flush=True)


if __name__ == "__main__":
    main()
