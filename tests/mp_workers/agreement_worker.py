"""Processes that disagree about a save: each case must raise on every process within
seconds, before anything is written; then a matching save still commits.

args: {"directory": path, "cases": [names], "agreement_timeout_s": float}
emits per case: {"event": "case", "case", "type", "message", "elapsed_s"} (type None: saved)
"""

import time

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402

d, me = args["directory"], jax.process_index()
mesh = _common.mesh((2, 2), ("data", "model"))


def tree(rows=8, epoch=1, extra=None):
    g = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    w = jax.make_array_from_callback(g.shape, NamedSharding(mesh, P("data")), lambda idx: g[idx])
    out = {"w": w, "epoch": epoch}
    if extra is not None:
        out["extra"] = extra
    return out


def run(case):
    """This process's part of `case`."""
    if case == "steps":  # through the manager: each process its own step
        mgr = ckpt.CheckpointManager(f"{d}/steps", agreement_timeout_s=args["agreement_timeout_s"])
        try:
            mgr.save(1 + me, tree())
        finally:
            mgr.close()
    elif case == "directories":  # e.g. a per-host or per-timestamp folder name
        ckpt.save(f"{d}/dir-{me}/1", tree(), agreement_timeout_s=args["agreement_timeout_s"])
    elif case == "trees":
        ckpt.save(f"{d}/trees/1", tree(rows=8 + 8 * me), agreement_timeout_s=args["agreement_timeout_s"])
    elif case == "values":
        ckpt.save(f"{d}/values/1", tree(epoch=1 + me), agreement_timeout_s=args["agreement_timeout_s"])
    elif case == "refused":  # process 1 holds a leaf that cannot be stored
        ckpt.save(f"{d}/refused/1", tree(extra=object() if me == 1 else 0), agreement_timeout_s=args["agreement_timeout_s"])
    elif case == "refused0":  # process 0 itself cannot store a leaf: it gives the verdict
        ckpt.save(f"{d}/refused0/1", tree(extra=object() if me == 0 else 0), agreement_timeout_s=args["agreement_timeout_s"])
    elif case == "manager_refused":  # process 1 fails in the manager's own checks, before the snapshot
        mgr = ckpt.CheckpointManager(f"{d}/manager_refused", agreement_timeout_s=args["agreement_timeout_s"])
        try:
            mgr.save(1, tree(), metadata={"extra": object()} if me == 1 else None)
        finally:
            mgr.close()
    elif case == "agreed":  # the saves after all those failures still line up and commit
        ckpt.save(f"{d}/agreed/1", tree(), agreement_timeout_s=args["agreement_timeout_s"])
    elif case == "absent":  # process 1 never calls save
        if me == 0:
            ckpt.save(f"{d}/absent/1", tree(), agreement_timeout_s=args["agreement_timeout_s"])


for case in args["cases"]:
    t0 = time.monotonic()
    try:
        run(case)
        _common.emit(event="case", case=case, type=None, message="", elapsed_s=time.monotonic() - t0)
    except ckpt.CheckpointError as e:
        _common.emit(event="case", case=case, type=type(e).__name__, message=str(e), elapsed_s=time.monotonic() - t0)
