"""The on-disk format (format_version 1): names, manifest schema and zarr array specs.

```
<path>/
  manifest.json          written last but one, by process 0
  arrays/<leaf path>/    one zarr v3 array per array leaf
  processes/<i>.json     what process i wrote
  COMMITTED              the commit marker, written last
<path>.partial-<generation>/   a save in flight or a crashed one
<path>.deleting-<generation>/  a replaced checkpoint being removed (overwrite, POSIX)
```
A generation names one save attempt: `<UTC yyyymmddHHMMSS>-<8 hex>` (`new_generation`).
Every chunk is stored (`store_data_equal_to_fill_value`), so a missing zarr shard file is
damage, never fill values. Each inner chunk and each shard index carries `crc32c`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import re
import struct
import uuid
from collections.abc import Mapping, Sequence
from typing import Literal

import crc32c
import numpy as np

from .._errors import CorruptCheckpointError
from ._box import Box
from ._tree import check_leaf_path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COMMITTED = "COMMITTED"
ARRAYS = "arrays"
PROCESSES = "processes"
PARTIAL_INFIX = ".partial-"
DELETING_INFIX = ".deleting-"
# strftime pattern of a generation's time part (UTC), and its length in characters.
GENERATION_TIME_FORMAT = "%Y%m%d%H%M%S"
GENERATION_TIME_CHARS = 14

# Bound on what a manifest may declare, checked before anything is allocated.
MAX_ARRAY_BYTES = 1 << 50
MAX_RANK = 32
MAX_MANIFEST_BYTES = 1 << 30
# Chunks of one leaf: one per saved shard, so at most one per device that held it.
MAX_CHUNKS_PER_LEAF = 1 << 18
# Inner chunks of one zarr shard file (its index is 16 bytes per inner chunk): a chunk
# of MAX_ARRAY_BYTES in 1 MiB inner chunks. Restore checks the files' real sizes too.
MAX_INNER_CHUNKS_PER_CHUNK = 1 << 30

# Inner chunks aim at 1/16 of the chunk within these bounds; see `inner_chunk_shape`.
INNER_CHUNK_TARGET_BYTES = 1 << 20
INNER_CHUNK_MIN_BYTES = 16 << 10
INNER_CHUNKS_PER_CHUNK = 16
MAX_SPLIT_FACTOR = 7
# Hard ceiling on an inner chunk, far below the 2 GiB that one read() system call
# returns on Linux and that many zarr codecs/readers handle; see `inner_chunk_shape`.
MAX_INNER_CHUNK_BYTES = 64 << 20

# Generations are parsed more loosely than `new_generation` writes them: any lowercase
# letters, digits and dashes (folders left by earlier versions or by hand stay visible).
_PARTIAL_RE = re.compile(rf"(?P<name>.+){re.escape(PARTIAL_INFIX)}(?P<generation>[0-9a-z-]+)")
_DELETING_RE = re.compile(rf"(?P<name>.+?){re.escape(DELETING_INFIX)}(?P<generation>.+)")


def new_generation(now: datetime.datetime | None = None) -> str:
    """A fresh save-attempt id: `<UTC yyyymmddHHMMSS>-<8 hex>`, e.g. `20260101120000-0a1b2c3d`.

    Args:
      now: the time to stamp (default: the current UTC time).
    Returns:
      The generation; sorting generations of one path sorts them by start time (to the
      second), and the 32 random bits tell apart attempts started in the same second.

    Multi-process: every process may call it; a save uses process 0's (agreed on through
    `_agreement.agree`).
    """
    now = datetime.datetime.now(datetime.timezone.utc) if now is None else now.astimezone(datetime.timezone.utc)
    return f"{now:{GENERATION_TIME_FORMAT}}-{uuid.uuid4().hex[:8]}"


def generation_time(generation: str) -> datetime.datetime | None:
    """When save attempt `generation` started (UTC, to the second), or None if its name
    does not start with a timestamp (generations of older or hand-made folders)."""
    try:
        t = datetime.datetime.strptime(generation[:GENERATION_TIME_CHARS], GENERATION_TIME_FORMAT)
    except ValueError:
        return None
    return t.replace(tzinfo=datetime.timezone.utc)


def is_step_name(name: str) -> bool:
    """Whether `name` is the canonical decimal of a step: ASCII digits, no sign, no
    leading zero ('0' itself is canonical). '0900000', '+5', '²' or '٣' are not steps:
    such folders are foreign, ignored by readers and never deleted."""
    return name.isascii() and name.isdigit() and (name == "0" or not name.startswith("0"))


def partial_name(name: str, generation: str) -> str:
    """The folder name of save attempt `generation` of checkpoint `name`."""
    return f"{name}{PARTIAL_INFIX}{generation}"


def parse_partial_name(name: str) -> tuple[str, str] | None:
    """`("100", generation)` for `"100.partial-<generation>"`, else None."""
    m = _PARTIAL_RE.fullmatch(name)
    return (m["name"], m["generation"]) if m else None


def deleting_name(name: str, generation: str) -> str:
    """The folder name checkpoint `name` is moved to while save `generation` replaces it."""
    return f"{name}{DELETING_INFIX}{generation}"


def parse_deleting_name(name: str) -> tuple[str, str] | None:
    """`("100", suffix)` for `"100.deleting-<suffix>"` (the first `.deleting-` splits), else None."""
    m = _DELETING_RE.fullmatch(name)
    return (m["name"], m["generation"]) if m else None


def array_dir(leaf_path: str) -> str:
    """The folder of a leaf's zarr array, relative to the checkpoint path."""
    check_leaf_path(leaf_path)
    return f"{ARRAYS}/{leaf_path}" if leaf_path else f"{ARRAYS}/%root"


