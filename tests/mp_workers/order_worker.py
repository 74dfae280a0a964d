"""Process 0 alone makes an extra save (which times out), then every process saves
`run/1` and `run/2`: the extra save must not throw the later ones out of step.

args: {"directory": path, "commit_timeout_s": float}
emits: {"event": "extra", "type"}  (process 0 only), then {"event": "saved", "step", "outcome"}
"""

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import checkpointer as ckpt  # noqa: E402

d = args["directory"]
if jax.process_index() == 0:
    try:
        ckpt.save(f"{d}/extras", {"cfg": np.arange(3)}, commit_timeout_s=args["commit_timeout_s"])
        _common.emit(event="extra", type="ok")
    except ckpt.CheckpointError as e:
        _common.emit(event="extra", type=type(e).__name__)
mesh = _common.mesh((2, 2), ("data", "model"))
for step in (1, 2):
    try:
        ckpt.save(f"{d}/run/{step}", _common.build_tree(mesh), commit_timeout_s=60)
        _common.emit(event="saved", step=step, outcome="ok")
    except ckpt.CheckpointError as e:
        _common.emit(event="saved", step=step, outcome=f"{type(e).__name__}: {e}")
