"""Two tiers: a step commits on node-local storage first, then on the durable directory.

```
LOCAL/process-<i>/<step>/               committed on process i's local tier iff
  arrays/<leaf>/zarr.json                 <step>/COMMITTED (its local marker) exists
  arrays/<leaf>/c/...                     only the chunks process i wrote
  processes/<i>.json                      its own record
  manifest.json                           a copy of the manifest (its own bytes only)
  COMMITTED                               local marker: generation, process count, devices
LOCAL/process-<i>/<step>.partial-<g>/   a local save in flight or a crashed one
```
The local commit is per process and needs no other process: each writes its files, its
record and the manifest copy into its partial folder, then the marker, then renames.
Every process's local root is its own folder, so processes sharing one node-local disk
never touch each other's files.

Replication (`replicate`) copies a committed local step's files to the durable tier,
each process only the files it wrote (process 0 also the `zarr.json` nodes), checks
each copy by reading it back and comparing its crc32c with the local file's, writes
its record last, and reports done through the coordination service. Process 0 then
commits as a direct save does: manifest, `COMMITTED`, rename (POSIX). A failure on any
process commits nothing.

Reading: `TieredStorage` serves the files of a step from the local folder where they
are and from the durable tier otherwise, counting the bytes read from the durable tier.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence

import crc32c

from .. import _commit, _coord, _encoding, _format, _storage
from .._errors import CheckpointError, CorruptCheckpointError, ReplicationError, RestoreAgreementError, SaveError
from .._format import ZARR_JSON, ProcessRecord
from .._save import guard
from .._storage import Reader, Storage, storage_for
from . import _tier_references

log = logging.getLogger("checkpointer")

PROCESS_DIR_PREFIX = "process-"
_COPY_THREADS = 8


@dataclasses.dataclass(frozen=True)
class LocalMarker:
    """The content of a local step's marker (`<step>/COMMITTED` on the local tier).

    Attributes:
      generation: the save attempt (the same on every process and on the durable tier).
      process_index: the process that wrote the local step.
      process_count: processes of the job that saved it.
      device_ids: ids of the devices of that process, ascending.
      overwrite: the save replaces a committed durable step (`force=True`).
      committed_unix_s: when the local step committed, seconds since the epoch.
    """

    generation: str
    process_index: int
    process_count: int
    device_ids: tuple[int, ...]
    overwrite: bool
    committed_unix_s: float

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "device_ids": list(self.device_ids), "tier": "local"}

    @staticmethod
    def from_json(obj: object) -> LocalMarker | None:
        """The marker, or None when `obj` is not a local marker (e.g. a durable one)."""
        if not isinstance(obj, dict) or obj.get("tier") != "local":
            return None
        try:
            return LocalMarker(
                generation=str(obj["generation"]), process_index=int(obj["process_index"]),
                process_count=int(obj["process_count"]), device_ids=tuple(int(d) for d in obj["device_ids"]),
                overwrite=bool(obj.get("overwrite", False)), committed_unix_s=float(obj["committed_unix_s"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError):
            return None


def local_root(local_directory: str | os.PathLike, process_index: int) -> tuple[Storage, str]:
    """This process's own folder on the local tier: `<local_directory>/process-<i>`."""
    storage, directory = storage_for(local_directory)
    return storage, f"{directory}/{PROCESS_DIR_PREFIX}{process_index}"


def own_device_ids() -> tuple[int, ...]:
    """Ids of this process's devices, ascending (a local step restores on them only)."""
    import jax

    return tuple(sorted(d.id for d in jax.local_devices()))


def read_marker(storage: Storage, path: str) -> LocalMarker | None:
    """The local marker of the step folder `path`, or None (absent, not local, or
    unreadable, e.g. EIO: the local copy is then not used, and never removed as durable)."""
    try:
        return LocalMarker.from_json(_format.loads(storage.read_file(f"{path}/{_format.COMMITTED}"), path))
    except (OSError, CheckpointError):
        return None


