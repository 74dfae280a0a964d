"""Incremental saves on two tiers (docs/incremental.md, "Two tiers").

A save of a two-tier manager with `incremental=True` commits on the local tier first, as
`LOCAL/process-<i>/<step>`; its base is the newest committed local step of the same
process folder (`_save.bases_beside`), so a local step references local steps only,
and its chunk files lie on the same disk.

Replication keeps the durable tier self-consistent (a durable step's references point
only into committed durable steps of the durable directory), reference by reference:

- translated: the referenced local step `F` is committed on the durable tier with the
  same generation (it was replicated; listed, or retired and still holding the file:
  `DurableSteps`): the durable step references durable `F`, whose chunk file holds the
  same bytes (replication copies them, checked). Nothing is copied.
- re-referenced: otherwise, when the newest committed durable step holds a copy of the
  very same chunk file (it materialized it from local `F`, same generation: its record
  says so, `MATERIALIZED_FROM`), or references such a copy (its record's reference says
  so, too), the durable step references that copy.
- materialized: otherwise (`durable_every_steps` > 1 skipped `F`, its replication
  failed, or durable retention removed it): the chunk file is copied from local `F`
  into the durable step, checked, and listed in the process's durable record as a chunk
  it wrote (with `MATERIALIZED_FROM`); the reference is dropped there.

Pack references (unchanged packed chunks in the pack of local `F`) go the same three
ways; a materialized one copies the whole local pack file as the durable step's own pack
`<array>.from-<F>` (`materialized_pack`, record field `packed_materialized`).

Never "replicate the referenced step": a step the schedule left local stays local, and a
durable step never depends on the local tier. Process 0 rebuilds the durable manifest's
references from the durable records of the processes that report references
(`with_every_reference`) and checks that each target is still the committed generation
(and, retired, still holds the files), or the commit fails (ReplicationError, nothing
committed).

Local retention retires a local step that a local step which stays references (only the
files local steps reference kept, as on the durable tier: `_retirement`), and keeps the
base of a local save in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Callable, Collection

import crc32c

from .. import _commit, _encoding, _format
from .._errors import CheckpointError, CorruptCheckpointError, ReplicationError
from .._format import ZARR_JSON, ArrayMetadata, ChunkRecord, ProcessRecord, read_metadata
from .._restore import RestoreOptions, resolve_tree
from .._storage import Storage, storage_for
from . import _maintenance, _retirement

log = logging.getLogger("checkpointer")

# A durable record's chunk copied from a local step it referenced: `[folder, generation]`
# of that local step (an additive field of the chunk's entry; older readers keep it as read).
MATERIALIZED_FROM = "materialized_from"


def remove_local(storage: Storage, root: str, steps: Collection[int], doomed: Collection[int]) -> list[int]:
    """Removes the local steps of `doomed` (of the committed `steps` of `root`), as the
    durable tier's retention does (`_maintenance.maintain`): one that a staying local
    step references is retired (hidden, only the chunks and packs local steps reference
    kept: `_retirement`), the others are removed one at a time, each only once no step
    left references it; then the retired steps' unreferenced files go, and a retired step
    nobody references any more is removed. A crash or a failed removal between two
    operations leaves no local step with a dangling reference. Returns the steps removed
    (retired ones too, once removed). The caller holds the local root's `guard`."""
    folders = _commit.committed_folders(storage, root)
    listed = {s: folders[s] for s in steps if s in folders}
    if not doomed:  # a retired step nobody references any more still goes
        return _retirement.prune(storage, root, listed)
    refs = {s: _maintenance.referenced_steps(storage, root, f) for s, f in listed.items()}
    retire = _maintenance.users_among(list(listed), doomed, refs)
    for c, users in sorted(retire.items()):
        _commit.retire_step(storage, root, c, users)
        log.info("local retention retired step %d of %s: kept only for the chunks local steps %s reference", c, root, users)
    may_go = {c for c in doomed if c not in retire and c in listed}
    remaining, removed = set(listed) - set(retire), []
    while may_go:
        ready = [c for c in may_go if not any(c in refs.get(s, ()) for s in remaining if s != c)]
        if not ready:
            break
        c = max(ready)
        may_go.discard(c)
        try:
            _commit.delete_step(storage, root, c)
        except OSError as e:
            log.warning("could not remove local step %d from %s: %s", c, root, e)
            continue
        remaining.discard(c)
        removed.append(c)
        log.info("local retention removed step %d from %s", c, root)
    try:
        removed += _retirement.prune(storage, root, {s: listed[s] for s in sorted(remaining)})
    except OSError as e:
        log.warning("could not free the retired local steps of %s: %s", root, e)
    return sorted(removed)


