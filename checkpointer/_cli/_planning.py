"""The pure planning commands: `plan` (the read plan and read amplification of a
restore onto a mesh) and `plan-save` (which process writes which bytes)."""

from __future__ import annotations

import math
from typing import Any

from .. import _format, _tools
from .._errors import UsageError
from ._inputs import _build_mesh, _metadata, _parse_spec
from ._inspection import _draw
from ._ui import _UI, _mesh_str, _shape, _spec_json, _spec_str


def _cmd_plan(args, ui: _UI) -> int:
    import jax
    from jax.sharding import NamedSharding

    from .._restore import plan_restore

    meta = _metadata(args.path)
    processes = args.processes
    pidx = args.process_index
    # With --processes the plan is pure (an abstract mesh, no devices needed);
    # without, it is the plan of a restore run here, on this machine's devices.
    mesh = _build_mesh(args, meta, abstract=processes is not None)
    n_devices = math.prod(mesh.shape.values())
    overrides = [_parse_spec(s, mesh) for s in args.spec]
    try:
        specs = _tools.target_specs(meta, mesh, overrides)
    except ValueError as e:
        raise UsageError(f"--spec: {e}") from e
    if processes is None:
        processes = jax.process_count()
        pidx = jax.process_index() if pidx is None else pidx
        if not 0 <= pidx < processes:
            raise UsageError(
                f"--process-index {pidx}: this command runs as {processes} process(es); add --processes P to plan "
                "as if the mesh's devices were spread over P processes"
            )
    else:
        pidx = 0 if pidx is None else pidx
        if processes < 1 or n_devices % processes:
            raise UsageError(f"--processes {processes} must divide the mesh's {n_devices} devices")
        if not 0 <= pidx < processes:
            raise UsageError(f"--process-index {pidx} must be in [0, {processes})")
    target = _tools.target_tree(meta, {p: NamedSharding(mesh, s) for p, s in specs.items()})
    plan = plan_restore(meta.path, target, process_index=pidx, processes=args.processes, cooperative=args.cooperative)
    if args.png:
        # With --processes the picture compares every process's plan (each is pure).
        plans = [plan if i == pidx else plan_restore(meta.path, target, process_index=i, processes=processes, cooperative=args.cooperative)
                 for i in range(processes)] if args.processes is not None else plan
        _draw(lambda: _tools.plot_plan(plans, title=f"restore plan of {meta.path} onto mesh {_mesh_str(mesh)}"), args.png)

    leaves: list[dict[str, Any]] = []
    for leaf in plan.leaves:
        leaves.append({
            "leaf": leaf.leaf_path, "keystr": meta.keystr(leaf.leaf_path), "shape": list(leaf.shape),
            "dtype": str(leaf.dtype),
            "target_spec": _spec_json(specs[leaf.leaf_path]),
            "boxes": len(leaf.boxes), "chunks": sum(len(b.reads) + len(b.packed) for b in leaf.boxes),
            "inner_chunks": sum(r.inner_chunks for b in leaf.boxes for r in b.reads),
            "bytes_needed": leaf.bytes_needed, "bytes_read": leaf.bytes_read, "bytes_received": leaf.bytes_received,
            "exchange_spec": None if leaf.exchange_spec is None else _spec_json(leaf.exchange_spec),
            "read_amplification": leaf.bytes_read / leaf.bytes_needed if leaf.bytes_needed else 1.0,
        })
    if ui.json_mode:
        ui.json({
            "path": meta.path, "mesh": {"shape": list(mesh.shape.values()), "axis_names": list(mesh.axis_names)},
            "process_index": pidx, "process_count": processes, "leaves": leaves,
            "chunks": sum(r["chunks"] for r in leaves), "bytes_needed": plan.bytes_needed, "bytes_read": plan.bytes_read,
            "bytes_received": plan.bytes_received, "cooperative": plan.cooperative,
            "read_amplification": plan.read_amplification, "png": args.png,
        })
        return 0
    ui.line(f"restore plan for {meta.path}")
    ui.line(f"target mesh {_mesh_str(mesh)} ({n_devices} devices), process {pidx} of {processes}")
    ui.table(
        ["leaf", "target", "boxes", "chunks", "needed", "read", "received", "amplification"],
        [(r["keystr"] or "<root>", _spec_str(specs[r["leaf"]]), r["boxes"], r["chunks"], _format.format_bytes(r["bytes_needed"]),
          _format.format_bytes(r["bytes_read"]), _format.format_bytes(r["bytes_received"]), f"{r['read_amplification']:.3f}")
         for r in leaves],
        right=["boxes", "chunks", "needed", "read", "received", "amplification"],
        footer=["total", "", sum(r["boxes"] for r in leaves), sum(r["chunks"] for r in leaves), _format.format_bytes(plan.bytes_needed),
                _format.format_bytes(plan.bytes_read), _format.format_bytes(plan.bytes_received),
                f"{plan.read_amplification:.3f}"],
    )
    ui.line(f"{plan.bytes_read} bytes read for {plan.bytes_needed} bytes needed: read amplification {plan.read_amplification:.3f}")
    if plan.cooperative:
        ui.line(f"cooperative: {plan.bytes_received} bytes come from peers over the device interconnect instead of "
                "storage (--no-cooperative: every process reads all it needs)")
    if args.png:
        ui.line(f"wrote the read plan to {args.png}")
    if processes > 1:
        ui.line(f"These figures are process {pidx}'s of {processes}; --process-index I shows process I (0 <= I < {processes}).")
    return 0


