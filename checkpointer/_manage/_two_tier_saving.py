"""The manager's save onto two tiers (a base of `CheckpointManager`, as `StepRestoring`
is): the local commit, the copies to peers and the durable replication of one save.

The manager's keyword arguments of the schedule (documented here, used by `LocalTier`):

- `peer_copies`: each local step is also held by this many processes on other nodes
  (checked copies over TCP, in the background): a restart after losing that many nodes
  resumes from it (`status().node_losses_survived`; docs/tiers_and_peers.md). 0: none.
- `peer_node`: this process's node name (default: its host name) for `peer_copies`;
  processes with one name never hold each other's copies.
- `durable_every_steps`, `durable_every_s`: replicate only every n-th local step (and
  at least s seconds apart, agreed) to the durable directory; 1 and None, the defaults,
  replicate every local step (the behaviour before schedules). `force=True` and the
  preemption save always go durable, and `durable_every_s` then counts from them.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from .._save import AsyncSave, Snapshot

if TYPE_CHECKING:
    from ._tier_manager import LocalTier


class TwoTierSaving:
    """`_save_two_tiers` of `CheckpointManager` (it reads the manager's attributes below)."""

    _mu: threading.Lock
    _tiers: LocalTier | None
    _in_flight: list[tuple[int, AsyncSave]]
    _last: dict[str, float | None]
    _last_write_mode: tuple[str | None, str | None]
    async_save: bool

    if TYPE_CHECKING:

        def _on_finish(self, step: int, handle: AsyncSave) -> None: ...

        def _failed(self, step: int, error: BaseException) -> None: ...

        def _raise_pending(self) -> None: ...

    def _save_two_tiers(self, step: int, snap: Snapshot, durable: bool = True) -> None:
        """Commits `snap` on the local tier (in the background unless `async_save=False`),
        queues its copies to peers and (when `durable`) its replication, in `save` order
        on every process."""
        tiers = self._tiers
        assert tiers is not None
        with tiers.queuing(step):  # local retention keeps the step until its replication is queued
            if self.async_save:
                handle = AsyncSave(snap, on_finish=lambda h: self._on_finish(step, h), runner=tiers.run_local)
                with self._mu:
                    self._in_flight.append((step, handle))
                tiers.send_to_peers(step, snap.generation, handle)
                if durable:
                    tiers.enqueue(step, snap.generation, snap.overwrite, handle)
                return
            t0 = time.perf_counter()
            try:
                tiers.run_local(snap)
            except BaseException as e:
                self._failed(step, e)
                tiers.send_to_peers(step, snap.generation, _FailedSave(e))  # the others' copies wait for its count
                raise
            tiers.send_to_peers(step, snap.generation)
            replicated = tiers.enqueue(step, snap.generation, snap.overwrite) if durable else None
        if replicated is not None:
            replicated.result()
        with self._mu:
            self._last["write_s"], self._last["commit_s"] = snap.result.write_s, time.perf_counter() - t0
            self._last_write_mode = (snap.result.write_mode, snap.result.write_mode_reason)
        self._raise_pending()


def check_copies(copies: object) -> int:
    """`peer_copies` as an int >= 0, or ValueError."""
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 0:
        raise ValueError(f"peer_copies must be an int >= 0 (copies of each local step on other nodes), got {copies!r}")
    return copies


class _FailedSave:
    """A local save that failed in the caller's thread, as `LocalTier.send_to_peers` takes one."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def join(self) -> None:
        pass