def local_steps(storage: Storage, root: str) -> dict[int, str]:
    """Step → folder of every step committed on this local root, ascending."""
    return _commit.committed_folders(storage, root)


def durable_generation(
    storage: Storage, directory: str, step: int, folders: Mapping[int, str] | None = None
) -> str | None:
    """The generation of committed durable `step` (from its marker), or None (also when
    the marker cannot be read: the local copy is then kept, a restore reads the durable
    tier, which raises the documented error). One
    listing of `directory`, or none when `folders` (`_commit.committed_folders`) is
    given."""
    folders = _commit.committed_folders(storage, directory) if folders is None else folders
    if step not in folders:
        return None
    path = f"{directory}/{folders[step]}"
    try:
        marker = _format.loads(storage.read_file(f"{path}/{_format.COMMITTED}"), path)
    except (OSError, CheckpointError):  # absent, or unreadable (EIO): not known durable, the safe answer
        return None
    return str(marker.get("generation")) if isinstance(marker, dict) else None


# --- replication -------------------------------------------------------------------------


def _crc(data: bytes | memoryview) -> int:
    return crc32c.crc32c(data)


def _copy_verified(src: Storage, src_path: str, dst: Storage, dst_path: str, limiter) -> int:
    """Copies one file and reads the copy back: its crc32c must equal the source's."""
    data = src.read_file(src_path)
    _storage.acquire(limiter, len(data))
    dst.write_file(dst_path, data)
    back = dst.read_file(dst_path)
    if len(back) != len(data) or _crc(back) != _crc(data):
        raise CorruptCheckpointError(
            f"the copy of {src_path} at {dst_path} reads back as {len(back)} bytes with crc32c {_crc(back):#010x}, "
            f"expected {len(data)} bytes with crc32c {_crc(data):#010x}; the durable tier corrupts writes"
        )
    return len(data)


def files_to_replicate(storage: Storage, local_path: str, process_index: int) -> tuple[list[str], str]:
    """What process `process_index` copies of its committed local step: the files of
    its record, as each encoding names them (chunk files; its pack and the pack's
    `zarr.json`), process 0 also every `zarr.json`, then its record (returned apart:
    it is copied last, as it says the process's files are durable)."""
    record_name = _format.process_record_name(process_index)
    raw = _format.loads(storage.read_file(f"{local_path}/{record_name}"), f"{local_path}/{record_name}")
    record = ProcessRecord.from_json(raw, f"{local_path}/{record_name}")
    keys = _encoding.replicated_files(record)  # each encoding's files of this record (a pack: its zarr.json too)
    if process_index == 0:
        keys += [k for k in storage.list_files(local_path) if k == ZARR_JSON or k.endswith("/" + ZARR_JSON)]
    return list(dict.fromkeys(keys)), record_name


def with_every_pack(manifest: dict, durable: Storage, root: str, process_count: int) -> None:
    """Process 0 at the durable commit: the local manifest copy indexes its own pack only
    (`packed_processes`); the durable one indexes every process's, from their records
    in `root` (each process copied its own)."""
    if manifest.pop("packed_processes", None) is None or not any(
            isinstance(e, dict) and e.get("packed") for e in manifest.get("leaves", {}).values()):
        return
    packs = _encoding.packs_of_save(durable, root, -1, None, process_count)
    manifest.pop("packed", None)
    if packs:
        manifest["packed"] = [p.to_json() for p in packs]


@dataclasses.dataclass(frozen=True)
class ReplicationTarget:
    """Where and how one committed local step is replicated.

    Attributes:
      step: the step.
      local_path: its committed local folder.
      durable_path: `<directory>/<step>` on the durable tier.
      generation: the save attempt (names the durable partial folder).
      attempt: the replication attempt of this step in this job (0, 1, ...): names the
        coordination keys, which must never be reused.
      overwrite: replace a committed durable step.
    """

    step: int
    local_path: str
    durable_path: str
    generation: str
    attempt: int
    overwrite: bool


