"""Where a save's time goes: per step and per process, the phases of each save.

Sources, all written by the saves themselves (nothing here writes a committed step):

- `processes/<i>.json` (`ProcessRecord.phases_unix_s`): each process's
  `wait_for_arrays` (from the save call until the computations producing the leaves
  are done: JAX dispatches asynchronously; absent in older records, whose `snapshot`
  includes it), `snapshot` (the pre-save agreement and the host copy: what blocks
  training), `write` (opening arrays and issuing chunk writes) and `durable` (until
  every chunk write completed, fsync included).
- `manifest.json` (`"save_phases_unix_s"`): process 0's `wait` for every process's
  "durable" report; its end is where the commit starts.
- `COMMITTED` (`"committed_unix_s"`): when the marker was written (the commit's end
  when no journal says more).
- the run-level journal `DIR/.checkpointer-journal.jsonl`, appended by a manager's
  process 0 after each commit (one JSON object a line): the `commit` span up to the
  published rename and the `retention` that followed. Retention runs before the
  other processes are told of the commit, so their `wait` ends with it.

`read_timeline` turns them into `Phase`s (pure given the files); `render_text` draws
them in a terminal with rich, `render_png` with matplotlib. Records are read as they
are: a phase whose times are not a wall-clock time between 1970 and 9999
(`drawable`, e.g. a timestamp of 1e308) is left out of the bars and the headline and
shown as a value that cannot be drawn.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence

from .. import _commit, _format
from .._commit import SAVE_JOURNAL as JOURNAL
from .._errors import CheckpointError, CheckpointNotFoundError
from .._format import ProcessRecord, parse_phases, phases_json
from .._storage import LocalStorage, Storage, storage_for

log = logging.getLogger("checkpointer")

# Object stores cannot append: the journal is rewritten with its newest lines only.
MAX_JOURNAL_LINES = 1000
MAX_JOURNAL_BYTES = 64 * 2**20
PHASES = ("wait_for_arrays", "snapshot", "write", "durable", "wait", "commit", "retention")
_STYLE = {"wait_for_arrays": "cyan", "snapshot": "red", "write": "yellow", "durable": "green", "wait": "bright_black", "commit": "blue",
          "retention": "magenta"}
_CHAR = {"wait_for_arrays": "a", "snapshot": "S", "write": "W", "durable": "D", "wait": ".", "commit": "C", "retention": "R"}
# Characters of the text table outside the bar: the process column and one per phase.
_TEXT_COLUMNS = 10 + sum(max(len(n), 6) + 2 for n in PHASES)
# Wall-clock times the drawing places on a bar: 1970-01-01 to 9999-12-31 (what datetime
# can show); anything else in a record (1e308, a negative time) is shown as such.
# Object stores rewrite the journal whole (read, then write): one rewrite at a time per process.
_REWRITING = threading.Lock()
_DRAWABLE_UNIX_S = (0.0, 253402300800.0)
_COLOR = {"wait_for_arrays": "#9edae5", "snapshot": "#d62728", "write": "#ffbf00", "durable": "#2ca02c", "wait": "#c7c7c7", "commit": "#1f77b4",
          "retention": "#9467bd"}


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of one process's part in one save.

    Attributes:
      step: the step saved (None for a save without step).
      process_index: the process.
      name: one of `PHASES`.
      start_unix_s: wall-clock start, seconds since the epoch.
      end_unix_s: wall-clock end, seconds since the epoch.
    """

    step: int | None
    process_index: int
    name: str
    start_unix_s: float
    end_unix_s: float

    @property
    def duration_s(self) -> float:
        return max(0.0, self.end_unix_s - self.start_unix_s)

    @property
    def drawable(self) -> bool:
        """Whether both ends are wall-clock times a bar can show (1970 to 9999)."""
        lo, hi = _DRAWABLE_UNIX_S
        return lo <= self.start_unix_s <= hi and lo <= self.end_unix_s <= hi


# --- the journal ---------------------------------------------------------------------------


