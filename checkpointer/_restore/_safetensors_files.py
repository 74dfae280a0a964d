"""safetensors files as the restore sees them (pure but for the header reads): the
header of each file checked with the format's rules, a Hugging Face sharded folder
resolved through its index, and a box of a tensor as the byte runs to read.

The format (as the `safetensors` package writes and checks it): 8 bytes, little-endian
u64 `N`; `N` bytes of a UTF-8 JSON object (starting with `{`, at most 100 MB) mapping
each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` plus an
optional `"__metadata__"` of strings; then the data, each tensor's little-endian
C-order bytes at `8 + N + begin`. The offsets tile the data exactly (sorted by begin,
each starts where the previous ends, the first at 0), each tensor's `end - begin` is
its shape times its dtype's size, and the file ends with the last tensor. The dtype
codes are those the installed `safetensors` names (`dtype_codes`); packed sub-byte
codes (`F4`, `F6_*`) are known but not read.

Since a tensor is one contiguous C-order range, the elements of a box of it are a set
of equal runs (`box_runs`): along the dimensions after the last one the box cuts, it
covers everything, so each run is that trailing block.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from collections.abc import Sequence

import numpy as np

from .._errors import CorruptCheckpointError, UnsupportedValueError
from .._format import Box, load_json
from .._storage import Storage

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
METADATA_KEY = "__metadata__"
MAX_HEADER_BYTES = 100_000_000  # the `safetensors` package's limit on N
# A header is {name: {dtype, shape, data_offsets}, __metadata__: {str: str}}: 3 levels.
HEADER_MAX_DEPTH = 8
# numpy's bounds on an array (np.empty refuses more, even with a zero size: `[0, 2**62]`).
MAX_RANK = 32
_MAX_INDEXABLE_BYTES = np.iinfo(np.intp).max
# Packed codes the format defines (several values per byte), which are not read here.
_PACKED_CODES = ("F4", "F6_E2M3", "F6_E3M2")
# Every dtype numpy or ml_dtypes has that safetensors might name (`dtype_codes` asks the package).
_CANDIDATES = (
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "float32",
    "float64", "complex64", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file.

    Attributes:
      name: its name in the header.
      file: the location of its file.
      dtype: its numpy dtype (little-endian on disk).
      shape: its shape, elements per dimension.
      offset_bytes: where its first byte is in the file (`8 + N + begin`).
      nbytes: its size in bytes.
    """

    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int


@functools.cache
def dtype_codes() -> dict[str, np.dtype]:
    """safetensors dtype code (e.g. `"BF16"`) -> numpy dtype, as the installed
    `safetensors` package names each dtype it can write."""
    import ml_dtypes
    import safetensors

    out: dict[str, np.dtype] = {}
    for name in _CANDIDATES:
        dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
        a = np.zeros(1, dtype)
        try:
            raw = bytes(safetensors.serialize({"x": safetensors.TensorSpec(
                dtype=dtype.name, shape=[1], data_ptr=a.ctypes.data, data_len=a.nbytes)}))
        except Exception:  # this version of safetensors lacks the dtype
            continue
        n = struct.unpack("<Q", raw[:8])[0]
        out[load_json(raw[8 : 8 + n], what="a safetensors header")["x"]["dtype"]] = dtype
    return out


