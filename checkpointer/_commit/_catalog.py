"""The step catalog: listing committed steps on object stores in O(steps), not O(objects).

TensorStore's kvstore has no delimiter listing, so on `s3://`, `gs://` and `memory://`
finding the steps of a directory by its folders lists every object of every checkpoint
(100 checkpoints of 10,000 files: a million keys). The catalog is a second, tiny index
that the commit keeps next to the steps:

```
DIR/.checkpointer-catalog/catalog.json   the catalog is complete (written last, by `repair`)
DIR/.checkpointer-catalog/<step>         one per step whose commit began: {step, generation}
```

Rules:
- Backends: only those without rename (object stores, `memory://`), where folder
  listing is the expensive part; on POSIX `os.listdir` is already O(steps) and nothing
  of this is written or read.
- The commit marker stays the truth. Process 0 writes a step's entry *before* its
  marker (after every process reported its shards durable, before the manifest). So
  every committed step of a catalogued directory has an entry: there is no crash window
  between marker and entry, and no step newer than the newest entry can be committed.
  An entry whose marker is absent (a save in flight, a crashed one, a step being
  deleted) is ignored by readers.
- Readers (`committed_steps`) list the catalog prefix only and check each entry's marker
  (concurrently). A directory without `catalog.json` (written by an earlier release, or
  never opened by a manager of this one) returns None: the caller falls back to the full
  listing.
- Deletion: the marker goes first (unpublishing the step), then the entry, then the
  step's objects; a crash in between leaves an entry without marker (ignored).
- Only the writer repairs: `repair` (with the writer's clean-up of crashed saves, at a
  manager's first save or `recover()`, and in `checkpointer gc`)
  lists the directory in full once, adds entries for committed steps that lack one
  (steps committed by an earlier release's writer, entries removed by hand), removes
  entries of steps with no object left, and writes `catalog.json` when it is missing. A
  `<step>` entry is written for saves into a catalogued directory by `ckpt.save` too.
- The one case the catalog cannot see: a step committed in a catalogued directory by a
  writer that does not know the catalog (an earlier release). It is listed again after
  the next repair.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

from .. import _format
from .._errors import SaveError
from .._storage import Storage
from . import _strategies

log = logging.getLogger("checkpointer")

CATALOG = ".checkpointer-catalog"
HEADER = "catalog.json"
CATALOG_VERSION = 1
_PROBE_THREADS = 16


def uses_catalog(storage: Storage) -> bool:
    """Whether `storage` keeps a step catalog: stores that write in place (object stores)."""
    return _strategies.strategy_for(storage).writes_in_place


def _split_step_path(path: str) -> tuple[str, int] | None:
    """(directory, step) of a checkpoint path `DIR/<step>`, or None if its name is no step."""
    if "/" not in path.rstrip("/"):
        return None
    directory, name = path.rstrip("/").rsplit("/", 1)
    return (directory, int(name)) if _format.is_step_name(name) else None


def catalog_steps(storage: Storage, directory: str, *, complete_only: bool = True) -> list[int] | None:
    """The steps with an entry, ascending (markers not checked).

    With `complete_only`, None when `catalog.json` is absent (no catalog, or a `repair`
    that did not finish).
    """
    names = storage.list_dir(f"{directory}/{CATALOG}")
    if complete_only and HEADER not in names:
        return None
    return sorted(int(n) for n in names if _format.is_step_name(n))


def committed_steps(storage: Storage, directory: str) -> list[int] | None:
    """The committed steps by the catalog, ascending; None when there is no catalog.

    Lists only `DIR/.checkpointer-catalog/` and reads each entry's step marker: O(steps)
    requests, whatever the checkpoints hold. Never a step without marker.

    Multi-process: any process, any time; reads only.
    """
    if not uses_catalog(storage):
        return None
    steps = catalog_steps(storage, directory)
    if not steps:
        return steps
    markers = [f"{directory}/{s}/{_format.COMMITTED}" for s in steps]
    with concurrent.futures.ThreadPoolExecutor(min(_PROBE_THREADS, len(steps))) as pool:
        present = list(pool.map(storage.exists, markers))
    return [s for s, ok in zip(steps, present) if ok]


def add_entry(storage: Storage, path: str, generation: str) -> None:
    """Enters the checkpoint at `path` (`DIR/<step>`) into DIR's catalog; call before
    writing its commit marker. No-op unless DIR has a catalog and `path` names a step.

    Raises:
      SaveError: the entry could not be written; the caller must not commit then.

    Multi-process: process 0 of the save only.
    """
    split = _split_step_path(path)
    if not uses_catalog(storage) or split is None:
        return
    directory, step = split
    try:
        if not storage.exists(f"{directory}/{CATALOG}/{HEADER}"):
            return
        entry = {"step": step, "generation": generation, "written_unix_s": time.time()}
        storage.write_file(f"{directory}/{CATALOG}/{step}", _format.dumps(entry))
    except Exception as e:
        raise SaveError(
            f"committing {path} failed (process 0): cannot write its entry in the step catalog "
            f"{directory}/{CATALOG}: {type(e).__name__}: {e}; nothing was committed. Check the storage "
            "and save again"
        ) from e


def remove_entry(storage: Storage, directory: str, step: int) -> None:
    """Removes `step`'s entry; call after its marker is gone, before its objects go.

    Multi-process: the writer (process 0) only.
    """
    if uses_catalog(storage):
        storage.delete_file(f"{directory}/{CATALOG}/{int(step)}")
