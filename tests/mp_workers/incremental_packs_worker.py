"""Incremental saves of packed small leaves by 2 processes: frozen small leaves (sharded
over the processes, and replicated), small adapters that change, three saves; then a
replicated restore (cooperative: the processes read parts and exchange them).

args: {"directory": a directory}
emits: {"event": "saved", "written": bytes written per process of the third save,
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
_common.emit(event="saved", written=list(m.process_bytes_written), ok=ok, cooperative=plan.cooperative,
             refs=sum(len(p["boxes"]) for p in packed if "in" in p), sources=sorted(str(k) for k in plan.bytes_read_by_source))
