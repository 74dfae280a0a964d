"""Incremental saves: which chunks of a save are unchanged since the newest committed
checkpoint of the same directory (the *base*), and are stored as references to it
instead of bytes (`_format._references`, docs/incremental.md).

The one seam of the save's hot path: `Base.split(leaf)` decides, per chunk, "unchanged:
reference the base" or "write", from

- identity (no work at all): the leaf is the very `jax.Array` object the base saved
  (remembered by `remember` when that save committed), neither deleted nor donated
  since: JAX arrays are immutable, so its bytes are the base's. Such a leaf is not even
  copied to host memory (`unchanged_by_identity`, asked before the snapshot);
- content: the chunk's crc32c differs from the base's -> changed (no more work). It
  matches -> proven by XXH3-128 (128 bits, ~0.07 CPU-s/GiB here; BLAKE2b ~1.1): against
  the hash the base's reference kept, or, the first time a chunk is found unchanged
  (the base wrote it: nothing kept a hash, and hashing every written chunk would cost
  every save where everything changes a second pass), against the hash of the base's
  bytes, read back once; the new reference keeps the hash for the next save.

Where the crc32c comes from: where the snapshot copied a chunk straight into its zarr
shard file (`_encoding.ShardImage`: the CPU backend or numpy leaves, saved to local
files), from that copy's own pass (`ShardImage.data_crc32c`, combined from its rows'
crc32c with `_encoding._crc`): the check costs nothing more until a chunk's crc32c
matches. Such a chunk is decided on the writer's thread, between its image's checksum
pass and its write (`Pending`, `_encoding.LeafWrite.write_if`), as a save without the
check checksums and writes it: checksumming every image up front instead, then writing,
cost a pretraining loop ~0.1 CPU-s per GiB more on a quiet 2-core VM (docs/DESIGN-decisions.md). Elsewhere (accelerators' `pinned_host`/host copies, object stores, buffered
writes, `direct_io=False`: host arrays the writer checksums only while encoding, after
the decision is needed) `split` runs one crc32c pass of its own over each chunk of a leaf
that has a base (~0.08 CPU-s/GiB here), and skips that pass for a leaf that changed
entirely at its last check for `RECHECK_EVERY` saves (a pretraining loop pays 1/8 of a
pass). A leaf whose chunks are all images is checked on every save (no pass to save).

Packed small leaves (`_pack`) are deduplicated entry by entry (`split_packed`): a packed
chunk whose crc32c and XXH3-128 equal the base's (compared with the base's bytes, read
back from its pack, the first time) is not put into this save's pack; the manifest's
`packed` list gains a record of the base's pack (`"in"`, `"generation"`) listing the
chunks referenced there (docs/format.md). On a two-tier manager's local tier too
(`bases_beside`): replication translates or materializes pack references
(`_manage._tier_references`), peer copies carry the referenced packs.

Not deduplicated: dtypes the byte-range reader does not decode
(complex, sub-byte: read through TensorStore's array layer, which cannot follow a
reference), and leaves whose layout (shape, dtype, chunk and inner chunk shape)
differs from the base's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
import xxhash

from .. import _commit, _encoding, _format
from .._errors import CheckpointError, CheckpointExistsError, SaveError
from .._format import ArrayMetadata, Box, CheckpointMetadata, ChunkRef, PackedBox, PackedBoxRecord, PackRecord
from .._storage import Storage

log = logging.getLogger("checkpointer")

# (directory, folder name, generation) of the newest committed save of each directory
# made by this process, and leaf path -> weak reference to the jax.Array it saved.
_IDENTITY: dict[str, tuple[str, str, dict[str, weakref.ref]]] = {}
_IDENTITY_LOCK = threading.Lock()
# Leaves found changed in every chunk at their last check (a pretraining loop: everything
# changes): directory key, leaf path -> saves since that check. Such a leaf is written
# without the crc32c pass until RECHECK_EVERY saves have passed, so the check costs a loop
# where everything changes 1/RECHECK_EVERY of a crc32c pass, and a leaf that stops changing
# is referenced again within RECHECK_EVERY saves. Only for leaves with chunks that are no
# `ShardImage` (whose crc32c is a pass of its own): an image's crc32c comes from its one checksum pass
# (`ShardImage.checksum`, on the writer's threads), which the write then reuses.
RECHECK_EVERY = 8
# The chunk crc32c of the last few bases, by (storage, path, generation): a training loop
# reads each base's process records once, not on every save.
_BASES: dict[tuple[str, str, str], dict[str, int]] = {}
_CHANGING: dict[tuple[str, str], int] = {}


def xxh3_128(data: np.ndarray) -> str:
    """XXH3-128 of an array's C-order bytes, 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)


