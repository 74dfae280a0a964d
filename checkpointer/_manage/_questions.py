"""The questions a training loop asks its manager about saved steps: `metrics(step)`,
`best_step(metric)`, `user_metadata(step)` (each from the step's manifest alone, never
its arrays, cached per step) and `delete(step)`; and the creation times that retention
by age reads (`_time_policies`). `CheckpointManager` derives from `StepQuestions`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .. import _commit, _coord
from .._errors import CheckpointError, CheckpointNotFoundError, UnknownMetricError
from .._format import CheckpointMetadata, read_metadata
from ._policies import KeepAny, KeepBest, metric_score as _score
from ._reader import StepReader

if TYPE_CHECKING:
    from .._save import AsyncSave
    from ._tier_manager import LocalTier

log = logging.getLogger("checkpointer")

_delete_round = itertools.count()


def _keep_best_mode(policy: object, metric: str) -> str | None:
    """The mode of the first `KeepBest` for `metric` in a retention policy (or a union)."""
    if isinstance(policy, KeepBest):
        return policy.mode if policy.metric == metric else None
    if isinstance(policy, KeepAny):
        for p in policy.policies:
            mode = _keep_best_mode(p, metric)
            if mode is not None:
                return mode
    return None


class StepQuestions(StepReader):
    """`metrics`, `best_step`, `user_metadata` and `delete` of a `CheckpointManager`.

    Attributes (set by `CheckpointManager`): `_mu` guarding `_in_flight` (step, handle),
    `_metrics_cache` and `_created_cache` (step → metrics, creation time; filled from
    manifests, or by `save` for the metrics it was given), `_tiers` (or None),
    `_is_primary`, `commit_timeout_s`, `read_only`, and `_ensure_writer()`.
    """

    _mu: threading.Lock
    _in_flight: list[tuple[int, AsyncSave]]
    _metrics_cache: dict[int, dict]
    _created_cache: dict[int, float | None]
    _tiers: LocalTier | None
    _is_primary: bool
    commit_timeout_s: float

    def _ensure_writer(self) -> list[str]:
        raise NotImplementedError

    # --- the manifest of a step ---------------------------------------------------------

    def _step_metadata(self, step: int, folders: Mapping[int, str] | None = None) -> CheckpointMetadata:
        """The manifest of committed `step`; fills the caches.

        Raises:
          CheckpointNotFoundError: `step` is not committed.
          CorruptCheckpointError: its manifest is missing or malformed.
        """
        folders = _commit.committed_folders(self.storage, self.directory) if folders is None else folders
        if step not in folders:
            raise CheckpointNotFoundError(self._not_found(step, folders))
        meta = read_metadata(self.storage, self._read_path(step, folders))
        metrics = meta.user_metadata.get("metrics", {})
        with self._mu:
            self._metrics_cache[step] = dict(metrics) if isinstance(metrics, dict) else {}
            self._created_cache[step] = meta.created_unix_s or None
        return meta

    def _not_found(self, step: int, folders: Mapping[int, str]) -> str:
        shown = list(folders)[-8:]
        return (f"step {step} is not a committed step of {self.directory} (process {_coord.process_index()}); the "
                f"committed steps are {shown if folders else 'none'}{' (the newest 8)' if len(folders) > 8 else ''}. "
                "See all_steps().")

    def _metrics(self, step: int, folders: Mapping[int, str]) -> dict:
        """The metrics of `step` for retention: {} when its manifest cannot be read."""
        with self._mu:
            if step in self._metrics_cache:
                return self._metrics_cache[step]
        try:
            self._step_metadata(step, folders)
        except CheckpointError:
            with self._mu:
                self._metrics_cache[step] = {}
        with self._mu:
            return self._metrics_cache[step]

    def _created_unix_s(self, step: int, folders: Mapping[int, str]) -> float | None:
        """The manifest's creation time of `step` for retention: None when unknown."""
        with self._mu:
            if step in self._created_cache:
                return self._created_cache[step]
        try:
            self._step_metadata(step, folders)
        except CheckpointError:
            return None
        with self._mu:
            return self._created_cache.get(step)

    def _newest_created_unix_s(self) -> float | None:
        """The newest committed step's creation time (for `save_interval_s`), or None."""
        folders = _commit.committed_folders(self.storage, self.directory)
        return self._created_unix_s(max(folders), folders) if folders else None

    def _forget(self, step: int) -> None:
        with self._mu:
            self._metrics_cache.pop(step, None)
            self._created_cache.pop(step, None)

    # --- the questions ------------------------------------------------------------------

    def metrics(self, step: int) -> dict[str, object]:
        """The metrics saved with `step` (`save(..., metrics=)`), from its manifest.

        Args:
          step: a committed step.
        Returns:
          Metric name → value: numbers as floats, NaN and the infinities as the strings
          "NaN", "Infinity", "-Infinity"; {} for a step saved without metrics.
        Raises:
          CheckpointNotFoundError: `step` is not committed.
          CorruptCheckpointError: its manifest is missing or malformed.

        Multi-process: any process may call it alone; reads only the manifest.
        """
        folders = _commit.committed_folders(self.storage, self.directory)
        if step not in folders:  # a step removed since it was cached is not answered from the cache
            raise CheckpointNotFoundError(self._not_found(step, folders))
        with self._mu:
            cached = self._metrics_cache.get(step)
        if cached is None:
            self._step_metadata(step, folders)  # raises for a damaged manifest
            with self._mu:
                cached = self._metrics_cache[step]
        return dict(cached)

    def best_step(self, metric: str, mode: str | None = None) -> int | None:
        """The committed step with the best value of `metric`, as `KeepBest` ranks it.

        Args:
          metric: a key of `save(..., metrics=)`.
          mode: "min" (lowest is best, e.g. a loss) or "max" (e.g. an accuracy). By
            default the mode of the manager's `KeepBest` policy for `metric` (in `keep`,
            also inside a `|` union), else "min". An explicit `mode` wins.
        Returns:
          The step, the newest one on a tie; None while no committed step has a number
          for `metric` (steps without it, with NaN, or whose manifest cannot be read
          are ignored), e.g. before the first save committed.
        Raises:
          ValueError: `mode` is neither "min" nor "max".
          UnknownMetricError (a KeyError): steps are committed, but neither they nor a
            save of this manager passed `metric`; names the metrics that were passed.

        Multi-process: any process may call it alone; reads only the manifests (once
        per step: they are cached).
        """
        if mode is None:
            mode = _keep_best_mode(getattr(self, "keep", None), metric) or "min"
        if mode not in ("min", "max"):
            raise ValueError(f"best_step mode must be 'min' or 'max', got {mode!r}")
        folders = _commit.committed_folders(self.storage, self.directory)
        scored = []
        passed: set[str] = set()
        for step in folders:
            metrics = self._metrics(step, folders)
            passed.update(metrics)
            v = _score(metrics.get(metric))
            if v is not None:
                scored.append((v if mode == "min" else -v, -step))
        if not scored and folders:
            with self._mu:
                passed.update(k for m in self._metrics_cache.values() for k in m)
            if metric not in passed:
                raise UnknownMetricError(
                    f"best_step({metric!r}): no save to {self.directory} passed a metric {metric!r}; the metrics "
                    f"saved are {sorted(passed) if passed else 'none (save(..., metrics={...}) records them)'}. "
                    "Check the name against save(..., metrics=)"
                )
        return -min(scored)[1] if scored else None

    def user_metadata(self, step: int | None = None) -> dict[str, object]:
        """The `metadata=` dict saved with `step` (default: the newest committed step),
        read from its manifest without touching the arrays.

        Returns:
          The dict as `save(..., metadata=)` stored it (JSON values; without the
          manager's `"metrics"`, which `metrics(step)` returns); {} when none was given.
        Raises:
          CheckpointNotFoundError: no committed step (or not that one).
          CorruptCheckpointError: its manifest is missing or malformed.

        Multi-process: any process may call it alone.
        """
        folders = _commit.committed_folders(self.storage, self.directory)
        if step is None:
            if not folders:
                raise CheckpointNotFoundError(f"no committed step in {self.directory}")
            step = max(folders)
        meta = self._step_metadata(int(step), folders)
        return {k: v for k, v in meta.user_metadata.items() if k != "metrics"}

    def delete(self, step: int) -> None:
        """Deletes committed `step`: it leaves every listing at once (unpublished), then
        its files go; with a local tier, each process's local copy goes too.

        Args:
          step: a committed step.
        Raises:
          CheckpointNotFoundError: `step` is not committed (on every process).
          CheckpointError: the manager is read_only; `step` is the newest committed step
            while a save is in flight (the resume point would vanish before the new one
            exists: `wait_until_finished()` first); another process failed (named).

        Multi-process: every process calls it with the same step; the processes check
        together, then process 0 deletes (holding the writer's lock) before any returns.
        """
        step = int(step)
        n = next(_delete_round)  # first: every process numbers every call, whatever fails below
        tag = hashlib.sha256(self.directory.encode()).hexdigest()[:12]

        def decide(got: Mapping[int, dict]) -> str | None:
            refused = _coord.refusals(got)
            if not refused:
                return None
            lines = [f"  process {i}: {text}" for i, text in sorted(refused.items())]
            return "\n".join([f"delete({step}) of {self.directory} failed on {len(refused)} process(es):", *lines])

        vote = _coord.Round(
            f"manage/{tag}/delete-{n}", decide=decide, timeout_s=self.commit_timeout_s, error=CheckpointError,
            what=f"delete({step}) of {self.directory}", timeout_name="commit_timeout_s",
            hint="Every process must call delete with the same step, in the same order.",
        )
        try:
            self._ensure_writer()  # raises for a read_only manager
            self._check_deletable(step)
        except BaseException as e:
            vote.refuse(e)
            raise
        vote.agree({"step": step}, outcome=lambda got: self._delete_now(step))
        if self._tiers is not None and step in self._tiers.local_steps() and step not in self._tiers.pending_steps():
            _commit.delete_step(self._tiers.storage, self._tiers.root, step)  # each process its own copy
        self._forget(step)

    def _check_deletable(self, step: int) -> None:
        folders = _commit.committed_folders(self.storage, self.directory)
        if step not in folders:
            raise CheckpointNotFoundError(self._not_found(step, folders))
        with self._mu:
            in_flight = [s for s, h in self._in_flight if not h.done()]
        if self._tiers is not None:  # committed locally, not yet durably: still in flight
            in_flight = sorted({*in_flight, *self._tiers.pending_steps()})
        if in_flight and step == max(folders):
            raise CheckpointError(
                f"delete({step}) of {self.directory} (process {_coord.process_index()}): step {step} is the newest "
                f"committed step and step {in_flight[-1]} is still being saved; deleting it would leave no resume "
                "point if that save fails. Call wait_until_finished() first, then delete."
            )

    def _delete_now(self, step: int) -> str:
        """Process 0, once every process has checked: unpublish, then remove."""
        _commit.delete_step(self.storage, self.directory, step)
        log.info("deleted step %d from %s", step, self.directory)
        return ""
