"""Retired steps (incremental saves): a step that retention removes while newer steps
still reference its chunks is retired, not kept whole (docs/incremental.md, "Retention").

1. `_commit.retire_step`: its catalog entry goes (object stores), then the `RETIRED`
   marker is written into the step folder, atomically. From then on the step is in no
   listing (`all_steps`, `latest_step`, the catalog, retention's counts, the CLI) and
   restoring it itself fails naming the steps that reference it; its `COMMITTED` marker
   and manifest stay, so it remains a valid reference target.
2. `prune` (here): for every retired step, the chunk files and pack files that no
   listed step references are deleted one by one (a referenced pack file stays whole);
   a retired step that nothing references any more is removed like any step
   (unpublished, then its bytes removed).

A crash after 1 leaves a hidden step whose files are all still there; a crash during
2 leaves one whose remaining chunks are whole files, and every chunk a listed step
references is among them: no listed step ever has a dangling reference. The next
retention or recovery (`maintain`, `checkpointer gc`) runs `prune` again and finishes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from .. import _commit, _format
from .._errors import CheckpointError
from .._storage import Storage

log = logging.getLogger("checkpointer")


def prune(storage: Storage, directory: str, listed: Mapping[int, str] | None,
          remove: Callable[[str], object] | None = None) -> list[int]:
    """Deletes what no listed step references of the retired steps of `directory`.

    Args:
      listed: step -> folder of the listed committed steps (`_commit.committed_folders`;
        None: listed here).
      remove: removes what is left of an unpublished retired step (as for `maintain`).
    Returns:
      The retired steps removed whole (nothing referenced them any more).

    Multi-process: the writer (process 0) only, under the directory's writer's lock.
    """
    retired = _commit.retired_folders(storage, directory)
    if not retired:
        return []
    listed = _commit.committed_folders(storage, directory) if listed is None else listed
    needed = needed_keys(storage, directory, listed)
    if needed is None:
        return []
    removed = []
    for step, folder in retired.items():
        keys = needed.get(folder)
        if not keys:
            leftover = _commit.unpublish_step(storage, directory, step)
            (storage.delete_tree if remove is None else remove)(leftover)
            log.info("retention removed retired step %d from %s: no step references it any more", step, directory)
            removed.append(step)
            continue
        freed = [k for k in storage.list_files(f"{directory}/{folder}") if is_data_file(k) and k not in keys]
        for key in freed:
            storage.delete_file(f"{directory}/{folder}/{key}")
        if freed:
            log.info("retention freed %d files of retired step %d of %s", len(freed), step, directory)
    return removed


def needed_keys(storage: Storage, directory: str, listed: Mapping[int, str]) -> dict[str, set[str]] | None:
    """Folder -> the chunk and pack files (keys relative to that folder) that the
    `listed` steps reference there; None when a listed step's manifest cannot be read
    (logged: then nothing is pruned)."""
    out: dict[str, set[str]] = {}
    for step, folder in listed.items():
        try:
            meta = _format.read_metadata(storage, f"{directory}/{folder}", check_references=False)
        except (CheckpointError, OSError) as e:
            log.warning("retention keeps the retired steps of %s whole: cannot read step %d: %s", directory, step, e)
            return None
        for m in meta.arrays.values():
            for cell, ref in m.references.items():
                out.setdefault(ref.folder, set()).add(_format.chunk_key(m.path, cell))
            for pb in m.pack_boxes:
                if pb.folder is not None:
                    out.setdefault(pb.folder, set()).add(_format.split_pack_key(pb.key)[1])
    return out


def is_data_file(key: str) -> bool:
    """Whether `key` (relative to a checkpoint) is a chunk file or a pack file (not a
    zarr.json, the manifest, a record or a marker)."""
    return key.split("/", 1)[0] in (_format.ARRAYS, "packed") and key.rsplit("/", 1)[-1] != _format.ZARR_JSON
