"""Replica-parallel writes: saves two states from a 4x2 ('data', 'model') mesh, or
restores them onto another mesh and checks every byte.

args: {"mode": "save", "paths": {state: path}}
      {"mode": "restore", "paths": {state: path}, "mesh_shape": [..], "axis_names": [..],
       "spec": one PartitionSpec (JSON) for every leaf, or null for the saving specs}
emits: save: {"event": "saved", "planned": {state: [bytes_written per process]}}
       restore: {"event": "restored", "state", "ok", "checked_shards", "mismatches"}
States (global values recomputed by every process from a seed):
- "replicated": every leaf fully replicated (P()): two large leaves the planner splits
  (4 MiB float32, 2 MiB bfloat16) and 40 small ones of 64 KiB it spreads whole.
- "dpmp": data parallel over processes x model parallel inside them: leaves sharded over
  'model' and replicated over 'data' (split or spread), one sharded over both (each
  process writes its own), 16 small replicated biases.
"""

import _common

args = _common.init()

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import checkpointer as ckpt  # noqa: E402

# leaf -> (shape, dtype, saving spec)
STATES = {
    "replicated": {
        "a": ((1024, 1024), np.float32, []),
        "b": ((1024, 1024), ml_dtypes.bfloat16, []),
        **{f"small/{i}": ((128, 128), np.float32, []) for i in range(40)},
    },
    "dpmp": {
        "w1": ((2048, 1024), np.float32, [None, "model"]),
        "w2": ((1024, 512), np.float32, ["model", None]),
        "emb": ((4096, 256), ml_dtypes.bfloat16, [None, "model"]),
        "v": ((1024, 1024), np.float32, ["data", "model"]),
        **{f"bias/{i}": ((256,), np.float32, []) for i in range(16)},
    },
}


def global_value(state: str, name: str) -> np.ndarray:
    shape, dtype, _ = STATES[state][name]
    seed = sum(map(ord, state + "/" + name))
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(dtype)


def nest(flat: dict) -> dict:
    out: dict = {}
    for name, v in flat.items():
        node = out
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return out


if args["mode"] == "save":
    mesh = _common.mesh((4, 2), ("data", "model"))
    planned = {}
    for state, path in args["paths"].items():
        flat = {}
        for name, (shape, _, spec) in STATES[state].items():
            g = global_value(state, name)
            sharding = NamedSharding(mesh, _common.spec(spec))
            flat[name] = jax.make_array_from_callback(shape, sharding, lambda idx, g=g: g[idx], dtype=g.dtype)
        tree = nest(flat)
        tree["step"] = 7
        planned[state] = [p.bytes_written for p in ckpt.plan_save(tree).processes]
        ckpt.save(path, tree, commit_timeout_s=60)
    _common.emit(event="saved", planned=planned)
else:
    mesh = _common.mesh(args["mesh_shape"], args["axis_names"])
    for state, path in args["paths"].items():
        target = {}
        for name, (shape, dtype, spec) in STATES[state].items():
            entries = spec if args["spec"] is None else args["spec"]
            target[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, _common.spec(entries)))
        tree = nest(target)
        tree["step"] = None
        out = ckpt.restore(path, tree)
        mismatches, checked = [], 0
        if out["step"] != 7:
            mismatches.append(f"step {out['step']!r}")
        for name in STATES[state]:
            arr = out
            for part in name.split("/"):
                arr = arr[part]
            g = global_value(state, name)
            if arr.sharding != target[name].sharding:
                mismatches.append(f"{name}: sharding {arr.sharding}")
            for s in arr.addressable_shards:
                checked += 1
                if not _common.same_bits(np.asarray(s.data), g[s.index]):
                    mismatches.append(f"{name}: shard on device {s.device.id} index {s.index} differs")
        _common.emit(event="restored", state=state, ok=not mismatches, checked_shards=checked, mismatches=mismatches[:10])