def check_option(incremental: object) -> bool:
    if not isinstance(incremental, bool):
        raise TypeError(f"incremental must be True or False, got {incremental!r}")
    return incremental


def weak_arrays(leaves: Sequence[tuple[str, object]]) -> dict[str, weakref.ref]:
    """Leaf path -> weak reference of each jax.Array leaf (a save keeps no array alive)."""
    out = {}
    for leaf_path, a in leaves:
        if isinstance(a, jax.Array):
            try:
                out[leaf_path] = weakref.ref(a)
            except TypeError:  # not weak-referenceable: never unchanged by identity
                pass
    return out


def remember(storage: Storage, path: str, generation: str, arrays: Mapping[str, weakref.ref]) -> None:
    """After a commit: the jax.Arrays this process just saved to `path` (`weak_arrays`),
    for the next incremental save's identity check."""
    parent, name = path.rstrip("/").rsplit("/", 1)
    with _IDENTITY_LOCK:
        _IDENTITY[f"{type(storage).__name__}:{parent}"] = (name, generation, dict(arrays))


@dataclasses.dataclass
class Stats:
    """What a save's equality check found (process-local)."""

    chunks_by_identity: int = 0
    chunks_by_hash: int = 0
    chunks_by_comparison: int = 0
    chunks_changed: int = 0
    bytes_referenced: int = 0
    bytes_hashed: int = 0  # crc32c and XXH3 passes of the check
    bytes_compared: int = 0  # read back from the base


_STATS_LOCK = threading.Lock()  # `Stats` of the checks run on the writer's threads


class Pending:
    """The decision on one image chunk, made on the writer's thread right after the
    image's checksum pass (`Base.split`): called there (`_encoding.LeafWrite.write_if`),
    it says whether to write the chunk, and keeps its reference if unchanged."""

    __slots__ = ("_decide", "ref")

    def __init__(self, decide: Callable[[], ChunkRef | None]) -> None:
        self._decide = decide
        self.ref: ChunkRef | None = None

    def __call__(self) -> bool:
        self.ref = self._decide()
        return self.ref is None


