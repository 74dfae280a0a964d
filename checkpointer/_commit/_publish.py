"""The commit sequence, written once: a direct save, a local-tier commit and a
replication to the durable tier all commit through `Commit`.

Once a process's files (chunks, pack, `processes/<i>.json`) are durable in the write
path (`<step>.partial-<generation>/` on POSIX, the final path on object stores):

1. it reports done (its bytes) in the commit's round of the rendezvous
   (`checkpointer/commit/<name>/`, `name` the generation, or a replication attempt of it);
2. process 0 waits for every report (a timeout names the missing processes; a
   process's error ends the wait at once), checks that every record is in the folder,
   writes the step-catalog entry (before the marker), the manifest, the commit marker,
   then publishes through the commit strategy (rename on POSIX) and runs the
   after-publish hook (retention; its errors are logged, the commit stands);
3. process 0 announces the outcome; the others return, or raise its error.

Any failure announces the error and removes the write path on process 0 once no
process writes into it (`discard`). A local-tier commit is the same sequence for one
process alone (`round=None`): no report, no announcement.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from .. import _coord, _format
from .._coord import MAX_SHOWN, Round
from .._errors import CheckpointError, CheckpointExistsError, CommitTimeoutError, CorruptCheckpointError, SaveError
from .._storage import Storage
from ._catalog import add_entry
from ._strategies import strategy_for

log = logging.getLogger("checkpointer")

# Write folders of failed saves whose removal failed (EIO, a busy mount), by parent
# directory: no save writes into them any more (a folder is only removed once every
# process reported), so the writer retries after its next commit (`remove_leftovers`)
# instead of leaving them until the next writer's recovery.
_leftovers_mu = threading.Lock()
_leftovers: dict[str, set[str]] = {}


def remove_leftovers(storage: Storage, directory: str) -> list[str]:
    """Retries removing the write folders of this process's failed saves into
    `directory` whose removal failed; returns those removed now (a failure is logged,
    and retried next time).

    Multi-process: process 0 (the only one that removes them) calls it after a commit.
    """
    with _leftovers_mu:
        folders = sorted(_leftovers.get(directory, ()))
    removed = []
    for folder in folders:
        try:
            storage.delete_tree(folder)
        except OSError as e:
            log.warning("could not remove %s (left by a failed save) again: %s", folder, e)
            continue
        with _leftovers_mu:
            _leftovers.get(directory, set()).discard(folder)
        removed.append(folder)
    return removed

# Extra time processes other than 0 allow process 0 to publish (manifest, marker, rename).
PUBLISH_MARGIN_S = 60.0


def commit_round(name: str, path: str, timeout_s: float, *, what: str | None = None) -> Round:
    """The rendezvous of the commit `name` (a generation, or `<generation>.replicate-<n>`)
    of `path`: done reports, then process 0's announcement; `what` names it in messages."""

    def decide(got: Mapping[int, dict]) -> str | None:
        refused = _coord.refusals(got)
        lines = [f"process {i} failed to write its shards of {path}: {text}" for i, text in sorted(refused.items())]
        return "\n".join(lines[:MAX_SHOWN]) + "\nNothing was committed." if lines else None

    return Round(
        f"commit/{name}", decide=decide, timeout_s=timeout_s, what=what or f"the commit of {path} (generation {name})",
        error=SaveError, timeout_error=CommitTimeoutError, arrive="report done", timeout_name="commit_timeout_s",
        hint="Nothing was committed. Check that every process called save for this step and is alive, or raise "
             "commit_timeout_s.",
        late_hint=f"Process 0 was committing when this process gave up, so {path} may still be committed: "
                  f"it is if it has a {_format.COMMITTED} marker (`checkpointer ls`). Raise commit_timeout_s if the "
                  "storage is this slow.",
        verdict_margin_s=PUBLISH_MARGIN_S,
    )


