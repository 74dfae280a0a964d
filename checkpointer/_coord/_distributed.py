"""Multi-process coordination through JAX's distributed runtime (`jax.distributed`).

Only the coordination service's key-value store is used (`key_value_set`,
`blocking_key_value_get`), never a device collective, so every function here is safe to
call from a background thread. With one process every function is a cheap no-op.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from .._errors import CommitTimeoutError, SaveError

DEFAULT_COMMIT_TIMEOUT_S = 600.0
# Extra time processes other than 0 allow process 0 to publish (manifest, marker, rename).
PUBLISH_MARGIN_S = 60.0
_PREFIX = "checkpointer"


def _client() -> Any:  # Any: jaxlib's DistributedRuntimeClient has no stubs
    from jax._src import distributed  # the client of jax.distributed.initialize()

    return distributed.global_state.client


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def poll_reports(client: Any, prefix: str, deadline: float, done: Callable[[dict[int, str]], bool]) -> dict[int, str]:
    """Polls the per-process keys `<prefix><i>` until `done(reports)` or the deadline.

    Args:
      client: the coordination service's client (`_client()`).
      prefix: the key prefix, ending in "/".
      deadline: when to give up, `time.monotonic()` seconds.
      done: called with the reports of each poll; True ends the wait.
    Returns:
      The last poll's reports: process index -> value. Keys whose last part is no
      index are skipped; an unreachable service reads as no reports.

    One `key_value_dir_get` per poll, 5 ms apart at first, doubling up to 100 ms, so
    a report is seen soon after it lands, whichever processes are still silent.
    """
    pause = 0.005
    while True:
        try:
            entries = client.key_value_dir_get(prefix)
        except Exception:  # the service is unreachable: the reports count as missing
            entries = []
        reports: dict[int, str] = {}
        for key, value in entries:
            try:
                reports[int(key.rsplit("/", 1)[1])] = value
            except ValueError:
                continue
        if done(reports) or time.monotonic() >= deadline:
            return reports
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.1)


class Coordinator:
    """Key-value rendezvous of one save attempt (`generation`) across processes.

    Call order: every process calls `report_done` (or `report_error`); process 0 calls
    `wait_all_done`, commits, then `announce_commit`; other processes call
    `wait_commit`. Each wait has a timeout and names the processes that did not answer.
    """

    def __init__(self, generation: str, *, timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S):
        self.generation = generation
        self.timeout_s = timeout_s
        self.process_index = process_index()
        self.process_count = process_count()
        self._client = _client() if self.process_count > 1 else None

    def _key(self, *parts: object) -> str:
        return "/".join([_PREFIX, self.generation, *map(str, parts)])

    def report_done(self, summary: str) -> None:
        """Tells process 0 this process's shards are durable (`summary`: its JSON record)."""
        if self._client is not None:
            self._client.key_value_set(self._key("done", self.process_index), "ok:" + summary)

    def report_error(self, message: str) -> None:
        """Tells the others this process failed, so they stop waiting early."""
        if self._client is not None:
            try:
                self._client.key_value_set(self._key("done", self.process_index), "error:" + message)
            except Exception:  # the service itself may be gone; the others time out
                pass

    def wait_all_done(self) -> list[str]:
        """Process 0: waits for every process's report; returns their summaries in order.

        Polls all reports at once, so an error reported by any process is raised as soon
        as it arrives, whichever processes are still writing.

        Raises:
          CommitTimeoutError: some processes did not report within the timeout; the
            message lists them.
          SaveError: a process reported an error.
        """
        if self._client is None:
            return []
        reports = poll_reports(
            self._client, self._key("done") + "/", time.monotonic() + self.timeout_s,
            lambda r: any(v.startswith("error:") for v in r.values()) or not self._silent(r),
        )
        for i, value in sorted(reports.items()):
            if value.startswith("error:"):
                raise SaveError(f"process {i} failed to write its shards: {value[6:]}")
        missing = self._silent(reports)
        if not missing:
            return [reports[i][3:] for i in range(self.process_count)]
        raise CommitTimeoutError(
            f"processes {missing} did not report their shards durable within {self.timeout_s:.0f} s "
            f"(generation {self.generation}); nothing was committed. Check that every process called "
            "save for this step and is alive, or raise commit_timeout_s."
        )

    def wait_all_reported(self, timeout_s: float) -> list[int]:
        """Process 0, after a failure: waits until every process has reported (ok or
        error) so no one is still writing into the partial folder; returns the
        processes still silent at the deadline."""
        if self._client is None:
            return []
        reports = poll_reports(self._client, self._key("done") + "/", time.monotonic() + timeout_s, lambda r: not self._silent(r))
        return self._silent(reports)

    def _silent(self, reports: dict[int, str]) -> list[int]:
        """The processes without a report in `reports`."""
        return [i for i in range(self.process_count) if i not in reports]

    def announce_commit(self, outcome: str) -> None:
        """Process 0: tells the others the outcome (`"ok"` or an error message)."""
        if self._client is not None:
            self._client.key_value_set(self._key("committed"), outcome)

    def wait_commit(self) -> None:
        """Processes other than 0: wait for process 0's commit.

        First waits for process 0's own report (its shards written, or its error), then
        for its announcement. Process 0 waits up to the timeout for the others only
        once its own shards are written, so the second wait allows the timeout plus
        `PUBLISH_MARGIN_S` for the manifest, the marker and the rename.

        Raises:
          CommitTimeoutError: process 0 did not report or announce in time.
          SaveError: process 0 failed to write its shards or to commit.
        """
        if self._client is None:
            return
        try:
            report = self._client.blocking_key_value_get(self._key("done", 0), int(self.timeout_s * 1000))
        except Exception as e:
            raise CommitTimeoutError(
                f"process 0 did not finish writing its shards of generation {self.generation} within "
                f"{self.timeout_s:.0f} s: {e}"
            ) from e
        if report.startswith("error:"):
            raise SaveError(f"process 0 failed to write its shards, nothing was committed: {report[6:]}")
        wait_s = self.timeout_s + PUBLISH_MARGIN_S
        try:
            outcome = self._client.blocking_key_value_get(self._key("committed"), int(wait_s * 1000))
        except Exception as e:
            raise CommitTimeoutError(
                f"process 0 did not commit generation {self.generation} within {wait_s:.0f} s: {e}"
            ) from e
        if outcome != "ok":
            raise SaveError(f"process 0 could not commit: {outcome}")