def process_record_name(process_index: int) -> str:
    return f"{PROCESSES}/{process_index}.json"


# --- dtypes --------------------------------------------------------------------------------


def dtype_name(dtype: np.dtype) -> str:
    """The zarr v3 / TensorStore data type name of a numpy (or ml_dtypes) dtype."""
    return _dtype_name(np.dtype(dtype))


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name  # ~20 µs in numpy (a regex per call); a save names every leaf's dtype


def dtype_from_name(name: object, *, where: str = "") -> np.dtype:
    """The numpy dtype for a stored dtype name (ml_dtypes names included; any JSON value
    is accepted and refused unless it names a numeric dtype)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16, float8_*, int4 with numpy)

    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_]+", name):
        raise CorruptCheckpointError(f"malformed dtype {name!r} in {where}")
    try:
        dtype = np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    except TypeError as e:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in {where}") from e
    if not is_numeric_dtype(dtype) or dtype.itemsize == 0 or dtype.name != name:
        raise CorruptCheckpointError(f"dtype {name!r} in {where} is not a numeric array dtype")
    return dtype


def is_numeric_dtype(dtype: np.dtype) -> bool:
    """Whether `dtype` is bool, integer, floating or complex, ml_dtypes' included
    (bfloat16, float8_*, int4, ...): the dtypes an array leaf may have."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" or dtype.type.__module__ == "ml_dtypes"


DTypeKind = Literal["b", "i", "f", "c"]
_NUMPY_KINDS: dict[str, DTypeKind] = {"b": "b", "i": "i", "u": "i", "f": "f", "c": "c"}


def dtype_kind(dtype: np.dtype) -> DTypeKind | None:
    """'b' bool, 'i' integer (signed or unsigned, int4 too), 'f' floating (bfloat16,
    float8_* too), 'c' complex; None for anything else. (numpy.can_cast's "same_kind"
    is not used: it allows int to float and, through ml_dtypes, float32 to int4.)"""
    import ml_dtypes

    dtype = np.dtype(dtype)
    if dtype.kind in _NUMPY_KINDS:
        return _NUMPY_KINDS[dtype.kind]
    try:
        ml_dtypes.iinfo(dtype)
        return "i"
    except (ValueError, TypeError):
        pass
    try:
        ml_dtypes.finfo(dtype)
        return "f"
    except (ValueError, TypeError):
        return None


def is_whole_byte_dtype(dtype: np.dtype) -> bool:
    """Whether each element fills its `itemsize` bytes: False for the packed sub-byte
    dtypes (int4, int2, float4_e2m1fn, ...), whose bits per element are fewer."""
    import ml_dtypes

    dtype = np.dtype(dtype)
    if dtype.kind in "bc":
        return True
    for info in (ml_dtypes.finfo, ml_dtypes.iinfo, np.finfo, np.iinfo):
        try:
            return info(dtype).bits == dtype.itemsize * 8
        except (ValueError, TypeError):
            continue
    return False


