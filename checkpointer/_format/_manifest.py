"""`manifest.json`, written by process 0 at commit: `manifest_json` writes it beside
`parse_manifest`, which validates it into a `CheckpointMetadata`; `metadata` /
`read_metadata` read a committed checkpoint's manifest.

The parser never fails on a field it does not know (format changes are additive): it
ignores it. Needs no devices: a checkpoint saved by 8 processes × 4 devices is described
on a laptop.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import importlib.metadata
import math
import operator
import os
import time
from collections.abc import Mapping, Sequence

from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, leaf_name
from .._storage import Storage, storage_for
from . import _json, _layout, _leaves, _references, _values
from ._box import Box
from ._leaves import ArrayMetadata, ValueMetadata
from ._metadata import CheckpointMetadata
from ._records import PackRecord, phases_json
from ._tree import check_leaf_path, keystrs, leaf_paths_of, rebuild

DISTRIBUTION = "checkpointer"


@functools.cache
def library_version() -> str:
    """The installed checkpointer's version (`importlib.metadata`), recorded in each
    manifest; `"0+unknown"` when the package runs from a source tree without being
    installed (a local version label, so it sorts below every release)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


_PATH = operator.attrgetter("path")


def manifest_json(
    *,
    step: int | None,
    generation: str,
    process_count: int,
    process_bytes_written: Sequence[int],
    structure: dict,
    arrays: Sequence[ArrayMetadata],
    values: Mapping[str, dict],
    user_metadata: Mapping,
    created_unix_s: float | None = None,
    save_phases_unix_s: Mapping[str, tuple[float, float]] | None = None,
    packed: Sequence[PackRecord] = (),
    packed_processes: Sequence[int] | None = None,
    array_entries: Sequence[dict] | None = None,
) -> dict:
    """The manifest of DESIGN.md's format_version 1 (what `parse_manifest` reads).

    Args:
      step: the training step, or None.
      generation: the save attempt.
      process_count: processes that saved.
      process_bytes_written: bytes of chunk files each process wrote, by process index.
      structure: the JSON tree structure (`_tree.describe`).
      arrays: the array leaves' metadata.
      values: leaf path → `_values.value_to_json` of each non-array leaf.
      user_metadata: the `metadata=` dict.
      created_unix_s: the creation time, seconds since the epoch (default: now).
      save_phases_unix_s: process 0's phases before the manifest, name → (start, end)
        in seconds since the epoch (`{"wait": ...}`: from its own record to every
        process's "durable" report); stored as `"save_phases_unix_s"` when given
        (additive: readers ignore it, `_timeline` draws it).
      packed: every process's pack index (`ProcessRecord.packed`), stored as
        `"packed"` when there is one (additive; see `_pack`).
      packed_processes: None (a committed checkpoint's manifest: `packed` is every
        process's). A list: the processes whose packs `packed` holds, the others'
        chunks are not indexed (a two-tier local copy; stored as `"packed_processes"`).
      array_entries: None, or each array leaf's entry, `arrays[i].to_json()` (leaves of
        one layout sharing one object), when no leaf has references (a save's own
        metadata: `Snapshot.array_entries`).
    """
    import jax

    leaves: dict[str, dict] = {}
    entries: dict[tuple, dict] = {}  # leaves of one layout share one entry object (encoded once)
    if array_entries is not None:  # made by the snapshot, one object per layout: no look-up per leaf
        assert len(array_entries) == len(arrays)
        leaves = dict(zip(map(_PATH, arrays), array_entries))
    for m in arrays if array_entries is None else ():
        if m.references:
            leaves[m.path] = m.to_json() | {"references": [r.to_json() for r in m.references.values()]}
            continue
        key = (m.shape, m.dtype, m.chunk_shape, m.inner_chunk_shape, id(m.saved_sharding), m.key_impl, m.kind, m.packed)
        entry = entries.get(key)
        if entry is None:
            entry = entries[key] = m.to_json()
        leaves[m.path] = entry
    leaves.update({p: {"type": "value", "value": v} for p, v in values.items()})
    out: dict[str, object] = {
        # Additive: a checkpoint with references (incremental saves) has the version older
        # readers refuse; one without keeps version 1.
        "format_version": _references.FORMAT_VERSION_REFERENCES if (
            array_entries is None and any(m.references for m in arrays)) or any(
            "in" in p.extra for p in packed) else _layout.FORMAT_VERSION,
        "step": step,
        "generation": generation,
        "created_unix_s": time.time() if created_unix_s is None else created_unix_s,
        "process_count": process_count,
        "process_bytes_written": list(process_bytes_written),
        "structure": structure,
        "leaves": leaves,
        "user_metadata": user_metadata,
        "library_version": library_version(),
        "jax_version": jax.__version__,
    }
    if save_phases_unix_s is not None:
        out["save_phases_unix_s"] = phases_json(save_phases_unix_s)
    if packed:
        out["packed"] = [p.to_json() for p in packed]
    if packed_processes is not None:
        out["packed_processes"] = list(packed_processes)
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _require(cond: bool, what: str, where: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"manifest of {where}: {what}")


