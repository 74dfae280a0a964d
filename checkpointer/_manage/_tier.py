"""One interface for every place a manager keeps steps: `Tier`.

A tier holds committed steps, each a step folder (the library's layout: `manifest.json`,
`arrays/`, `processes/`, `COMMITTED`) under one root of one `Storage`. The manager asks
every tier the same questions (which steps, of which save attempt, where to read one,
remove one) and applies each tier's retention under that tier's own lock
(`retention_mu`), so the local, peer and durable tiers are implementations of one
interface rather than hard-coded cases:

- `LocalStepTier`: this process's own local steps (`LOCAL/process-<i>/`), node-local
  disk or memory (`/dev/shm`). Survives a restart of the process on the same node.
- `PeerCopyTier`: the copies this process holds of another process's local steps
  (`LOCAL/peer-copies/process-<owner>/`, written by `_peers`). Survives the loss of the
  owner's node.
- `DurableTier`: the manager's directory (shared storage, a bucket). Survives any node loss.

`tests/test_tier_conformance.py` runs one conformance test against each implementation.
"""

from __future__ import annotations

import abc
import logging
import threading

from .. import _commit, _format
from .._errors import CheckpointError
from .._storage import Storage

PEER_COPIES_DIR = "peer-copies"
log = logging.getLogger("checkpointer")


class Tier(abc.ABC):
    """One place that holds committed steps.

    Attributes:
      name: "local", "peer" or "durable" (for messages and `status`).
      survives: what the tier survives, in words (docs and `status`).
      storage: the tier's backend; root: the folder of its step folders.
      retention_mu: the tier's one retention lock: retention of this tier runs one
        call at a time under it (the save thread, the replication and peer threads).
    """

    name: str = ""
    survives: str = ""

    def __init__(self, storage: Storage, root: str, retention_mu: threading.Lock | None = None) -> None:
        self.storage, self.root = storage, root
        self.retention_mu = retention_mu if retention_mu is not None else threading.Lock()

    def folders(self) -> dict[int, str]:
        """Step → folder name of every committed step, ascending."""
        try:
            return _commit.committed_folders(self.storage, self.root)
        except FileNotFoundError:
            return {}

    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        return list(self.folders())

    def step_path(self, step: int) -> str:
        """The folder of committed `step` (to read it with `restore_from`).

        Raises:
          CheckpointError: the tier holds no committed `step`.
        """
        folders = self.folders()
        if step not in folders:
            raise CheckpointError(f"the {self.name} tier {self.root} holds no committed step {step}")
        return f"{self.root}/{folders[step]}"

    def generation(self, step: int) -> str | None:
        """The save attempt of committed `step` (its marker's generation), or None."""
        try:
            path = self.step_path(step)
            marker = _format.loads(self.storage.read_file(f"{path}/{_format.COMMITTED}"), path)
        except (FileNotFoundError, NotADirectoryError, CheckpointError):
            return None
        generation = marker.get("generation") if isinstance(marker, dict) else None
        return None if generation is None else str(generation)

    def remove(self, step: int) -> None:
        """Removes committed `step` (unpublished first, so a crash leaves no half step)."""
        _commit.delete_step(self.storage, self.root, step)

    @abc.abstractmethod
    def describe(self) -> str:
        """The tier in words, e.g. `the local tier /ssd/process-3`."""


class LocalStepTier(Tier):
    """This process's own local steps (`LOCAL/process-<i>/`)."""

    name = "local"
    survives = "a restart of the process on the same node (not the loss of the node)"

    def describe(self) -> str:
        return f"the local tier {self.root}"


class PeerCopyTier(Tier):
    """The copies this process holds of process `owner`'s local steps."""

    name = "peer"
    survives = "the loss of the owner's node (each copy is on another node)"

    def __init__(self, storage: Storage, root: str, owner: int, retention_mu: threading.Lock | None = None) -> None:
        super().__init__(storage, root, retention_mu)
        self.owner = owner

    def describe(self) -> str:
        return f"the copies of process {self.owner}'s local steps in {self.root}"


class DurableTier(Tier):
    """The manager's directory (shared storage or a bucket)."""

    name = "durable"
    survives = "the loss of any number of nodes (the storage's own durability)"

    def describe(self) -> str:
        return f"the durable tier {self.root}"


def peer_copy_root(local_root: str, owner: int) -> str:
    """Where process `local_root`'s owner keeps its copies of process `owner`'s local
    steps: `<local_root>/peer-copies/process-<owner>` (`local_root`: `LOCAL/process-<i>`)."""
    return f"{local_root}/{PEER_COPIES_DIR}/process-{owner}"


def held_owners(storage: Storage, local_root: str) -> list[int]:
    """The processes whose copies `local_root` holds (its `peer-copies/process-<i>/` folders)."""
    prefix = "process-"
    return sorted(int(n[len(prefix):]) for n in storage.list_dir(f"{local_root}/{PEER_COPIES_DIR}")  # [] if absent
            if n.startswith(prefix) and n[len(prefix):].isdigit())


def recover_peer_copies(storage: Storage, local_root: str) -> list[str]:
    """Finishes what a killed holder left in `<local_root>/peer-copies/process-<i>/`, as
    `_commit.recover` does for a directory of steps: a copy committed but not renamed
    (killed between the marker's rename and the folder's) is renamed into place; uncommitted
    partial and `.deleting-` folders are removed. Call while no put is in flight (the
    holder's start). Returns the folders renamed or removed; a folder that cannot be
    cleaned up stays listed as it was (logged)."""
    done: list[str] = []
    for owner in held_owners(storage, local_root):
        root = peer_copy_root(local_root, owner)
        try:
            done += [f"{root}/{folder}" for folder in _commit.recover(storage, root)]
        except OSError as e:
            log.warning("could not clean up the peer copies in %s: %s", root, e)
    return done