class Commit:
    """One commit of the checkpoint at `path`, attempt `generation`.

    Args:
      storage: where it is written.
      path: the final checkpoint path.
      generation: the save attempt (names the partial folder).
      overwrite: a committed checkpoint at `path` is replaced (atomically on POSIX).
      round: the processes that commit it together (`commit_round`); None: this
        process alone (the local tier).
      process_index: this process (default: the round's).
    """

    def __init__(
        self, storage: Storage, path: str, generation: str, *, overwrite: bool, round: Round | None = None,
        process_index: int | None = None,
    ) -> None:
        self.storage, self.path, self.generation, self.overwrite, self.round = storage, path, generation, overwrite, round
        self.process_index = process_index if process_index is not None else (round.index if round is not None else 0)
        self.strategy = strategy_for(storage)
        self.write_path = self.strategy.write_path(path, generation)
        # Process 0, once every process reported: the processes whose records hold
        # references (incremental saves), from their reports; the manifest gathers those.
        self.referencing: list[int] = []

    def fail(self, error: BaseException | str) -> None:
        """This process could not write its files: tells the others (process 0 stops
        waiting for it) and removes the write path (process 0, once no process writes
        into it)."""
        if self.round is not None:
            self.round.refuse(error)
        self.discard()

    def run(
        self,
        bytes_written: int | None,
        manifest: Callable[[list[int]], bytes],
        *,
        marker: Mapping | None = None,
        after_publish: Callable[[], object] | None = None,
        phases: dict[str, tuple[float, float]] | None = None,
        references: bool = False,
        guard: contextlib.AbstractContextManager | None = None,
    ) -> None:
        """This process's files are durable: commits (process 0) or waits for the commit.

        Args:
          bytes_written: this process's bytes, for the manifest.
          manifest: the manifest's bytes from every process's bytes written; it may read
            `self.referencing`, the processes that reported `references`.
          marker: the commit marker's content (default: generation and time).
          after_publish: process 0 runs it after publishing, before the others are
            told (retention), so when the commit returns anywhere it is done too.
          phases: process 0 records `wait` (its report to every report) and `commit`.
          references: this process's record holds references (incremental saves): it
            says so in its report, so process 0 gathers them whatever its own save did.
          guard: process 0 holds it from the manifest to the publication (incremental
            saves: the retention of the directory waits, so the referenced chunks it
            checked stay until this step is listed).
        Raises:
          CommitTimeoutError: a process did not report in time; nothing was committed.
          SaveError: a process failed, or committing failed; nothing was committed.
          CheckpointExistsError: `path` was committed meanwhile and not `overwrite`.
        """
        reported = time.time()
        r = self.round
        report = {"bytes": int(bytes_written or 0), **({"references": 1} if references else {})}
        if r is not None:
            r.post(report)
            if r.index != 0:
                try:
                    r.wait()
                except CommitTimeoutError:
                    if not self._committed_here():
                        raise
                    log.warning("%s was committed by process 0, whose verdict came after this process's timeout", self.path)
                return
        try:
            got = r.gather() if r is not None else {self.process_index: report}
        except BaseException as e:  # published by the round
            self.discard(timed_out=isinstance(e, CommitTimeoutError))
            raise
        all_durable = time.time()
        if phases is not None:
            phases["wait"] = (reported, all_durable)
        self.referencing = [i for i in sorted(got) if got[i].get("references")]
        try:
            self._check_records(sorted(got))
            add_entry(self.storage, self.path, self.generation)  # before the marker
            with guard if guard is not None else contextlib.nullcontext():
                self._publish(manifest, [int(got[i].get("bytes", 0)) for i in sorted(got)], marker)
        except BaseException as e:
            if r is not None:
                r.publish_error(f"process 0 could not commit {self.path}: {_coord.error_text(e)}")
            self.discard()
            raise
        if phases is not None:
            phases["commit"] = (all_durable, time.time())
        if after_publish is not None:
            try:
                after_publish()
            except Exception as e:  # retention failures must not undo a commit
                log.warning("after committing %s: %s", self.path, e)
        if r is not None:
            r.publish()

    def _committed_here(self) -> bool:
        """Whether `path` holds this commit (its marker names this generation): process 0
        went ahead while this process waited for its verdict."""
        try:
            marker = _format.loads(self.storage.read_file(f"{self.path}/{_format.COMMITTED}"), self.path)
        except (OSError, CheckpointError):
            return False
        return isinstance(marker, dict) and marker.get("generation") == self.generation

    def _check_records(self, processes: Sequence[int]) -> None:
        """Process 0, before committing: every process's record is in this save's folder.

        A process that reported done for this generation but wrote elsewhere (saves
        called in different orders) must not yield a committed checkpoint with missing
        shards.
        """
        missing = [i for i in processes if not self.storage.exists(f"{self.write_path}/{_format.process_record_name(i)}")]
        if missing:
            raise SaveError(
                f"processes {missing} reported their shards durable but {self.write_path} has no record of them; "
                "nothing was committed. Every process must call save with the same paths in the same order."
            )

    def _publish(self, manifest: Callable[[list[int]], bytes], process_bytes: list[int], marker: Mapping | None) -> None:
        """The manifest, the marker, then the publication; after it only warnings."""
        storage, root, final = self.storage, self.write_path, self.path
        try:
            content_of_manifest = manifest(process_bytes)
        except CorruptCheckpointError as e:  # a process's record, read for the pack index
            raise SaveError(
                f"committing {final} failed (process {self.process_index}): a process record in {root} is "
                f"damaged: {e}. Nothing was committed; save again (a disk or another writer damaged it)."
            ) from e
        try:
            storage.write_file(f"{root}/{_format.MANIFEST}", content_of_manifest)
            content = dict(marker) if marker is not None else {"generation": self.generation, "committed_unix_s": time.time()}
            storage.write_file(f"{root}/{_format.COMMITTED}", _format.dumps(content))
            replaced = self.strategy.publish(root, final, self.generation, overwrite=self.overwrite)
        except CheckpointExistsError:
            raise
        except OSError as e:
            raise SaveError(f"committing {final} failed (process {self.process_index}): {e}") from e
        # Committed: from here on a failure is logged, never raised (a SaveError means that
        # nothing was committed). A leftover `.deleting-` folder is removed by recovery/gc.
        try:
            self.strategy.finish_publish(final, replaced)
        except OSError as e:
            log.warning("committed %s, but syncing its folder or removing the replaced checkpoint failed: %s", final, e)

    def discard(self, *, timed_out: bool = False) -> None:
        """Best-effort removal of the write path after a failure (process 0; alone: this
        process). With several processes the removal waits on a daemon thread until
        every process has reported (ok or error, up to the round's timeout), so that no
        one is still writing into the folder it removes, while the error reaches the
        caller at once. A process that never reports leaves the folder to garbage
        collection, unless the failure itself was the commit timeout (`timed_out`):
        processes silent for that long are taken for dead and it is removed at once.
        Object stores leave it to recovery (no marker: not a checkpoint)."""
        folder = self.strategy.discard_path(self.path, self.generation)
        r = self.round
        if folder is None or (r is not None and r.index != 0):
            return

        def remove() -> None:
            silent = [] if (timed_out or r is None) else r.wait_posted(r.timeout_s)
            if silent:
                log.warning("processes %s never reported; leaving %s for garbage collection", silent, folder)
                return
            try:
                self.storage.delete_tree(folder)
            except OSError as e:
                log.warning("could not remove %s after a failed commit (retried after the next commit): %s", folder, e)
                with _leftovers_mu:
                    _leftovers.setdefault(folder.rstrip("/").rsplit("/", 1)[0], set()).add(folder)

        if r is None or r.count == 1 or timed_out:
            remove()
        else:
            threading.Thread(target=remove, name=f"checkpointer-abort-{self.generation}", daemon=True).start()
