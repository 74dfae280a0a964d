"""Multi-process coordination through JAX's distributed runtime (`jax.distributed`).

Only the coordination service's key-value store is used (`key_value_set`,
`blocking_key_value_get`), never a device collective, so every function here is safe to
call from a background thread. With one process every function is a cheap no-op.
"""

from __future__ import annotations

import time

import jax

from ._errors import CommitTimeoutError, SaveError

DEFAULT_COMMIT_TIMEOUT_S = 600.0
_PREFIX = "checkpointer"


def _client():
    from jax._src import distributed  # the client of jax.distributed.initialize()

    return distributed.global_state.client


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


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

        Raises:
          CommitTimeoutError: some processes did not report within the timeout; the
            message lists them.
          SaveError: a process reported an error.
        """
        if self._client is None:
            return []
        deadline = time.monotonic() + self.timeout_s
        summaries, missing = [], []
        for i in range(self.process_count):
            remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                value = self._client.blocking_key_value_get(self._key("done", i), remaining_ms)
            except Exception:
                missing.append(i)
                continue
            if value.startswith("error:"):
                raise SaveError(f"process {i} failed to write its shards: {value[6:]}")
            summaries.append(value[3:])
        if missing:
            raise CommitTimeoutError(
                f"processes {missing} did not report their shards durable within {self.timeout_s:.0f} s "
                f"(generation {self.generation}); nothing was committed. Check that every process called "
                "save for this step and is alive, or raise commit_timeout_s."
            )
        return summaries

    def announce_commit(self, outcome: str) -> None:
        """Process 0: tells the others the outcome (`"ok"` or an error message)."""
        if self._client is not None:
            self._client.key_value_set(self._key("committed"), outcome)

    def wait_commit(self) -> None:
        """Processes other than 0: wait for process 0's commit.

        Raises:
          CommitTimeoutError: process 0 did not announce within the timeout.
          SaveError: process 0 announced a failure.
        """
        if self._client is None:
            return
        try:
            outcome = self._client.blocking_key_value_get(self._key("committed"), int(self.timeout_s * 1000))
        except Exception as e:
            raise CommitTimeoutError(
                f"process 0 did not commit generation {self.generation} within {self.timeout_s:.0f} s: {e}"
            ) from e
        if outcome != "ok":
            raise SaveError(f"process 0 could not commit: {outcome}")


def agree_on(name: str, value_if_process0: str, *, timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S) -> str:
    """Returns process 0's `value_if_process0` on every process (for the generation id).

    Every process must call it with the same `name`, in the same order.
    """
    if process_count() == 1:
        return value_if_process0
    client = _client()
    key = f"{_PREFIX}/agree/{name}"
    if process_index() == 0:
        client.key_value_set(key, value_if_process0)
        return value_if_process0
    try:
        return client.blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:
        raise CommitTimeoutError(f"process 0 did not start save {name!r} within {timeout_s:.0f} s: {e}") from e
