"""Async save in which process `failer`'s write fails (an injected OSError).

args: {"path": checkpoint path, "failer": process index, "commit_timeout_s": float,
       "slow": {process index: seconds its write sleeps first} (optional)}
emits: {"event": "wait_raised", "type", "message", "is_checkpoint_error", "elapsed_s"}
       or {"event": "wait_returned"}; then process 0: {"event": "listing", "entries"}.
"""

import os
import time

import _common

args = _common.init()

import jax  # noqa: E402

import checkpointer as ckpt  # noqa: E402
import checkpointer._save._pipeline as save_mod  # noqa: E402

if jax.process_index() == args["failer"]:

    def failing_write(snap):
        raise ckpt.SaveError(f"injected write failure on process {snap.process_index}: No space left on device")

    save_mod.write_snapshot = failing_write
elif str(jax.process_index()) in args.get("slow", {}):
    real_write, delay_s = save_mod.write_snapshot, args["slow"][str(jax.process_index())]

    def slow_write(snap):
        time.sleep(delay_s)
        return real_write(snap)

    save_mod.write_snapshot = slow_write

mesh = _common.mesh((2, 4), ("data", "model"))
handle = ckpt.save_async(args["path"], _common.build_tree(mesh), commit_timeout_s=args["commit_timeout_s"])
t0 = time.monotonic()
try:
    handle.wait(timeout=args["commit_timeout_s"] * 3)
except ckpt.CheckpointError as e:
    _common.emit(event="wait_raised", type=type(e).__name__, message=str(e), is_checkpoint_error=True, elapsed_s=time.monotonic() - t0)
except BaseException as e:
    _common.emit(event="wait_raised", type=type(e).__name__, message=str(e), is_checkpoint_error=False, elapsed_s=time.monotonic() - t0)
else:
    _common.emit(event="wait_returned", elapsed_s=time.monotonic() - t0)

if jax.process_index() == 0:
    parent = os.path.dirname(args["path"].rstrip("/"))
    entries = []
    for root, dirs, files in os.walk(parent):
        entries += [os.path.relpath(os.path.join(root, n), parent) for n in dirs + files]
    _common.emit(event="listing", entries=sorted(entries))