def parse_manifest(raw: object, where: str) -> CheckpointMetadata:
    """Validates a parsed manifest; every failure is a `CorruptCheckpointError`."""
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"manifest of {where}: not a JSON object")
    version = raw.get("format_version")
    if not _is_int(version) or version not in (_layout.FORMAT_VERSION, _references.FORMAT_VERSION_REFERENCES):
        raise CorruptCheckpointError(
            f"{where} has format_version {version!r}; this library reads format_version "
            f"{_layout.FORMAT_VERSION} and {_references.FORMAT_VERSION_REFERENCES}. Upgrade checkpointer to read newer checkpoints."
        )
    step = raw.get("step")
    _require(step is None or _is_int(step), f"step {step!r:.100} is not an int", where)
    leaves_raw = raw.get("leaves")
    if not isinstance(leaves_raw, dict):
        raise CorruptCheckpointError(f"manifest of {where}: 'leaves' is not an object")
    structure = raw.get("structure")
    if not isinstance(structure, dict):
        raise CorruptCheckpointError(f"manifest of {where}: 'structure' is not an object")
    user_metadata = raw.get("user_metadata", {})
    _require(isinstance(user_metadata, dict), "'user_metadata' is not an object", where)
    pcount = raw.get("process_count", 1)
    _require(_is_int(pcount) and pcount >= 1, f"process_count {pcount!r:.100} is invalid", where)
    pbytes = raw.get("process_bytes_written", [])
    _require(
        isinstance(pbytes, list) and all(_is_int(b) and 0 <= b <= _leaves.MAX_ARRAY_BYTES for b in pbytes),
        "'process_bytes_written' is not a list of byte counts",
        where,
    )
    created = _json.finite_number(raw.get("created_unix_s", 0.0))  # never OverflowError (an int of 400 digits)
    _require(created is not None, "'created_unix_s' is not a number", where)

    leaves: dict[str, ArrayMetadata | ValueMetadata] = {}
    for path, entry in leaves_raw.items():
        check_leaf_path(path, where=where)
        if not isinstance(entry, dict):
            _require(False, f"leaf {path!r} is not an object", where)
        if entry.get("type") == "array":
            am = _leaves.array_metadata_from_json(path, entry, where)
            if entry.get("references") is not None:
                am = _attach_references(am, entry["references"], version, where)
            leaves[path] = am
        elif entry.get("type") == "value":
            leaves[path] = ValueMetadata(path, _values.value_from_json(entry.get("value"), f"leaf {path!r} in {where}"))
        else:
            raise CorruptCheckpointError(f"leaf {path!r} in {where} has unknown type {entry.get('type')!r}")
    ordered = leaf_paths_of(structure)
    _require(len(ordered) == len(leaves) and set(ordered) == leaves.keys(), "the tree structure and the leaves disagree", where)
    boxes = _pack_boxes(raw.get("packed", []), leaves, where, complete="packed_processes" not in raw, version=version)
    names = keystrs(structure)
    leaves = {p: _leaves.with_fields(m, keystr=names[p], pack_boxes=boxes.get(p, m.pack_boxes), references=m.references) if isinstance(m, ArrayMetadata)
              else dataclasses.replace(m, keystr=names[p]) for p, m in ((p, leaves[p]) for p in ordered)}
    tree = rebuild(structure, lambda p: leaves[p], where=where)
    return CheckpointMetadata(
        path=where, step=step, format_version=version, tree=tree, leaves=leaves, user_metadata=user_metadata,
        process_count=pcount, process_bytes_written=tuple(pbytes), created_unix_s=float(created or 0.0),
        library_version=str(raw.get("library_version", "")), jax_version=str(raw.get("jax_version", "")),
        structure=structure, generation=raw.get("generation") if isinstance(raw.get("generation"), str) else None,
    )


