"""A manager's directory: step folders, crashed saves, and their cleanup.

```
DIR/<step>/                      committed iff <step>/COMMITTED exists; retired (hidden,
                                 kept for the chunks newer steps reference) iff
                                 <step>/RETIRED exists too (`retire_step`)
DIR/<step>.partial-<generation>/ a save in flight or a crashed one (POSIX)
DIR/<step>.deleting-<generation>/ an old copy being replaced (force=True, POSIX)
DIR/.checkpointer-gc.json        object stores: when recovery first saw each
                                 marker-less <step>/ unchanged (see `recover`)
DIR/.checkpointer-journal.jsonl  the after-commit phases of each save (`_timeline`)
DIR/.checkpointer-finished.json  the writer closed with finished=True (`_manage/_follow`)
```
On object stores a save writes `<step>/` directly, so a `<step>/` without marker is a
save in flight or a crashed one, and nothing tells the two apart but time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Sequence

from .. import _format
from .._errors import CheckpointError
from .._format import is_step_name
from .._storage import Storage
from . import _catalog, _strategies

log = logging.getLogger("checkpointer")

# Object stores: a marker-less <step>/ is removed once recovery has seen it unchanged
# for this long. Far longer than a save takes to commit after its last object lands
# (the default commit timeout is 60 s), so a live save is never removed under itself.
OBJECT_STORE_GC_GRACE_S = 3600.0
GC_JOURNAL = ".checkpointer-gc.json"
LOCK_NAME = ".checkpointer.lock"  # the writer's directory lock (POSIX)
SAVE_JOURNAL = ".checkpointer-journal.jsonl"  # after-commit phases of each save (`_timeline`)
FINISHED_NAME = ".checkpointer-finished.json"  # the run is over (`close(finished=True)`, `_manage/_follow`)
_OWN_FILES = frozenset({GC_JOURNAL, LOCK_NAME, SAVE_JOURNAL, FINISHED_NAME, _catalog.CATALOG})


@dataclasses.dataclass(frozen=True)
class StepEntry:
    """One folder of a directory.

    Attributes:
      name: the folder name.
      step: the step it belongs to.
      committed: whether it holds a commit marker.
      generation: the save attempt, for partial folders.
      retired: a committed `<step>/` with a `RETIRED` marker: no step any more, kept
        only for the chunks newer steps reference (`retire_step`).
    """

    name: str
    step: int
    committed: bool
    generation: str | None
    retired: bool = False


# Process 0 of a save holds an flock on `<partial folder>.lock` while it writes (POSIX),
# so recovery and gc in other processes tell a save in flight from a crashed one.
SAVE_LOCK_SUFFIX = ".lock"


def _step_folder(name: str) -> tuple[int, str | None, bool] | None:
    """(step, generation, being deleted) of a step folder's name: `<step>`,
    `<step>.partial-<generation>` or `<step>.deleting-<generation>`; None for any other name."""
    if is_step_name(name):
        return int(name), None, False
    partial = _format.parse_partial_name(name)
    if partial and is_step_name(partial[0]):
        return int(partial[0]), partial[1], False
    deleting = _format.parse_deleting_name(name)
    if deleting and is_step_name(deleting[0]):
        return int(deleting[0]), deleting[1], True
    return None


def entries(storage: Storage, directory: str, names: Sequence[str] | None = None) -> list[StepEntry]:
    """Every step folder (committed, partial, being deleted), sorted by step then name.

    Reads the commit marker of each step and partial folder; `names` is the listing of
    `directory` when the caller has it already (else it is listed here).
    """
    out = []
    for name in storage.list_dir(directory) if names is None else names:
        folder = _step_folder(name)
        if folder is None:
            continue
        step, generation, deleting = folder
        committed = not deleting and storage.exists(f"{directory}/{name}/{_format.COMMITTED}")
        retired = committed and generation is None and storage.exists(f"{directory}/{name}/{_format.RETIRED}")
        out.append(StepEntry(name, step, committed, generation, retired))
    return sorted(out, key=lambda e: (e.step, e.name))


def foreign_entries(storage: Storage, directory: str, names: Sequence[str] | None = None) -> list[str]:
    """Names in `directory` that are neither step folders (canonical names, their
    partial and deleting folders) nor the library's own files: readers ignore them and
    nothing deletes them. By name alone (no marker is read); `names` as for `entries`."""
    names = storage.list_dir(directory) if names is None else names
    return [n for n in names if _step_folder(n) is None and n not in _OWN_FILES and not _is_save_lock_name(n)]


def _is_save_lock_name(name: str) -> bool:
    """`<step>.partial-<generation>.lock` of a canonical step (a save's own lock file)."""
    if not name.endswith(SAVE_LOCK_SUFFIX):
        return False
    partial = _format.parse_partial_name(name[: -len(SAVE_LOCK_SUFFIX)])
    return partial is not None and is_step_name(partial[0])


def committed_folders(storage: Storage, directory: str) -> dict[int, str]:
    """Step → folder name of every committed step, ascending by step.

    A step's folder is `<step>/` when that holds the marker. A save that crashed after
    writing its marker but before the rename that publishes it (POSIX) leaves a
    committed `<step>.partial-<generation>/` and no committed `<step>/`: the marker is
    the truth, so that step is committed and read from the partial folder until the
    writer's recovery renames it into place (readers never rename or delete). A
    committed partial folder whose save still holds its lock (`<partial>.lock`) is a
    save between its marker and its rename, published in a moment: not listed, so no
    reader starts reading a folder that is about to move.

    Stores that write in place (object stores) read the step catalog when the directory
    has one (see `_catalog`): O(steps) requests instead of listing every object.
    """
    steps = _catalog.committed_steps(storage, directory)
    if steps is not None:
        return {s: str(s) for s in steps}
    out: dict[int, str] = {}
    for e in entries(storage, directory):  # sorted: `<step>` before its partial folders
        if not e.committed or e.retired:
            continue
        if e.generation is None:
            out[e.step] = e.name
        elif _format.parse_partial_name(e.name) and (e.step not in out or out[e.step] != str(e.step)):
            if storage.lock_holder(f"{directory}/{e.name}{SAVE_LOCK_SUFFIX}") is None:  # crashed, not in flight
                out[e.step] = e.name  # the newest committed partial of a step without `<step>/`
    return dict(sorted(out.items()))


def committed_steps(storage: Storage, directory: str) -> list[int]:
    """The committed steps, ascending. Never a step whose folder lacks the marker."""
    return list(committed_folders(storage, directory))


def plan_recovery(
    storage: Storage,
    directory: str,
    *,
    live_generations: frozenset = frozenset(),
    live_steps: frozenset = frozenset(),
    grace_s: float | None = None,
    now: float | None = None,
) -> list[tuple[str, str]]:
    """What `recover` would do, without doing it: `(folder, "remove" | "roll forward")`.

    Arguments as for `recover`. Marker-less `<step>/` folders of an object store that
    are not yet due (see `recover`) are not listed.
    """
    return [(name, action) for name, action, _ in _plan(storage, directory, live_generations, live_steps, grace_s, now)[0]]


def recover(
    storage: Storage,
    directory: str,
    *,
    live_generations: frozenset = frozenset(),
    live_steps: frozenset = frozenset(),
    grace_s: float | None = None,
    now: float | None = None,
) -> list[str]:
    """Cleans up after crashed saves; call from one process (on POSIX, while no other
    save runs: the manager holds the directory lock).

    - a `<step>.partial-<g>` folder that holds a commit marker and whose `<step>/` is
      absent was committed but not yet renamed (a crash between the two renames of a
      `force=True` replacement): it is renamed into place;
    - any other `.partial-*` folder whose generation is not in `live_generations`, and
      every `.deleting-*` folder, is removed;
    - object stores (no rename, no directory lock): a `<step>/` without commit marker
      is a save in flight (maybe another job's, or a preempted job's still uploading)
      or a crashed one. It is removed only if its step is not in `live_steps` and
      recovery has seen it *unchanged* (the same object keys) for at least `grace_s`
      seconds (default `OBJECT_STORE_GC_GRACE_S`, one hour). First sightings are kept
      in `DIR/.checkpointer-gc.json`; a folder that gained or lost objects since is
      seen anew. So the first recovery that meets a crashed save only notes it, and a
      later one (a manager's next first save, `checkpointer gc`) removes it. `grace_s=0`
      removes every such folder at once (for a caller that knows nothing else writes
      the directory).

    Args:
      live_generations: partial folders of saves in flight (POSIX), kept.
      live_steps: steps being saved by the caller, kept (object stores).
      grace_s: object stores: how long a marker-less `<step>/` must stay unchanged.
      now: the current time (seconds since the epoch), for tests.
    Returns:
      The folder names removed or renamed.
    """
    actions, journal, old_journal = _plan(storage, directory, live_generations, live_steps, grace_s, now)
    done = []
    for name, action, step in actions:
        path = f"{directory}/{name}"
        if action == "roll forward":
            storage.rename(path, f"{directory}/{step}")
            log.warning("rolled forward %s: it was committed but not yet renamed", path)
        else:
            storage.delete_tree(path)
            log.info("removed %s (left by a crashed or replaced save)", path)
        done.append(name)
    if storage.supports_locks:
        # Lock files of saves that are over (crashed: the kernel dropped their lock).
        names = set(storage.list_dir(directory))
        for name in names:
            folder = name[: -len(SAVE_LOCK_SUFFIX)]
            if _is_save_lock_name(name) and folder not in names and storage.lock_holder(f"{directory}/{name}") is None:
                storage.delete_file(f"{directory}/{name}")
    if journal != old_journal:
        if journal:
            storage.write_file(f"{directory}/{GC_JOURNAL}", _format.dumps(journal))
        else:
            storage.delete_file(f"{directory}/{GC_JOURNAL}")
    return done


def _plan(storage: Storage, directory: str, live_generations, live_steps, grace_s, now):
    """Returns (actions [(name, action, step)], new journal, old journal)."""
    actions = []
    found = entries(storage, directory)
    existing = {e.step for e in found if e.committed and e.generation is None}
    for e in found:
        if e.generation is None or e.generation in live_generations:
            continue
        if ".partial-" in e.name and storage.lock_holder(f"{directory}/{e.name}{SAVE_LOCK_SUFFIX}") is not None:
            continue  # a save in flight (its process 0 holds the lock): not ours to touch
        if e.committed and e.step not in existing and storage.supports_rename and ".partial-" in e.name:
            existing.add(e.step)
            actions.append((e.name, "roll forward", e.step))
        else:
            actions.append((e.name, "remove", e.step))
    if not _strategies.strategy_for(storage).writes_in_place:
        return actions, {}, {}
    # Object stores: marker-less <step>/ folders, by the journal of first sightings.
    grace_s = OBJECT_STORE_GC_GRACE_S if grace_s is None else float(grace_s)
    now = time.time() if now is None else float(now)
    old_journal = _read_journal(storage, directory)
    journal = {}
    for e in found:
        if e.generation is not None or e.committed or e.step in live_steps:
            continue
        keys = storage.list_files(f"{directory}/{e.name}")
        if not keys:
            continue
        digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:32]
        fingerprint = f"{len(keys)}:{digest}"
        seen = old_journal.get(e.name)
        if not (isinstance(seen, dict) and seen.get("fingerprint") == fingerprint
                and isinstance(seen.get("unchanged_since_unix_s"), (int, float))):
            seen = {"unchanged_since_unix_s": now, "fingerprint": fingerprint}
        if grace_s <= 0 or now - seen["unchanged_since_unix_s"] >= grace_s:
            actions.append((e.name, "remove", e.step))
        else:
            journal[e.name] = seen
            log.info(
                "%s/%s has no commit marker: a save in flight or a crashed one; removed once unchanged for %.0f s",
                directory, e.name, grace_s,
            )
    return actions, journal, old_journal