def _commit_of(target: ReplicationTarget, durable: Storage, commit_timeout_s: float) -> _commit.Commit:
    """The durable commit of a replication: the direct save's commit sequence, its round
    keyed `<generation>.replicate-<attempt>` (never reused)."""
    name = f"{target.generation}.replicate-{target.attempt}"
    what = f"the replication of step {target.step} to {target.durable_path} (generation {target.generation}, attempt {target.attempt})"
    round_ = _commit.commit_round(name, target.durable_path, commit_timeout_s, what=what)
    return _commit.Commit(durable, target.durable_path, target.generation, overwrite=target.overwrite, round=round_)


def refuse_replication(target: ReplicationTarget, durable: Storage, reason: str, *, commit_timeout_s: float) -> None:
    """Tells the other processes that this process will not replicate `target` (its
    local save failed), so they fail at once; nothing is committed."""
    _commit_of(target, durable, commit_timeout_s).fail(reason)


def replicate(
    target: ReplicationTarget,
    local: Storage,
    durable: Storage,
    *,
    commit_timeout_s: float,
    limiter: _storage.TokenBucket | None = None,
    after_publish: Callable[[], object] | None = None,
) -> int:
    """Copies this process's files of a committed local step to the durable tier and
    takes part in the durable commit (`_commit.Commit`: process 0 commits).

    Returns:
      Bytes this process copied.
    Raises:
      ReplicationError: a copy, a read-back check or the commit failed, here or on
        another process (a process that did not report within `commit_timeout_s`
        included); nothing was committed on the durable tier.

    Multi-process: every process calls it for the same steps in the same order.
    """
    pidx = _coord.process_index()
    commit = _commit_of(target, durable, commit_timeout_s)
    root = commit.write_path
    lock = None
    copied = 0
    try:
        try:
            keys, record_name = files_to_replicate(local, target.local_path, pidx)
            parent = target.durable_path.rsplit("/", 1)[0]
            durable.makedirs(parent)
            if pidx == 0 and durable.supports_locks and root != target.durable_path:
                lock = durable.lock(root + _commit.SAVE_LOCK_SUFFIX)  # recovery leaves it alone
            # Incremental saves: references to local steps not durable are materialized.
            rewritten = _tier_references.durable_record(local, target.local_path, durable, target.durable_path, record_name)
            sources = [(f"{target.local_path}/{k}", k) for k in keys]
            writes = rewritten.writes if rewritten is not None else []
            if rewritten is not None:
                sources += [(src, k) for src, k, _ in rewritten.copies]
            for folder in sorted({f"{root}/{k}".rsplit("/", 1)[0] for k in [*(k for _, k in sources), *(k for k, _ in writes), record_name]}):
                durable.makedirs(folder)
            with concurrent.futures.ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="checkpointer-replicate") as pool:
                futures = [pool.submit(_copy_verified, local, src, durable, f"{root}/{k}", limiter) for src, k in sources]
                copied = sum(f.result() for f in futures)
            for k, data in writes:  # a materialized pack's zarr.json
                copied += _tier_references.write_verified(durable, f"{root}/{k}", data)
            if rewritten is not None:
                copied += _tier_references.write_verified(durable, f"{root}/{record_name}", rewritten.data)
            else:
                copied += _copy_verified(local, f"{target.local_path}/{record_name}", durable, f"{root}/{record_name}", None)
        except BaseException as e:
            commit.fail(e)
            if isinstance(e, CheckpointError):
                raise ReplicationError(f"replicating step {target.step} to {target.durable_path} failed on process {pidx}: {e}") from e
            raise ReplicationError(
                f"replicating step {target.step} to {target.durable_path} failed on process {pidx}: "
                f"{type(e).__name__}: {e}. The local step is kept (under a durable schedule, until a newer local step "
                "supersedes it); it is replicated again when the job restarts and resumes from it"
            ) from e

        def manifest(process_bytes: list[int]) -> bytes:
            """The local copy of the manifest, with every process's bytes written and
            (`with_every_pack`) every process's pack indexed."""
            raw = _format.loads(local.read_file(f"{target.local_path}/{_format.MANIFEST}"), target.local_path)
            if not isinstance(raw, dict):
                raise CorruptCheckpointError(f"{target.local_path}/{_format.MANIFEST} is not a JSON object")
            found = raw.get("generation")
            if isinstance(found, str) and found != target.generation:  # replaced while copied: files of either save
                raise SaveError(f"{target.local_path} holds save {found!r} of step {target.step}, not {target.generation!r} "
                                "being replicated: another save of the step replaced it; nothing was committed")
            with_every_pack(raw, durable, root, _coord.process_count())
            _tier_references.with_every_reference(raw, durable, root, target.durable_path, commit.referencing)
            return _format.dumps({**raw, "process_bytes_written": process_bytes} if len(process_bytes) > 1 else raw)

        try:
            commit.run(copied, manifest, after_publish=after_publish, references=rewritten is not None and rewritten.has_references,
                       guard=guard(durable, parent))
        except Exception as e:
            if pidx != 0:
                raise ReplicationError(f"step {target.step} was not committed on {target.durable_path}: {e}") from e
            raise ReplicationError(f"committing step {target.step} on {target.durable_path} failed: {e}") from e
        return copied
    finally:
        if lock is not None:
            lock.release(remove=True)


