"""Saves one small state from 2 processes x 2 CPU devices for tests/test_inspect.py.

args: {"path": the checkpoint path}
emits: {"event": "saved"}
The state, on a 2x2 ('data', 'model') mesh (data over the processes):
- "rep": 1024x1024 float32 sharded over 'model', replicated over 'data': both processes
  hold each box, so the save splits it (replica-parallel) and each writes half;
- "own": 512x512 float32 over ('data', 'model'): each process writes its own shards;
- "bias": 64 float32 over 'model' (small: packed, replicated over the processes);
- "step": 3.
"""

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402

mesh = _common.mesh((2, 2), ("data", "model"))
tree = {"step": 3}
for name, shape, spec in (("rep", (1024, 1024), P(None, "model")), ("own", (512, 512), P("data", "model")),
                          ("bias", (64,), P("model"))):
    g = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    tree[name] = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda idx, g=g: g[idx])
ckpt.save(args["path"], tree, commit_timeout_s=60)
_common.emit(event="saved")
