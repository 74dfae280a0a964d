"""The single-checkpoint front door: `save`, `save_async`."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .. import _commit, _coord, _storage
from .._memory import shared_pool
from . import _incremental
from ._async import AsyncSave
from ._options import SaveOptions
from ._pipeline import save_sync, take_snapshot


def _step_from_path(path: str | os.PathLike) -> int | None:
    name = os.fspath(path).rstrip("/").rsplit("/", 1)[-1]
    return int(name) if name.isascii() and name.isdigit() else None


def save(
    path: str | os.PathLike,
    tree: object,
    *,
    metadata: Mapping | None = None,
    overwrite: bool = False,
    commit_timeout_s: float = _coord.DEFAULT_COMMIT_TIMEOUT_S,
    agreement_timeout_s: float = _commit.DEFAULT_AGREEMENT_TIMEOUT_S,
    per_process_state: object = None,
    max_write_bytes_per_s: float | None = None,
    pack_small_leaves_bytes: int | None = None,
    direct_io: str | bool = "auto",
    incremental: bool = False,
) -> None:
    """Saves `tree` to `path` and returns once it is committed.

    Args:
      path: the checkpoint path (local, `file://`, `memory://`, `gs://`, `s3://`). If its
        last component is an integer, it is recorded as the step.
      tree: a pytree whose leaves are `jax.Array` (any sharding; typed PRNG keys too),
        numpy arrays, None, bool, int, float, complex, str or numpy scalars.
      metadata: a JSON-serialisable dict stored in the manifest (`user_metadata`).
      overwrite: replace an already committed checkpoint at `path`, atomically.
      commit_timeout_s: how long process 0 waits for every process's shards, seconds (default 60:
        below JAX's 100 s heartbeat timeout, so a dead peer raises CommitTimeoutError
        instead of JAX aborting the job; raise both together).
      agreement_timeout_s: how long processes wait for each other to agree on what
        they save, before anything is written, seconds.
      per_process_state: this process's own JSON-serialisable value (a data loader's
        position, a host's RNG seed), stored in its `processes/<i>.json` record and
        read back with `ckpt.per_process_state(path)`; never compared across processes.
      max_write_bytes_per_s: caps this process's write throughput, bytes per second
        (a token bucket paced per chunk write, see `_ratelimit`); None: unlimited.
      pack_small_leaves_bytes: leaves whose chunks (saved shards) hold at most this
        many bytes are packed into one zarr array per process (`packed/process-<i>`,
        see `_pack` and docs/format.md) instead of an array each; None:
        256 KiB; 0 writes every leaf as its own zarr array (the layout of release 0.1).
      direct_io: how local files are written: "auto" writes the zarr shard files and
        packs with `O_DIRECT` (past the page cache, the bytes TensorStore would write)
        where one probing write shows the file system takes it, else through
        TensorStore; True requires direct writes (SaveError where impossible); False
        always TensorStore. Object stores are always written through TensorStore.
        `processes/<i>.json` records the mode used and why (`write_mode`).
      incremental: chunks equal to the same chunk of the newest committed checkpoint
        of the folder holding `path` (canonical step names only, e.g. `DIR/100` beside
        `DIR/200`) are not written: the new checkpoint references them
        (docs/incremental.md). Equal by identity (the same live `jax.Array` that save
        saved, not donated since: no copy, no read) or by content (crc32c, then
        XXH3-128). Off by default: such a checkpoint has format_version 2 (older
        releases refuse it; TensorStore or zarr-python alone would read the missing
        chunks as zeros) and depends on the checkpoints it references.
    Raises:
      CheckpointExistsError: `path` is committed and `overwrite` is False.
      UnsupportedValueError: a leaf or `per_process_state` cannot be stored (names it).
      SaveAgreementError: processes save different paths, steps or trees (or different
        non-array values), or one did not arrive in time; raised on every process,
        naming per process what differs; nothing was written.
      ValueError: `max_write_bytes_per_s` is not None or a positive number,
        `pack_small_leaves_bytes` is not a non-negative int, `direct_io` is not
        "auto", True or False, or a timeout is not a number of seconds in (0, a week].
      TypeError: `incremental` is not a bool.
      SaveError, CommitTimeoutError: writing or committing failed; nothing was committed.

    Multi-process: every process must call it with the same path and tree (the same
    non-array values too), as its n-th save when the others make their n-th; each
    writes only its devices' `replica_id == 0` shards; process 0 commits.
    """
    options = SaveOptions(
        metadata, overwrite, commit_timeout_s, agreement_timeout_s, per_process_state, max_write_bytes_per_s, pack_small_leaves_bytes,
        direct_io, _incremental.check_option(incremental),
    )
    save_sync(path, tree, options, step=_step_from_path(path))


def save_async(
    path: str | os.PathLike,
    tree: object,
    *,
    metadata: Mapping | None = None,
    overwrite: bool = False,
    commit_timeout_s: float = _coord.DEFAULT_COMMIT_TIMEOUT_S,
    agreement_timeout_s: float = _commit.DEFAULT_AGREEMENT_TIMEOUT_S,
    per_process_state: object = None,
    max_write_bytes_per_s: float | None = None,
    pack_small_leaves_bytes: int | None = None,
    direct_io: str | bool = "auto",
    incremental: bool = False,
) -> AsyncSave:
    """Like `save`, but returns once the host snapshot is taken.

    The arrays may be donated, deleted or overwritten as soon as this returns; the
    write, fsync, per-process record and commit run on a background thread. The host
    copies go into buffers that the next `save_async` reuses (no page faults of fresh
    memory): the process keeps up to one snapshot's worth of them (the largest so far)
    until `ckpt.release_host_buffers()`.

    Returns:
      An `AsyncSave`, which is a `concurrent.futures.Future`: `.wait(timeout=None)`
      returns when committed and raises the background error if there was one;
      `.result(timeout)` returns the path once committed (raises as `wait`),
      `.exception()`, `.add_done_callback(fn)`, `.done()`, `.error`. A failure that no
      `wait()`, `result()` or `exception()` saw is logged at ERROR when the handle is
      garbage-collected or at exit.
    Raises:
      As `save`, for what is checked before the snapshot.

    Multi-process: as `save`.
    """
    options = SaveOptions(
        metadata, overwrite, commit_timeout_s, agreement_timeout_s, per_process_state, max_write_bytes_per_s, pack_small_leaves_bytes,
        direct_io, _incremental.check_option(incremental),
    )
    limiter = _storage.limiter_for(max_write_bytes_per_s)  # raises before the snapshot
    snap = take_snapshot(path, tree, options, step=_step_from_path(path), buffers=shared_pool(), write_limiter=limiter)
    return AsyncSave(snap)