# --- restore -----------------------------------------------------------------------------


_restore_round = itertools.count()


def agree(directory: str, propose: Callable[[], str], timeout_s: float) -> list[str]:
    """Every process's vote (`propose()`, a short text), in process order: one round of
    the rendezvous (keys `checkpointer/tiers/<hash of directory>/restore-<n>/`); one
    process: `[propose()]`. A process whose `propose` raises refuses the round and raises
    its error; the others raise RestoreAgreementError naming it.

    Multi-process: every process calls it, the same number of times, in the same order.
    """
    n = next(_restore_round)
    tag = hashlib.sha256(directory.encode()).hexdigest()[:12]

    def decide(got: Mapping[int, dict]) -> str | None:
        refused = _coord.refusals(got)
        lines = [f"  process {i}: {text}" for i, text in sorted(refused.items())]
        return "\n".join([f"the choice of tier to restore from {directory} failed on {len(refused)} process(es):", *lines]) if lines else None

    vote = _coord.Round(
        f"tiers/{tag}/restore-{n}", decide=decide, timeout_s=timeout_s, error=RestoreAgreementError,
        what=f"the choice of tier to restore from {directory} (restore #{n})", timeout_name="commit_timeout_s",
        hint="Every process of a manager with a local directory must call restore the same number of times, in the "
             "same order.",
        max_poll_s=0.02,  # a restore waits for each round: process 0 polls as the cooperative restore's does
    )
    try:
        mine = propose()
    except BaseException as e:
        vote.refuse(e)
        raise
    payload = vote.agree({"vote": mine}, outcome=lambda got: json.dumps([got[i].get("vote") for i in sorted(got)]))
    votes = _format.load_json(payload, what=f"the vote on the tier to restore from {directory}", error=RestoreAgreementError)
    return [str(v) for v in votes] if isinstance(votes, list) else []


class _CountingReader(Reader):
    def __init__(self, inner: Reader, counter: Callable[[int], None]):
        self._inner, self._count = inner, counter

    def size(self) -> int | None:
        return self._inner.size()

    def read_into(self, offset: int, buffer: memoryview | bytearray) -> None:
        self._count(len(buffer))
        self._inner.read_into(offset, buffer)

    def close(self) -> None:
        self._inner.close()


