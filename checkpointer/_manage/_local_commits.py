"""The job-wide record of local commits, for local retention in a job of several processes.

With a durable schedule (`durable_every_steps` > 1 or `durable_every_s`) and no peer
copies, a local-only step (newer than the newest durable step) is the only copy of its
share. A newer local step supersedes it only once every process has committed the newer
one: a process that dropped its share of step 11 as soon as it alone had committed 12
lost step 11 for the job when another process died before committing 12 (the restart
then found no step whole on every process and resumed from the durable one). With peer
copies the same holds where the job-wide copy counts tie at 0 (no holder took a copy:
every process on one node, or failed copies), so the record is kept with peers too.

Each process publishes the local steps it committed in this run, with their generations,
in the coordination service's key-value store under
`checkpointer/local-commits/<tag>/<process>` (`{"<step>": "<generation>"}`; `tag` hashes
the manager's directory); `everywhere()` reads every process's record. After each local
commit a background thread waits until every process has recorded the step, or a newer
one, or until the step left this process's record (a newer commit's wait takes over),
then applies local retention again. It gives up `timeout_s` after the commit (not after
the wait starts: the waits queue on one thread, and the waits of a process that never
records share one timeout); then it does nothing, so the older step stays until a later
commit is recorded everywhere (or a newer step is durable).
Nothing here issues a device collective: only the key-value store, on background threads.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .. import _coord

log = logging.getLogger("checkpointer")


class LocalCommits:
    """This process's part of the job-wide record of local commits of one manager.

    Args:
      directory: the manager's directory (names the keys).
      timeout_s: how long the wait after a local commit lasts at most, seconds.
      client: the coordination service's client (default: `jax.distributed`'s).
      process_index, process_count: this process and the job's size (default: JAX's).
    """

    def __init__(self, directory: str, timeout_s: float, *, client: Any = None, process_index: int | None = None,
                 process_count: int | None = None) -> None:
        self.timeout_s = timeout_s
        self.process_index = _coord.process_index() if process_index is None else process_index
        self.process_count = _coord.process_count() if process_count is None else process_count
        self._client = _coord.client() if client is None else client
        self._prefix = f"checkpointer/local-commits/{hashlib.sha256(directory.encode()).hexdigest()[:12]}"
        self._own: dict[int, str] = {}  # step -> generation, committed by this process in this run
        self._mu = threading.Lock()
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpointer-local-commits")
        self._jobs: list[concurrent.futures.Future] = []

    def committed(self, step: int, generation: str, held: Iterable[int], then: Callable[[], object] | None) -> None:
        """Records local `step` (of `generation`) as committed by this process (`held`: the
        steps its local tier still holds; the others leave the record), and calls `then`
        in the background once every process has recorded it or a newer step, or once
        `step` left this record; not when `timeout_s` (from now) passes first. `then`
        None: no wait (with peer copies, the retention after the step's copy job runs once
        every process has finished that job, so after every process recorded its commit)."""
        deadline = time.monotonic() + self.timeout_s
        held = set(held)
        with self._mu:
            self._own = {s: g for s, g in self._own.items() if s in held}
            self._own[step] = generation
            record = json.dumps({str(s): g for s, g in self._own.items()})
            self._jobs = [j for j in self._jobs if not j.done()]
        try:
            self._client.key_value_set(f"{self._prefix}/{self.process_index}", record, allow_overwrite=True)
        except Exception as e:  # the older local steps stay: retention never drops them on this record
            log.warning("could not record the local commit of step %d (process %d): %s", step, self.process_index, e)
            return
        if then is None:
            return
        job = self._waiter.submit(self._wait_then, step, deadline, then)
        with self._mu:
            self._jobs.append(job)

    def everywhere(self) -> set[int]:
        """This process's committed local steps that every process has recorded as committed
        at the same generation (one read of the key-value store; unreadable: none)."""
        with self._mu:
            own = dict(self._own)
        found = _coord.records(self._client, self._prefix)
        if found is None:
            return set()
        per = {p: r for p, r in found.items() if isinstance(r, dict)}
        others = [p for p in range(self.process_count) if p != self.process_index]
        return {s for s, g in own.items() if all(per.get(p, {}).get(str(s)) == g for p in others)}

    def _settled(self, step: int) -> bool:
        """Whether the wait after `step` is over: `step` or a newer step of this process is
        recorded everywhere (retention may let it supersede the older ones), or `step` left
        this process's record (it can never be everywhere; the newer commit's wait goes on).
        Before, a wait for a step that had left the records ran out its timeout while the
        later waits queued behind it, and timed out in turn (review44)."""
        with self._mu:
            if step not in self._own:
                return True
        return any(s >= step for s in self.everywhere())

    def _wait_then(self, step: int, deadline: float, then: Callable[[], object]) -> None:
        if not _coord.poll(lambda: self._settled(step), deadline, clock=time):
            log.info("not every process recorded the local commit of step %d within %.0f s: the older local "
                     "steps stay", step, self.timeout_s)
            return
        try:
            then()
        except Exception as e:  # a later commit applies retention again
            log.warning("local retention after step %d was committed on every process failed: %s", step, e)

    def wait_all(self) -> None:
        """Waits for the waits in flight (at most `timeout_s` after the last commit)."""
        with self._mu:
            jobs = list(self._jobs)
        concurrent.futures.wait(jobs)

    def close(self) -> None:
        self.wait_all()
        self._waiter.shutdown(wait=True)