def append_journal(storage: Storage, directory: str, *, step: int | None, generation: str,
                   phases_unix_s: Mapping[str, tuple[float, float]]) -> None:
    """Appends one save's after-commit phases to `DIR/.checkpointer-journal.jsonl`.

    Diagnostics only: never fsynced, failures are logged and never raised (the commit
    stands). Local files are appended to; object stores rewrite the journal with its
    newest `MAX_JOURNAL_LINES` lines.

    Multi-process: process 0 of the writing manager only.
    """
    append_journal_line(storage, directory, {"step": step, "generation": generation,
                                             "phases_unix_s": phases_json(phases_unix_s)})


def append_journal_line(storage: Storage, directory: str, entry: Mapping[str, object], *,
                        replaces: str | None = None) -> None:
    """Appends one JSON object as a line of the directory's journal (see `append_journal`).

    Lines of other kinds than a save's phases carry an `"event"` name and no
    `"generation"` (`read_journal` skips them). Object stores rewrite the whole journal:
    there, with `replaces`, earlier lines of that event are dropped (a periodic note
    keeps only its newest line instead of pushing the phases out).
    """
    line = json.dumps(dict(entry), allow_nan=False) + "\n"
    path = f"{directory}/{JOURNAL}"
    try:
        if isinstance(storage, LocalStorage):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
            return
        with _REWRITING:  # one process's notes (its commit and deleter threads) never drop each other's
            old = storage.read_file(path, max_bytes=MAX_JOURNAL_BYTES).decode() if storage.exists(path) else ""
            lines = old.splitlines(keepends=True)
            if replaces is not None:
                lines = [ln for ln in lines if f'"event": "{replaces}"' not in ln]
            storage.write_file(path, "".join((lines + [line])[-MAX_JOURNAL_LINES:]).encode())
    except (OSError, ValueError) as e:
        log.warning("could not append to the save journal %s: %s", path, e)


def read_journal(storage: Storage, directory: str) -> dict[str, dict[str, tuple[float, float]]]:
    """Generation → after-commit phases, from the journal (absent: empty; longer than
    `MAX_JOURNAL_BYTES`: its newest lines). Lines that do not parse are skipped (a line
    cut short by a crash)."""
    path = f"{directory}/{JOURNAL}"
    try:
        size = storage.size(path) if storage.cheap_size else None
        if size is not None and size > MAX_JOURNAL_BYTES:  # a local journal is appended, never cut: its newest lines
            text = storage.read_range(path, size - MAX_JOURNAL_BYTES, MAX_JOURNAL_BYTES).decode(errors="replace")
            text = text.split("\n", 1)[-1]  # the first line is cut
        else:
            text = storage.read_file(path, max_bytes=MAX_JOURNAL_BYTES).decode(errors="replace")
    except (FileNotFoundError, CheckpointNotFoundError):
        return {}
    except OSError as e:
        if not storage.exists(path):
            return {}
        raise CheckpointError(f"cannot read the save journal {path}: {e}") from e
    out = {}
    for n, line in enumerate(text.splitlines()):
        try:
            entry = _format.load_json(line, what=f"{path} line {n + 1}")
            out[str(entry["generation"])] = parse_phases(entry["phases_unix_s"])
        except (ValueError, TypeError, KeyError):  # CorruptCheckpointError is a ValueError
            continue
    return out


# --- building the timeline -----------------------------------------------------------------