def _read_journal(storage: Storage, directory: str) -> dict:
    try:
        journal = _format.loads(storage.read_file(f"{directory}/{GC_JOURNAL}"), GC_JOURNAL)
    except FileNotFoundError:
        return {}
    except CheckpointError:  # unreadable: start afresh, which only delays removals
        log.warning("ignoring malformed %s/%s", directory, GC_JOURNAL)
        return {}
    return journal if isinstance(journal, dict) else {}


def unpublish_step(storage: Storage, directory: str, step: int) -> str:
    """Makes a committed step vanish from listings at once; returns what is left to remove.

    On POSIX the step folder is renamed to `<step>.deleting-gc-<id>` (atomic); on object
    stores its marker is deleted (see `CommitStrategy.unpublish`).
    """
    moved = _strategies.strategy_for(storage).unpublish(f"{directory}/{step}")
    _catalog.remove_entry(storage, directory, step)  # after the marker, before the objects
    return moved


def retire_step(storage: Storage, directory: str, step: int, referenced_by: Sequence[int]) -> None:
    """Hides committed `step` from every listing for good, keeping its files: its chunks
    are still read by the steps `referenced_by` (incremental saves). Its catalog entry
    goes first (object stores), then the `RETIRED` marker is written (one atomic write):
    a crash between the two leaves a whole step that only the catalog does not list
    until `repair` adds it back. Retention then removes the chunks nobody references
    (`_manage._maintenance`).

    Multi-process: the writer (process 0) only.
    """
    _catalog.remove_entry(storage, directory, step)
    content = {"retired_unix_s": time.time(), "referenced_by": sorted(int(s) for s in referenced_by)}
    storage.write_file(f"{directory}/{step}/{_format.RETIRED}", _format.dumps(content))


