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
                                 codecs bytes + crc32c; attributes.checkpointer.packed_index
                                 is the index below (with each leaf's dtype)
  packed/process-<i>/c/0         the n bytes: each packed chunk's C-order, little-endian
                                 bytes, back to back in plan order, then 4 bytes crc32c

The index, per packed chunk `{leaf, box, offset, data_bytes, data_crc32c}`, is in
`processes/<i>.json` (`ProcessRecord.packed`), in the manifest (`"packed"`, one entry per
process, which is what readers use) and in the pack's attributes (for zarr-python users).
Packed leaves have no zarr array of their own: they are described in the manifest like
every leaf (shape, dtype, chunk shape, saved sharding), and read as
`zarr.open_array(f"{path}/packed/process-0")[off:off + n].view(dtype).reshape(box shape)`.

Incremental saves reference unchanged packed chunks in an earlier step's pack instead
of packing them again: a `packed` record with `"in"` (`_format.pack_file`,
docs/format.md "Packed chunks referenced"; `_save._incremental.Base.split_packed`).

This module is the pack itself: the rule, the names, writing it, the index of a save,
and reading planned byte ranges of it (`read_runs`, `assemble_box`). The encoding's
operations (plans, the cooperative share, file checks, restore, verify, export, the two
tiers) are `_packed.PackedEncoding`'s.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import sys
from collections.abc import Callable, Iterable, Sequence
from json.encoder import encode_basestring
from typing import Any

import crc32c
import numpy as np

from .. import _errors, _format
from .._errors import CorruptCheckpointError, where
from .._format import ArrayMetadata, Box, ChunkRecord, PackedBoxRecord, PackRecord, is_whole_byte_dtype
from .._memory import aligned_empty
from .._storage import DIRECT_ALIGN, Storage, ts_context, write_direct_file
from ._leaf_plan import BoxRead, PackRun
from ._write import DirectWriter

PACKED = "packed"
DEFAULT_PACK_BYTES = 256 << 10
CRC_BYTES = 4


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


LAYOUT = "C-order little-endian bytes of each box at offset"  # the pack's `attributes.checkpointer.layout`


def zarr_json(nbytes: int, boxes: Sequence[PackedBoxRecord], dtypes: Sequence[np.dtype]) -> bytes:
    """The pack's `zarr.json` (`zarr_metadata` with its index, each box with its leaf's
    dtype) byte for byte as TensorStore writes it when it creates the array: compact,
    keys sorted, UTF-8 (`tests/test_pack.py` compares the two). Each box is formatted
    directly (a dict per small chunk, then TensorStore's conversion of them, cost
    ~5 µs a chunk)."""
    names = {d: encode_basestring(_format.dtype_name(d)) for d in set(dtypes)}
    # The text before the crc32c, per (box, data_bytes, dtype): the leaves of one layout
    # share their chunk's Box object, so it is formatted once per layout, not per chunk.
    heads: dict[tuple[int, int, np.dtype], str] = {}
    entries = []
    for b, d in zip(boxes, dtypes):
        if b.extra:  # never for a pack this process writes; kept exact anyway
            entries.append(json.dumps(b.to_json() | {"dtype": _format.dtype_name(d)}, sort_keys=True, separators=(",", ":"),
                                      ensure_ascii=False))
            continue
        box, size = b.box, b.data_bytes
        head = heads.get((id(box), size, d))
        if head is None:
            origin, shape = ",".join(map(str, box.origin)), ",".join(map(str, box.shape))
            head = heads[(id(box), size, d)] = f'{{"box":[[{origin}],[{shape}]],"data_bytes":{size},"data_crc32c":'
        entries.append(f'{head}{b.data_crc32c},"dtype":{names[d]},"leaf":{encode_basestring(b.leaf)},"offset":{b.offset}}}')
    mark = "packed index goes here"
    meta = zarr_metadata(nbytes, {"checkpointer": {"packed_index": mark, "layout": LAYOUT}}) | {"node_type": "array", "zarr_format": 3}
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    head, tail = text.split(json.dumps(mark), 1)
    return (head + "[" + ",".join(entries) + "]" + tail).encode()


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


def buffer_bytes(nbytes: int) -> int:
    """Bytes of a pack's write buffer for `nbytes` of packed data: the data and its
    crc32c, rounded up to `DIRECT_ALIGN` (one direct write)."""
    return -(-(nbytes + CRC_BYTES) // DIRECT_ALIGN) * DIRECT_ALIGN


class PackSlab:
    """The snapshot's one copy of a process's packed chunks, laid out as its pack:
    their C-order little-endian bytes back to back in plan order, in one buffer aligned
    and long enough for the pack's direct write (`buffer_bytes`). `views[k]` is the
    k-th chunk's box, a view of the buffer (the snapshot's host array of that chunk).

    `PackWriter` writes the buffer as it is when it packs exactly these views in this
    order; otherwise (an incremental save leaves out unchanged chunks) it copies them.
    """

    def __init__(self, buffer: np.ndarray, views: list[np.ndarray], nbytes: int):
        self.buffer: np.ndarray | None = buffer  # uint8, DIRECT_ALIGN-aligned, at least buffer_bytes(nbytes) long
        self.views = views
        self.nbytes = nbytes

    def release(self) -> np.ndarray | None:
        """Forgets the buffer and its views (the bytes are durable) and returns the
        buffer, once (then None)."""
        buffer, self.buffer, self.views = self.buffer, None, []
        return buffer

    @staticmethod
    def fill(sources: Sequence[np.ndarray], take: Callable[[int], np.ndarray]) -> PackSlab:
        """Copies `sources` (host arrays of native byte order, e.g. views of CPU shards)
        into a new slab whose buffer is `take(buffer_bytes(nbytes))` (a `DIRECT_ALIGN`-
        aligned uint8 array); one copy each.

        Runs of consecutive sources of one dtype and shape (a tree's small leaves come in
        such runs) are copied by one `np.concatenate` into their block of the slab and
        their views are the rows of that block: no Python per leaf (a view made and
        assigned per leaf cost ~1.3 µs, the run ~0.4 µs a leaf)."""
        runs = [(key, list(group)) for key, group in itertools.groupby(sources, _DTYPE_SHAPE)]
        nbytes = sum(dtype.itemsize * math.prod(shape) * len(run) for (dtype, shape), run in runs)
        buf = take(buffer_bytes(nbytes))
        assert buf.nbytes >= buffer_bytes(nbytes) and buf.ctypes.data % DIRECT_ALIGN == 0
        views: list[np.ndarray] = []
        offset = 0
        for (dtype, shape), run in runs:
            size = dtype.itemsize * math.prod(shape)
            if len(run) >= _MIN_RUN and shape:
                block = np.ndarray((len(run), *shape), dtype, buffer=buf, offset=offset)
                np.concatenate(run, axis=None, out=block.reshape(-1))
                views += list(block)
                offset += size * len(run)
                continue
            for src in run:  # short runs and scalars (a row of a block of scalars is no array)
                view = np.ndarray(shape, dtype, buffer=buf, offset=offset)
                view[...] = src
                views.append(view)
                offset += size
        return PackSlab(buf, views, nbytes)


_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")  # what a run of `PackSlab.fill` shares
_HOST = operator.itemgetter(2)  # of a `PackWriter` part
_MIN_RUN = 4  # shorter runs are copied leaf by leaf (a run's fixed cost ~1 µs)


class PackWriter:
    """One process's pack of a save: built from the host copies, written through TensorStore.

    `add` every packed chunk (plan order), then `write` (issues the write) and `finish`
    (waits; returns the records).
    """

    def __init__(self, process_index: int, slab: PackSlab | None = None):
        self.process_index = process_index
        self._parts: list[tuple[ArrayMetadata, Box, np.ndarray]] = []
        self._slab = slab  # where the snapshot laid the chunks out already, if it did

    def _slab_holds_parts(self) -> bool:
        """Whether the parts are the slab's views, all of them, in order (the buffer is the pack)."""
        slab = self._slab
        return slab is not None and slab.buffer is not None and len(slab.views) == len(self._parts) and all(
            map(operator.is_, map(_HOST, self._parts), slab.views))

    def add(self, meta: ArrayMetadata, box: Box, host: np.ndarray) -> None:
        self._parts.append((meta, box, host))

    def add_all(self, parts: Iterable[tuple[ArrayMetadata, Box, Any]]) -> None:
        """`add` of each `(meta, box, host array)`, in order (packed leaves are never shard files)."""
        start = len(self._parts)
        self._parts.extend(parts)
        assert all(isinstance(h, np.ndarray) for _, _, h in self._parts[start:])

    def __bool__(self) -> bool:
        return bool(self._parts)

    @property
    def nbytes(self) -> int:
        """Bytes of packed data added so far."""
        return sum(h.nbytes for _, _, h in self._parts)

    def write(self, storage: Storage, root: str, direct: DirectWriter | None = None) -> Callable[[], tuple[PackRecord, ChunkRecord]]:
        """Concatenates the chunks, checksums them and issues the pack's write into
        `root` (the save's write path): TensorStore creates its `zarr.json` and writes
        its chunk file, or (`direct`) the direct writer writes the chunk file, the same
        bytes (the data, then their crc32c, computed once for the codec and the record).
        Returns the function that waits for it and gives the pack's index and its chunk
        record.

        Raises:
          OSError, ValueError: from TensorStore or the file system (the caller names the path).
        """
        laid_out = self._slab_holds_parts()
        nbytes = self._slab.nbytes if laid_out and self._slab is not None else self.nbytes
        # Aligned and long enough for a direct write of the data and the codec's crc32c.
        slab_buffer = self._slab.buffer if laid_out and self._slab is not None else None
        buf = slab_buffer if slab_buffer is not None else aligned_empty(
            (buffer_bytes(nbytes),), np.dtype(np.uint8), DIRECT_ALIGN)
        whole = buf.data
        boxes, dtypes = [], []
        offset = 0
        for meta, box, host in self._parts:
            size = host.nbytes
            if not laid_out:
                buf[offset : offset + size] = _little_endian_bytes(host)
            crc = crc32c.crc32c(whole[offset : offset + size])
            boxes.append(PackedBoxRecord.new(meta.path, box, offset, size, crc))
            dtypes.append(meta.dtype)
            offset += size
        data = buf[:nbytes]
        data_crc = crc32c.crc32c(data.data)
        name = array_name(self.process_index)
        record = PackRecord(array=name, key=chunk_key(self.process_index), file_bytes=nbytes + CRC_BYTES, boxes=tuple(boxes))
        futures: list[Any]
        if direct is None:
            attrs = [b.to_json() | {"dtype": _format.dtype_name(d)} for b, d in zip(boxes, dtypes)]
            spec = {
                "driver": "zarr3",
                "kvstore": storage.kvstore_spec(f"{root}/{name}"),
                "metadata": zarr_metadata(nbytes, {"checkpointer": {"packed_index": attrs, "layout": LAYOUT}}),
                "create": True,
                "store_data_equal_to_fill_value": True,
            }
            import tensorstore as ts  # lazily: a restore of local files never needs it

            futures = [ts.open(spec, context=ts_context()).result().write(data)]
        else:  # local files: the pack's zarr.json as TensorStore writes it, and its chunk file, by the direct writer
            buf[nbytes : nbytes + CRC_BYTES] = np.frombuffer(data_crc.to_bytes(CRC_BYTES, "little"), np.uint8)
            path = f"{root}/{record.key}"
            direct.makedirs(path.rsplit("/", 1)[0])
            meta_path, meta_bytes = f"{root}/{name}/{_format.ZARR_JSON}", zarr_json(nbytes, boxes, dtypes)
            futures = [direct.submit(write_direct_file, path, buf, nbytes + CRC_BYTES)]
            if direct.direct:  # the zarr.json (about 150 bytes a chunk) as the data: no page cache, no rename
                meta_buf = aligned_empty((buffer_bytes(len(meta_bytes)),), np.dtype(np.uint8), DIRECT_ALIGN)
                meta_buf[: len(meta_bytes)] = np.frombuffer(meta_bytes, np.uint8)
                futures.append(direct.submit(write_direct_file, meta_path, meta_buf, len(meta_bytes)))
            else:
                futures.append(direct.submit(storage.write_file, meta_path, meta_bytes))
        chunk = ChunkRecord(
            key=record.key, box=Box((0,), (nbytes,)), file_bytes=record.file_bytes, data_bytes=nbytes, data_crc32c=data_crc,
        )

        def finish() -> tuple[PackRecord, ChunkRecord]:
            for future in futures:
                future.result()
            return record, chunk

        return finish


def packs_of_save(
    storage: Storage, root: str, process_index: int, own: PackRecord | None, process_count: int,
    own_references: Sequence[PackRecord] = (),
) -> list[PackRecord]:
    """Process 0 at commit: every process's pack index, for the manifest (its own,
    `own`, the others' from their `processes/<i>.json` in `root`), then the packs of
    earlier checkpoints they reference (incremental saves: `own_references`, the
    others' records' `packed_references`).

    Raises:
      CorruptCheckpointError: a record cannot be parsed.
    """
    packs, refs = [], []
    for i in range(process_count):
        if i == process_index:
            mine, theirs = [own] if own is not None else [], list(own_references)
        else:
            mine, theirs = _read_pack_index(storage, f"{root}/{_format.process_record_name(i)}")
        packs += mine
        refs += theirs
    return packs + refs


def _read_pack_index(storage: Storage, location: str) -> tuple[list[PackRecord], list[PackRecord]]:
    """The packs a process record indexes (`packed`, then `packed_materialized`: two
    tiers) and its `packed_references`, parsed alone (its `chunks` may be thousands of
    entries process 0 does not need here)."""
    raw = _format.loads(storage.read_file(location, max_bytes=_format.MAX_MANIFEST_BYTES), location)
    packed = raw.get("packed") if isinstance(raw, dict) else None
    lists = {}
    for name in ("packed_materialized", "packed_references"):
        items = raw.get(name) if isinstance(raw, dict) else None
        if items is not None and not isinstance(items, list):
            raise CorruptCheckpointError(f"{location}: '{name}' is not a list")
        lists[name] = [PackRecord.from_json(r, f"{location}: {name}[{i}]") for i, r in enumerate(items or ())]
    own = ([] if packed is None else [PackRecord.from_json(packed, f"{location}: packed")]) + lists["packed_materialized"]
    return own, lists["packed_references"]


# --- reads ---------------------------------------------------------------------------------


def gone_leaves(boxes: Sequence[tuple[int, int, str]], size: int | None) -> list[str]:
    """The leaves of `(offset, nbytes, leaf)` byte ranges that a pack file of `size`
    bytes (None: missing) cuts off, in order, each once."""
    return list(dict.fromkeys(leaf for offset, nbytes, leaf in boxes if size is None or offset + nbytes > size))


def name_leaves(leaves: Sequence[str], shown: int = 3) -> str:
    """`['a']`, `['a'] and ['b']`, `['a'], ['b'], ['c'] and 4 more leaves`, for messages
    (`leaves`: names as `_errors.leaf_name` gives them)."""
    names = list(leaves[:shown])
    rest = len(leaves) - len(names)
    if rest:
        return f"{', '.join(names)} and {rest} more leaves"
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _shown(path: str, key: str) -> str:
    """A pack file for messages: its key in this checkpoint, or the whole path of a pack
    of an earlier checkpoint it references (which names that checkpoint)."""
    return key if _format.split_pack_key(key)[0] is None else _format.pack_file(path, key)


def read_runs(
    storage: Storage, path: str, runs: Sequence[PackRun], stats: Any, piece_crcs: dict[tuple[str, int], int] | None = None
) -> dict[tuple[str, int], memoryview]:
    """Executes planned `PackRun`s: (pack key, offset) of every byte range in them →
    its bytes, crc32c checked (a piece of a shared chunk, crc32c None: its crc32c goes
    into `piece_crcs`, checked after the exchange).

    Raises:
      CorruptCheckpointError: a read fails (naming the leaves whose bytes it cut off)
        or checksums do not match (naming every damaged leaf of the runs).
    """
    out: dict[tuple[str, int], memoryview] = {}
    readers: dict[str, Any] = {}
    process = _errors.this_process()
    damaged: list[tuple[str, str]] = []
    try:
        for run in runs:
            try:
                reader = readers.get(run.key)
                if reader is None:
                    reader = readers[run.key] = storage.open_reader(_format.pack_file(path, run.key))
                buf = np.empty(run.nbytes, np.uint8)
                reader.read_into(run.offset, buf.data)
            except (OSError, EOFError) as e:
                size = None
                try:
                    size = readers[run.key].size() if run.key in readers else None
                except (OSError, EOFError):
                    pass
                leaves = gone_leaves([(o, n, leaf) for o, n, _, leaf in run.boxes], size) or [leaf for *_, leaf in run.boxes]
                leaves = list(dict.fromkeys(leaves))
                others = f" (and {len(leaves) - 1} other leaves packed next to it)" if len(leaves) > 1 else ""
                raise CorruptCheckpointError(
                    f"{where(keystr=leaves[0], path=path, process=process)}: pack file {_shown(path, run.key)}, bytes {run.offset}..{run.offset + run.nbytes}{others}, "
                    f"cannot be read: {e}. Run `checkpointer verify {path}`."
                ) from e
            # Counted as planned: the packed chunks' bytes (`LeafRestorePlan.bytes_read`),
            # not the gaps between them a run reads through.
            stats._add(sum(n for _, n, _, _ in run.boxes), chunk_reads=1)
            view = buf.data
            for offset, nbytes, crc, leaf in run.boxes:
                data = view[offset - run.offset : offset - run.offset + nbytes]
                computed = crc32c.crc32c(data)
                if crc is None:
                    assert piece_crcs is not None, "a piece of a shared chunk outside a cooperative restore"
                    piece_crcs[(run.key, offset)] = computed
                elif computed != crc:
                    damaged.append((leaf, f"bytes {offset}..{offset + nbytes} of {_shown(path, run.key)}: crc32c mismatch (stored {crc:#010x}, "
                                          f"the bytes read give {computed:#010x})"))
                out[(run.key, offset)] = data
    finally:
        for r in readers.values():
            r.close()
    if damaged:
        leaves = list(dict.fromkeys(leaf for leaf, _ in damaged))
        first = damaged[0][1]
        raise CorruptCheckpointError(
            f"{where(keystr=leaves[0], path=path, process=process)}: packed {first}: the data is damaged"
            + (f"; so are the packed bytes of {name_leaves(leaves[1:])}" if len(leaves) > 1 else "")
            + f". Run `checkpointer verify {path}` for a full report; restore the other leaves with partial=True."
        )
    return out


def assemble_box(meta: ArrayMetadata, box_read: BoxRead, data: dict[tuple[str, int], memoryview], *,
                 adoptable: bool = False) -> np.ndarray:
    """One target box of a packed leaf, from the packed chunks read (a new array): in a
    buffer JAX cannot adopt (`unadoptable`), unless `adoptable` (the box goes to one
    device only, so nothing can alias it)."""
    dtype = meta.dtype.newbyteorder("<") if meta.dtype.itemsize > 1 else meta.dtype
    reads = box_read.packed
    if len(reads) == 1 and reads[0].box == reads[0].chunk_box == box_read.box:
        r = reads[0]
        whole = np.frombuffer(data[(r.key, r.offset)], dtype).reshape(box_read.box.shape)
        if adoptable:
            return whole.copy()
        out = _empty_unadoptable(box_read.box.shape, meta.dtype)
        out[...] = whole
        return out
    out = np.empty(box_read.box.shape, meta.dtype) if adoptable else _empty_unadoptable(box_read.box.shape, meta.dtype)
    for r in reads:
        chunk = np.frombuffer(data[(r.key, r.offset)], dtype).reshape(r.chunk_box.shape)
        src = r.local_box.slices()
        dst = tuple(slice(d, d + n) for d, n in zip(r.dest, r.box.shape))
        out[dst] = chunk[src]
    return out


_MISALIGN_BYTES = 8


def unadoptable(host: np.ndarray) -> np.ndarray:
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
    """An uninitialised array laid out as `unadoptable` returns them."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + 64 + _MISALIGN_BYTES, np.uint8)
    start = (-raw.ctypes.data) % 64 + _MISALIGN_BYTES
    return raw[start : start + nbytes].view(dtype).reshape(shape)
