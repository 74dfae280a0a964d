"""A manager's state, for logs and dashboards: `ManagerStatus`, and the part of
`CheckpointManager` that reports it from what its saves measured (`StatusReporting`:
`status`, `recommend_interval`)."""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import TYPE_CHECKING

from ._reader import StepReader

if TYPE_CHECKING:
    from .._save import AsyncSave, Snapshot
    from ._tier_manager import LocalTier


def write_rate(snap: Snapshot) -> float | None:
    """Bytes per second this process wrote in `snap` (None before it wrote anything)."""
    return snap.result.bytes_written / snap.result.write_s if snap.result.write_s > 0 and snap.result.bytes_written else None


@dataclasses.dataclass(frozen=True)
class ManagerStatus:
    """A manager's state, for logs and dashboards.

    Attributes:
      latest_committed_step: newest committed step, or None.
      step_in_flight: the step being written in the background, or None.
      commit_lag_steps: steps between the newest step handed to `save` and the newest
        committed one (0 when everything is committed).
      last_error: the background error not yet raised, or the last one raised, as text.
      last_snapshot_s: seconds `save` blocked for the last host snapshot.
      last_wait_s: seconds the last `save` waited for the previous save to finish.
      last_write_s: seconds the last finished save spent writing.
      last_commit_s: seconds from the last finished save's snapshot to its commit.
      last_write_bytes_per_s: this process's write throughput of the last finished save
        (bytes written / `last_write_s`), bytes per second.
      latest_local_step: two tiers: the newest step committed on this process's local
        tier (None without a local tier, or when it holds none).
      replication_lag_steps: two tiers: `latest_local_step` minus the newest durable
        step (0 when the durable tier is up to date).
      replication_lag_s: two tiers: seconds since the oldest local step newer than the
        newest durable step committed locally (0.0 when none is).
      last_replication_error: two tiers: the last failed replication, as text.
      waiting_for_replication: two tiers: a `save` is waiting because the local window
        (`keep_local`) is full of steps not yet durable.
      last_restore_source: two tiers: where this process's last `restore` read from:
        "local", "local+durable" or "durable" (None before the first).
      last_restore_durable_bytes: bytes that restore fetched from the durable tier.
      last_restore_reason: two tiers: why the last `restore` read from where it did,
        in words: for a durable step after `restore(None)`, why the local copies did
        not serve it (which step, which processes' shares survive and which are
        missing, or what failed); for a local step, how the local copies served it
        (e.g. combined over the device exchange for another mesh or process count).
        None before the first restore.
      last_write_mode: how this process wrote the last finished save's chunk files:
        "direct" (`O_DIRECT`, local files) or "buffered" (TensorStore); None before the
        first (`direct_io=` of the manager).
      last_write_mode_reason: why that mode (the `direct_io` value and what the probe
        of the file system found).
      node_losses_survived: `peer_copies`: each local step of this process's local tier
        → how many node losses it survives in the whole job: the fewest checked peer
        copies of any process's share (published through the coordination service; a
        process not yet reported counts 0). Durable steps survive any loss and are
        not listed. Empty without peer copies.
      last_peer_error: `peer_copies`: the last failed copy to a peer, as text.
    """

    latest_committed_step: int | None
    step_in_flight: int | None
    commit_lag_steps: int
    last_error: str | None
    last_snapshot_s: float | None
    last_wait_s: float | None
    last_write_s: float | None
    last_commit_s: float | None
    last_write_bytes_per_s: float | None = None
    latest_local_step: int | None = None
    replication_lag_steps: int = 0
    replication_lag_s: float = 0.0
    last_replication_error: str | None = None
    waiting_for_replication: bool = False
    last_restore_source: str | None = None
    last_restore_durable_bytes: int | None = None
    last_write_mode: str | None = None
    last_write_mode_reason: str | None = None
    node_losses_survived: dict[int, int] = dataclasses.field(default_factory=dict)
    last_peer_error: str | None = None
    last_restore_reason: str | None = None