def local_keys(meta: ArrayMetadata, keys: list[str], step_folder: str) -> list[str]:
    """`keys` (files of `meta`, relative to the step folder: `_encoding.files`) relative to
    the local root instead: `<step>/<key>`, or `<F>/<key>` for a chunk the step
    references in local step `F`, or a pack there (`_format.pack_ref_key`)."""
    where = {_format.chunk_key(meta.path, cell): ref.folder for cell, ref in meta.references.items()}
    out = []
    for k in keys:
        folder, rest = _format.split_pack_key(k)
        out.append(f"{folder}/{rest}" if folder is not None else f"{where.get(k, step_folder)}/{k}")
    return out


class DurableSteps:
    """The committed durable steps of the durable directory `parent` that a local step's
    references may be translated to, read lazily (one listing; the retired steps' only
    when a reference needs one; each step's marker and a retired step's files once)."""

    def __init__(self, durable: Storage, parent: str):
        self.durable, self.parent = durable, parent
        self.listed = _commit.committed_folders(durable, parent)
        self._retired: dict[int, str] | None = None
        self._generations: dict[str, str | None] = {}
        self._files: dict[str, set[str]] = {}

    def holds(self, folder: object, generation: object, key: str) -> bool:
        """Whether the durable step `folder` is the save `generation` (it was replicated
        from the local step a reference names) and holds the file `key`: a listed step
        holds every file it wrote; a retired one (`_retirement`) only those listed steps
        reference, which stay while this step is committed (durable retention runs after
        a durable commit, never during a replication, and `with_every_reference` checks
        them again at the commit)."""
        if not isinstance(folder, str) or not _format.is_step_name(folder):
            return False
        step, retired = int(folder), False
        if step not in self.listed:
            if self._retired is None:
                self._retired = _commit.retired_folders(self.durable, self.parent)
            if step not in self._retired:
                return False
            retired = True
        path = f"{self.parent}/{self.listed.get(step) or (self._retired or {})[step]}"
        if path not in self._generations:
            self._generations[path] = durable_generation_of(self.durable, path)
        if self._generations[path] != generation:
            return False
        if retired and path not in self._files:
            self._files[path] = set(self.durable.list_files(path))
        return not retired or key in self._files[path]


@dataclasses.dataclass
class DurableRecord:
    """What replicating one process's share of a local step with references writes
    (`durable_record`).

    Attributes:
      data: the durable record.
      copies: files to copy from the local tier: `(local path, key in the durable step,
        bytes)`, the chunks and packs of materialized references.
      writes: files to write: `(key, bytes)`, the `zarr.json` of each materialized pack.
      has_references: whether the durable record still has references.
    """

    data: bytes
    copies: list[tuple[str, str, int]]
    writes: list[tuple[str, bytes]]
    has_references: bool


