"""Time in a manager's directory: retention by age (`KeepEverySeconds`, `KeepNewerThan`,
composable with the step policies through `|`) and the time-based save decision
(`SaveClock`, for `CheckpointManager(save_interval_s=...)`).

Every time is a step's manifest `created_unix_s` (written by process 0 when it commits),
never a file's modification time: copies, restores from backup and object stores change
those, the manifest says when the state was saved. A step whose manifest has no time
(0.0, written by an old version) is kept by these policies: nothing says it is old.
So is a step created more than `FUTURE_SKEW_TOLERANCE_S` after now (a host whose clock
was ahead when it committed, or this one stepped back): its age is unknown, it is kept,
and it never anchors `KeepEverySeconds` (counting from a time a day ahead would drop
every later step for a day). The first such step logs a warning, once per process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

from .. import _coord
from .._errors import SaveAgreementError
from ._policies import KeepPolicy

log = logging.getLogger("checkpointer")

# How far after now a creation time may lie and still count as a time (seconds). Hosts
# synchronised by NTP differ by milliseconds; 5 minutes covers a host whose sync is late or
# slewing, the bound Kerberos uses for clock skew, and is short against the intervals these
# policies keep (an hour, a day), so a time within it changes nothing that matters.
FUTURE_SKEW_TOLERANCE_S = 300.0
_warned_future = False


def _check_seconds(name: str, s: object) -> float:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
        raise ValueError(f"{name} needs a number of seconds > 0, got {s!r}")
    return float(s)


def _known(t: float | None) -> bool:
    return t is not None and math.isfinite(t) and t > 0


def _dated(step: int, t: float | None, now_unix_s: float) -> bool:
    """Whether `t` is a creation time the policies count with: known, and not beyond
    `FUTURE_SKEW_TOLERANCE_S` after now (then its age is unknown; warns once)."""
    global _warned_future
    if not _known(t):
        return False
    if t <= now_unix_s + FUTURE_SKEW_TOLERANCE_S:  # type: ignore[operator]  # _known: a float
        return True
    if not _warned_future:
        _warned_future = True
        log.warning(
            "step %d was created %.0f s in the future (its manifest's created_unix_s, beyond the %.0f s of clock skew "
            "tolerated): a clock is wrong. Time-based retention keeps the step and does not count from its time "
            "(this warning is shown once)", step, t - now_unix_s, FUTURE_SKEW_TOLERANCE_S,  # type: ignore[operator]
        )
    return False


@dataclasses.dataclass(frozen=True)
class _SecondsPolicy(KeepPolicy):
    """A retention policy by creation time with one duration `s`, seconds (> 0): what both
    time policies share. Without the steps' times (`keep`) nothing is known to be old."""

    s: float
    uses_times = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "s", _check_seconds(f"{type(self).__name__}(s)", self.s))

    def keep(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, object]]) -> set[int]:
        return set(steps)


@dataclasses.dataclass(frozen=True)
class KeepEverySeconds(_SecondsPolicy):
    """Keeps one step every `s` seconds of creation time (Orbax's `EveryNSeconds`).

    The oldest step is kept; then, in step order, each step created at least `s`
    seconds after the last step kept. Steps without a creation time, or created more
    than `FUTURE_SKEW_TOLERANCE_S` (300 s) in the future, are kept and do not count as
    "the last step kept".

    Args:
      s: seconds between the steps kept (> 0).
    """

    def keep_at(
        self,
        steps: Sequence[int],
        metrics: Mapping[int, Mapping[str, object]],
        created_unix_s: Mapping[int, float | None],
        now_unix_s: float,
    ) -> set[int]:
        out: set[int] = set()
        last: float | None = None
        for step in sorted(steps):
            t = created_unix_s.get(step)
            if not _dated(step, t, now_unix_s):
                out.add(step)
            elif last is None or t - last >= self.s:  # type: ignore[operator]  # _known: a float
                out.add(step)
                last = t
        return out


