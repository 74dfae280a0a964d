"""Saves the test tree from a 2x4 ('data', 'model') mesh spanning every process.

args: {"path": checkpoint path}
emits: {"event": "saved", "local_devices": [...], "written": {leaf: [chunk keys]},
        "own_state": what per_process_state(path) returns here, "all_states": [...]}
Each process saves its own data-loader position as per-process state.
"""

import _common

args = _common.init()

import jax  # noqa: E402

import checkpointer as ckpt  # noqa: E402

mesh = _common.mesh((2, 4), ("data", "model"))
tree = _common.build_tree(mesh)
# Which chunks this process holds with replica_id 0 (what it should write).
mine = {
    name: sorted({tuple(s.index[d].start or 0 for d in range(tree[name].ndim)) for s in tree[name].addressable_shards if s.replica_id == 0})
    for name in _common.ARRAY_LEAVES
}
ckpt.save(
    args["path"], tree, metadata={"saved_by": "save_worker"}, commit_timeout_s=60,
    per_process_state=_common.loader_state(jax.process_index()),
)
_common.emit(
    event="saved",
    local_devices=[d.id for d in jax.local_devices()],
    replica0_origins={k: [list(o) for o in v] for k, v in mine.items()},
    own_state=ckpt.per_process_state(args["path"]),
    all_states=ckpt.per_process_state(args["path"], all_processes=True),
)
