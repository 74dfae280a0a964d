"""Packed small leaves: one zarr array per process per step holds the chunks of small leaves.

A save of many small leaves (a transformer's norms and biases, times three for AdamW)
used to cost a zarr array per leaf and a zarr shard file per chunk: ~3.5 files and ~2 ms
per leaf, mostly TensorStore's per-key work. Packing writes them as byte ranges of one
file per process instead (issue 15).

Rule (`packs_leaf`): a leaf is packed when every chunk of it holds at most
`pack_small_leaves_bytes` bytes (default `DEFAULT_PACK_BYTES`, 256 KiB), it is not empty,
its dtype is whole-byte (sub-byte dtypes keep TensorStore's own encoding) and the host is
little-endian. The rule depends only on the chunk shape and dtype, so every process
decides the same, and the manifest entry says `"packed": true`.

Layout, per process i that writes at least one packed chunk:

  packed/process-<i>/zarr.json   a zarr v3 array: uint8, shape [n], one chunk of [n],
                                 codecs bytes + crc32c; attributes.checkpointer.boxes
                                 is the index below (with each leaf's dtype)
  packed/process-<i>/c/0         the n bytes: each packed chunk's C-order, little-endian
                                 bytes, back to back in plan order, then 4 bytes crc32c

The index, per packed chunk `{leaf, box, offset, data_bytes, data_crc32c}`, is in
`processes/<i>.json` (`ProcessRecord.packed`), in the manifest (`"packed"`, one entry per
process, which is what readers use) and in the pack's attributes (for zarr-python users).
Packed leaves have no zarr array of their own: they are described in the manifest like
every leaf (shape, dtype, chunk shape, saved sharding), and read as
`zarr.open_array(f"{path}/packed/process-0")[off:off + n].view(dtype).reshape(box shape)`.

The restore planner (`_restore_plan`) turns each packed chunk a target box needs into a
`PackedRead` (a byte range of the pack's file) and coalesces neighbouring ranges into
`PackRun`s; `restore_packed` here runs them and places every packed leaf with one
`jax.make_array_from_callback` (each device its own host copy: never one host buffer
aliased across devices).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import jax
import numpy as np
from jax.sharding import NamedSharding

from .. import _errors, _format
from .._errors import CorruptCheckpointError, where
from .._format import ArrayMetadata, Box, ChunkRecord, PackedBoxRecord, PackRecord, is_whole_byte_dtype
from .._storage import Storage, ts_context
from ._leaf_plan import BoxRead, LeafRestorePlan, PackRun, coalesce_packed, plan_leaf
from ._read import RestoreStats, check_file_size

PACKED = "packed"
DEFAULT_PACK_BYTES = 256 << 10
_CRC_BYTES = 4


def array_name(process_index: int) -> str:
    """The pack's zarr array, relative to the checkpoint path."""
    return f"{PACKED}/process-{process_index}"


def chunk_key(process_index: int) -> str:
    """The pack's one chunk file, relative to the checkpoint path."""
    return f"{array_name(process_index)}/c/0"


def check_threshold(pack_small_leaves_bytes: object) -> int:
    """Validates `pack_small_leaves_bytes` (bytes; 0 turns packing off; None: the
    default, `DEFAULT_PACK_BYTES` as it is when called).

    Raises:
      ValueError: not a non-negative int or None.
    """
    v = DEFAULT_PACK_BYTES if pack_small_leaves_bytes is None else pack_small_leaves_bytes
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"pack_small_leaves_bytes must be a non-negative int (bytes; 0: no packing), got {v!r}")
    return v


def packs_leaf(shape: Sequence[int], chunk_shape: Sequence[int], dtype: np.dtype, threshold_bytes: int) -> bool:
    """Whether a leaf's chunks go into the packs (module docstring).

    Args:
      shape: the leaf's global shape.
      chunk_shape: its chunk shape (the saved shard shape, or a replica-parallel split).
      dtype: the stored dtype.
      threshold_bytes: the largest chunk packed, bytes; 0: none.
    """
    dtype = np.dtype(dtype)
    if threshold_bytes <= 0 or sys.byteorder != "little" or not is_whole_byte_dtype(dtype):
        return False
    n = 1
    for s in shape:
        n *= s
    if n == 0:
        return False
    chunk = dtype.itemsize
    for c in chunk_shape:
        chunk *= c
    return chunk <= threshold_bytes


def _little_endian_bytes(host: np.ndarray) -> np.ndarray:
    data = np.ascontiguousarray(host)
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    return data.reshape(-1).view(np.uint8)


