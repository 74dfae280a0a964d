"""A training loop that saves at every step and stops on preemption: SIGTERM is sent to
the processes listed in `signalled` (by themselves, a real signal) at step `signal_at`.
Under jax.distributed JAX's preemption sync point picks the step; one process run with
`distributed=False` uses the manager's SIGTERM handler.

args: {"directory": path, "signalled": [process ids], "signal_at": step, "max_steps": n,
       "pause_s": seconds per step, "should_save": optional, True: the loop calls `save` only
       when `mgr.should_save(step)` says so (Orbax's and torch_xla's loops)}
emits: {"event": "preempted", "step", "saved", "all_steps", "mode", "committed_on_return"}
       or {"event": "not preempted"}
"""

import os
import signal
import time

import _common

args = _common.init()

import jax  # noqa: E402  (after the harness set the device count)
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402

mesh = _common.mesh((2, 2), ("data", "model"))
sharding = NamedSharding(mesh, P("data", "model"))


def state(step):
    g = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step
    return {"w": jax.make_array_from_callback(g.shape, sharding, lambda idx: g[idx]), "step": step}


with ckpt.CheckpointManager(args["directory"], save_interval_steps=10**6) as mgr:
    for step in range(1, args["max_steps"]):
        if step == args["signal_at"] and jax.process_index() in args["signalled"]:
            os.kill(os.getpid(), signal.SIGTERM)
        if args.get("should_save") and not mgr.should_save(step):
            saved = False
        else:
            saved = mgr.save(step, state(step))
        if mgr.reached_preemption(step):
            committed = os.path.exists(os.path.join(args["directory"], str(step), "COMMITTED"))
            _common.emit(event="preempted", step=step, saved=saved, all_steps=mgr.all_steps(),
                         mode=mgr._preemption.mode, committed_on_return=committed)
            break
        time.sleep(args["pause_s"])
    else:
        _common.emit(event="not preempted")