@dataclasses.dataclass
class Base:
    """The newest committed checkpoint of the directory that a save may reference."""

    storage: Storage
    path: str  # the base checkpoint's path
    folder: str  # its folder name
    meta: CheckpointMetadata
    crcs: dict[str, int]  # chunk key -> data_crc32c of the chunks the base holds itself
    same: dict[str, weakref.ref]  # leaf path -> the jax.Array the base saved (this process)
    own: str = ""  # the folder name of the save itself: a base's reference into it is not copied

    @property
    def generation(self) -> str:
        assert self.meta.generation is not None
        return self.meta.generation

    def leaf(self, meta: ArrayMetadata) -> ArrayMetadata | None:
        """The base's leaf of the same path and layout, or None (not referenced)."""
        b = self.meta.arrays.get(meta.path)
        if b is None or b.packed or meta.packed or not _encoding_reads_directly(meta.dtype):
            return None
        if (b.shape, b.dtype, b.chunk_shape, b.inner_chunk_shape, b.key_impl) != (
                meta.shape, meta.dtype, meta.chunk_shape, meta.inner_chunk_shape, meta.key_impl):
            return None
        return b

    def _ref(self, b: ArrayMetadata, chunk: tuple[int, ...], crc: int | None, h: str | None) -> ChunkRef | None:
        """The reference to the base's chunk (to where the base found it, if the base
        references it itself: references are flat)."""
        old = b.references.get(chunk)
        if old is not None:  # into the step being replaced (force=True): its bytes go, written again
            return None if old.folder == self.own else dataclasses.replace(old, xxh3_128=old.xxh3_128 or h)
        base_crc = self.crcs.get(_format.chunk_key(b.path, chunk))
        if base_crc is None or (crc is not None and crc != base_crc):
            return None
        return ChunkRef(chunk, self.folder, self.generation, base_crc, h)

    def unchanged_by_identity(self, meta: ArrayMetadata, leaf: object) -> bool:
        """Whether `leaf` is the very jax.Array the base saved, alive and not donated."""
        ref = self.same.get(meta.path)
        if ref is None or ref() is not leaf or self.leaf(meta) is None:
            return False
        try:
            return isinstance(leaf, jax.Array) and not leaf.is_deleted()
        except Exception:  # a deleted or foreign array: checked by content instead
            return False

    def identical(self, meta: ArrayMetadata, leaf: object, chunks: Sequence[tuple[int, ...]]) -> tuple[ChunkRef, ...] | None:
        """References for every chunk of a leaf unchanged by identity, or None: the
        leaf is not (`unchanged_by_identity`), or a chunk the base's records do not know
        (the leaf is then checked by content)."""
        b = self.leaf(meta)
        if b is None or not self.unchanged_by_identity(meta, leaf):
            return None
        refs = [self._ref(b, tuple(c), None, None) for c in chunks]
        if any(r is None for r in refs):
            return None
        return tuple(r for r in refs if r is not None)

    def split(self, meta: ArrayMetadata, chunks: Sequence[tuple[tuple[int, ...], Box, np.ndarray | _encoding.ShardImage]],
              stats: Stats) -> tuple[list, list[ChunkRef | Pending], list[Pending | None]]:
        """The seam: `(chunks to write, references, checks)` of one leaf's chunks `(chunk
        index, box, host copy)` (a host array of the box, or its `ShardImage`), deciding
        by content (module docstring); adds what it found and cost to `stats`.

        A leaf whose chunks are all images is decided on the writer's threads, each chunk
        right after its image's checksum pass (the one pass that gives its crc32c) and
        before its write: such a chunk is in the chunks to write with its `Pending` in
        `checks` (`_encoding.LeafWrite.write_if`) and in the references, in plan order
        (`resolve` keeps those found unchanged once the writes are done). Else every
        chunk is decided here, and `checks` is all None."""
        b = self.leaf(meta)
        if b is None:
            return list(chunks), [], [None] * len(chunks)
        key = (self.path.rsplit("/", 1)[0], meta.path)
        passes = any(not isinstance(host, _encoding.ShardImage) for _, _, host in chunks)  # a crc32c pass of its own
        with _IDENTITY_LOCK:
            since = _CHANGING.get(key) if passes else None
            if since is not None and since + 1 < RECHECK_EVERY:
                _CHANGING[key] = since + 1
                stats.chunks_changed += len(chunks)
                return list(chunks), [], [None] * len(chunks)  # changed at its last check: written without looking
        write: list = []
        refs: list[ChunkRef | Pending] = []
        checks: list[Pending | None] = []
        reader: list = []  # the base's region reader, once needed
        for chunk_index, box, host in chunks:
            cell = tuple(chunk_index)
            old = b.references.get(cell)
            base_crc = old.data_crc32c if old is not None else self.crcs.get(_format.chunk_key(b.path, cell))
            if base_crc is None or (host.data_bytes if isinstance(host, _encoding.ShardImage) else host.nbytes) == 0:
                write.append((chunk_index, box, host))
                checks.append(None)
                continue
            if not passes:  # decided on the writer's thread, after the image's checksum pass
                pending = Pending(functools.partial(self._decide, b, meta, cell, box, host, base_crc, old, stats, []))
                write.append((chunk_index, box, host))
                checks.append(pending)
                refs.append(pending)
                continue
            ref = self._decide(b, meta, cell, box, host, base_crc, old, stats, reader)
            if ref is None:
                write.append((chunk_index, box, host))
                checks.append(None)
            else:
                refs.append(ref)
        if passes:
            found = [r for r in refs if isinstance(r, ChunkRef)]
            with _IDENTITY_LOCK:
                if write and not found:
                    _CHANGING[key] = 0
                else:
                    _CHANGING.pop(key, None)
        return write, refs, checks

    def _decide(self, b: ArrayMetadata, meta: ArrayMetadata, cell: tuple[int, ...], box: Box,
                host: np.ndarray | _encoding.ShardImage, base_crc: int, old: ChunkRef | None, stats: Stats,
                reader: list) -> ChunkRef | None:
        """One chunk with a base: its reference if unchanged, else None (changed: written).
        `reader`: a one-item cache of the base's region reader (empty until needed)."""
        image = host if isinstance(host, _encoding.ShardImage) else None
        nbytes = image.data_bytes if image is not None else host.nbytes
        hashed = 0
        if image is not None:
            crc = image.data_crc32c  # the image's checksum pass
        else:
            crc = _format.data_crc32c(np.asarray(host))
            hashed += nbytes
        if crc != base_crc:
            with _STATS_LOCK:
                stats.chunks_changed += 1
                stats.bytes_hashed += hashed
            return None
        h = _xxh3_128_of(meta, box, host)
        hashed += nbytes
        compared = by_hash = by_comparison = 0
        if old is not None and old.xxh3_128 is not None:
            same = h == old.xxh3_128
            by_hash = int(same)
        else:  # the first time: compare with the bytes where they lie (following the base's reference), once
            if not reader:
                reader.append(_encoding.region_reader(self.storage, self.path, b))
            theirs = reader[0](box)  # crc32c-checked by the reader, inner chunk by inner chunk
            compared = nbytes
            same = tuple(theirs.shape) == tuple(box.shape) and xxh3_128(theirs) == h
            by_comparison = int(same)
        ref = self._ref(b, cell, crc, h) if same else None
        with _STATS_LOCK:
            stats.bytes_hashed += hashed
            stats.bytes_compared += compared
            stats.chunks_by_hash += by_hash
            stats.chunks_by_comparison += by_comparison
            if ref is None:
                stats.chunks_changed += 1
            else:
                stats.bytes_referenced += nbytes
        return ref

    def split_packed(self, meta: ArrayMetadata, chunks: Sequence[tuple[tuple[int, ...], Box, np.ndarray]],
                     stats: Stats) -> tuple[list, list[PackedBox]]:
        """`split` for a packed leaf: `(chunks to write into this save's pack, references)`,
        each reference the base's `PackedBox` of the same chunk, pointing to the pack that
        holds its bytes (the base's own, or where the base found it: references are flat).

        Equality: the crc32c of the host copy against the base's index entry; a match is
        proven by XXH3-128, against the hash the base's reference kept, or else against
        the base's bytes read back from its pack (crc32c-checked)."""
        b = self.meta.arrays.get(meta.path)
        if b is None or not b.packed or not meta.packed or (b.shape, b.dtype, b.chunk_shape) != (
                meta.shape, meta.dtype, meta.chunk_shape):
            return list(chunks), []
        theirs = {pb.box: pb for pb in b.pack_boxes}
        write, refs = [], []
        readers: dict[str, object] = {}
        try:
            for chunk_index, box, host in chunks:
                pb = theirs.get(box)
                data = np.ascontiguousarray(host)
                if pb is None or pb.nbytes != data.nbytes or pb.nbytes == 0 or pb.folder == self.own:
                    write.append((chunk_index, box, host))
                    continue
                stats.bytes_hashed += data.nbytes
                if _format.data_crc32c(data) != pb.crc32c:
                    stats.chunks_changed += 1
                    write.append((chunk_index, box, host))
                    continue
                h = xxh3_128(data)
                stats.bytes_hashed += data.nbytes
                if pb.xxh3_128 is not None:
                    same = h == pb.xxh3_128
                    stats.chunks_by_hash += same
                else:  # the first time: the base's bytes, read back once
                    file = _format.pack_file(self.path, pb.key)
                    reader = readers.get(file)
                    if reader is None:
                        reader = readers[file] = self.storage.open_reader(file)
                    buf = np.empty(pb.nbytes, np.uint8)
                    reader.read_into(pb.offset, buf.data)  # type: ignore[attr-defined]
                    stats.bytes_compared += pb.nbytes
                    same = _format.data_crc32c(buf) == pb.crc32c and xxh3_128(buf) == h
                    stats.chunks_by_comparison += same
                if not same:
                    stats.chunks_changed += 1
                    write.append((chunk_index, box, host))
                    continue
                stats.bytes_referenced += pb.nbytes
                folder, key = _format.split_pack_key(pb.key)
                refs.append(dataclasses.replace(pb, key=key, folder=folder or self.folder,
                                                generation=pb.generation or self.generation, xxh3_128=h))
        except OSError as e:  # the base's pack cannot be read: this leaf's chunks are written
            log.warning("incremental save: cannot read the pack of the base %s (%s); writing %s whole", self.path, e, meta.path)
            return list(chunks), []
        finally:
            for r in readers.values():
                r.close()  # type: ignore[attr-defined]
        return write, refs


