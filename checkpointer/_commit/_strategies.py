"""How a save becomes visible: the commit strategies a storage backend hands out.

`RenameCommit` (POSIX) writes into `<step>.partial-<generation>/` and publishes by
`rename`; `MarkerCommit` (object stores, no rename) writes under the final name and the
commit marker alone publishes. Both sit behind `CommitStrategy`, as Orbax's
`AtomicRenameTemporaryPath` and `CommitFileTemporaryPath` do; `strategy_for(storage)`
picks one from the backend's capabilities. The bytes move through the `Storage` each
strategy holds; this module decides only names and order.
"""

from __future__ import annotations

import abc
import os
import uuid
from typing import TYPE_CHECKING

from .. import _format
from .._errors import CheckpointExistsError

if TYPE_CHECKING:
    from .._storage import Storage


class CommitStrategy(abc.ABC):
    """How a save becomes visible, and how a committed step stops being visible.

    A save writes its files into `write_path(path, generation)`, then its manifest and
    commit marker there, then calls `publish`. Recovery and retention call `unpublish`.
    The two strategies mirror Orbax's `AtomicRenameTemporaryPath` and
    `CommitFileTemporaryPath`.

    Attributes:
      writes_in_place: saves write under the final name, so a `<step>/` without a
        marker may be a save in flight (recovery must wait before removing it).
    """

    writes_in_place: bool

    def __init__(self, storage: Storage):
        self.storage = storage

    @abc.abstractmethod
    def write_path(self, path: str, generation: str) -> str:
        """The folder a save of `path` (attempt `generation`) writes its files into."""

    def target_blocked(self, path: str) -> bool:
        """Whether something that is no folder sits at `path` and blocks publishing."""
        return False

    def prepare_overwrite(self, path: str) -> None:
        """Process 0, before the generation is agreed: makes room for a save of `path`."""

    @abc.abstractmethod
    def publish(self, write_path: str, path: str, generation: str, *, overwrite: bool) -> str | None:
        """Makes the marked save in `write_path` the checkpoint at `path`.

        Returns:
          A replaced folder to remove once published (see `finish_publish`), or None.
        Raises:
          CheckpointExistsError: `path` was committed meanwhile and not `overwrite`.
          OSError: publishing failed; nothing was published.
        """

    def finish_publish(self, path: str, replaced: str | None) -> None:
        """After `publish`: makes the publication durable and removes `replaced`.
        Its OSErrors do not undo the commit."""

    def discard_path(self, path: str, generation: str) -> str | None:
        """The folder process 0 removes after a failed save, or None to leave the
        leftovers to recovery (a save under the final name may share it with others)."""
        return None

    @abc.abstractmethod
    def unpublish(self, path: str) -> str:
        """Makes the committed checkpoint at `path` vanish from listings at once.

        Returns:
          The folder left to remove (`delete_tree`); a crash before the removal leaves
          nothing that looks committed, and recovery removes the rest.
        """


class RenameCommit(CommitStrategy):
    """POSIX: write into `<step>.partial-<generation>/`, publish by `rename`; a replaced
    step is first renamed to `<step>.deleting-<generation>/`, removed after publishing."""

    writes_in_place = False

    def write_path(self, path: str, generation: str) -> str:
        parent, name = path.rsplit("/", 1)
        return f"{parent}/{_format.partial_name(name, generation)}"

    def target_blocked(self, path: str) -> bool:
        return os.path.lexists(path) and not os.path.isdir(path)  # a folder cannot be renamed onto it

    def publish(self, write_path: str, path: str, generation: str, *, overwrite: bool) -> str | None:
        storage = self.storage
        storage.sync_dir(write_path)
        committed = storage.exists(f"{path}/{_format.COMMITTED}")
        if not (committed or os.path.exists(path)):
            storage.rename(write_path, path)
            return None
        if committed and not overwrite:
            raise CheckpointExistsError(
                f"{path} was committed by another save while this one was writing (process 0): this save committed "
                "nothing. Pass overwrite=True (CheckpointManager: force=True) to replace it, or save to another path"
            )
        # Replace: move the old one aside, publish the new one, then delete the old. A
        # crash between the two renames leaves a committed partial folder that
        # recovery rolls forward.
        old = _format.deleting_name(path, generation)
        storage.rename(path, old)
        try:
            storage.rename(write_path, path)
        except OSError:
            storage.rename(old, path)  # put the old checkpoint back before reporting
            raise
        return old

    def finish_publish(self, path: str, replaced: str | None) -> None:
        self.storage.sync_dir(path.rsplit("/", 1)[0])
        if replaced is not None:
            self.storage.delete_tree(replaced)

    def discard_path(self, path: str, generation: str) -> str | None:
        # The step moved aside by this save and not put back (both renames of `publish`
        # failed): the committed partial folder is all that holds the step now, for
        # recovery to roll forward; never remove it too.
        if os.path.lexists(_format.deleting_name(path, generation)) and not os.path.lexists(path):
            return None
        return self.write_path(path, generation)

    def unpublish(self, path: str) -> str:
        moved = _format.deleting_name(path, f"gc-{uuid.uuid4().hex[:8]}")
        self.storage.rename(path, moved)
        return moved


class MarkerCommit(CommitStrategy):
    """Object stores (no rename): write under the final name; the commit marker alone
    publishes. Overwriting clears the folder first, so the step is absent until the
    new marker lands, the best an object store allows without rename."""

    writes_in_place = True

    def write_path(self, path: str, generation: str) -> str:
        return path

    def prepare_overwrite(self, path: str) -> None:
        # Whatever is there (a committed step being overwritten, or a crashed save's
        # leftovers) goes: the marker first, then every object. Process 0 does it
        # before the generation is agreed, so no other process has started writing.
        if self.storage.list_dir(path):
            self.storage.delete_file(f"{path}/{_format.COMMITTED}")
            self.storage.delete_tree(path)

    def publish(self, write_path: str, path: str, generation: str, *, overwrite: bool) -> None:
        return None  # the marker, already written, is the publication

    def unpublish(self, path: str) -> str:
        self.storage.delete_file(f"{path}/{_format.COMMITTED}")
        return path


def strategy_for(storage: Storage) -> CommitStrategy:
    """How saves are published on `storage`: by rename where it exists, else by marker."""
    return RenameCommit(storage) if storage.supports_rename else MarkerCommit(storage)
