"""The single-checkpoint front door: `save`, `save_async`."""

from __future__ import annotations

import os
from typing import Mapping

from . import _distributed, _ratelimit
from ._async import AsyncSave
from ._save import run_background, take_snapshot


def _step_from_path(path: str | os.PathLike) -> int | None:
    name = os.fspath(path).rstrip("/").rsplit("/", 1)[-1]
    return int(name) if name.isascii() and name.isdigit() else None


def save(
    path: str | os.PathLike,
    tree: object,
    *,
    metadata: Mapping | None = None,
    overwrite: bool = False,
    commit_timeout_s: float = _distributed.DEFAULT_COMMIT_TIMEOUT_S,
    max_write_bytes_per_s: float | None = None,
) -> None:
    """Saves `tree` to `path` and returns once it is committed.

    Args:
      path: the checkpoint path (local, `file://`, `memory://`, `gs://`, `s3://`). If its
        last component is an integer, it is recorded as the step.
      tree: a pytree whose leaves are `jax.Array` (any sharding; typed PRNG keys too),
        numpy arrays, None, bool, int, float, complex, str or numpy scalars.
      metadata: a JSON-serialisable dict stored in the manifest (`user_metadata`).
      overwrite: replace an already committed checkpoint at `path`, atomically.
      commit_timeout_s: how long process 0 waits for every process, seconds.
      max_write_bytes_per_s: caps this process's write throughput, bytes per second
        (a token bucket paced per chunk write, see `_ratelimit`); None: unlimited.
    Raises:
      CheckpointExistsError: `path` is committed and `overwrite` is False.
      UnsupportedValueError: a leaf cannot be stored (names its leaf path).
      ValueError: `max_write_bytes_per_s` is not None or a positive number.
      SaveError, CommitTimeoutError: writing or committing failed; nothing was committed.

    Multi-process: every process must call it with the same path and tree structure;
    each writes only its devices' `replica_id == 0` shards; process 0 commits.
    """
    limiter = _ratelimit.limiter_for(max_write_bytes_per_s)
    snap = take_snapshot(path, tree, metadata=metadata, overwrite=overwrite, step=_step_from_path(path), commit_timeout_s=commit_timeout_s)
    snap.write_limiter = limiter
    run_background(snap)


def save_async(
    path: str | os.PathLike,
    tree: object,
    *,
    metadata: Mapping | None = None,
    overwrite: bool = False,
    commit_timeout_s: float = _distributed.DEFAULT_COMMIT_TIMEOUT_S,
    max_write_bytes_per_s: float | None = None,
) -> AsyncSave:
    """Like `save`, but returns once the host snapshot is taken.

    The arrays may be donated, deleted or overwritten as soon as this returns; the
    write, fsync, per-process record and commit run on a background thread.

    Returns:
      An `AsyncSave`: `.wait(timeout=None)` returns when committed and raises the
      background error if there was one; `.done()`.
    Raises:
      As `save`, for what is checked before the snapshot.

    Multi-process: as `save`.
    """
    limiter = _ratelimit.limiter_for(max_write_bytes_per_s)
    snap = take_snapshot(path, tree, metadata=metadata, overwrite=overwrite, step=_step_from_path(path), commit_timeout_s=commit_timeout_s)
    snap.write_limiter = limiter
    return AsyncSave(snap)