def pack_references(refs: Sequence[tuple[str, ChunkRef | PackedBox]]) -> tuple[PackRecord, ...] | None:
    """The packed chunks referenced (`split_packed`, in `refs` beside the chunk
    references) as pack records of the packs holding them: `"in"`, `"generation"`, and
    the referenced boxes (each with its `xxh3_128`); None when there are none."""
    groups: dict[tuple[str, str, str, int], list[PackedBoxRecord]] = {}
    for leaf, pb in refs:
        if isinstance(pb, PackedBox):
            assert pb.folder is not None and pb.generation is not None
            extra = {"xxh3_128": pb.xxh3_128} if pb.xxh3_128 is not None else {}
            groups.setdefault((pb.folder, pb.generation, pb.key, pb.file_bytes), []).append(PackedBoxRecord(
                leaf=leaf, box=pb.box, offset=pb.offset, data_bytes=pb.nbytes, data_crc32c=pb.crc32c, extra=extra))
    out = tuple(PackRecord(array=key.rsplit("/c/", 1)[0], key=key, file_bytes=n, boxes=tuple(sorted(boxes, key=lambda x: x.offset)),
                           extra={"in": folder, "generation": gen}) for (folder, gen, key, n), boxes in groups.items())
    return out or None


def _xxh3_128_of(meta: ArrayMetadata, box: Box, host: np.ndarray | _encoding.ShardImage) -> str:
    """XXH3-128 of a chunk's C-order bytes, from its host array or read back from its image."""
    if not isinstance(host, _encoding.ShardImage):
        return xxh3_128(host)
    h = xxhash.xxh3_128()
    for piece in _encoding.image_data(host, meta.layout, tuple(box.shape), meta.dtype):
        h.update(piece.data)
    return h.hexdigest()


