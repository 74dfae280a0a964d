"""The local window without peer copies (`peer_copies=0`), 2 processes x 2 devices:
durable_every_steps=10, keep_local=KeepLatest(1), synchronous saves.

args: {"directory", "local", "phase": "save" | "restore", "steps": [..], "commit_timeout_s": s,
       "peer_copies": n (default 0; both processes run on this one node, so no process holds a copy)}
phase "save": saves `steps` but the last on every process, waits, emits {"event": "before_kill",
  "local_steps"} and syncs; then both save the last step: process 1 dies (SIGKILL) while
  writing it, before its local commit; process 0 commits it and emits {"event": "saved", "local_steps"} and exits at once (its peer
  is dead: no shutdown barrier).
phase "restore": restore(None), checks every shard bit-exactly; emits {"event": "restored",
  "step", "source", "reason", "mismatches"}.
"""

import json
import os
import signal

import _common

args = _common.init()

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import checkpointer as ckpt  # noqa: E402

pidx = jax.process_index()
mesh = _common.mesh((2, 2), ("data", "model"))
tree = _common.build_tree(mesh)
expected = _common.global_arrays()
mngr = ckpt.CheckpointManager(args["directory"], local_directory=args["local"], keep_local=ckpt.KeepLatest(1),
                              durable_every_steps=10, commit_timeout_s=args["commit_timeout_s"], async_save=False,
                              peer_copies=args.get("peer_copies", 0))
if args["phase"] == "save":
    *steps, last = args["steps"]
    for step in steps:
        mngr.save(step, dict(tree, w=tree["w"] + float(step), step=step))
    mngr.wait_until_finished()
    _common.emit(event="before_kill", local_steps=mngr._tiers.local_steps())
    multihost_utils.sync_global_devices("before-kill")
    if pidx == 1:  # dies while writing `last` (after the save's agreement), before its local commit
        from checkpointer._manage import _tier_manager

        _tier_manager.write_snapshot = lambda snap: os.kill(os.getpid(), signal.SIGKILL)
    mngr.save(last, dict(tree, w=tree["w"] + float(last), step=last))
    _common.emit(event="saved", local_steps=mngr._tiers.local_steps())
    os._exit(0)
target = {k: (v.sharding if isinstance(v, jax.Array) else None) for k, v in tree.items()}
out = mngr.restore(None, target)
status = mngr.status()
mismatches = _common.step_mismatches(out, expected)
_common.emit(event="restored", step=int(out["step"]), source=status.last_restore_source,
             reason=status.last_restore_reason, mismatches=mismatches)
mngr.close()
print(json.dumps({"done": pidx}))