@functools.cache
def zarr_supports_dtype(dtype: np.dtype) -> bool:
    """Whether TensorStore's zarr3 driver can store `dtype` (e.g. int4: yes; uint4: no)."""
    import tensorstore as ts

    try:
        ts.Spec({"driver": "zarr3", "kvstore": "memory://", "metadata": zarr_metadata((1,), dtype, (1,), (1,))})
    except ValueError:
        return False
    return True


# --- chunking rule ------------------------------------------------------------------------


def _smallest_prime_factor(n: int) -> int:
    for p in range(2, int(math.isqrt(n)) + 1):
        if n % p == 0:
            return p
    return n


def inner_chunk_target_bytes(chunk_bytes: int) -> int:
    """The inner chunk size to aim for: 1/16 of the chunk, clamped to [16 KiB, 1 MiB]."""
    return min(INNER_CHUNK_TARGET_BYTES, max(INNER_CHUNK_MIN_BYTES, chunk_bytes // INNER_CHUNKS_PER_CHUNK))


def inner_chunk_shape(chunk_shape: Sequence[int], itemsize: int, target_bytes: int | None = None) -> tuple[int, ...]:
    """Chooses the inner chunk shape of a zarr shard file.

    Rule: start from the chunk (= saved shard) shape and, while the inner chunk is larger
    than the target (default `inner_chunk_target_bytes`: 1/16 of the chunk, at least
    16 KiB, at most 1 MiB), divide its longest dimension by that dimension's smallest
    prime factor (2 whenever the size is even), considering only dimensions whose
    smallest prime factor is at most 7: a dimension whose size has only large prime
    factors (1021) stays whole, so such a chunk may stay above the target. The result
    always divides the chunk shape (the `sharding_indexed` codec requires it). For
    power-of-two shapes the chunk is cut into about 16 inner chunks along its longest
    axes, so a target shard obtained by splitting saved shards up to 4 ways along two
    axes (or 16 along one), or by merging them, is a union of whole inner chunks: such
    reshardings read only the zarr shard files' indexes beyond the data.

    Args:
      chunk_shape: the chunk (saved shard) shape, elements per dimension.
      itemsize: bytes per element.
      target_bytes: override of the size inner chunks should not exceed, bytes.
    Returns:
      The inner chunk shape, same rank as `chunk_shape`.
    """
    if target_bytes is None:
        target_bytes = inner_chunk_target_bytes(math.prod(max(1, c) for c in chunk_shape) * itemsize)
    inner = [max(1, c) for c in chunk_shape]
    while math.prod(inner) * itemsize > target_bytes:
        # Split only by small primes: a size like 1021 (prime) stays whole rather
        # than collapsing to inner chunks one element wide.
        candidates = [i for i, d in enumerate(inner) if d > 1 and _smallest_prime_factor(d) <= MAX_SPLIT_FACTOR]
        if not candidates:
            break
        dim = max(candidates, key=lambda i: (inner[i], -i))
        inner[dim] //= _smallest_prime_factor(inner[dim])
    # Hard ceiling: an inner chunk still above MAX_INNER_CHUNK_BYTES (only dimensions
    # with large prime factors left, e.g. (46337, 46349)) has its longest dimension
    # split by its smallest prime factor whatever it is, as long as the inner chunk
    # stays at least INNER_CHUNK_MIN_BYTES (so a 1-D leaf of prime length stays whole
    # rather than becoming one-element inner chunks with an index 4x the data).
    while math.prod(inner) * itemsize > MAX_INNER_CHUNK_BYTES:
        candidates = [
            i for i, d in enumerate(inner)
            if d > 1 and math.prod(inner) // _smallest_prime_factor(d) * itemsize >= INNER_CHUNK_MIN_BYTES
        ]
        if not candidates:
            break
        dim = max(candidates, key=lambda i: (inner[i], -i))
        inner[dim] //= _smallest_prime_factor(inner[dim])
    return tuple(inner)


def zarr_metadata(shape: Sequence[int], dtype: np.dtype, chunk_shape: Sequence[int], inner_shape: Sequence[int]) -> dict:
    """The zarr v3 array metadata (`zarr.json`) of one leaf."""
    checked = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    if np.dtype(dtype).itemsize == 1 or np.dtype(dtype).kind == "b":
        checked = [{"name": "bytes"}, {"name": "crc32c"}]
    return {
        "shape": list(shape),
        "data_type": dtype_name(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, c) for c in chunk_shape]}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(inner_shape),
                    "codecs": checked,
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    "index_location": "end",
                },
            }
        ],
    }


