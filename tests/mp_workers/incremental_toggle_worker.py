"""Incremental saves toggled between runs and between processes (issue 30): a manager run
by 2 processes saves `steps` with `incremental` per process (`incremental[i]`), a frozen
base (the same jax.Array: unchanged by identity) and an adapter that changes; process 0's
half of the base changes every step when `p0_changes` (its records then hold no
references, only process 1's do); with `p0_no_base`, process 0 finds no base (as when it
cannot read the newest step), so only process 1 references. Then it verifies and
restores every step it kept.

args: {"directory": manager directory, "local": a local_directory (two tiers) or null,
       "incremental": [bool, bool], "steps": [int, ...], "keep": KeepLatest(n),
       "durable_every_steps": int, "p0_changes": bool, "p0_no_base": bool, "restore": bool, "log": bool}
emits: {"event": "saved", "steps": all_steps, "refs": {step: references per leaf},
        "verified": {step: ok}, "restored": {step: ok}} or {"event": "error", "type", "message"}
"""

import _common

args = _common.init()

import logging  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402

logging.basicConfig(level=logging.INFO if args.get("log") else logging.WARNING)

mesh = _common.mesh((2, 4), ("data", "model"))
sharding = NamedSharding(mesh, P("data", "model"))
N = 512


def base_host(step):
    host = np.arange(N * N, dtype=np.float32).reshape(N, N)
    if args.get("p0_changes"):
        host[: N // 2] += step  # process 0's half (the 'data' axis splits the rows)
    return host


def put(host):
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


frozen = put(base_host(0))
if args.get("p0_no_base") and jax.process_index() == 0:
    from checkpointer._save import _incremental

    _incremental.find_base = lambda storage, path: None
d = args["directory"]
tiers = {"local_directory": args["local"], "durable_every_steps": args.get("durable_every_steps", 1)} if args.get("local") else {}
incremental = args["incremental"][jax.process_index()]
try:
    with ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(args.get("keep", 2)), incremental=incremental,
                                async_save=False, pack_small_leaves_bytes=0, **tiers) as mgr:
        for step in args["steps"]:
            base = put(base_host(step)) if args.get("p0_changes") else frozen
            mgr.save(step, {"base": base, "adapter": put(np.full((N, N), step, np.float32))})
        mgr.wait_until_finished()
        if args.get("restore") and tiers:  # a restart resumes the replication of a local-only step
            mgr.restore(None, {"base": sharding, "adapter": sharding})
            mgr.wait_until_finished()
        steps = mgr.all_steps()
except ckpt.CheckpointError as e:
    _common.emit(event="error", type=type(e).__name__, message=str(e))
    raise SystemExit(0) from None
refs, verified, restored = {}, {}, {}
for s in steps:
    refs[s] = {k: len(v.references) for k, v in ckpt.metadata(f"{d}/{s}").arrays.items()}
    verified[s] = ckpt.verify(f"{d}/{s}").ok
    try:
        out = ckpt.restore(f"{d}/{s}", {"base": sharding, "adapter": sharding})
        host = base_host(s)
        restored[s] = all(np.array_equal(np.asarray(x.data), host[x.index]) for x in out["base"].addressable_shards)
    except ckpt.CheckpointError as e:
        restored[s] = f"{type(e).__name__}: {e}"[:300]
_common.emit(event="saved", steps=steps, refs=refs, verified=verified, restored=restored)
