"""Incremental saves of packed small leaves by 2 processes: frozen small leaves (sharded
over the processes, and replicated), small adapters that change, three saves; then a
replicated restore (cooperative: the processes read parts and exchange them).

args: {"directory": a directory, "local": a local_directory (two tiers: a manager) or absent}
emits: {"event": "saved", "written": bytes of chunk files written per process by the third save (its records'
        bytes_written: on two tiers, the durable copy's: what replication wrote besides metadata),
        "refs": packed boxes the third save references per process's pack, "ok": bool,
        "cooperative": bool, "sources": the plan's read sources}
"""

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402

mesh = _common.mesh((2, 4), ("data", "model"))
split, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())


def tree(step):
    def put(host, sharding):
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    frozen = {f"norm{i}": put(np.full((8, 256), i, np.float32), split) for i in range(6)}
    frozen["bias"] = put(np.arange(512, dtype=np.float32), replicated)
    return {"base": frozen, "lora": put(np.full((8, 64), step, np.float32), split)}


d = args["directory"]
if args.get("local"):  # two tiers: every local step replicated
    with ckpt.CheckpointManager(d, local_directory=args["local"], incremental=True, async_save=False) as mgr:
        for step in range(3):
            mgr.save(step, tree(step))
else:
    for step in range(3):
        ckpt.save(f"{d}/{step}", tree(step), incremental=True)
m = ckpt.metadata(f"{d}/2")
target = jax.tree.map(lambda _: replicated, tree(2))
out = ckpt.restore(f"{d}/2", target)
hosts = {"base/bias": np.arange(512, dtype=np.float32), "lora": np.full((8, 64), 2, np.float32),
         **{f"base/norm{i}": np.full((8, 256), i, np.float32) for i in range(6)}}
flat = {"base/bias": out["base"]["bias"], "lora": out["lora"], **{f"base/norm{i}": out["base"][f"norm{i}"] for i in range(6)}}
ok = all(np.array_equal(np.asarray(a.addressable_shards[0].data), hosts[k]) for k, a in flat.items())
plan = ckpt.plan_restore(f"{d}/2", target)
import json  # noqa: E402

with open(f"{d}/2/manifest.json") as f:
    packed = json.load(f)["packed"]
written = []
for i in range(jax.process_count()):
    with open(f"{d}/2/processes/{i}.json") as f:
        written.append(json.load(f)["bytes_written"])
_common.emit(event="saved", written=written, ok=ok, cooperative=plan.cooperative,
             refs=sum(len(p["boxes"]) for p in packed if "in" in p), sources=sorted(str(k) for k in plan.bytes_read_by_source))
