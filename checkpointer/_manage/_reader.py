"""What any manager does without the writer's lock: list the committed steps of its
directory, find the folder a step is read from, follow new steps as they commit, read the
per-process state and run the restore drill. `CheckpointManager` derives from it."""

from __future__ import annotations

import operator
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .. import _commit
from .._errors import CheckpointNotFoundError
from .._storage import Storage
from ._follow import StepFollower

if TYPE_CHECKING:
    from .._tools import DrillReport


class StepReader:
    """The reading side of a `CheckpointManager` of `directory`: listing, following and
    reading steps; takes no lock and deletes nothing, so any number of readers may run
    beside the writer.

    Attributes:
      storage: the backend of `directory`.
      directory: the directory of steps, normalised for `storage`.
    """

    storage: Storage
    directory: str

    # --- listing ------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (never an uncommitted folder)."""
        return _commit.committed_steps(self.storage, self.directory)

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def wait_for_step(self, after: int | None = None, *, timeout_s: float | None = None, poll_s: float = 1.0) -> int | None:
        """Waits until a committed step newer than `after` exists and returns the newest.

        Like Orbax's `wait_for_new_checkpoint`: an evaluation job calls it with the last
        step it evaluated. Takes no lock; the directory is listed every `poll_s`.

        Args:
          after: a step, or None to accept any committed step.
          timeout_s: give up after this many seconds (None: wait for as long as it takes).
          poll_s: seconds between listings (> 0).
        Returns:
          The newest committed step (> `after`), or None if none appeared in time.

        Multi-process: any process may call it alone.
        """
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0 seconds, got {poll_s!r}")
        deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        while True:
            latest = self.latest_step()
            if latest is not None and (after is None or latest > after):
                return latest
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            time.sleep(poll_s if deadline is None else min(poll_s, deadline - now))

    def follow(self, after: int | None = None, *, timeout_s: float | None = None, poll_s: float = 1.0) -> StepFollower:
        """Yields committed steps newer than `after`, oldest first, as they appear.

        Like TensorFlow's `checkpoints_iterator`, but every new step is yielded (not just
        the newest), in ascending order; the directory is listed again before each one.
        It ends once the writer closed with `close(finished=True)`, after yielding every
        step up to the marked one, or once no new step appeared for `timeout_s`. A step
        that retention removed before it could be yielded is skipped, logged and counted
        (`removed_steps` of the iterator returned). A step yielded may still be removed
        by retention before it is restored: `restore` then raises
        `CheckpointNotFoundError` (never returns a mix or reports damage); skip it.

        Args:
          after: yield only steps > `after` (None: every committed step, from the oldest).
          timeout_s: stop once no new step appeared for this many seconds (None: never,
            unless the run is marked finished).
          poll_s: seconds between listings while waiting (> 0).
        Returns:
          A `StepFollower`: an iterator of step numbers, strictly increasing, with
          `removed_steps`, `finished` and `finished_step`.
        Raises:
          ValueError: `poll_s` is not > 0.

        Multi-process: any process may call it alone; takes no lock and deletes nothing.
        """
        return StepFollower(self.storage, self.directory, self.all_steps, after, timeout_s=timeout_s, poll_s=poll_s)

    def step_path(self, step: int) -> str:
        """The checkpoint path of `step`."""
        return f"{self.directory}/{int(step)}"

    def _read_path(self, step: int | None, folders: Mapping[int, str] | None = None) -> str:
        """Where committed `step` (None: the newest) is read from: `step_path(step)`, or
        the committed partial folder of a save that crashed before its rename (until the
        writer's recovery renames it into place). One listing, or none when `folders`
        (`_commit.committed_folders`) is given.

        Raises:
          CheckpointNotFoundError: `step` is None and no step is committed.
        """
        folders = _commit.committed_folders(self.storage, self.directory) if folders is None else folders
        if step is None:
            if not folders:
                raise CheckpointNotFoundError(f"no committed step in {self.directory}")
            step = max(folders)
        return f"{self.directory}/{folders.get(int(step), str(int(step)))}"

    # --- reading ------------------------------------------------------------------------

    def per_process_state(
        self, step: int | None = None, *, process_index: int | None = None, all_processes: bool = False
    ) -> object:
        """The per-process state saved with `step` (default: the newest committed step).

        As `ckpt.per_process_state`: this process's own record when the job has as
        many processes as the save; otherwise pass `all_processes=True` (a list indexed
        by the saving process) or `process_index=i`.

        Raises:
          CheckpointNotFoundError: no committed step (or not that one).
          ProcessCountMismatchError: the process counts differ and no choice was given.

        Multi-process: any process may call it alone.
        """
        from .._restore import per_process_state

        return per_process_state(self._read_path(step), process_index, all_processes=all_processes)

    def drill(self, mesh_shape: Sequence[int] | None = None, *, axis_names: Sequence[str] | None = None) -> DrillReport:
        """The restore drill: restore the newest committed step onto a scratch mesh of the
        local devices (or `mesh_shape`), verify every checksum, and time it.

        Returns:
          A `DrillReport` (restore_s, verify_s, bytes_read, bytes_needed,
          read_amplification, step, ok, problems).
        Raises:
          CheckpointNotFoundError: no committed step.
          ValueError: fewer local devices than `mesh_shape` needs.

        Multi-process: any process may call it alone; it uses local devices only.
        """
        from .._tools import drill

        return drill(self.directory, mesh_shape, axis_names=axis_names)


def as_step(step: object) -> int:
    """The step as a Python int (numpy and 0-d JAX integers accepted)."""
    try:
        value = operator.index(step)  # type: ignore[arg-type]  # any object: the TypeError is the check
    except TypeError:
        raise ValueError(f"step must be an int >= 0, got {step!r}") from None
    if value < 0 or isinstance(step, bool):
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return value
