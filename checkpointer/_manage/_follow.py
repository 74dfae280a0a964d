"""Following a run: the finished mark a writer leaves, and the iterator `follow()` returns.

```
DIR/.checkpointer-finished.json   {"step": <newest committed step or null>, "finished_unix_s": ...}
```
Only an explicit `mgr.close(finished=True)` writes the mark (process 0, after every save
in flight committed): a preempted job also closes cleanly and must not end its
evaluators. The next writer's first save (or `recover()`) removes it.

`StepFollower` yields committed steps oldest first. Each poll reads the mark before the
listing, so every step up to the marked one (committed before the mark was written) is
in that listing: the follower yields them and ends. Steps that were committed and then
removed by retention before the follower could yield them are learned from the save
journal (`DIR/.checkpointer-journal.jsonl`, one line per commit of the manager's direct
saves, with its generation; notes of requested and failed saves carry an `"event"` and
are skipped; read incrementally), counted in `removed_steps` and logged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

from .. import _commit, _format
from .._errors import CheckpointError
from .._storage import Storage

log = logging.getLogger("checkpointer")

FINISHED_NAME = _commit.FINISHED_NAME


@dataclasses.dataclass(frozen=True)
class FinishedMark:
    """A run marked finished by `close(finished=True)`.

    Attributes:
      step: the newest committed step when the writer closed (None: it had none).
      finished_unix_s: when, seconds since the epoch.
    """

    step: int | None
    finished_unix_s: float


def write_finished(storage: Storage, directory: str, step: int | None) -> None:
    """Process 0 of the writer: marks the run finished at `step`."""
    body = {"step": step, "finished_unix_s": time.time()}
    storage.write_file(f"{directory}/{FINISHED_NAME}", _format.dumps(body))


def clear_finished(storage: Storage, directory: str) -> None:
    """The writer's first save: the run goes on, the mark goes."""
    storage.delete_file(f"{directory}/{FINISHED_NAME}")


def read_finished(storage: Storage, directory: str) -> FinishedMark | None:
    """The mark, or None (absent, or not one of ours: a warning)."""
    path = f"{directory}/{FINISHED_NAME}"
    try:
        raw = _format.loads(storage.read_file(path), path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (CheckpointError, OSError) as e:
        log.warning("cannot read the finished mark %s: %s; following on", path, e)
        return None
    if not isinstance(raw, dict):
        log.warning("the finished mark %s is not a JSON object (%r); following on", path, raw)
        return None
    step = raw.get("step")
    if not (step is None or (isinstance(step, int) and not isinstance(step, bool) and step >= 0)):
        log.warning("the finished mark %s holds no step (%r); following on", path, raw)
        return None
    when = raw.get("finished_unix_s")
    return FinishedMark(step, _format.finite_number(when) or 0.0)


class _JournalSteps:
    """The steps the save journal says were committed, read from where the last read
    ended (local files) or whole (object stores, where it is rewritten)."""

    def __init__(self, storage: Storage, directory: str) -> None:
        self.storage, self.path = storage, f"{directory}/{_commit.SAVE_JOURNAL}"
        self.steps: set[int] = set()
        self._offset = 0

    def update(self) -> set[int]:
        try:
            if self.storage.cheap_size:
                size = self.storage.size(self.path)
                if size < self._offset:  # rewritten
                    self._offset = 0
                data = self.storage.read_range(self.path, self._offset, size - self._offset) if size > self._offset else b""
            else:
                self._offset, data = 0, self.storage.read_file(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return self.steps
        except OSError as e:
            log.warning("cannot read the save journal %s: %s", self.path, e)
            return self.steps
        whole = data[: data.rfind(b"\n") + 1]  # a line being appended waits for the next read
        self._offset += len(whole)
        for line in whole.splitlines():
            try:
                entry = _format.load_json(line, what=self.path)
                step = entry.get("step")
            except (ValueError, AttributeError):  # CorruptCheckpointError is a ValueError
                continue
            if "event" in entry or "generation" not in entry:
                continue  # a note of another kind (a requested or failed save: `_alerts`), not a commit
            if isinstance(step, int) and not isinstance(step, bool):
                self.steps.add(step)
        return self.steps


class StepFollower(Iterator[int]):
    """The iterator `follow()` returns: committed steps newer than `after`, oldest first.

    Attributes:
      removed_steps: steps committed and removed by retention before they could be
        yielded, ascending (each also logged as a warning).
      finished_step: the step the writer marked finished with (`close(finished=True)`)
        once the follower has ended on it, else None.
      finished: True once it ended on a finished mark (not on `timeout_s`).
    """

    def __init__(
        self, storage: Storage, directory: str, list_steps: Callable[[], list[int]], after: int | None,
        *, timeout_s: float | None, poll_s: float,
    ) -> None:
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0 seconds, got {poll_s!r}")
        self.storage, self.directory = storage, directory
        self._list_steps = list_steps
        self._last = after
        self._yielded: set[int] = set()
        self._timeout_s = None if timeout_s is None else float(timeout_s)
        self._poll_s = poll_s
        self._journal = _JournalSteps(storage, directory)
        self._done = False
        self.removed_steps: list[int] = []
        self.finished_step: int | None = None
        self.finished = False

    def _count_removed(self, below: int | None, present: list[int]) -> None:
        """Journal steps after the last one yielded and before `below` (None: no bound)
        that are gone from the listing `present`."""
        have = set(present)
        for s in sorted(self._journal.update()):
            if (self._last is None or s > self._last) and (below is None or s < below) and s not in have \
                    and s not in self._yielded and s not in self.removed_steps:
                self.removed_steps.append(s)
                log.warning(
                    "follow(%s): step %d was committed and removed by retention before it could be yielded "
                    "(%d such steps so far)", self.directory, s, len(self.removed_steps),
                )

    def __next__(self) -> int:
        if self._done:
            raise StopIteration
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        while True:
            mark = read_finished(self.storage, self.directory)  # before the listing: see the module docstring
            steps = self._list_steps()
            newer = [s for s in steps if self._last is None or s > self._last]
            if mark is not None:
                newer = [s for s in newer if mark.step is not None and s <= mark.step]
            if newer:
                step = newer[0]
                self._count_removed(step, steps)
                self._last = step
                self._yielded.add(step)
                return step
            if mark is not None:
                self._count_removed(None if mark.step is None else mark.step + 1, steps)
                self._done, self.finished, self.finished_step = True, True, mark.step
                log.info("follow(%s): the run is finished at step %s", self.directory, mark.step)
                raise StopIteration
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._done = True
                raise StopIteration
            time.sleep(self._poll_s if deadline is None else min(self._poll_s, deadline - now))
