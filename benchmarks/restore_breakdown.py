"""Where a fresh-process restore's time goes (issue 28 item 2): one restore of the state
`fresh_restore_alt.py` saved under DIR (`DIR/ckpt`), in this process (run it fresh), with
the thread CPU (user + system, `time.thread_time`) and wall of the read path's functions
summed over all threads, when each first started and last ended after the restore call,
the restore's rusage (user, system, minor faults) and its cyclic collections.

Run:  .venv/bin/python benchmarks/restore_breakdown.py DIR [same|4x2]
      with PYTHONPATH at the checkout to measure; alternate checkouts per run, e.g. main's
      `git archive` in /tmp and this one, and unset PYTHONDONTWRITEBYTECODE with a
      PYTHONPYCACHEPREFIX per checkout (the library's import is in the figures).
Nested wrapped functions count in both (`_execute` includes `read` and `_check_crc`).
"""
import collections
import gc
import json
import os
import resource
import sys
import threading
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


def main() -> None:
    ckpt_dir = os.path.join(sys.argv[1], "ckpt")
    target = sys.argv[2] if len(sys.argv) > 2 else "same"
    with open(ckpt_dir + ".shapes") as f:
        shapes = json.load(f)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape((4, 2) if target == "4x2" else (2, 4)), ("data", "model"))
    tgt = {k: jax.ShapeDtypeStruct(tuple(s), np.float32, sharding=NamedSharding(mesh, P() if k == "replicated" else P("data", "model")))
           for k, s in shapes.items()}
    acc: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0, float("inf"), 0.0])
    lock = threading.Lock()

    def wrap(owner, name):
        f = getattr(owner, name)

        def timed(*a, **k):
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                c, t1 = time.thread_time() - c0, time.perf_counter()
                with lock:
                    e = acc[name]
                    e[0] += c
                    e[1] += t1 - t0
                    e[2] += 1
                    e[3], e[4] = min(e[3], t0), max(e[4], t1)
        setattr(owner, name, timed)

    collections_s = [0.0, 0]
    started: list[float] = []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        else:
            collections_s[0] += time.perf_counter() - started.pop()
            collections_s[1] += 1

    gc.callbacks.append(on_gc)
    t_import = time.perf_counter()
    import checkpointer as ckpt
    from checkpointer._encoding import _read, _zarr_array
    from checkpointer._memory import _device_destination
    from checkpointer._restore import _pipeline
    t_import = time.perf_counter() - t_import
    for owner, name in [(_read, "read_chunk_index"), (_read, "_execute"), (_read, "_check_crc"), (_read, "_read_run_direct"),
                        (_read._ChunkFile, "read"), (_pipeline, "_prepare"), (_zarr_array, "_destinations"),
                        (_device_destination, "_allocate_all"), (_zarr_array, "populate_destination"), (_zarr_array, "_place"),
                        (_zarr_array, "_assemble")]:
        if hasattr(owner, name):
            wrap(owner, name)
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    jax.block_until_ready(ckpt.restore(ckpt_dir, tgt))
    t1, ru1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    print(f"{target}: import {t_import:.3f} s; restore wall {t1 - t0:.3f} s, user {ru1.ru_utime - ru0.ru_utime:.3f} s, "
          f"sys {ru1.ru_stime - ru0.ru_stime:.3f} s, faults {ru1.ru_minflt - ru0.ru_minflt}, "
          f"cyclic collections {collections_s[0]:.3f} s x{collections_s[1]}")
    print("| function | thread CPU s | wall s (all threads) | calls | first start .. last end, s after the call |")
    print("|---|---|---|---|---|")
    for name, (c, w, n, a, b) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        print(f"| {name} | {c:.3f} | {w:.3f} | {n} | {a - t0:.3f} .. {b - t0:.3f} |")


if __name__ == "__main__":
    main()
