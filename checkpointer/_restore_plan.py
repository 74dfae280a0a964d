"""Restore planning (pure): which stored bytes each target shard box needs.

Given the saved chunk grid of each leaf and the boxes the target sharding puts on this
process's devices, the planner lists, per *unique* target box, the chunks (zarr shard
files) it intersects, the inner chunks it needs inside each and the bytes that costs,
including each zarr shard file's index. A box held by several local devices is read
once and placed on each. No device work and no I/O: tests build inputs by hand.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from . import _format
from ._box import Box, cell_box, grid_cells
from ._format import ArrayMetadata


@dataclasses.dataclass(frozen=True)
class ChunkRead:
    """The part of one stored chunk a target box needs.

    Attributes:
      chunk_index: the chunk's cell in the saved chunk grid.
      chunk_key: its key relative to the checkpoint path (a zarr shard file).
      box: the region of the global array read from this chunk (target ∩ chunk).
      inner_chunks: how many inner chunks of the zarr shard file that region touches.
      bytes_read: bytes fetched: those inner chunks with their crc32c, plus the index.
    """

    chunk_index: tuple[int, ...]
    chunk_key: str
    box: Box
    inner_chunks: int
    bytes_read: int


@dataclasses.dataclass(frozen=True)
class BoxRead:
    """One unique target box of one leaf on this process.

    Attributes:
      box: the region of the global array (a target shard).
      device_ids: the local devices that hold it.
      reads: the chunk reads that assemble it.
      bytes_needed: bytes of the box itself.
    """

    box: Box
    device_ids: tuple[int, ...]
    reads: tuple[ChunkRead, ...]
    bytes_needed: int

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.reads)


@dataclasses.dataclass(frozen=True)
class LeafRestorePlan:
    """The reads of one array leaf.

    Attributes:
      leaf_path: the leaf path.
      shape: the global shape.
      dtype: the stored dtype.
      boxes: one entry per unique target box of this process.
    """

    leaf_path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    boxes: tuple[BoxRead, ...]

    @property
    def bytes_needed(self) -> int:
        return sum(b.bytes_needed for b in self.boxes)

    @property
    def bytes_read(self) -> int:
        return sum(b.bytes_read for b in self.boxes)


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
    def read_amplification(self) -> float:
        """`bytes_read / bytes_needed` (1.0 when nothing is needed)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0

    def __str__(self) -> str:
        rows = [("leaf", "shape", "dtype", "boxes", "chunks", "needed", "read", "ampl.")]
        for leaf in self.leaves:
            chunks = sum(len(b.reads) for b in leaf.boxes)
            amp = leaf.bytes_read / leaf.bytes_needed if leaf.bytes_needed else 1.0
            rows.append((leaf.leaf_path or "<root>", "x".join(map(str, leaf.shape)) or "()", str(leaf.dtype), str(len(leaf.boxes)),
                         str(chunks), _fmt_bytes(leaf.bytes_needed), _fmt_bytes(leaf.bytes_read), f"{amp:.3f}"))
        rows.append(("total", "", "", "", str(len(self.reads)), _fmt_bytes(self.bytes_needed), _fmt_bytes(self.bytes_read),
                     f"{self.read_amplification:.3f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"RestorePlan for {self.path} (process {self.process_index})"]
        for k, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if k == 0 or k == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def plan_chunk_read(meta: ArrayMetadata, chunk: tuple[int, ...], region: Box) -> ChunkRead:
    """The read of `region` (inside chunk `chunk`) from its zarr shard file."""
    chunk_origin = tuple(c * s for c, s in zip(chunk, meta.chunk_shape))
    local = Box(tuple(o - c for o, c in zip(region.origin, chunk_origin)), region.shape)
    inner = sum(1 for _ in grid_cells(local, meta.inner_chunk_shape))
    n_inner = math.prod(c // i for c, i in zip(meta.chunk_shape, meta.inner_chunk_shape))
    inner_bytes = math.prod(meta.inner_chunk_shape) * meta.dtype.itemsize
    return ChunkRead(chunk, _format.chunk_key(meta.path, chunk), region, inner, inner * (inner_bytes + 4) + n_inner * 16 + 4)


def plan_leaf(meta: ArrayMetadata, device_boxes: Mapping[int, Box] | Sequence[tuple[int, Box]]) -> LeafRestorePlan:
    """Plans the reads of one leaf for this process's devices.

    Args:
      meta: the stored leaf (shape, dtype, chunk and inner chunk shapes).
      device_boxes: `(device_id, target box)` pairs of this process's devices.
    Returns:
      One `BoxRead` per unique box, in box order.
    """
    items = device_boxes.items() if isinstance(device_boxes, Mapping) else device_boxes
    by_box: dict[Box, list[int]] = {}
    for device_id, box in items:
        by_box.setdefault(box, []).append(device_id)
    boxes = []
    itemsize = meta.dtype.itemsize
    for box in sorted(by_box):
        reads = []
        for chunk in grid_cells(box, meta.chunk_shape):
            region = box.intersect(cell_box(chunk, meta.chunk_shape, meta.shape))
            if region is not None:
                reads.append(plan_chunk_read(meta, chunk, region))
        boxes.append(BoxRead(box, tuple(sorted(by_box[box])), tuple(reads), box.size * itemsize))
    return LeafRestorePlan(meta.path, meta.shape, meta.dtype, tuple(boxes))