def durable_record(local: Storage, local_path: str, durable: Storage, durable_path: str, record_name: str) -> DurableRecord | None:
    """The durable record of this process for a local step whose record has references
    (chunks or packed chunks of earlier local steps), and the files to copy into the
    durable step for the references that are materialized. None when the local record
    has none (it is copied as it is).

    Raises:
      CorruptCheckpointError: a referenced local step lacks the chunk or pack entry, or
        its crc32c differs from the reference's.
    """
    location = f"{local_path}/{record_name}"
    raw = _format.loads(local.read_file(location), location)
    if not isinstance(raw, dict) or not (raw.get("references") or raw.get("packed_references")):
        return None
    local_root, durable_parent = local_path.rsplit("/", 1)[0], durable_path.rsplit("/", 1)[0]
    steps = DurableSteps(durable, durable_parent)
    kept_refs, chunks, out = [], list(raw.get("chunks") or []), DurableRecord(b"", [], [], False)
    records: dict[str, tuple[ProcessRecord, dict[str, ChunkRecord]]] = {}
    earlier, earlier_packs = _materialized(durable, durable_parent, steps.listed, durable_path.rsplit("/", 1)[1], record_name)

    def record_of(folder: str) -> tuple[ProcessRecord, dict[str, ChunkRecord]]:  # this process's record in local `folder`
        if folder not in records:
            loc = f"{local_root}/{folder}/{record_name}"
            rec = ProcessRecord.from_json(_format.loads(local.read_file(loc), loc), loc)
            records[folder] = rec, {c.key: c for c in rec.chunks}
        return records[folder]

    for r in raw.get("references") or ():
        folder, generation = r.get("in"), r.get("generation")
        key = _format.chunk_key(r["leaf"], r["chunk"])
        if steps.holds(folder, generation, key):  # translated: the durable step of the same save holds it
            kept_refs.append(r)
            continue
        again = earlier.get((key, folder, generation))
        if again is not None:  # the newest durable step holds a copy of the very same chunk file
            kept_refs.append({**r, "in": again[0], "generation": again[1], MATERIALIZED_FROM: [folder, generation]})
            continue
        c = record_of(folder)[1].get(key)
        if c is None or c.data_crc32c != r.get("data_crc32c"):
            raise CorruptCheckpointError(
                f"{local_path}: leaf {r['leaf']!r} chunk {r['chunk']} references the local step {local_root}/{folder}, "
                f"which {'has no such chunk' if c is None else 'holds other bytes (crc32c differs)'}; the local tier is damaged"
            )
        chunks.append(c.to_json() | {MATERIALIZED_FROM: [folder, generation]})
        out.copies.append((f"{local_root}/{folder}/{key}", key, c.file_bytes or 0))
    kept_packs, own_packs = [], list(raw.get("packed_materialized") or [])
    for p in raw.get("packed_references") or ():
        folder, generation, key = p.get("in"), p.get("generation"), str(p.get("key"))
        if steps.holds(folder, generation, key):  # translated: durable `folder` holds the same pack file
            kept_packs.append(p)
            continue
        again_pack = earlier_packs.get((key, str(folder), str(generation)))
        if again_pack is not None and {_box_id(b) for b in p["boxes"]} <= again_pack[3]:
            kept_packs.append({**p, "in": again_pack[0], "generation": again_pack[1], "key": again_pack[2],
                               "array": again_pack[2].rsplit("/c/", 1)[0], MATERIALIZED_FROM: [folder, generation, key]})
            continue
        pack, writes = materialized_pack(local, f"{local_root}/{folder}", record_of(str(folder))[0], p, local_path)
        own_packs.append(pack)
        chunks.append(writes[0])
        out.copies.append((f"{local_root}/{folder}/{key}", pack["key"], int(p["bytes"])))
        out.writes.append(writes[1])
    raw["chunks"] = chunks
    raw["bytes_written"] = (raw.get("bytes_written") or 0) + sum(n for _, _, n in out.copies)
    for name, items in (("references", kept_refs), ("packed_references", kept_packs), ("packed_materialized", own_packs)):
        if items:
            raw[name] = items
        else:
            raw.pop(name, None)
    if out.copies:
        log.info("replicating %s: %d referenced chunk(s) or pack(s) of local steps not on %s are copied into it", local_path,
                 len(out.copies), durable_parent)
    out.data, out.has_references = _format.dumps(raw), bool(kept_refs or kept_packs)
    return out


def _box_id(b: dict) -> tuple[str, tuple[int, ...]]:
    """(leaf, box origin) of a pack record's box (JSON)."""
    return str(b["leaf"]), tuple(b["box"][0])