def zarr_metadata(nbytes: int, attributes: dict) -> dict:
    """The pack's `zarr.json`: uint8 [nbytes], one chunk, raw bytes + crc32c."""
    return {
        "shape": [nbytes],
        "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [nbytes]}},
        "chunk_key_encoding": {"name": "default"},
        "fill_value": 0,
        "codecs": [{"name": "bytes"}, {"name": "crc32c"}],
        "attributes": attributes,
    }


class PackWriter:
    """One process's pack of a save: built from the host copies, written through TensorStore.

    `add` every packed chunk (plan order), then `write` (issues the write) and `finish`
    (waits; returns the records).
    """

    def __init__(self, process_index: int):
        self.process_index = process_index
        self._parts: list[tuple[ArrayMetadata, Box, np.ndarray]] = []

    def add(self, meta: ArrayMetadata, box: Box, host: np.ndarray) -> None:
        self._parts.append((meta, box, host))

    def __bool__(self) -> bool:
        return bool(self._parts)

    @property
    def nbytes(self) -> int:
        """Bytes of packed data added so far."""
        return sum(h.nbytes for _, _, h in self._parts)

    def write(self, storage: Storage, root: str) -> Callable[[], tuple[PackRecord, ChunkRecord]]:
        """Concatenates the chunks, checksums them and issues the pack's TensorStore
        write into `root` (the save's write path); returns the function that waits for
        it and gives the pack's index and its chunk record.

        Raises:
          OSError, ValueError: from TensorStore (the caller names the path).
        """
        nbytes = self.nbytes
        buf = np.empty(nbytes, np.uint8)
        boxes, attrs = [], []
        offset = 0
        for meta, box, host in self._parts:
            raw = _little_endian_bytes(host)
            buf[offset : offset + raw.size] = raw
            crc = crc32c.crc32c(raw.data)
            boxes.append(PackedBoxRecord(leaf=meta.path, box=box, offset=offset, data_bytes=raw.size, data_crc32c=crc))
            attrs.append(boxes[-1].to_json() | {"dtype": _format.dtype_name(meta.dtype)})
            offset += raw.size
        name = array_name(self.process_index)
        record = PackRecord(array=name, key=chunk_key(self.process_index), file_bytes=nbytes + _CRC_BYTES, boxes=tuple(boxes))
        attributes = {"checkpointer": {"packed_index": attrs, "layout": "C-order little-endian bytes of each box at offset"}}
        spec = {
            "driver": "zarr3",
            "kvstore": storage.kvstore_spec(f"{root}/{name}"),
            "metadata": zarr_metadata(nbytes, attributes),
            "create": True,
            "store_data_equal_to_fill_value": True,
        }
        import tensorstore as ts  # lazily: a restore of local files never needs it

        store = ts.open(spec, context=ts_context()).result()
        future = store.write(buf)
        chunk = ChunkRecord(
            key=record.key, box=Box((0,), (nbytes,)), file_bytes=record.file_bytes, data_bytes=nbytes,
            data_crc32c=crc32c.crc32c(buf.data),
        )

        def finish() -> tuple[PackRecord, ChunkRecord]:
            future.result()
            return record, chunk

        return finish


def packs_of_save(
    storage: Storage, root: str, process_index: int, own: PackRecord | None, process_count: int
) -> list[PackRecord]:
    """Process 0 at commit: every process's pack index, for the manifest (its own,
    `own`, the others' from their `processes/<i>.json` in `root`).

    Raises:
      CorruptCheckpointError: a record cannot be parsed.
    """
    packs = []
    for i in range(process_count):
        pack = own if i == process_index else _read_pack_index(storage, f"{root}/{_format.process_record_name(i)}")
        if pack is not None:
            packs.append(pack)
    return packs


def _read_pack_index(storage: Storage, location: str) -> PackRecord | None:
    """The `packed` field of a process record, parsed alone (its `chunks` may be thousands
    of entries process 0 does not need here)."""
    raw = _format.loads(storage.read_file(location, max_bytes=_format.MAX_MANIFEST_BYTES), location)
    packed = raw.get("packed") if isinstance(raw, dict) else None
    return None if packed is None else PackRecord.from_json(packed, f"{location}: packed")


# --- restore -------------------------------------------------------------------------------


def check_pack_files(storage: Storage, path: str, metas: Sequence[ArrayMetadata]) -> None:
    """Checks that the pack files these packed leaves use exist with the size the
    manifest gives (local files only, one `stat` per pack).

    Raises:
      CorruptCheckpointError: a pack file is missing or of another size.
    """
    if not storage.cheap_size:
        return
    sizes: dict[str, tuple[int, str]] = {}
    for m in metas:
        for b in m.pack_boxes:
            sizes.setdefault(b.key, (b.file_bytes, m.path))
    process = _errors.this_process()
    for key, (expected, leaf) in sizes.items():
        check_file_size(storage, path, key, expected, f"{where(leaf=leaf, path=path, process=process)}: pack file {key}")