def retired_folders(storage: Storage, directory: str) -> dict[int, str]:
    """Step -> folder of every retired step (one full listing), ascending."""
    return {e.step: e.name for e in entries(storage, directory) if e.retired}


def delete_step(storage: Storage, directory: str, step: int) -> None:
    """Deletes a committed step: unpublished first, then removed."""
    storage.delete_tree(unpublish_step(storage, directory, step))


def repair(storage: Storage, directory: str) -> tuple[list[int], list[int]]:
    """Makes DIR's catalog match the markers, from one full listing; creates the catalog.

    Returns:
      (steps whose entry was added, steps whose entry was removed).

    Multi-process: the writer (process 0) only, while none of its saves is in flight.
    """
    if not _catalog.uses_catalog(storage):
        return [], []
    # The catalog first, then the folders: an entry seen here was written after its
    # step's objects, so the full listing sees that folder and a save committing
    # meanwhile (`checkpointer gc` beside a live writer) does not lose its entry.
    listed = set(_catalog.catalog_steps(storage, directory, complete_only=False) or ())
    found = entries(storage, directory)
    committed = {e.step for e in found if e.committed and e.generation is None and not e.retired}
    folders = {e.step for e in found if e.generation is None}
    added = sorted(committed - listed)
    removed = sorted(s for s in listed if s not in folders)
    for step in added:
        entry = {"step": step, "generation": None, "written_unix_s": time.time(), "repaired": True}
        storage.write_file(f"{directory}/{_catalog.CATALOG}/{step}", _format.dumps(entry))
    for step in removed:
        storage.delete_file(f"{directory}/{_catalog.CATALOG}/{step}")
    try:
        storage.read_file(f"{directory}/{_catalog.CATALOG}/{_catalog.HEADER}")
    except FileNotFoundError:
        header = {"catalog_version": _catalog.CATALOG_VERSION, "created_unix_s": time.time()}
        storage.write_file(f"{directory}/{_catalog.CATALOG}/{_catalog.HEADER}", _format.dumps(header))
    except (OSError, CheckpointError) as e:
        log.warning("cannot read %s/%s/%s: %s", directory, _catalog.CATALOG, _catalog.HEADER, e)
    if added or removed:
        log.info("step catalog of %s: added %s, removed %s", directory, added, removed)
    return added, removed
