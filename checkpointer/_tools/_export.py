"""Export a checkpoint's arrays to safetensors or npz, one slab at a time.

Tensor names are the user's key paths joined by `separator` (default `.`, as Hugging
Face names weights): `{"params": {"dense": {"kernel": x}}}` gives `params.dense.kernel`,
a list index gives its number (`layers.0.w`), an int dict key its decimal form. Only
array leaves are exported; non-array leaves (step, strings, None) are listed in the
report as skipped. Typed PRNG keys are exported as their key data (uint32).

safetensors: one file `model.safetensors`, or, when the arrays exceed
`max_shard_bytes`, files `model-00001-of-0000N.safetensors` filled in tree order (a
tensor larger than the limit gets a file of its own) plus `model.safetensors.index.json`
(`{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`), as Hugging Face
shards checkpoints. The file is written in the safetensors layout (8-byte header size,
JSON header, raw little-endian bytes) tensor by tensor and slab by slab, so host
memory stays at one slab (`SLAB_BYTES`) whatever the file size; the `safetensors`
library names each dtype and re-reads every header written, so the files are what it
reads. npz: one zip (stored, zip64) whose `<name>.npy` members are written the same
way, as `numpy.savez` lays them out.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import struct
import zipfile
from collections.abc import Sequence
from typing import IO

import ml_dtypes
import numpy as np

from .. import _encoding
from .._errors import CheckpointExistsError, UnsupportedValueError
from .._format import ArrayMetadata, Box, CheckpointMetadata, read_metadata, row_slabs
from .._storage import Storage, storage_for

DEFAULT_MAX_SHARD_BYTES = 5 << 30  # Hugging Face's default max_shard_size ("5GB")
SLAB_BYTES = 64 << 20
SAFETENSORS_INDEX = "model.safetensors.index.json"
FORMATS = ("safetensors", "npz")


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What `export` wrote.

    Attributes:
      files: the files written (absolute paths), the index last when there is one.
      tensors: tensor name -> the file that holds it.
      skipped: key paths of the non-array leaves that were not exported.
      total_bytes: bytes of tensor data written.
    """

    files: tuple[str, ...]
    tensors: dict
    skipped: tuple[str, ...]
    total_bytes: int


# --- names ----------------------------------------------------------------------------------


def _key_text(key: object) -> str:
    if isinstance(key, dict) and "int" in key:
        return str(key["int"])
    if isinstance(key, dict) and "repr" in key:
        return str(key["repr"])
    return str(key)


def key_paths(structure: dict) -> dict[str, tuple]:
    """Leaf path -> the user's keys (JSON form, as in the manifest's `structure`)."""
    out: dict[str, tuple] = {}
    stack: list[tuple[dict, tuple]] = [(structure, ())]
    while stack:
        node, keys = stack.pop()
        if node.get("kind") == "leaf":
            path = node.get("path")
            if isinstance(path, str):
                out[path] = keys
            continue
        for k, child in zip(node.get("keys", []), node.get("children", [])):
            stack.append((child, keys + (k,)))
    return out


def tensor_names(meta: CheckpointMetadata, separator: str = ".") -> dict[str, str]:
    """Array leaf path -> tensor name (the user's keys joined by `separator`).

    Raises:
      UnsupportedValueError: two leaves get one name (e.g. keys `"a.b"` and `a` / `b`);
        names both and suggests another separator.
    """
    keys = key_paths(meta.structure)
    names: dict[str, str] = {}
    seen: dict[str, str] = {}
    for leaf_path in meta.arrays:
        name = separator.join(_key_text(k) for k in keys.get(leaf_path, ())) or "array"
        if name in seen:
            raise UnsupportedValueError(
                f"leaves {seen[name]!r} and {leaf_path!r} of {meta.path} would both be exported as {name!r}; "
                f"choose a separator that no key contains (separator={'/' if separator != '/' else ':'!r})"
            )
        seen[name] = leaf_path
        names[leaf_path] = name
    return names


# --- dtypes ---------------------------------------------------------------------------------


@functools.cache
def safetensors_dtype(dtype: np.dtype) -> str | None:
    """The safetensors dtype code of `dtype` (e.g. "BF16"), as the library names it; None
    when the format has none (int4, complex128, float8_e4m3b11fnuz, ...)."""
    import safetensors

    a = np.zeros(1, dtype)
    try:
        raw = bytes(safetensors.serialize({"x": safetensors.TensorSpec(
            dtype=np.dtype(dtype).name, shape=[1], data_ptr=a.ctypes.data, data_len=a.nbytes)}))
    except Exception:
        return None
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n])["x"]["dtype"]


