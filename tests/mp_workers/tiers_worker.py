"""Two tiers across processes: every process runs CheckpointManager(local_directory=...).

args: {"directory": durable path, "local": local directory (shared: process-<i>/ each),
       "phase": "save" | "restore", "steps": [..]}
phase "save": saves `steps` (the tree with w + step) and waits until they are durable;
  emits {"event": "saved", "all_steps", "local_step"}.
phase "restore": restore(None) onto the saved shardings, checks every shard bit-exactly;
  emits {"event": "restored", "step", "source", "durable_bytes", "mismatches": [...]}.
"""

import _common

args = _common.init()

import jax  # noqa: E402

import checkpointer as ckpt  # noqa: E402

mesh = _common.mesh((2, 4), ("data", "model"))
tree = _common.build_tree(mesh)
expected = _common.global_arrays()
with ckpt.CheckpointManager(args["directory"], local_directory=args["local"], keep_local=ckpt.KeepLatest(1),
                            commit_timeout_s=60) as mngr:
    if args["phase"] == "save":
        for step in args["steps"]:
            mngr.save(step, dict(tree, w=tree["w"] + float(step), step=step))
        mngr.wait_until_finished()
        _common.emit(event="saved", all_steps=mngr.all_steps(), local_step=mngr.status().latest_local_step)
    else:
        target = {k: (v.sharding if isinstance(v, jax.Array) else None) for k, v in tree.items()}
        out = mngr.restore(None, target)
        status = mngr.status()
        mismatches = _common.step_mismatches(out, expected)
        _common.emit(event="restored", step=out["step"], source=status.last_restore_source,
                     durable_bytes=status.last_restore_durable_bytes, mismatches=mismatches)