def read_runs(storage: Storage, path: str, runs: Sequence[PackRun], stats: Any) -> dict[tuple[str, int], memoryview]:
    """Executes planned `PackRun`s: (pack key, offset) of every packed chunk in them →
    its bytes, crc32c checked.

    Raises:
      CorruptCheckpointError: a read fails or a checksum does not match; names the pack.
    """
    out: dict[tuple[str, int], memoryview] = {}
    readers: dict[str, Any] = {}
    try:
        for run in runs:
            try:
                reader = readers.get(run.key)
                if reader is None:
                    reader = readers[run.key] = storage.open_reader(f"{path}/{run.key}")
                buf = np.empty(run.nbytes, np.uint8)
                reader.read_into(run.offset, buf.data)
            except (OSError, EOFError) as e:
                leaves = list(dict.fromkeys(leaf for *_, leaf in run.boxes))
                others = f" (and {len(leaves) - 1} other leaves packed next to it)" if len(leaves) > 1 else ""
                raise CorruptCheckpointError(
                    f"{where(leaf=leaves[0], path=path, process=_errors.this_process())}: pack file {run.key}, bytes {run.offset}..{run.offset + run.nbytes}{others}, "
                    f"cannot be read: {e}. Run `checkpointer verify {path}`."
                ) from e
            # Counted as planned: the packed chunks' bytes (`LeafRestorePlan.bytes_read`),
            # not the gaps between them a run reads through.
            stats._add(sum(n for _, n, _, _ in run.boxes), chunk_reads=1)
            view = buf.data
            for offset, nbytes, crc, leaf in run.boxes:
                data = view[offset - run.offset : offset - run.offset + nbytes]
                computed = crc32c.crc32c(data)
                if computed != crc:
                    raise CorruptCheckpointError(
                        f"{where(leaf=leaf, path=path, process=_errors.this_process())}: packed bytes {offset}..{offset + nbytes} of {run.key}: crc32c "
                        f"mismatch (stored {crc:#010x}, the bytes read give {computed:#010x}): the data is damaged. "
                        f"Run `checkpointer verify {path}` for a full report."
                    )
                out[(run.key, offset)] = data
    finally:
        for r in readers.values():
            r.close()
    return out


def assemble_box(meta: ArrayMetadata, box_read: BoxRead, data: dict[tuple[str, int], memoryview]) -> np.ndarray:
    """One target box of a packed leaf, from the packed chunks read (a new array)."""
    dtype = meta.dtype.newbyteorder("<") if meta.dtype.itemsize > 1 else meta.dtype
    reads = box_read.packed
    out = _empty_unadoptable(box_read.box.shape, meta.dtype)
    if len(reads) == 1 and reads[0].box == reads[0].chunk_box == box_read.box:
        r = reads[0]
        out[...] = np.frombuffer(data[(r.key, r.offset)], dtype).reshape(box_read.box.shape)
        return out
    for r in reads:
        chunk = np.frombuffer(data[(r.key, r.offset)], dtype).reshape(r.chunk_box.shape)
        src = r.local_box.slices()
        dst = tuple(slice(d, d + n) for d, n in zip(r.dest, r.box.shape))
        out[dst] = chunk[src]
    return out


def _place_per_device(meta: ArrayMetadata, sharding: jax.sharding.Sharding, hosts: dict[Box, np.ndarray]) -> jax.Array:
    """`place` for a target in another memory kind (e.g. pinned_host): one put per device."""
    shape = meta.shape
    index: Any = sharding.addressable_devices_indices_map(shape)
    pieces = [
        jax.device_put(hosts[Box.from_index(idx, shape)].copy(), jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind))
        for d, idx in sorted(index.items(), key=lambda kv: kv[0].id)
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)


def region_reader(storage: Storage, path: str, meta: ArrayMetadata) -> Callable[[Box], np.ndarray]:
    """`_read.region_reader` of a packed leaf: `read(box)` returns the leaf's values in
    `box` (a fresh array), from the packed chunks it intersects.

    Raises (from `read`):
      CorruptCheckpointError: a pack read failed or a checksum does not match.
    """
    stats = RestoreStats()

    def read(box: Box) -> np.ndarray:
        b = plan_leaf(meta, [(-1, box)]).boxes[0]
        return assemble_box(meta, b, read_runs(storage, path, coalesce_packed((meta.path, p) for p in b.packed), stats))

    return read


_MISALIGN_BYTES = 8


