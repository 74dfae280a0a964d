"""Restores the saved test tree onto one or more target meshes and checks every byte.

args: {"path": checkpoint path,
       "targets": [{"name": str, "mesh_shape": [..], "axis_names": [..], "specs": {leaf: spec}}]}
emits per target: {"event": "restored", "name", "ok", "checked_shards", "bytes_needed",
                   "expected_bytes", "total_bytes", "mismatches": [...]}
       then {"event": "per_process_state", "own_error": error type or None, "own": value,
             "all": [...], "by_index": the record of process_index % saved count}
"""

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import checkpointer as ckpt  # noqa: E402
from checkpointer._format._box import Box  # noqa: E402

expected = _common.global_arrays()

for t in args["targets"]:
    mesh = _common.mesh(t["mesh_shape"], t["axis_names"])
    target = {
        name: jax.ShapeDtypeStruct(g.shape, g.dtype, sharding=NamedSharding(mesh, _common.spec(t["specs"][name])))
        for name, g in expected.items()
    }
    target.update({k: None for k in _common.VALUES})  # non-array leaves: taken from the manifest
    out = ckpt.restore(args["path"], target)

    mismatches, checked = [], 0
    for k, v in _common.VALUES.items():
        if out[k] != v or type(out[k]) is not type(v):
            mismatches.append(f"{k}: {out[k]!r} != {v!r}")
    unique_boxes = set()  # (leaf, box) of this process's devices
    for name, g in expected.items():
        arr = out[name]
        if arr.sharding != target[name].sharding or arr.dtype != g.dtype or arr.shape != g.shape:
            mismatches.append(f"{name}: got {arr.sharding} {arr.dtype} {arr.shape}")
            continue
        devices = {s.device for s in arr.addressable_shards}
        if devices != {d for d in mesh.devices.flat if d.process_index == jax.process_index()}:
            mismatches.append(f"{name}: shards on {sorted(d.id for d in devices)}")
        for s in arr.addressable_shards:
            checked += 1
            if not _common.same_bits(np.asarray(s.data), g[s.index]):
                mismatches.append(f"{name}: shard on device {s.device.id} index {s.index} differs")
            unique_boxes.add((name, Box.from_index(s.index, g.shape)))

    # The plan of this process covers exactly the unique boxes of its own devices: it
    # reads them, or (a leaf shared with other processes, cooperative) reads a share of
    # them and receives the rest.
    plan = ckpt.plan_restore(args["path"], target)
    expected_bytes = sum(box.size * expected[name].dtype.itemsize for name, box in unique_boxes)
    planned_boxes = set()
    for leaf in plan.leaves:
        boxes = leaf.target_boxes if leaf.exchange_spec is not None else [b.box for b in leaf.boxes]
        planned_boxes |= {(leaf.leaf_path, box) for box in boxes}
        if leaf.exchange_spec is not None:
            for tb in leaf.target_boxes:
                got = sum(r.box.size for r in leaf.received if r.box.intersect(tb)) + sum(
                    x.size for b in leaf.boxes if (x := b.box.intersect(tb)) is not None)
                if got != tb.size:
                    mismatches.append(f"{leaf.leaf_path}: read + received cover {got} of {tb.size} elements of {tb}")
    if planned_boxes != unique_boxes:
        mismatches.append(f"plan boxes {sorted(planned_boxes)} != own boxes {sorted(unique_boxes)}")
    if plan.process_index != jax.process_index():
        mismatches.append(f"plan for process {plan.process_index}")
    # Every chunk read lies inside the box it is for.
    for leaf in plan.leaves:
        for b in leaf.boxes:
            for r in b.reads:
                if r.box.intersect(b.box) != r.box:
                    mismatches.append(f"{leaf.leaf_path}: read {r.box} outside box {b.box}")

    _common.emit(
        event="restored",
        name=t["name"],
        ok=not mismatches,
        checked_shards=checked,
        bytes_needed=plan.bytes_needed,
        bytes_read=plan.bytes_read,
        expected_bytes=expected_bytes,
        total_bytes=sum(g.nbytes for g in expected.values()),
        mismatches=mismatches,
    )

# Per-process state follows the documented rule: own record only when the process count
# matches the save's; otherwise all records (or one named record) on request.
try:
    own, own_error = ckpt.per_process_state(args["path"]), None
except ckpt.ProcessCountMismatchError as e:
    own, own_error = None, type(e).__name__
records = ckpt.per_process_state(args["path"], all_processes=True)
_common.emit(
    event="per_process_state", own=own, own_error=own_error, all=records,
    by_index=ckpt.per_process_state(args["path"], process_index=jax.process_index() % len(records)),
)
