"""The manager's local tier: local commits, the replication queue, retention per tier,
and the choice of tier at restore (see `_tiers` for the layout and the protocols).

One `LocalTier` per `CheckpointManager(local_directory=...)`, on every process. A save
commits on the local tier in the background (`run_local`, the `AsyncSave` runner) and is
queued for replication in the order of `save` calls (`enqueue`), so every process
replicates the same steps in the same order. One worker replicates one step at a time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

from .. import _commit, _coord, _format, _storage
from .._encoding import RestoreStats
from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .._format import PyTree
from .._restore import RestoreOptions, restore_from
from .._save import SaveResult, Snapshot, bases_beside, guard, manifest_bytes, release_host, remember, write_snapshot
from .._storage import Storage
from . import _alerts, _local_commits, _mesh_restart, _peer_delivery, _peers, _tier_references, _tiers
from ._policies import KeepPolicy
from ._tier import DurableTier, LocalStepTier
from ._time_policies import SaveClock

log = logging.getLogger("checkpointer")


@dataclasses.dataclass(frozen=True)
class TierStatus:
    """The two tiers' part of `ManagerStatus` (see there)."""

    latest_local_step: int | None
    replication_lag_steps: int
    replication_lag_s: float
    last_replication_error: str | None
    waiting_for_replication: bool
    node_losses_survived: dict[int, int] = dataclasses.field(default_factory=dict)
    last_peer_error: str | None = None
    last_restore_reason: str | None = None


def _naming(error: CheckpointError, where: str, text: str | None = None) -> CheckpointError:
    """`error` again (its class), its message (or `text`) prefixed with the copy it read."""
    message = f"{where}: {error if text is None else text}"
    try:
        return type(error)(message)
    except TypeError:  # a class with another constructor
        return CheckpointError(message)


