"""What a manager restores, and from which tier: `CheckpointManager.restore` (a base of
the manager, as `StatusReporting` and `StepQuestions` are), with its `jax.monitoring`
figures and, after resuming from a local-only step, the replication it resumes."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING

from .._encoding import RestoreStats
from .._format import PyTree
from .._restore import RestoreOptions, restore_from
from .._storage import DEFAULT_MAX_OVER_READ_RATIO, storage_for
from . import _events, _tiers
from ._reader import StepReader, as_step

if TYPE_CHECKING:
    from ._tier_manager import LocalTier


class StepRestoring(StepReader):
    """The manager's restore, from either tier (a base of `CheckpointManager`; it reads
    the attributes below, which the manager sets)."""

    _mu: threading.Lock
    _tiers: LocalTier | None
    _last_restore: tuple[str | None, int | None]
    read_only: bool

    if TYPE_CHECKING:

        def _ensure_writer(self) -> list[str]: ...

    def restore(
        self,
        step: int | None = None,
        target: object = None,
        *,
        partial: bool = False,
        missing: str = "error",
        max_inflight_bytes: int | None = None,
        stats: RestoreStats | None = None,
        cooperative: bool = True,
        max_over_read_ratio: float = DEFAULT_MAX_OVER_READ_RATIO,
        read_chunk_bytes: int | None = None,
    ) -> PyTree:
        """Restores `step` (default: the newest committed step) onto `target`.

        Args:
          step: the step, or None for `latest_step()`.
          target, partial, missing, max_inflight_bytes, stats, cooperative, max_over_read_ratio, read_chunk_bytes: as for
            `ckpt.restore` (`missing="keep_target"` keeps the target's values for
            leaves the checkpoint lacks), whichever tier the step is read from.

        Two tiers: `step=None` restores a step newer than the newest durable one
        when it is committed on the local tier of every process, with the same process
        count and devices, and holds every chunk each process needs (the processes agree
        through the coordination service); it is logged and its replication resumes.
        One that fails its checks on any process is skipped for the next older one (a
        second vote: the same step on every process), with a warning naming the damaged
        copy (`LOCAL/process-<i>/<step>`). With `peer_copies`, a step counts as whole
        when every process's share survives somewhere (its own copy, or a peer's checked
        copy): a process whose own copy is gone (a replaced node) receives its boxes from
        the process holding its copy, over the device interconnect, within this call (a
        collective then); it falls back to fetching the copy's files when a copy is
        damaged or the target has host leaves or PRNG keys. A target of another mesh,
        sharding or process count is served from the surviving local copies combined file
        by file, when they hold every share of one step (docs/tiers_and_peers.md).
        Otherwise the newest durable step; `status().last_restore_reason` says why. A durable step whose local copy (same
        generation) is on this process is read from there, the files missing locally
        from `directory`; a local copy that fails its checksums is dropped for
        `directory`. `status().last_restore_source` tells which. With a local tier,
        restores never cooperate (`cooperative` is ignored): each process reads
        node-local files, where sharing reads saves no shared-storage bandwidth, and a
        process whose local copy is damaged falls back to `directory` on its own.

        Raises:
          CheckpointNotFoundError: no committed step (or not that one).

        Multi-process: every process calls it.
        """
        stats = RestoreStats() if stats is None else stats  # its figures become events
        options = RestoreOptions(partial, missing, max_inflight_bytes, stats, cooperative, max_over_read_ratio, read_chunk_bytes)
        t0 = time.perf_counter()
        tree = self._restore(step, target, options)
        _events.restored(time.perf_counter() - t0, stats.bytes_read)
        return tree

    def _restore(self, step: int | None, target: object, options: RestoreOptions) -> PyTree:
        if self._tiers is not None:
            resume = None if self.read_only else self._resume_replication
            tree, source, durable_bytes = self._tiers.restore(
                None if step is None else as_step(step), target, dataclasses.replace(options, cooperative=False),
                latest_durable=self.latest_step(), durable_path=self._read_path, resume=resume,
            )
            with self._mu:
                self._last_restore = (source, durable_bytes)
            return tree
        storage, path = storage_for(self._read_path(step))
        return restore_from(storage, path, target, options)

    def _resume_replication(self, step: int, generation: str, overwrite: bool, local_save: object = None,
                            best_effort: bool = False) -> None:
        """After resuming from a local-only step: replicate it (the writer's lock first;
        after `local_save`, a replaced process's copy still being fetched, when given).
        Every process waits until process 0 has cleaned up the directory (its first
        writer's recovery removes partial folders of earlier jobs, the same step's
        among them): a process that started copying first would lose its files.
        `best_effort`: a failure is logged and shown by `status()`, not raised from the next
        save (`TierManager.enqueue`). A step whose replication is still queued or running on
        any process (a restore in a running manager, saves in flight) is not queued again: that
        round ends on every process (a second one would fail once the first committed). Nor is
        one already durable at `generation` (its replication committed after the restore listed
        the durable tier: chosen as local-only, it is pending nowhere by the vote)."""
        assert self._tiers is not None
        tiers = self._tiers
        self._ensure_writer()

        def state() -> str:
            if step in tiers.pending_steps():
                return "queued"
            durable = _tiers.durable_generation(tiers.durable, tiers.directory, step)
            return "durable" if durable == generation else "recovered"

        votes = _tiers.agree(tiers.directory, state, tiers.commit_timeout_s)
        if all(v == "recovered" for v in votes):
            tiers.enqueue(step, generation, overwrite, local_save, best_effort=best_effort)
