"""The durable tier's retention in `CheckpointManager` (a base of it, as `TwoTierSaving`
is): the callback process 0 runs after each commit, before the other processes are told
(leftovers of failed saves, then the steps the policy does not keep, then the save's
after-commit phases into the journal), and the removal of a step's bytes on the deleter
thread. The local tier's retention is `LocalTier.apply_retention`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from .. import _commit, _tools
from .._save import AsyncSave, Snapshot, guard
from .._storage import Storage
from ._maintenance import bases_in_flight, maintain
from ._policies import KeepPolicy

log = logging.getLogger("checkpointer")


class DurableRetention:
    """`_retention_after`, `_apply_retention` and `_remove` of `CheckpointManager` (it
    reads the manager's attributes below)."""

    storage: Storage
    directory: str
    keep: KeepPolicy
    _is_primary: bool
    _mu: threading.Lock
    _in_flight: list[tuple[int, AsyncSave]]
    _deleter: concurrent.futures.ThreadPoolExecutor

    if TYPE_CHECKING:

        def _metrics(self, step: int, folders: Mapping[int, str]) -> dict: ...

        def _created_unix_s(self, step: int, folders: Mapping[int, str]) -> float | None: ...

        def _forget(self, step: int) -> None: ...

    def _retention_after(self, step: int, snap: Snapshot | None = None) -> Callable[[], object] | None:
        """The callback process 0 runs after committing `step`, before telling the others:
        retention, then (given the save's `snap`) its after-commit phases into the journal
        (`_timeline`); the two-tier replication's durable commits pass no snapshot."""
        if not self._is_primary:
            return None

        def after_commit() -> None:
            start = time.time()
            try:
                _commit.remove_leftovers(self.storage, self.directory)  # of failed saves: not left for recovery
                self._apply_retention(protect={step})
            finally:
                if snap is not None:
                    phases = {"retention": (start, time.time())}
                    if "commit" in snap.result.phases_unix_s:
                        phases["commit"] = snap.result.phases_unix_s["commit"]
                    _tools.append_journal(self.storage, self.directory, step=step, generation=snap.generation,
                                             phases_unix_s=phases)

        return after_commit

    def _apply_retention(self, protect: frozenset[int] | set[int] = frozenset()) -> list[int]:
        def in_flight() -> set[int]:
            with self._mu:
                running = [(s, h.snapshot) for s, h in self._in_flight if not h.done()]
                return {s for s, _ in running} | set(protect) | bases_in_flight([snap for _, snap in running])

        # Removing the bytes of an unpublished step (a GiB takes a while) runs on the
        # deleter thread, so it does not delay the commit being announced. Under the
        # directory's guard: an incremental commit's check of what it references holds it.
        with guard(self.storage, self.directory):
            _, removed = maintain(self.storage, self.directory, recover=False, keep=self.keep, metrics=self._metrics,
                                  protect=in_flight, remove=lambda path: self._deleter.submit(self._remove, path),
                                  created=self._created_unix_s)
        for s in removed:
            self._forget(s)
        return removed

    def _remove(self, path: str) -> None:
        try:
            self.storage.delete_tree(path)
        except OSError as e:  # recovery removes it on a later first save
            log.warning("could not remove %s: %s", path, e)
