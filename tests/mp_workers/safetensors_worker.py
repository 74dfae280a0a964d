"""Restores a safetensors file onto the job's 2x4 mesh: `w` sharded over all 8 devices on
its second axis, `r` replicated; reports the bytes read (the restore's count and the
kernel's read(2) count for this process) and whether every shard is bit-exact.

args: {"path": the file (tensors `w` float32 (512, 2048), `r` bfloat16 (64, 64), from
       `np.random.default_rng(seed)` in that order), "seed": int}
emits: {"event": "restored", "ok", "bytes_read", "kernel_read_bytes", "mismatches"}
"""

import _common

args = _common.init()

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from checkpointer._encoding import RestoreStats  # noqa: E402
from checkpointer._restore import RestoreOptions  # noqa: E402
from checkpointer._restore._safetensors import read_safetensors  # noqa: E402
from checkpointer._storage import LocalStorage  # noqa: E402

mesh = _common.mesh([2, 4], ["data", "model"])
target = {
    "w": jax.ShapeDtypeStruct((512, 2048), np.float32, sharding=NamedSharding(mesh, P(None, ("data", "model")))),
    "r": jax.ShapeDtypeStruct((64, 64), jax.numpy.bfloat16, sharding=NamedSharding(mesh, P())),
}
read_safetensors(LocalStorage(), args["path"], target, RestoreOptions())  # warm: imports, compiled programs
proc = psutil.Process()
stats = RestoreStats()
before = proc.io_counters().read_chars
out = read_safetensors(LocalStorage(), args["path"], target, RestoreOptions(), stats=stats)
kernel = proc.io_counters().read_chars - before

rng = np.random.default_rng(args["seed"])
expected = {
    "w": rng.standard_normal((512, 2048)).astype(np.float32),
    "r": rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16),
}
mismatches = []
for name, arr in out.items():
    if arr.sharding != target[name].sharding:
        mismatches.append(f"{name}: sharding {arr.sharding}")
    for s in arr.addressable_shards:
        got = np.asarray(s.data)
        if got.tobytes() != np.ascontiguousarray(expected[name][s.index]).tobytes():
            mismatches.append(f"{name}: shard {s.index} differs")
_common.emit(event="restored", ok=not mismatches, bytes_read=stats.bytes_read, kernel_read_bytes=kernel, mismatches=mismatches)
