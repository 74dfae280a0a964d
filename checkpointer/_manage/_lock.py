"""The writer's lock of a manager's directory (`DIR/.checkpointer.lock`, POSIX): taken by
the first operation of a `CheckpointManager` that writes or deletes, and by `checkpointer
gc`, so two writers never delete each other's steps."""

from __future__ import annotations

import gc
import os

from .. import _commit
from .._errors import CheckpointError, LockHeldByThisProcessError, LockHeldError
from .._storage import Storage


class DirectoryLock:
    """An advisory `flock` on `DIR/.checkpointer.lock` held by process 0 of the writer.

    Taken on the first operation that writes or deletes (not by readers), so a second
    writer on the same directory (same machine) fails at once instead of deleting the
    first one's steps. The kernel drops the lock when the process dies, so a crashed
    job never leaves a stale lock. Needs `storage.supports_locks`.
    """

    def __init__(self, storage: Storage, directory: str) -> None:
        try:
            self._lock = storage.lock(f"{directory}/{_commit.LOCK_NAME}", wait=False, holder=_holder_text())
        except LockHeldError as e:
            holder = (e.holder or "").strip()
            same = holder == _holder_text()
            raise (LockHeldByThisProcessError if same else CheckpointError)(lock_conflict_message(directory, holder)) from None

    def release(self) -> None:
        self._lock.release()


def _holder_text() -> str:
    """What the lock file says about its holder: `pid <n> on <host>`."""
    return f"pid {os.getpid()} on {os.uname().nodename}"


def lock_conflict_message(directory: str, holder: str) -> str:
    """Why the writer's lock of `directory` cannot be taken, and how to free it.

    `holder` is the lock file's content (`pid <n> on <host>`); when it names this very
    process, the other writer is another `CheckpointManager` object (or `gc`) of ours.
    """
    if holder == _holder_text():
        return (
            f"another CheckpointManager in this same process (pid {os.getpid()}) holds the writer's lock of "
            f"{directory}: it saved or cleaned up there and was neither closed nor garbage-collected. Call close() "
            "on that manager (or `del` every reference to it, e.g. the variable of a notebook cell you ran again); "
            "a manager that only reads (listing, restore, wait_for_step) needs no lock: "
            "CheckpointManager(..., read_only=True)."
        )
    return (
        f"another CheckpointManager is using {directory} ({holder or 'unknown holder'}) as writer; two managers "
        "writing one directory would delete each other's steps. Close the other one, use another directory, or "
        "open this one with read_only=True to only read (listing, restore, following new steps)."
    )


def forked_copy_message(directory: str, owner_pid: int) -> str:
    """Why a forked child's copy of a manager (opened by `owner_pid`) neither saves nor deletes."""
    return (
        f"this CheckpointManager of {directory} was opened by process {owner_pid}; this process ({os.getpid()}) was "
        "forked from it and holds only a copy: the parent's saves, writer's lock and clean-up are the parent's, so the "
        "copy neither saves nor deletes. Open a CheckpointManager in the child (read_only=True to read)."
    )


def take_lock(storage: Storage, directory: str) -> DirectoryLock:
    """The writer's lock. If this very process holds it through a manager nobody refers
    to any more (a notebook cell run twice: the old manager may sit in a reference
    cycle), a garbage collection runs its finalizer and the lock is tried once more."""
    try:
        return DirectoryLock(storage, directory)
    except LockHeldByThisProcessError:
        gc.collect()
    return DirectoryLock(storage, directory)