ZarrSpecMode = Literal["create", "write", "read"]


def zarr_spec(kvstore: Mapping, meta: ArrayMetadata, *, mode: ZarrSpecMode) -> dict:
    """The TensorStore spec of a leaf's zarr array.

    Args:
      kvstore: the kvstore spec of the array's folder (`Storage.kvstore_spec`).
      meta: the leaf's manifest entry; its zarr metadata is part of every spec.
      mode: `"create"`: write, creating `zarr.json` (process 0 of a save); `"write"`:
        write into an array another process creates (its `zarr.json` is assumed, not
        read); `"read"`: open an existing array, refusing a `zarr.json` whose shape, dtype,
        chunk grid or codecs differ from the manifest (so bytes are never decoded as
        another dtype or inner-chunk layout), and a missing chunk (never fill values).
    Returns:
      A dict for `tensorstore.open`.
    """
    spec: dict[str, object] = {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": zarr_metadata(meta.shape, meta.dtype, meta.chunk_shape, meta.inner_chunk_shape),
    }
    if mode == "read":
        spec.update({"open": True, "fill_missing_data_reads": False, "recheck_cached_data": False})
    elif mode in ("create", "write"):
        spec["store_data_equal_to_fill_value"] = True
        spec["create" if mode == "create" else "assume_metadata"] = True
    else:
        raise ValueError(f"zarr_spec mode must be 'create', 'write' or 'read', got {mode!r}")
    return spec


def data_crc32c(data: np.ndarray) -> int:
    """crc32c of an array's C-order bytes (0 for an empty array): `data_crc32c` of a chunk
    in `processes/<i>.json`, checked by `verify` on top of the codec's checksums."""
    if data.size == 0:
        return 0
    return crc32c.crc32c(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)


def chunk_key(leaf_path: str, chunk_index: Sequence[int]) -> str:
    """Key of a chunk (a zarr shard file) relative to the checkpoint path."""
    return f"{array_dir(leaf_path)}/c" + "".join(f"/{i}" for i in chunk_index) if chunk_index else f"{array_dir(leaf_path)}/c"


