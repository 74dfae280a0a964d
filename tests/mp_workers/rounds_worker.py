"""Every kind of meeting of the processes, then what is left in the coordination service.

Runs, on a 2x4 ('data', 'model') mesh over every process: a manager save with a local
tier (the save agreement, the local commit, the replication's commit round), a
manager restore (the two tiers' vote), a cooperative restore onto a replicated target
(its two rounds), and a save that process 1 refuses (a leaf it cannot store). Process
0 then waits for its rounds' keys to go.

args: {"directory": path}
emits: {"event": "rounds", "refused_type", "leftover": [keys under "checkpointer/"]}
"""

import time

import _common

args = _common.init()

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402
from checkpointer._coord._distributed import _client  # noqa: E402

d, me = args["directory"], jax.process_index()
mesh = _common.mesh((2, 4), ("data", "model"))
tree = _common.build_tree(mesh)
with ckpt.CheckpointManager(f"{d}/run", local_directory=f"{d}/local-{me}", async_save=False) as mgr:
    mgr.save(1, tree)
    mgr.wait_until_finished()
    mgr.restore()
target = {name: jax.ShapeDtypeStruct(g.shape, g.dtype, sharding=NamedSharding(mesh, P())) for name, g in _common.global_arrays().items()}
target.update({k: None for k in _common.VALUES})
ckpt.restore(f"{d}/run/1", target)
try:
    ckpt.save(f"{d}/refused/1", {**tree, "extra": object() if me == 1 else 0})
    refused = None
except ckpt.CheckpointError as e:
    refused = type(e).__name__
leftover = []
if me == 0:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        leftover = sorted(k for k, _ in _client().key_value_dir_get("checkpointer/"))
        if not leftover:
            break
        time.sleep(0.05)
_common.emit(event="rounds", refused_type=refused, leftover=leftover)
