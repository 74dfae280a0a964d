"""A writer that marks its run finished and an evaluation job that follows it, as two
independent programs (no jax.distributed between them): process 0 saves `steps` steps
with KeepLatest(1) and closes with finished=True; process 1 follows with no timeout, so
only the finished mark ends it, polling slowly so that retention removes steps first.

args: {"directory": path, "steps": n, "pause_s": seconds between saves, "poll_s": follower's}
emits: writer {"event": "written", "all_steps"}; follower {"event": "followed", "yielded",
       "removed", "finished", "finished_step"}
"""

import time

import _common
import numpy as np

import checkpointer as ckpt

args = _common.mp_args()  # no jax.distributed: two separate jobs
directory, steps = args["directory"], args["steps"]

if _common.process_index() == 0:
    mgr = ckpt.CheckpointManager(directory, keep=ckpt.KeepLatest(1))
    for step in range(1, steps + 1):
        mgr.save(step, {"w": np.full((16, 16), step, np.float32)})
        time.sleep(args["pause_s"])
    mgr.close(finished=True)
    _common.emit(event="written", all_steps=ckpt.CheckpointManager(directory, read_only=True).all_steps())
else:
    reader = ckpt.CheckpointManager(directory, read_only=True)
    followed = reader.follow(poll_s=args["poll_s"])  # no timeout: the mark ends it
    yielded = list(followed)
    _common.emit(event="followed", yielded=yielded, removed=followed.removed_steps, finished=followed.finished,
                 finished_step=followed.finished_step)
