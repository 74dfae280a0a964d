"""A manager's directory: step folders, crashed saves, and their cleanup.

```
DIR/<step>/                      committed iff <step>/COMMITTED exists
DIR/<step>.partial-<generation>/ a save in flight or a crashed one (POSIX)
DIR/<step>.deleting-<generation>/ an old copy being replaced (force=True, POSIX)
DIR/.checkpointer-gc.json        object stores: when recovery first saw each
                                 marker-less <step>/ unchanged (see `recover`)
```
On object stores a save writes `<step>/` directly, so a `<step>/` without marker is a
save in flight or a crashed one, and nothing tells the two apart but time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import uuid

from . import _catalog, _format
from ._errors import CheckpointError
from ._storage import Storage

log = logging.getLogger("checkpointer")

# Object stores: a marker-less <step>/ is removed once recovery has seen it unchanged
# for this long. Far longer than a save takes to commit after its last object lands
# (the default commit timeout is 600 s), so a live save is never removed under itself.
OBJECT_STORE_GC_GRACE_S = 3600.0
GC_JOURNAL = ".checkpointer-gc.json"


@dataclasses.dataclass(frozen=True)
class StepEntry:
    """One folder of a directory.

    Attributes:
      name: the folder name.
      step: the step it belongs to.
      committed: whether it holds a commit marker.
      generation: the save attempt, for partial folders.
    """

    name: str
    step: int
    committed: bool
    generation: str | None


# Process 0 of a save holds an flock on `<partial folder>.lock` while it writes (POSIX),
# so recovery and gc in other processes tell a save in flight from a crashed one.
SAVE_LOCK_SUFFIX = ".lock"


def _is_step_name(name: str) -> bool:
    """ASCII digits only: '²' or '٣' pass str.isdigit() but are not step numbers."""
    return name.isascii() and name.isdigit()


def entries(storage: Storage, directory: str) -> list[StepEntry]:
    """Every step folder (committed, partial, being deleted), sorted by step then name."""
    out = []
    for name in storage.list_dir(directory):
        partial = _format.parse_partial_name(name)
        if _is_step_name(name):
            out.append(StepEntry(name, int(name), storage.exists(f"{directory}/{name}/{_format.COMMITTED}"), None))
        elif partial and _is_step_name(partial[0]):
            committed = storage.exists(f"{directory}/{name}/{_format.COMMITTED}")
            out.append(StepEntry(name, int(partial[0]), committed, partial[1]))
        elif ".deleting-" in name and _is_step_name(name.split(".deleting-")[0]):
            out.append(StepEntry(name, int(name.split(".deleting-")[0]), False, name.split(".deleting-")[1]))
    return sorted(out, key=lambda e: (e.step, e.name))


def committed_steps(storage: Storage, directory: str) -> list[int]:
    """The committed steps, ascending. Never a step whose folder lacks the marker.

    Object stores read the step catalog when the directory has one (see `_catalog`).
    """
    steps = _catalog.committed_steps(storage, directory)
    if steps is not None:
        return steps
    return sorted({e.step for e in entries(storage, directory) if e.committed and e.generation is None})


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
      later one (the next manager start, `checkpointer gc`) removes it. `grace_s=0`
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
    if storage.supports_rename:
        # Lock files of saves that are over (crashed: the kernel dropped their lock).
        names = set(storage.list_dir(directory))
        for name in names:
            folder = name[: -len(SAVE_LOCK_SUFFIX)]
            if name.endswith(SAVE_LOCK_SUFFIX) and ".partial-" in name and folder not in names:
                if not storage.lock_is_held(f"{directory}/{name}"):
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
    existing = set(committed_steps(storage, directory))
    found = entries(storage, directory)
    for e in found:
        if e.generation is None or e.generation in live_generations:
            continue
        if ".partial-" in e.name and storage.lock_is_held(f"{directory}/{e.name}{SAVE_LOCK_SUFFIX}"):
            continue  # a save in flight (its process 0 holds the lock): not ours to touch
        if e.committed and e.step not in existing and storage.supports_rename and ".partial-" in e.name:
            existing.add(e.step)
            actions.append((e.name, "roll forward", e.step))
        else:
            actions.append((e.name, "remove", e.step))
    if storage.supports_rename:
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

    On POSIX the step folder is renamed to `<step>.deleting-gc` (atomic); on object
    stores its marker is deleted. Either way a crash before the removal leaves nothing
    that looks committed, and recovery removes the rest.
    """
    path = f"{directory}/{step}"
    if storage.supports_rename:
        moved = f"{directory}/{step}.deleting-gc-{uuid.uuid4().hex[:8]}"
        storage.rename(path, moved)
        return moved
    storage.delete_file(f"{path}/{_format.COMMITTED}")
    _catalog.remove_entry(storage, directory, step)  # after the marker, before the objects
    return path


def delete_step(storage: Storage, directory: str, step: int) -> None:
    """Deletes a committed step: unpublished first, then removed."""
    storage.delete_tree(unpublish_step(storage, directory, step))