class StatusReporting(StepReader):
    """`CheckpointManager.status` and `recommend_interval`, from the manager's measurements.

    Attributes (set by `CheckpointManager`): the lock `_mu` guarding the others, the
    saves in flight `_in_flight` (step, handle), the newest step handed to `save`
    `_last_requested_step`, the last error `_last_error`, the last save's timings
    `_last`, the last restore's source and durable bytes `_last_restore`, every save's
    snapshot seconds `_snapshot_history_s`, the last save's write mode and why
    `_last_write_mode`, and the local tier `_tiers` (or None).
    """

    _mu: threading.Lock
    _in_flight: list[tuple[int, AsyncSave]]
    _last_requested_step: int | None
    _last_error: str | None
    _last: dict[str, float | None]
    _last_restore: tuple[str | None, int | None]
    _last_write_mode: tuple[str | None, str | None]
    _snapshot_history_s: list[float]
    _tiers: LocalTier | None

    # --- operations ---------------------------------------------------------------------

    def status(self) -> ManagerStatus:
        """The manager's current state (see `ManagerStatus`)."""
        latest = self.latest_step()
        tiers = self._tiers.status(latest) if self._tiers is not None else None
        with self._mu:
            in_flight = [s for s, h in self._in_flight if not h.done()]
            requested = self._last_requested_step
            if requested is None:
                lag = 0
            elif latest is None:
                lag = requested
            else:
                lag = max(0, requested - latest)
            return ManagerStatus(
                latest_committed_step=latest,
                step_in_flight=in_flight[-1] if in_flight else None,
                commit_lag_steps=lag,
                last_error=self._last_error,
                last_snapshot_s=self._last["snapshot_s"],
                last_wait_s=self._last["wait_s"],
                last_write_s=self._last["write_s"],
                last_commit_s=self._last["commit_s"],
                last_write_bytes_per_s=self._last["write_bytes_per_s"],
                latest_local_step=tiers.latest_local_step if tiers else None,
                replication_lag_steps=tiers.replication_lag_steps if tiers else 0,
                replication_lag_s=tiers.replication_lag_s if tiers else 0.0,
                last_replication_error=tiers.last_replication_error if tiers else None,
                waiting_for_replication=tiers.waiting_for_replication if tiers else False,
                last_restore_source=self._last_restore[0],
                last_restore_durable_bytes=self._last_restore[1],
                last_write_mode=self._last_write_mode[0],
                last_write_mode_reason=self._last_write_mode[1],
                node_losses_survived=tiers.node_losses_survived if tiers else {},
                last_peer_error=tiers.last_peer_error if tiers else None,
                last_restore_reason=tiers.last_restore_reason if tiers else None,
            )

    def recommend_interval(self, mtbf_s: float) -> float:
        """The checkpoint interval that minimises expected lost time, in seconds.

        Young's first-order optimum T = sqrt(2·δ·M) (Young 1974; Daly 2006), with δ the
        measured blocking cost of a save (median `save` snapshot seconds of this
        manager) and M the mean time between failures. Never shorter than the measured
        time for a save to commit, since saves cannot overlap more than
        `max_saves_in_flight`.

        Args:
          mtbf_s: mean time between failures of the whole job, seconds (> 0).
        Returns:
          Seconds between checkpoints.
        Raises:
          ValueError: no save has been measured yet, or `mtbf_s` <= 0.
        """
        if not mtbf_s > 0:
            raise ValueError(f"mtbf_s must be > 0, got {mtbf_s!r}")
        with self._mu:
            history = sorted(self._snapshot_history_s)
            commit_s = self._last["commit_s"]
        if not history:
            raise ValueError("no save measured yet: call save() at least once before recommend_interval()")
        delta_s = history[len(history) // 2]
        return max(math.sqrt(2.0 * delta_s * mtbf_s), commit_s or 0.0)
