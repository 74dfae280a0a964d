"""Restart after a lost node, as a user would try it (tests/test_review_findings.py).

args: {"directory", "local", "phase": "save" | "restore", "steps": [...], "peer_copies": k,
       "durable_every_steps": n, "mesh": [rows, cols], "restore_mesh": [rows, cols],
       "incremental": bool, "then_save": [steps saved after the restore],
       "node_names": {process: name}, "target": "same" | "none" | "cast" | "missing_leaf" | "partial" | "per_process" (process 1 asks another spec)}
phase "save": saves `steps` (w + step), emits {"event": "saved", "local_steps", "survives"}.
phase "restore": restore(None, target), checks every shard; emits {"event": "restored", "step",
  "source", "reason", "mismatches"} or {"event": "refused", "error"}; then saves `then_save`
  and emits {"event": "then_saved", "all_steps", "local_steps"}.
"""

import json

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import checkpointer as ckpt  # noqa: E402

pidx = jax.process_index()
SPECS = {"w": ["data", "model"], "ids": ["data"], "bf": ["data", None]}
mesh = _common.mesh(tuple(args.get("mesh", (2, 2))), ("data", "model"))
full = _common.global_arrays()
tree = {k: v for k, v in _common.build_tree(mesh, {**_common.SAVE_SPECS, **SPECS}).items() if k in SPECS}


def state(step):
    return dict(tree, w=tree["w"] + float(step), step=step)


with ckpt.CheckpointManager(args["directory"], local_directory=args["local"], keep_local=ckpt.KeepLatest(1),
                            commit_timeout_s=60, peer_copies=args.get("peer_copies", 1), peer_node=args.get("node_names", {}).get(str(pidx), f"node-{pidx}"),
                            durable_every_steps=args.get("durable_every_steps", 100),
                            incremental=args.get("incremental", False)) as mngr:
    if args["phase"] == "save":
        for step in args["steps"]:
            mngr.save(step, state(step))
        mngr.wait_until_finished()
        multihost_utils.sync_global_devices("saved")
        _common.emit(event="saved", local_steps=mngr._tiers.local_steps(),
                     survives={str(k): v for k, v in mngr.status().node_losses_survived.items()})
    else:
        rmesh = _common.mesh(tuple(args.get("restore_mesh") or args.get("mesh", (2, 2))), ("data", "model"))
        target = {k: NamedSharding(rmesh, _common.spec(SPECS[k])) for k in SPECS}
        kind = args.get("target", "same")
        if kind == "none":
            target = {k: None for k in SPECS}
        elif kind == "cast":
            target["w"] = jax.ShapeDtypeStruct(full["w"].shape, jax.numpy.bfloat16, sharding=target["w"])
        elif kind in ("missing_leaf", "partial"):
            del target["ids"]
        elif kind == "per_process" and pidx == 1:
            target["w"] = NamedSharding(rmesh, _common.spec(["model", "data"]))
        target["step"] = None
        try:
            out = mngr.restore(None, target, partial=kind == "partial")
        except ckpt.CheckpointError as e:
            _common.emit(event="refused", error=f"{type(e).__name__}: {e}")
        else:
            status = mngr.status()
            mismatches = []
            for name in [k for k in SPECS if k in out]:
                g = full[name]
                if name == "w":
                    g = (g + np.float32(out["step"])).astype(out[name].dtype)
                if not isinstance(out[name], jax.Array):
                    if not _common.same_bits(out[name], g):
                        mismatches.append(f"{name}: host array differs")
                    continue
                for s in out[name].addressable_shards:
                    if not _common.same_bits(np.asarray(s.data), g[s.index]):
                        mismatches.append(f"{name}: shard on device {s.device.id} differs")
            _common.emit(event="restored", step=int(out["step"]), source=status.last_restore_source,
                         reason=status.last_restore_reason, mismatches=mismatches)
        for step in args.get("then_save", []):
            mngr.save(step, state(step))
        mngr.wait_until_finished()
        if args.get("then_save"):
            multihost_utils.sync_global_devices("then-saved")
            _common.emit(event="then_saved", all_steps=mngr.all_steps(), local_steps=mngr._tiers.local_steps())
print(json.dumps({"done": pidx}))
