"""A manager's directory: step folders, crashed saves, and their cleanup.

```
DIR/<step>/                      committed iff <step>/COMMITTED exists
DIR/<step>.partial-<generation>/ a save in flight or a crashed one
DIR/<step>.deleting-<generation>/ an old copy being replaced (force=True)
```
"""

from __future__ import annotations

import dataclasses
import logging

from . import _format
from ._storage import Storage

log = logging.getLogger("checkpointer")


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


def entries(storage: Storage, directory: str) -> list[StepEntry]:
    """Every step folder (committed, partial, being deleted), sorted by step then name."""
    out = []
    for name in storage.list_dir(directory):
        partial = _format.parse_partial_name(name)
        if name.isdigit():
            out.append(StepEntry(name, int(name), storage.exists(f"{directory}/{name}/{_format.COMMITTED}"), None))
        elif partial and partial[0].isdigit():
            committed = storage.exists(f"{directory}/{name}/{_format.COMMITTED}")
            out.append(StepEntry(name, int(partial[0]), committed, partial[1]))
        elif ".deleting-" in name and name.split(".deleting-")[0].isdigit():
            out.append(StepEntry(name, int(name.split(".deleting-")[0]), False, name.split(".deleting-")[1]))
    return sorted(out, key=lambda e: (e.step, e.name))


def committed_steps(storage: Storage, directory: str) -> list[int]:
    """The committed steps, ascending. Never a step whose folder lacks the marker."""
    return sorted({e.step for e in entries(storage, directory) if e.committed and e.generation is None})


def recover(storage: Storage, directory: str, *, live_generations: frozenset = frozenset()) -> list[str]:
    """Cleans up after crashed saves; call from one process while no other save runs.

    - a `<step>.partial-<g>` folder that holds a commit marker and whose `<step>/` is
      absent was committed but not yet renamed (a crash between the two renames of a
      `force=True` replacement): it is renamed into place;
    - any other `.partial-*` folder whose generation is not in `live_generations`, and
      every `.deleting-*` folder, is removed.

    Returns:
      The folder names removed or renamed.
    """
    done = []
    existing = set(committed_steps(storage, directory))
    for e in entries(storage, directory):
        if e.generation is None or e.generation in live_generations:
            continue
        path = f"{directory}/{e.name}"
        if e.committed and e.step not in existing and storage.supports_rename and ".partial-" in e.name:
            storage.rename(path, f"{directory}/{e.step}")
            existing.add(e.step)
            log.warning("rolled forward %s: it was committed but not yet renamed", path)
        else:
            storage.delete_tree(path)
            log.info("removed %s (left by a crashed or replaced save)", path)
        done.append(e.name)
    return done


def delete_step(storage: Storage, directory: str, step: int) -> None:
    """Deletes a committed step: the marker goes first, so a crash midway leaves no
    half-deleted checkpoint that looks committed."""
    path = f"{directory}/{step}"
    if storage.supports_rename:
        # Rename away first: the step vanishes from listings atomically.
        tmp = f"{directory}/{step}.deleting-gc"
        storage.rename(path, tmp)
        storage.delete_tree(tmp)
    else:
        storage.delete_file(f"{path}/{_format.COMMITTED}")
        storage.delete_tree(path)
