"""Leaf-by-leaf save from one process, for trees that never sit in memory whole.

`save` snapshots a whole tree to host memory before writing; converters (`import_orbax`)
have arrays that live elsewhere (another checkpoint format) and must not. This writer
takes a tree whose array leaves are `ArraySource`s, reads one chunk of one leaf at a
time through its `read` callback, writes it as a zarr shard file, checksums it and
drops it, then commits with the same protocol as `save` (partial folder, process
record, manifest, marker, rename). Host memory stays within about one source read
plus one encoded chunk (at most `MAX_CHUNK_BYTES`), whatever the tree's size.

The checkpoint it writes is an ordinary format_version 1 checkpoint: each leaf's chunk
grid is its `shard_shape` (the saved shard shape, as `save` uses), subdivided along
small prime factors until a chunk holds at most `MAX_CHUNK_BYTES` (a regular
subdivision, as replica-parallel saves use), so restore plans read it like any other.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import TypeGuard

import numpy as np

from .. import _commit, _coord, _encoding, _format
from .._errors import SaveError, UnsupportedValueError, where
from .._format import (
    ArrayMetadata,
    Box,
    ChunkRecord,
    ProcessRecord,
    SavedSharding,
    cell_box,
    describe,
    flatten,
    grid_cells,
    metadata_json,
    write_group_nodes,
)
from .._storage import storage_for
from . import _pipeline
from ._leaves import check_storable
from ._plan import LeafWritePlan, chunk_shape_for

log = logging.getLogger("checkpointer")

# Reads one region of an array leaf: `read(box)` returns a numpy array of `box.shape`
# (and the leaf's dtype) holding the leaf's values in `box`.
RegionReader = Callable[[Box], np.ndarray]
ProgressCallback = Callable[[str, int], None]

# Largest chunk (zarr shard file) the writer produces, bytes: bounds the encoded copy
# TensorStore holds while writing one chunk.
MAX_CHUNK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class ArraySource:
    """An array leaf whose data is read on demand.

    Attributes:
      shape: the global shape.
      dtype: the numpy dtype stored.
      shard_shape: the saved shard shape (the chunk grid before subdivision); the
        whole shape for an unsharded array.
      saved_sharding: how it was sharded, for the manifest (None: a host array).
      kind: `"jax"` or `"numpy"` (what it was when saved).
      read: returns the region `box` of the array as a numpy array of `box.shape`
        (a `RegionReader`).
      key_impl: the PRNG impl name (e.g. `"threefry2x32"`) when the array is the key
        data of a typed PRNG key array (restored as typed keys), else None.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    shard_shape: tuple[int, ...]
    saved_sharding: SavedSharding | None
    kind: str
    read: RegionReader
    key_impl: str | None = None


def _is_source(x: object) -> TypeGuard[ArraySource]:
    return isinstance(x, ArraySource)