@dataclasses.dataclass(frozen=True)
class KeepNewerThan(_SecondsPolicy):
    """Keeps the steps created less than `s` seconds ago (Orbax's `LatestDuration`).

    Steps without a creation time are kept; so are steps "created" more than
    `FUTURE_SKEW_TOLERANCE_S` (300 s) in the future (a clock stepped back): their age
    is unknown.

    Args:
      s: the age below which a step is kept, seconds (> 0).
    """

    def keep_at(
        self,
        steps: Sequence[int],
        metrics: Mapping[int, Mapping[str, object]],
        created_unix_s: Mapping[int, float | None],
        now_unix_s: float,
    ) -> set[int]:
        out = set()
        for step in steps:
            t = created_unix_s.get(step)
            if not _dated(step, t, now_unix_s) or now_unix_s - t < self.s:  # type: ignore[operator]  # _known: a float
                out.add(step)
        return out


_decision_round = itertools.count()


class SaveClock:
    """The time-based save decision of a manager (`save_interval_s`), like Orbax's
    `ContinuousCheckpointingPolicy(minimum_interval_secs=...)`: process 0 alone reads
    its clock and decides, every process learns its answer through one round of the
    rendezvous, so all of them save the same steps whatever their clocks say.

    A save is due when at least `interval_s` seconds have passed since the last save
    this manager wrote (on process 0), or, before its first, since the creation of the
    newest committed step (`first_unix_s()`); with neither (or a creation time after
    now), at once. Should process 0's clock step back past the last save, the interval
    counts from the moment that is noticed (at most `interval_s` without a save, not
    the size of the step).

    Args:
      interval_s: seconds between saves (> 0).
      directory: the manager's directory (names the round).
      timeout_s: how long the processes wait for each other, seconds.
      first_unix_s: the newest committed step's creation time, or None (process 0 asks once).
    """

    def __init__(self, interval_s: float, directory: str, timeout_s: float,
                 first_unix_s: Callable[[], float | None]) -> None:
        self.interval_s = _check_seconds("save_interval_s", interval_s)
        self.directory = directory
        self.timeout_s = timeout_s
        self._first_unix_s = first_unix_s
        self._last_unix_s: float | None = None
        self._asked = False
        self._tag = hashlib.sha256(directory.encode()).hexdigest()[:12]

    def saved(self, unix_s: float | None = None) -> None:
        """Records that a save was written now (or at `unix_s`)."""
        self._last_unix_s = time.time() if unix_s is None else unix_s

    def _due_here(self, now_unix_s: float) -> bool:
        if self._last_unix_s is None and not self._asked:
            self._asked = True
            first = self._first_unix_s()
            # Created "in the future" (another host's clock ahead, or this one stepped back):
            # its age is unknown, as for KeepNewerThan; waiting for it could hold saves back for hours.
            self._last_unix_s = first if _known(first) and first <= now_unix_s else None  # type: ignore[operator]
        if self._last_unix_s is not None and now_unix_s < self._last_unix_s:
            # This clock stepped back (NTP, a VM resumed): counting from a time still ahead
            # would hold saves back for as long as the step; count from now instead.
            self._last_unix_s = now_unix_s
        return self._last_unix_s is None or now_unix_s - self._last_unix_s >= self.interval_s

    def due(self, step: int, *, now_unix_s: float | None = None) -> bool:
        """Whether `save(step)` writes by the time rule: process 0's answer.

        Raises:
          SaveAgreementError: the processes ask about different steps, or one of them
            did not ask within `timeout_s`.

        Multi-process: every process calls it, for the same steps in the same order.
        """
        n = next(_decision_round)

        def decide(got: Mapping[int, dict]) -> str | None:
            refused = _coord.refusals(got)
            if refused:
                return f"the time-based save decision of {self.directory}: " + "; ".join(
                    f"process {i}: {t}" for i, t in sorted(refused.items()))
            steps = {i: p.get("step") for i, p in got.items()}
            if len(set(steps.values())) > 1:
                shown = ", ".join(f"{_coord.procs(ps)} step {s}" for ps, s in _coord.groups(steps))
                return (f"the processes called save with different steps in {self.directory} ({shown}); every process "
                        "must call save with the same step, in the same order")
            return None

        now = time.time() if now_unix_s is None else now_unix_s
        vote = _coord.Round(
            f"manage/{self._tag}/save-interval-{n}", decide=decide, timeout_s=self.timeout_s, error=SaveAgreementError,
            what=f"the time-based save decision of step {step} in {self.directory}", timeout_name="agreement_timeout_s",
            hint="With save_interval_s every process must call save for the same steps, in the same order.",
        )
        payload = vote.agree({"step": int(step)}, outcome=lambda got: "1" if self._due_here(now) else "0")
        return payload == "1"