def materialized_pack(local: Storage, folder_path: str, record: ProcessRecord, p: dict, where: str) -> tuple[dict, tuple[dict, tuple[str, bytes]]]:
    """A pack reference `p` (JSON, into the local step at `folder_path`, whose record of
    this process is `record`) materialized: the referenced pack file is copied whole as
    this checkpoint's own pack `<array>.from-<step>` (the same offsets), indexing the
    boxes `p` lists. Returns (its pack record for `packed_materialized`, (the chunk
    record of its file for `chunks`, (the key and bytes of its `zarr.json`: the source's,
    its index cut to those boxes))).

    Raises:
      CorruptCheckpointError: the local step lacks the pack or one of the boxes, or
        holds other bytes there.
    """
    folder, generation, key = p.get("in"), p.get("generation"), str(p.get("key"))
    source = next((q for q in record.own_packs if q.key == key), None)
    index = {(b.leaf, b.box.origin): b for b in source.boxes} if source is not None else {}
    chunk = next((c for c in record.chunks if c.key == key), None)
    bad = []
    for b in p["boxes"]:
        e = index.get(_box_id(b))
        if e is None or (e.offset, e.data_bytes, e.data_crc32c) != (b.get("offset"), b.get("data_bytes"), b.get("data_crc32c")):
            bad.append(b)
    if source is None or chunk is None or source.file_bytes != p.get("bytes") or bad:
        what = f"box of leaf {bad[0].get('leaf')!r}" if bad and source is not None else "pack"
        raise CorruptCheckpointError(
            f"{where}: its packed chunks reference the pack {key} of the local step {folder_path}, which has another or no "
            f"such {what}; the local tier is damaged")
    array = f"{key.rsplit('/c/', 1)[0]}.from-{folder}"
    origin = [folder, generation, key]
    pack = {"array": array, "key": f"{array}/c/0", "bytes": p["bytes"], "boxes": p["boxes"], MATERIALIZED_FROM: origin}
    node = _format.loads(local.read_file(f"{folder_path}/{source.array}/{ZARR_JSON}"), f"{folder_path}/{source.array}")
    try:
        listed = {_box_id(b) for b in p["boxes"]}
        attrs = node["attributes"]["checkpointer"]
        attrs["packed_index"] = [e for e in attrs["packed_index"] if _box_id(e) in listed]
    except (KeyError, TypeError, IndexError) as e:
        raise CorruptCheckpointError(f"{folder_path}/{source.array}/{ZARR_JSON} has no pack index ({e})") from e
    return pack, (chunk.to_json() | {"key": pack["key"], MATERIALIZED_FROM: origin}, (f"{array}/{ZARR_JSON}", _format.dumps(node)))


def _materialized(durable: Storage, parent: str, folders: dict[int, str], own: str, record_name: str) -> tuple[
        dict[tuple[str, str, str], tuple[str, str]], dict[tuple[str, str, str], tuple[str, str, str, set]]]:
    """What the newest committed durable step (not `own`) holds as copies of local steps'
    files (`MATERIALIZED_FROM` in this process's record there), or references as such:
    chunks, (key, local folder, generation) -> (durable folder, generation); packs,
    (pack key, local folder, generation) -> (durable folder, generation, key there, the
    `(leaf, origin)` of the boxes it indexes). A later durable step references them there
    instead of copying them again."""
    newest = [f for s, f in folders.items() if f == str(s) and f != own]
    if not newest:
        return {}, {}
    path = f"{parent}/{newest[-1]}"
    generation = durable_generation_of(durable, path)
    try:
        record = _format.read_process_record(durable, f"{path}/{record_name}")
    except (OSError, CorruptCheckpointError):
        return {}, {}
    out, packs = {}, {}
    for c in record.chunks:
        origin = c.extra.get(MATERIALIZED_FROM)
        if generation is not None and isinstance(origin, list) and len(origin) == 2:
            out[(c.key, str(origin[0]), str(origin[1]))] = (newest[-1], generation)
    for r in record.references or ():  # it references such a copy in turn
        origin = r.get(MATERIALIZED_FROM)
        if isinstance(origin, list) and len(origin) == 2 and isinstance(r.get("chunk"), list):
            out[(_format.chunk_key(r["leaf"], r["chunk"]), str(origin[0]), str(origin[1]))] = (str(r["in"]), str(r["generation"]))
    for p in [*(record.packed_materialized or ()), *(record.packed_references or ())]:
        origin = p.extra.get(MATERIALIZED_FROM)
        if isinstance(origin, list) and len(origin) == 3:
            at = (str(p.extra["in"]), str(p.extra.get("generation"))) if "in" in p.extra else (newest[-1], generation)
            if at[1] is not None:
                boxes = {(b.leaf, b.box.origin) for b in p.boxes}
                packs[(str(origin[2]), str(origin[0]), str(origin[1]))] = (at[0], at[1], p.key, boxes)
    return out, packs


