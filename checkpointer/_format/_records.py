"""`processes/<i>.json`, written by each process once its chunks are durable: the
`ProcessRecord` with its `ChunkRecord`s and pack index (`PackRecord`, `PackedBoxRecord`),
each with `to_json` / `from_json` beside each other, and the save phases' JSON.

A reader never fails on a field it does not know (format changes are additive): a record
keeps it in `extra` and writes it back.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .._errors import CorruptCheckpointError
from .._storage import Storage
from . import _json
from ._box import Box


def _json_field(key: str, parse: Callable[[object], object], dump: Callable[[Any], object] = lambda v: v, **kw: Any) -> Any:
    """A dataclass field stored under `key`: `parse` checks and converts the JSON value
    (raising ValueError or TypeError), `dump` is its inverse (it takes the field's type)."""
    return dataclasses.field(metadata={"key": key, "parse": parse, "dump": dump}, **kw)


def _count(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{v!r:.100} is not a count")
    return v


def _text(v: object) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{v!r:.100} is not a string")
    return v


def _seconds(v: object) -> float:
    seconds = _json.finite_number(v)  # never OverflowError (an int of 400 digits)
    if seconds is None:
        raise ValueError(f"{v!r:.100} is not a number of seconds")
    return seconds


def parse_phases(v: object) -> dict[str, tuple[float, float]]:
    """`{"snapshot": [start, end], ...}`: wall-clock spans, seconds since the epoch."""
    if not isinstance(v, dict):
        raise ValueError(f"{v!r:.100} is not an object of phases")
    out = {}
    for name, span in v.items():
        if not isinstance(span, list) or len(span) != 2:
            raise ValueError(f"phase {name!r}: {span!r:.100} is not [start, end]")
        # Wall clocks may step backwards (NTP): an end before its start is kept as read.
        out[str(name)] = (float(_seconds(span[0])), float(_seconds(span[1])))
    return out


def phases_json(phases: Mapping[str, tuple[float, float]]) -> dict:
    return {name: [round(a, 6), round(b, 6)] for name, (a, b) in phases.items()}


_Record = TypeVar("_Record", "ChunkRecord", "ProcessRecord", "PackedBoxRecord", "PackRecord")


@functools.cache
def _json_fields(cls: type) -> tuple[tuple[str, str, Callable[[Any], object]], ...]:
    """(attribute, JSON key, dump) of a record class's `_json_field`s (`dataclasses.fields`
    is slow, and records of thousands of chunks are written on every save)."""
    return tuple((f.name, f.metadata["key"], f.metadata["dump"]) for f in dataclasses.fields(cls) if "key" in f.metadata)


def _record_to_json(obj: ChunkRecord | ProcessRecord | PackedBoxRecord | PackRecord) -> dict:
    out = {}
    cls: Any = type(obj)
    for name, key, dump in _json_fields(cls):
        value = getattr(obj, name)
        if value is not None:
            out[key] = dump(value)
    out.update((k, v) for k, v in obj.extra.items() if k not in out)
    return out


def _record_from_json(cls: type[_Record], obj: object, where: str) -> _Record:
    """Parses `obj` into `cls` by its `_json_field`s: a required field (one without a
    default) must be present, an optional one may be absent or null; the others go to
    `extra`."""
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    values, known = {}, set()
    for f in dataclasses.fields(cls):
        if "key" not in f.metadata:
            continue
        key = f.metadata["key"]
        known.add(key)
        if obj.get(key) is None:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise CorruptCheckpointError(f"{where}: the field {key!r} is missing")
            continue
        try:
            values[f.name] = f.metadata["parse"](obj[key])
        except (ValueError, TypeError, OverflowError) as e:
            raise CorruptCheckpointError(f"{where}: field {key!r}: {e}") from e
    return cls(**values, extra={k: v for k, v in obj.items() if k not in known})


def _box(v: object) -> Box:
    return Box.from_json(v)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkRecord:
    """One chunk (zarr shard file) a process wrote: an entry of `processes/<i>.json`.

    Only `key` is required when read back (`verify` needs it and the crc); a record from
    this library always has every field.

    Attributes:
      leaf: the leaf path.
      key: the chunk's key relative to the checkpoint path (`_layout.chunk_key`).
      box: the chunk's region of the global array.
      file_bytes: size of the zarr shard file, bytes (JSON `"bytes"`).
      data_bytes: bytes of array data in the chunk (box size × itemsize).
      data_crc32c: crc32c of the chunk's C-order bytes (`_zarr_arrays.data_crc32c`).
      extra: JSON fields this version does not know, kept as read.
    """

    leaf: str | None = _json_field("leaf", _text, default=None)
    key: str = _json_field("key", _text)
    box: Box | None = _json_field("box", _box, Box.to_json, default=None)
    file_bytes: int | None = _json_field("bytes", _count, default=None)
    data_bytes: int | None = _json_field("data_bytes", _count, default=None)
    data_crc32c: int | None = _json_field("data_crc32c", _count, default=None)
    extra: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        """The JSON object (fields in the order of format_version 1; None fields omitted)."""
        return _record_to_json(self)

    @staticmethod
    def from_json(obj: object, where: str) -> ChunkRecord:
        """Parses one chunk entry.

        Raises:
          CorruptCheckpointError: not an object, `key` missing, or a field of the wrong type.
        """
        return _record_from_json(ChunkRecord, obj, where)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedBoxRecord:
    """One chunk of a packed leaf inside a process's pack: an entry of `PackRecord.boxes`.

    Attributes:
      leaf: the leaf path.
      box: the chunk's region of the global array.
      offset: where its C-order bytes start in the pack's chunk file, bytes.
      data_bytes: their length, bytes (box size × itemsize).
      data_crc32c: crc32c of those bytes (`_zarr_arrays.data_crc32c`).
      extra: JSON fields this version does not know, kept as read.
    """

    leaf: str = _json_field("leaf", _text)
    box: Box = _json_field("box", _box, Box.to_json)
    offset: int = _json_field("offset", _count)
    data_bytes: int = _json_field("data_bytes", _count)
    data_crc32c: int = _json_field("data_crc32c", _count)
    extra: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        """The JSON object (`_record_to_json`, spelled out: a save writes one per small chunk)."""
        out = {"leaf": self.leaf, "box": [list(self.box.origin), list(self.box.shape)], "offset": self.offset,
               "data_bytes": self.data_bytes, "data_crc32c": self.data_crc32c}
        out.update((k, v) for k, v in self.extra.items() if k not in out)
        return out

    def json_text(self) -> str:
        """`to_json()` as `_json.dumps_large` encodes an entry (compact, ASCII), formatted directly."""
        if self.extra:
            return _json.encode(self.to_json())
        origin, shape = ", ".join(map(str, self.box.origin)), ", ".join(map(str, self.box.shape))
        return (f'{{"leaf": {_json.encode_ascii(self.leaf)}, "box": [[{origin}], [{shape}]], "offset": {self.offset}, '
                f'"data_bytes": {self.data_bytes}, "data_crc32c": {self.data_crc32c}}}')

    @staticmethod
    def new(leaf: str, box: Box, offset: int, data_bytes: int, data_crc32c: int) -> PackedBoxRecord:
        """`PackedBoxRecord(leaf=..., ...)` without `extra`, made without the frozen
        dataclass's `__init__` (a save makes one per small chunk: 100,000 cost 0.25 s)."""
        out = object.__new__(PackedBoxRecord)
        out.__dict__.update(leaf=leaf, box=box, offset=offset, data_bytes=data_bytes, data_crc32c=data_crc32c, extra={})
        return out


def _packed_box(obj: object, where: str) -> PackedBoxRecord:
    """`_record_from_json(PackedBoxRecord, ...)` spelled out (a record holds one per small chunk)."""
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    known = ("leaf", "box", "offset", "data_bytes", "data_crc32c")
    try:
        leaf, box = _text(obj["leaf"]), _box(obj["box"])
        offset, data_bytes, crc = _count(obj["offset"]), _count(obj["data_bytes"]), _count(obj["data_crc32c"])
    except KeyError as e:
        raise CorruptCheckpointError(f"{where}: the field {e.args[0]!r} is missing") from e
    except (ValueError, TypeError, OverflowError) as e:
        raise CorruptCheckpointError(f"{where}: {e}") from e
    extra = {k: v for k, v in obj.items() if k not in known} if len(obj) > len(known) else {}
    return PackedBoxRecord(leaf=leaf, box=box, offset=offset, data_bytes=data_bytes, data_crc32c=crc, extra=extra)


def _packed_boxes(v: object) -> tuple[PackedBoxRecord, ...]:
    if not isinstance(v, list):
        raise ValueError(f"{v!r:.100} is not a list")
    return tuple(_packed_box(b, f"packed box {i}") for i, b in enumerate(v))


def _box_texts(boxes: Sequence[PackedBoxRecord]) -> list[str]:
    """`[b.json_text() for b in boxes]`, each distinct Box object formatted once (the
    chunks of the leaves of one layout share theirs)."""
    texts: dict[int, str] = {}  # id(box) -> its text; `boxes` keeps them alive
    out = []
    for b in boxes:
        if b.extra:
            out.append(b.json_text())
            continue
        box = b.box
        text = texts.get(id(box))
        if text is None:
            text = texts[id(box)] = f'[[{", ".join(map(str, box.origin))}], [{", ".join(map(str, box.shape))}]]'
        out.append(f'{{"leaf": {_json.encode_ascii(b.leaf)}, "box": {text}, "offset": {b.offset}, '
                   f'"data_bytes": {b.data_bytes}, "data_crc32c": {b.data_crc32c}}}')
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackRecord:
    """One process's pack of small leaves (`_pack`): `processes/<i>.json`'s `"packed"`
    and an entry of the manifest's `"packed"` list.

    Attributes:
      array: the pack's zarr array, relative to the checkpoint path (`packed/process-<i>`).
      key: its one chunk file, relative to the checkpoint path (`packed/process-<i>/c/0`).
      file_bytes: that file's size, bytes: the packed data and a 4-byte crc32c (JSON `"bytes"`).
      boxes: the chunks of packed leaves in it, in file order.
      extra: JSON fields this version does not know, kept as read.
    """

    array: str = _json_field("array", _text)
    key: str = _json_field("key", _text)
    file_bytes: int = _json_field("bytes", _count)
    boxes: tuple[PackedBoxRecord, ...] = _json_field("boxes", _packed_boxes, lambda bs: [b.to_json() for b in bs])
    extra: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        """The JSON object (`array`, `key`, `bytes`, `boxes`): a new dict each call, built
        once (a save writes it into its process record and the manifest, one entry per
        small chunk); its `boxes` list and their objects are shared between calls, not to
        be changed."""
        cached = self.__dict__.get("_json")
        if cached is None:
            cached = _record_to_json(self)
            # Each box's text made once, for the record and the manifest (`_json.EncodedObjects`).
            cached["boxes"] = _json.EncodedObjects(cached["boxes"], _box_texts(self.boxes))
            object.__setattr__(self, "_json", cached)  # frozen: a cache, not a field (not compared, not replaced)
        return dict(cached)

    @staticmethod
    def from_json(obj: object, where: str) -> PackRecord:
        """Parses one pack entry.

        Raises:
          CorruptCheckpointError: not an object, a field missing or of the wrong type.
        """
        return _record_from_json(PackRecord, obj, where)


def _pack(v: object) -> PackRecord:
    return PackRecord.from_json(v, "packed")


def _pack_list(v: object) -> tuple[PackRecord, ...]:
    if not isinstance(v, list):
        raise ValueError(f"{v!r:.100} is not a list")
    return tuple(PackRecord.from_json(p, f"packed reference {i}") for i, p in enumerate(v))


def _ref_list(v: object) -> tuple[dict, ...]:
    if not isinstance(v, list) or not all(isinstance(r, dict) and isinstance(r.get("leaf"), str) for r in v):
        raise ValueError(f"{v!r:.100} is not a list of references with a leaf")
    return tuple(v)


def _chunks(v: object) -> tuple[ChunkRecord, ...]:
    if not isinstance(v, list):
        raise ValueError(f"{v!r:.100} is not a list")
    return tuple(ChunkRecord.from_json(c, f"chunk {i}") for i, c in enumerate(v))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessRecord:
    """What one process wrote in one save: `processes/<i>.json`.

    Written once the process's chunks are durable; process 0 checks that every record
    exists before committing, and `verify` checks the chunks against them. Only `chunks`
    is required when read back. To add a field: one more optional `_json_field` (old
    records read as None; older readers keep it in `extra`).

    Attributes:
      process_index: the process that wrote it.
      generation: the save attempt (`_layout.new_generation`).
      chunks: the chunks it wrote, one per saved shard.
      bytes_written: sum of the chunks' `file_bytes`, bytes.
      snapshot_s: seconds the host snapshot took on that process.
      write_s: seconds the writes took on that process.
      per_process_state: the JSON value the process passed as `save(...,
        per_process_state=)`, or None (absent from the file) when it passed none.
      phases_unix_s: wall-clock spans of this process's save phases, phase name →
        (start, end) in seconds since the epoch (JSON `{"wait_for_arrays": [s, e],
        "snapshot": [s, e], "write": [s, e], "durable": [s, e]}`; `wait_for_arrays`
        runs from the save call until the leaves' computations are done
        (`jax.block_until_ready`), `snapshot` from there to the end of the host copy
        (the pre-save agreement included), `durable` ends when every chunk write has
        completed, before this record is written). None in records of older versions;
        records before `wait_for_arrays` have none (their `snapshot` starts at the
        save call and includes that wait).
      packed: the index of this process's pack of small leaves (`_pack`), or None
        (absent) when it packed nothing. The pack's chunk file is also one of `chunks`
        (`leaf` absent), so `bytes_written` and `verify` count it.
      write_mode: how it wrote its chunk files: "direct" (the library, `O_DIRECT`) or
        "buffered" (TensorStore); None (absent) in records of older versions.
      write_mode_reason: why that mode (`direct_io` and what the probe found).
      references: the chunks this process did not write because they are unchanged
        since an earlier checkpoint of the directory (incremental saves): each
        `{"leaf": path, **_references.ChunkRef.to_json()}`, parsed by the manifest's
        reader; None (absent) when there are none. Not in `chunks`.
      packed_references: the packed chunks this process did not write because they are
        unchanged (incremental saves): pack records with `"in"` and `"generation"`
        (kept in `PackRecord.extra`), each listing the referenced boxes of one pack of
        an earlier checkpoint, copied into the manifest's `packed`; None (absent) when
        there are none.
      packed_materialized: packs of this checkpoint besides `packed` (two tiers): the
        pack of a local step that a local step referenced, copied whole into its durable
        step (or its peer copy) as `packed/process-<i>.from-<step>`, listing the boxes
        this checkpoint reads there, with `"materialized_from": [step, generation]`; their
        files are also in `chunks`. None (absent) when there are none.
      extra: JSON fields this version does not know, kept as read.
    """

    process_index: int | None = _json_field("process_index", _count, default=None)
    generation: str | None = _json_field("generation", _text, default=None)
    chunks: tuple[ChunkRecord, ...] = _json_field("chunks", _chunks, lambda cs: [c.to_json() for c in cs])
    bytes_written: int | None = _json_field("bytes_written", _count, default=None)
    snapshot_s: float | None = _json_field("snapshot_s", _seconds, default=None)
    write_s: float | None = _json_field("write_s", _seconds, default=None)
    per_process_state: object = _json_field("per_process_state", lambda v: v, default=None)
    phases_unix_s: Mapping[str, tuple[float, float]] | None = _json_field(
        "phases_unix_s", parse_phases, phases_json, default=None
    )
    packed: PackRecord | None = _json_field("packed", _pack, PackRecord.to_json, default=None)
    write_mode: str | None = _json_field("write_mode", _text, default=None)
    write_mode_reason: str | None = _json_field("write_mode_reason", _text, default=None)
    references: tuple[dict, ...] | None = _json_field("references", _ref_list, list, default=None)
    packed_references: tuple[PackRecord, ...] | None = _json_field(
        "packed_references", _pack_list, lambda ps: [p.to_json() for p in ps], default=None)
    packed_materialized: tuple[PackRecord, ...] | None = _json_field(
        "packed_materialized", _pack_list, lambda ps: [p.to_json() for p in ps], default=None)
    extra: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        """The JSON object (fields in the order of format_version 1; None fields omitted)."""
        return _record_to_json(self)

    @property
    def own_packs(self) -> tuple[PackRecord, ...]:
        """Every pack of this checkpoint this process's record indexes: `packed`, then
        `packed_materialized`."""
        return ((self.packed,) if self.packed is not None else ()) + tuple(self.packed_materialized or ())

    @property
    def has_references(self) -> bool:
        """Whether it references chunks or packed chunks of earlier checkpoints."""
        return bool(self.references or self.packed_references)

    @staticmethod
    def from_json(obj: object, where: str) -> ProcessRecord:
        """Parses and validates a process record.

        Args:
          obj: the parsed JSON (`_json.loads`).
          where: the record's path, for messages.
        Raises:
          CorruptCheckpointError: not an object, `chunks` missing, or a field of the wrong type.
        """
        return _record_from_json(ProcessRecord, obj, where)


def read_process_record(storage: Storage, location: str) -> ProcessRecord:
    """Reads and parses the process record at `location` (`<path>/processes/<i>.json`).

    Raises:
      FileNotFoundError: no file at `location`.
      CorruptCheckpointError: larger than `_json.MAX_MANIFEST_BYTES`, not JSON, or
        not a valid record; names `location`.
    """
    try:
        data = storage.read_file(location, max_bytes=_json.MAX_MANIFEST_BYTES)
    except OSError as e:
        if e.errno != errno.EFBIG:
            raise
        raise CorruptCheckpointError(f"{location} is larger than {_json.MAX_MANIFEST_BYTES} bytes") from e
    return ProcessRecord.from_json(_json.loads(data, location), location)
