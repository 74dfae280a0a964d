"""A writer and an evaluation job on one directory, as two independent programs (no
jax.distributed between them): process 0 saves ten steps with KeepLatest(2); process 1
follows the run and restores every step it is shown.

args: {"directory": path, "steps": n, "pause_s": seconds between saves}
emits: writer {"event": "written", "all_steps"}; follower one {"event": "seen", "step",
       "outcome": "exact" | "not found" | "<type>: <message>"} per step, then {"event": "done"}
"""

import os
import time

import _common
import numpy as np

import checkpointer as ckpt

args = _common.mp_args()  # no jax.distributed: two separate jobs
directory, steps = args["directory"], args["steps"]


def tree(step):
    return {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64) * step, "step": step}


if _common.process_index() == 0:
    with ckpt.CheckpointManager(directory, keep=ckpt.KeepLatest(2)) as mgr:
        for step in range(1, steps + 1):
            mgr.save(step, tree(step))
            time.sleep(args["pause_s"])
        mgr.wait_until_finished()
        _common.emit(event="written", all_steps=mgr.all_steps())
else:
    reader = ckpt.CheckpointManager(directory, read_only=True)
    for step in reader.follow(timeout_s=60, poll_s=0.02):
        try:
            got = reader.restore(step)
            exact = _common.same_bits(got["w"], tree(step)["w"]) and got["step"] == step
            outcome = "exact" if exact else "wrong bytes"
        except ckpt.CheckpointNotFoundError:
            outcome = "not found"
        except Exception as e:  # anything else is a failure of the test
            outcome = f"{type(e).__name__}: {e}"
        _common.emit(event="seen", step=step, outcome=outcome)
        if step == steps:
            break
    _common.emit(event="done", lock_file_exists=os.path.exists(os.path.join(directory, ".checkpointer.lock")))