def leaf_write(base: Base | None, meta: ArrayMetadata, chunks: list, identical: Sequence[ChunkRef] | None,
               references: list, stats: Stats) -> _encoding.LeafWrite:
    """The write of one leaf (`chunks`, each `(chunk index, box, host copy)`, all of them
    for a save that is not incremental) but for its unchanged chunks; the references made
    instead are appended to `references` (`(leaf path, ChunkRef)`): `identical`, those of
    a leaf unchanged by identity (nothing was copied), else what `base.split` found, some
    of them `Pending` until the writes are done (`resolve`)."""
    if identical is not None:
        stats.chunks_by_identity += len(identical)
        references += [(meta.path, r) for r in identical]
        return _encoding.LeafWrite(meta, [])
    if base is None:
        return _encoding.LeafWrite(meta, chunks)
    if meta.packed:
        chunks, packed_refs = base.split_packed(meta, chunks, stats)
        references += [(meta.path, pb) for pb in packed_refs]
        return _encoding.LeafWrite(meta, chunks)
    chunks, refs, checks = base.split(meta, chunks, stats)  # the equality check's one seam
    references += [(meta.path, r) for r in refs]
    return _encoding.LeafWrite(meta, chunks, checks if any(c is not None for c in checks) else ())


def resolve(references: list) -> None:
    """Once the writes are done: each `Pending` of `references` becomes its reference
    (the chunk was unchanged, not written) or goes (it was written); in place, in order."""
    if any(isinstance(r, Pending) for _, r in references):
        references[:] = [(leaf, r.ref if isinstance(r, Pending) else r) for leaf, r in references
                         if not isinstance(r, Pending) or r.ref is not None]


