"""Cooperative restores of a replicated state: bytes read per process, bit-exactness,
and processes that cannot take part.

args: {"path": checkpoint path (`_common.replicated_values()` and "step": 7),
       "targets": [{"name", "mesh_shape", "axis_names", "specs": {leaf: spec}, "cast": {leaf: dtype},
                    "cooperative": bool}],
       "cases": [names of failure cases, run after the targets: "other_target", "missing_path",
                 "unshared_missing_path", "alone_unshared", or "again" (the first target)]}
emits per target: {"event": "restored", "name", "mismatches", "bytes_read", "bytes_received",
                   "plan_bytes_read", "cooperative", "exchange_s"}
      per case: {"event": "case", "case", "type", "message", "elapsed_s"}
"""

import os
import time

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import checkpointer as ckpt  # noqa: E402

me = jax.process_index()
stored = _common.replicated_values()
KEY = "key"  # a PRNG key leaf (threefry): stored as key data


def target_for(t, override=None):
    mesh = _common.mesh(t["mesh_shape"], t["axis_names"])
    out = {}
    for name, g in stored.items():
        spec = (override or {}).get(name, t["specs"][name])
        sharding = NamedSharding(mesh, _common.spec(spec))
        if name == KEY:
            out[name] = jax.ShapeDtypeStruct(g.shape[:-1], jax.random.key(0).dtype, sharding=sharding)
        else:
            out[name] = jax.ShapeDtypeStruct(g.shape, t.get("cast", {}).get(name, g.dtype), sharding=sharding)
    out["step"] = None
    return out


for t in args["targets"]:
    target = target_for(t)
    stats = ckpt.RestoreStats()
    out = ckpt.restore(args["path"], target, stats=stats, cooperative=t.get("cooperative", True))
    mismatches = []
    if out["step"] != 7:
        mismatches.append(f"step {out['step']!r}")
    for name, g in stored.items():
        arr = out[name]
        # (A key array's sharding is JAX's equivalent of the target's, e.g. P(None,) for P().)
        if not arr.sharding.is_equivalent_to(target[name].sharding, arr.ndim) or (name != KEY and arr.sharding != target[name].sharding):
            mismatches.append(f"{name}: sharding {arr.sharding}")
        if name == KEY:
            arr = jax.random.key_data(arr)
        want = g.astype(target[name].dtype) if name != KEY else g
        for s in arr.addressable_shards:
            if not _common.same_bits(np.asarray(s.data), want[s.index]):
                mismatches.append(f"{name}: shard on device {s.device.id} index {s.index} differs")
    _common.emit(
        event="restored", name=t["name"], mismatches=mismatches, bytes_read=stats.bytes_read,
        bytes_received=stats.bytes_received, plan_bytes_read=stats.plan.bytes_read, cooperative=stats.plan.cooperative,
        exchange_s=stats.exchange_s, elapsed_s=stats.elapsed_s, pid=os.getpid(),
    )

base = args["targets"][0] if args["targets"] else None
for case in args.get("cases", []):
    path, target = args["path"], target_for(base)
    if case == "other_target" and me == jax.process_count() - 1:
        target = target_for(base, {"w": ["model"]})  # still replicated over 'data': it would cooperate
    if case == "missing_path" and me == 1:
        path = args["path"] + "-deleted-by-retention"
    if case == "unshared_missing_path":  # no box shared across processes: process 0 restores plainly
        target = target_for(base, {"w": ["data"], "emb": ["data"], "b": ["data"], "key": ["data"]})
        if me == 1:
            path = args["path"] + "-deleted-by-retention"
    if case == "alone_unshared":  # process 0 alone restores a target that shares no box
        target = target_for(base, {"w": ["data"], "emb": ["data"], "b": ["data"], "key": ["data"]})
        if me != 0:
            _common.emit(event="case", case=case, type=None, message="skipped", elapsed_s=0.0)
            continue
    t0 = time.monotonic()
    try:
        ckpt.restore(path, target)
        kind, message = None, ""
    except ckpt.CheckpointError as e:
        kind, message = type(e).__name__, str(e)
    _common.emit(event="case", case=case, type=kind, message=message, elapsed_s=time.monotonic() - t0)
