"""Direct writes with real processes: 2 processes x 2 devices save the same state twice,
with `direct_io=True` and `direct_io=False`, so the test can compare every file
(replica-parallel split grids, each process's pack).

args: {"paths": {"direct": path, "buffered": path}}
emits: {"event": "saved", "modes": {name: write_mode of this process's record}}
"""

import _common

args = _common.init()

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import checkpointer as ckpt  # noqa: E402

mesh = _common.mesh((2, 2), ("data", "model"))
rng = np.random.default_rng(20)
LEAVES = {  # name -> (global value, spec)
    "rep": (rng.standard_normal((512, 1024), dtype=np.float32), []),  # replicated over processes: split
    "dpmp": (rng.standard_normal((256, 512), dtype=np.float32), ["data", "model"]),
    "mp": (rng.standard_normal((384, 256), dtype=np.float32), [None, "model"]),  # replicated over 'data': split
    "bias": (rng.standard_normal(300, dtype=np.float32), []),  # packed
}
tree = {}
for name, (g, spec) in LEAVES.items():
    sharding = NamedSharding(mesh, _common.spec(spec))
    tree[name] = jax.make_array_from_callback(g.shape, sharding, lambda idx, g=g: g[idx], dtype=g.dtype)
tree["step"] = 3
modes = {}
for name, path in args["paths"].items():
    ckpt.save(path, tree, direct_io=name == "direct", commit_timeout_s=60)
    with open(f"{path}/processes/{_common.process_index()}.json") as f:
        modes[name] = json.load(f).get("write_mode")
_common.emit(event="saved", modes=modes)