class TieredStorage(Storage):
    """Read-only view of one step: files present in the local folder come from there,
    every other file from the durable tier.

    Paths are durable paths under `durable_path`; `durable_bytes_read` counts the bytes
    fetched from the durable tier (files and byte ranges). TensorStore (`kvstore_spec`)
    reads from the durable tier (`used_durable_kvstore` tells), or from the local folder
    when the step is not durable.
    """

    def __init__(self, local: Storage, local_path: str, durable: Storage, durable_path: str, *, durable_committed: bool):
        self.local, self.local_path = local, local_path
        self.durable, self.durable_path = durable, durable_path
        self.durable_committed = durable_committed
        self.cheap_size = local.cheap_size and durable.cheap_size
        self.has_folders = durable.has_folders
        self.durable_bytes_read = 0
        self.used_durable_kvstore = False
        self._mu = threading.Lock()
        self._parent = durable_path.rsplit("/", 1)[0]
        self._siblings: dict[str, str | None] = {}

    def _count(self, n: int) -> None:
        with self._mu:
            self.durable_bytes_read += n

    def _where(self, path: str) -> tuple[Storage, str, bool]:
        if path == self.durable_path or path.startswith(self.durable_path + "/"):
            if self.durable_committed and path in (f"{self.durable_path}/{_format.COMMITTED}", f"{self.durable_path}/{_format.MANIFEST}"):
                # The durable marker, the same on every process (a cooperative restore
                # compares it); the local one names this process. The durable manifest
                # indexes every process's pack; the local copy only its own. Not
                # counted: no data.
                return self.durable, path, True
            local_path = self.local_path + path[len(self.durable_path):]
            if self.local.exists(local_path):
                return self.local, local_path, True
        elif path.startswith(self._parent + "/"):  # a sibling step's file: a chunk or pack an incremental save references
            folder, _, rest = path[len(self._parent) + 1:].partition("/")
            sibling = self._local_sibling(folder)
            data = rest.startswith((_format.ARRAYS + "/", _encoding.PACKED + "/"))  # not its marker or manifest: the tier's own
            if sibling is not None and rest and (not self.durable_committed or data):
                local_path = f"{sibling}/{rest}"
                if self.local.exists(local_path):
                    return self.local, local_path, True
        return self.durable, path, False

    def _local_sibling(self, folder: str) -> str | None:
        """The local step folder beside this step's local folder that holds the same
        save as the step `folder` beside the durable path (a local-only view: the local
        step `folder` itself, whose generation the local manifest's references check; a
        durable view: only when its marker names the durable step's generation), or None."""
        with self._mu:
            if folder in self._siblings:
                return self._siblings[folder]
        found = None
        if _format.is_step_name(folder):
            local = f"{self.local_path.rsplit('/', 1)[0]}/{folder}"
            marker = read_marker(self.local, local)
            # (the durable step's own marker: a retired step, no longer listed, is still a reference target)
            if marker is not None and (not self.durable_committed or marker.generation == _tier_references.durable_generation_of(
                    self.durable, f"{self._parent}/{folder}")):
                found = local
        with self._mu:
            self._siblings[folder] = found
        return found

    def kvstore_spec(self, path: str) -> dict:
        if not self.durable_committed and path.startswith(self.durable_path):
            return self.local.kvstore_spec(self.local_path + path[len(self.durable_path):])
        # TensorStore's array reads (complex and sub-byte dtypes) go to the durable tier,
        # uncounted: a local copy may lack chunks another process wrote, and TensorStore
        # would read a missing chunk as fill values.
        self.used_durable_kvstore = True
        return self.durable.kvstore_spec(path)

    def write_file(self, path: str, data: bytes) -> None:
        raise PermissionError(f"{path}: a tiered view is read-only")

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        if not self.durable_committed and path == f"{self.durable_path}/{_format.COMMITTED}":
            # A local-only step: its local markers differ per process (index, devices,
            # time); a cooperative restore compares markers, so every process sees the
            # same one, naming the save by its generation (None if absent).
            marker = read_marker(self.local, self.local_path)
            if marker is None:
                raise FileNotFoundError(path)
            return _format.dumps({"generation": marker.generation, "tier": "local"})
        storage, p, local = self._where(path)
        data = storage.read_file(p, max_bytes)
        if not local:
            self._count(len(data))
        return data

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        storage, p, local = self._where(path)
        data = storage.read_range(p, offset, length)
        if not local:
            self._count(len(data))
        return data

    def open_reader(self, path: str) -> Reader:
        storage, p, local = self._where(path)
        reader = storage.open_reader(p)
        return reader if local else _CountingReader(reader, self._count)

    def size(self, path: str) -> int:
        storage, p, _ = self._where(path)
        return storage.size(p)

    def exists(self, path: str) -> bool:
        storage, p, local = self._where(path)
        return local or storage.exists(p)

    def is_folder(self, path: str) -> bool:
        return self.durable.is_folder(path) or self._where(path)[2]

    def list_dir(self, path: str) -> list[str]:
        return self.durable.list_dir(path)

    def list_files(self, path: str) -> list[str]:
        return self.durable.list_files(path)

    def delete_tree(self, path: str) -> None:
        raise PermissionError(f"{path}: a tiered view is read-only")

    def delete_file(self, path: str) -> None:
        raise PermissionError(f"{path}: a tiered view is read-only")