def npz_supports(dtype: np.dtype) -> bool:
    """numpy's own dtypes only: `np.load` reads ml_dtypes (bfloat16, float8, int4) as raw void."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" and dtype.type.__module__ == "numpy"


def upcast_dtype(dtype: np.dtype) -> np.dtype | None:
    """A numpy dtype that holds every value of `dtype` exactly (None if there is none)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "biufc" and dtype.type.__module__ == "numpy":
        return dtype
    try:
        info = ml_dtypes.iinfo(dtype)
        return np.dtype(np.int8 if info.min < 0 else np.uint8)
    except (ValueError, TypeError):
        pass
    try:
        ml_dtypes.finfo(dtype)
        return np.dtype(np.float32)
    except (ValueError, TypeError):
        return None


def _out_dtype(meta: ArrayMetadata, name: str, fmt: str, upcast: bool, path: str) -> np.dtype:
    ok = (lambda d: safetensors_dtype(d) is not None) if fmt == "safetensors" else npz_supports
    if ok(meta.dtype):
        return meta.dtype
    wider = upcast_dtype(meta.dtype)
    if upcast and wider is not None and ok(wider):
        return wider
    if fmt == "npz":
        fix = ("export with --format safetensors, which holds it" if safetensors_dtype(meta.dtype) else "")
        fix = ", or ".join(f for f in (fix, f"pass --upcast (upcast=True) to export it as {wider}, exactly" if wider and ok(wider) else "") if f)
        why = "numpy has no such dtype (np.load would return raw void bytes)"
    else:
        fix = f"pass --upcast (upcast=True) to export it as {wider}, exactly" if wider and ok(wider) else "export with --format npz"
        why = "safetensors has no such dtype"
    raise UnsupportedValueError(f"tensor {name!r} (leaf {meta.path!r} of {path}) has dtype {meta.dtype}: {why}; "
                                f"{fix or 'convert it in your own code'}")


# --- reading --------------------------------------------------------------------------------


def _write_leaf(f: IO[bytes], storage: Storage, path: str, meta: ArrayMetadata, out_dtype: np.dtype) -> int:
    """Writes the leaf's C-order little-endian bytes to `f`, slab by slab; returns bytes."""
    read, n = _encoding.region_reader(storage, path, meta), 0
    little = out_dtype.newbyteorder("<") if out_dtype.itemsize > 1 else out_dtype
    for box in row_slabs(Box.whole(meta.shape), meta.dtype.itemsize, SLAB_BYTES):  # one slab in memory at a time
        slab = np.ascontiguousarray(read(box).astype(little, copy=False))
        f.write(slab.reshape(-1).view(np.uint8).data)
        n += slab.nbytes
        del slab
    return n


# --- planning -------------------------------------------------------------------------------