def _unadoptable(host: np.ndarray) -> np.ndarray:
    """`host`'s values in a buffer that starts 8 bytes past a 64-byte boundary.

    XLA's CPU client adopts a suitably aligned host buffer without copying, and
    `jax.make_array_from_callback` / `jax.device_put` of one host array onto a
    replicated sharding then hands the *same* buffer to every device (measured, JAX
    0.10: `may_alias=False` does not prevent it), so donating one device's array would
    change the others'. From a buffer it cannot adopt, JAX copies once per device.
    (`tests/test_pack.py` checks that no two devices share a buffer.)
    """
    if host.ctypes.data % 64 == _MISALIGN_BYTES or host.nbytes == 0:
        return host
    out = _empty_unadoptable(host.shape, host.dtype)
    out[...] = host
    return out


def _empty_unadoptable(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array laid out as `_unadoptable` returns them."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + 64 + _MISALIGN_BYTES, np.uint8)
    start = (-raw.ctypes.data) % 64 + _MISALIGN_BYTES
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def place(meta: ArrayMetadata, sharding: jax.sharding.Sharding, hosts: dict[Box, np.ndarray]) -> jax.Array:
    """The global array of one leaf on `sharding` from its host boxes (one per unique
    target box of this process's devices), in one `jax.make_array_from_callback`.

    Every device gets its own copy of its box (`_unadoptable`): never one host buffer
    aliased across devices, which donation would corrupt.
    """
    shape = meta.shape
    by_origin = {b.origin: _unadoptable(h) for b, h in hosts.items()}

    def piece(index: tuple[slice, ...] | None) -> np.ndarray:
        # A shard's origin names its box (JAX indices are unit-step slices, None = 0).
        return by_origin[tuple(sl.start or 0 for sl in index or ())]

    if sharding.memory_kind not in (None, "device"):
        return _place_per_device(meta, sharding, hosts)
    return jax.make_array_from_callback(shape, sharding, piece)


def restore_packed(
    storage: Storage, path: str, leaves: Sequence[tuple[ArrayMetadata, Any, LeafRestorePlan]], budget: Any,
    stats: Any, copies_in_flight: int,
) -> dict[str, object]:
    """Restores packed leaves as planned: reads their packed chunks in coalesced runs,
    assembles each target box and places each leaf on its target with one call.

    Args:
      leaves: `(meta, target, plan)` of each packed leaf (`_targets.LeafTarget`,
        `LeafRestorePlan`), in target order.
      budget: the restore's host-memory budget (`_restore._Budget`): leaves are taken
        in batches of at most its limit / `copies_in_flight` bytes (at least one leaf).
      stats: the restore's `RestoreStats`.
    Returns:
      leaf path → a `jax.Array` on the target's sharding (PRNG keys wrapped), a numpy
      array for a host target, or for a leaf with an exchange (cooperative plan) the
      global array of its exchange layout (raw key data; `_restore._exchange` reshards).
    Raises:
      CorruptCheckpointError: a pack read failed or a checksum does not match.
    """
    out: dict[str, object] = {}
    limit = max(1, budget.limit // copies_in_flight)
    batch: list[tuple[ArrayMetadata, Any, LeafRestorePlan]] = []
    batch_bytes = 0
    for item in leaves:
        n = item[2].bytes_needed
        if batch and batch_bytes + n > limit:
            _restore_batch(storage, path, batch, budget, batch_bytes * copies_in_flight, stats, out)
            batch, batch_bytes = [], 0
        batch.append(item)
        batch_bytes += n
    if batch:
        _restore_batch(storage, path, batch, budget, batch_bytes * copies_in_flight, stats, out)
    return out


def _restore_batch(storage, path, batch, budget, cost, stats, out) -> None:
    budget.acquire(cost)
    try:
        runs = coalesce_packed((lp.leaf_path, p) for _, _, lp in batch for b in lp.boxes for p in b.packed)
        data = read_runs(storage, path, runs, stats)
        for meta, lt, lp in batch:
            hosts: dict[Box, np.ndarray] = {}
            for b in lp.boxes:
                host = assemble_box(meta, b, data)
                if lt.dtype is not None:
                    with np.errstate(all="ignore"):  # the cast was asked for: NaN/overflow are not news
                        host = host.astype(lt.dtype)
                hosts[b.box] = host
            if lt.sharding is None:
                arr: Any = hosts[Box.whole(meta.shape)]
            elif lp.exchange_spec is not None:  # cooperative: the exchange layout; `_restore._exchange` reshards and wraps
                s = lt.sharding
                out[meta.path] = place(meta, NamedSharding(s.mesh, lp.exchange_spec, memory_kind=s.memory_kind), hosts)
                continue
            else:
                arr = place(meta, lt.sharding, hosts)
            out[meta.path] = jax.random.wrap_key_data(arr, impl=meta.key_impl) if meta.key_impl is not None else arr
    finally:
        budget.release(cost)
