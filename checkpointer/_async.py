"""`AsyncSave`: the handle of a save whose write and commit run on a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ._save import Snapshot, run_background


class AsyncSave:
    """A save in flight. Created by `save_async` once the host snapshot is taken.

    Two moments matter (as in `jax.experimental.array_serialization`): the snapshot,
    after which the caller may donate or change the arrays (already past when you hold
    this handle), and the commit, which `wait()` waits for.
    """

    def __init__(
        self,
        snap: Snapshot,
        *,
        on_finish: Callable[[AsyncSave], None] | None = None,
        after_publish: Callable[[], object] | None = None,
    ) -> None:
        self.snapshot = snap
        self.path = snap.path
        self.error: BaseException | None = None
        self.started_s = time.monotonic()
        self.finished_s: float | None = None
        self._on_finish = on_finish
        self._after_publish = after_publish
        # Not a daemon: the interpreter waits for it at exit, so a program that ends
        # right after `save` (without `wait()` or `close()`) still commits its last save.
        self._thread = threading.Thread(target=self._run, name=f"checkpointer-save-{snap.generation}", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        try:
            run_background(self.snapshot, self._after_publish)
        except BaseException as e:  # surfaced by wait()
            self.error = e
        finally:
            self.finished_s = time.monotonic()
            if self._on_finish is not None:
                self._on_finish(self)

    def done(self) -> bool:
        """Whether the background work has finished (committed or failed)."""
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Waits until the background work has finished, without raising its error.

        Args:
          timeout: seconds to wait at most; None waits for as long as it takes.
        Returns:
          Whether it has finished (committed or failed; see `error`).

        Multi-process: as `wait`.
        """
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until committed.

        Args:
          timeout: seconds to wait at most; None waits for as long as it takes.
        Raises:
          TimeoutError: still running after `timeout` seconds (the save goes on).
          CheckpointError (SaveError, CommitTimeoutError, ...): the background failed;
            nothing was committed.

        Multi-process: each process waits for its own part; process 0's wait returns
        after the commit, the others' after process 0 announced it.
        """
        if not self.join(timeout):
            raise TimeoutError(f"save of {self.path} still running after {timeout} s")
        if self.error is not None:
            raise self.error

    @property
    def commit_s(self) -> float | None:
        """Seconds from the end of the snapshot to the end of the commit, once done."""
        return None if self.finished_s is None else self.finished_s - self.started_s

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self.error else "committed")
        return f"AsyncSave({self.path!r}, {state})"
