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

An export cannot half-fail: every name is checked (a name the format reserves, such as
safetensors' `__metadata__`, two leaves with one name, a dtype the format lacks) before
a file is opened; every file is written under a temporary name (`<file>.tmp-<pid>`) and
read back, and only when all are written are they renamed into place; on any failure
the temporary files are removed (and the output folder, if the export created it and it
is empty). `leaves=` selects leaves by globs over their tensor names or key strings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import json
import math
import os
import re
import struct
import zipfile
from collections.abc import Iterator, Sequence
from typing import IO

import ml_dtypes
import numpy as np

from .. import _commit, _encoding
from .._errors import CheckpointExistsError, StructureMismatchError, UnsupportedValueError, leaf_name
from .._format import ArrayMetadata, Box, CheckpointMetadata, is_step_name, load_json, read_metadata, row_slabs
from .._storage import Storage, storage_for
from ._orbax_export import export_orbax
from ._orbax_import import below, resolved

DEFAULT_MAX_SHARD_BYTES = 5 << 30  # Hugging Face's default max_shard_size ("5GB")
SLAB_BYTES = 64 << 20
SAFETENSORS_INDEX = "model.safetensors.index.json"
FORMATS = ("safetensors", "npz", "orbax")
# Tensor names a format gives a meaning of its own: safetensors' header holds its
# free-form metadata under `__metadata__` (the library refuses a tensor of that name).
RESERVED_NAMES = {"safetensors": ("__metadata__",), "npz": (), "orbax": ()}


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What `export` wrote.

    Attributes:
      files: the files written (absolute paths), the index last when there is one.
      tensors: tensor name -> the file that holds it.
      skipped: key paths of the non-array leaves that were not exported.
      total_bytes: bytes of tensor data written.
      steps: `format="orbax"` of a manager directory: the steps written, ascending.
      dropped: `format="orbax"`: what Orbax cannot hold and was left out, one line each
        (the per-process state of a step, by process); also given as a warning.
    """

    files: tuple[str, ...]
    tensors: dict
    skipped: tuple[str, ...]
    total_bytes: int
    steps: tuple[int, ...] = ()
    dropped: tuple[str, ...] = ()


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
                f"leaves {meta.keystr(seen[name]) or '<root>'} and {meta.keystr(leaf_path) or '<root>'} of {meta.path} would both be exported as {name!r}; "
                f"choose a separator that no key contains (separator={'/' if separator != '/' else ':'!r})"
            )
        seen[name] = leaf_path
        names[leaf_path] = name
    return names


def check_reserved(names: dict[str, str], fmt: str, path: str, keystrs: dict[str, str]) -> None:
    """Raises `UnsupportedValueError` for a tensor name the format reserves (names the leaf)."""
    for leaf_path, name in names.items():
        if name in RESERVED_NAMES[fmt]:
            raise UnsupportedValueError(
                f"leaf {leaf_name(leaf_path, keystrs.get(leaf_path))} of {path} would be exported as the tensor {name!r}, a name "
                f"{fmt} reserves (its header's metadata); nothing was written. Leave it out (leaves=/--leaves selects "
                "the others), or export with --format npz"
            )


# A glob written as a key string (`['params']*`, `[0]['w']`), matched against key strings only.
_KEYSTR_GLOB = re.compile(r"""^\[(?:'|"|\d+\])""")


def select(names: dict[str, str], keystrs: dict[str, str], leaves: str | Sequence[str], separator: str,
           top_level: Sequence[str], path: str) -> dict[str, str]:
    """The entries of `names` (leaf path -> tensor name) whose leaf matches a glob of `leaves`.

    A glob matches a leaf when it matches the tensor name (`params.*`), the key string
    as `inspect` prints it (`['params']*`), or a key prefix of the name (`params`
    selects everything under `params`).

    Raises:
      StructureMismatchError: a glob matches no leaf (names the top-level keys).
    """
    globs = [leaves] if isinstance(leaves, str) else list(leaves)
    if not globs or not all(isinstance(g, str) and g for g in globs):
        raise ValueError(f"leaves must be a non-empty glob or list of globs, got {leaves!r}")

    def hit(glob: str, leaf_path: str) -> bool:
        # A key string's brackets are literal (`['params']*`), never a character class.
        if fnmatch.fnmatchcase(keystrs.get(leaf_path, ""), glob.replace("[", "[[]")):
            return True
        if _KEYSTR_GLOB.match(glob):
            return False
        name = names[leaf_path]
        return fnmatch.fnmatchcase(name, glob) or fnmatch.fnmatchcase(name, glob + separator + "*")

    for g in globs:
        if not any(hit(g, p) for p in names):
            raise StructureMismatchError(
                f"leaves={g!r} matches no array leaf of {path}; its top-level keys are "
                f"{', '.join(repr(k) for k in top_level) or '(none: the root is one leaf)'}. Globs match tensor names "
                f"(params.*), key strings (['params']*) or a key prefix (params)"
            )
    return {p: n for p, n in names.items() if any(hit(g, p) for g in globs)}


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
    return load_json(raw[8 : 8 + n], what="a safetensors header")["x"]["dtype"]


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
    raise UnsupportedValueError(f"tensor {name!r} (leaf {leaf_name(meta.path, meta.keystr)} of {path}) has dtype {meta.dtype}: {why}; "
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


@contextlib.contextmanager
def _all_or_nothing(out_dir: str) -> Iterator[list[str]]:
    """Yields a list to register temporary files in; on any failure removes those that
    exist, and `out_dir` when this export created it and it is left empty."""
    created = not os.path.exists(out_dir)
    tmps: list[str] = []
    try:
        yield tmps
    except BaseException:
        for tmp in tmps:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out_dir)  # only when empty
        raise


def _tmp(file: str) -> str:
    return f"{file}.tmp-{os.getpid()}"


def _write_safetensors(
    storage: Storage, path: str, items: Sequence[_Item], out_dir: str, max_shard_bytes: int, overwrite: bool
) -> tuple[list[str], dict[str, str]]:
    import safetensors

    groups = plan_files([(name, math.prod(m.shape) * d.itemsize) for name, m, d in items], max_shard_bytes)
    n = len(groups)
    names = ["model.safetensors"] if n <= 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    files = [os.path.join(out_dir, f) for f in names]
    index_file = os.path.join(out_dir, SAFETENSORS_INDEX)
    _check_new(files + ([index_file] if n > 1 else []), overwrite)
    by_name = {name: (m, d) for name, m, d in items}
    weight_map: dict[str, str] = {}
    with _all_or_nothing(out_dir) as tmps:
        os.makedirs(out_dir, exist_ok=True)
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
            tmps.append(_tmp(file))
            with open(tmps[-1], "wb") as f:
                f.write(struct.pack("<Q", len(blob)) + blob)
                for name in group:
                    m, d = by_name[name]
                    _write_leaf(f, storage, path, m, d)
            try:
                with safetensors.safe_open(tmps[-1], framework="np") as check:  # the library reads what we wrote
                    keys = list(check.keys())
            except Exception as e:
                raise OSError(f"{file}: the safetensors library cannot read the file written: {e}") from e
            if keys != sorted(group):
                raise OSError(f"{file}: safetensors reads the tensors {keys[:5]}, expected {sorted(group)[:5]}")
            weight_map.update({name: file for name in group})
        if n > 1:
            total = sum(math.prod(m.shape) * d.itemsize for _, m, d in items)
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: os.path.basename(f) for name, f in sorted(weight_map.items())}}
            tmps.append(_tmp(index_file))
            with open(tmps[-1], "w") as index_out:
                json.dump(index, index_out, indent=2)
            files.append(index_file)
        for tmp, file in zip(tmps, files):  # every file is complete: into place, the index last
            os.replace(tmp, file)
    return files, weight_map


def _write_npz(
    storage: Storage, path: str, items: Sequence[_Item], out_file: str, overwrite: bool
) -> tuple[list[str], dict[str, str]]:
    _check_new([out_file], overwrite)
    out_dir = os.path.dirname(out_file) or "."
    with _all_or_nothing(out_dir) as tmps:
        os.makedirs(out_dir, exist_ok=True)
        tmps.append(_tmp(out_file))
        with zipfile.ZipFile(tmps[-1], "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, m, d in items:
                with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                    header = {"descr": np.lib.format.dtype_to_descr(d.newbyteorder("<") if d.itemsize > 1 else d),
                              "fortran_order": False, "shape": tuple(m.shape)}
                    try:
                        np.lib.format.write_array_header_1_0(f, header)
                    except ValueError:  # a header over 64 KiB (a very high rank)
                        np.lib.format.write_array_header_2_0(f, header)
                    _write_leaf(f, storage, path, m, d)
        os.replace(tmps[-1], out_file)
    return [out_file], {name: out_file for name, _, _ in items}


def _check_not_named_like_a_step(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Refuses an output folder named like a step (`500`) in a directory holding committed
    steps: without a commit marker it is no checkpoint, gc removes it once it stayed
    unchanged for an hour, and a save of that step would collide with it. An `out` that
    is the source `path` (or holds it) is left to the export's own refusal."""
    storage, dst = storage_for(out)
    src = storage_for(path)[1]
    parent, _, name = resolved(dst).rpartition("/")
    if parent and not (resolved(src) == resolved(dst) or below(dst, src) is not None) and is_step_name(name) and storage.is_folder(parent) and _commit.committed_folders(storage, parent):
        raise CheckpointExistsError(
            f"{dst} is named like a step of the run {parent}: no checkpoint (no commit marker), so gc removes it "
            f"once it stayed unchanged for an hour, and a save of step {name} would collide with it; nothing was "
            f"written. Name it {name}.orbax (or .safetensors), or export outside the run")


def export(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    format: str = "safetensors",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    separator: str = ".",
    upcast: bool = False,
    overwrite: bool = False,
    leaves: str | Sequence[str] | None = None,
) -> ExportReport:
    """Writes the array leaves of the checkpoint at `path` as safetensors or npz, or the
    whole checkpoint (or a manager directory) as Orbax checkpoints.

    Args:
      path: a committed checkpoint; for `format="orbax"` also a manager directory
        (every committed step).
      out: safetensors: a folder (created) for `model.safetensors` or the sharded files
        and their index; npz: the `.npz` file; orbax: the Orbax checkpoint folder
        (StandardCheckpointer's layout: `StandardCheckpointer().restore(out, target)`),
        or for a manager directory the Orbax CheckpointManager directory (`out/<step>/
        default`, `out/<step>/metrics`), see docs/orbax_export.md.
      format: `"safetensors"`, `"npz"` or `"orbax"` (every leaf, arrays and values, in
        Orbax's PyTree layout without OCDBT, zarr3; Orbax is not needed to write it;
        `max_shard_bytes`, `separator`, `upcast` and `leaves` do not apply).
      max_shard_bytes: safetensors only: data bytes per file before a new file starts.
      separator: joins the keys of a leaf into its tensor name.
      upcast: export dtypes the format cannot hold as a wider dtype that holds every
        value exactly (bfloat16, float8, float4 -> float32; int4, int2 -> int8), instead
        of raising.
      overwrite: replace files that exist.
      leaves: export only the array leaves a glob (or one of a list of globs) matches:
        by tensor name (`"params.*"`), by key string as `inspect` prints it
        (`"['params']*"`), or by key prefix (`"params"`: the parameters only, without
        the optimizer state). None exports every array leaf.
    Returns:
      An `ExportReport`.
    Raises:
      CheckpointNotFoundError: no committed checkpoint at `path`.
      UnsupportedValueError: a leaf's dtype the format cannot hold (names the tensor,
        the leaf and the fix), two leaves with one tensor name, or a tensor name the
        format reserves (safetensors' `__metadata__`); raised before a file is opened.
      StructureMismatchError: a glob of `leaves` matches no array leaf (names the
        top-level keys).
      CheckpointExistsError: an output file exists and `overwrite` is False; `out` is a
        folder named like a step (`500`) beside committed steps; orbax: `out` is `path`
        or holds it, or lies inside the checkpoint or inside a step of the run.
      CorruptCheckpointError: stored bytes fail their checksums.
      ValueError: an option that does not apply to `format="orbax"`.

    Warns:
      UserWarning: `format="orbax"` left out per-process state (listed in `dropped`).

    On every failure the temporary files are removed: the output holds either every
    file of the export or none of them (files that were there before stay; except a run
    exported as Orbax with `overwrite=True`: a failure removes `out` whole, since the
    earlier export there was already partly replaced).

    Host memory: one slab of one leaf (`SLAB_BYTES`, 64 MiB, or one row if larger).
    Multi-process: call from one process; it reads every leaf whole.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if format != "npz":  # a folder
        _check_not_named_like_a_step(path, out)
    if format == "orbax":
        given = [n for n, v, d in (("max_shard_bytes", max_shard_bytes, DEFAULT_MAX_SHARD_BYTES), ("separator", separator, "."),
                                   ("upcast", upcast, False), ("leaves", leaves, None)) if v != d]
        if given:
            raise ValueError(f"{', '.join(given)} do(es) not apply to format='orbax' (Orbax gets every leaf, named by its "
                             "keys joined with '.')")
        done = export_orbax(path, out, overwrite=overwrite)
        return ExportReport((done.out,), done.params, (), done.total_bytes, done.steps, done.dropped)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be an int >= 1, got {max_shard_bytes!r}")
    storage, path = storage_for(path)
    meta = read_metadata(storage, path)
    names = tensor_names(meta, separator)
    keys = key_paths(meta.structure)
    keystrs = {p: meta.keystr(p) for p in meta.leaves}
    if leaves is not None:
        top = sorted({_key_text(k[0]) for k in keys.values() if k})
        names = select(names, keystrs, leaves, separator, top, path)
    check_reserved(names, format, path, keystrs)
    items: list[_Item] = []
    for leaf_path, m in meta.arrays.items():
        if leaf_path in names:
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
