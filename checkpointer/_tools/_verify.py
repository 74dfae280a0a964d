"""`verify`: read every stored byte of a checkpoint and check every checksum."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import crc32c
import tensorstore as ts

from .. import _format
from .._encoding import open_zarr_array
from .._errors import CheckpointError
from .._format import ArrayMetadata, Box, ChunkRecord, PackedBox, cell_box, grid_cells, read_metadata, read_process_record
from .._storage import Storage, storage_for, ts_context


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """The result of `verify`.

    Attributes:
      path: the checkpoint path.
      ok: True when no problem was found.
      problems: one line per problem, each naming the leaf and the chunk key.
      chunks_checked: zarr shard files read.
      bytes_checked: bytes of array data decoded and checksummed.
      elapsed_s: seconds the verification took.
    """

    path: str
    ok: bool
    problems: tuple[str, ...]
    chunks_checked: int
    bytes_checked: int
    elapsed_s: float

    def __str__(self) -> str:
        head = f"{self.path}: {'OK' if self.ok else f'{len(self.problems)} problem(s)'}"
        head += f" ({self.chunks_checked} chunks, {self.bytes_checked / 2**20:.1f} MiB, {self.elapsed_s:.2f} s)"
        return "\n".join([head] + [f"  - {p}" for p in self.problems])


def verify(path: str | os.PathLike, *, progress: Callable[[int, int], object] | None = None) -> VerifyReport:
    """Reads every chunk of the committed checkpoint at `path` and checks it.

    Checks: the manifest parses; every chunk of every array leaf exists and decodes
    (TensorStore checks the `crc32c` of each inner chunk and of each zarr shard file's
    index); the decoded bytes match the `data_crc32c` the writing process recorded in
    `processes/<i>.json`; every chunk was recorded by exactly one process. Packed
    leaves (`_pack`): each pack decodes (its `crc32c` codec) to the bytes its writer
    recorded, and every packed chunk matches the manifest's crc32c (a packed chunk
    counts in `chunks_checked`).

    Args:
      path: a checkpoint path.
      progress: optional callable `progress(done_chunks, total_chunks)`.
    Returns:
      A `VerifyReport` listing every problem found (it does not stop at the first).
    Raises:
      CheckpointNotFoundError: no committed checkpoint at `path`.
      CorruptCheckpointError: the manifest itself is unreadable.

    Multi-process: any process may call it alone; it reads everything.
    """
    t0 = time.perf_counter()
    storage, path = storage_for(path)
    meta = read_metadata(storage, path)
    problems: list[str] = []
    recorded: dict[str, ChunkRecord] = {}
    for name in storage.list_dir(f"{path}/{_format.PROCESSES}"):
        where = f"{path}/{_format.PROCESSES}/{name}"
        try:
            record = read_process_record(storage, where)
        except CheckpointError as e:
            problems.append(f"process record {name} is malformed: {e}")
            continue
        for c in record.chunks:
            if c.key in recorded:
                problems.append(f"chunk {c.key} is recorded by two processes")
            recorded[c.key] = c
    work = []
    packed = [m for m in meta.arrays.values() if m.packed]
    for leaf, m in meta.arrays.items():
        if m.packed:
            continue  # checked pack by pack, below
        for cell in grid_cells(Box.whole(m.shape), m.chunk_shape):
            work.append((leaf, m, cell))
    n_bytes = 0
    total = len(work) + sum(len(m.pack_boxes) for m in packed)  # packed chunks count like any other
    stores: dict[str, ts.TensorStore] = {}
    for i, (leaf, m, cell) in enumerate(work):
        key = _format.chunk_key(leaf, cell)
        try:
            if leaf not in stores:
                stores[leaf] = open_zarr_array(storage, path, m).result()
            box = cell_box(cell, m.chunk_shape, m.shape)
            data = stores[leaf][box.slices()].read().result()
            n_bytes += data.nbytes
            rec = recorded.get(key)
            if rec is None:
                problems.append(f"leaf {leaf!r}: chunk {key} is not in any process record")
            elif rec.data_crc32c != _format.data_crc32c(data):
                problems.append(f"leaf {leaf!r}: chunk {key} decodes to bytes whose crc32c differs from the writer's record")
        except Exception as e:  # every failure is a finding, keep going
            problems.append(f"leaf {leaf!r}: chunk {key}: {str(e).splitlines()[0]}")
        if progress is not None:
            progress(i + 1, total)
    n_packed, packed_bytes = _verify_packs(storage, path, packed, recorded, problems, progress, len(work), total)
    return VerifyReport(path, not problems, tuple(problems), len(work) + n_packed, n_bytes + packed_bytes, time.perf_counter() - t0)


def _verify_packs(storage: Storage, path: str, metas: list[ArrayMetadata], recorded: dict[str, ChunkRecord],
                  problems: list[str], progress: Callable[[int, int], object] | None = None, done: int = 0,
                  total: int = 0) -> tuple[int, int]:
    """Checks the packs of small leaves (`_pack`): each pack file decodes through
    TensorStore (its crc32c codec) to the bytes its writer recorded, and every packed
    chunk's bytes match the manifest's crc32c. Returns (packed chunks, bytes) checked.
    `progress(done + packed chunks checked so far, total)` is called after each pack."""
    by_key: dict[str, list[tuple[str, PackedBox]]] = {}
    for m in metas:
        for b in m.pack_boxes:
            by_key.setdefault(b.key, []).append((m.path, b))
    n_chunks = n_bytes = 0
    for key, boxes in sorted(by_key.items()):
        n_chunks += len(boxes)
        array = key.rsplit("/c/", 1)[0]
        raw: memoryview
        try:
            kvstore = storage.kvstore_spec(f"{path}/{array}")
            store = ts.open({"driver": "zarr3", "kvstore": kvstore, "open": True, "fill_missing_data_reads": False},
                            context=ts_context(), read=True).result()
            data = store.read().result()
            rec = recorded.get(key)
            if rec is None:
                problems.append(f"pack {key} is not in any process record")
            elif rec.data_crc32c != _format.data_crc32c(data):
                problems.append(f"pack {key} decodes to bytes whose crc32c differs from the writer's record")
            raw = data.data
        except Exception as e:  # every failure is a finding; name the damaged leaves from the raw bytes
            problems.append(f"pack {key}: {str(e).splitlines()[0]}")
            try:
                raw = memoryview(storage.read_file(f"{path}/{key}"))
            except OSError as read_error:  # nothing of the pack is checkable: every leaf in it is lost
                for leaf in dict.fromkeys(leaf for leaf, _ in boxes):
                    problems.append(f"leaf {leaf!r}: its packed chunks in {key} cannot be read "
                                    f"({read_error.strerror or read_error})")
                if progress is not None:
                    progress(done + n_chunks, total)
                continue
        for leaf, b in boxes:
            if b.offset + b.nbytes > len(raw) or crc32c.crc32c(raw[b.offset : b.offset + b.nbytes]) != b.crc32c:
                problems.append(f"leaf {leaf!r}: packed chunk at {b.box.origin} (bytes {b.offset}..{b.offset + b.nbytes} "
                                f"of {key}) does not match its crc32c in the manifest")
            else:
                n_bytes += b.nbytes
        if progress is not None:
            progress(done + n_chunks, total)
    return n_chunks, n_bytes