def _corrupt(file: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{file} is not a valid safetensors file: {what}. Download or export it again.")


def parse_header(file: str, header: bytes, *, data_offset: int) -> tuple[dict[str, TensorEntry], int, dict[str, tuple[str, str]]]:
    """Checks a header with the format's rules.

    Args:
      file: the file's location, for messages.
      header: the `N` bytes of JSON.
      data_offset: where the data starts in the file (`8 + N`), bytes.
    Returns:
      (name -> `TensorEntry` of every tensor of a dtype this restore reads; the file size
      the header implies, bytes; name -> (packed code, why) for tensors of packed codes).
    Raises:
      CorruptCheckpointError: the JSON is malformed, a dtype code is unknown, a shape or
        offsets are malformed, or the offsets do not tile the data; names the file and
        the tensor.
    """
    if not header.startswith(b"{"):
        raise _corrupt(file, "the header does not start with '{'")
    try:
        header.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _corrupt(file, f"the header is not UTF-8 ({e})") from e
    obj = load_json(header, what=f"{file} (its safetensors header)", max_bytes=MAX_HEADER_BYTES, max_depth=HEADER_MAX_DEPTH)
    if not isinstance(obj, dict):
        raise _corrupt(file, "the header is not a JSON object")
    codes = dtype_codes()
    spans: list[tuple[int, int, str]] = []
    entries: dict[str, TensorEntry] = {}
    packed: dict[str, tuple[str, str]] = {}
    for name, info in obj.items():
        if name == METADATA_KEY:
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise _corrupt(file, f"{METADATA_KEY!r} is not an object of strings")
            continue
        what = f"tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise _corrupt(file, f"{what} lacks dtype, shape or data_offsets")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise _corrupt(file, f"{what} has shape {shape!r}, not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets) or offsets[1] < offsets[0]):
            raise _corrupt(file, f"{what} has data_offsets {offsets!r}, not [begin, end]")
        begin, end = offsets
        spans.append((begin, end, name))
        if not isinstance(code, str):
            raise _corrupt(file, f"{what} has dtype {code!r}, not a dtype code (a string such as 'F32')")
        if code in _PACKED_CODES:
            packed[name] = (code, "a packed sub-byte dtype")
            continue
        if code not in codes:
            raise _corrupt(file, f"{what} has dtype {code!r}, which safetensors does not define (known: {', '.join(sorted(codes))})")
        dtype = codes[code]
        nbytes = math.prod(shape) * dtype.itemsize
        if len(shape) > MAX_RANK or math.prod(max(s, 1) for s in shape) * dtype.itemsize > _MAX_INDEXABLE_BYTES:
            raise _corrupt(file, f"{what} has shape {tuple(shape)} of dtype {code}, beyond what an array holds "
                                 f"(rank at most {MAX_RANK}, at most {_MAX_INDEXABLE_BYTES} bytes ignoring zero sizes)")
        if end - begin != nbytes:
            raise _corrupt(file, f"{what} of shape {tuple(shape)} and dtype {code} needs {nbytes} bytes, its data_offsets "
                                 f"{offsets} hold {end - begin}")
        entries[name] = TensorEntry(name, file, dtype, tuple(shape), data_offset + begin, nbytes)
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise _corrupt(file, f"tensor {name!r} starts at data byte {begin}, the previous tensor ends at {at} "
                                 "(the data must be tiled without gaps or overlaps)")
        at = end
    return entries, data_offset + at, packed


def read_file_header(storage: Storage, file: str, counter: list[int]) -> tuple[dict[str, TensorEntry], dict[str, tuple[str, str]]]:
    """Reads and checks the header of `file`, and that the file is as long as the header says.

    Where the storage knows sizes cheaply (local files) the size must match exactly;
    on object stores the last data byte must be there (a longer object goes unnoticed,
    since finding an object's size there costs a download).

    Args:
      storage: where the file lives.
      file: its location.
      counter: `[bytes read]`, incremented by the bytes this reads.
    Returns:
      As `parse_header`, less the implied size.
    Raises:
      FileNotFoundError: no file at `file`.
      CorruptCheckpointError: the header is malformed or disagrees with the file's size;
        names the file (and the tensor).
    """
    head = storage.read_range(file, 0, 8)
    counter[0] += len(head)
    if len(head) < 8:
        raise _corrupt(file, f"it has {len(head)} bytes, fewer than the 8 of the header size")
    n = struct.unpack("<Q", head)[0]
    if n > MAX_HEADER_BYTES:
        raise _corrupt(file, f"its header size says {n} bytes, more than the format's limit {MAX_HEADER_BYTES}")
    if storage.cheap_size and n > (found := storage.size(file)) - 8:  # before reading (a read allocates n first)
        raise _corrupt(file, f"its header size says {n} bytes, the file holds {max(found - 8, 0)} after it")
    header = storage.read_range(file, 8, n) if n else b""
    counter[0] += len(header)
    if len(header) != n:
        raise _corrupt(file, f"its header size says {n} bytes, the file holds {len(header)} after it")
    entries, size, packed = parse_header(file, header, data_offset=8 + n)
    last = max((e for e in entries.values() if e.nbytes), key=lambda e: e.offset_bytes + e.nbytes, default=None)
    if storage.cheap_size:
        found = storage.size(file)
        if found != size:
            raise _corrupt(file, f"the header says the file has {size} bytes ({8 + n} of header and the tensors' data), "
                                 f"it has {found}" + (f"; tensor {last.name!r} ends there" if last and found < size else ""))
    elif size > 8 + n:
        tail = storage.read_range(file, size - 1, 1)
        counter[0] += len(tail)
        if len(tail) != 1:
            raise _corrupt(file, f"the header says the file has {size} bytes, it ends before"
                                 + (f" the end of tensor {last.name!r}" if last else ""))
    return entries, packed


