"""The blocking time of `save_async` alone (no Orbax, no training loop): 12 saves of a
1 GiB tree (16 x float32[2048, 2048] P('data','model') on a 2x4 mesh, plus a replicated
float32[1024, 1024]), printing the median of the last 10. For comparing two commits of the
library on one machine: run it alternately with `PYTHONPATH` at each commit's tree, e.g.

    for k in 1 2; do PYTHONPATH=$BEFORE python benchmarks/snapshot_blocking_check.py before
                     PYTHONPATH=$AFTER python benchmarks/snapshot_blocking_check.py after; done
"""

import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "checkpointer"
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    tree = {f"w{i}": jax.device_put(jnp.full((2048, 2048), i, jnp.float32), NamedSharding(mesh, P("data", "model"))) for i in range(16)}
    tree["r"] = jax.device_put(jnp.ones((1024, 1024)), NamedSharding(mesh, P()))
    jax.block_until_ready(tree)
    with tempfile.TemporaryDirectory() as d:
        times = []
        for i in range(12):
            t0 = time.perf_counter()
            handle = ckpt.save_async(f"{d}/{i}", tree)
            times.append(time.perf_counter() - t0)
            handle.wait()
    print(f"{label}: save_async blocking median {1000 * statistics.median(times[2:]):.1f} ms "
          f"(all: {', '.join(f'{1000 * t:.0f}' for t in times)} ms)")


if __name__ == "__main__":
    main()
