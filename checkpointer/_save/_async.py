"""`AsyncSave`: the handle of a save whose write and commit run on a background thread;
a `concurrent.futures.Future` resolved when the save is committed (or failed)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Callable

from .._encoding import lower_workers
from ._pipeline import Snapshot, run_background

log = logging.getLogger("checkpointer")

# The nice value the direct writer's threads of a background save add to their own
# (Linux: per thread; `_write.lower_workers`; the background thread itself keeps the
# caller's, so that the process-wide pools it may start, TensorStore's, are not left
# lowered for blocking saves and restores): a training step that keeps the
# cores busy (a CPU backend, a busy data loader) keeps them, and the write takes the
# time they leave. Measured in train_loss_bench (3 runs each, fresh 960 MiB state):
# training time lost per checkpoint 0.74 s/GiB (manager) at +0, 0.53 at +10, 0.43 at +19.
# +10 keeps about a tenth of a core for the save against one busy nice-0 thread
# (CFS weights 110 : 1024), so a loop that waits for it is not starved as at +19 (15).
BACKGROUND_NICE = 10


class _Outcome:
    """What the handle's finalizer needs to know: text and flags only, never the error
    object (its traceback reaches the handle and the manager, which the finalizer
    registry would then keep alive forever)."""

    def __init__(self, path: str, observed: bool):
        self.path = path
        self.error_text: str | None = None
        self.finished_s: float | None = None
        self.observed = observed  # a wait() raised it, or a manager reports it
        self.abandoned = False  # the handle was garbage-collected
        self.lock = threading.Lock()

    def log_unobserved(self) -> None:
        """Logs the failure at ERROR unless someone saw it already (call under `lock`)."""
        if self.error_text is not None and not self.observed:
            self.observed = True
            log.error("save_async of %s failed and nobody called wait() on it: %s; nothing was committed",
                      self.path, self.error_text)


# Handles with done-callbacks still to run: held here until resolved, so that a caller who
# keeps no reference (`save_async(...).add_done_callback(fn)`) still gets `fn` called, as
# from any concurrent.futures executor (the save thread holds its handle only weakly).
_AWAITING_CALLBACKS: set[AsyncSave] = set()
_AWAITING_LOCK = threading.Lock()


def _report_unobserved(outcome: _Outcome) -> None:
    """The handle's finalizer (garbage collection, or interpreter exit after the
    non-daemon save thread ended): a failure no `wait()` raised is logged at ERROR; a
    save still running logs its own failure later."""
    with outcome.lock:
        outcome.abandoned = True
        outcome.log_unobserved()


def _run(
    snap: Snapshot,
    outcome: _Outcome,
    after_publish: Callable[[], object] | None,
    handle_ref: Callable[[], AsyncSave | None],
    on_finish: Callable[[AsyncSave], None] | None,
    runner: Callable[[Snapshot, Callable[[], object] | None], None],
) -> None:
    """The background thread: write and commit, then record the outcome (at a lower
    CPU priority for the direct writer's threads: `BACKGROUND_NICE`)."""
    lower_workers(BACKGROUND_NICE)
    try:
        runner(snap, after_publish)
    except BaseException as e:  # surfaced by wait(), else logged (see _Outcome)
        _finish(outcome, handle_ref, on_finish, e)
    else:
        _finish(outcome, handle_ref, on_finish, None)


def _finish(
    outcome: _Outcome,
    handle_ref: Callable[[], AsyncSave | None],
    on_finish: Callable[[AsyncSave], None] | None,
    error: BaseException | None,
) -> None:
    # A frame of its own: the handle must not be a local of `_run`, whose frame the
    # error's traceback keeps.
    handle = handle_ref()
    if handle is not None:
        handle._error = error
    with outcome.lock:
        outcome.finished_s = time.monotonic()
        if error is not None:
            outcome.error_text = f"{type(error).__name__}: {error}"
            if outcome.abandoned:
                outcome.log_unobserved()
    try:
        if on_finish is not None and handle is not None:
            on_finish(handle)
    finally:
        # Resolved last: a done-callback or `result()` sees the manager's bookkeeping done.
        if handle is not None:
            try:
                if error is None:
                    handle.set_result(handle.path)
                else:
                    handle.set_exception(error)
            finally:
                with _AWAITING_LOCK:
                    _AWAITING_CALLBACKS.discard(handle)


class AsyncSave(concurrent.futures.Future[str]):
    """A save in flight. Created by `save_async` once the host snapshot is taken.

    Two moments matter (as in `jax.experimental.array_serialization`): the snapshot,
    after which the caller may donate or change the arrays (already past when you hold
    this handle), and the commit, which `wait()` waits for.

    It is a `concurrent.futures.Future` (as torch's `async_save` returns), resolved
    when the background work ends: `result(timeout)` returns the checkpoint path once
    committed and raises the save's error (`SaveError`, ...) otherwise; `exception()`,
    `add_done_callback(fn)` (called on the save thread, or at once when done),
    `done()`, and `concurrent.futures.wait` / `as_completed` work as for any future.
    It is running from the start, so `cancel()` returns False: a save in flight is
    not cancelled. `wait()` and `error` are the library's own, as before.
    """

    def __init__(
        self,
        snap: Snapshot,
        *,
        on_finish: Callable[[AsyncSave], None] | None = None,
        after_publish: Callable[[], object] | None = None,
        runner: Callable[[Snapshot, Callable[[], object] | None], None] = run_background,
    ) -> None:
        super().__init__()
        self.set_running_or_notify_cancel()  # running: cancel() is refused
        self.snapshot = snap
        self.path = snap.path
        self.started_s = time.monotonic()
        self._error: BaseException | None = None
        # A manager's saves (on_finish given) are reported by the manager; a bare
        # save_async's failure is logged if no wait() raised it by the time the handle
        # is collected or the interpreter exits (after this non-daemon thread ended).
        self._outcome = _Outcome(self.path, observed=on_finish is not None)
        weakref.finalize(self, _report_unobserved, self._outcome)
        # Not a daemon: the interpreter waits for it at exit, so a program that ends
        # right after `save` (without `wait()` or `close()`) still commits its last save.
        # The thread refers to the handle only weakly: the error's traceback keeps the
        # thread's frames, and through them it must not keep the handle alive.
        self._thread = threading.Thread(
            target=_run, args=(snap, self._outcome, after_publish, weakref.ref(self), on_finish, runner),
            name=f"checkpointer-save-{snap.generation}", daemon=False,
        )
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """The background error once failed (None while running or when committed)."""
        return self._error

    @property
    def finished_s(self) -> float | None:
        """`time.monotonic()` when the background work ended, None while it runs."""
        return self._outcome.finished_s

    def done(self) -> bool:
        """Whether the background work has finished (committed or failed): the future
        is resolved."""
        return super().done()

    def result(self, timeout: float | None = None) -> str:
        """The checkpoint path, once committed (`concurrent.futures.Future.result`).

        Args:
          timeout: seconds to wait at most; None waits for as long as it takes.
        Raises:
          TimeoutError: still running after `timeout` seconds (the save goes on).
          CheckpointError (SaveError, CommitTimeoutError, ...): the background failed;
            nothing was committed.

        Multi-process: as `wait`.
        """
        try:
            return super().result(timeout)
        except BaseException as e:
            if e is self._error:
                self._observed()
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The background error once failed, None once committed (waits as `result`)."""
        error = super().exception(timeout)
        if error is not None:
            self._observed()
        return error

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future[str]], object]) -> None:
        """Calls `fn(self)` once resolved (on the save thread), or at once if done; the
        handle is kept until then even if the caller drops it."""
        if not self.done():
            with _AWAITING_LOCK:
                _AWAITING_CALLBACKS.add(self)
            if self.done():  # resolved meanwhile: nothing left to keep it for
                with _AWAITING_LOCK:
                    _AWAITING_CALLBACKS.discard(self)
        super().add_done_callback(fn)

    def _observed(self) -> None:
        with self._outcome.lock:
            self._outcome.observed = True

    def join(self, timeout: float | None = None) -> bool:
        """Waits until the background work has finished, without raising its error.

        Args:
          timeout: seconds to wait at most; None waits for as long as it takes.
        Returns:
          Whether it has finished (committed or failed; see `error`).

        Multi-process: as `wait`.
        """
        if threading.current_thread() is self._thread:
            return True  # a done-callback (run on the save thread): the work has ended
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
        if self._error is not None:
            self._observed()
            raise self._error

    @property
    def commit_s(self) -> float | None:
        """Seconds from the end of the snapshot to the end of the commit, once done."""
        return None if self.finished_s is None else self.finished_s - self.started_s

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self.error else "committed")
        return f"AsyncSave({self.path!r}, {state})"
