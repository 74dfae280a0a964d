"""Write-rate limit benchmark: the throughput a save achieves under `max_write_bytes_per_s`.

State: one float32 8192x8192 array (256 MiB) sharded P('data', 'model') over a 2x4 mesh of
8 host devices: 8 chunks (zarr shard files) of 32 MiB. (--leaves N: N float32 arrays of
equal size instead, same total bytes.)

For each cap (default 50, 100, 200 MiB/s, then unlimited) a `CheckpointManager(dir,
async_save=False, max_write_bytes_per_s=cap)` saves the state once (one unmeasured warm-up
save without a cap comes first), and the script prints:

  status rate   `mgr.status().last_write_bytes_per_s`: bytes written / write seconds of
                the save (from the first chunk write issued to the last one durable).
  wall rate     bytes written / seconds of the whole `mgr.save` call (snapshot and commit
                included).
  vs cap        status rate / cap - 1.

Run:  PYTHONPATH=. .venv/bin/python benchmarks/write_rate_bench.py [--caps 50,100,200]
      [--mib 256] [--leaves 1] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _common as C  # benchmarks/ is the script's folder, first on sys.path
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt

MiB = 2**20


def make_state(total_mib: int, leaves: int) -> dict:
    sharding = NamedSharding(C.mesh((2, 4), ("data", "model")), P("data", "model"))
    elements = total_mib * MiB // 4 // leaves
    cols = 2048
    rows = elements // cols
    fill = jax.jit(lambda i: jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols) + i, out_shardings=sharding, static_argnums=0)
    return {f"w{i}": fill(i) for i in range(leaves)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", default="50,100,200", help="caps in MiB/s, comma-separated")
    ap.add_argument("--mib", type=int, default=256, help="state size, MiB")
    ap.add_argument("--leaves", type=int, default=1)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    state = make_state(args.mib, args.leaves)
    caps = [float(c) for c in args.caps.split(",")] + [None]
    root = tempfile.mkdtemp(prefix="write-rate-", dir=args.dir)
    try:
        with ckpt.CheckpointManager(f"{root}/warmup", async_save=False) as mgr:
            mgr.save(0, state)
        print(f"state: {args.mib} MiB in {args.leaves} leaves, 8 chunks per leaf; storage: {root}")
        print("| cap MiB/s | status rate MiB/s | wall rate MiB/s | vs cap | write s | save s |")
        print("|---:|---:|---:|---:|---:|---:|")
        for i, cap in enumerate(caps):
            with ckpt.CheckpointManager(
                f"{root}/run{i}", async_save=False, max_write_bytes_per_s=None if cap is None else cap * MiB
            ) as mgr:
                t0 = time.perf_counter()
                mgr.save(1, state)
                wall_s = time.perf_counter() - t0
                status = mgr.status()
            rate = status.last_write_bytes_per_s
            written = rate * status.last_write_s
            vs = "" if cap is None else f"{rate / (cap * MiB) - 1:+.1%}"
            print(
                f"| {'none' if cap is None else f'{cap:.0f}'} | {rate / MiB:.1f} | {written / wall_s / MiB:.1f} | {vs} "
                f"| {status.last_write_s:.2f} | {wall_s:.2f} |",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