def save_phases(
    step: int | None,
    records: Mapping[int, ProcessRecord],
    manifest_phases: Mapping[str, tuple[float, float]],
    committed_unix_s: float | None,
    journal_phases: Mapping[str, tuple[float, float]],
) -> list[Phase]:
    """The phases of one save, from what its processes wrote (pure).

    Args:
      step: the step.
      records: process index → its record (records without `phases_unix_s` add nothing).
      manifest_phases: the manifest's `save_phases_unix_s` (process 0's `wait`).
      committed_unix_s: the marker's time, or None.
      journal_phases: the journal's entry for this save (`commit`, `retention`), or {}.
    Returns:
      Phases sorted by process, then start.
    """
    out: list[Phase] = []
    commit = journal_phases.get("commit")
    if commit is None and "wait" in manifest_phases and committed_unix_s is not None:
        commit = (manifest_phases["wait"][1], committed_unix_s)
    retention = journal_phases.get("retention")
    # The others learn of the commit after process 0's retention.
    released = retention[1] if retention else commit[1] if commit else None
    for pidx, rec in sorted(records.items()):
        own = dict(rec.phases_unix_s or {})
        if not own:
            continue
        for name in ("wait_for_arrays", "snapshot", "write", "durable"):
            if name in own:
                out.append(Phase(step, pidx, name, *own[name]))
        durable_end = own["durable"][1] if "durable" in own else None
        if pidx == 0:
            if "wait" in manifest_phases:  # from its report: writing its record is the gap before
                out.append(Phase(step, 0, "wait", *manifest_phases["wait"]))
            if commit is not None:
                out.append(Phase(step, 0, "commit", *commit))
            if retention is not None:
                out.append(Phase(step, 0, "retention", *retention))
        elif durable_end is not None and released is not None:
            out.append(Phase(step, pidx, "wait", durable_end, max(durable_end, released)))
    return sorted(out, key=lambda p: (p.process_index, p.start_unix_s, PHASES.index(p.name)))


def _read_json(storage: Storage, path: str) -> object:
    return _format.loads(storage.read_file(path, max_bytes=_format.MAX_MANIFEST_BYTES), path)


def _checkpoint_phases(storage: Storage, path: str, journal: Mapping[str, Mapping]) -> list[Phase]:
    manifest = _read_json(storage, f"{path}/{_format.MANIFEST}")
    if not isinstance(manifest, dict):
        return []
    try:
        marker = _read_json(storage, f"{path}/{_format.COMMITTED}")
        committed = marker.get("committed_unix_s") if isinstance(marker, dict) else None
    except (OSError, CheckpointError):
        committed = None
    try:
        manifest_phases = parse_phases(manifest.get("save_phases_unix_s", {}))
    except (ValueError, TypeError):
        manifest_phases = {}
    records = {}
    for i in range(int(manifest.get("process_count", 1))):
        name = f"{path}/{_format.process_record_name(i)}"
        try:
            records[i] = ProcessRecord.from_json(_read_json(storage, name), name)
        except (OSError, CheckpointError):
            continue  # a missing or unreadable record: that process is left out
    step = manifest.get("step")
    return save_phases(step if isinstance(step, int) else None, records, manifest_phases,
                       committed if isinstance(committed, (int, float)) else None,
                       journal.get(str(manifest.get("generation")), {}))


def read_timeline(location: str | os.PathLike, *, last: int | None = None) -> list[Phase]:
    """The phases of every committed save in a manager's directory, or of one checkpoint.

    Args:
      location: a manager's DIR, or one checkpoint's PATH (local path or URL).
      last: only the newest `last` committed steps (default: all).
    Returns:
      Phases by step, process, start. Saves by versions without timestamps add none.
    Raises:
      CheckpointNotFoundError: `location` is neither a checkpoint nor holds committed steps.

    Multi-process: a single-process reader; reads every process's record.
    """
    storage, path = storage_for(location)
    if storage.exists(f"{path}/{_format.COMMITTED}"):
        parent = path.rsplit("/", 1)[0]
        return _checkpoint_phases(storage, path, read_journal(storage, parent))
    folders = _commit.committed_folders(storage, path)
    if not folders:
        raise CheckpointNotFoundError(
            f"{path} holds no committed checkpoint and no committed step folders; pass a manager's directory or "
            "one checkpoint's path"
        )
    steps = list(folders)[-last:] if last else list(folders)
    journal = read_journal(storage, path)
    return [p for s in steps for p in _checkpoint_phases(storage, f"{path}/{folders[s]}", journal)]


# --- drawing ---------------------------------------------------------------------------------


def _by_step(phases: Sequence[Phase]) -> dict[int | None, list[Phase]]:
    out: dict[int | None, list[Phase]] = {}
    for p in phases:
        out.setdefault(p.step, []).append(p)
    return out


