"""The maintenance of a manager's directory, one function for `CheckpointManager` and
`checkpointer gc`: the clean-up after crashed saves (`_commit.recover`: a committed but
unrenamed step rolled forward, partial folders of saves not in flight removed), the repair
of the step catalog (object stores), and retention (the committed steps a policy does not
keep unpublished, then removed)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Set as AbstractSet
from typing import TYPE_CHECKING

from .. import _commit, _format
from .._errors import CheckpointError
from .._storage import Storage
from . import _retirement
from ._policies import KeepPolicy

if TYPE_CHECKING:
    from .._save import Snapshot

log = logging.getLogger("checkpointer")


def maintain(
    storage: Storage,
    directory: str,
    *,
    recover: bool = True,
    keep: KeepPolicy | None = None,
    metrics: Callable[[int, Mapping[int, str]], Mapping[str, object]] | None = None,
    protect: Callable[[], Collection[int]] = frozenset,
    remove: Callable[[str], object] | None = None,
    created: Callable[[int, Mapping[int, str]], float | None] | None = None,
    kept_for_references: dict[int, list[int]] | None = None,
) -> tuple[list[str], list[int]]:
    """Cleans up the directory of steps `directory`, then applies retention. The caller
    is the directory's only writer (it holds the writer's lock where `storage` has locks).

    Args:
      storage, directory: the directory of steps.
      recover: first clean up after crashed saves and repair the step catalog.
      keep: then remove every committed step this policy does not keep (None: no
        retention). The newest committed step and the steps of `protect()` always stay.
      metrics: `metrics(step, folders)`, the saved metrics of committed `step` for the
        policy (`folders`: `_commit.committed_folders`, listed once); None: {} for every step.
      protect: the steps that must stay (saves in flight, the step just committed); asked
        once the metrics are read.
      remove: removes what is left of an unpublished step (e.g. on a deleter thread, so
        a commit is announced without waiting for the bytes to go); None: at once.
      created: `created(step, folders)`, the manifest's creation time of `step` (None:
        unknown), read only for a policy by time (`keep.uses_times`).
      kept_for_references: filled (when given) with each step the policy would remove
        but that kept steps reference (incremental saves): step -> the steps that
        reference it. Such a step is retired (`_retirement`): hidden from listings, only
        the chunks those steps reference kept.
    Returns:
      The folder names the recovery removed or rolled forward, and the steps retention
      removed (retired steps too, once nothing references them).

    Multi-process: process 0 alone calls it.
    """
    done: list[str] = []
    if recover:
        done = _commit.recover(storage, directory)
        _commit.repair(storage, directory)  # object stores: the step catalog
    if keep is None:
        return done, _retirement.prune(storage, directory, None, remove) if recover else []
    folders = _commit.committed_folders(storage, directory)  # one listing for steps and metrics
    steps = list(folders)
    if not steps:
        return done, []
    saved = {s: metrics(s, folders) if metrics is not None else {} for s in steps}
    times = {s: created(s, folders) if created is not None else None for s in steps} if keep.uses_times else {}
    kept = set(keep.keep_at(steps, saved, times, time.time())) | {steps[-1]} | set(protect())
    doomed = [s for s in steps if s not in kept]
    if not doomed:  # a recovery also finishes a retirement a crash interrupted
        return done, _retirement.prune(storage, directory, folders, remove) if recover else []
    refs = {s: referenced_steps(storage, directory, folders[s]) for s in steps}
    retire = users_among(steps, doomed, refs)
    if kept_for_references is not None:
        kept_for_references.update(retire)
    # A doomed step that a step which stays references is retired (hidden at once; only
    # the chunks nobody references go, below), the others are removed.
    for c, users in sorted(retire.items()):
        _commit.retire_step(storage, directory, c, users)
        log.info("retention retired step %d of %s: kept only for the chunks steps %s reference", c, directory, users)
    listed = [s for s in steps if s not in retire]
    doomed_set = {s for s in doomed if s not in retire}
    # Remove one step at a time, only one that no listed step still references: a
    # crash between any two operations leaves no committed step with a dangling reference.
    remaining, removed = set(listed), []
    while doomed_set:
        ready = [c for c in doomed_set if not any(c in refs[s] for s in remaining if s != c)]
        if not ready:  # references among the doomed steps only in a cycle: a hostile manifest; keep them
            log.warning("retention keeps steps %s of %s: they reference each other", sorted(doomed_set), directory)
            break
        c = max(ready)
        # Unpublishing is instant: the step leaves every listing before its bytes go.
        leftover = _commit.unpublish_step(storage, directory, c)
        (storage.delete_tree if remove is None else remove)(leftover)
        log.info("retention removed step %d from %s", c, directory)
        remaining.discard(c)
        doomed_set.discard(c)
        removed.append(c)
    removed += _retirement.prune(storage, directory, {s: folders[s] for s in sorted(remaining)}, remove)
    return done, sorted(removed)


def users_among(steps: Collection[int], doomed: Collection[int], refs: Mapping[int, AbstractSet[int]]) -> dict[int, list[int]]:
    """Of the `doomed` steps, those that a step which stays references: step -> those
    steps (references are flat: a step references the step that holds the bytes, so
    only the steps that stay count)."""
    gone = set(doomed)
    out = {c: sorted(s for s in steps if s not in gone and c in refs.get(s, ())) for c in sorted(gone)}
    return {c: users for c, users in out.items() if users}


class EveryStep(frozenset[int]):
    """What a step whose manifest cannot be read may reference: any step. Retention then
    retires (keeps) the steps it would remove, as for a referenced step, instead of
    removing the data of a kept step whose manifest was unreadable for a moment (EIO, a
    store's error); they go once it can be read again, or once it goes itself."""

    def __contains__(self, step: object) -> bool:
        return True


def referenced_steps(storage: Storage, directory: str, folder: str) -> AbstractSet[int]:
    """The steps whose chunks the committed step in `folder` references (incremental
    saves); empty for a checkpoint without references; `EveryStep()` for one whose
    manifest cannot be read (logged)."""
    try:
        meta = _format.read_metadata(storage, f"{directory}/{folder}", check_references=False)
    except (CheckpointError, OSError) as e:
        log.warning("cannot read the references of %s/%s (%s): retention keeps the steps it may reference",
                    directory, folder, e)
        return EveryStep()
    return {int(f) for f in meta.referenced_folders if _format.is_step_name(f)}


def bases_in_flight(snapshots: Iterable[Snapshot]) -> set[int]:
    """The steps that incremental saves in flight reference (their base): retention keeps
    them until those saves commit."""
    folders = {snap.base.folder for snap in snapshots if snap.base is not None}
    return {int(f) for f in folders if _format.is_step_name(f)}