# --- metadata -------------------------------------------------------------------------------


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
    """

    key: str
    file_bytes: int
    box: Box
    offset: int
    nbytes: int
    crc32c: int


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


def _shape(v: object, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_RANK or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 62 for i in v):
        raise CorruptCheckpointError(f"malformed {what} {v!r} in {where}")
    return tuple(v)


def array_metadata_from_json(path: str, obj: object, where: str) -> ArrayMetadata:
    """Parses and validates one array entry of a manifest.

    Raises:
      CorruptCheckpointError: a field is missing, of the wrong type or absurd.
    """
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"leaf {path!r} in {where}: entry is not an object")
    loc = f"leaf {path!r} in {where}"
    shape = _shape(obj.get("shape"), "shape", loc)
    chunk = _shape(obj.get("chunk_shape"), "chunk_shape", loc)
    inner = _shape(obj.get("inner_chunk_shape"), "inner_chunk_shape", loc)
    dtype = dtype_from_name(obj.get("dtype"), where=loc)
    if not (len(shape) == len(chunk) == len(inner)) or any(
        c < 1 or i < 1 or c % i or c > max(1, s) for s, c, i in zip(shape, chunk, inner)
    ):
        raise CorruptCheckpointError(f"{loc}: chunk_shape {chunk} and inner_chunk_shape {inner} do not fit shape {shape}")
    if math.prod(shape) * dtype.itemsize > MAX_ARRAY_BYTES:
        raise CorruptCheckpointError(f"{loc}: shape {shape} of {dtype} declares more than {MAX_ARRAY_BYTES} bytes")
    n_chunks = math.prod(-(-s // c) for s, c in zip(shape, chunk))
    n_inner = math.prod(c // i for c, i in zip(chunk, inner))
    if n_chunks > MAX_CHUNKS_PER_LEAF or n_inner > MAX_INNER_CHUNKS_PER_CHUNK:
        raise CorruptCheckpointError(
            f"{loc}: chunk_shape {chunk} and inner_chunk_shape {inner} declare {n_chunks} chunks of {n_inner} "
            f"inner chunks (at most {MAX_CHUNKS_PER_LEAF} chunks, {MAX_INNER_CHUNKS_PER_CHUNK} inner chunks each)"
        )
    key_impl = obj.get("key_impl")
    if key_impl is not None and not isinstance(key_impl, str):
        raise CorruptCheckpointError(f"{loc}: key_impl must be a string")
    kind = obj.get("kind", "jax")
    if kind not in ("jax", "numpy"):
        raise CorruptCheckpointError(f"{loc}: unknown array kind {kind!r}")
    try:
        sharding = SavedSharding.from_json(obj["saved_sharding"]) if obj.get("saved_sharding") else None
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise CorruptCheckpointError(f"{loc}: malformed saved_sharding ({e})") from e
    packed = obj.get("packed", False)
    if not isinstance(packed, bool):
        raise CorruptCheckpointError(f"{loc}: packed must be true or false")
    return ArrayMetadata(path, shape, dtype, chunk, inner, sharding, key_impl, kind, packed=packed)


# --- non-array leaf values --------------------------------------------------------------


def value_to_json(value: object) -> dict | None:
    """JSON for a non-array leaf, bit-exact; None if the value is not of a storable kind."""
    if value is None:
        return {"type": "none"}
    # numpy scalars first: np.float64 and np.complex128 subclass float and complex.
    if isinstance(value, np.generic) and value.dtype.kind in "biufc" or type(value).__module__ == "ml_dtypes":
        arr = np.asarray(value)
        return {"type": "numpy_scalar", "dtype": dtype_name(arr.dtype), "hex": arr.tobytes().hex()}
    if isinstance(value, bool):
        return {"type": "bool", "value": value}
    if isinstance(value, int):  # hex: no 4300-digit limit, any size
        return {"type": "int", "hex": format(value, "x")}
    if isinstance(value, float):
        return {"type": "float", "hex": struct.pack("<d", value).hex()}
    if isinstance(value, complex):
        return {"type": "complex", "hex": struct.pack("<dd", value.real, value.imag).hex()}
    if isinstance(value, str):
        return {"type": "str", "value": value}
    return None


def value_from_json(obj: object, where: str) -> object:
    """Inverse of `value_to_json`. Raises CorruptCheckpointError on malformed input."""
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"malformed value {obj!r:.200} in {where}: not an object")
    try:
        t = obj["type"]
        if t == "none":
            return None
        if t == "bool" and isinstance(obj["value"], bool):
            return obj["value"]
        if t == "int" and isinstance(obj["hex"], str) and len(obj["hex"]) < 1_000_000:
            return int(obj["hex"], 16)
        if t == "float":
            return struct.unpack("<d", bytes.fromhex(obj["hex"]))[0]
        if t == "complex":
            re_, im = struct.unpack("<dd", bytes.fromhex(obj["hex"]))
            return complex(re_, im)
        if t == "str" and isinstance(obj["value"], str):
            return obj["value"]
        if t == "numpy_scalar":
            dtype = dtype_from_name(obj["dtype"], where=where)
            raw = bytes.fromhex(obj["hex"])
            if len(raw) != dtype.itemsize:
                raise ValueError("size")
            return np.frombuffer(raw, dtype=dtype)[0]
    except (KeyError, TypeError, ValueError, OverflowError, struct.error) as e:
        raise CorruptCheckpointError(f"malformed value {obj!r:.200} in {where}: {e}") from e
    raise CorruptCheckpointError(f"malformed value {obj!r:.200} in {where}")


def format_bytes(n: int | None) -> str:
    """A byte count for people: `"512 B"`, `"1.5 KiB"`, ... up to TiB; `"-"` for None."""
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{n} B"
    x = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def dumps(obj: object) -> bytes:
    """The JSON encoding used for every file of the format."""
    return json.dumps(obj, indent=1, sort_keys=False, allow_nan=False).encode()


def _expands(obj: object, depth: int) -> bool:
    if isinstance(obj, dict):
        return bool(obj) and (depth < 2 or any(isinstance(v, list) and v and isinstance(v[0], dict) for v in obj.values()))
    if isinstance(obj, list):
        return bool(obj) and (depth < 1 or all(isinstance(v, dict) for v in obj))
    return False


_ENCODER = json.JSONEncoder(allow_nan=False)  # one instance: `json.dumps(..., allow_nan=False)` builds one per call


def _dump_lines(obj: object, depth: int, out: list[str]) -> None:
    if not _expands(obj, depth):
        out.append(_ENCODER.encode(obj))
        return
    pad = " " * (depth + 1)
    items: list[tuple[object, object]] = list(obj.items()) if isinstance(obj, dict) else [(None, v) for v in obj]  # type: ignore[attr-defined]
    out.append("{" if isinstance(obj, dict) else "[")
    for i, (k, v) in enumerate(items):
        out.append("\n" + pad + (_ENCODER.encode(k) + ": " if k is not None else ""))
        _dump_lines(v, depth + 1, out)
        if i + 1 < len(items):
            out.append(",")
    out.append("\n" + " " * depth + ("}" if isinstance(obj, dict) else "]"))


def dumps_large(obj: object) -> bytes:
    """The JSON encoding of the format's large files (manifest, process records): the
    top levels one entry per line and every list of objects one object per line (a
    leaf, a chunk, a packed box), each entry compact. Same JSON as `dumps`, other
    whitespace: it runs on the C encoder (`indent=` forces Python's, ~10 µs per
    value: 0.3 s for a record of 5,000 chunks)."""
    out: list[str] = []
    _dump_lines(obj, 0, out)
    return "".join(out).encode()


def loads(data: bytes, where: str) -> object:
    """Parses a JSON file of the format; raises CorruptCheckpointError if malformed."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON: {e}") from e


