"""What a manifest says about each leaf: `ArrayMetadata` (shape, dtype, chunking, saved
sharding, packing) with its `SavedSharding` and `PackedBox`es, `ValueMetadata` for a
non-array leaf, and the checked parse of an array entry, within the bounds a manifest
may declare."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np

from .._errors import CorruptCheckpointError
from ._box import Box
from ._dtypes import dtype_from_name, dtype_name
from ._references import ChunkRef
from ._shard_file import ShardFileLayout

# Bound on what a manifest may declare, checked before anything is allocated.
MAX_ARRAY_BYTES = 1 << 50
MAX_RANK = 32
# Chunks of one leaf: one per saved shard, so at most one per device that held it.
MAX_CHUNKS_PER_LEAF = 1 << 18
# Inner chunks of one zarr shard file (its index is 16 bytes per inner chunk): a chunk
# of MAX_ARRAY_BYTES in 1 MiB inner chunks. Restore checks the files' real sizes too.
MAX_INNER_CHUNKS_PER_CHUNK = 1 << 30


@dataclasses.dataclass(frozen=True)
class SavedSharding:
    """How a leaf was sharded when saved (informational; restore needs only the chunks).

    Attributes:
      kind: `"named"` (a NamedSharding), `"single_device"` or `"other"`.
      mesh_axis_names: mesh axis names, for `"named"`.
      mesh_shape: mesh axis sizes, for `"named"`.
      spec: the PartitionSpec, each entry None, an axis name or a tuple of axis names.
      shard_shape: the per-device shard shape.
      device_count: number of devices the array spanned.
    """

    kind: str
    mesh_axis_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    spec: tuple
    shard_shape: tuple[int, ...]
    device_count: int

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "mesh_axis_names": list(self.mesh_axis_names),
            "mesh_shape": list(self.mesh_shape),
            "spec": [list(s) if isinstance(s, tuple) else s for s in self.spec],
            "shard_shape": list(self.shard_shape),
            "device_count": self.device_count,
        }

    @staticmethod
    def from_json(obj: Mapping) -> SavedSharding:
        spec = tuple(tuple(s) if isinstance(s, list) else s for s in obj["spec"])
        return SavedSharding(
            kind=str(obj["kind"]),
            mesh_axis_names=tuple(str(a) for a in obj["mesh_axis_names"]),
            mesh_shape=tuple(int(a) for a in obj["mesh_shape"]),
            spec=spec,
            shard_shape=tuple(int(a) for a in obj["shard_shape"]),
            device_count=int(obj["device_count"]),
        )

    def describe(self) -> str:
        """E.g. `P('data', 'model') on mesh data=2 x model=4`."""
        if self.kind != "named":
            return f"{self.kind} ({self.device_count} devices, shard {list(self.shard_shape)})"
        spec = ", ".join(repr(s) for s in self.spec)
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_axis_names, self.mesh_shape))
        return f"P({spec}) on mesh {mesh}"


@dataclasses.dataclass(frozen=True)
class ArrayMetadata:
    """What the manifest says about one array leaf.

    Attributes:
      path: the leaf path.
      shape: the global shape.
      dtype: the stored numpy dtype (for PRNG keys, the key data's dtype).
      chunk_shape: the zarr chunk shape: the saved shard shape, or a regular subdivision
        of it (replica-parallel writes, the leaf-by-leaf writer).
      inner_chunk_shape: the inner chunk shape inside each zarr shard file.
      saved_sharding: how it was sharded when saved, or None for a host numpy array.
      key_impl: the PRNG impl name (e.g. `"threefry2x32"`) when the leaf is a typed PRNG
        key array; `shape` then includes the key data's trailing dimensions.
      kind: `"jax"` (restored as jax.Array) or `"numpy"` (a host numpy array when saved).
      keystr: the leaf's key path as `jax.tree_util.keystr` prints it (`['params']['w']`),
        the name to show users; set when read from a manifest (None before the save
        writes one). Not stored in the leaf's entry and not compared.
      packed: the leaf's chunks are boxes in the processes' packs (`packed/process-<i>`,
        see `_pack`), not a zarr array of its own (JSON `"packed": true`, absent when
        False).
      pack_boxes: where each chunk of a packed leaf lies in the packs, from the
        manifest's `packed` section (empty before a manifest exists, and for leaves
        that are not packed). Not stored in the leaf's entry and not compared.
      references: chunk cell -> `ChunkRef` of the chunks that live in an earlier
        checkpoint of the same directory (incremental saves; the entry's
        `"references"`, written by `manifest_json`). Not compared.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    saved_sharding: SavedSharding | None
    key_impl: str | None = None
    kind: str = "jax"
    keystr: str | None = dataclasses.field(default=None, compare=False)
    packed: bool = False
    pack_boxes: tuple[PackedBox, ...] = dataclasses.field(default=(), compare=False, repr=False)
    references: Mapping[tuple[int, ...], ChunkRef] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def source_of(self, chunk: tuple[int, ...]) -> str | None:
        """The sibling checkpoint folder that holds chunk `chunk` (a reference of an
        incremental save, `_references`), or None: this checkpoint holds it."""
        ref = self.references.get(tuple(chunk)) if self.references else None
        return None if ref is None else ref.folder

    @property
    def nbytes(self) -> int:
        """Bytes of the array's data (shape × itemsize)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def layout(self) -> ShardFileLayout:
        """The byte layout of each of its zarr shard files (every chunk has the same)."""
        return ShardFileLayout(self.chunk_shape, self.inner_chunk_shape, self.dtype.itemsize)

    def to_json(self) -> dict:
        return {
            "type": "array",
            "kind": self.kind,
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "chunk_shape": list(self.chunk_shape),
            "inner_chunk_shape": list(self.inner_chunk_shape),
            "saved_sharding": self.saved_sharding.to_json() if self.saved_sharding else None,
            "key_impl": self.key_impl,
        } | ({"packed": True} if self.packed else {})


@dataclasses.dataclass(frozen=True)
class PackedBox:
    """Where one chunk of a packed leaf lies: a byte range of a pack's chunk file.

    Attributes:
      key: the pack's chunk file, relative to the checkpoint path
        (`packed/process-<i>/c/0`).
      file_bytes: the size that file must have, bytes (its data and the 4-byte crc32c
        the pack's codec appends).
      box: the chunk's region of the global array.
      offset: where its C-order bytes start in the file, bytes.
      nbytes: their length, bytes (box size × itemsize).
      crc32c: crc32c of those bytes.
      folder: None, or (incremental saves, format_version 2) the sibling checkpoint
        whose pack holds the chunk (the manifest's pack record `"in"`); `key` is then
        `_references.pack_ref_key(folder, its key there)`, read through `pack_file`.
      generation: with `folder`: the save attempt of that checkpoint referenced.
      xxh3_128: with `folder`: XXH3-128 of the chunk's bytes, or None (unknown).
    """

    key: str
    file_bytes: int
    box: Box
    offset: int
    nbytes: int
    crc32c: int
    folder: str | None = None
    generation: str | None = None
    xxh3_128: str | None = None


@dataclasses.dataclass(frozen=True)
class ValueMetadata:
    """A non-array leaf stored in the manifest (None, bool, int, float, complex, str, numpy scalar).

    Attributes:
      path: the leaf path.
      value: the value.
      keystr: as `ArrayMetadata.keystr`.
    """

    path: str
    value: object
    keystr: str | None = dataclasses.field(default=None, compare=False)


def _shape(v: object, what: str, where: str | Callable[[], str]) -> tuple[int, ...]:
    # `type(i) is int`: not bool (JSON parses integers as int exactly).
    if type(v) is not list or len(v) > MAX_RANK or not all(type(i) is int and 0 <= i < 1 << 62 for i in v):
        raise CorruptCheckpointError(f"malformed {what} {v!r} in {where if isinstance(where, str) else where()}")
    return tuple(v)


_DTYPES: dict[str, np.dtype] = {}  # dtype names parsed so far (a manifest names a few, once per leaf)


def _dtype(name: object, where: Callable[[], str]) -> np.dtype:
    dtype = _DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        dtype = dtype_from_name(name, where=where())
        _DTYPES[str(name)] = dtype
    return dtype


_T = TypeVar("_T")


def with_fields(obj: _T, **fields: object) -> _T:
    """`dataclasses.replace(obj, **fields)` for a dataclass whose `__init__` only assigns
    (no `__post_init__`, no slots, frozen or not) and fields that need no checks: a copy of
    its attributes instead of `__init__` (a third of the cost). For objects made once per
    leaf of a large tree (the manifest's parser, the snapshot: 100,000 leaves cost 0.25 s
    by `replace`). Mutable defaults are shared with `obj` unless given."""
    out = object.__new__(type(obj))
    out.__dict__.update(obj.__dict__)
    out.__dict__.update(fields)
    return out


def array_metadata_from_json(path: str, obj: object, where: str) -> ArrayMetadata:
    """Parses and validates one array entry of a manifest.

    Raises:
      CorruptCheckpointError: a field is missing, of the wrong type or absurd.
    """
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"leaf {path!r} in {where}: entry is not an object")

    def place() -> str:  # for messages only: formatted when one is raised
        return f"leaf {path!r} in {where}"

    shape = _shape(obj.get("shape"), "shape", place)
    chunk = _shape(obj.get("chunk_shape"), "chunk_shape", place)
    inner = _shape(obj.get("inner_chunk_shape"), "inner_chunk_shape", place)
    dtype = _dtype(obj.get("dtype"), place)
    if not (len(shape) == len(chunk) == len(inner)) or any(
        c < 1 or i < 1 or c % i or c > max(1, s) for s, c, i in zip(shape, chunk, inner)
    ):
        raise CorruptCheckpointError(f"{place()}: chunk_shape {chunk} and inner_chunk_shape {inner} do not fit shape {shape}")
    if math.prod(shape) * dtype.itemsize > MAX_ARRAY_BYTES:
        raise CorruptCheckpointError(f"{place()}: shape {shape} of {dtype} declares more than {MAX_ARRAY_BYTES} bytes")
    n_chunks = math.prod(-(-s // c) for s, c in zip(shape, chunk))
    n_inner = math.prod(c // i for c, i in zip(chunk, inner))
    if n_chunks > MAX_CHUNKS_PER_LEAF or n_inner > MAX_INNER_CHUNKS_PER_CHUNK:
        raise CorruptCheckpointError(
            f"{place()}: chunk_shape {chunk} and inner_chunk_shape {inner} declare {n_chunks} chunks of {n_inner} "
            f"inner chunks (at most {MAX_CHUNKS_PER_LEAF} chunks, {MAX_INNER_CHUNKS_PER_CHUNK} inner chunks each)"
        )
    key_impl = obj.get("key_impl")
    if key_impl is not None and not isinstance(key_impl, str):
        raise CorruptCheckpointError(f"{place()}: key_impl must be a string")
    kind = obj.get("kind", "jax")
    if kind not in ("jax", "numpy"):
        raise CorruptCheckpointError(f"{place()}: unknown array kind {kind!r}")
    try:
        sharding = SavedSharding.from_json(obj["saved_sharding"]) if obj.get("saved_sharding") else None
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise CorruptCheckpointError(f"{place()}: malformed saved_sharding ({e})") from e
    packed = obj.get("packed", False)
    if not isinstance(packed, bool):
        raise CorruptCheckpointError(f"{place()}: packed must be true or false")
    return ArrayMetadata(path, shape, dtype, chunk, inner, sharding, key_impl, kind, packed=packed)