def local_restore_proposal(
    storage: Storage, root: str, newer_than: int | None, needed_keys: Callable[[str], Sequence[str] | None],
    below: int | None = None,
) -> str:
    """This process's vote for resuming from a local-only step: `"<step> <generation>"`
    of its newest local step newer than `newer_than` (and older than `below`, after a
    damaged one) that it can restore whole (same process count and devices, every chunk
    file the target needs present), or `"-"`."""
    steps = [s for s in local_steps(storage, root)
             if (newer_than is None or s > newer_than) and (below is None or s < below)]
    if not steps:
        return "-"
    step = steps[-1]
    path = f"{root}/{step}"
    marker = read_marker(storage, path)
    if marker is None or marker.process_count != _coord.process_count() or marker.device_ids != own_device_ids():
        return "-"
    keys = needed_keys(path)  # relative to `root` (an incremental step's references: other local steps)
    if keys is None or any(not storage.exists(f"{root}/{k}") for k in keys):
        return "-"
    return f"{step} {marker.generation}"


# --- listing -----------------------------------------------------------------------------


def local_listing(local_directory: str | os.PathLike, durable: Storage, directory: str) -> list[dict]:
    """Every step folder on a local tier, of every process folder in it (`checkpointer ls
    --local`): one dict per folder with `process`, `step`, `folder`, `state` ("durable":
    committed locally and on `directory` with the same generation; "retired": kept only
    for the chunks later local steps reference (incremental saves); "not durable":
    committed locally only; "partial": a local save in flight or crashed), `generation`
    and `size_bytes`. Reads only; takes no lock."""
    storage, root = storage_for(local_directory)
    durable_folders = _commit.committed_folders(durable, directory)
    rows = []
    for name in sorted(storage.list_dir(root)):
        if not name.startswith(PROCESS_DIR_PREFIX) or not name[len(PROCESS_DIR_PREFIX):].isdigit():
            continue
        proc = f"{root}/{name}"
        for e in _commit.entries(storage, proc):
            marker = read_marker(storage, f"{proc}/{e.name}") if e.committed else None
            if marker is None:
                state = "partial"
            elif e.retired:  # incremental saves: kept only for what later local steps reference
                state = "retired"
            elif durable_generation(durable, directory, e.step, durable_folders) == marker.generation:
                state = "durable"
            else:
                state = "not durable"
            rows.append({
                "process": int(name[len(PROCESS_DIR_PREFIX):]), "step": e.step, "folder": f"{name}/{e.name}",
                "state": state, "generation": marker.generation if marker else e.generation,
                "size_bytes": storage.folder_bytes(f"{proc}/{e.name}"),
            })
    return rows
