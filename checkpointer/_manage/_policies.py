"""Retention policies: which committed steps a `CheckpointManager` keeps.

A policy maps the committed steps (and their metrics) to the steps it keeps; `a | b`
keeps a step if either keeps it. Policies by time (`_time_policies`) also read each
step's creation time (`keep_at`). The manager always keeps the newest committed step,
whatever the policy says, so a resume point always exists.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence


def _is_count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


class KeepPolicy:
    """Base class of retention policies."""

    def keep(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, object]]) -> set[int]:
        """Returns the subset of `steps` (sorted ascending, committed) to keep.

        `metrics[step]` is the step's saved metrics: numbers as floats, NaN and the
        infinities as the strings "NaN", "Infinity", "-Infinity", other values as given;
        a step saved without metrics maps to {}.
        """
        raise NotImplementedError

    # A policy that reads creation times sets this (the manager then reads them).
    uses_times = False
    # A policy that reads metrics sets this (`keep_local` refuses it: local retention has none).
    uses_metrics = False

    def keep_at(
        self,
        steps: Sequence[int],
        metrics: Mapping[int, Mapping[str, object]],
        created_unix_s: Mapping[int, float | None],
        now_unix_s: float,
    ) -> set[int]:
        """`keep`, given also each step's creation time (the manifest's
        `created_unix_s`, seconds since the epoch; None when unknown) and the time now.
        Policies by step ignore the times."""
        return self.keep(steps, metrics)

    def __or__(self, other: KeepPolicy) -> KeepAny:
        if not isinstance(other, KeepPolicy):
            return NotImplemented
        return KeepAny((self, other))


@dataclasses.dataclass(frozen=True)
class KeepAny(KeepPolicy):
    """The union of several policies."""

    policies: tuple[KeepPolicy, ...]

    def keep(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, object]]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep(steps, metrics)
        return out

    @property
    def uses_times(self) -> bool:  # type: ignore[override]  # a property over the class attribute
        return any(p.uses_times for p in self.policies)

    @property
    def uses_metrics(self) -> bool:  # type: ignore[override]  # a property over the class attribute
        return any(p.uses_metrics for p in self.policies)

    def keep_at(
        self,
        steps: Sequence[int],
        metrics: Mapping[int, Mapping[str, object]],
        created_unix_s: Mapping[int, float | None],
        now_unix_s: float,
    ) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep_at(steps, metrics, created_unix_s, now_unix_s)
        return out

    def __or__(self, other: KeepPolicy) -> KeepAny:
        if not isinstance(other, KeepPolicy):
            return NotImplemented
        return KeepAny(self.policies + (other,))


@dataclasses.dataclass(frozen=True)
class KeepLatest(KeepPolicy):
    """Keeps the `n` newest committed steps (n >= 1)."""

    n: int

    def __post_init__(self) -> None:
        if not _is_count(self.n):
            raise ValueError(f"KeepLatest(n) needs an int n >= 1, got {self.n!r}")

    def keep(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, object]]) -> set[int]:
        return set(sorted(steps)[-self.n :])


@dataclasses.dataclass(frozen=True)
class KeepEvery(KeepPolicy):
    """Keeps every step that is a multiple of `n` (e.g. a permanent one each 10 000 steps)."""

    n: int

    def __post_init__(self) -> None:
        if not _is_count(self.n):
            raise ValueError(f"KeepEvery(n) needs an int n >= 1, got {self.n!r}")

    def keep(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, object]]) -> set[int]:
        return {s for s in steps if s % self.n == 0}


def metric_score(value: object) -> float | None:
    """A saved metric as a number to rank (`KeepBest`, `best_step`), or None (absent,
    NaN, a bool, an int beyond any float, not a number). Saved infinities are the strings "Infinity" /
    "-Infinity" (see `save(metrics=)`)."""
    if isinstance(value, str):
        value = {"Infinity": math.inf, "-Infinity": -math.inf}.get(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float (a damaged manifest): no number to rank
        return None
    return None if math.isnan(number) else number


@dataclasses.dataclass(frozen=True)
class KeepBest(KeepPolicy):
    """Keeps the `n` steps with the best value of `metric` (`mode` "min" or "max").

    Steps saved without that metric (or with a NaN, or a bool) are never "best"; they go
    unless another policy keeps them. Ties go to the newer step. Values are ranked as
    `best_step` ranks them (`metric_score`): an infinity counts.
    """

    metric: str
    mode: str = "min"
    n: int = 1
    uses_metrics = True

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest mode must be 'min' or 'max', got {self.mode!r}")
        if not _is_count(self.n):
            raise ValueError(f"KeepBest(n=...) needs an int n >= 1, got {self.n!r}")

    def keep(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, object]]) -> set[int]:
        scored = []
        for s in steps:
            v = metric_score(metrics.get(s, {}).get(self.metric))
            if v is not None:
                scored.append((v if self.mode == "min" else -v, -s))
        return {-neg_step for _, neg_step in sorted(scored)[: self.n]}


@dataclasses.dataclass(frozen=True)
class KeepSteps(KeepPolicy):
    """Keeps exactly the given steps (when they exist)."""

    steps: frozenset[int]

    def __init__(self, steps: Iterable[int]):
        if isinstance(steps, (str, bytes)):
            raise ValueError(f"KeepSteps needs an iterable of int steps, got {steps!r}")
        steps = list(steps)
        bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad:
            raise ValueError(f"KeepSteps needs int steps >= 0, got {bad!r}")
        object.__setattr__(self, "steps", frozenset(steps))

    def keep(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, object]]) -> set[int]:
        return {s for s in steps if s in self.steps}