@dataclasses.dataclass(frozen=True)
class StepSummary:
    """One save's headline figures, from its phases.

    Attributes:
      total_s: first phase start to last phase end, seconds.
      blocking_s: the longest snapshot (agreement and host copy), seconds: training
        blocked by the save. The wait for the arrays before it is not counted: the
        training steps that produce them run meanwhile (in records older than
        `wait_for_arrays` the snapshot still includes that wait).
      wait_for_arrays_s: the longest wait for the arrays, seconds, or None when no
        record has that phase.
      commit_lag_s: end of the last snapshot (its host copy) to the end of the commit,
        seconds (how long the copied state was not yet safe), or None without a commit
        phase.
      slowest_process: the process whose chunks were durable last, or None.
      phase_s: phase name → its longest duration over processes, seconds.
    """

    total_s: float
    blocking_s: float
    wait_for_arrays_s: float | None
    commit_lag_s: float | None
    slowest_process: int | None
    phase_s: Mapping[str, float]


def step_summary(phases: Sequence[Phase]) -> StepSummary:
    """The `StepSummary` of one save's (non-empty) phases."""
    start = min(p.start_unix_s for p in phases)
    end = max(p.end_unix_s for p in phases)
    snaps = [p for p in phases if p.name == "snapshot"]
    commits = [p for p in phases if p.name == "commit"]
    durables = [p for p in phases if p.name == "durable"]
    phase_s: dict[str, float] = {}
    for p in phases:
        phase_s[p.name] = max(phase_s.get(p.name, 0.0), p.duration_s)
    snap_end = max((p.end_unix_s for p in snaps), default=start)
    return StepSummary(
        total_s=end - start,
        blocking_s=max((p.duration_s for p in snaps), default=0.0),
        wait_for_arrays_s=phase_s.get("wait_for_arrays"),
        commit_lag_s=(commits[0].end_unix_s - snap_end) if commits else None,
        slowest_process=max(durables, key=lambda p: p.end_unix_s).process_index if durables else None,
        phase_s=phase_s,
    )


def _headline(step: int | None, s: StepSummary) -> str:
    lag = "-" if s.commit_lag_s is None else f"{s.commit_lag_s:.3f} s"
    wait = "" if s.wait_for_arrays_s is None else f"waited for the arrays {s.wait_for_arrays_s:.3f} s, then "
    return (f"step {step}: {wait}training blocked {s.blocking_s:.3f} s, commit lag {lag}, slowest process "
            f"{s.slowest_process}, {s.total_s:.3f} s in all")


def render_text(phases: Sequence[Phase], console, *, width: int = 60) -> None:
    """Prints one bar per process and step on a rich `console`, time running left to
    right from the step's first phase (each step on its own scale). The bar is at most
    `width` characters, fewer when the console is too narrow for it and the durations."""
    from rich.text import Text

    width = max(10, min(width, console.width - _TEXT_COLUMNS))

    legend = Text("phases: ")
    for name in PHASES:
        legend.append(f"{_CHAR[name]} {name}  ", style=_STYLE[name])
    console.print(legend)
    for step, every in _by_step(phases).items():
        ps = [p for p in every if p.drawable]
        odd = [p for p in every if not p.drawable]
        if not ps:
            console.print(Text(f"step {step}: no phase can be drawn"))
        else:
            _render_step(step, ps, console, width)
        for p in odd:
            console.print(Text(f"  step {step}, process {p.process_index}: {p.name} [{p.start_unix_s!r}, "
                               f"{p.end_unix_s!r}] cannot be drawn (not a wall-clock time between 1970 and 9999)"))


