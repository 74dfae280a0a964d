"""What an operator's probe asks a directory in use: how far behind is the newest
committed step, and did a save fail (`checkpointer status`, `read_status`).

The writing manager notes two things in the directory's journal
(`DIR/.checkpointer-journal.jsonl`, beside the save phases `_timeline` reads; one JSON
object a line, `"event"` naming the kind):

```
{"event": "save_requested", "step": 120, "unix_s": ...}   process 0, when a save starts
                                                           (after its snapshot), unless the
                                                           last note is younger than
                                                           REQUESTED_EVERY_S seconds and
                                                           its step not yet committed
{"event": "save_failed", "step": 121, "process_index": 3, "error": "CommitTimeoutError: ...", "unix_s": ...}
                                                           each failed save, by the process it failed on
```
Notes are diagnostics: never fsynced, a failure to write one is logged, never raised.
On object stores the journal is rewritten whole, so a note written by two processes at
once may lose one of them (process 0 also fails a save another process failed, and
notes it). `read_status` takes no lock: it lists the directory, reads the newest
manifest and the journal's last `TAIL_BYTES`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import _commit, _coord, _format, _tools
from .._commit import SAVE_JOURNAL
from .._errors import CheckpointError, CheckpointNotFoundError
from .._storage import Storage, storage_for
from . import _events

if TYPE_CHECKING:
    from .._save import Snapshot

log = logging.getLogger("checkpointer")

REQUESTED_EVERY_S = 10.0
TAIL_BYTES = 1 << 20
MAX_ERROR_CHARS = 2000
REQUESTED, FAILED = "save_requested", "save_failed"
PEER_COPIES = "peer_copies"  # a process's local step and how many peers hold a checked copy


class RunJournal:
    """A writing manager's notes in its directory's journal (see the module).

    Args:
      storage, directory: the manager's directory.
      is_primary: process 0 (notes the requested steps).
      submit: runs a note off the training thread (the manager's deleter thread).
    """

    def __init__(self, storage: Storage, directory: str, *, is_primary: bool,
                 submit: Callable[[Callable[[], None]], object]) -> None:
        self.storage, self.directory = storage, directory
        self.is_primary = is_primary
        self._submit = submit
        self._mu = threading.Lock()
        self._noted_unix_s: float | None = None
        self._noted_step: int | None = None
        self._committed_step: int | None = None

    def requested(self, step: int, *, now_unix_s: float | None = None) -> None:
        """A save of `step` started: noted when the last note is `REQUESTED_EVERY_S` old,
        or when the step it carries has committed since (so that the journal always
        carries a step in flight: a probe's commit lag counts it, as `status()` does;
        saves that commit before the next starts are each noted, once)."""
        if not self.is_primary:
            return
        now = time.time() if now_unix_s is None else now_unix_s
        with self._mu:
            stale = self._noted_step is not None and self._committed_step is not None and self._noted_step <= self._committed_step
            if self._noted_unix_s is not None and now - self._noted_unix_s < REQUESTED_EVERY_S and not stale:
                return
            self._noted_unix_s, self._noted_step = now, int(step)
        entry = {"event": REQUESTED, "step": int(step), "unix_s": round(now, 6)}
        try:
            self._submit(lambda: _tools.append_journal_line(self.storage, self.directory, entry, replaces=REQUESTED))
        except RuntimeError:  # the manager is closing: note it here
            _tools.append_journal_line(self.storage, self.directory, entry, replaces=REQUESTED)

    def save_over(self, step: int, snap: Snapshot, *, commit_lag_s: float | None, commit_lag_steps: int,
                  error: BaseException | None) -> None:
        """A save of the manager is over: its failure noted, or its figures recorded as
        `jax.monitoring` events (`_events`)."""
        if error is not None:
            self.failed(step, error)
            return
        with self._mu:
            self._committed_step = step if self._committed_step is None else max(self._committed_step, step)
        durable = snap.result.phases_unix_s.get("durable")
        _events.save_committed(write_s=snap.result.write_s, commit_s=None if durable is None else time.time() - durable[1],
                               commit_lag_s=commit_lag_s, commit_lag_steps=commit_lag_steps,
                               bytes_written=snap.result.bytes_written)

    def failed(self, step: int | None, error: BaseException) -> None:
        """A save of `step` failed on this process: noted now, and a `jax.monitoring` event."""
        _events.save_failed()
        text = " ".join(f"{type(error).__name__}: {error}".split())[:MAX_ERROR_CHARS]
        entry = {"event": FAILED, "step": step, "process_index": _coord.process_index(), "error": text,
                 "unix_s": round(time.time(), 6)}
        _tools.append_journal_line(self.storage, self.directory, entry)


def note_peer_copies(storage: Storage, directory: str, step: int, copies_checked: int, kept: list[int]) -> None:
    """Notes in the journal how many checked peer copies this process's share of local
    `step` has, and the local steps it keeps now (`checkpointer status` reports per step
    still kept the fewest over the processes)."""
    entry = {"event": PEER_COPIES, "step": int(step), "process_index": _coord.process_index(),
             "process_count": _coord.process_count(), "copies_checked": int(copies_checked),
             "kept": [int(s) for s in kept], "unix_s": round(time.time(), 6)}
    _tools.append_journal_line(storage, directory, entry)


@dataclasses.dataclass(frozen=True)
class SaveFailure:
    """One failed save, as the journal noted it.

    Attributes:
      step: the step (None for a save without one).
      process_index: the process it failed on.
      error: the error, as text (type: message).
      unix_s: when it was noted, seconds since the epoch.
    """

    step: int | None
    process_index: int | None
    error: str
    unix_s: float


@dataclasses.dataclass(frozen=True)
class DirectoryStatus:
    """A manager's directory as a probe sees it (`read_status`, `checkpointer status`).

    Attributes:
      directory: the directory read.
      latest_committed_step: the newest committed step, or None.
      latest_created_unix_s: its manifest's creation time, or None.
      latest_age_s: seconds since then (None without a committed step).
      step_in_flight: the newest step being saved (POSIX: a partial folder whose save
        holds its lock; object stores: a newer `<step>/` without marker), or None.
      last_requested_step: the newest step the writer noted handing to `save`, or None.
        Noted when a save starts (written off the training thread, moments later),
        except that while the last noted step is still in flight a newer one is noted at
        most every `REQUESTED_EVERY_S` (10) seconds: so it may be up to 10 s behind the
        job, never behind a step still in flight.
      commit_lag_steps: the newer of `last_requested_step` and `step_in_flight`, minus
        `latest_committed_step` (0 when not behind; None when neither is known): the
        job's `CheckpointManager.status().commit_lag_steps`, counting a save in flight,
        as of the last note (at most 10 s old while saves pile up) and the listing.
      last_failure: the newest failed save noted, or None.
      failing: `last_failure` is newer than the newest committed step (no save has
        committed since).
      node_losses_survived: local steps newer than the newest committed (durable) step
        → how many node losses each survives: the fewest checked peer copies of any
        process's share, as the processes noted them (`peer_copies=`; 0 until every
        process noted one). Empty without peer copies.
    """

    directory: str
    latest_committed_step: int | None
    latest_created_unix_s: float | None
    latest_age_s: float | None
    step_in_flight: int | None
    last_requested_step: int | None
    commit_lag_steps: int | None
    last_failure: SaveFailure | None
    failing: bool
    node_losses_survived: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def newest_step(self) -> int | None:
        """The newest step the writer handed to `save` or has in flight (the lag's)."""
        return max((s for s in (self.last_requested_step, self.step_in_flight) if s is not None), default=None)

    def problems(self, *, max_lag_steps: int | None = None, max_age_s: float | None = None) -> list[str]:
        """What an alert should say: the bounds crossed and a failing save ([] when ok)."""
        out = []
        if max_lag_steps is not None and self.commit_lag_steps is not None and self.commit_lag_steps > max_lag_steps:
            out.append(f"commit lag {self.commit_lag_steps} steps > --max-lag-steps {max_lag_steps} (step "
                       f"{self.newest_step} handed to save, {self.latest_committed_step} committed)")
        if max_age_s is not None:
            if self.latest_age_s is None:
                out.append(f"no committed step in {self.directory} (--max-age-s {max_age_s:g})")
            elif self.latest_age_s > max_age_s:
                out.append(f"the newest committed step {self.latest_committed_step} is {self.latest_age_s:.0f} s old "
                           f"> --max-age-s {max_age_s:g}")
        if self.failing and self.last_failure is not None:
            f = self.last_failure
            out.append(f"the save of step {f.step} failed on process {f.process_index}: {f.error}")
        return out

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _journal_tail(storage: Storage, directory: str) -> list[dict]:
    """The journal's last `TAIL_BYTES` as objects (lines that do not parse skipped)."""
    path = f"{directory}/{SAVE_JOURNAL}"
    try:
        size = storage.size(path)
        if size <= 0:
            return []
        start = max(0, size - TAIL_BYTES)
        data = storage.read_range(path, start, size - start)
    except (FileNotFoundError, CheckpointNotFoundError):
        return []
    lines = data.decode(errors="replace").splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # cut inside
    out = []
    for n, line in enumerate(lines):
        try:
            entry = _format.load_json(line, what=f"{path} line {n + 1}")
        except ValueError:  # CorruptCheckpointError: a line being written, or damaged
            continue
        if isinstance(entry, dict) and isinstance(entry.get("event"), str):
            out.append(entry)
    return out


def _number(v: object) -> float | None:
    return _format.finite_number(v)


def _step(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _in_flight(storage: Storage, directory: str, names: list[str], latest: int | None) -> int | None:
    steps = []
    for e in _commit.entries(storage, directory, names):
        if e.committed or _format.parse_deleting_name(e.name):
            continue
        if e.generation is None:  # object stores: a `<step>/` not yet committed
            if latest is None or e.step > latest:
                steps.append(e.step)
        elif storage.lock_holder(f"{directory}/{e.name}{_commit.SAVE_LOCK_SUFFIX}") is not None:
            steps.append(e.step)  # its process 0 holds the save's lock: not a crashed one
    return max(steps) if steps else None


def read_status(location: str | os.PathLike, *, now_unix_s: float | None = None) -> DirectoryStatus:
    """The state of a manager's directory, for a probe (see `DirectoryStatus`).

    Reads without any lock beside a running writer: one listing, the newest step's
    manifest, the journal's tail. What a probe can know is what the directory holds:
    the committed steps, the saves in flight (a partial step folder whose save holds
    its lock; on object stores a newer step without its marker), and what the writer's
    process 0 noted in the journal (the step it last handed to `save`, the failed
    saves). Its commit lag agrees with the job's `status()` as of the writer's last
    note: at most `REQUESTED_EVERY_S` (10) seconds stale while saves pile up, and never
    missing a save in flight. Steps handed to `save` that a manager skipped or that
    are still waiting for the snapshot are not known to it.

    Args:
      location: a manager's directory (local path or URL).
      now_unix_s: the time now, seconds since the epoch (for tests).
    Returns:
      A `DirectoryStatus`.
    Raises:
      FileNotFoundError: `location` does not exist.
      NotADirectoryError: it is a file.
      OSError: it cannot be listed or read.
      CheckpointError: it is one checkpoint, not a directory of steps.

    Multi-process: any process (or none of the job's) may call it alone.
    """
    storage, directory = storage_for(location)
    if storage.supports_locks:  # a local path: tell an absent one from an empty one
        if not os.path.exists(directory):
            raise FileNotFoundError(f"{directory} does not exist")
        if not os.path.isdir(directory):
            raise NotADirectoryError(f"{directory} is not a directory")
    names = storage.list_dir(directory)
    if not names and not storage.is_folder(directory) and not storage.supports_locks:
        raise FileNotFoundError(f"{directory} holds nothing: not a manager's directory")
    if _format.COMMITTED in names:
        raise CheckpointError(f"{directory} is one checkpoint, not a manager's directory of steps; pass its parent")
    folders = _commit.committed_folders(storage, directory)
    latest = max(folders) if folders else None
    created: float | None = None
    if latest is not None:
        try:
            created = _format.read_metadata(storage, f"{directory}/{folders[latest]}").created_unix_s or None
        except CheckpointError as e:
            log.warning("cannot read the manifest of step %d in %s: %s", latest, directory, e)
    now = time.time() if now_unix_s is None else now_unix_s
    requested: int | None = None
    failure: SaveFailure | None = None
    copies: dict[int, dict[int, int]] = {}  # step → process → checked copies
    counts: dict[int, int] = {}  # step → process count
    kept: dict[int, set[int]] = {}  # process → the local steps its newest note says it keeps
    for entry in _journal_tail(storage, directory):
        if entry["event"] == PEER_COPIES and _step(entry.get("step")) is not None:
            step_, proc, n = _step(entry.get("step")), _step(entry.get("process_index")), _step(entry.get("copies_checked"))
            count = _step(entry.get("process_count"))
            if step_ is not None and proc is not None and n is not None and count:
                copies.setdefault(step_, {})[proc] = n
                counts[step_] = count
                if isinstance(entry.get("kept"), list):
                    kept[proc] = {s for s in entry["kept"] if _step(s) is not None}
            continue
        if entry["event"] == REQUESTED and _step(entry.get("step")) is not None:
            requested = _step(entry.get("step"))
        elif entry["event"] == FAILED:
            failure = SaveFailure(_step(entry.get("step")), _step(entry.get("process_index")), str(entry.get("error")),
                                  _number(entry.get("unix_s")) or 0.0)
    in_flight = _in_flight(storage, directory, names, latest)
    newest = max((s for s in (requested, in_flight) if s is not None), default=None)
    if newest is None:
        lag = None
    else:
        lag = newest if latest is None else max(0, newest - latest)
    failing = failure is not None and (created is None or failure.unix_s > created)
    survived = {s: min(copies[s].get(p, 0) for p in range(counts[s])) for s in sorted(copies)
                if (latest is None or s > latest) and all(s in k for k in kept.values())}
    return DirectoryStatus(
        directory=directory, latest_committed_step=latest, latest_created_unix_s=created,
        latest_age_s=None if created is None else max(0.0, now - created), step_in_flight=in_flight,
        last_requested_step=requested, commit_lag_steps=lag, last_failure=failure, failing=failing,
        node_losses_survived=survived,
    )
