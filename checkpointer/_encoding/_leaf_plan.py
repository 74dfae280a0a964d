"""Restore planning (pure): which stored bytes each target shard box needs, and where they go.

Given the saved chunk grid of each leaf and the boxes the target sharding puts on this
process's devices (`_targets.resolve_tree`), the planner lists, per *unique* target box,
the chunks (zarr shard files) it intersects and, per chunk, a `ChunkRead` the reader runs
as it stands: the file and its expected size, the byte range of its shard index, the
index entries (inner chunks) to read, and for each the part of the inner chunk to copy
and where in the box's buffer it goes. Like DCP's `ReadItem`, a read names both
coordinate systems: storage (file, index range, inner chunk ids and lengths) and
destination (offsets in the box). A box held by several local devices is read once and
placed on each; a box larger than the host-memory bound is planned as slabs.

The inner chunks' own offsets in the file are not in the plan: zarr lets a writer place
them anywhere, so the reader takes them from the index it reads (one range per chunk),
checks each entry against the plan's expected length and file bounds, and coalesces
inner chunks adjacent in the file into one read. No device work and no I/O here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from jax.sharding import PartitionSpec

from .. import _format
from .._errors import leaf_name
from .._format import ArrayMetadata, Box, cell_box, grid_cells, row_slabs


@dataclasses.dataclass(frozen=True)
class ChunkRead:
    """The part of one stored chunk a target box needs, as the reader executes it.

    Attributes:
      chunk_index: the chunk's cell in the saved chunk grid.
      chunk_key: its key relative to the checkpoint path (a zarr shard file).
      box: the region of the global array read from this chunk (target ∩ chunk).
      inner_chunks: how many inner chunks of the zarr shard file that region touches.
      bytes_read: bytes fetched: those inner chunks with their crc32c, plus the index.
      local_box: `box` in the chunk's own coordinates.
      file_bytes: the size the zarr shard file must have, bytes.
      index_offset: where its shard index (entries and crc32c) starts, bytes.
      index_bytes: the index's length with its crc32c, bytes.
      inner_bytes_with_crc: the stored length every index entry must give, bytes.
      inner_ids: the index entries (C-order inner chunk ids) to read, ascending; the
        k-th is the k-th element of `itertools.product(*spans)`.
      spans: per dimension, per inner chunk index along it that is read,
        `(source start in the inner chunk, destination start in the box buffer,
        length)` in elements; the copy of one inner chunk is the product of one span
        per dimension.
      source: the sibling checkpoint folder the chunk file is read from (a reference
        of an incremental save: `ArrayMetadata.references`), or None: this checkpoint.
    """

    chunk_index: tuple[int, ...]
    chunk_key: str
    box: Box
    inner_chunks: int
    bytes_read: int
    local_box: Box
    file_bytes: int
    index_offset: int
    index_bytes: int
    inner_bytes_with_crc: int
    inner_ids: tuple[int, ...]
    spans: tuple[tuple[tuple[int, int, int], ...], ...]
    source: str | None = None


@dataclasses.dataclass(frozen=True)
class PackedRead:
    """The part of one packed chunk (`_pack`) a target box needs: a byte range of a pack.

    Usually the whole chunk's bytes are read (its crc32c covers them all; packed chunks
    are small by definition), then `box` is copied out of them. In a cooperative plan a
    chunk that several processes need may be split among them (`SharedChunk`): each
    reads only its piece, a contiguous part of the chunk's bytes, whose crc32c is checked
    with the others' after the exchange (`crc32c` None).

    Attributes:
      key: the pack's chunk file, relative to the checkpoint path.
      file_bytes: the size that file must have, bytes.
      offset: where the bytes read start in the file, bytes.
      nbytes: their length, bytes.
      crc32c: their crc32c (from the manifest); None for a piece of a shared chunk.
      chunk_box: the region of the global array the bytes read hold (C order): the
        chunk's, or the piece's.
      box: the region read from it (target ∩ chunk_box).
      local_box: `box` in `chunk_box`'s own coordinates.
      dest: `box`'s origin relative to the destination box (or slab).
    """

    key: str
    file_bytes: int
    offset: int
    nbytes: int
    crc32c: int | None
    chunk_box: Box
    box: Box
    local_box: Box
    dest: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SharedChunk:
    """A stored chunk whose bytes several processes read in pieces (a cooperative plan):
    no process holds all of them, so its crc32c is checked after the exchange, from every
    piece's crc32c (`_crc.combine`), on every process alike.

    Attributes:
      key: the file, relative to the checkpoint path.
      offset: where the chunk's bytes start in it, bytes.
      nbytes: their length, bytes.
      crc32c: their crc32c (from the manifest).
      pieces: `(offset in the file, bytes, reader)` of each piece, ascending and
        back to back; `reader` is the process whose crc32c of the piece counts (the
        lowest of those that read it).
    """

    key: str
    offset: int
    nbytes: int
    crc32c: int
    pieces: tuple[tuple[int, int, int], ...]


@dataclasses.dataclass(frozen=True)
class PackRun:
    """One read of a pack file that covers several packed chunks (neighbours coalesced).

    Attributes:
      key: the pack's chunk file, relative to the checkpoint path.
      offset: the first byte read.
      nbytes: bytes read (gaps between the chunks included).
      boxes: the distinct packed byte ranges in it, `(offset, nbytes, crc32c, leaf
        path)`, ascending; crc32c None for a piece of a shared chunk.
    """

    key: str
    offset: int
    nbytes: int
    boxes: tuple[tuple[int, int, int | None, str], ...]


# Neighbouring packed chunks are read in one run across gaps up to this size, and a run
# is cut once it exceeds `_PACK_RUN_BYTES`.
PACK_GAP_BYTES = 64 << 10
_PACK_RUN_BYTES = 16 << 20


def coalesce_packed(reads: Iterable[tuple[str, PackedRead]]) -> tuple[PackRun, ...]:
    """Groups packed chunk reads into runs of neighbouring byte ranges.

    Args:
      reads: `(leaf path, PackedRead)` pairs; a chunk needed by several target boxes
        is read once.
    Returns:
      Per pack file, ascending, runs covering every distinct chunk once: a chunk joins
      the previous run when the gap is at most `PACK_GAP_BYTES` and the run stays
      within 16 MiB (a larger chunk is a run of its own).
    """
    # Sorted by file and offset only: a piece's crc32c is None.
    distinct = sorted({(r.key, r.offset, r.nbytes, r.crc32c, leaf) for leaf, r in reads}, key=lambda d: (d[0], d[1], d[2], d[4]))
    runs: list[PackRun] = []
    cur: list[tuple[int, int, int | None, str]] = []
    key, start, end = "", 0, 0
    for k, off, n, crc, leaf in distinct:
        if cur and k == key and off - end <= PACK_GAP_BYTES and off + n - start <= _PACK_RUN_BYTES:
            cur.append((off, n, crc, leaf))
            end = max(end, off + n)
            continue
        if cur:
            runs.append(PackRun(key, start, end - start, tuple(cur)))
        cur, key, start, end = [(off, n, crc, leaf)], k, off, off + n
    if cur:
        runs.append(PackRun(key, start, end - start, tuple(cur)))
    return tuple(runs)


@dataclasses.dataclass(frozen=True)
class BoxRead:
    """One unique target box of one leaf on this process.

    Attributes:
      box: the region of the global array (a target shard).
      device_ids: the local devices that hold it.
      reads: the chunk reads that assemble it (destinations relative to `box`).
      bytes_needed: bytes of the box itself.
      slabs: when the box is larger than the host-memory bound it was planned with,
        the slabs it is read in (consecutive along the first dimension, each with its
        own reads, destinations relative to the slab); empty: read the box whole.
      receivers: in a cooperative plan, the other processes that need (part of) this
        box and get it from this process through the exchange; () otherwise.
      packed: for a packed leaf (`_pack`), the packed chunks that assemble the box
        (then `reads` is empty; packed boxes are never split into slabs).
    """

    box: Box
    device_ids: tuple[int, ...]
    reads: tuple[ChunkRead, ...]
    bytes_needed: int
    slabs: tuple[BoxRead, ...] = ()
    receivers: tuple[int, ...] = ()
    packed: tuple[PackedRead, ...] = ()

    @property
    def bytes_read(self) -> int:
        """Bytes fetched for this box (through its slabs when it has them); a packed
        chunk counts in full for each box that needs it (`LeafRestorePlan.bytes_read`
        counts it once, as it is read)."""
        if self.slabs:
            return sum(s.bytes_read for s in self.slabs)
        return sum(r.bytes_read for r in self.reads) + sum(p.nbytes for p in self.packed)


@dataclasses.dataclass(frozen=True)
class PeerPiece:
    """A region this process needs and another process reads from storage (cooperative plan).

    Attributes:
      box: the region of the global array (inside one of this process's target boxes).
      reader: the process that reads it from storage (the lowest, if several do).
    """

    box: Box
    reader: int


@dataclasses.dataclass(frozen=True)
class LeafRestorePlan:
    """The reads of one array leaf.

    Attributes:
      leaf_path: the leaf path (escaped storage name; `name` is what people read).
      keystr: the leaf's key string as saved (`ArrayMetadata.keystr`; None in old manifests).
      shape: the global shape (of the stored array; PRNG key data included).
      dtype: the stored dtype.
      boxes: what this process reads from storage: one entry per unique target box
        of its devices, or, in a cooperative plan, per unique exchange box.
      exchange_spec: None: no exchange, `boxes` are the target boxes. Else the
        PartitionSpec (over the target's mesh, for `shape`) of the exchange layout
        the read boxes form; the executor reshards it onto the target.
      target_boxes: in a cooperative plan, this process's unique target boxes.
      received: in a cooperative plan, the regions of `target_boxes` other processes
        read and this process receives from them.
      shared: in a cooperative plan, the leaf's chunks that processes read in pieces
        (`SharedChunk`), all of them, the same on every process; checked after the
        exchange.
    """

    leaf_path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    boxes: tuple[BoxRead, ...]
    exchange_spec: PartitionSpec | None = None
    target_boxes: tuple[Box, ...] = ()
    received: tuple[PeerPiece, ...] = ()
    shared: tuple[SharedChunk, ...] = ()
    keystr: str | None = None

    @property
    def name(self) -> str:
        """The leaf's name for people: its key string as `jax.tree_util.keystr` writes it
        for the saved tree (`_errors.leaf_name`; `<root>` for a root leaf)."""
        return leaf_name(self.leaf_path, self.keystr)

    @property
    def bytes_needed(self) -> int:
        """Bytes of this process's unique target boxes."""
        if self.exchange_spec is not None:
            return sum(b.size for b in self.target_boxes) * self.dtype.itemsize
        return sum(b.bytes_needed for b in self.boxes)

    @property
    def bytes_read(self) -> int:
        """Bytes this process fetches from storage for the leaf: a packed chunk that
        several boxes need counts once, and so do a zarr shard file's index and an inner
        chunk that several boxes (not read in slabs) need, as the reader fetches them
        (`_read.read_boxes`: the boxes of a leaf that fit in a third of
        `max_inflight_bytes` together are read together; a leaf whose boxes do not is
        read in batches, each fetching a shared index or inner chunk again)."""
        packed = {(p.key, p.offset): p.nbytes for b in self.boxes for p in b.packed}
        return sum(self.zarr_bytes_read_by_source.values()) + sum(packed.values())

    @property
    def zarr_bytes_read_by_source(self) -> dict[str | None, int]:
        """Bytes of zarr shard files fetched for the leaf, per checkpoint they are read
        from (`ChunkRead.source`), each index and inner chunk counted as `bytes_read` says."""
        together: dict[tuple[str | None, str, int], int] = {}
        out: dict[str | None, int] = {}
        for b in self.boxes:
            for s in b.slabs:
                for r in s.reads:
                    out[r.source] = out.get(r.source, 0) + r.bytes_read
            if not b.slabs:
                for r in b.reads:
                    together[r.source, r.chunk_key, -1] = r.index_bytes
                    together.update(((r.source, r.chunk_key, i), r.inner_bytes_with_crc) for i in r.inner_ids)
        for (source, _, _), n in together.items():
            out[source] = out.get(source, 0) + n
        return out

    @property
    def bytes_received(self) -> int:
        """Bytes of the leaf this process receives from peers (0 without an exchange)."""
        return sum(p.box.size for p in self.received) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What one process reads to restore a checkpoint onto a target.

    Attributes:
      path: the checkpoint path.
      process_index: the process the plan is for.
      leaves: one plan per array leaf that is read.
    """

    path: str
    process_index: int
    leaves: tuple[LeafRestorePlan, ...]

    @property
    def reads(self) -> tuple[ChunkRead, ...]:
        """Every chunk read, all leaves and boxes."""
        return tuple(r for leaf in self.leaves for b in leaf.boxes for r in b.reads)

    @property
    def bytes_needed(self) -> int:
        """Bytes of the unique target boxes of this process."""
        return sum(leaf.bytes_needed for leaf in self.leaves)

    @property
    def bytes_read(self) -> int:
        """Bytes the reads fetch from storage, index reads included."""
        return sum(leaf.bytes_read for leaf in self.leaves)

    @property
    def bytes_received(self) -> int:
        """Bytes this process receives from peers instead of reading them (cooperative plan)."""
        return sum(leaf.bytes_received for leaf in self.leaves)

    @property
    def pack_runs(self) -> tuple[PackRun, ...]:
        """The reads of every packed chunk of the plan, neighbours coalesced (`coalesce_packed`)."""
        return coalesce_packed((leaf.leaf_path, p) for leaf in self.leaves for b in leaf.boxes for p in b.packed)

    @property
    def cooperative(self) -> bool:
        """Whether some leaf is read cooperatively (its restore is collective)."""
        return any(leaf.exchange_spec is not None for leaf in self.leaves)

    @property
    def read_amplification(self) -> float:
        """`bytes_read / bytes_needed` (1.0 when nothing is needed); below 1 when peers
        supply part of it (`bytes_received`)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0

    @property
    def bytes_read_by_source(self) -> dict[str | None, int]:
        """Bytes read per checkpoint: None for this one, a sibling folder name for the
        chunks an incremental save references (`ChunkRead.source`) and for the packed
        chunks it references in a sibling's pack (`_format.split_pack_key`)."""
        out: dict[str | None, int] = {}
        for leaf in self.leaves:
            for source, n in leaf.zarr_bytes_read_by_source.items():
                out[source] = out.get(source, 0) + n
            packed = {(p.key, p.offset): p.nbytes for b in leaf.boxes for p in b.packed}  # each once, as `bytes_read`
            for (key, _), n in packed.items():
                source = _format.split_pack_key(key)[0]
                out[source] = out.get(source, 0) + n
        return out

    def __repr__(self) -> str:
        """A summary naming the leaves by key string (the whole plan lists every chunk read)."""
        names = [leaf.name for leaf in self.leaves]
        shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
        return (f"<RestorePlan for {self.path} (process {self.process_index}): {len(self.leaves)} leaves ({shown}), "
                f"{len(self.reads)} chunk reads, {self.bytes_read} bytes read>")

    def __str__(self) -> str:
        # The "received" column (bytes from peers) only for a cooperative plan.
        coop = self.cooperative
        rows = [("leaf", "shape", "dtype", "boxes", "chunks", "needed", "read") + (("received",) if coop else ()) + ("ampl.",)]
        for leaf in self.leaves:
            chunks = sum(len(b.reads) + len(b.packed) for b in leaf.boxes)
            amp = leaf.bytes_read / leaf.bytes_needed if leaf.bytes_needed else 1.0
            received = (_format.format_bytes(leaf.bytes_received),) if coop else ()
            rows.append((leaf.name, "x".join(map(str, leaf.shape)) or "()", str(leaf.dtype), str(len(leaf.boxes)),
                         str(chunks), _format.format_bytes(leaf.bytes_needed), _format.format_bytes(leaf.bytes_read))
                        + received + (f"{amp:.3f}",))
        received = (_format.format_bytes(self.bytes_received),) if coop else ()
        rows.append(("total", "", "", "", str(len(self.reads) + sum(len(b.packed) for leaf in self.leaves for b in leaf.boxes)), _format.format_bytes(self.bytes_needed), _format.format_bytes(self.bytes_read))
                    + received + (f"{self.read_amplification:.3f}",))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"RestorePlan for {self.path} (process {self.process_index})"]
        for k, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if k == 0 or k == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        by_source = self.bytes_read_by_source
        if any(s is not None for s in by_source):  # an incremental save: where the reads go
            parts = [f"{'this checkpoint' if s is None else _format.source_path(self.path, s)}: {_format.format_bytes(n)}"
                     for s, n in sorted(by_source.items(), key=lambda kv: (kv[0] is not None, kv[0] or ""))]
            lines.append("read from: " + "; ".join(parts))
        return "\n".join(lines)


def _axis_spans(origin: int, size: int, inner: int, box_origin: int) -> tuple[tuple[int, int, int, int], ...]:
    """Along one dimension of a chunk: `(inner chunk index, source start, destination
    start, length)` of each inner chunk that the chunk-local range `[origin, origin +
    size)` touches; destinations are relative to `box_origin` (chunk-local)."""
    out = []
    for cell in range(origin // inner, (origin + size - 1) // inner + 1):
        lo, hi = max(origin, cell * inner), min(origin + size, (cell + 1) * inner)
        out.append((cell, lo - cell * inner, lo - box_origin, hi - lo))
    return tuple(out)


def plan_chunk_read(meta: ArrayMetadata, chunk: tuple[int, ...], region: Box, dest: Box | None = None) -> ChunkRead:
    """The read of `region` (inside chunk `chunk`) from its zarr shard file.

    Args:
      meta: the stored leaf.
      chunk: the chunk's cell in the chunk grid.
      region: the global region to read, inside the chunk.
      dest: the box whose buffer receives it (default: `region` itself).
    """
    layout = meta.layout
    dest = region if dest is None else dest
    chunk_origin = tuple(c * s for c, s in zip(chunk, meta.chunk_shape))
    local = Box(tuple(o - c for o, c in zip(region.origin, chunk_origin)), region.shape)
    dest_local = tuple(d - c for d, c in zip(dest.origin, chunk_origin))
    per_dim = [_axis_spans(o, n, i, d) for o, n, i, d in zip(local.origin, local.shape, meta.inner_chunk_shape, dest_local)]
    grid = layout.inner_grid
    # C-order ids of the product of the per-dimension inner chunk indices.
    ids = [0]
    for spans, n in zip(per_dim, grid):
        ids = [i * n + s[0] for i in ids for s in spans]
    inner = len(ids)
    return ChunkRead(
        chunk, _format.chunk_key(meta.path, chunk), region, inner,
        inner * layout.inner_bytes_with_crc + layout.index_bytes,
        local_box=local, file_bytes=layout.file_bytes, index_offset=layout.index_offset, index_bytes=layout.index_bytes,
        inner_bytes_with_crc=layout.inner_bytes_with_crc, inner_ids=tuple(ids),
        spans=tuple(tuple(s[1:] for s in spans) for spans in per_dim), source=meta.source_of(chunk),
    )


def _plan_box(meta: ArrayMetadata, box: Box) -> tuple[ChunkRead, ...]:
    reads = []
    for chunk in grid_cells(box, meta.chunk_shape):
        region = box.intersect(cell_box(chunk, meta.chunk_shape, meta.shape))
        if region is not None:
            reads.append(plan_chunk_read(meta, chunk, region, box))
    return tuple(reads)


def _slabs(meta: ArrayMetadata, box: Box, device_ids: tuple[int, ...], slab_bytes: int) -> tuple[BoxRead, ...]:
    """Splits a box larger than `slab_bytes` into slabs along its first dimension,
    each planned like a box of its own; () when the box fits or cannot be split."""
    itemsize = meta.dtype.itemsize
    if box.size * itemsize <= slab_bytes or not box.shape or box.shape[0] <= 1:
        return ()
    return tuple(
        BoxRead(slab, device_ids, _plan_box(meta, slab), slab.size * itemsize) for slab in row_slabs(box, itemsize, slab_bytes)
    )


def plan_array_leaf(
    meta: ArrayMetadata, by_box: Mapping[Box, Sequence[int]], *, slab_bytes: int | None = None
) -> LeafRestorePlan:
    """Plans the reads of a leaf stored as its own zarr array (`plan_leaf`'s, for that encoding).

    Args:
      meta: the stored leaf (shape, dtype, chunk and inner chunk shapes).
      by_box: each unique target box → the devices that hold it.
      slab_bytes: host-memory bound of one read, bytes: a box larger than it is also
        planned as slabs (`BoxRead.slabs`). None: no slabs.
    Returns:
      One `BoxRead` per unique box, in box order.
    """
    boxes = []
    itemsize = meta.dtype.itemsize
    for box in sorted(by_box):
        ids = tuple(sorted(by_box[box]))
        slabs = _slabs(meta, box, ids, slab_bytes) if slab_bytes is not None else ()
        boxes.append(BoxRead(box, ids, _plan_box(meta, box), box.size * itemsize, slabs))
    return LeafRestorePlan(meta.path, meta.shape, meta.dtype, tuple(boxes), keystr=meta.keystr)


def by_box(device_boxes: Mapping[int, Box] | Iterable[tuple[int, Box]]) -> dict[Box, list[int]]:
    """`(device id, box)` pairs grouped: each unique box → its devices."""
    items = device_boxes.items() if isinstance(device_boxes, Mapping) else device_boxes
    out: dict[Box, list[int]] = {}
    for device_id, box in items:
        out.setdefault(box, []).append(device_id)
    return out