class LocalTier:
    """This process's local tier of one manager.

    Args:
      local_directory: node-local folder (POSIX); this process uses `process-<i>/` in it.
      durable: the durable tier's storage; directory: the manager's directory.
      keep_local: retention of the local tier.
      commit_timeout_s: how long replication waits for the other processes, seconds.
      limiter: caps the replication's writes to the durable tier (`max_write_bytes_per_s`).
      retention_after: step → the callback process 0 runs after the durable commit.
      on_error: called with (step, error) when a replication fails.
      peer_copies: copies of each local step held by processes on other nodes (0: none).
      peer_node: this process's node name (default: its host name): for `peer_copies`,
        and for a restart onto fewer processes, which reads the folders of its node.
      durable_every_steps: replicate every n-th local step to the durable tier (1: all).
      durable_clock: also replicate only when this clock says a save is due (seconds).
    """

    def __init__(
        self,
        local_directory: str | os.PathLike,
        durable: Storage,
        directory: str,
        *,
        keep_local: KeepPolicy,
        commit_timeout_s: float,
        limiter: _storage.TokenBucket | None,
        retention_after: Callable[[int], Callable[[], object] | None],
        on_error: Callable[[int, BaseException], None],
        peer_copies: int = 0,
        peer_node: str | None = None,
        durable_every_steps: int = 1,
        durable_clock: SaveClock | None = None,
    ) -> None:
        self.process_index = _coord.process_index()
        self.storage, self.root = _tiers.local_root(local_directory, self.process_index)
        if not self.storage.supports_rename:
            raise ValueError(
                f"local_directory must be a node-local POSIX folder (a local path), got {os.fspath(local_directory)!r}"
            )
        self.durable, self.directory = durable, directory
        self.keep_local = keep_local
        self.commit_timeout_s = commit_timeout_s
        self.limiter = limiter
        self._retention_after = retention_after
        self._on_error = on_error
        self._mu = threading.Lock()
        self._retention_mu = threading.Lock()  # held by apply_retention: local commits and replications both apply it
        self._queue = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpointer-replicate")
        self._jobs: dict[int, concurrent.futures.Future] = {}
        self._attempts: dict[int, int] = {}
        self._bases_in_flight: dict[int, int] = {}  # incremental local saves in flight: step -> its local base
        self._queuing: list[int] = []  # steps of saves whose replication and peer copies are not queued yet
        self.last_error: str | None = None
        self.waiting = False
        self._recovered = False
        if isinstance(durable_every_steps, bool) or not isinstance(durable_every_steps, int) or durable_every_steps < 1:
            raise ValueError(f"durable_every_steps must be an int >= 1, got {durable_every_steps!r}")
        self.durable_every_steps = durable_every_steps
        self._durable_clock = durable_clock
        self.tier = LocalStepTier(self.storage, self.root, self._retention_mu)
        self.durable_tier = DurableTier(durable, directory)
        self.node = peer_node if peer_node is not None else socket.gethostname()
        self.last_restore_reason: str | None = None  # why the last restore read where it did (`status`)
        self.peers: _peers.PeerService | None = None
        if peer_copies and _coord.process_count() > 1:
            self.peers = _peers.PeerService(self.root, directory, copies=peer_copies, node=peer_node,
                                            timeout_s=commit_timeout_s)
        elif peer_copies:
            log.info("peer_copies=%d: a job of one process has no peer to hold copies", peer_copies)
        # A newer step supersedes once all hold it; with peers too: copy counts tied at 0 say nothing (review44)
        self.scheduled = durable_every_steps > 1 or durable_clock is not None  # a durable schedule: not every step
        self._commits = _local_commits.LocalCommits(directory, commit_timeout_s) if (
            self.scheduled and _coord.process_count() > 1) else None

    # --- local commit -------------------------------------------------------------------

    def recover(self) -> list[str]:
        """Removes this process's crashed local saves (its own root only; once)."""
        if self._recovered:
            return []
        self.storage.makedirs(self.root)
        _mesh_restart.write_node(self.root, self.node)  # a later job with fewer processes per node reads it
        _mesh_restart.remove_staging_leftovers(self.root, self.process_index)
        self._recovered = True
        return _commit.recover(self.storage, self.root)

    def bases(self, step: int):
        """Around `take_snapshot` of an incremental save: its base is the newest
        committed step of this process's local tier (`_tier_references`)."""
        return bases_beside(self.storage, f"{self.root}/{step}")

    def local_snapshot(self, snap: Snapshot) -> Snapshot:
        """The snapshot of a save, redirected to this process's local tier."""
        if snap.base is not None and snap.step is not None and _format.is_step_name(snap.base.folder):
            with self._mu:  # local retention keeps it until the save ends
                self._bases_in_flight[snap.step] = int(snap.base.folder)
        return dataclasses.replace(
            snap, storage=self.storage, path=f"{self.root}/{snap.step}", writes_array_metadata=True, write_limiter=None,
            result=SaveResult(phases_unix_s=dict(snap.result.phases_unix_s)),
        )

    @contextlib.contextmanager
    def queuing(self, step: int) -> Iterator[None]:
        """Local retention keeps `step` until its replication and peer copies are queued (else
        a forced save after a rewind, older than the newest durable step, went at once)."""
        with self._mu:
            self._queuing.append(step)
        try:
            yield
        finally:
            with self._mu:
                self._queuing.remove(step)

    def run_local(self, snap: Snapshot, after_publish: Callable[[], object] | None = None) -> None:
        """Writes and commits `snap` (a `local_snapshot`) on the local tier (the
        `AsyncSave` runner): the commit sequence of `_commit.Commit` for this process
        alone, with a manifest copy of its own bytes and the local marker. Raises
        SaveError; a failed local save leaves nothing committed locally and is not
        replicated."""
        t0 = time.perf_counter()
        commit = _commit.Commit(self.storage, snap.path, snap.generation, overwrite=True, process_index=snap.process_index)
        try:
            try:
                record = write_snapshot(snap)
            except BaseException as e:
                commit.fail(e)
                raise
            finally:
                release_host(snap)
            n = snap.process_count
            own = [record.bytes_written or 0 if i == snap.process_index else 0 for i in range(n)]
            marker = _tiers.LocalMarker(
                generation=snap.generation, process_index=snap.process_index, process_count=n,
                device_ids=_tiers.own_device_ids(), overwrite=snap.overwrite, committed_unix_s=time.time(),
            )
            # A local replacement (the same step saved again) is always atomic: overwrite=True.
            commit.run(record.bytes_written, lambda _: manifest_bytes(snap, own, own_pack_only=True), marker=marker.to_json(),
                       guard=guard(self.storage, self.root) if snap.incremental else None)
            if snap.saved_arrays:  # the next incremental save's identity check
                remember(snap.storage, snap.path, snap.generation, snap.saved_arrays)
        finally:
            with self._mu:
                self._bases_in_flight.pop(snap.step if snap.step is not None else -1, None)
            if snap.result.lock is not None:
                snap.result.lock.release(remove=True)
                snap.result.lock = None
        snap.result.commit_s = time.perf_counter() - t0
        log.info("step %s committed on the local tier %s (process %d)", snap.step, self.root, snap.process_index)
        _commit.remove_leftovers(self.storage, self.root)  # of failed local saves: not left for recovery
        if self._commits is not None and snap.step is not None:
            self._commits.committed(snap.step, snap.generation, self.local_steps(),  # peers: `_peer_copied` applies it
                                    self.apply_retention if self.peers is None else None)
        self.apply_retention()

    # --- replication --------------------------------------------------------------------

    def enqueue(self, step: int, generation: str, overwrite: bool, local_save=None,
                best_effort: bool = False) -> concurrent.futures.Future:
        """Queues the replication of `step` after its local save (`local_save`, an
        `AsyncSave`, or None when it is committed locally already). `best_effort` (a step
        restored after a node loss, whose replaced processes re-fetch their copies in the
        background): a failure (e.g. a copy that cannot be fetched whole) is logged and
        shown by `status()` only; it does not fail the next saves, which would otherwise
        fail on every restart alike; the step stays local and the next durable save covers it."""
        with self._mu:
            attempt = self._attempts[step] = self._attempts.get(step, -1) + 1
            target = _tiers.ReplicationTarget(
                step=step, local_path=f"{self.root}/{step}", durable_path=f"{self.directory}/{step}",
                generation=generation, attempt=attempt, overwrite=overwrite,
            )
            job = self._queue.submit(self._replicate, target, local_save, best_effort)
            self._jobs[step] = job
        return job

    def durable_due(self, step: int, forced: bool = False) -> bool:
        """Whether local `step` is also replicated to the durable tier (`durable_every_steps`,
        the clock; `forced`: yes, and the clock counts from it); the same on every process."""
        if step % self.durable_every_steps and not forced:
            return False
        if self._durable_clock is not None:
            if not forced and not self._durable_clock.due(step):
                return False
            self._durable_clock.saved()
        return True

    def send_to_peers(self, step: int, generation: str, local_save=None) -> None:
        """Queues the copy of local `step` to its holders on other nodes (after its
        local save, an `AsyncSave` or None), when `peer_copies` > 0."""
        if self.peers is None:
            return

        def local_ok() -> None:
            if local_save is not None:
                local_save.join()
                if local_save.error is not None:
                    raise local_save.error

        self.peers.enqueue(step, generation, self.local_steps, local_ok, self._peer_copied)

    def _peer_copied(self, step: int, copies: int) -> None:
        self.apply_retention()
        _alerts.note_peer_copies(self.durable, self.directory, step, copies, self.local_steps())

    def _replicate(self, target: _tiers.ReplicationTarget, local_save, best_effort: bool = False) -> None:
        if local_save is not None:
            local_save.join()
            if local_save.error is not None:  # surfaced by the manager; tell the others
                _tiers.refuse_replication(
                    target, self.durable, f"the local save of step {target.step} failed: {local_save.error}",
                    commit_timeout_s=self.commit_timeout_s,
                )
                return
        try:
            _tiers.replicate(
                target, self.storage, self.durable, commit_timeout_s=self.commit_timeout_s, limiter=self.limiter,
                after_publish=self._retention_after(target.step),
            )
        except BaseException as e:
            with self._mu:
                self.last_error = f"step {target.step}: {type(e).__name__}: {e}"
            if best_effort:
                log.warning("replicating step %d (restored after a node loss) to %s failed: %s; the local step is kept "
                            "and the next durable save covers it", target.step, self.directory, e)
                return
            log.error("replicating step %d to %s failed: %s; the local step is kept", target.step, self.directory, e)
            self._on_error(target.step, e)
            return
        log.info("step %d replicated and committed on %s", target.step, self.directory)
        self.apply_retention()

    def pending_steps(self) -> set[int]:
        """Steps queued or being replicated."""
        with self._mu:
            return {s for s, j in self._jobs.items() if not j.done()}

    def wait_for_room(self, step: int) -> float:
        """Before saving `step`: waits while the local window (`keep_local`, counting
        `step`) would have to drop a step still being replicated, and while `step` itself
        is (a save of it replaces the local folder its replication reads). Returns seconds
        waited."""
        t0 = time.perf_counter()
        while True:
            with self._mu:
                pending = {s: j for s, j in self._jobs.items() if not j.done()}
            steps = sorted(set(self.local_steps()) | set(pending) | {step})
            kept = self.keep_local.keep(steps, {s: {} for s in steps}) | {step}
            blocking = [s for s in steps if (s not in kept or s == step) and s in pending]
            if not blocking:
                self.waiting = False
                return time.perf_counter() - t0
            self.waiting = True
            log.info("the local tier is full of steps not yet durable: save of step %d waits for step %d", step, blocking[0])
            concurrent.futures.wait([pending[blocking[0]]])

    def wait_all(self) -> None:
        """Waits until every queued replication has finished (committed or failed)."""
        with self._mu:
            jobs = list(self._jobs.values())
        concurrent.futures.wait(jobs)
        if self.peers is not None:
            self.peers.wait_all()
        if self._commits is not None:
            self._commits.wait_all()

    def close(self) -> None:
        self.wait_all()
        self._queue.shutdown(wait=True)
        if self._commits is not None:
            self._commits.close()
        if self.peers is not None:
            self.peers.close()

    # --- retention ----------------------------------------------------------------------

    def local_steps(self) -> list[int]:
        """Steps committed on this process's local tier, ascending."""
        return self.tier.steps()

    def apply_retention(self) -> list[int]:
        """Removes local steps `keep_local` does not keep and that are durable (or older
        than the newest durable step and not being replicated); the newest local step and
        steps being replicated stay. Returns the steps removed.

        Multi-process: this process's local tier only. One call at a time per tier (the
        save thread after a local commit and the replication thread after a durable one
        both call it): the second waits for the first, then sees its deletions.
        """
        with self._retention_mu, guard(self.storage, self.root):  # the guard: a local commit's check of its references
            return self._apply_retention_locked()

    def _apply_retention_locked(self) -> list[int]:
        steps = self.local_steps()
        if not steps:
            return []
        kept = self.keep_local.keep(steps, {s: {} for s in steps}) | {steps[-1]} | self.pending_steps()
        if self.peers is not None:
            kept |= self.peers.pending_steps()
        with self._mu:
            kept |= set(self._bases_in_flight.values()) | set(self._queuing)
        if kept.issuperset(steps):  # nothing may go: no listing of the durable tier (a request on an object store)
            return _tier_references.remove_local(self.storage, self.root, steps, [])
        # Node losses each step survives in the whole job (the fewest checked copies of any
        # process's share), not this process's own count: a step whose own copy is checked but
        # another process's is not survives no node loss, and must not supersede an older one.
        copies = self.peers.job_survives() if self.peers is not None else {}
        # In a job of several processes: only a newer step every process committed.
        everywhere = set(steps) if self._commits is None else self._commits.everywhere()
        durable_folders = _commit.committed_folders(self.durable, self.directory)
        durable_steps = sorted(durable_folders)
        latest_durable = durable_steps[-1] if durable_steps else None
        may_go = []
        for s in steps:
            if s in kept:
                continue
            marker = _tiers.read_marker(self.storage, f"{self.root}/{s}")
            durable = s in durable_steps and marker is not None and (
                _tiers.durable_generation(self.durable, self.directory, s, durable_folders) == marker.generation
            )
            # A newer local step that survives as many node losses (in the whole job) makes
            # this one's bytes a fallback only: the restore resumes from the newer one.
            # Only with a durable schedule (a step whose replication failed too, else failed durable saves
            # fill the tier); by default one whose replication failed stays until a newer step is durable.
            superseded = self.scheduled and any(
                n > s and copies.get(n, 0) >= copies.get(s, 0) and n in everywhere for n in steps)
            if not durable and not (latest_durable is not None and s < latest_durable) and not superseded:
                continue  # the only copy of a step newer than the newest durable one: kept
            may_go.append(s)
        return _tier_references.remove_local(self.storage, self.root, steps, may_go)  # after the steps they reference

    def status(self, latest_durable: int | None) -> TierStatus:
        steps = self.local_steps()
        latest_local = steps[-1] if steps else None
        lag_steps = 0 if latest_local is None else max(0, latest_local - (latest_durable if latest_durable is not None else -1))
        if latest_durable is None and latest_local is not None:
            lag_steps = latest_local
        newer = [s for s in steps if latest_durable is None or s > latest_durable]
        lag_s = 0.0
        if newer:
            marker = _tiers.read_marker(self.storage, f"{self.root}/{newer[0]}")
            if marker is not None:
                lag_s = max(0.0, time.time() - marker.committed_unix_s)
        survives = self.peers.job_survives() if self.peers is not None else {}
        survives = {s: n for s, n in survives.items() if s in steps}
        with self._mu:
            return TierStatus(latest_local, lag_steps, lag_s, self.last_error, self.waiting, survives,
                              self.peers.last_error if self.peers is not None else None, self.last_restore_reason)

    # --- restore ------------------------------------------------------------------------

    def _copy_name(self, step: int) -> str:
        return f"the local copy {self.root}/{step} of step {step} (process {self.process_index}, not on {self.directory})"

    def _read_local_only(self, step: int, target: object, options: RestoreOptions) -> tuple[PyTree | None, str, int]:
        """Reads a local-only step. Returns (tree, "ok", durable bytes), or (None, what
        is damaged, 0) when the copy fails its checks; another error is raised naming
        the copy."""
        view = _tiers.TieredStorage(
            self.storage, f"{self.root}/{step}", self.durable, f"{self.directory}/{step}", durable_committed=False,
        )
        try:
            tree = restore_from(view, f"{self.directory}/{step}", target, options)
        except (CorruptCheckpointError, FileNotFoundError) as e:
            return None, f"{self._copy_name(step)} is damaged: {self._as_local(e, step)}", 0
        except CheckpointError as e:
            raise _naming(e, f"reading {self._copy_name(step)}", self._as_local(e, step)) from e
        return tree, "ok", view.durable_bytes_read

    def _as_local(self, error: BaseException, step: int) -> str:
        """The text of an error of reading local-only `step`: the files it names under
        `DIR/<step>` were read from the local copy (the durable tier has no such step)."""
        durable = re.escape(f"{self.directory}/{step}") + r"(?!\d)"
        return re.sub(durable, lambda _: f"{self.root}/{step}", str(error))

    def _restore_local_only(
        self, target: object, options: RestoreOptions, latest_durable: int | None,
        resume: Callable[..., None] | None, damaged_copies: list[str], below: int | None = None,
        voted: tuple[int, str] | None = None,
    ) -> tuple[PyTree, str, int] | None:
        """`restore(None)`'s local-only steps: the newest one whole on every process, read,
        and (a second vote) intact on every process; a damaged one is skipped for the
        next older one, the same on every process, with a warning naming the damaged
        copies (also added to `damaged_copies`); with `peer_copies`, first (once per step)
        the holders' checked copies serve the damaged shares (`_peer_delivery.restart`).
        None: no local-only step to restore (the newest durable step is next)."""
        needed = _tier_references.needed_keys(self.storage, self.process_index, target, options)
        retried: set[int] = set()
        while True:
            chosen, voted = voted or self._vote_local_step(latest_durable, needed, below), None  # voted: in the peers' round
            if chosen is None:
                return None
            step, generation = chosen
            damaged, tree, durable_bytes = self._read_agreed(step, target, options)
            if damaged:
                damaged_copies.extend(damaged)
                if self.peers is not None and step not in retried:  # every process alike: the outcomes are agreed
                    retried.add(step)
                    restored, below, voted = _peer_delivery.restart(self, target, options, latest_durable, resume,
                                                                    retry=(step, tree is None))
                    if restored is not None:
                        return restored
                    below = step if below is None else below
                    continue
                log.warning(
                    "the local-only step %d cannot be restored: %s; restoring the newest intact step instead",
                    step, "; ".join(damaged),
                )
                below = step
                continue
            log.warning(
                "restored step %d from the local tier: it is committed on the local tier of every process but not "
                "yet on %s (newest durable step: %s); it is replicated now", step, self.directory, latest_durable,
            )
            if resume is not None:
                marker = _tiers.read_marker(self.storage, f"{self.root}/{step}")
                resume(step, generation, bool(marker and marker.overwrite))
            return tree, "local", durable_bytes

    def _vote_local_step(
        self, latest_durable: int | None, needed: Callable[[str], list[str] | None], below: int | None,
    ) -> tuple[int, str] | None:
        """The restore vote: (step, generation) of the local-only step below `below` that
        every process holds whole, or None."""
        votes = _tiers.agree(
            self.directory,
            lambda: _tiers.local_restore_proposal(self.storage, self.root, latest_durable, needed, below=below),
            self.commit_timeout_s,
        )
        if votes[0] != "-" and all(v == votes[0] for v in votes):
            local_step, generation = votes[0].split()
            return int(local_step), generation
        if any(v != "-" for v in votes):
            log.warning(
                "local steps newer than the newest durable step (%s) are not whole on every process (%s); "
                "restoring the newest durable step", latest_durable, votes,
            )
        return None

    def _read_agreed(self, step: int, target: object, options: RestoreOptions) -> tuple[list[str], PyTree | None, int]:
        """Reads local-only `step` and votes on the outcome: (the damaged copies of every
        process, [] when none; the tree; durable bytes read). A read error other than
        damage refuses the vote, so every process raises at once."""
        read: list[tuple[PyTree | None, str, int]] = []

        def outcome() -> str:
            read.append(self._read_local_only(step, target, options))
            return read[0][1]

        outcomes = _tiers.agree(self.directory, outcome, self.commit_timeout_s)
        tree, _, durable_bytes = read[0]
        return [o for o in outcomes if o != "ok"], tree, durable_bytes

    def restore(
        self,
        step: int | None,
        target: object,
        options: RestoreOptions,
        *,
        latest_durable: int | None,
        durable_path: Callable[[int], str],
        resume: Callable[..., None] | None,
    ) -> tuple[PyTree, str, int]:
        """Restores from the local tier where it can (see `CheckpointManager.restore`).

        Returns:
          (tree, source, durable bytes read): source is "local" (every byte from this
          process's local tier), "local+durable" or "durable".
        """
        if step is None:
            below, voted, self.last_restore_reason = None, None, None
            with self._retention_mu, _peers.holding(self.peers):  # no step read is removed or replaced (lock order: `holding`)
                if self.peers is not None:  # a replaced process receives its boxes from its holders
                    restored, below, voted = _peer_delivery.restart(self, target, options, latest_durable, resume)
                    if restored is not None:  # the reason: `_mesh_restart`'s when it combined the copies
                        self.last_restore_reason = self.last_restore_reason or (
                            "the newest local step survived whole: the processes without their own copy received their "
                            "boxes from the processes holding copies")
                        return restored
                damaged: list[str] = []
                local = self._restore_local_only(target, options, latest_durable, resume, damaged, below, voted)
                if local is not None:
                    self.last_restore_reason = (self.last_restore_reason  # set when the holders' copies served
                                                or "the newest local step is whole on every process's own local tier")
                    return local
                # Another mesh, sharding or process count: the surviving copies combined.
                combined, why = _mesh_restart.restart(self, target, options, latest_durable, resume)
            self.last_restore_reason = why
            if combined is not None:
                return combined
            if latest_durable is None and damaged:
                raise CorruptCheckpointError(
                    f"no intact committed step in {self.directory} nor on the local tier of every process: "
                    + "; ".join(damaged) + f". {self.directory} has no committed step to fall back to: restore an "
                    "explicit checkpoint, or start the run afresh"
                )
            if latest_durable is None:
                raise CheckpointNotFoundError(f"no committed step in {self.directory} (nor on every process's local "
                                              f"tier{': ' + why if why else ''})")
            if why:
                log.warning("restoring the newest durable step %d from %s: %s", latest_durable, self.directory, why)
            self.last_restore_reason = (f"the newest durable step {latest_durable} was restored: "
                                        f"{why or 'no process holds a local step newer than it'}")
            step = latest_durable
        else:
            self.last_restore_reason = f"restore(step={step}) names the step"
        path = durable_path(step)
        marker = _tiers.read_marker(self.storage, f"{self.root}/{step}")
        # A retired local copy (incremental saves: kept only for what newer local steps
        # reference) is no copy: its RETIRED marker would hide the durable step behind it.
        if marker is not None and marker.generation == _tiers.durable_generation(self.durable, self.directory, step) \
                and not self.storage.exists(f"{self.root}/{step}/{_format.RETIRED}"):
            view = _tiers.TieredStorage(self.storage, f"{self.root}/{step}", self.durable, path, durable_committed=True)
            try:
                tree = restore_from(view, path, target, options)
                only_local = view.durable_bytes_read == 0 and not view.used_durable_kvstore
                return tree, ("local" if only_local else "local+durable"), view.durable_bytes_read
            except CorruptCheckpointError as e:
                log.warning("the local copy of step %d in %s is damaged (%s); reading it from %s", step, self.root, e, path)
            except CheckpointError as e:
                raise _naming(e, f"reading step {step} from its local copy {self.root}/{step} (process "
                                 f"{self.process_index}) and {path}") from e
        if options.stats is None:
            options = dataclasses.replace(options, stats=RestoreStats())
        assert options.stats is not None
        before = options.stats.bytes_read
        tree = restore_from(self.durable, path, target, options)
        return tree, "durable", options.stats.bytes_read - before