def with_references(arrays: Sequence[ArrayMetadata], refs: dict[str, dict[tuple[int, ...], ChunkRef]]) -> list[ArrayMetadata]:
    """The manifest's leaves with every process's references (`gather`)."""
    return [dataclasses.replace(m, references=refs[m.path]) if m.path in refs else m for m in arrays]


def check_unreferenced(storage: Storage, path: str, pidx: int) -> None:
    """Refuses to replace the committed checkpoint `path` that others reference.

    Raises:
      CheckpointExistsError: naming the referencing checkpoints.
    """
    users = referencing(storage, path)
    if users:
        raise CheckpointExistsError(
            f"cannot replace {path} (process {pidx}): the committed checkpoints {users} of the same directory reference "
            "its chunks (incremental saves), and replacing it would leave them without their data. Save to a new "
            "step, or delete the referencing steps first"
        )


def _encoding_reads_directly(dtype: np.dtype) -> bool:
    return _encoding.fast_path_supported(dtype)


_WHERE = threading.local()


@contextlib.contextmanager
def bases_beside(storage: Storage, path: str):
    """Within (on this thread): an incremental save takes its base beside `path` on
    `storage` instead of beside its own path. A two-tier manager's save commits on the
    local tier first (`LOCAL/process-<i>/<step>`), so it references the newest committed
    step of that same local folder; the durable copy is made self-consistent when it is
    replicated (`_manage._tier_references`)."""
    _WHERE.at = (storage, path)
    try:
        yield
    finally:
        _WHERE.at = None


def find_base(storage: Storage, path: str) -> Base | None:
    """The newest committed checkpoint beside `path` (canonical step folders of its
    parent, `path` itself excluded), with its manifest and chunk crc32c, or None
    (`bases_beside` redirects it).

    A base whose manifest or records cannot be read is skipped (logged): the save is
    then a full one."""
    at = getattr(_WHERE, "at", None)
    if at is not None:
        storage, path = at
    parent, name = path.rstrip("/").rsplit("/", 1)
    try:
        folders = _commit.committed_folders(storage, parent)
    except OSError:
        return None
    candidates = [f for s, f in folders.items() if f == str(s) and f != name]
    if not candidates:
        return None
    folder = candidates[-1]
    base_path = f"{parent}/{folder}"
    try:
        meta = _format.read_metadata(storage, base_path, check_references=False)
        if meta.generation is None:
            return None
        key = (type(storage).__name__, base_path, meta.generation)
        with _IDENTITY_LOCK:
            crcs = _BASES.get(key)
        if crcs is None:  # first use of this base (a committed generation never changes: cached)
            # The base's own references are checked: a save copies them (references are
            # flat), and one that dangles would fail the commit; such a base is skipped.
            _format.check_reference_targets(storage, base_path, meta)
            crcs = {}
            for rec_name in storage.list_dir(f"{base_path}/{_format.PROCESSES}"):
                record = _format.read_process_record(storage, f"{base_path}/{_format.PROCESSES}/{rec_name}")
                crcs.update((c.key, c.data_crc32c) for c in record.chunks if c.data_crc32c is not None and c.leaf is not None)
            with _IDENTITY_LOCK:
                _BASES[key] = crcs
                while len(_BASES) > 4:
                    _BASES.pop(next(iter(_BASES)))
    except (CheckpointError, OSError) as e:
        log.warning("incremental save to %s: cannot read the base %s (%s); saving every chunk", path, base_path, e)
        return None
    with _IDENTITY_LOCK:
        known = _IDENTITY.get(f"{type(storage).__name__}:{parent}")
    same = known[2] if known is not None and known[0] == folder and known[1] == meta.generation else {}
    return Base(storage, base_path, folder, meta, crcs, same, own=name)


def references_json(refs: Sequence[tuple[str, ChunkRef | PackedBox]]) -> list[dict]:
    """A process record's `"references"`: `{"leaf": path, **ChunkRef.to_json()}` each."""
    return [{"leaf": leaf} | r.to_json() for leaf, r in refs if isinstance(r, ChunkRef)]


