"""How many node losses each local step survives in the whole job (`node_losses_survived`),
counted per save attempt.

Every process publishes, after each copy job of its own (`PeerService._send`), the copies
its holders checked of each of its local steps, keyed by the step's save attempt: its
generation (`_format.new_generation`, process 0's, agreed on in the save, so the same on
every process and in every process's local marker). It also names the attempts whose copy
jobs it has finished (the last `SENT_KEPT`). A copy job then waits (`wait_counted`) until
every process has finished the same attempt, and local retention judges by the job's
counts (`job_survives`): a process's count counts only for the attempt that this process's
local copy of the step is. So the counts of an earlier attempt of the same step (a
`force=True` re-save, a rewind) neither end the wait for the new attempt nor make it
survive a node loss it does not.

Key-value store: `checkpointer/peers/<tag>/copies/<i>` = `{"copies": {step: [generation,
copies]}, "sent": [generation, ...]}`, one key per process, overwritten: an attempt's
count is replaced by the next attempt of its step, and dropped with the step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from .. import _coord
from .._storage import LocalStorage
from ._tier import LocalStepTier

log = logging.getLogger("checkpointer")

# Attempts each process names as finished. A wait for an attempt older than the last
# `SENT_KEPT` of another process ends at its timeout instead (late, never on stale counts).
SENT_KEPT = 64

_Published = dict[int, tuple[dict[int, tuple[str, int]], set[str]]]  # process → (step → (generation, copies), sent)


class CopyCounts:
    """This process's counts of checked copies of its own local steps, and the job's.

    Args:
      client: the coordination service's client; None in a job of one process.
      prefix: the key-value folder of the counts (`.../copies`; process `i` writes `<prefix>/<i>`).
      process_index, process_count: this process and the job's processes.
      local_root: this process's local tier (whose markers name each step's attempt).
      timeout_s: how long `wait_counted` waits for the other processes, seconds.
    """

    def __init__(self, client: Any, prefix: str, process_index: int, process_count: int, local_root: str,
                 timeout_s: float) -> None:
        self._client, self._prefix = client, prefix
        self._process_index, self._process_count = process_index, process_count
        self._local_root, self._timeout_s = local_root, timeout_s
        self._mu = threading.Lock()
        self._copies: dict[int, tuple[str, int]] = {}  # own step → (its attempt, copies checked by their holders)
        self._sent: list[str] = []  # the attempts whose copy jobs ended, oldest first

    def finished(self, step: int, generation: str, copies: int, keep: Iterable[int]) -> None:
        """Records that this process's copy job of `step`'s attempt `generation` ended with
        `copies` checked copies (0: its local save failed), forgets the steps not in
        `keep` (the local steps), and publishes. Not a collective."""
        with self._mu:
            self._copies[step] = (generation, copies)
            for s in set(self._copies) - set(keep) - {step}:
                del self._copies[s]
            self._sent = [*(g for g in self._sent if g != generation), generation][-SENT_KEPT:]
            value = json.dumps({"copies": {str(s): [g, n] for s, (g, n) in self._copies.items()}, "sent": self._sent})
        if self._client is None:
            return
        try:
            self._client.key_value_set(f"{self._prefix}/{self._process_index}", value, allow_overwrite=True)
        except Exception as e:  # diagnostics and retention only: the others' waits end at their timeout
            log.warning("could not publish the peer copies of process %d: %s", self._process_index, e)

    def verified(self) -> dict[int, tuple[str, int]]:
        """Own local step → (the attempt counted, copies checked by holders on other nodes)."""
        with self._mu:
            return dict(self._copies)

    def _published(self) -> _Published | None:
        """Every process's published counts; None: no job (one process), or unreadable."""
        found = _coord.records(self._client, self._prefix)
        if found is None:
            return None
        per: _Published = {}
        for p, obj in found.items():
            with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError, IndexError):  # malformed: no count
                per[p] = ({int(s): (str(c[0]), int(c[1])) for s, c in obj["copies"].items()}, {str(g) for g in obj["sent"]})
        return per

    def wait_counted(self, generation: str) -> None:
        """Waits (at most `timeout_s`) until every process has published the end of its copy
        job of the attempt `generation` (each publishes after its own send, or its failed
        local save). Not a collective: the key-value store only."""
        def counted() -> bool:
            per = self._published()
            return per is None or all(generation in per.get(p, ({}, set()))[1] for p in range(self._process_count))

        _coord.poll(counted, time.monotonic() + self._timeout_s, clock=time)

    def job_survives(self) -> dict[int, int]:
        """Own local step → node losses it survives in the whole job: the fewest checked
        copies of any process's share of the attempt this process's local copy of the
        step is. A process that has not reported that attempt counts 0 (its count is of an
        earlier attempt, or none), and so does a step whose local copy is an attempt whose
        copies are not counted yet (a re-save in flight)."""
        local = LocalStepTier(LocalStorage(), self._local_root)
        mine = {s: (g, n if local.generation(s) == g else 0) for s, (g, n) in sorted(self.verified().items())}
        per = self._published()
        if per is None:
            return {s: n for s, (_, n) in mine.items()}
        others = [per.get(p, ({}, set()))[0] for p in range(self._process_count) if p != self._process_index]
        return {s: min([n] + [c[s][1] if s in c and c[s][0] == g else 0 for c in others]) for s, (g, n) in mine.items()}
