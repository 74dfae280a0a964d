"""Every process runs a CheckpointManager(keep=KeepLatest(2), async_save=True), steps 1..4.

args: {"directory": path, "steps": [..], "keep": n}
emits: {"event": "deleted", "steps": [steps this process passed to unpublish_step]}
       {"event": "done", "all_steps": [...], "latest_step": n}
       process 0 also: {"event": "listing", "entries": [names in the directory]}
"""

import os

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import checkpointer as ckpt  # noqa: E402
import checkpointer._commit as directory_mod  # noqa: E402  (the package: the manager calls it there)

deleted = []
real_unpublish_step = directory_mod.unpublish_step


def counting_unpublish_step(storage, directory, step):
    deleted.append(int(step))
    return real_unpublish_step(storage, directory, step)


directory_mod.unpublish_step = counting_unpublish_step

mesh = _common.mesh((2, 4), ("data", "model"))
tree = _common.build_tree(mesh)
with ckpt.CheckpointManager(args["directory"], keep=ckpt.KeepLatest(args["keep"]), async_save=True, commit_timeout_s=60) as mngr:
    for step in args["steps"]:
        # A cheap change per step, so every step holds different bytes.
        tree = dict(tree, w=tree["w"] + 1.0, step=step)
        assert mngr.save(step, tree, metrics={"loss": 1.0 / step})
    mngr.wait_until_finished()
    all_steps, latest = mngr.all_steps(), mngr.latest_step()
    restored = mngr.restore(None, {"w": tree["w"].sharding, "step": None}, partial=True)
    w_ok = bool(np.array_equal(
        np.asarray(restored["w"].addressable_shards[0].data), np.asarray(tree["w"].addressable_shards[0].data)
    ))
_common.emit(event="deleted", steps=deleted)
_common.emit(event="done", all_steps=all_steps, latest_step=latest, restored_step=restored["step"], w_ok=w_ok)
if jax.process_index() == 0:
    _common.emit(event="listing", entries=sorted(os.listdir(args["directory"])))
