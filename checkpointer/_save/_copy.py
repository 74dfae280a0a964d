"""The snapshot's one copy of every chunk a process writes, and the leaves that hold it.

Where each chunk's bytes go (`copy_leaves`):
- a leaf of its own zarr array whose shards are read in place, saved to local files:
  straight into its shard files (`_encoding.fill_images`);
- the chunks of packed leaves, when every one of them is read in place: back to back
  into one buffer laid out as this process's pack (`_encoding.PackSlab`), which the pack
  writer then writes as it is;
- every other chunk: a host array of its box (`_memory.snapshot_to_host`: a pool buffer,
  or the accelerator routes' own host copy).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import _encoding, _format, _memory
from .._format import ArrayMetadata
from .._memory import POOL, HostBufferPool, snapshot_to_host
from .._storage import LocalStorage, Storage
from ._options import SaveOptions
from ._plan import LeafWritePlan

IMAGE = "shard_file"  # `copy_route_bytes`: copied straight into shard files (`_encoding.fill_images`)


@dataclasses.dataclass(frozen=True)
class LeafSnapshot:
    """One array leaf's plan, metadata and this process's host copies (one per write).

    `host` is the one list a snapshot changes after it is taken: `release_host` empties
    it once the bytes are durable (the buffers go back to the pool or are freed)."""

    meta: ArrayMetadata
    plan: LeafWritePlan
    host: list[np.ndarray | _encoding.ShardImage]  # per write: a host array of its box, or its shard file
    pooled: tuple[bool, ...] = ()  # per host copy: a buffer of `Snapshot.buffers`
    # Incremental saves: every chunk unchanged by identity (`_incremental`), nothing copied.
    references: tuple[_format.ChunkRef, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Copies:
    """What `copy_leaves` made.

    Attributes:
      leaves: every array leaf with its host copies.
      copied_bytes: bytes copied to host memory, each saved byte once.
      route_bytes: those bytes by route (`IMAGE`, and `_memory`'s routes).
      pack_slab: the packed chunks' buffer (`_encoding.PackSlab`), or None.
      pack_slab_pooled: whether its buffer came from the snapshot's pool.
    """

    leaves: list[LeafSnapshot]
    copied_bytes: int
    route_bytes: dict[str, int]
    pack_slab: _encoding.PackSlab | None = None
    pack_slab_pooled: bool = False


def as_images(storage: Storage, options: SaveOptions, meta: ArrayMetadata, datas: list) -> bool:
    """Whether the snapshot copies this leaf's chunks straight into their shard files
    (`_encoding.fill_images`): local files the direct writer may write (or, where the
    file system refuses `O_DIRECT`, written through the page cache), a dtype it lays out,
    a leaf of its own zarr array, every shard read in place (`_memory.reads_in_place`)."""
    return (
        isinstance(storage, LocalStorage) and options.direct_io is not False and not meta.packed
        and _encoding.direct_supported(meta.dtype) and any(np.prod(d.shape) for d in datas)
        and all(_memory.reads_in_place(d) for d in datas)
    )


def _all_in_place(datas: list) -> bool:
    """`_memory.reads_in_place` of every one of `datas`, asked once per sharding."""
    seen: dict = {}
    for d in datas:
        if isinstance(d, np.ndarray):
            continue
        key = d.sharding
        known = seen.get(key)
        if known is None:
            known = seen[key] = _memory.reads_in_place(d)
        if not known:
            return False
    return True


def copy_leaves(
    storage: Storage, options: SaveOptions, planned: list[tuple[ArrayMetadata, LeafWritePlan]], device_data: list[list],
    buffers: HostBufferPool | None,
) -> Copies:
    """The snapshot's one copy of every chunk this process writes (module docstring):
    each chunk of `device_data[i]` (leaf i's planned writes, in order) into its shard
    file, the pack slab or a host array of its box."""
    hosts: list[list] = [[None] * len(datas) for datas in device_data]
    pooled: list[list[bool]] = [[False] * len(datas) for datas in device_data]
    images: list[tuple[int, int]] = []  # (leaf, chunk) copied into shard files
    packed: list[tuple[int, int]] = []  # (leaf, chunk) of packed leaves
    boxes: list[tuple[int, int]] = []  # the others
    for i, ((meta, _), datas) in enumerate(zip(planned, device_data)):
        if not datas:
            continue
        if meta.packed:
            if len(datas) == 1:
                packed.append((i, 0))
            else:
                packed += [(i, j) for j in range(len(datas))]
            continue
        as_image = as_images(storage, options, meta, datas)
        for j, d in enumerate(datas):
            (images if as_image and np.prod(d.shape) else boxes).append((i, j))
    slab_sources = [device_data[i][j] for i, j in packed]
    if _all_in_place(slab_sources):  # views of the shards (CPU) or the numpy leaves themselves
        slab_sources = [np.asarray(d) for d in slab_sources]
    else:  # an accelerator's shards: their own host copies (its routes), packed by the writer
        boxes, packed, slab_sources = boxes + packed, [], []
    slab_bytes = _encoding.pack_buffer_bytes(sum(d.nbytes for d in slab_sources)) if slab_sources else 0
    if buffers is not None and (images or slab_sources):  # the pool's bound: the whole snapshot, shard files and boxes
        buffers.note_snapshot(
            sum(_encoding.image_bytes(planned[i][0].layout, tuple(device_data[i][j].shape)) for i, j in images) + slab_bytes
            + sum(np.dtype(device_data[i][j].dtype).itemsize * int(np.prod(device_data[i][j].shape)) for i, j in boxes)
        )
    copies = snapshot_to_host([device_data[i][j] for i, j in boxes], buffers)
    for (i, j), host, pool_buffer in zip(boxes, copies.arrays, copies.pooled):
        hosts[i][j], pooled[i][j] = host, pool_buffer
    route_bytes = dict(copies.route_bytes)
    take = (lambda n: buffers.take((n,), np.dtype(np.uint8), _memory.PAGE_ALIGN)) if buffers is not None else (
        lambda n: _memory.page_aligned_empty((n,), np.dtype(np.uint8)))
    if images:
        made = _encoding.fill_images([(planned[i][0].layout, np.asarray(device_data[i][j])) for i, j in images], take)
        for (i, j), image in zip(images, made):
            hosts[i][j], pooled[i][j] = image, buffers is not None
        route_bytes[IMAGE] = sum(image.data_bytes for image in made)
    slab = None
    if slab_sources:  # views of the slab: not pool buffers themselves (the slab's buffer is)
        slab = _encoding.PackSlab.fill(slab_sources, take)
        for (i, j), view in zip(packed, slab.views):
            hosts[i][j] = view
        route_bytes[POOL] = route_bytes.get(POOL, 0) + slab.nbytes
    leaves: list[LeafSnapshot] = []
    if planned:
        one = LeafSnapshot(planned[0][0], planned[0][1], [], ())  # copied per leaf: `with_fields`
        leaves = [_format.with_fields(one, meta=meta, plan=plan, host=host, pooled=tuple(p))
                  for (meta, plan), host, p in zip(planned, hosts, pooled)]
    return Copies(leaves, sum(route_bytes.values()), route_bytes, slab, slab is not None and buffers is not None)
