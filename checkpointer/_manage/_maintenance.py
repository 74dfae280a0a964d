"""The maintenance of a manager's directory, one function for `CheckpointManager` and
`checkpointer gc`: the clean-up after crashed saves (`_commit.recover`: a committed but
unrenamed step rolled forward, partial folders of saves not in flight removed), the repair
of the step catalog (object stores), and retention (the committed steps a policy does not
keep unpublished, then removed)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping

from .. import _commit
from .._storage import Storage
from ._policies import KeepPolicy

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
    Returns:
      The folder names the recovery removed or rolled forward, and the steps retention removed.

    Multi-process: process 0 alone calls it.
    """
    done: list[str] = []
    if recover:
        done = _commit.recover(storage, directory)
        _commit.repair(storage, directory)  # object stores: the step catalog
    if keep is None:
        return done, []
    folders = _commit.committed_folders(storage, directory)  # one listing for steps and metrics
    steps = list(folders)
    if not steps:
        return done, []
    saved = {s: metrics(s, folders) if metrics is not None else {} for s in steps}
    times = {s: created(s, folders) if created is not None else None for s in steps} if keep.uses_times else {}
    kept = set(keep.keep_at(steps, saved, times, time.time())) | {steps[-1]} | set(protect())
    removed = [s for s in steps if s not in kept]
    for s in removed:
        # Unpublishing is instant: the step leaves every listing before its bytes go.
        leftover = _commit.unpublish_step(storage, directory, s)
        (storage.delete_tree if remove is None else remove)(leftover)
        log.info("retention removed step %d from %s", s, directory)
    return done, removed
