"""Async save during which process `victim` dies (SIGKILL) after its snapshot.

args: {"path": checkpoint path, "victim": process index, "commit_timeout_s": float,
       "wait_timeout_s": float}

The victim's `write_snapshot` is patched to sleep first, so it cannot report its shards
durable before it kills itself right after `save_async` returns (the snapshot is taken,
the background thread is running). The others wait and report what `wait()` raised.
emits (survivors): {"event": "snapshot_taken"}, then {"event": "wait_raised", "type",
"message", "is_checkpoint_error", "elapsed_s"} or {"event": "wait_returned"}; finally
{"event": "listing", "entries": [...]} from process 0.
"""

import os
import signal
import time

import _common

args = _common.init()

import jax  # noqa: E402

import checkpointer as ckpt  # noqa: E402
import checkpointer._save._pipeline as save_mod  # noqa: E402

victim = args["victim"]
me = jax.process_index()
if me == victim:
    real_write = save_mod.write_snapshot

    def slow_write(snap):
        time.sleep(3600)  # never reports done: it is killed first
        return real_write(snap)

    save_mod.write_snapshot = slow_write

mesh = _common.mesh((2, 4), ("data", "model"))
tree = _common.build_tree(mesh)
handle = ckpt.save_async(args["path"], tree, commit_timeout_s=args["commit_timeout_s"])
_common.emit(event="snapshot_taken", generation=handle.snapshot.generation)
if me == victim:
    os.kill(os.getpid(), signal.SIGKILL)

t0 = time.monotonic()
try:
    handle.wait(timeout=args["wait_timeout_s"])
except ckpt.CheckpointError as e:
    _common.emit(event="wait_raised", type=type(e).__name__, message=str(e), is_checkpoint_error=True,
                 elapsed_s=time.monotonic() - t0)
except BaseException as e:  # TimeoutError of wait() itself, or anything unexpected
    _common.emit(event="wait_raised", type=type(e).__name__, message=str(e), is_checkpoint_error=False,
                 elapsed_s=time.monotonic() - t0)
else:
    _common.emit(event="wait_returned", elapsed_s=time.monotonic() - t0)

if me == 0:
    parent = os.path.dirname(args["path"].rstrip("/"))
    entries = []
    for root, dirs, files in os.walk(parent):
        entries += [os.path.relpath(os.path.join(root, n), parent) for n in dirs + files]
    _common.emit(event="listing", entries=sorted(entries))
# A peer is dead: skip jax.distributed's shutdown barrier at exit, which would wait for it.
os._exit(0)
