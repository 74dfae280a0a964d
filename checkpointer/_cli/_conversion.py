"""The converting commands: `import-orbax` (an Orbax checkpoint into this format) and
`export` (the arrays as safetensors or npz, or everything as Orbax checkpoints)."""

from __future__ import annotations

import os

from .. import _format
from ._inputs import _metadata
from ._ui import _UI, PROG


def _cmd_import_orbax(args, ui: _UI) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .._tools import import_orbax

    # A bar on a terminal's stderr while the steps of a manager directory come over (not with --json).
    bar = Progress(TextColumn("importing Orbax steps"), BarColumn(), MofNCompleteColumn(), TextColumn("step {task.fields[step]}"),
                   TimeElapsedColumn(), console=ui.err, transient=True, disable=ui.json_mode or not ui.err.is_terminal)
    task = bar.add_task("import", total=None, step="-")

    def progress(done: int, total: int, step: int) -> None:
        bar.update(task, completed=done, total=total, step=step)

    with bar:
        report = import_orbax(args.src, args.dst, overwrite=args.overwrite, progress=progress)
    steps = report.steps if report.steps or report.resumed else (report,)
    if ui.json_mode:
        ui.json({"src": report.src, "dst": report.dst, "step": report.step, "arrays": report.arrays,
                 "values": report.values, "total_bytes": report.total_bytes, "elapsed_s": report.elapsed_s,
                 "resumed": list(report.resumed),
                 "steps": [{"step": r.step, "src": r.src, "dst": r.dst, "items": r.items, "placeholders": r.placeholders,
                            "prng_keys": list(r.prng_keys), "metrics": r.metrics, "arrays": r.arrays,
                            "values": r.values, "total_bytes": r.total_bytes} for r in steps]})
        return 0
    for r in steps:
        items = ", ".join(f"{name} -> {what}" for name, what in r.items.items())
        ui.line(f"imported {r.src} into {r.dst}: {r.arrays} arrays, {r.values} values, "
                f"{_format.format_bytes(r.total_bytes)} in {r.elapsed_s:.2f} s ({items})")
        if r.placeholders:
            ui.line(f"  empty Orbax nodes kept as placeholders (restore fills them from the target): "
                    f"{', '.join(f'{k} ({v})' for k, v in r.placeholders.items())}")
        if r.prng_keys:
            ui.line(f"  typed PRNG keys: {', '.join(r.prng_keys)}")
    if report.resumed:
        ui.line(f"already imported, kept: steps {', '.join(map(str, report.resumed))}")
    if report.steps or report.resumed:
        ui.line(f"{len(report.steps)} steps imported into {report.dst} in {report.elapsed_s:.2f} s; "
                f"`{PROG} ls {report.dst}` lists them, ckpt.CheckpointManager opens them.")
    else:
        ui.line(f"`{PROG} inspect {report.dst}` shows the tree; ckpt.restore restores it onto any mesh.")
    return 0


def _default_out(path: str, suffix: str) -> str:
    """`<path><suffix>` beside the checkpoint (or run): for a local path, from its normalized
    absolute form, so that `.` or `7/` name `../7.orbax`, never `..orbax` inside it."""
    base = path.rstrip("/")
    if "://" not in path:
        base = os.path.normpath(os.path.abspath(path))
    return f"{base}{suffix}"


def _cmd_export(args, ui: _UI) -> int:
    from .._tools import export

    if args.format == "orbax":
        return _export_orbax(args, ui)
    _metadata(args.path)  # the directory hint when PATH is a directory of steps
    out = args.output
    if out is None:
        out = _default_out(args.path, ".safetensors" if args.format == "safetensors" else ".npz")
    report = export(args.path, out, format=args.format, max_shard_bytes=args.max_shard_bytes, separator=args.separator,
                    upcast=args.upcast, overwrite=args.overwrite, leaves=args.leaves)
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


def _export_orbax(args, ui: _UI) -> int:
    import warnings

    from .._tools import export

    given = [flag for flag, on in (("--leaves", args.leaves), ("--upcast", args.upcast), ("--separator", args.separator != "."))
             if on]
    if given:
        raise ValueError(f"{', '.join(given)} do(es) not apply to --format orbax: Orbax gets every leaf, named by its "
                         "keys joined with '.'")
    out = args.output if args.output is not None else _default_out(args.path, ".orbax")
    with warnings.catch_warnings():  # the dropped state is printed below
        warnings.simplefilter("ignore", UserWarning)
        report = export(args.path, out, format="orbax", overwrite=args.overwrite)
    if ui.json_mode:
        ui.json({"out": report.files[0], "steps": list(report.steps), "params": sorted(report.tensors),
                 "dropped": list(report.dropped), "total_bytes": report.total_bytes})
        return 0
    what = f"{len(report.steps)} steps" if report.steps else "1 checkpoint"
    ui.line(f"exported {what} ({len(report.tensors)} leaves, {_format.format_bytes(report.total_bytes)}) as Orbax: "
            f"{report.files[0]}")
    for line in report.dropped:
        ui.line(f"  not exported: {line}")
    if report.steps:
        ui.line("  open it with orbax.checkpoint.CheckpointManager(DIR) and restore with args.StandardRestore(target)")
    else:
        ui.line("  restore it with orbax.checkpoint.StandardCheckpointer().restore(OUT, target)")
    return 0