def chunk_shape_of(shape: tuple[int, ...], shard_shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The chunk shape: the shard shape, subdivided to at most `MAX_CHUNK_BYTES` where
    its dimensions have small prime factors (see `_format.inner_chunk_shape`)."""
    chunk = chunk_shape_for(shape, shard_shape)
    return _format.inner_chunk_shape(chunk, itemsize, MAX_CHUNK_BYTES) if chunk else chunk


def save_leaf_by_leaf(
    path: str | os.PathLike,
    tree: object,
    *,
    metadata: Mapping | None = None,
    step: int | None = None,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
) -> None:
    """Saves `tree`, whose array leaves are `ArraySource`s, one chunk at a time.

    Args:
      path: the checkpoint path (local or kvstore URL).
      tree: a pytree of `ArraySource`s and non-array leaves (None, bool, int, float,
        complex, str, numpy scalars).
      metadata: stored as `user_metadata` (the rule of `ckpt.save(metadata=)`).
      step: recorded as the step.
      overwrite: replace a committed checkpoint at `path`.
      progress: called as `progress(leaf_path, bytes_written)` after each chunk.
    Raises:
      CheckpointExistsError: `path` is committed and `overwrite` is False, or holds
        other files.
      UnsupportedValueError: a leaf the format cannot hold (names it).
      SaveError: writing failed; nothing was committed.

    Multi-process: single-process only (raises `SaveError` under `jax.distributed` with
    several processes); run converters in one process.
    """
    if _coord.process_count() != 1:
        raise SaveError(f"saving {path} leaf by leaf runs in one process; this job has "
                        f"{_coord.process_count()} processes. Run the conversion as a single-process program")
    storage, path = storage_for(path)
    _pipeline.check_target(storage, path, 0, overwrite)
    user_metadata = metadata_json(metadata, path)
    arrays: list[tuple[_pipeline.LeafSnapshot, ArraySource]] = []
    values: dict[str, dict] = {}
    for leaf_path, leaf in flatten(tree, is_leaf=lambda x: x is None or _is_source(x)):
        if _is_source(leaf):
            dtype = np.dtype(leaf.dtype)
            check_storable(leaf_path, dtype, path)
            chunk = chunk_shape_of(tuple(leaf.shape), tuple(leaf.shard_shape), dtype.itemsize)
            inner = _format.inner_chunk_shape(chunk, dtype.itemsize) if chunk else ()
            n_chunks = math.prod(-(-s // c) for s, c in zip(leaf.shape, chunk)) if chunk else 1
            if n_chunks > _format.MAX_CHUNKS_PER_LEAF:
                raise UnsupportedValueError(
                    f"{where(leaf=leaf_path, path=path)}: shard shape {leaf.shard_shape} of shape {leaf.shape} makes "
                    f"{n_chunks} chunks, more than {_format.MAX_CHUNKS_PER_LEAF}; resave it with fewer, larger shards"
                )
            meta = ArrayMetadata(leaf_path, tuple(leaf.shape), dtype, chunk, inner, leaf.saved_sharding, leaf.key_impl, leaf.kind)
            plan = LeafWritePlan(leaf_path, tuple(leaf.shape), chunk, inner, ())
            arrays.append((_pipeline.LeafSnapshot(meta, plan, []), leaf))
            continue
        value = _format.value_to_json(leaf)
        if value is None:
            raise UnsupportedValueError(
                f"{where(leaf=leaf_path, path=path)}: a leaf of type {type(leaf).__qualname__} cannot be stored; "
                "leaves must be ArraySource, None, bool, int, float, complex, str or numpy scalars (nothing is pickled)"
            )
        values[leaf_path] = value
    _commit.strategy_for(storage).prepare_overwrite(path)
    snap = _pipeline.Snapshot(
        storage=storage, path=path, generation=_format.new_generation(), process_index=0, process_count=1,
        structure=describe(tree, _is_source), arrays=[leaf for leaf, _ in arrays], values=values,
        user_metadata=user_metadata, step=step, overwrite=overwrite, commit_timeout_s=_coord.DEFAULT_COMMIT_TIMEOUT_S,
    )
    # The save's own protocol (commit, abort and clean-up), with this writer.
    _pipeline.run_background(snap, write=lambda s: _write(s, arrays, progress))


def _write(
    snap: _pipeline.Snapshot, arrays: list[tuple[_pipeline.LeafSnapshot, ArraySource]], progress: ProgressCallback | None
) -> ProcessRecord:
    """Writes every chunk, one at a time, and `processes/0.json`; returns the record."""
    t0 = time.perf_counter()
    root = snap.write_path
    try:
        _pipeline.begin_write(snap)
        write_group_nodes(snap.storage, root, snap.structure, [leaf.meta.path for leaf, _ in arrays])
        chunks: list[ChunkRecord] = []
        for leaf, source in arrays:
            chunks += _write_leaf(snap, leaf.meta, source, progress)
        snap.result.write_s = time.perf_counter() - t0
        return _pipeline.write_record(snap, chunks)
    except (SaveError, UnsupportedValueError):
        raise
    except Exception as e:
        raise SaveError(f"writing {root} failed: {type(e).__name__}: {e}") from e


def _write_leaf(
    snap: _pipeline.Snapshot, meta: ArrayMetadata, source: ArraySource, progress: ProgressCallback | None
) -> list[ChunkRecord]:
    root = snap.write_path
    try:
        store = _pipeline.open_for_write(snap, meta, create=True).result()
    except Exception as e:
        raise SaveError(f"{where(leaf=meta.path, keystr=meta.keystr, path=root)}: cannot create the zarr array: {e}") from e
    out: list[ChunkRecord] = []
    if 0 in meta.shape:
        return out
    encoded = meta.layout.file_bytes
    for cell in grid_cells(Box.whole(meta.shape), meta.chunk_shape):
        box = cell_box(cell, meta.chunk_shape, meta.shape)
        data = np.asarray(source.read(box))
        if data.shape != box.shape or data.dtype != meta.dtype:
            raise SaveError(
                f"{where(leaf=meta.path, keystr=meta.keystr, path=root)}: the source returned {data.shape} {data.dtype} for the region "
                f"{box}, expected {box.shape} {meta.dtype}"
            )
        try:
            # The source array is not touched again: TensorStore may encode from it
            # without a copy of its own (one chunk less of host memory).
            store[box.slices()].write(data, can_reference_source_data_indefinitely=True).result()
        except Exception as e:
            raise SaveError(f"{where(leaf=meta.path, keystr=meta.keystr, path=root)}: writing chunk {cell} failed: {e}") from e
        out.append(_encoding.chunk_record(meta, cell, box, data))
        del data
        if progress is not None:
            progress(meta.path, encoded)
    return out
