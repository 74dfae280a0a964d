"""Incremental saves by 2 processes: a frozen base (the same jax.Array) and an adapter that
changes, three steps with a manager (KeepLatest(2)), then restores: sharded, and replicated
(a cooperative restore: the processes read parts and exchange them).

args: {"directory": manager directory, "local": a local_directory (two tiers: steps 1..4,
      durable every 2nd: durable 2 holds the base, durable 4 references it; the base's
      first 512 rows, process 0's, change every step: only process 1 references), optional}
emits: {"event": "saved", "steps": all_steps, "refs": {step: references per leaf},
        "base_ok": bool, "adapter": float}
"""

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402

mesh = _common.mesh((2, 4), ("data", "model"))
sharding = NamedSharding(mesh, P("data", "model"))
host_base = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)
base = jax.make_array_from_callback(host_base.shape, sharding, lambda idx: host_base[idx])


def adapter(step):
    return jax.make_array_from_callback((1024, 1024), sharding, lambda idx: np.full((1024, 1024), step, np.float32)[idx])


d = args["directory"]
tiers = {"local_directory": args["local"], "durable_every_steps": 2} if args.get("local") else {}
first, last = (1, 4) if tiers else (0, 2)
with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(2), incremental=True, async_save=False, pack_small_leaves_bytes=0,
                            **tiers) as mgr:
    for step in range(first, last + 1):
        if tiers:  # process 0's half of the base changes: its local manifest copies have no references
            host_base = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)
            host_base[:512] += step
            base = jax.make_array_from_callback(host_base.shape, sharding, lambda idx, h=host_base: h[idx])
        mgr.save(step, {"base": base, "adapter": adapter(step)})
    steps = mgr.all_steps()
    out = mgr.restore(last, {"base": sharding, "adapter": sharding})
    local = [np.array_equal(np.asarray(s.data), host_base[s.index]) for s in out["base"].addressable_shards]
    # Replicated on every process: a cooperative restore (each process reads a part, they exchange).
    rep = mgr.restore(last, {"base": NamedSharding(mesh, P()), "adapter": sharding})
    local.append(np.array_equal(np.asarray(rep["base"].addressable_shards[0].data), host_base))
    plan = ckpt.plan_restore(f"{d}/{last}", {"base": NamedSharding(mesh, P()), "adapter": sharding})
    refs = {s: {k: len(v.references) for k, v in ckpt.metadata(f"{d}/{s}").arrays.items()} for s in steps}
_common.emit(event="saved", steps=steps, refs=refs, base_ok=all(local), cooperative=plan.cooperative,
             sources=sorted(str(k) for k in plan.bytes_read_by_source),
             adapter=float(np.asarray(out["adapter"].addressable_shards[0].data).reshape(-1)[0]))
