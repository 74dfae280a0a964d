"""Local steps held by peers: 4 processes x 2 devices as 4 simulated nodes
(`peer_node="node-<i>"`), CheckpointManager(local_directory=..., peer_copies=k).

args: {"directory", "local", "phase": "save" | "restore", "steps": [..], "peer_copies": k,
       "durable_every_steps": n, "late_s": {"<process>": seconds before joining the manager},
       "mesh": [rows, cols] (default [4, 2]),
       "restore_mesh": [rows, cols], "restore_specs": {leaf: spec}: the restore's target
       (default: the saved mesh and SPECS), "node_group": n (process p is on node
       "node-<p // n>"; default 1),
       "kill_sending": [process, step]: that process dies (SIGKILL) in the middle of
       streaming its copy of that step to its first holder, "incremental": bool,
       "pack_small_leaves_bytes": int,
       "enospc_holder": [process, step]: before that step is saved (every earlier copy
       checked), that process's FaultLayer (tests/faults) arms ENOSPC at its next write
       of a peer's copy (the holder's tier is full),
       "count_retention": bool: the local tier's retention runs are recorded}
phase "save": saves `steps` (w + step), waits, syncs, emits {"event": "saved", "all_steps",
  "local_steps", "survives", "peer_error", "retention_runs": [{"after": the caller of
  `LocalTier.apply_retention`, "removed": steps, "unix_s"}]}; with "enospc_holder", after the faulted step
  {"event": "after_fault", "survives", "peer_error", "held": {owner: [folders]}, "fired"}.
phase "restore": restore(None), checks every shard bit-exactly; emits {"event": "restored",
  "step", "source", "durable_bytes", "reason", "mismatches"}, or {"event": "refused", "error"}.
"""

import json
import os
import signal
import socket
import sys
import time

import _common

args = _common.init()

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import checkpointer as ckpt  # noqa: E402
from checkpointer._manage import _peers  # noqa: E402

pidx = jax.process_index()
SPECS = {"w": ["data", "model"], "ids": ["data"], "bf": ["data", None]}
mesh = _common.mesh(tuple(args.get("mesh", (4, 2))), ("data", "model"))
full = _common.global_arrays()
expected = {k: full[k] for k in SPECS}
tree = {k: v for k, v in _common.build_tree(mesh, {**_common.SAVE_SPECS, **SPECS}).items() if k in SPECS}
time.sleep(float(args.get("late_s", {}).get(str(pidx), 0)))

kill = args.get("kill_sending")
if kill and kill[0] == pidx:
    real_put = _peers.PeerService._put

    def dying_put(self, holder, step, generation, files, keep):
        if step != kill[1]:
            return real_put(self, holder, step, generation, files, keep)
        address = self.address(holder)
        sock = socket.create_connection((address.host, address.port), timeout=30)
        _peers._send_json(sock, {"op": "put", "owner": pidx, "step": step, "generation": generation,
                                 "keep": keep, "files": files})
        with open(f"{self.local_root}/{step}/{files[0]['key']}", "rb") as f:
            sock.sendall(f.read(max(1, files[0]["size"] // 2)))  # half of the first file, then death
        os.kill(os.getpid(), signal.SIGKILL)

    _peers.PeerService._put = dying_put



def _arm_enospc(mngr, holder):
    """Every earlier copy checked, then the holder's next write of a peer's copy fails
    with ENOSPC (the FaultLayer of tests/faults, installed for the rest of the job)."""
    mngr.wait_until_finished()
    multihost_utils.sync_global_devices("before-enospc")
    if pidx != holder:
        return None
    from tests.faults import Fault, FaultLayer  # the repository root is on the workers' path

    layer = FaultLayer(roots=[args["directory"], args["local"]])
    installed = layer.installed()  # referenced by the layer: a collected context manager uninstalls it
    installed.__enter__()
    layer.arm(Fault("enospc", "peer_copy"))
    layer.installed_for_the_job = installed
    return layer


def _after_fault(mngr, layer):
    mngr.wait_until_finished()
    multihost_utils.sync_global_devices("after-enospc")
    status = mngr.status()
    copies = f"{mngr._tiers.root}/peer-copies"
    held = {name: sorted(os.listdir(f"{copies}/{name}")) for name in sorted(os.listdir(copies))} if os.path.isdir(copies) else {}
    fired = None if layer is None or layer.fired is None else f"{layer.fired.op} {layer.fired.path}"
    _common.emit(event="after_fault", survives={str(k): v for k, v in status.node_losses_survived.items()},
                 peer_error=status.last_peer_error, held=held, fired=fired)


retention_runs = []
if args.get("count_retention"):
    from checkpointer._manage import _tier_manager

    real_apply = _tier_manager.LocalTier.apply_retention

    def counted_apply(self):
        after = sys._getframe(1).f_code.co_name
        removed = real_apply(self)
        retention_runs.append({"after": after, "removed": removed, "unix_s": time.time()})
        return removed

    _tier_manager.LocalTier.apply_retention = counted_apply


with ckpt.CheckpointManager(args["directory"], local_directory=args["local"], keep_local=ckpt.KeepLatest(1),
                            commit_timeout_s=60, peer_copies=args.get("peer_copies", 1),
                            peer_node=f"node-{pidx // args.get('node_group', 1)}",
                            durable_every_steps=args.get("durable_every_steps", 1),
                            incremental=args.get("incremental", False),
                            pack_small_leaves_bytes=args.get("pack_small_leaves_bytes")) as mngr:
    if args["phase"] == "save":
        enospc, layer = args.get("enospc_holder"), None
        for step in args["steps"]:
            if enospc and step == enospc[1]:
                layer = _arm_enospc(mngr, enospc[0])
            mngr.save(step, dict(tree, w=tree["w"] + float(step), step=step))
            if enospc and step == enospc[1]:
                _after_fault(mngr, layer)
        mngr.wait_until_finished()
        multihost_utils.sync_global_devices("peers-saved")  # every process's copies are published
        status = mngr.status()
        _common.emit(event="saved", all_steps=mngr.all_steps(), local_steps=mngr._tiers.local_steps(),
                     survives={str(k): v for k, v in status.node_losses_survived.items()},
                     peer_error=status.last_peer_error, retention_runs=retention_runs)
    else:
        target = {k: (v.sharding if isinstance(v, jax.Array) else None) for k, v in tree.items()}
        if args.get("restore_mesh") or args.get("restore_specs"):
            rmesh = _common.mesh(tuple(args.get("restore_mesh") or args.get("mesh", (4, 2))), ("data", "model"))
            specs = {**SPECS, **args.get("restore_specs", {})}
            target = {k: jax.sharding.NamedSharding(rmesh, _common.spec(specs[k])) for k in SPECS}
        target["step"] = None
        try:
            out = mngr.restore(None, target)
        except ckpt.CheckpointError as e:
            _common.emit(event="refused", error=f"{type(e).__name__}: {e}")
        else:
            status = mngr.status()
            mismatches = _common.step_mismatches(out, expected)
            _common.emit(event="restored", step=int(out["step"]), source=status.last_restore_source,
                         durable_bytes=status.last_restore_durable_bytes, reason=status.last_restore_reason,
                         mismatches=mismatches)
        mngr.wait_until_finished()
print(json.dumps({"done": pidx}))