def _attach_references(m: ArrayMetadata, raw: object, version: int, where: str) -> ArrayMetadata:
    """`m` with the chunk references of its entry (`_references`); only in a manifest of
    the version that has them, each chunk inside the leaf's grid, never of a packed leaf."""
    loc = f"leaf {leaf_name(m.path)} in {where}"
    _require(version == _references.FORMAT_VERSION_REFERENCES,
             f"{loc} has references, which format_version {version} does not have", where)
    _require(not m.packed, f"{loc}: a packed leaf cannot have references", where)
    own = where.rstrip("/").rsplit("/", 1)[-1]
    refs = _references.refs_from_json(raw, own, len(m.shape), loc)
    grid = [-(-s // c) for s, c in zip(m.shape, m.chunk_shape)]
    for r in refs:
        _require(all(c < g for c, g in zip(r.chunk, grid)), f"{loc}: referenced chunk {list(r.chunk)} is outside the chunk grid", where)
    return dataclasses.replace(m, references=_references.by_chunk(refs))


def _pack_boxes(raw: object, leaves: Mapping[str, ArrayMetadata | ValueMetadata], where: str, complete: bool = True,
                version: int = _layout.FORMAT_VERSION) -> dict[str, tuple[_leaves.PackedBox, ...]]:
    """Parses the manifest's `packed` section: each packed leaf's `pack_boxes`, by leaf
    path, in chunk order; every chunk of a packed leaf must be in exactly one pack, in
    bounds (`complete=False`, a local tier's copy indexing its own process's pack: at most one).

    A hand-rolled parse (not `PackRecord.from_json`): it runs on every restore, over
    one entry per small chunk (5,000 for issue 15's 2,000 leaves)."""
    _require(isinstance(raw, list), "'packed' is not a list", where)
    found: dict[str, list[_leaves.PackedBox]] = {}
    assert isinstance(raw, list)
    for i, pack in enumerate(raw):
        loc = f"packed[{i}]"
        _require(isinstance(pack, dict) and isinstance(pack.get("key"), str) and isinstance(pack.get("boxes"), list),
                 f"{loc} is not an object with 'key' and 'boxes'", where)
        key, file_bytes = pack["key"], pack.get("bytes")
        _require(_is_int(file_bytes) and file_bytes >= 4, f"{loc}: 'bytes' {file_bytes!r:.100} is not a size", where)
        check_leaf_path(key, where=where)
        folder = generation = None
        if "in" in pack:  # a pack of a sibling checkpoint, its listed boxes referenced (format_version 2)
            _require(version == _references.FORMAT_VERSION_REFERENCES,
                     f"{loc} references a pack, which format_version {version} does not have", where)
            folder = _references.check_folder_name(pack["in"], where.rstrip("/").rsplit("/", 1)[-1], f"manifest of {where}: {loc}")
            generation = pack.get("generation")
            _require(isinstance(generation, str) and 0 < len(generation) <= 255, f"{loc}: malformed generation", where)
            key = _references.pack_ref_key(folder, key)
        for j, b in enumerate(pack["boxes"]):
            try:
                leaf, (origin, shape), offset, nbytes, crc = b["leaf"], b["box"], b["offset"], b["data_bytes"], b["data_crc32c"]
                box = Box(tuple(origin), tuple(shape))
            except (KeyError, TypeError, ValueError, OverflowError) as e:
                raise CorruptCheckpointError(f"manifest of {where}: {loc} box {j} is malformed ({e})") from e
            m = leaves.get(leaf) if isinstance(leaf, str) else None
            if not (isinstance(m, ArrayMetadata) and m.packed):  # (messages formatted only when raised: one box per small leaf)
                _require(False, f"{loc} box {j}: {leaf!r:.100} is not a packed array leaf", where)
            assert isinstance(m, ArrayMetadata)
            ok = type(offset) is int and type(nbytes) is int and type(crc) is int and offset >= 0 and crc >= 0
            ok = ok and len(box.origin) == len(box.shape) == len(m.shape) and offset + nbytes <= file_bytes - 4
            size = m.dtype.itemsize
            for o, s, c, n in zip(box.origin, box.shape, m.chunk_shape, m.shape):
                ok = ok and type(o) is int and type(s) is int and 0 <= o < n and o % c == 0 and s == min(c, n - o)
                size = size * s if ok else -1  # never `*=` a str or list from a hostile manifest
            if not (ok and nbytes == size):
                _require(False, f"{loc} box {j} of leaf {leaf!r} does not fit the leaf's chunk grid or the pack's size", where)
            h = b.get("xxh3_128") if folder is not None else None
            if not (h is None or isinstance(h, str) and len(h) == 32):
                _require(False, f"{loc} box {j}: malformed xxh3_128", where)
            found.setdefault(leaf, []).append(_leaves.PackedBox(key, file_bytes, box, offset, nbytes, crc, folder, generation, h))
    out: dict[str, tuple[_leaves.PackedBox, ...]] = {}
    for path, m in leaves.items():
        if isinstance(m, ArrayMetadata) and m.packed:
            boxes = found.get(path, [])
            if len(boxes) == 1 and all(c >= s for s, c in zip(m.shape, m.chunk_shape)):  # one chunk, the leaf's only one
                out[path] = (boxes[0],)
                continue
            n_chunks = math.prod(-(-s // c) for s, c in zip(m.shape, m.chunk_shape)) if math.prod(m.shape) else 0
            _require(len({b.box for b in boxes}) == len(boxes) and (len(boxes) == n_chunks or not complete and len(boxes) <= n_chunks),
                     f"packed leaf {path!r} has {len(boxes)} boxes in the packs, expected one per chunk ({n_chunks})", where)
            out[path] = tuple(sorted(boxes, key=lambda b: b.box.origin))
    return out


def read_metadata(storage: Storage, path: str, *, check_references: bool = True) -> CheckpointMetadata:
    """Reads the manifest of the committed checkpoint at `path`; with references
    (incremental saves), checks their targets (`check_reference_targets`) unless
    `check_references` is False.

    Raises:
      CheckpointNotFoundError: no commit marker at `path`, or (`check_references`) the
        step is retired (kept only for the chunks newer steps reference).
      CorruptCheckpointError: the manifest is missing, malformed or cannot be read (an
        I/O error: its cause), or a reference's target is missing, replaced, of another
        layout or itself a reference.
    """
    if not storage.exists(f"{path}/{_layout.COMMITTED}"):
        parent, name = path.rstrip("/").rsplit("/", 1)
        partials = [n for n in storage.list_dir(parent) if (_layout.parse_partial_name(n) or ("",))[0] == name]
        hint = (
            f" Found uncommitted save attempts {partials}: they crashed or are still writing, and are not checkpoints."
            if partials
            else " Check the path, or list committed steps with `checkpointer ls DIR`."
        )
        raise CheckpointNotFoundError(f"no committed checkpoint at {path}: the commit marker {_layout.COMMITTED} is absent.{hint}")
    if check_references and storage.exists(f"{path}/{_layout.RETIRED}"):
        raise CheckpointNotFoundError(_retired_message(storage, path))
    try:
        data = storage.read_file(f"{path}/{_layout.MANIFEST}", max_bytes=_json.MAX_MANIFEST_BYTES)
    except (FileNotFoundError, IsADirectoryError) as e:
        raise CorruptCheckpointError(f"{path} is marked committed but has no {_layout.MANIFEST} file") from e
    except OSError as e:
        if e.errno != errno.EFBIG:  # EIO and the like: the documented error, as for a chunk that cannot be read
            raise CorruptCheckpointError(
                f"{path}/{_layout.MANIFEST} cannot be read: {e}. An I/O error is not always damage: try again, or "
                f"check the checkpoint with `checkpointer verify {path}`"
            ) from e
        raise CorruptCheckpointError(f"{path}/{_layout.MANIFEST} is larger than {_json.MAX_MANIFEST_BYTES} bytes") from e
    raw = _json.loads(data, f"{path}/{_layout.MANIFEST}")
    _check_one_save(storage, path, raw)
    meta = parse_manifest(raw, path)
    if check_references and meta.format_version == _references.FORMAT_VERSION_REFERENCES:
        check_reference_targets(storage, path, meta)
    return meta


def _retired_message(storage: Storage, path: str) -> str:
    """Why the retired step at `path` cannot be read itself (its `RETIRED` marker)."""
    try:
        users = _json.load_json(storage.read_file(f"{path}/{_layout.RETIRED}", max_bytes=1 << 20), what=path).get("referenced_by")
    except (CheckpointError, OSError, AttributeError):
        users = None
    when = f" (steps {', '.join(map(str, users))} when it was retired)" if isinstance(users, list) and users else ""
    return (f"{path} is retired: retention removed it but kept the chunks that newer steps reference{when} "
            f"(incremental saves; its {_layout.RETIRED} marker), so it is no checkpoint any more. Restore a newer step "
            "(`checkpointer ls` lists them)")


def _check_one_save(storage: Storage, path: str, raw: object) -> None:
    """Refuses a manifest and a commit marker of two different saves (their `generation`s
    differ): one of them is a file of another checkpoint (a link out of this one, or a
    copy), whose values must not be returned as this one's. A marker without a generation
    (or unreadable) is not compared."""
    generation = raw.get("generation") if isinstance(raw, dict) else None
    if not isinstance(generation, str):
        return
    try:
        marker = _json.load_json(storage.read_file(f"{path}/{_layout.COMMITTED}", max_bytes=1 << 20), what=path)
    except (CheckpointError, OSError):
        return
    committed = marker.get("generation") if isinstance(marker, dict) else None
    if isinstance(committed, str) and committed != generation:
        raise CorruptCheckpointError(
            f"{path}/{_layout.MANIFEST} belongs to save {generation!r}, its commit marker {_layout.COMMITTED} to save "
            f"{committed!r}: one of them is another checkpoint's file (a link out of this one, or a copy). Restore "
            "another step, or copy the checkpoint's own files back"
        )


def _target_of(storage: Storage, path: str, folder: str, leaf: str, targets: dict) -> CheckpointMetadata:
    """The manifest of the referenced sibling `folder` (read once per folder, its own
    references not followed), or CorruptCheckpointError naming both checkpoints and
    the leaf (`leaf`: its name as `jax.tree_util.keystr` prints it)."""
    if folder not in targets:
        target = _references.sibling(path, folder)
        try:
            targets[folder] = read_metadata(storage, target, check_references=False)
        except CheckpointNotFoundError as e:
            raise CorruptCheckpointError(
                f"{path}: leaf {leaf} references chunks of {target}, which is not a committed checkpoint (deleted, "
                f"or never committed): the referenced data is gone. Restore another step. ({e})"
            ) from e
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{path}: leaf {leaf} references {target}, whose manifest is unreadable: {e}") from e
    return targets[folder]


def check_reference_targets(storage: Storage, path: str, meta: CheckpointMetadata) -> None:
    """Checks every reference of `meta` (the checkpoint at `path`) against its target: a
    committed sibling checkpoint whose manifest names the referenced generation, with
    the same leaf in the same layout, holding the chunk's bytes itself (a reference to
    a reference is refused: no chains, no cycles). Reads each target's manifest once.

    Raises:
      CorruptCheckpointError: naming this checkpoint, the target, the leaf and the chunk.
    """
    targets: dict[str, CheckpointMetadata] = {}
    for m in meta.arrays.values():
        name = leaf_name(m.path, m.keystr)
        for cell, ref in m.references.items():
            t = _target_of(storage, path, ref.folder, name, targets)
            target = _references.sibling(path, ref.folder)
            here = f"{path}: leaf {name} chunk {list(cell)} references {target}"
            tm = t.arrays.get(m.path)
            if t.generation != ref.generation:
                raise CorruptCheckpointError(
                    f"{here}, saved by generation {ref.generation}, but {target} now holds generation {t.generation} "
                    "(replaced since): the referenced bytes are gone. Restore another step"
                )
            if tm is None or tm.packed or (tm.shape, tm.dtype, tm.chunk_shape, tm.inner_chunk_shape) != (
                    m.shape, m.dtype, m.chunk_shape, m.inner_chunk_shape):
                raise CorruptCheckpointError(f"{here}, which has no leaf {name} of the same shape, dtype and chunk layout")
            if cell in tm.references:
                raise CorruptCheckpointError(
                    f"{here}, where that chunk is itself a reference (to {tm.references[cell].folder}): references must "
                    "point to the checkpoint holding the bytes (a chain or a cycle)"
                )
        for pb in m.pack_boxes:
            if pb.folder is not None:
                _check_pack_reference(storage, path, m, name, pb, _target_of(storage, path, pb.folder, name, targets))


def _check_pack_reference(storage: Storage, path: str, m: ArrayMetadata, name: str, pb: _leaves.PackedBox,
                          t: CheckpointMetadata) -> None:
    """One referenced packed chunk: the target names its generation and holds the same
    bytes (key, offset, size, crc32c) in its own pack (no chain), for a leaf of the same
    shape, dtype and chunk shape."""
    assert pb.folder is not None
    target = _references.sibling(path, pb.folder)
    here = f"{path}: leaf {name} packed chunk at {list(pb.box.origin)} references the pack of {target}"
    if t.generation != pb.generation:
        raise CorruptCheckpointError(
            f"{here}, saved by generation {pb.generation}, but {target} now holds generation {t.generation} "
            "(replaced since): the referenced bytes are gone. Restore another step"
        )
    tm = t.arrays.get(m.path)
    if tm is None or not tm.packed or (tm.shape, tm.dtype, tm.chunk_shape) != (m.shape, m.dtype, m.chunk_shape):
        raise CorruptCheckpointError(f"{here}, which has no packed leaf {name} of the same shape, dtype and chunk layout")
    key = _references.split_pack_key(pb.key)[1]
    theirs = next((b for b in tm.pack_boxes if b.box == pb.box), None)
    if theirs is None or theirs.folder is not None or (theirs.key, theirs.offset, theirs.nbytes, theirs.crc32c) != (
            key, pb.offset, pb.nbytes, pb.crc32c):
        raise CorruptCheckpointError(
            f"{here}, which does not hold that chunk itself at the same place (another pack, offset, size or crc32c, "
            "or a reference: a chain or a cycle). Restore another step"
        )


def metadata(path: str | os.PathLike) -> CheckpointMetadata:
    """Returns the metadata of the committed checkpoint at `path`.

    Reads only `manifest.json`; needs no devices, whatever mesh saved the checkpoint.

    Args:
      path: a checkpoint path (local, `file://`, `memory://`, `gs://`, `s3://`).
    Returns:
      A `CheckpointMetadata` (step, per-leaf shape/dtype/chunking/saved sharding, user
      metadata, process count, versions).
    Raises:
      CheckpointNotFoundError: `path` has no commit marker.
      CorruptCheckpointError: the manifest is malformed.

    Multi-process: any process may call it alone.
    """
    storage, path = storage_for(path)
    return read_metadata(storage, path)
