"""The converting commands: `import-orbax` (an Orbax checkpoint into this format) and
`export` (the arrays as safetensors or npz)."""

from __future__ import annotations

import time

from .. import _format
from .._storage import storage_for
from ._inputs import _metadata
from ._ui import _UI, PROG


def _cmd_import_orbax(args, ui: _UI) -> int:
    from .._format import read_metadata
    from .._tools import import_orbax

    t0 = time.perf_counter()
    import_orbax(args.src, args.dst, overwrite=args.overwrite)
    storage, dst = storage_for(args.dst)
    meta = read_metadata(storage, dst)
    elapsed_s = time.perf_counter() - t0
    if ui.json_mode:
        ui.json({"src": meta.user_metadata.get("imported_from", {}).get("path"), "dst": meta.path, "step": meta.step,
                 "arrays": len(meta.arrays), "values": len(meta.leaves) - len(meta.arrays),
                 "total_bytes": meta.total_bytes, "elapsed_s": elapsed_s})
        return 0
    ui.line(f"imported {meta.user_metadata.get('imported_from', {}).get('path', args.src)} into {meta.path}: "
            f"{len(meta.arrays)} arrays, {len(meta.leaves) - len(meta.arrays)} values, "
            f"{_format.format_bytes(meta.total_bytes)} in {elapsed_s:.2f} s")
    ui.line(f"`{PROG} inspect {meta.path}` shows the tree; ckpt.restore restores it onto any mesh.")
    return 0


def _cmd_export(args, ui: _UI) -> int:
    from .._tools import export

    _metadata(args.path)  # the directory hint when PATH is a directory of steps
    out = args.output
    if out is None:
        base = args.path.rstrip("/")
        out = f"{base}.safetensors" if args.format == "safetensors" else f"{base}.npz"
    report = export(args.path, out, format=args.format, max_shard_bytes=args.max_shard_bytes, separator=args.separator,
                    upcast=args.upcast, overwrite=args.overwrite)
    if ui.json_mode:
        ui.json({"files": list(report.files), "tensors": report.tensors, "skipped": list(report.skipped),
                 "total_bytes": report.total_bytes})
        return 0
    ui.line(f"exported {len(report.tensors)} tensors ({_format.format_bytes(report.total_bytes)}) as {args.format}:")
    for f in report.files:
        ui.line(f"  {f}")
    if report.skipped:
        ui.line(f"not exported (not arrays): {', '.join(report.skipped)}")
    return 0
