"""A run directory as a picture (`plot_run`): committed steps with their metrics, each
save's commit lag and blocking time, and the save timeline (`_timeline`'s phases).
matplotlib is imported inside `plot_run` (the `notebook` extra)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .. import _commit
from .._errors import CheckpointNotFoundError
from .._format import finite_number, read_metadata
from .._storage import storage_for
from ._inspect import _DPI, _FONT, _import_matplotlib, _unit
from ._timeline import _COLOR, PHASES, read_timeline, step_summary

if TYPE_CHECKING:
    from matplotlib.figure import Figure



def _directory_of(run: object) -> str | os.PathLike:
    directory = getattr(run, "directory", None)  # a CheckpointManager: a path or URL, as storage_for made it
    if isinstance(directory, str) and hasattr(run, "all_steps"):
        return directory
    if isinstance(run, (str, os.PathLike)):
        return run
    raise TypeError(f"plot_run takes a directory (a path or URL) or a CheckpointManager, not {type(run).__name__}")


def plot_run(run: str | os.PathLike | Any, *, last: int | None = 10) -> Figure:
    """Draws a run directory: its committed steps with their metrics, each step's
    commit lag, and the save timeline of the newest steps (`ckpt.timeline`'s picture).

    Args:
      run: a manager's directory (local path or URL) or a `CheckpointManager`.
      last: the newest `last` committed steps (None: all).
    Returns:
      A `matplotlib.figure.Figure`: top, the numeric metrics per step (one line per
      metric, at most 6) or the steps' sizes without metrics; middle, the commit lag
      and training-blocked seconds per step; bottom, the timeline of the newest steps'
      phases per process.
    Raises:
      CheckpointNotFoundError: no committed step in the directory.
      ValueError: `last` is not None nor an int >= 1 (0 drew every step, -1 all but the oldest).
      ModuleNotFoundError: matplotlib is not installed (`pip install 'checkpointer[notebook]'`).

    Multi-process: reads every process's record; call it from one process.
    """
    if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 1):
        raise ValueError(f"plot_run(last=...) needs an int >= 1 or None (all steps), got {last!r}")
    Figure = _import_matplotlib()

    location = _directory_of(run)
    storage, directory = storage_for(location)
    folders = _commit.committed_folders(storage, directory)
    if not folders:
        raise CheckpointNotFoundError(f"{directory} holds no committed step folders; pass a manager's directory")
    steps = list(folders)[-last:] if last else list(folders)
    metas = {s: read_metadata(storage, f"{directory}/{folders[s]}") for s in steps}
    metrics: dict[str, list[tuple[int, float]]] = {}
    for s, meta in metas.items():
        for k, v in (meta.user_metadata.get("metrics") or {}).items():
            number = finite_number(v)  # None for an int beyond any float too
            if number is not None:
                metrics.setdefault(k, []).append((s, number))
    phases = read_timeline(location, last=len(steps))
    by_step: dict[int | None, list] = {}
    for p in phases:
        if p.drawable:
            by_step.setdefault(p.step, []).append(p)
    summaries = {s: step_summary(ps) for s, ps in by_step.items() if isinstance(s, int)}
    fig = Figure(figsize=(11, 8.5), dpi=_DPI, layout="constrained")
    top, mid, bottom = fig.subplots(3, 1, height_ratios=[1, 1, 1.3])
    if metrics:
        for k, pts in list(metrics.items())[:6]:
            top.plot([s for s, _ in pts], [v for _, v in pts], marker="o", label=k)
        top.legend(fontsize=_FONT - 1)
        top.set_xlabel("step", fontsize=_FONT)
        if len(steps) <= 20:
            top.set_xticks(steps, [str(s) for s in steps])
        top.set_ylabel("metric", fontsize=_FONT)
        top.set_title(f"metrics of the {len(steps)} newest committed steps", fontsize=_FONT)
    else:
        scale, unit = _unit(max(m.total_bytes for m in metas.values()) or 1)
        top.bar([str(s) for s in steps], [metas[s].total_bytes / scale for s in steps], color="#6baed6")
        top.set_ylabel(unit, fontsize=_FONT)
        top.set_title(f"array bytes of the {len(steps)} newest committed steps (no metrics saved)", fontsize=_FONT)
    top.tick_params(labelsize=_FONT - 1)
    drawn = [s for s in steps if s in summaries]
    xs = range(len(drawn))
    mid.bar([x - 0.2 for x in xs], [summaries[s].blocking_s for s in drawn], width=0.4, color=_COLOR["snapshot"],
            label="training blocked")
    mid.bar([x + 0.2 for x in xs], [summaries[s].commit_lag_s or 0.0 for s in drawn], width=0.4, color=_COLOR["commit"],
            label="commit lag")
    mid.set_xticks(list(xs), [str(s) for s in drawn], fontsize=_FONT - 1)
    mid.set_xlabel("step", fontsize=_FONT)
    mid.set_ylabel("seconds", fontsize=_FONT)
    mid.tick_params(axis="y", labelsize=_FONT - 1)
    mid.legend(fontsize=_FONT - 1)
    mid.set_title("per save: training blocked and commit lag (host copy done → committed)", fontsize=_FONT)
    shown = drawn[-5:]
    for row, s in enumerate(shown):
        ps = by_step[s]
        t0 = min(p.start_unix_s for p in ps)
        n = max(p.process_index for p in ps) + 1
        for p in ps:
            y = row + (p.process_index + 0.1) / n
            bottom.broken_barh([(p.start_unix_s - t0, max(p.duration_s, 1e-4))], (y, 0.8 / n), facecolors=_COLOR[p.name])
    bottom.set_yticks([r + 0.5 for r in range(len(shown))], [f"step {s}" for s in shown], fontsize=_FONT - 1)
    bottom.invert_yaxis()
    bottom.set_xlabel("seconds from the save call (processes stacked within a step)", fontsize=_FONT)
    bottom.tick_params(axis="x", labelsize=_FONT - 1)
    bottom.set_title("save timeline", fontsize=_FONT)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=_COLOR[n], label=n) for n in PHASES], loc="outside lower center", ncol=len(PHASES),
               fontsize=_FONT - 1, frameon=False)
    fig.suptitle(f"run {directory}: steps {steps[0]} … {steps[-1]} ({len(folders)} committed)", fontsize=_FONT + 1)
    return fig
