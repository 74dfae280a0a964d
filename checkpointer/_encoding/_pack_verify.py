"""`verify` of packed leaves (`_packed.PackedEncoding.verify`): every pack's size and
bytes, every packed chunk's crc32c, and the copies of each pack's index.

The manifest's `packed` index is the truth (readers use only it). Its copies, in the
writer's `processes/<i>.json` and in the pack's `zarr.json` attributes (what zarr-python
users read), must agree with it entry by entry; each difference is a problem naming the
copy, the pack, the entry (leaf and box) and the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import crc32c

from .. import _format
from .._errors import leaf_name
from .._format import ZARR_JSON, ArrayMetadata, PackedBox, PackRecord
from .._storage import Storage, ts_context
from . import _pack
from ._base import VerifyContext

# Per copy, at most this many differing entries are listed (then a count).
_MAX_SHOWN = 10
_FIELDS = ("shape", "offset", "data_bytes", "data_crc32c", "dtype")

# (leaf, box origin) → (box shape, offset, data_bytes, data_crc32c, dtype name)
_Index = Mapping[tuple[str, tuple[int, ...]], tuple[object, ...]]


def _compare(key: str, copy: str, truth: _Index, got: _Index, problems: list[str], names: Mapping[str, str]) -> None:
    lines = []
    for entry in sorted(truth.keys() | got.keys(), key=lambda e: (e[0], tuple(map(str, e[1])))):
        want, have = truth.get(entry), got.get(entry)
        if want == have:
            continue
        leaf, origin = entry
        at = f"the entry of leaf {names.get(leaf) or leaf_name(leaf)}, box at {list(origin)}"
        if have is None:
            lines.append(f"pack {key}: {copy} lacks {at}, which the manifest's 'packed' index (the truth) has")
        elif want is None:
            lines.append(f"pack {key}: {copy} has {at}, which the manifest's 'packed' index (the truth) lacks")
        else:
            diffs = [f"{f} {h!r} there, {w!r} in the manifest" for f, h, w in zip(_FIELDS, have, want) if h != w]
            lines.append(f"pack {key}: {copy} differs from the manifest's 'packed' index (the truth) at {at}: {'; '.join(diffs)}")
    problems.extend(lines[:_MAX_SHOWN])
    if len(lines) > _MAX_SHOWN:
        problems.append(f"pack {key}: {copy}: {len(lines) - _MAX_SHOWN} more entries differ from the manifest's 'packed' index")


def _check_record(key: str, expected: int, truth: _Index, dtypes: Mapping[str, str], found: tuple[str, PackRecord] | None,
                  problems: list[str], names: Mapping[str, str]) -> None:
    if found is None:
        problems.append(f"pack {key}: no process record (processes/<i>.json) holds its index; the writer's copy is lost")
        return
    name, pack = found
    copy = f"processes/{name}"
    if pack.file_bytes != expected:
        problems.append(f"pack {key}: {copy} says it has {pack.file_bytes} bytes, the manifest's 'packed' index {expected}")
    got = {(b.leaf, b.box.origin): (b.box.shape, b.offset, b.data_bytes, b.data_crc32c, dtypes.get(b.leaf)) for b in pack.boxes}
    _compare(key, copy, truth, got, problems, names)


def _check_attributes(storage: Storage, path: str, key: str, expected: int, truth: _Index, problems: list[str],
                      names: Mapping[str, str]) -> None:
    array = key.rsplit("/c/", 1)[0]
    copy = f"{array}/{ZARR_JSON} (attributes checkpointer.packed_index)"
    try:
        node: Any = _format.loads(storage.read_file(f"{path}/{array}/{ZARR_JSON}", max_bytes=_format.MAX_MANIFEST_BYTES), f"{array}/{ZARR_JSON}")
        shape = node["shape"]
        entries = node["attributes"]["checkpointer"]["packed_index"]
        got: dict[tuple[str, tuple[int, ...]], tuple[object, ...]] = {}
        for e in entries:
            (origin, box_shape) = e["box"]
            got[(str(e["leaf"]), tuple(origin))] = (tuple(box_shape), e["offset"], e["data_bytes"], e["data_crc32c"], e.get("dtype"))
    except Exception as e:  # every failure is a finding
        problems.append(f"pack {key}: {copy} cannot be read: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        return
    if shape != [expected - _pack.CRC_BYTES]:
        problems.append(f"pack {key}: {copy} gives the shape {shape!r}, the manifest's 'packed' index {[expected - _pack.CRC_BYTES]} "
                        f"({expected} bytes with the crc32c)")
    _compare(key, copy, truth, got, problems, names)


def verify_packs(storage: Storage, path: str, metas: Sequence[ArrayMetadata], ctx: VerifyContext) -> None:
    """Checks every pack the manifest's index names: its size against the index, its
    bytes through TensorStore (the crc32c codec) against the writer's record, every
    packed chunk against its crc32c (on a codec failure from the raw file, so the
    damaged leaves are named), and the index's copies against the manifest's."""
    import tensorstore as ts  # lazily: a restore of local files never needs it

    by_key: dict[str, list[tuple[str, PackedBox]]] = {}
    for m in metas:
        for b in m.pack_boxes:
            by_key.setdefault(b.key, []).append((m.path, b))
    dtypes = {m.path: _format.dtype_name(m.dtype) for m in metas}
    names = {m.path: leaf_name(m.path, m.keystr) for m in metas}
    record_packs = {p.key: (name, p) for name, r in sorted(ctx.records.items()) for p in r.own_packs}
    problems = ctx.problems
    for key in sorted(record_packs.keys() - by_key.keys()):
        problems.append(f"pack {key}: processes/{record_packs[key][0]} holds an index of it, the manifest's 'packed' index "
                        "(the truth) has none")
    for key, boxes in sorted(by_key.items()):
        expected = boxes[0][1].file_bytes
        if boxes[0][1].folder is not None:  # a pack of an earlier checkpoint (incremental saves)
            _verify_referenced(storage, path, key, boxes, names, ctx)
            continue
        truth: _Index = {(leaf, b.box.origin): (b.box.shape, b.offset, b.nbytes, b.crc32c, dtypes[leaf]) for leaf, b in boxes}
        _check_record(key, expected, truth, dtypes, record_packs.get(key), problems, names)
        _check_attributes(storage, path, key, expected, truth, problems, names)
        try:
            size = storage.size(f"{path}/{key}")
        except OSError:
            size = None  # reported by the read below
        if size is not None and size != expected:
            ranges = sorted((b.offset, b.nbytes, leaf) for leaf, b in boxes)
            gone = _pack.gone_leaves(ranges, size)
            lost = f": the packed bytes of {_pack.name_leaves([names[g] for g in gone])} lie past its end" if gone else ""
            problems.append(f"pack {key} has {size} bytes, the manifest's 'packed' index says {expected}{lost}")
        raw: memoryview
        n_bytes = 0
        try:
            kvstore = storage.kvstore_spec(f"{path}/{key.rsplit('/c/', 1)[0]}")
            store = ts.open({"driver": "zarr3", "kvstore": kvstore, "open": True, "fill_missing_data_reads": False},
                            context=ts_context(), read=True).result()
            data = store.read().result()
            rec = ctx.chunks.get(key)
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
                    problems.append(f"leaf {names.get(leaf) or leaf_name(leaf)}: its packed chunks in {key} cannot be read ({read_error.strerror or read_error})")
                ctx.done(len(boxes))
                continue
        for leaf, b in boxes:
            if b.offset + b.nbytes > len(raw) or crc32c.crc32c(raw[b.offset : b.offset + b.nbytes]) != b.crc32c:
                problems.append(f"leaf {names.get(leaf) or leaf_name(leaf)}: packed chunk at {b.box.origin} (bytes {b.offset}..{b.offset + b.nbytes} "
                                f"of {key}) does not match its crc32c in the manifest")
            else:
                n_bytes += b.nbytes
        ctx.done(len(boxes), n_bytes)


def _verify_referenced(storage: Storage, path: str, key: str, boxes: Sequence[tuple[str, PackedBox]], names: Mapping[str, str],
                       ctx: VerifyContext) -> None:
    """The packed chunks this checkpoint references in an earlier checkpoint's pack: each
    read where it lies and checked against its crc32c and XXH3-128 (`read_metadata`
    already checked them against that checkpoint's index; its own `verify` checks the
    rest of that pack)."""
    import xxhash

    file = _format.pack_file(path, key)
    n_bytes = 0
    try:
        raw = memoryview(storage.read_file(file))
    except OSError as e:
        for leaf in dict.fromkeys(leaf for leaf, _ in boxes):
            ctx.problems.append(f"leaf {names.get(leaf) or leaf_name(leaf)}: its packed chunks, referenced in {file}, cannot be "
                                f"read ({e.strerror or e})")
        ctx.done(len(boxes))
        return
    for leaf, b in boxes:
        data = raw[b.offset : b.offset + b.nbytes]
        if (b.offset + b.nbytes > len(raw) or crc32c.crc32c(data) != b.crc32c
                or b.xxh3_128 is not None and xxhash.xxh3_128_hexdigest(data) != b.xxh3_128):
            ctx.problems.append(f"leaf {names.get(leaf) or leaf_name(leaf)}: packed chunk at {b.box.origin}, referenced in {file} "
                                f"(bytes {b.offset}..{b.offset + b.nbytes}), does not match the reference's crc32c or XXH3-128")
        else:
            n_bytes += b.nbytes
    ctx.done(len(boxes), n_bytes)