def files_of(storage: Storage, path: str, counter: list[int]) -> tuple[list[str], dict[str, str] | None, str | None]:
    """The files of a safetensors location, the index's weight map (tensor name -> file
    location) and the index's location (both None without an index).

    Args:
      storage: where it lives.
      path: a `.safetensors` file, a `model.safetensors.index.json`, or a folder with
        either (the index first).
      counter: `[bytes read]`, incremented by the bytes the index takes.
    Raises:
      FileNotFoundError: neither is there; CorruptCheckpointError: a malformed index.
    """
    if path.endswith(".safetensors"):
        return [path], None, None
    index = path if path.endswith(".json") else f"{path}/{INDEX_FILE}"
    try:
        raw = storage.read_file(index, max_bytes=MAX_HEADER_BYTES)
    except FileNotFoundError:
        if path.endswith(".json"):
            raise
        single = f"{path}/{SINGLE_FILE}"
        if storage.cheap_size and not storage.exists(single):
            raise FileNotFoundError(f"no {INDEX_FILE} and no {SINGLE_FILE} in {path}") from None
        return [single], None, None
    counter[0] += len(raw)
    try:
        weight_map = load_json(raw, what=index, max_bytes=MAX_HEADER_BYTES, max_depth=HEADER_MAX_DEPTH)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError("weight_map is not an object of file names")
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{index} is not a safetensors index ({e}): it needs a weight_map of "
                                     "tensor name -> file name") from e
    folder = index.rsplit("/", 1)[0]
    for f in weight_map.values():
        if "/" in f or f in ("", ".", ".."):
            raise CorruptCheckpointError(f"{index} names file {f!r}, not a file name in its folder")
    files = [f"{folder}/{f}" for f in sorted(set(weight_map.values()))]
    return files, {k: f"{folder}/{v}" for k, v in weight_map.items()}, index


def check_index(weight_map: dict[str, str], entries: dict[str, TensorEntry], packed: dict[str, str], index: str) -> None:
    """Checks that the index and the files' headers name the same tensors in the same files.

    Args:
      weight_map: tensor name -> file location, from the index.
      entries: the tensors of every file.
      packed: name -> file of the tensors of packed dtypes.
      index: the index's location, for messages.
    Raises:
      CorruptCheckpointError: a tensor the index names is not in its file, or a file
        holds one the index lacks; names both.
    """
    found = {n: e.file for n, e in entries.items()} | packed
    for name, file in weight_map.items():
        if found.get(name) != file:
            where = f"it is in {found[name]}" if name in found else f"{file} does not hold it"
            raise CorruptCheckpointError(f"{index} maps tensor {name!r} to {file}, but {where}. Download the model again.")
    extra = sorted(set(found) - set(weight_map))
    if extra:
        raise CorruptCheckpointError(f"{found[extra[0]]} holds tensor {extra[0]!r}, which {index} does not name "
                                     f"({len(extra)} such tensor(s)). Download the model again.")


def check_readable(name: str, packed: dict[str, tuple[str, str]], file: str) -> None:
    """Raises UnsupportedValueError for a tensor of a packed sub-byte dtype."""
    if name in packed:
        code, why = packed[name]
        raise UnsupportedValueError(
            f"tensor {name!r} of {file} has dtype {code}, {why}, which restore_safetensors does not read. Restore "
            "the other tensors with partial=True and a target without it, and convert it with safetensors itself."
        )


def box_runs(box: Box, shape: Sequence[int]) -> tuple[int, np.ndarray]:
    """The elements of `box` in a C-order array of `shape` as equal contiguous runs.

    Args:
      box: a region of the array (non-empty).
      shape: the array's shape.
    Returns:
      (elements per run; the first element of each run, int64, ascending: the runs in
      the order the box's own C-order buffer holds them, one after another).
    """
    shape = tuple(shape)
    nd = len(shape)
    j = nd - 1  # the last dimension the box cuts; dims after it are whole
    while j >= 0 and box.origin[j] == 0 and box.shape[j] == shape[j]:
        j -= 1
    if j < 0:
        return math.prod(shape), np.zeros(1, np.int64)
    strides = [math.prod(shape[d + 1 :]) for d in range(nd)]
    run = box.shape[j] * strides[j]
    starts = np.full((), box.origin[j] * strides[j], np.int64)
    for d in range(j):  # outer dims: every index of the box along each
        starts = starts[..., None] + (np.arange(box.origin[d], box.origin[d] + box.shape[d], dtype=np.int64) * strides[d])
    return run, starts.reshape(-1)
