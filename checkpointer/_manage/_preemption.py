"""Saving on preemption: the step at which every process of the job saves and stops.

Spot and preemptible machines get a SIGTERM and a grace period. The manager asks
`PreemptionWatch.reached(step)` at every `save(step)` (the loop calls `save` every step;
the interval still decides what is written otherwise):

- under `jax.distributed` (any process count), JAX's preemption sync manager answers
  (`jax.experimental.multihost_utils.reached_preemption_sync_point`): when any process
  gets the notice (SIGTERM, caught by JAX's own notifier, installed by
  `jax.distributed.initialize` while `jax_enable_preemption_service` is on, the
  default), the processes agree on the step after the newest step any of them has
  reached, and that step is the answer on every process. JAX's notifier then owns
  SIGTERM: no handler is installed here.
- otherwise (one process, no coordination service), a SIGTERM handler installed from the
  main thread sets a flag; the first step asked after it is the preemption step. The
  handler chains to a Python handler installed before it (never to the default action,
  which would end the process) and `close()` restores the previous handler. A child
  forked from the process (`os.fork`, `multiprocessing`'s fork start method) gets the
  handler found before the first manager's back (SIGTERM's default action unless the
  program installed its own): it is not the process that saves, and a handler that
  never falls back to the default action would leave it unstoppable by SIGTERM.

A SIGTERM after the loop's last `save` has no step left to save. Under `jax.distributed`
the job's exit may then abort in JAX's shutdown barrier (SIGABRT): JAX's sync protocol,
started on a process that got the notice, waits at a barrier for a process already in
`jax.distributed.shutdown()`, and holds the lock that its own shutdown needs
(docs/operating.md, "Preemption"; tests/test_fault_campaign.py reproduces it without
this library).

A step's answer is asked of JAX once (`reached` remembers the last step asked), so
`mgr.should_save(step)`, `save(step)` and `mgr.reached_preemption(step)` in one loop
iteration agree, whichever of them asks first.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("checkpointer")

# How preemption is learned: JAX's sync point, this module's SIGTERM handler, or not at all.
JAX_SYNC_POINT = "jax sync point"
SIGTERM_HANDLER = "sigterm handler"
OFF = "off"
_MAX_SYNC_STEP = 2**31 - 1
# A closed watch's handler that a later one still chains to (it was not the newest when
# closed) -> the handler it found: a later close restores past it, never back to it.
_CLOSED: dict[Callable[[int, FrameType | None], None], Callable[[int, FrameType | None], Any] | int | None] = {}
# Open watches' installed handlers -> the handler each found (what a forked child gets back).
_INSTALLED: dict[Callable[[int, FrameType | None], None], Callable[[int, FrameType | None], Any] | int | None] = {}


def _past_closed(handler: Any) -> Any:
    """`handler`, or, where it is a closed manager's (closed out of order: inert, it would
    swallow SIGTERM), the handler that one found, and so on."""
    while handler in _CLOSED:
        handler = _CLOSED.pop(handler)
    return handler


_fork_masks = threading.local()  # the forking thread's signal mask before `_before_fork`


def _ours_installed() -> bool:
    handler = signal.getsignal(signal.SIGTERM)
    return handler in _INSTALLED or handler in _CLOSED


def _before_fork() -> None:
    """SIGTERM blocked on the forking thread while a manager's handler is installed: a
    SIGTERM sent to the child before `_after_fork_in_child` stays pending until the child
    has its own handler back (else the inherited handler would take it, and swallow it)."""
    _fork_masks.old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if _ours_installed() else None


def _after_fork_in_parent() -> None:
    old, _fork_masks.old = getattr(_fork_masks, "old", None), None
    if old is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _after_fork_in_child() -> None:
    """In a forked child: SIGTERM's handler as it was before any manager's (the managers'
    handlers are the parent's business: the child saves nothing); then a SIGTERM sent to
    it meanwhile is delivered, to that handler."""
    old, _fork_masks.old = getattr(_fork_masks, "old", None), None
    try:
        handler = signal.getsignal(signal.SIGTERM)
        if handler in _INSTALLED or handler in _CLOSED:
            while handler in _INSTALLED or handler in _CLOSED:
                handler = _INSTALLED[handler] if handler in _INSTALLED else _CLOSED[handler]
            signal.signal(signal.SIGTERM, handler)
        _INSTALLED.clear()
        _CLOSED.clear()
    except (ValueError, OSError) as e:  # not the main thread of the main interpreter
        log.warning("a forked child could not restore SIGTERM's handler: %s", e)
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


if hasattr(os, "register_at_fork") and hasattr(signal, "pthread_sigmask"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def _distributed_state() -> Any:  # Any: jax's distributed State has no stubs
    from jax._src import distributed  # the state jax.distributed.initialize() fills in

    return distributed.global_state


def _jax_sync_point(step: int) -> bool:
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))


class PreemptionWatch:
    """Tells a manager at which step the job was preempted.

    Args:
      enabled: False: never preempted (`save_on_preemption=False`, or a read-only manager).
      directory: names the manager in log lines.

    Attributes:
      mode: `JAX_SYNC_POINT`, `SIGTERM_HANDLER` or `OFF` (see the module docstring).
      preempted_step: the preemption step once reached, else None.
    """

    def __init__(self, enabled: bool, directory: str) -> None:
        self.directory = directory
        self.preempted_step: int | None = None
        self._asked: tuple[int, bool] | None = None
        self._noticed = threading.Event()
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None
        self._installed: Callable[[int, FrameType | None], None] | None = None
        self.mode = OFF
        if not enabled:
            return
        state = _distributed_state()
        if state.client is not None:
            if state.preemption_sync_manager is None:
                log.warning(
                    "%s: save_on_preemption is on but JAX's preemption service is off "
                    "(jax_enable_preemption_service=False before jax.distributed.initialize): no save on "
                    "preemption; enable the service to get one", directory,
                )
                return
            self.mode = JAX_SYNC_POINT
            return
        self._install()

    def _install(self) -> None:
        """The SIGTERM handler, from the main thread only, chained to a Python handler."""
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "%s: save_on_preemption needs a SIGTERM handler, and Python installs signal handlers from the main "
                "thread only; this manager was opened on thread %r: no save on preemption. Open it on the main "
                "thread, or call jax.distributed.initialize() (JAX's notifier then owns SIGTERM)",
                self.directory, threading.current_thread().name,
            )
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None:  # a handler installed from C (not Python's): it cannot be restored
            log.warning("%s: SIGTERM has a handler installed outside Python; no save on preemption", self.directory)
            return

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            if self._installed is not on_sigterm:  # closed, yet still installed or chained to
                if signal.getsignal(signal.SIGTERM) is on_sigterm:  # closed off the main thread: restore here
                    found = _past_closed(previous)
                    signal.signal(signal.SIGTERM, found)
                    if found == signal.SIG_DFL:
                        os.kill(os.getpid(), signum)  # what SIGTERM would have done without this manager
                    elif callable(found):
                        found(signum, frame)
                elif callable(previous):
                    previous(signum, frame)
                return
            if not self._noticed.is_set():
                log.warning("%s: SIGTERM received: the next save is written and committed (preemption)", self.directory)
            self._noticed.set()
            if callable(previous):  # an earlier Python handler; never SIG_DFL (it would end the process)
                previous(signum, frame)

        self._previous, self._installed = previous, on_sigterm  # before: a SIGTERM at once finds it open
        _INSTALLED[on_sigterm] = previous
        signal.signal(signal.SIGTERM, on_sigterm)
        self.mode = SIGTERM_HANDLER

    def reached(self, step: int) -> bool:
        """Whether `step` is the preemption step (the same on every process).

        Multi-process: under `jax.distributed` every process asks it at every step, in
        step order (JAX's sync point's rule); the manager's `save` does.
        """
        if self._asked is not None and self._asked[0] == step:
            return self._asked[1]
        if self.mode == JAX_SYNC_POINT:
            # JAX's sync manager counts steps in a C int: larger steps cannot be asked.
            hit = step <= _MAX_SYNC_STEP and _jax_sync_point(step)
        else:
            hit = self.preempted_step is None and self._noticed.is_set()
        if hit:
            self.preempted_step = step
            log.warning("%s: preemption: step %d is saved and committed, then the loop can stop", self.directory, step)
        self._asked = (step, hit)
        return hit

    def reached_committed(self, step: int, committed_steps: list[int]) -> bool:
        """`reached(step)`, and `step` among `committed_steps`; at an unsaved preemption step,
        False and a logged warning saying so (what `CheckpointManager.reached_preemption` returns)."""
        if not self.reached(step):
            return False
        if step in committed_steps:
            return True
        log.warning(
            "%s: the preemption step %d was not saved (the loop did not call save(%d), or the save failed): nothing "
            "was committed for it; the job resumes from the newest committed step. Call save(%d, tree, force=True) "
            "to save it now", self.directory, step, step, step,
        )
        return False

    def close(self) -> None:
        """Restores the SIGTERM handler found at construction, if this one is still installed
        (a handler installed after it stays; it may chain to this one, now inert)."""
        installed, self._installed = self._installed, None
        if installed is None:
            return
        _INSTALLED.pop(installed, None)
        try:
            if signal.getsignal(signal.SIGTERM) is installed:
                signal.signal(signal.SIGTERM, _past_closed(self._previous))  # a handler, SIG_DFL or SIG_IGN
            else:
                _CLOSED[installed] = self._previous
        except ValueError:  # not the main thread
            _CLOSED[installed] = self._previous  # a child forked from now on skips it too
            log.warning("%s: closed off the main thread: its SIGTERM handler stays installed until the next SIGTERM, "
                        "which it hands to the handler found before it", self.directory)
        self._noticed.clear()