def gather(storage: Storage, path: str, root: str, own_index: int, own: Sequence[tuple[str, ChunkRef | PackedBox]],
           referencing: Sequence[int]) -> dict[str, dict[tuple[int, ...], ChunkRef]]:
    """Process 0 at commit: every process's references, leaf path -> chunk -> reference:
    its own (`own`) and, from their records in `root`, those of the processes that
    reported references (`referencing`, `_commit.Commit.referencing`: whatever this
    process's own save did, e.g. it found no base); checks that every checkpoint beside
    `path` they reference is still the committed generation referenced, and that a
    retired one still holds every file referenced there (run under `guard`).

    Raises:
      SaveError: a referenced checkpoint was deleted, replaced or pruned meanwhile
        (nothing is committed).
    """
    out: dict[str, dict[tuple[int, ...], ChunkRef]] = {}
    wanted: dict[str, set[str]] = {}  # referenced folder -> the generations referenced there
    files: dict[str, set[str]] = {}  # referenced folder -> the chunk and pack files referenced there
    for i in [own_index, *(i for i in referencing if i != own_index)]:
        if i == own_index:
            items = [(leaf, r) for leaf, r in own if isinstance(r, ChunkRef)]  # packed ones: `pack_references`
            packs = pack_references(own) or ()
        else:
            location = f"{root}/{_format.process_record_name(i)}"
            record = _format.read_process_record(storage, location)
            items = [(raw["leaf"], _format_refs(raw, location, j)) for j, raw in enumerate(record.references or ())]
            packs = record.packed_references or ()
        for p in packs:
            folder = str(p.extra.get("in"))
            wanted.setdefault(folder, set()).add(str(p.extra.get("generation")))
            files.setdefault(folder, set()).add(p.key)
        for leaf, r in items:
            out.setdefault(leaf, {})[r.chunk] = r
            wanted.setdefault(r.folder, set()).add(r.generation)
            files.setdefault(r.folder, set()).add(_format.chunk_key(leaf, r.chunk))
    for folder in wanted:
        target = _format.sibling(path, folder)
        try:
            generation = _format.read_metadata(storage, target, check_references=False).generation
        except CheckpointError as e:
            raise SaveError(f"incremental save into {root}: the referenced checkpoint {target} is gone ({e}); nothing committed") from e
        if wanted[folder] != {generation}:
            raise SaveError(f"incremental save into {root}: the referenced checkpoint {target} was replaced meanwhile; nothing committed")
        if storage.exists(f"{target}/{_format.RETIRED}"):  # retention keeps only what listed steps reference there
            missing = sorted(files[folder] - set(storage.list_files(target)))
            if missing:
                raise SaveError(
                    f"incremental save into {root}: retention retired the referenced checkpoint {target} meanwhile and "
                    f"removed {len(missing)} file(s) it references (e.g. {missing[0]}); nothing committed. Save again")
    return out


_GUARDS: dict[str, threading.RLock] = {}


def guard(storage: Storage, directory: str) -> threading.RLock:
    """The lock of `directory` (in this process) that its retention holds while it runs
    and an incremental save's commit holds from its check of the referenced checkpoints
    (`gather`) to its publication: retention never prunes what a commit just checked."""
    key = f"{type(storage).__name__}:{directory.rstrip('/')}"
    with _IDENTITY_LOCK:
        return _GUARDS.setdefault(key, threading.RLock())


def _format_refs(raw: dict, location: str, j: int) -> ChunkRef:
    chunk = raw.get("chunk")
    rank = len(chunk) if isinstance(chunk, list) else 0
    return _format.refs_from_json([{k: v for k, v in raw.items() if k != "leaf"}], "", rank, f"{location}: reference {j}")[0]


def referencing(storage: Storage, path: str) -> list[str]:
    """The committed checkpoints beside `path` (canonical step folders) that reference
    its chunks (one manifest read each; asked before an overwrite only)."""
    parent, name = path.rstrip("/").rsplit("/", 1)
    out = []
    for step, folder in _commit.committed_folders(storage, parent).items():
        if folder == name or folder != str(step):
            continue
        try:
            meta = _format.read_metadata(storage, f"{parent}/{folder}", check_references=False)
        except (CheckpointError, OSError):
            continue
        if name in meta.referenced_folders:
            out.append(folder)
    return out
