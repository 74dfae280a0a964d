"""Cooperative restores of a replicated packed leaf (`_packed`: a chunk read in pieces,
one per process, its crc32c checked after the exchange).

args: {"cases": [{"name", "path"}]}: each a checkpoint of `packed_values()` saved with
      packed leaves; restored replicated onto a mesh of every device (`["d"]`).
emits per case: {"event": "restored", "name", "mismatches", "bytes_read", "bytes_received",
                 "plan_bytes_read", "cooperative", "shared"}
             or {"event": "failed", "name", "type", "message"}
"""

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402

mesh = _common.mesh([len(jax.devices())], ["d"])
stored = _common.packed_values()

for case in args["cases"]:
    target = {name: NamedSharding(mesh, P()) for name in stored}
    stats = ckpt.RestoreStats()
    try:
        out = ckpt.restore(case["path"], target, stats=stats)
    except ckpt.CheckpointError as e:
        _common.emit(event="failed", name=case["name"], type=type(e).__name__, message=str(e))
        continue
    mismatches = []
    for name, want in stored.items():
        if out[name].sharding != target[name]:
            mismatches.append(f"{name}: sharding {out[name].sharding}")
        for s in out[name].addressable_shards:
            if not _common.same_bits(np.asarray(s.data), want[s.index]):
                mismatches.append(f"{name}: shard on device {s.device.id} differs")
    _common.emit(
        event="restored", name=case["name"], mismatches=mismatches, bytes_read=stats.bytes_read,
        bytes_received=stats.bytes_received, plan_bytes_read=stats.plan.bytes_read, cooperative=stats.plan.cooperative,
        shared=sum(len(lp.shared) for lp in stats.plan.leaves),
    )