def _render_step(step: int | None, ps: Sequence[Phase], console, width: int) -> None:
    """One step's table: a bar per process of its (drawable) phases."""
    from rich.table import Table
    from rich.text import Text

    s = step_summary(ps)
    t0 = min(p.start_unix_s for p in ps)
    span = max(s.total_s, 1e-9)
    table = Table(title=_headline(step, s), title_justify="left", show_edge=False, pad_edge=False, box=None)
    table.add_column("process", justify="right", no_wrap=True)
    table.add_column(f"0 … {span:.3f} s", no_wrap=True)
    for name in PHASES:
        table.add_column(name, justify="right", no_wrap=True, style=_STYLE[name])
    for pidx in sorted({p.process_index for p in ps}):
        mine = [p for p in ps if p.process_index == pidx]
        cells = [" "] * width
        # A phase shorter than a cell still shows as one character: the longest are
        # drawn first, so a short snapshot between a long wait and write stays visible.
        for p in sorted(mine, key=lambda p: -p.duration_s):
            a = min(width - 1, int((p.start_unix_s - t0) / span * width))
            b = max(a + 1, min(width, int(round((p.end_unix_s - t0) / span * width))))
            for i in range(a, b):
                cells[i] = p.name
        bar = Text()
        for c in cells:
            bar.append(_CHAR[c] if c != " " else " ", style=_STYLE.get(c, ""))
        durations = {p.name: p.duration_s for p in mine}
        table.add_row(str(pidx), bar, *(f"{durations[n]:.3f}" if n in durations else "" for n in PHASES))
    console.print(table)


def render_png(phases: Sequence[Phase], out: str | os.PathLike, *, title: str | None = None) -> None:
    """Draws one panel per step (rows: processes; x: seconds from the step's first
    phase) into the PNG file `out`.

    Raises:
      ModuleNotFoundError: matplotlib is not installed (`pip install matplotlib`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    steps = {step: drawn for step, ps in _by_step(phases).items() if (drawn := [p for p in ps if p.drawable])}
    phases = [p for ps in steps.values() for p in ps]
    if not steps:
        raise ValueError("no save phases to draw (checkpoints written before timestamps were recorded have none)")
    n_proc = max(p.process_index for p in phases) + 1
    fig, axes = plt.subplots(len(steps), 1, figsize=(10, 0.6 + len(steps) * (0.5 + 0.35 * n_proc)), squeeze=False)
    for ax, (step, ps) in zip(axes[:, 0], steps.items()):
        t0 = min(p.start_unix_s for p in ps)
        for p in ps:
            ax.broken_barh([(p.start_unix_s - t0, max(p.duration_s, 1e-4))], (p.process_index - 0.4, 0.8),
                           facecolors=_COLOR[p.name])
        ax.set_title(_headline(step, step_summary(ps)), fontsize=9, loc="left")
        procs = sorted({p.process_index for p in ps})
        ax.set_yticks(procs, [f"process {i}" for i in procs], fontsize=8)
        ax.invert_yaxis()
        ax.tick_params(axis="x", labelsize=8)
    axes[-1, 0].set_xlabel("seconds from the save call")
    fig.legend(handles=[Patch(color=_COLOR[n], label=n) for n in PHASES], loc="lower center", ncol=len(PHASES),
               fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def timeline(
    location: str | os.PathLike,
    *,
    png: str | os.PathLike | None = None,
    last: int | None = None,
    console=None,
    width: int = 60,
) -> list[Phase]:
    """Prints where each save's time went and optionally draws it: `checkpointer timeline`.

    Args:
      location: a manager's directory (every committed step) or one checkpoint's path.
      png: also draw the timeline into this PNG file (needs matplotlib).
      last: only the newest `last` committed steps.
      console: a `rich.console.Console` to print on (default: a new one on stdout); the
        text is one bar per step and process, with each phase's seconds.
      width: characters per bar.
    Returns:
      The phases drawn (`Phase`: step, process_index, name, start/end unix seconds).
    Raises:
      CheckpointNotFoundError: no checkpoint and no committed steps at `location`.
      ModuleNotFoundError: `png` given and matplotlib is not installed.

    Multi-process: call it from one process (it reads every process's record).
    """
    phases = read_timeline(location, last=last)
    if console is None:
        from rich.console import Console

        console = Console()
        if not console.is_terminal and "COLUMNS" not in os.environ:  # a pipe or a log file
            console = Console(width=_TEXT_COLUMNS + width)
    if png is not None and phases:
        render_png(phases, png, title=f"checkpointer timeline {location}")
    if phases:
        render_text(phases, console, width=width)
    else:
        console.print(f"{location}: no save phases recorded (saved by a version without timestamps)")
    return phases