def durable_generation_of(storage: Storage, path: str) -> str | None:
    """The generation in the `COMMITTED` marker of the durable step at `path`, or None."""
    try:
        marker = _format.loads(storage.read_file(f"{path}/{_format.COMMITTED}"), path)
    except (OSError, CorruptCheckpointError):
        return None
    return str(marker.get("generation")) if isinstance(marker, dict) else None


def write_verified(storage: Storage, path: str, data: bytes) -> int:
    """Writes `data` and reads it back (as `_tiers._copy_verified` does a copy)."""
    storage.write_file(path, data)
    back = storage.read_file(path)
    if back != data:
        raise CorruptCheckpointError(
            f"{path} reads back as {len(back)} bytes with crc32c {crc32c.crc32c(back):#010x}, expected {len(data)} "
            f"bytes with crc32c {crc32c.crc32c(data):#010x}; the durable tier corrupts writes"
        )
    return len(data)


def with_every_reference(manifest: dict, durable: Storage, root: str, durable_path: str, referencing: Collection[int]) -> None:
    """Process 0 at the durable commit (after `_tiers.with_every_pack`, which indexes every
    process's packs and pack references): the local manifest copy lists process 0's local
    references; the durable one lists every process's durable references, read from the
    durable records in `root` of the processes that reported references (`referencing`,
    `_commit.Commit.referencing`: whatever process 0's own step or this job's
    `incremental` option is, e.g. a restart without it resuming the replication of a
    local step saved with it), with `format_version` 2 when any and 1 otherwise. Checks
    that every referenced durable step still holds the generation.

    Raises:
      ReplicationError: a referenced durable step was removed or replaced meanwhile.
    """
    leaves = manifest.get("leaves")
    if not isinstance(leaves, dict):
        return
    had = any(isinstance(e, dict) and e.get("references") for e in leaves.values())
    refs: dict[str, list[dict]] = {}
    for i in sorted(referencing):
        location = f"{root}/{_format.process_record_name(i)}"
        record = _format.read_process_record(durable, location)
        for r in record.references or ():
            refs.setdefault(r["leaf"], []).append({k: v for k, v in r.items() if k not in ("leaf", MATERIALIZED_FROM)})
    for leaf, entry in leaves.items():
        if isinstance(entry, dict):
            entry.pop("references", None)
            if leaf in refs:
                entry["references"] = sorted(refs[leaf], key=lambda r: r.get("chunk") or [])
    wanted: dict[tuple[str, str], set[str]] = {}
    for leaf, rs in refs.items():
        for r in rs:
            wanted.setdefault((r["in"], r["generation"]), set()).add(_format.chunk_key(leaf, r["chunk"]))
    packed = manifest.get("packed")
    pack_refs = [p for p in packed if isinstance(p, dict) and "in" in p] if isinstance(packed, list) else []
    for p in pack_refs:  # every process's, indexed by `with_every_pack` from the durable records
        wanted.setdefault((p["in"], p["generation"]), set()).add(p["key"])
    for (folder, generation), keys in sorted(wanted.items()):
        target = _format.sibling(durable_path, folder)
        missing = sorted(keys - set(durable.list_files(target))) if durable.exists(f"{target}/{_format.RETIRED}") else []
        if durable_generation_of(durable, target) != generation or missing:
            raise ReplicationError(
                f"replicating {durable_path}: the durable step {target} it references (generation {generation}) was "
                f"removed, replaced or pruned meanwhile{f' ({missing[0]} is gone)' if missing else ''}; nothing "
                "committed. The local step is replicated again on restart"
            )
    if had or refs or pack_refs or manifest.get("format_version") == _format.FORMAT_VERSION_REFERENCES:
        manifest["format_version"] = _format.FORMAT_VERSION_REFERENCES if refs or pack_refs else _format.FORMAT_VERSION