def _cmd_plan_save(args, ui: _UI) -> int:
    import jax
    from jax.sharding import NamedSharding

    from .._save import plan_save

    meta = _metadata(args.path)
    mesh = _build_mesh(args, meta, abstract=True)
    n_devices = math.prod(mesh.shape.values())
    processes = args.processes
    if processes < 1 or n_devices % processes:
        raise UsageError(f"--processes {processes} must divide the mesh's {n_devices} devices")
    overrides = [_parse_spec(s, mesh) for s in args.spec]
    try:
        specs = _tools.target_specs(meta, mesh, overrides)
    except ValueError as e:
        raise UsageError(f"--spec: {e}") from e
    state = _tools.target_tree(meta, {
        p: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=NamedSharding(mesh, specs[p])) for p, m in meta.arrays.items()
    })
    plan = plan_save(state, processes=processes)
    leaves: list[dict[str, Any]] = [{
        "leaf": a.leaf_path, "keystr": meta.keystr(a.leaf_path), "shape": list(a.shape), "spec": _spec_json(specs[a.leaf_path]),
        "chunk_shape": list(a.chunk_shape), "replicas": a.replicas, "split_dim": a.split_dim,
        "split_factor": a.split_factor, "writers": len({p for p, _ in a.writes}), "chunks": len(a.writes),
    } for a in plan.leaves]
    rows = [{"process_index": p.process_index, "bytes_written": p.bytes_written, "data_bytes": p.data_bytes, "files": p.files}
            for p in plan.processes]
    if ui.json_mode:
        ui.json({
            "path": meta.path, "mesh": {"shape": list(mesh.shape.values()), "axis_names": list(mesh.axis_names)},
            "process_count": processes, "leaves": leaves, "processes": rows, "bytes_written": plan.bytes_written,
            "files": plan.files, "imbalance": plan.imbalance,
        })
        return 0
    ui.line(f"save plan of {meta.path}'s state from mesh {_mesh_str(mesh)} ({n_devices} devices) on {processes} processes")
    ui.table(
        ["leaf", "saved by", "chunk", "replicas", "split", "writers"],
        [(r["keystr"] or "<root>", _spec_str(specs[r["leaf"]]), _shape(r["chunk_shape"]), r["replicas"],
          f"{r['split_factor']} along dim {r['split_dim']}" if r["split_dim"] is not None else "-", r["writers"]) for r in leaves],
        right=["replicas", "writers"],
    )
    ui.table(
        ["process", "bytes written", "files"],
        [(r["process_index"], _format.format_bytes(r["bytes_written"]), r["files"]) for r in rows],
        right=["process", "bytes written", "files"],
        footer=["total", _format.format_bytes(plan.bytes_written), plan.files],
    )
    ui.line(f"largest process writes {plan.imbalance:.3f}x the mean ({_format.format_bytes(plan.bytes_written // max(1, processes))})")
    return 0
