"""Errors raised by checkpointer.

Every error derives from `CheckpointError`; each subclass also derives from the builtin
that matches its meaning (as zarr-python does), so callers can catch either. Messages say
what went wrong, where (leaf path, checkpoint path, process) and how to fix it.

Every exception class of the package is defined here (tests/test_layout.py checks it),
including the few outside the `CheckpointError` family that the front door does not
export: `LockHeldError` (a `BlockingIOError` of the storage's lock), the manager's
`LockHeldByThisProcessError`, the CLI's `UsageError` and the test harness's
`ProcessesFailed` (an `AssertionError`).
"""

from __future__ import annotations

import errno
import sys
import urllib.parse


class CheckpointError(Exception):
    """Base class of every error this library raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path holds no committed checkpoint (or the directory no committed step)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already exists where a save was asked to write."""


class StructureMismatchError(CheckpointError, ValueError):
    """The target tree's leaf paths differ from the saved tree's."""


class ShapeMismatchError(CheckpointError, ValueError):
    """A target leaf's shape differs from the saved shape."""


class DTypeMismatchError(CheckpointError, TypeError):
    """A target leaf's dtype cannot be produced from the saved dtype."""


class InvalidTargetError(CheckpointError, ValueError):
    """A restore target leaf is not one of the accepted kinds or lacks a sharding."""


class MeshError(CheckpointError, ValueError):
    """A mesh cannot be built or resolved: too few devices, names that do not fit its
    shape, or an abstract mesh with no concrete devices to stand for it."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A leaf of the tree to save is of a kind the format cannot hold."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored bytes or metadata are missing, truncated, fail a checksum or are malformed."""


class SaveError(CheckpointError, OSError):
    """Writing or committing a checkpoint failed; nothing was committed."""


class CommitTimeoutError(SaveError, TimeoutError):
    """Some processes did not report their shards durable within the commit timeout."""


class UnknownMetricError(CheckpointError, KeyError):
    """A metric was asked for that no save of the directory ever passed (`best_step`)."""

    def __str__(self) -> str:  # KeyError would print the message quoted, as a key
        return str(self.args[0]) if self.args else ""


class ProcessCountMismatchError(CheckpointError, ValueError):
    """Per-process state was asked for by a job whose process count differs from the
    save's, without saying how to map the saved records onto its processes."""


class SaveAgreementError(SaveError):
    """Before a save wrote anything, the processes disagreed on what to save (another
    path, step or tree, or a different non-array value), one refused, or one did not
    arrive within the agreement timeout. Raised on every process; nothing was written."""


class RestoreAgreementError(CheckpointError, RuntimeError):
    """A cooperative restore (collective) could not go ahead: the processes restore
    another path, save or target, one could not restore (its error is named), failed
    to read its share, or did not arrive in time. Raised on every process, before the
    exchange; the process that failed raises its own error instead."""


class ReplicationError(SaveError):
    """Copying a committed local step to the durable tier, or committing it there, failed.

    The local step is kept; nothing was committed on the durable tier.
    """


class LockHeldByThisProcessError(CheckpointError):
    """The writer's lock is held by another manager of this very process."""


class LockHeldError(BlockingIOError):
    """`FileLock.acquire(wait=False)` found the lock held by another process.

    Attributes:
      holder: the note the holder wrote into the lock file ("" when it wrote none).
    """

    def __init__(self, path: str, holder: str):
        super().__init__(errno.EWOULDBLOCK, f"locked by {holder or 'unknown holder'}", path)
        self.holder = holder


class UsageError(Exception):
    """A bad command line (exit status 2)."""


class ProcessesFailed(AssertionError):
    """The processes timed out (all were killed), or one ended with an unexpected status.

    An `AssertionError`, so that pytest reports it as a test failure. The message holds
    the tail of every process's stdout and stderr.
    """


def this_process() -> int | None:
    """This process's index for error messages: `jax.process_index()` when the job has
    several processes (`jax.process_count() > 1`), None with one process (nothing to tell
    apart) or when JAX is not imported yet (the library does not import it for this).

    Multi-process: each process names itself; no communication."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    return jax.process_index() if jax.process_count() > 1 else None


def path_keystr(leaf_path: str) -> str:
    """A leaf path (escaped storage name, `_format._tree`) written as
    `jax.tree_util.keystr` writes a key path, for when the saved key string is not at
    hand: `"opt_state/0/nu/params/l2/bias"` -> `"['opt_state'][0]['nu']['params']['l2']['bias']"`.
    Exact for dict keys; an attribute (`.params` of a `TrainState`) comes out as
    `['params']`, a str key made of digits as `[0]`. `""` (a root leaf) stays `""`."""
    if not leaf_path:
        return ""
    out = []
    for c in leaf_path.split("/"):
        if c.startswith("@int:"):
            out.append(f"[{c[len('@int:'):]}]")
        elif c.startswith("@") and ":" in c:
            out.append(f"[{urllib.parse.unquote(c.split(':', 1)[1])}]")  # a repr, as keystr prints other keys
        elif c.isdigit():
            out.append(f"[{c}]")
        else:
            out.append(f"[{'' if c == '%' else urllib.parse.unquote(c)!r}]")
    return "".join(out)


def leaf_name(leaf_path: str | None = None, keystr: str | None = None) -> str:
    """The one name a user reads for a leaf, everywhere (errors, plans, the command
    line, reports): its key string as `jax.tree_util.keystr` writes it for the saved
    tree (`.opt_state[0].nu['params']`, `['params']['dense']['kernel']`), `<root>` for
    a root leaf. Give `keystr` when known (`ArrayMetadata.keystr`,
    `CheckpointMetadata.keystr`, `keystr(key_path)` at save); else it is rebuilt from
    the leaf path (`path_keystr`). Storage paths are never shown as leaf names."""
    name = keystr if keystr is not None else path_keystr(leaf_path or "")
    return name or "<root>"


def where(
    *, leaf: str | None = None, path: str | None = None, process: int | None = None, keystr: str | None = None
) -> str:
    """Formats the location part of an error message: `leaf ['a']['b'] in /ckpt/100 (process 0)`.

    Args:
      leaf: the leaf path (escaped storage name): named as `leaf_name` writes it.
      path: the checkpoint path.
      process: the process index.
      keystr: the leaf's key string (as `jax.tree_util.keystr` prints it), when known
        (`<root>` for a root leaf).
    """
    parts = []
    if keystr is not None or leaf is not None:
        parts.append(f"leaf {leaf_name(leaf, keystr)}")
    if path is not None:
        parts.append(f"in {path}")
    if process is not None:
        parts.append(f"(process {process})")
    return " ".join(parts)
