"""Every process runs a CheckpointManager(save_interval_s=100) whose clock reads a fake time
per call to save: process 0's times decide; the others' clocks disagree wildly.

args: {"directory": path, "times": {process index: [seconds per save call]}}
emits: {"event": "saved", "returns": [what save returned per call], "all_steps": [...]}
"""

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import checkpointer as ckpt  # noqa: E402
from checkpointer._manage import _time_policies  # noqa: E402

times = list(args["times"][str(jax.process_index())])
now = [times[0]]


class _Clock:
    @staticmethod
    def time():
        return now[0]


_time_policies.time = _Clock  # the save decision's clock (and its record of saves)

returns = []
with ckpt.CheckpointManager(args["directory"], save_interval_s=100, commit_timeout_s=60) as mgr:
    for step, t in enumerate(times, start=1):
        now[0] = t
        returns.append(mgr.save(step, {"w": np.full((4,), step, np.float32)}))
    mgr.wait_until_finished()
    _common.emit(event="saved", returns=returns, all_steps=mgr.all_steps())