# --- zarr shard file layout -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardFileLayout:
    """The byte layout of one zarr shard file (one chunk) of this format.

    ```
    inner chunk 0: raw bytes || crc32c (u32 LE)    inner_bytes_with_crc each, in the
    inner chunk 1: ...                             order the index says (C order as written)
    index: per inner chunk in C order (offset u64 LE, nbytes u64 LE)   16 bytes each
    crc32c(index) (u32 LE)
    ```
    The index sits at the end (`index_location: "end"`), `index_bytes` long from
    `index_offset`; every inner chunk is stored, so the file is `file_bytes` long.

    Attributes:
      chunk_shape: the chunk (= zarr shard) shape, elements.
      inner_chunk_shape: the inner chunk shape, elements.
      itemsize: bytes per element.
    """

    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    itemsize: int

    CRC_BYTES = 4
    INDEX_ENTRY_BYTES = 16
    MISSING = (1 << 64) - 1  # an index entry of an inner chunk that is not stored

    @property
    def inner_grid(self) -> tuple[int, ...]:
        """Inner chunks per dimension."""
        return tuple(max(1, c) // i for c, i in zip(self.chunk_shape, self.inner_chunk_shape))

    @property
    def inner_chunks(self) -> int:
        """Inner chunks in the file."""
        return math.prod(self.inner_grid)

    @property
    def inner_bytes(self) -> int:
        """Raw bytes of one inner chunk."""
        return math.prod(self.inner_chunk_shape) * self.itemsize

    @property
    def inner_bytes_with_crc(self) -> int:
        """Stored bytes of one inner chunk: raw bytes and their crc32c."""
        return self.inner_bytes + self.CRC_BYTES

    @property
    def index_bytes(self) -> int:
        """Bytes of the index and its crc32c."""
        return self.inner_chunks * self.INDEX_ENTRY_BYTES + self.CRC_BYTES

    @property
    def index_offset(self) -> int:
        """Where the index starts: right after the inner chunks."""
        return self.inner_chunks * self.inner_bytes_with_crc

    @property
    def file_bytes(self) -> int:
        """Size of the whole file."""
        return self.index_offset + self.index_bytes

    def inner_id(self, cell: Sequence[int]) -> int:
        """The C-order position of inner chunk `cell` (its entry in the index)."""
        out = 0
        for c, n in zip(cell, self.inner_grid):
            out = out * n + c
        return out

    @classmethod
    def split_crc(cls, blob) -> tuple[memoryview, int]:
        """`(data, stored crc32c)` of an inner chunk or index as stored (crc last)."""
        view = memoryview(blob)
        return view[: -cls.CRC_BYTES], int.from_bytes(view[-cls.CRC_BYTES :], "little")
