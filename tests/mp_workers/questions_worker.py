"""Every process runs a CheckpointManager, saves steps 1..3 with metrics, asks the
manager's questions and deletes: step 2 (present), then step 7 (absent).

args: {"directory": path}
emits: {"event": "answers", "best": .., "metrics": .., "metadata": .., "after_delete": [...],
        "absent": [error type, message]}
"""

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import checkpointer as ckpt  # noqa: E402

losses = {1: 0.8, 2: 0.2, 3: 0.5}
with ckpt.CheckpointManager(args["directory"], keep=ckpt.KeepLatest(10), commit_timeout_s=60) as mgr:
    for step, loss in losses.items():
        mgr.save(step, {"w": np.full((8,), step, np.float32)}, metrics={"loss": loss}, metadata={"epoch": step})
    mgr.wait_until_finished()
    best = mgr.best_step("loss")
    answers = {"best": best, "metrics": mgr.metrics(best), "metadata": mgr.user_metadata(best)}
    mgr.delete(best)
    answers["after_delete"] = mgr.all_steps()
    try:
        mgr.delete(7)
    except ckpt.CheckpointError as e:
        answers["absent"] = [type(e).__name__, str(e)]
    _common.emit(event="answers", process=jax.process_index(), **answers)