def plan_files(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Groups tensors, in order, into files of at most `max_shard_bytes` of data (a
    larger tensor gets a file of its own), as Hugging Face's `split_torch_state_dict_into_shards`."""
    files: list[list[str]] = []
    used = 0
    for name, nbytes in sizes:
        if files and used + nbytes <= max_shard_bytes:
            files[-1].append(name)
            used += nbytes
        else:
            files.append([name])
            used = nbytes
    return files


# --- writers --------------------------------------------------------------------------------


def _check_new(paths: Sequence[str], overwrite: bool) -> None:
    existing = [p for p in paths if os.path.lexists(p)]
    if existing and not overwrite:
        raise CheckpointExistsError(f"{existing[0]} exists; pass --overwrite (overwrite=True) to replace it")


# (tensor name, the leaf's metadata, the dtype it is exported as), in tree order.
_Item = tuple[str, ArrayMetadata, np.dtype]


def _write_safetensors(
    storage: Storage, path: str, items: Sequence[_Item], out_dir: str, max_shard_bytes: int, overwrite: bool
) -> tuple[list[str], dict[str, str]]:
    import safetensors

    groups = plan_files([(name, math.prod(m.shape) * d.itemsize) for name, m, d in items], max_shard_bytes)
    n = len(groups)
    names = ["model.safetensors"] if n <= 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    files = [os.path.join(out_dir, f) for f in names]
    _check_new(files + ([os.path.join(out_dir, SAFETENSORS_INDEX)] if n > 1 else []), overwrite)
    os.makedirs(out_dir, exist_ok=True)
    by_name = {name: (m, d) for name, m, d in items}
    weight_map: dict[str, str] = {}
    for group, file in zip(groups or [[]], files):
        header: dict[str, dict] = {}
        offset = 0
        for name in group:
            m, d = by_name[name]
            nbytes = math.prod(m.shape) * d.itemsize
            header[name] = {"dtype": safetensors_dtype(d), "shape": list(m.shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        tmp = f"{file}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for name in group:
                m, d = by_name[name]
                _write_leaf(f, storage, path, m, d)
        with safetensors.safe_open(tmp, framework="np") as check:  # the library reads what we wrote
            if list(check.keys()) != sorted(group):
                raise OSError(f"{file}: safetensors reads the tensors {list(check.keys())[:5]}, expected {sorted(group)[:5]}")
        os.replace(tmp, file)
        weight_map.update({name: file for name in group})
    if n > 1:
        total = sum(math.prod(m.shape) * d.itemsize for _, m, d in items)
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: os.path.basename(f) for name, f in sorted(weight_map.items())}}
        with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as index_file:
            json.dump(index, index_file, indent=2)
        files.append(os.path.join(out_dir, SAFETENSORS_INDEX))
    return files, weight_map


def _write_npz(
    storage: Storage, path: str, items: Sequence[_Item], out_file: str, overwrite: bool
) -> tuple[list[str], dict[str, str]]:
    _check_new([out_file], overwrite)
    os.makedirs(os.path.dirname(out_file) or ".", exist_ok=True)
    tmp = f"{out_file}.tmp-{os.getpid()}"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, m, d in items:
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                header = {"descr": np.lib.format.dtype_to_descr(d.newbyteorder("<") if d.itemsize > 1 else d),
                          "fortran_order": False, "shape": tuple(m.shape)}
                try:
                    np.lib.format.write_array_header_1_0(f, header)
                except ValueError:  # a header over 64 KiB (a very high rank)
                    np.lib.format.write_array_header_2_0(f, header)
                _write_leaf(f, storage, path, m, d)
    os.replace(tmp, out_file)
    return [out_file], {name: out_file for name, _, _ in items}


def export(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    format: str = "safetensors",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    separator: str = ".",
    upcast: bool = False,
    overwrite: bool = False,
) -> ExportReport:
    """Writes the array leaves of the checkpoint at `path` as safetensors or npz.

    Args:
      path: a committed checkpoint.
      out: safetensors: a folder (created) for `model.safetensors` or the sharded files
        and their index; npz: the `.npz` file.
      format: `"safetensors"` or `"npz"`.
      max_shard_bytes: safetensors only: data bytes per file before a new file starts.
      separator: joins the keys of a leaf into its tensor name.
      upcast: export dtypes the format cannot hold as a wider dtype that holds every
        value exactly (bfloat16, float8, float4 -> float32; int4, int2 -> int8), instead
        of raising.
      overwrite: replace files that exist.
    Returns:
      An `ExportReport`.
    Raises:
      CheckpointNotFoundError: no committed checkpoint at `path`.
      UnsupportedValueError: a leaf's dtype the format cannot hold (names the tensor,
        the leaf and the fix), or two leaves with one tensor name.
      CheckpointExistsError: an output file exists and `overwrite` is False.
      CorruptCheckpointError: stored bytes fail their checksums.

    Host memory: one slab of one leaf (`SLAB_BYTES`, 64 MiB, or one row if larger).
    Multi-process: call from one process; it reads every leaf whole.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be an int >= 1, got {max_shard_bytes!r}")
    storage, path = storage_for(path)
    meta = read_metadata(storage, path)
    names = tensor_names(meta, separator)
    keys = key_paths(meta.structure)
    items: list[_Item] = []
    for leaf_path, m in meta.arrays.items():
        items.append((names[leaf_path], m, _out_dtype(m, names[leaf_path], format, upcast, path)))
    skipped = tuple(separator.join(_key_text(k) for k in keys.get(p, ())) for p in meta.leaves if p not in meta.arrays)
    out = os.fspath(out)
    if format == "safetensors":
        files, where = _write_safetensors(storage, path, items, out, max_shard_bytes, overwrite)
    else:
        files, where = _write_npz(storage, path, items, out, overwrite)
    total = sum(math.prod(m.shape) * d.itemsize for _, m, d in items)
    return ExportReport(tuple(os.path.abspath(f) for f in files), {k: os.path.abspath(f) for k, f in where.items()},
                        skipped, total)
