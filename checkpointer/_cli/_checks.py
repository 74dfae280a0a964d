"""The commands that check a checkpoint restores: `verify` (every byte read, every
checksum checked) and `drill` (the newest step restored on a scratch mesh, verified and
timed)."""

from __future__ import annotations

import math

from .. import _format, _tools
from .._errors import MeshError, UsageError
from ._inputs import _metadata, _open_dir, _parse_axes, _parse_mesh
from ._ui import _UI


def _cmd_verify(args, ui: _UI) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .._tools import verify

    _metadata(args.path)  # a clear error (with the directory hint) before the progress bar
    progress = Progress(TextColumn("verifying"), BarColumn(), MofNCompleteColumn(), TextColumn("chunks"),
                        TimeElapsedColumn(), console=ui.err, transient=True,
                        disable=ui.json_mode or not ui.err.is_terminal)
    with progress:
        task = progress.add_task("verify", total=None)
        report = verify(args.path, progress=lambda done, total: progress.update(task, completed=done, total=total))
    if ui.json_mode:
        ui.json({"path": report.path, "ok": report.ok, "problems": list(report.problems), "chunks_checked": report.chunks_checked,
                 "bytes_checked": report.bytes_checked, "elapsed_s": report.elapsed_s})
    else:
        verdict = "OK" if report.ok else f"{len(report.problems)} problem(s)"
        ui.line(f"{report.path}: {verdict}", style="bold green" if report.ok else "bold red")
        ui.line(f"{report.chunks_checked} chunks, {report.bytes_checked} bytes ({_format.format_bytes(report.bytes_checked)}) "
                f"read and checksummed in {report.elapsed_s:.2f} s")
        for p in report.problems:
            ui.line(f"  - {p}")
    return 0 if report.ok else 1


def _cmd_drill(args, ui: _UI) -> int:
    shape = _parse_mesh(args.mesh) if args.mesh else None
    axes = _parse_axes(args.axes, len(shape)) if shape is not None and args.axes else None
    if args.axes and shape is None:
        raise UsageError("--axes needs --mesh")
    _open_dir(args.directory)
    try:
        report = _tools.drill(args.directory, shape, axis_names=axes)
    except MeshError as e:
        raise UsageError(str(e)) from e
    if ui.json_mode:
        ui.json(report.to_json())
        return 0 if report.ok else 1
    ui.line(f"restore drill of {report.path} (step {report.step}): {'OK' if report.ok else 'FAILED'}",
            style="bold green" if report.ok else "bold red")
    mesh = " x ".join(f"{n}={s}" for n, s in zip(report.mesh_axis_names, report.mesh_shape))
    ui.fields([
        ("scratch mesh", f"{mesh} ({math.prod(report.mesh_shape)} device{'s' * (math.prod(report.mesh_shape) != 1)})"),
        ("time to restored state", f"{report.restore_s:.3f} s" if report.restore_s is not None else "restore FAILED"),
        ("bytes needed", f"{report.bytes_needed} ({_format.format_bytes(report.bytes_needed)})"),
        ("bytes read", f"{report.bytes_read} ({_format.format_bytes(report.bytes_read)})"),
        ("read amplification", f"{report.read_amplification:.3f}"),
        ("verify", f"{'OK' if not report.problems else f'{len(report.problems)} problem(s)'} in {report.verify_s:.3f} s"),
    ])
    for p in report.problems:
        ui.line(f"  - {p}")
    return 0 if report.ok else 1
