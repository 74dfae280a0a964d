"""`CheckpointManager`: steps in a directory, the writer's lock, async saves, retention
(`_retention`), restore from either tier, status. Listing and following steps: `_reader`."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from types import TracebackType

from .. import _commit, _coord, _encoding, _storage
from .._errors import CheckpointError, CheckpointExistsError, SaveError, UnsupportedValueError
from .._format import metadata_json, metrics_json
from .._memory import HostBufferPool
from .._save import AsyncSave, SaveOptions, Snapshot, run_background, take_snapshot
from .._storage import storage_for
from . import _events, _tier_manager
from ._alerts import RunJournal
from ._follow import clear_finished, write_finished
from ._lock import DirectoryLock, forked_copy_message, take_lock
from ._maintenance import maintain
from ._policies import KeepLatest, KeepPolicy
from ._preemption import PreemptionWatch
from ._questions import StepQuestions
from ._reader import as_step
from ._restoring import StepRestoring
from ._retention import DurableRetention
from ._status import StatusReporting, write_rate
from ._time_policies import SaveClock
from ._two_tier_saving import TwoTierSaving, check_copies

log = logging.getLogger("checkpointer")


class CheckpointManager(StepQuestions, StepRestoring, StatusReporting, TwoTierSaving, DurableRetention):
    """Saves steps of a training run into `directory`, keeps what the policy says.

    Args:
      directory: local path or kvstore URL; created if missing.
      keep: retention policy (`KeepLatest`, `KeepEvery`, `KeepBest`, `KeepSteps`,
        `KeepEverySeconds`, `KeepNewerThan`, or a union with `|`); the newest committed
        step is always kept.
      save_interval_steps: `save(step)` writes only when `step % save_interval_steps == 0`
        (or `force=True`).
      save_interval_s: also (with the step rule) only when at least this many seconds
        passed since the last save written (or the newest committed step's creation),
        by process 0's clock, agreed by every process (None: no time rule).
      async_save: write and commit on a background thread (the default) or in `save`.
      commit_timeout_s: how long process 0 waits for every process's report, seconds (default 60:
        below JAX's 100 s heartbeat timeout, so a dead peer raises CommitTimeoutError
        instead of JAX aborting the job; raise both together).
      max_saves_in_flight: saves allowed in flight at once (1 bounds host memory to one
        snapshot); a new save waits for the oldest one, and the wait is recorded.
      agreement_timeout_s: how long processes wait for each other to agree on what a
        save writes (before anything is written), seconds.
      read_only: a reader only (an evaluation job, a notebook, a drill): `save` and
        `recover` raise. Any manager reads without a lock; this makes the intent explicit.
      max_write_bytes_per_s: caps this process's write throughput, bytes per second,
        shared by all its saves in flight (a token bucket, see `_ratelimit`); None:
        unlimited. `status().last_write_bytes_per_s` shows the rate achieved. With a
        local tier it caps the replication's writes to `directory`.
      local_directory: two tiers: a node-local POSIX folder (each process its own, or a
        shared one: each process uses `process-<i>/` in it). A save commits there
        first (`save` returns after the snapshot; the step is a restore point of this
        node once its local marker is written) and is then replicated to `directory`
        in the background and committed there; only durable steps are `all_steps()`.
      keep_local: retention of the local tier, by step (default: the newest step; a policy
        by time or metric, e.g. `KeepBest`, raises TypeError). A local step not yet durable
        is never removed (with a durable schedule, only for a newer local step that survives
        as many node losses): a save that would need to remove one waits for its replication
        (`status().waiting_for_replication`).
      pack_small_leaves_bytes: as for `save` (0: every leaf its own zarr array), on
        both tiers alike.
      save_on_preemption: on a preemption notice (SIGTERM), `save` writes the step
        every process agrees on whatever the interval, and returns once it is committed
        (durably, with `local_directory`); `reached_preemption(step)` is then True.
        Under `jax.distributed` JAX's preemption sync point decides (its notifier owns
        SIGTERM); otherwise a SIGTERM handler is installed (main thread only, chained to
        an earlier Python handler) and `close()` restores the previous one; a child
        forked afterwards gets the handler found before (SIGTERM's default action unless
        the program set one). The loop calls `save`, or `should_save`, at every step;
        `if mgr.should_save(step): mgr.save(step, state)` saves the preemption step too.
        See `_preemption`.
      direct_io: as for `save` ("auto", True, False); with two tiers it applies to the
        local tier's writes. `status().last_write_mode` says which mode the last
        finished save used, and why.
      incremental: as for `save` (docs/incremental.md). Retention retires a step kept steps
        reference: hidden, it keeps only their chunks until none does; `force=True` refuses to
        replace a referenced step. With `local_directory` a local step references the
        newest committed local step of the same process; its durable copy references a
        durable step of the same save, or holds the chunk itself; a peer copy carries
        the chunks it references (docs/incremental.md, "Two tiers").
      peer_copies, peer_node, durable_every_steps, durable_every_s: local steps held by
        peers on other nodes, and the durable schedule: see `TwoTierSaving`.

    Opening a manager, listing, `restore`, `metadata`, `status`, `drill` and following
    new steps (`wait_for_step`, `follow`) take no lock and delete nothing, so any number
    of readers may run beside the writer. The writer's lock (`DIR/.checkpointer.lock`,
    POSIX) is taken by the first operation that writes or deletes (`save`, `recover`),
    together with the clean-up of crashed saves, and released by `close()`, when the
    manager is garbage-collected, or at interpreter exit.

    Raises:
      ValueError: an interval, `max_saves_in_flight`, `max_write_bytes_per_s` or a
        timeout (seconds, in (0, a week]) out of range, or `direct_io` not "auto", True
        or False.

    Multi-process: every process constructs it and calls `save`/`restore` in the same
    order; process 0 alone cleans up, applies retention and holds the directory lock.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: KeepPolicy = KeepLatest(3),
        save_interval_steps: int = 1,
        async_save: bool = True,
        commit_timeout_s: float = _coord.DEFAULT_COMMIT_TIMEOUT_S,
        max_saves_in_flight: int = 1,
        read_only: bool = False,
        agreement_timeout_s: float = _commit.DEFAULT_AGREEMENT_TIMEOUT_S,
        max_write_bytes_per_s: float | None = None,
        local_directory: str | os.PathLike | None = None,
        keep_local: KeepPolicy = KeepLatest(1),
        pack_small_leaves_bytes: int | None = None,
        save_interval_s: float | None = None,
        save_on_preemption: bool = True,
        direct_io: str | bool = "auto",
        incremental: bool = False,
        peer_copies: int = 0,
        peer_node: str | None = None,
        durable_every_steps: int = 1,
        durable_every_s: float | None = None,
    ) -> None:
        if not isinstance(keep, KeepPolicy):
            raise TypeError(
                f"keep must be a retention policy (ckpt.KeepLatest(n), KeepEvery, KeepBest, KeepSteps, or a union "
                f"with |), got {keep!r}; for Orbax's max_to_keep=n use keep=ckpt.KeepLatest(n)"
            )
        if not isinstance(max_saves_in_flight, int) or max_saves_in_flight < 1:
            raise ValueError(f"max_saves_in_flight must be an int >= 1, got {max_saves_in_flight!r}")
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be an int >= 1, got {save_interval_steps!r}")
        self._write_limiter = _storage.limiter_for(max_write_bytes_per_s)
        # Two tiers pack as a direct save does: each process replicates its own pack.
        self._pack_bytes = _encoding.check_threshold(pack_small_leaves_bytes)
        self._direct_io = _storage.check_direct_io(direct_io)
        self._incremental = _check_incremental(incremental)
        self._last_write_mode: tuple[str | None, str | None] = (None, None)
        self.storage, self.directory = storage_for(directory)
        self.keep = keep
        self.save_interval_steps = save_interval_steps
        self.async_save = async_save
        self.commit_timeout_s = _coord.check_timeout_s("commit_timeout_s", commit_timeout_s)
        self.agreement_timeout_s = _coord.check_timeout_s("agreement_timeout_s", agreement_timeout_s)
        self.max_saves_in_flight = max_saves_in_flight
        self.read_only = bool(read_only)
        self._is_primary = _coord.process_index() == 0
        self._pid = os.getpid()  # a forked child's copy writes and deletes nothing (`_ensure_writer`, `close`)
        self._lock: DirectoryLock | None = None
        self._release_lock: weakref.finalize | None = None
        self._writer_ready = False
        self._mu = threading.Lock()
        self._in_flight: list[tuple[int, AsyncSave]] = []
        self._pending_error: BaseException | None = None
        self._last_error: str | None = None
        self._last_requested_step: int | None = None
        self._last: dict[str, float | None] = dict.fromkeys(("snapshot_s", "wait_s", "write_s", "commit_s", "write_bytes_per_s"))
        self._snapshot_history_s: list[float] = []
        self._metrics_cache: dict[int, dict] = {}
        self._rewind_warned: int | None = None  # the newest step `_warn_rewind` named
        self._created_cache: dict[int, float | None] = {}
        self._closed = False
        # The previous snapshot's host buffers, reused by the next one (warm memory
        # copies about twice as fast as fresh pages); released by close().
        self._buffers = HostBufferPool()
        self._deleter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpointer-gc")
        self._journal = RunJournal(self.storage, self.directory, is_primary=self._is_primary, submit=self._deleter.submit)
        self._clock = None if save_interval_s is None else SaveClock(
            save_interval_s, self.directory, agreement_timeout_s, first_unix_s=self._newest_created_unix_s)
        self._last_restore: tuple[str | None, int | None] = (None, None)
        self._tiers: _tier_manager.LocalTier | None = None
        self._preemption = PreemptionWatch(bool(save_on_preemption) and not self.read_only, self.directory)
        weakref.finalize(self, self._preemption.close)  # an unclosed manager's handler goes with it
        if local_directory is not None:
            if not isinstance(keep_local, KeepPolicy) or keep_local.uses_times or keep_local.uses_metrics:
                raise TypeError(f"keep_local must be a retention policy by step (e.g. ckpt.KeepLatest(1)), got {keep_local!r}: "
                                "the local tier's retention reads no times or metrics")
            self._tiers = _tier_manager.LocalTier(
                local_directory, self.storage, self.directory, keep_local=keep_local,
                commit_timeout_s=commit_timeout_s, limiter=self._write_limiter,
                retention_after=self._retention_after, on_error=self._on_replication_error,
                peer_copies=check_copies(peer_copies), peer_node=peer_node,
                durable_every_steps=durable_every_steps, durable_clock=None if durable_every_s is None else SaveClock(
                    durable_every_s, self.directory + "#durable", agreement_timeout_s,
                    first_unix_s=self._newest_created_unix_s),
            )
        elif peer_copies:
            raise ValueError("peer_copies needs local_directory: the copies are held in the peers' local tiers")

    # --- the writer's lock --------------------------------------------------------------

    def _ensure_writer(self) -> list[str]:
        """Before the first write or delete: the directory, then (process 0) the writer's
        lock and the clean-up of crashed saves (returns what it removed or rolled
        forward). Readers never get here."""
        if self.read_only:
            raise CheckpointError(
                f"this CheckpointManager of {self.directory} is read_only: it lists, restores and follows steps but "
                "never saves or deletes. Open one without read_only=True to save."
            )
        if os.getpid() != self._pid:
            raise CheckpointError(forked_copy_message(self.directory, self._pid))
        if self._writer_ready:
            return []
        try:
            return self._become_writer()
        except CheckpointError:
            raise
        except OSError as e:  # the directory cannot be made or cleaned up: a save cannot start
            raise SaveError(
                f"cannot prepare {self.directory} for saving (process {_coord.process_index()}): {e}. Nothing was "
                "written; the next save tries again, or fix the storage (a full or failing disk, permissions)"
            ) from e

    def _become_writer(self) -> list[str]:
        done: list[str] = []
        self.storage.makedirs(self.directory)
        if self._is_primary:
            if self.storage.supports_locks and self._lock is None:
                self._lock = take_lock(self.storage, self.directory)
                # Released on close(), on garbage collection and at interpreter exit;
                # the finalizer holds the lock object only, never the manager.
                self._release_lock = weakref.finalize(self, self._lock.release)
            done, _ = maintain(self.storage, self.directory)
            clear_finished(self.storage, self.directory)  # a writer again: the run goes on
        if self._tiers is not None:  # every process: its own local root
            done += self._tiers.recover()
        self._writer_ready = True
        return done

    def recover(self) -> list[str]:
        """Takes the writer's lock and cleans up after crashed saves now (the first
        `save` does this by itself): rolls forward a committed but unrenamed step, removes
        partial folders of saves not in flight. Foreign entries are never touched.

        Returns:
          The folder names removed or rolled forward (process 0; [] elsewhere).
        Raises:
          CheckpointError: the manager is read_only, or another writer holds the lock.

        Multi-process: any process may call it; only process 0 acts.
        """
        if not self._writer_ready or os.getpid() != self._pid:
            return self._ensure_writer()
        if not self._is_primary:
            return []
        with self._mu:
            live = frozenset(h.snapshot.generation for _, h in self._in_flight if not h.done())
            steps = frozenset(s for s, h in self._in_flight if not h.done())
        return _commit.recover(self.storage, self.directory, live_generations=live, live_steps=steps)

    # --- errors -------------------------------------------------------------------------

    def _raise_pending(self) -> None:
        with self._mu:
            err, self._pending_error = self._pending_error, None
        if err is not None:
            raise err

    def _failed(self, step: int, error: BaseException) -> None:
        """A save of `step` failed: `status()` shows it, its in-flight entry goes, the
        journal notes it (the probe)."""
        with self._mu:
            self._last_error = f"step {step}: {type(error).__name__}: {error}"
        self._forget(step)
        self._journal.failed(step, error)

    def _on_replication_error(self, step: int, error: BaseException) -> None:
        with self._mu:
            self._pending_error = error
        self._failed(step, error)

    def _on_finish(self, step: int, handle: AsyncSave) -> None:
        snap = handle.snapshot
        with self._mu:
            self._last["write_s"] = snap.result.write_s
            self._last["commit_s"] = handle.commit_s
            self._last["write_bytes_per_s"] = write_rate(snap)
            self._last_write_mode = (snap.result.write_mode, snap.result.write_mode_reason)
            if handle.error is not None:
                self._pending_error = handle.error
                self._last_error = f"step {step}: {type(handle.error).__name__}: {handle.error}"
                log.error("checkpoint of step %d failed: %s", step, handle.error)
        self._finished(step, snap, handle.commit_s, handle.error)

    def _finished(self, step: int, snap: Snapshot, commit_lag_s: float | None, error: BaseException | None) -> None:
        if error is not None:
            self._forget(step)  # the metrics `save` cached are not the step's (a replaced step keeps its old ones)
        with self._mu:
            lag_steps = max(0, (self._last_requested_step or step) - step)
        self._journal.save_over(step, snap, commit_lag_s=commit_lag_s, commit_lag_steps=lag_steps, error=error)

    # --- save ---------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `save(step)` would write: True at the preemption step (see
        `save_on_preemption`) and where `step % save_interval_steps == 0`. With
        `save_interval_s`, `save` may still skip a step this says True for (the time rule is
        decided inside `save`, by one vote of the processes).

        Args:
          step: the training step (int >= 0).
        Returns:
          Whether to call `save(step)`.

        Multi-process: it asks the preemption notice as `save` does: under
        `jax.distributed` JAX's preemption sync point, which every process must ask at
        every step, in step order. Call `should_save` (or `save`) at every step on every
        process; a `save` of the same step afterwards does not ask again, and agrees.
        """
        step = as_step(step)
        return self._preemption.reached(step) or step % self.save_interval_steps == 0

    def save(
        self,
        step: int,
        tree: object,
        *,
        metrics: Mapping[str, object] | None = None,
        metadata: Mapping[str, object] | None = None,
        force: bool = False,
        per_process_state: object = None,
    ) -> bool:
        """Saves `tree` as `step` (asynchronously unless `async_save=False`).

        Blocks for the host snapshot only (plus any wait for the previous save when
        `max_saves_in_flight` saves are in flight).

        Args:
          step: the training step (int >= 0).
          tree: the pytree to save (see `ckpt.save`).
          metrics: numbers stored with the step (for `KeepBest`), in the manifest's
            `user_metadata["metrics"]`; numpy/JAX scalars become floats, NaN and
            infinities the strings "NaN" / "Infinity" / "-Infinity".
          metadata: a JSON dict stored with the step: its keys become the keys of
            `ckpt.metadata(path).user_metadata` beside `"metrics"` (which it may not
            use). Same rule as `ckpt.save(metadata=)` and `metrics`.
          force: save even off the interval, and replace an already committed `step`
            atomically.
          per_process_state: this process's own JSON-serialisable value (e.g. its data
            loader's position), stored in its `processes/<i>.json`; read it back with
            `per_process_state(step)`.
        Returns:
          True if a save was started, False if skipped by `save_interval_steps`.
        Raises:
          CheckpointError: the previous background save failed (raised here once); the
            step is already committed, or being saved, and `force` is False
            (CheckpointExistsError); a leaf cannot be stored; the manager is read_only or
            another writer holds the directory.
          UnsupportedValueError: a metric or metadata value the rule refuses (names its
            key, e.g. `metadata['a']['b']`), or a `"metrics"` key in `metadata`.
          SaveAgreementError: the processes save different steps or trees; nothing written.

        Multi-process: every process calls it with the same step and tree (non-array
        leaves equal), in the same order.
        """
        if self._closed:
            raise CheckpointError(f"the CheckpointManager of {self.directory} is closed")
        try:
            self._ensure_writer()
            self._raise_pending()
            step = as_step(step)
            preempted = self._preemption.reached(step)  # every step: the sync point's rule
            if not force and not preempted and not self.should_save(step):
                return False
            if not force and not preempted and self._clock is not None and not self._clock.due(step):
                return False
            committed = self.all_steps()
            if committed and committed[-1] > step and self._rewind_warned != committed[-1]:
                self._rewind_warned = _warn_rewind(self.directory, step, committed)  # once per newer step
            with self._mu:  # a step being saved counts as saved: a second save of it would fail at its commit
                writing = {s for s, h in self._in_flight if not h.done()}
            if not force and (step in committed or step in writing):
                if preempted:  # saved already: commit what is in flight, then the loop stops
                    self.wait_until_finished()
                    return False
                raise CheckpointExistsError(
                    f"step {step} is already {'committed' if step in committed else 'being saved (in flight)'} in "
                    f"{self.directory}; pass force=True to replace it atomically"
                )
            user_metadata = metadata_json(metadata, self.step_path(step))
            if "metrics" in user_metadata:
                raise UnsupportedValueError(
                    f"metadata['metrics'] for step {step} of {self.directory}: the key 'metrics' holds the manager's "
                    "metrics= (KeepBest reads it); pass metrics=... or rename the metadata key"
                )
            metrics = metrics_json(metrics, self.step_path(step))
            if metrics:
                user_metadata["metrics"] = metrics
            t0 = time.perf_counter()
            self._wait_for_room()
            if self._tiers is not None:
                self._tiers.wait_for_room(step)
            wait_s = time.perf_counter() - t0
            self._raise_pending()
            options = SaveOptions(
                metadata=user_metadata, overwrite=force, commit_timeout_s=self.commit_timeout_s,
                agreement_timeout_s=self.agreement_timeout_s, per_process_state=per_process_state,
                pack_small_leaves_bytes=self._pack_bytes, direct_io=self._direct_io, incremental=self._incremental,
            )
        except BaseException as e:
            # Before the snapshot (which takes the save's number itself): a process that
            # fails here alone (the writer's lock, a listing, a value) must still take the
            # number and refuse it, or every later save would pair with another's.
            _commit.refuse(_commit.next_ticket(), f"{self.directory}/{step}", e)
            raise
        try:
            with self._tiers.bases(step) if self._tiers is not None and self._incremental else contextlib.nullcontext():
                snap = take_snapshot(self.step_path(step), tree, options, step=step, buffers=self._buffers,
                                     write_limiter=self._write_limiter)
        except Exception as e:
            self._journal.failed(step, e)
            raise
        if self._clock is not None:
            self._clock.saved()
        _events.save_blocked(snap.snapshot_s)
        durable = True
        if self._tiers is not None:
            snap = self._tiers.local_snapshot(snap)
            durable = self._tiers.durable_due(step, forced=force or preempted)
        with self._mu:
            self._last["snapshot_s"], self._last["wait_s"] = snap.snapshot_s, wait_s
            self._snapshot_history_s.append(snap.snapshot_s)
            self._last_requested_step = step
            self._metrics_cache[step] = dict(metrics)  # a replaced step's old metrics go
            self._created_cache.pop(step, None)
        self._journal.requested(step)
        if self._tiers is not None:
            self._save_two_tiers(step, snap, durable)
        elif self.async_save:
            handle = AsyncSave(snap, on_finish=lambda h: self._on_finish(step, h), after_publish=self._retention_after(step, snap))
            with self._mu:
                self._in_flight.append((step, handle))
        else:
            self._run_sync(step, snap)
        if preempted:  # committed (durably, with two tiers) before the loop stops
            self.wait_until_finished()
        return True

    def reached_preemption(self, step: int) -> bool:
        """Whether the job was preempted at `step` and `step` is committed: after
        `save(step)`, True tells the loop to stop (see `save_on_preemption`).

        A loop that did not save the preemption step (it skipped `save`, or the save
        failed) gets False and a logged warning that the preemption step was not saved:
        the job then runs on until the grace period ends and it is killed, and resumes
        from the newest committed step. To save it after all, call
        `save(step, tree, force=True)`; this then returns True.

        Args:
          step: the step just passed to `save` (int >= 0).
        Returns:
          True at the preemption step only, once it is committed (the same on every
          process).

        Multi-process: under `jax.distributed` every process calls it (or `save`, or
        `should_save`) at every step, in step order, as JAX's preemption sync point
        requires.
        """
        return self._preemption.reached_committed(as_step(step), self.all_steps())

    def _run_sync(self, step: int, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        try:
            run_background(snap, self._retention_after(step, snap))
        except BaseException as e:
            self._failed(step, e)
            raise
        with self._mu:
            self._last["write_s"], self._last["commit_s"] = snap.result.write_s, time.perf_counter() - t0
            self._last["write_bytes_per_s"] = write_rate(snap)
            self._last_write_mode = (snap.result.write_mode, snap.result.write_mode_reason)
        self._finished(step, snap, self._last["commit_s"], None)

    def _wait_for_room(self) -> None:
        while True:
            with self._mu:
                self._in_flight = [(s, h) for s, h in self._in_flight if not h.done()]
                if len(self._in_flight) < self.max_saves_in_flight:
                    return
                oldest = self._in_flight[0][1]
            oldest.join()

    def wait_until_finished(self) -> None:
        """Blocks until every save in flight is committed.

        Raises:
          CheckpointError: a background save failed (the error is raised once).
        """
        with self._mu:
            handles = [h for _, h in self._in_flight]
        for h in handles:
            h.join()
        with self._mu:
            self._in_flight = []
        if self._tiers is not None:
            self._tiers.wait_all()
        self._raise_pending()

    def close(self, finished: bool = False) -> None:
        """Waits for saves in flight, releases the directory lock; raises a pending error.

        Args:
          finished: mark the run finished (`DIR/.checkpointer-finished.json`, at the
            newest committed step) once every save committed: `follow()` then ends
            after yielding every step up to it. Only this marks a run finished (a
            preempted job closes without it); the next writer's first save removes it.
        Raises:
          CheckpointError: a background save failed (the mark is not written), or
            `finished=True` on a read_only manager or a forked child's copy.

        Multi-process: every process calls it; process 0 writes the mark. In a child
        forked from the process that opened it, it only marks the copy closed.
        """
        if self._closed:
            return
        if os.getpid() != self._pid:  # a forked child's copy: the parent's saves, lock, threads and peers stay its own
            self._closed = True
            if finished:
                raise CheckpointError(forked_copy_message(self.directory, self._pid))
            return
        if finished and self.read_only:
            raise CheckpointError(
                f"close(finished=True) on a read_only CheckpointManager of {self.directory}: only the writer marks its "
                "run finished"
            )
        try:
            self.wait_until_finished()
            if finished:
                self._ensure_writer()
                if self._is_primary:
                    write_finished(self.storage, self.directory, self.latest_step())
        finally:
            self._closed = True
            self._preemption.close()
            self._deleter.shutdown(wait=True)
            if self._tiers is not None:
                self._tiers.close()
            self._buffers = HostBufferPool()
            if self._release_lock is not None:
                self._release_lock()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the caller's exception with a background one
            try:
                self.close()
            except Exception as e:
                log.error("while closing after an exception: %s", e)


def _check_incremental(incremental: object) -> bool:
    """The manager's `incremental` option, checked.

    Raises:
      TypeError: not a bool.
    """
    if not isinstance(incremental, bool):
        raise TypeError(f"incremental must be True or False, got {incremental!r}")
    return incremental


def _warn_rewind(directory: str, step: int, committed: list[int]) -> int:
    """A save of `step` below committed steps (a rewind, or a run started again in a used
    directory): `restore(None)` and retention order steps by number (the contract's
    "newest committed step", as Orbax's `latest_step`), so until this run passes them a
    restart resumes from the newer steps of the earlier run. Says so, naming them, and
    returns the newest (`committed` ascending)."""
    newer = [s for s in committed if s > step]
    shown = ", ".join(map(str, newer[:5])) + (f" and {len(newer) - 5} more" if len(newer) > 5 else "")
    log.warning(
        "saving step %d of %s below committed step(s) %s (a rewind?): restore(None) and retention order steps by "
        "number, so a restart before this run passes step %d resumes from step %d of the earlier run. If those "
        "steps belong to an abandoned run, delete them (CheckpointManager.delete(step), every process)",
        step, directory, shown, newer[-1], newer[-1])
    return committed[-1]
