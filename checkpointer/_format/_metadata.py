"""The JSON schemas of a checkpoint, each writer beside its reader.

- `manifest.json` (process 0, at commit): `manifest_json` writes it, `parse_manifest`
  validates it into `CheckpointMetadata`; `metadata` / `read_metadata` read it.
- `processes/<i>.json` (each process, once its chunks are durable): `ProcessRecord`
  with its `ChunkRecord`s, `to_json` / `from_json`.

Readers never fail on a field they do not know (format changes are additive): the
manifest parser ignores it, a `ProcessRecord` keeps it in `extra` and writes it back.
Needs no devices: a checkpoint saved by 8 processes × 4 devices is described on a laptop.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import importlib.metadata
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .._errors import CheckpointNotFoundError, CorruptCheckpointError
from .._storage import Storage, storage_for
from . import _layout
from ._box import Box
from ._layout import ArrayMetadata, ValueMetadata
from ._tree import check_leaf_path, keystrs, leaf_paths_of, rebuild

DISTRIBUTION = "checkpointer"


@functools.cache
def library_version() -> str:
    """The installed checkpointer's version (`importlib.metadata`), recorded in each
    manifest; `"0+unknown"` when the package runs from a source tree without being
    installed (a local version label, so it sorts below every release)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


# --- processes/<i>.json ---------------------------------------------------------------------


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
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{v!r:.100} is not a number of seconds")
    return v


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
      data_crc32c: crc32c of the chunk's C-order bytes (`_layout.data_crc32c`).
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
      data_crc32c: crc32c of those bytes (`_layout.data_crc32c`).
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
        """The JSON object (`array`, `key`, `bytes`, `boxes`)."""
        return _record_to_json(self)

    @staticmethod
    def from_json(obj: object, where: str) -> PackRecord:
        """Parses one pack entry.

        Raises:
          CorruptCheckpointError: not an object, a field missing or of the wrong type.
        """
        return _record_from_json(PackRecord, obj, where)


def _pack(v: object) -> PackRecord:
    return PackRecord.from_json(v, "packed")


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
    extra: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        """The JSON object (fields in the order of format_version 1; None fields omitted)."""
        return _record_to_json(self)

    @staticmethod
    def from_json(obj: object, where: str) -> ProcessRecord:
        """Parses and validates a process record.

        Args:
          obj: the parsed JSON (`_layout.loads`).
          where: the record's path, for messages.
        Raises:
          CorruptCheckpointError: not an object, `chunks` missing, or a field of the wrong type.
        """
        return _record_from_json(ProcessRecord, obj, where)


def read_process_record(storage: Storage, location: str) -> ProcessRecord:
    """Reads and parses the process record at `location` (`<path>/processes/<i>.json`).

    Raises:
      FileNotFoundError: no file at `location`.
      CorruptCheckpointError: larger than `_layout.MAX_MANIFEST_BYTES`, not JSON, or
        not a valid record; names `location`.
    """
    try:
        data = storage.read_file(location, max_bytes=_layout.MAX_MANIFEST_BYTES)
    except OSError as e:
        if e.errno != errno.EFBIG:
            raise
        raise CorruptCheckpointError(f"{location} is larger than {_layout.MAX_MANIFEST_BYTES} bytes") from e
    return ProcessRecord.from_json(_layout.loads(data, location), location)


# --- manifest.json ---------------------------------------------------------------------------


