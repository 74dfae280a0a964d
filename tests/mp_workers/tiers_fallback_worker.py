"""Two tiers, two processes, a leaf sharded over both (no replicated box, so each
process's local copy is whole for its own devices).

args: {"directory": durable path, "local": local directory, "phase": "save" | "restore"}
phase "save": saves steps 1 and 2 (w + step), both durable; emits {"event": "saved"}.
phase "restore": restore(None); emits {"event": "restored", "step", "exact"}.
"""

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402

mesh = _common.mesh((2, 4), ("data", "model"))
sharding = NamedSharding(mesh, P("data", "model"))
base = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)


def tree(step):
    g = base + step
    return {"w": jax.make_array_from_callback(g.shape, sharding, lambda idx: g[idx]), "step": step}


with ckpt.CheckpointManager(args["directory"], local_directory=args["local"], keep_local=ckpt.KeepLatest(2),
                            pack_small_leaves_bytes=0, commit_timeout_s=60) as mgr:
    if args["phase"] == "save":
        for step in (1, 2):
            mgr.save(step, tree(step))
        mgr.wait_until_finished()
        _common.emit(event="saved", all_steps=mgr.all_steps())
    else:
        out = mgr.restore(None, {"w": sharding, "step": None})
        step = out["step"]
        exact = all(_common.same_bits(np.asarray(s.data), (base + step)[s.index]) for s in out["w"].addressable_shards)
        _common.emit(event="restored", step=step, exact=exact)