# --- peer copies -------------------------------------------------------------------------

PEER_SEND_PREFIX = ".peer-send-"


def peer_copy_folder(local_root: str, step: int) -> tuple[str, Callable[[], None]]:
    """The folder to send as the peer copy of local `step` (`_peers`): the step folder
    itself, or, when its manifest has references, a standalone copy beside it
    (`.peer-send-<step>`, a foreign name that listings ignore): hard links to the step's
    files, to the chunk files it references in earlier local steps and to the packs
    holding the packed chunks it references there (as its own `<pack>.from-<step>`: no
    bytes copied), with the manifest and this process's record rewritten without
    references (the chunks and packs listed as its own, `MATERIALIZED_FROM` the local
    step). A copy then carries what it references: the holder keeps one folder per step,
    and a copy fetched after a node loss restores alone. Returns (folder, cleanup). Local
    POSIX only, like the local tier.

    Raises:
      CorruptCheckpointError: a referenced local step lacks the chunk or pack entry, or
        holds other bytes.
    """
    folder = f"{local_root}/{step}"
    with open(f"{folder}/{_format.MANIFEST}", "rb") as f:
        manifest = _format.loads(f.read(), folder)
    leaves = manifest.get("leaves") if isinstance(manifest, dict) else None
    packed: list = manifest["packed"] if isinstance(manifest, dict) and isinstance(manifest.get("packed"), list) else []
    if not isinstance(leaves, dict) or not (any(isinstance(e, dict) and e.get("references") for e in leaves.values())
                                            or any(isinstance(p, dict) and "in" in p for p in packed)):
        return folder, lambda: None
    for name in os.listdir(local_root):  # one sender thread: any other is a crashed send's
        if name.startswith(PEER_SEND_PREFIX):
            shutil.rmtree(f"{local_root}/{name}", ignore_errors=True)
    staging = f"{local_root}/{PEER_SEND_PREFIX}{step}"
    local, _ = storage_for(local_root)
    own_packs: list[dict] = []
    try:
        for dirpath, _, names in os.walk(folder):
            target = os.path.join(staging, os.path.relpath(dirpath, folder))
            os.makedirs(target, exist_ok=True)
            for n in names:
                os.link(os.path.join(dirpath, n), os.path.join(target, n))
        for rec_name in os.listdir(f"{folder}/{_format.PROCESSES}"):
            record_name = f"{_format.PROCESSES}/{rec_name}"
            with open(f"{folder}/{record_name}", "rb") as f:
                raw = _format.loads(f.read(), f"{folder}/{record_name}")
            if not isinstance(raw, dict) or not (raw.get("references") or raw.get("packed_references")):
                continue
            records: dict[str, tuple[ProcessRecord, dict[str, ChunkRecord]]] = {}
            chunks = list(raw.get("chunks") or [])
            for r in raw.pop("references", None) or ():
                key = _format.chunk_key(r["leaf"], r["chunk"])
                c = _referenced_chunk(local_root, str(r["in"]), record_name, key, r, records)
                _link(f"{local_root}/{r['in']}/{key}", f"{staging}/{key}")
                chunks.append(c.to_json() | {MATERIALIZED_FROM: [r["in"], r["generation"]]})
                raw["bytes_written"] = (raw.get("bytes_written") or 0) + (c.file_bytes or 0)
            for p in raw.pop("packed_references", None) or ():
                source = f"{local_root}/{p['in']}"
                rec = _local_record(local_root, str(p["in"]), record_name, records)[0]
                pack, (chunk, (zarr_key, zarr_json)) = materialized_pack(local, source, rec, p, folder)
                _link(f"{source}/{p['key']}", f"{staging}/{pack['key']}")
                with open(f"{staging}/{zarr_key}", "wb") as f:
                    f.write(zarr_json)
                own_packs.append(pack)
                raw["packed_materialized"] = [*(raw.get("packed_materialized") or ()), pack]
                chunks.append(chunk)
                raw["bytes_written"] = (raw.get("bytes_written") or 0) + int(p["bytes"])
            raw["chunks"] = chunks
            _replace_file(f"{staging}/{record_name}", _format.dumps(raw))
        for entry in leaves.values():
            if isinstance(entry, dict):
                entry.pop("references", None)
        if packed:
            manifest["packed"] = [p for p in packed if "in" not in p] + [
                {k: v for k, v in p.items() if k != MATERIALIZED_FROM} for p in own_packs]
        manifest["format_version"] = _format.FORMAT_VERSION
        _replace_file(f"{staging}/{_format.MANIFEST}", _format.dumps(manifest))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging, lambda: shutil.rmtree(staging, ignore_errors=True)