def manifest_json(
    *,
    step: int | None,
    generation: str,
    process_count: int,
    process_bytes_written: Sequence[int],
    structure: dict,
    arrays: Sequence[ArrayMetadata],
    values: Mapping[str, dict],
    user_metadata: Mapping,
    created_unix_s: float | None = None,
    save_phases_unix_s: Mapping[str, tuple[float, float]] | None = None,
    packed: Sequence[PackRecord] = (),
    packed_processes: Sequence[int] | None = None,
) -> dict:
    """The manifest of DESIGN.md's format_version 1 (what `parse_manifest` reads).

    Args:
      step: the training step, or None.
      generation: the save attempt.
      process_count: processes that saved.
      process_bytes_written: bytes of chunk files each process wrote, by process index.
      structure: the JSON tree structure (`_tree.describe`).
      arrays: the array leaves' metadata.
      values: leaf path → `_layout.value_to_json` of each non-array leaf.
      user_metadata: the `metadata=` dict.
      created_unix_s: the creation time, seconds since the epoch (default: now).
      save_phases_unix_s: process 0's phases before the manifest, name → (start, end)
        in seconds since the epoch (`{"wait": ...}`: from its own record to every
        process's "durable" report); stored as `"save_phases_unix_s"` when given
        (additive: readers ignore it, `_timeline` draws it).
      packed: every process's pack index (`ProcessRecord.packed`), stored as
        `"packed"` when there is one (additive; see `_pack`).
      packed_processes: None (a committed checkpoint's manifest: `packed` is every
        process's). A list: the processes whose packs `packed` holds, the others'
        chunks are not indexed (a two-tier local copy; stored as `"packed_processes"`).
    """
    import jax

    leaves = {m.path: m.to_json() for m in arrays}
    leaves.update({p: {"type": "value", "value": v} for p, v in values.items()})
    out: dict[str, object] = {
        "format_version": _layout.FORMAT_VERSION,
        "step": step,
        "generation": generation,
        "created_unix_s": time.time() if created_unix_s is None else created_unix_s,
        "process_count": process_count,
        "process_bytes_written": list(process_bytes_written),
        "structure": structure,
        "leaves": leaves,
        "user_metadata": user_metadata,
        "library_version": library_version(),
        "jax_version": jax.__version__,
    }
    if save_phases_unix_s is not None:
        out["save_phases_unix_s"] = phases_json(save_phases_unix_s)
    if packed:
        out["packed"] = [p.to_json() for p in packed]
    if packed_processes is not None:
        out["packed_processes"] = list(packed_processes)
    return out


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a committed checkpoint holds, read from its manifest.

    Attributes:
      path: the checkpoint path.
      step: the training step, or None if the save gave none.
      format_version: the on-disk format version (1).
      tree: the saved tree with each leaf replaced by its `ArrayMetadata` or
        `ValueMetadata` (containers rebuilt as in a target-less restore).
      leaves: leaf path → `ArrayMetadata` | `ValueMetadata`, in tree order. The leaf
        path is the escaped storage name (`mlp%2F~%2Flinear_0/w`); show users each
        entry's `.keystr` (`['mlp/~/linear_0']['w']`), or `keystr(leaf_path)`.
      user_metadata: the `metadata=` / `metrics=` dict given at save time.
      process_count: how many processes saved it.
      process_bytes_written: bytes of chunk files each process wrote.
      created_unix_s: when the manifest was written, seconds since the epoch.
      library_version: checkpointer version that wrote it.
      jax_version: JAX version that wrote it.
      structure: the raw JSON tree structure.
    """

    path: str
    step: int | None
    format_version: int
    tree: object
    leaves: dict[str, ArrayMetadata | ValueMetadata]
    user_metadata: dict
    process_count: int
    process_bytes_written: tuple[int, ...]
    created_unix_s: float
    library_version: str
    jax_version: str
    structure: dict

    @property
    def total_bytes(self) -> int:
        """Bytes of all array data (sum of shape × itemsize)."""
        return sum(m.nbytes for m in self.leaves.values() if isinstance(m, ArrayMetadata))

    @property
    def arrays(self) -> dict[str, ArrayMetadata]:
        """The array leaves only."""
        return {p: m for p, m in self.leaves.items() if isinstance(m, ArrayMetadata)}

    def keystr(self, leaf_path: str) -> str:
        """The user's name of a leaf: its key path as `jax.tree_util.keystr` prints it.

        Args:
          leaf_path: a key of `leaves` (the escaped storage name).
        Returns:
          E.g. `"['mlp/~/linear_0']['w']"` for the leaf path `"mlp%2F~%2Flinear_0/w"`,
          `".params['dense']['kernel']"` under a flax `TrainState`; `""` for a root leaf.
        Raises:
          KeyError: no such leaf path.
        """
        name = self.leaves[leaf_path].keystr
        return name if name is not None else leaf_path


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _require(cond: bool, what: str, where: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"manifest of {where}: {what}")


def parse_manifest(raw: object, where: str) -> CheckpointMetadata:
    """Validates a parsed manifest; every failure is a `CorruptCheckpointError`."""
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"manifest of {where}: not a JSON object")
    version = raw.get("format_version")
    if not _is_int(version) or version != _layout.FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where} has format_version {version!r}; this library reads format_version "
            f"{_layout.FORMAT_VERSION}. Upgrade checkpointer to read newer checkpoints."
        )
    step = raw.get("step")
    _require(step is None or _is_int(step), f"step {step!r:.100} is not an int", where)
    leaves_raw = raw.get("leaves")
    if not isinstance(leaves_raw, dict):
        raise CorruptCheckpointError(f"manifest of {where}: 'leaves' is not an object")
    structure = raw.get("structure")
    if not isinstance(structure, dict):
        raise CorruptCheckpointError(f"manifest of {where}: 'structure' is not an object")
    user_metadata = raw.get("user_metadata", {})
    _require(isinstance(user_metadata, dict), "'user_metadata' is not an object", where)
    pcount = raw.get("process_count", 1)
    _require(_is_int(pcount) and pcount >= 1, f"process_count {pcount!r:.100} is invalid", where)
    pbytes = raw.get("process_bytes_written", [])
    _require(
        isinstance(pbytes, list) and all(_is_int(b) and 0 <= b <= _layout.MAX_ARRAY_BYTES for b in pbytes),
        "'process_bytes_written' is not a list of byte counts",
        where,
    )
    created = raw.get("created_unix_s", 0.0)
    _require(
        (isinstance(created, (int, float)) and not isinstance(created, bool)) and math.isfinite(created),
        "'created_unix_s' is not a number",
        where,
    )

    leaves: dict[str, ArrayMetadata | ValueMetadata] = {}
    for path, entry in leaves_raw.items():
        check_leaf_path(path, where=where)
        _require(isinstance(entry, dict), f"leaf {path!r} is not an object", where)
        if entry.get("type") == "array":
            leaves[path] = _layout.array_metadata_from_json(path, entry, where)
        elif entry.get("type") == "value":
            leaves[path] = ValueMetadata(path, _layout.value_from_json(entry.get("value"), f"leaf {path!r} in {where}"))
        else:
            raise CorruptCheckpointError(f"leaf {path!r} in {where} has unknown type {entry.get('type')!r}")
    ordered = leaf_paths_of(structure)
    _require(sorted(ordered) == sorted(leaves), "the tree structure and the leaves disagree", where)
    _attach_pack_boxes(raw.get("packed", []), leaves, where, complete="packed_processes" not in raw)
    names = keystrs(structure)
    leaves = {p: dataclasses.replace(leaves[p], keystr=names[p]) for p in ordered}
    tree = rebuild(structure, lambda p: leaves[p], where=where)
    return CheckpointMetadata(
        path=where, step=step, format_version=version, tree=tree, leaves=leaves, user_metadata=user_metadata,
        process_count=pcount, process_bytes_written=tuple(pbytes), created_unix_s=float(created),
        library_version=str(raw.get("library_version", "")), jax_version=str(raw.get("jax_version", "")),
        structure=structure,
    )


def _attach_pack_boxes(raw: object, leaves: dict[str, ArrayMetadata | ValueMetadata], where: str, complete: bool = True) -> None:
    """Parses the manifest's `packed` section and sets each packed leaf's `pack_boxes`
    (in place); every chunk of a packed leaf must be in exactly one pack, in bounds
    (`complete=False`, a local tier's copy indexing its own process's pack: at most one).

    A hand-rolled parse (not `PackRecord.from_json`): it runs on every restore, over
    one entry per small chunk (5,000 for issue 15's 2,000 leaves)."""
    _require(isinstance(raw, list), "'packed' is not a list", where)
    found: dict[str, list[_layout.PackedBox]] = {}
    assert isinstance(raw, list)
    for i, pack in enumerate(raw):
        loc = f"packed[{i}]"
        _require(isinstance(pack, dict) and isinstance(pack.get("key"), str) and isinstance(pack.get("boxes"), list),
                 f"{loc} is not an object with 'key' and 'boxes'", where)
        key, file_bytes = pack["key"], pack.get("bytes")
        _require(_is_int(file_bytes) and file_bytes >= 4, f"{loc}: 'bytes' {file_bytes!r:.100} is not a size", where)
        check_leaf_path(key, where=where)
        for j, b in enumerate(pack["boxes"]):
            try:
                leaf, (origin, shape), offset, nbytes, crc = b["leaf"], b["box"], b["offset"], b["data_bytes"], b["data_crc32c"]
                box = Box(tuple(origin), tuple(shape))
            except (KeyError, TypeError, ValueError, OverflowError) as e:
                raise CorruptCheckpointError(f"manifest of {where}: {loc} box {j} is malformed ({e})") from e
            m = leaves.get(leaf) if isinstance(leaf, str) else None
            _require(isinstance(m, ArrayMetadata) and m.packed, f"{loc} box {j}: {leaf!r:.100} is not a packed array leaf", where)
            assert isinstance(m, ArrayMetadata)
            ok = type(offset) is int and type(nbytes) is int and type(crc) is int and offset >= 0 and crc >= 0
            ok = ok and len(box.origin) == len(box.shape) == len(m.shape) and offset + nbytes <= file_bytes - 4
            size = m.dtype.itemsize
            for o, s, c, n in zip(box.origin, box.shape, m.chunk_shape, m.shape):
                ok = ok and type(o) is int and type(s) is int and 0 <= o < n and o % c == 0 and s == min(c, n - o)
                size = size * s if ok else -1  # never `*=` a str or list from a hostile manifest
            _require(ok and nbytes == size, f"{loc} box {j} of leaf {leaf!r} does not fit the leaf's chunk grid or the pack's size", where)
            found.setdefault(leaf, []).append(_layout.PackedBox(key, file_bytes, box, offset, nbytes, crc))
    for path, m in leaves.items():
        if isinstance(m, ArrayMetadata) and m.packed:
            boxes = found.get(path, [])
            n_chunks = math.prod(-(-s // c) for s, c in zip(m.shape, m.chunk_shape)) if math.prod(m.shape) else 0
            _require(len({b.box for b in boxes}) == len(boxes) and (len(boxes) == n_chunks or not complete and len(boxes) <= n_chunks),
                     f"packed leaf {path!r} has {len(boxes)} boxes in the packs, expected one per chunk ({n_chunks})", where)
            leaves[path] = dataclasses.replace(m, pack_boxes=tuple(sorted(boxes, key=lambda b: b.box.origin)))


def read_metadata(storage: Storage, path: str) -> CheckpointMetadata:
    """Reads the manifest of the committed checkpoint at `path`.

    Raises:
      CheckpointNotFoundError: no commit marker at `path`.
      CorruptCheckpointError: the manifest is missing or malformed.
    """
    if not storage.exists(f"{path}/{_layout.COMMITTED}"):
        parent, name = path.rstrip("/").rsplit("/", 1)
        partials = [n for n in storage.list_dir(parent) if (_layout.parse_partial_name(n) or ("",))[0] == name]
        hint = (
            f" Found uncommitted save attempts {partials}: they crashed or are still writing, and are not checkpoints."
            if partials
            else " Check the path, or list committed steps with `checkpointer ls DIR`."
        )
        raise CheckpointNotFoundError(f"no committed checkpoint at {path}: the commit marker {_layout.COMMITTED} is absent.{hint}")
    try:
        data = storage.read_file(f"{path}/{_layout.MANIFEST}", max_bytes=_layout.MAX_MANIFEST_BYTES)
    except (FileNotFoundError, IsADirectoryError) as e:
        raise CorruptCheckpointError(f"{path} is marked committed but has no {_layout.MANIFEST} file") from e
    except OSError as e:
        if e.errno != errno.EFBIG:
            raise
        raise CorruptCheckpointError(f"{path}/{_layout.MANIFEST} is larger than {_layout.MAX_MANIFEST_BYTES} bytes") from e
    return parse_manifest(_layout.loads(data, f"{path}/{_layout.MANIFEST}"), path)


def metadata(path: str | os.PathLike) -> CheckpointMetadata:
    """Returns the metadata of the committed checkpoint at `path`.

    Reads only `manifest.json`; needs no devices, whatever mesh saved the checkpoint.

    Args:
      path: a checkpoint path (local, `file://`, `memory://`, `gs://`, `s3://`).
    Returns:
      A `CheckpointMetadata` (step, per-leaf shape/dtype/chunking/saved sharding, user
      metadata, process count, versions).
    Raises:
      CheckpointNotFoundError: `path` has no commit marker.
      CorruptCheckpointError: the manifest is malformed.

    Multi-process: any process may call it alone.
    """
    storage, path = storage_for(path)
    return read_metadata(storage, path)