def _link(source: str, target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.link(source, target)


def _local_record(local_root: str, folder: str, record_name: str,
                  records: dict[str, tuple[ProcessRecord, dict[str, ChunkRecord]]]) -> tuple[ProcessRecord, dict[str, ChunkRecord]]:
    """This process's record in local step `folder` and its chunks by key (cached)."""
    if folder not in records:
        location = f"{local_root}/{folder}/{record_name}"
        with open(location, "rb") as f:
            rec = ProcessRecord.from_json(_format.loads(f.read(), location), location)
        records[folder] = rec, {c.key: c for c in rec.chunks}
    return records[folder]


def _referenced_chunk(local_root: str, folder: str, record_name: str, key: str, r: dict,
                      records: dict[str, tuple[ProcessRecord, dict[str, ChunkRecord]]]) -> ChunkRecord:
    """The chunk record of `key` in local step `folder` (this process's record there),
    checked against the reference `r`."""
    c = _local_record(local_root, folder, record_name, records)[1].get(key)
    if c is None or c.data_crc32c != r.get("data_crc32c"):
        raise CorruptCheckpointError(
            f"leaf {r.get('leaf')!r} chunk {r.get('chunk')} references the local step {local_root}/{folder}, which "
            f"{'has no such chunk' if c is None else 'holds other bytes (crc32c differs)'}; the local tier is damaged"
        )
    return c


def _replace_file(path: str, data: bytes) -> None:
    """Writes `path` anew (never through a hard link to the step's own file)."""
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def needed_keys(storage: Storage, process_index: int, target: object, options: RestoreOptions) -> Callable[[str], list[str] | None]:
    """For a local step's path, the files this process's devices need of it (relative to
    the local root; None: not whole here): every file of every box they hold, whether or
    not a cooperative restore would read it (after a replica-parallel save a process holds
    only the chunks it wrote of a replicated box, so such a step is not whole here and the
    durable tier is read; a local manifest indexes only its own process's pack, so a
    packed chunk written by another process makes the step not whole here either)."""

    def needed(path: str) -> list[str] | None:
        try:
            meta = read_metadata(storage, path)
            resolved = resolve_tree(meta, target, partial=options.partial, process_index=process_index, missing=options.missing)
        except CheckpointError:
            return None
        keys: list[str] = []
        try:
            for leaf in resolved.leaves:
                if leaf.target is not None and isinstance(leaf.meta, ArrayMetadata):
                    keys.extend(local_keys(leaf.meta, [k for k, _ in _encoding.files(
                        leaf.meta, [b for _, b in leaf.device_boxes])], path.rsplit("/", 1)[1]))
        except CheckpointError:  # e.g. a packed chunk another process wrote: not in this copy's index
            return None
        return keys

    return needed
