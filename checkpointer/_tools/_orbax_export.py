"""Export a checkpoint, or a manager directory, as Orbax checkpoints, written through
TensorStore and JSON alone (Orbax is not imported, nor needed).

What is written is what orbax-checkpoint 0.12's `StandardCheckpointHandler` writes with
`use_ocdbt=False, use_zarr3=True` (see `_orbax_import` for the fields):

```
<item>/_METADATA              {"tree_metadata": {"('a', 'b')": {"key_metadata": [...],
                              "value_metadata": {"value_type": ..., "skip_deserialize": ...,
                              "write_shape": [...]}}}, "use_ocdbt": false, "use_zarr3": true,
                              "store_array_data_equal_to_fill_value": true, ...}
<item>/<param name>/zarr.json one zarr v3 array per array leaf (and per scalar), every chunk
<item>/<param name>/c/...     stored (also those equal to the fill value: Orbax reads with
                              fill_missing_data_reads off)
<item>/_sharding              the saved NamedShardings (Orbax's JSON), for target-less restores
<item>/_strings.json          string leaves
<item>/array_metadatas/process_0   write and chunk shapes; the impl of typed PRNG keys
<item>/_CHECKPOINT_METADATA   (one checkpoint) the handler, timestamps, custom_metadata
<item>/commit_success.txt
```
A manager directory becomes a CheckpointManager directory: `<out>/<step>/default/` (the
item above, Orbax's `DEFAULT_ITEM_NAME`), `<out>/<step>/metrics/metrics` (the step's
metrics as the manager's `JsonCheckpointHandler` writes them), `<out>/<step>/
_CHECKPOINT_METADATA` (`item_handlers`, `commit_timestamp_nsecs`, the user metadata as
`custom_metadata`) and `commit_success.txt`. Each step is written under
`<step>.orbax-checkpoint-tmp-<ns>` and renamed when complete (Orbax skips those
folders), or, on a store without rename, in place with `commit_success.txt` last.

Why not OCDBT: see docs/DESIGN-decisions.md ("Orbax export"). Host memory: one region
of one leaf (`REGION_BYTES`), whatever the leaf's size.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import tensorstore as ts

from .. import _commit, _encoding
from .._errors import CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError, UnsupportedValueError
from .._format import (
    ArrayMetadata,
    Box,
    CheckpointMetadata,
    ValueMetadata,
    cell_box,
    grid_cells,
    process_record_name,
    read_metadata,
    read_process_record,
    value_repr,
    zarr_supports_dtype,
)
from .._storage import Storage, storage_for
from ._orbax_import import below, read_json, resolved

log = logging.getLogger("checkpointer")

ITEM = "default"  # orbax.checkpoint.checkpoint_manager.DEFAULT_ITEM_NAME
METRICS_ITEM = "metrics"  # checkpoint_manager.METRIC_ITEM_NAME (folder and file)
METADATA_FILE = "_METADATA"
SHARDING_FILE = "_sharding"
STRINGS_FILE = "_strings.json"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS = "commit_success.txt"
ARRAY_METADATAS = "array_metadatas/process_0"
TMP_INFIX = ".orbax-checkpoint-tmp-"
STANDARD_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
JSON_HANDLER = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
NAME_MAX = 255  # bytes of one file or folder name (ext4, xfs, APFS, NTFS): a param folder's name
REGION_BYTES = 64 << 20  # the most bytes of one leaf in host memory; also the chunk size limit
SEQUENCE, DICT = 1, 2  # orbax's tree metadata KeyType
_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
_EMPTY_TYPES = {"dict": "Dict", "list": "List", "tuple": "Tuple"}  # others: "None", as Orbax without rich types


def _dumps(obj: object) -> bytes:
    return json.dumps(obj).encode()


# --- the tree as Orbax names it ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    names: tuple[str, ...]  # the key names, as Orbax's get_key_name writes them (str)
    key_types: tuple[int, ...]
    keystr: str
    leaf: ArrayMetadata | ValueMetadata | None  # None: an empty node
    empty_type: str = ""

    @property
    def param(self) -> str:
        return ".".join(self.names)


def _key_name(key: object) -> str:
    if isinstance(key, dict) and "int" in key:
        return str(key["int"])
    if isinstance(key, dict) and "repr" in key:
        return str(key["repr"])
    return str(key)


def _key_type(kind: object, key_kind: object) -> int:
    if kind in ("list", "tuple"):
        return SEQUENCE
    if kind == "custom" and key_kind in ("index", "flat"):
        return SEQUENCE
    return DICT


def orbax_entries(meta: CheckpointMetadata) -> list[_Entry]:
    """Every leaf and empty node of the checkpoint's tree, with Orbax's key names and types,
    in tree order.

    Raises:
      UnsupportedValueError: two leaves get one Orbax param name (names both).
    """
    out: list[_Entry] = []
    stack: list[tuple[dict, tuple, tuple, str]] = [(meta.structure, (), (), "")]
    while stack:
        node, names, types, keystr = stack.pop()
        kind = node.get("kind")
        if kind == "leaf":
            path = node.get("path")
            leaf = meta.leaves.get(path) if isinstance(path, str) else None
            if leaf is None:
                raise CorruptCheckpointError(f"{meta.path}: the tree names leaf {path!r}, which the manifest lacks")
            out.append(_Entry(names, types, leaf.keystr or keystr, leaf))
            continue
        keys, children = node.get("keys", []), node.get("children", [])
        if not keys:
            out.append(_Entry(names, types, keystr, None, _EMPTY_TYPES.get(str(kind), "None")))
            continue
        kinds = node.get("key_kinds") or [None] * len(keys)
        for k, child, kk in reversed(list(zip(keys, children, kinds))):
            stack.append((child, names + (_key_name(k),), types + (_key_type(kind, kk),), keystr + f"[{_key_name(k)!r}]"))
    seen: dict[str, str] = {}
    for e in out:
        if e.param in seen:
            raise UnsupportedValueError(
                f"leaves {seen[e.param]} and {e.keystr} of {meta.path} would both be the Orbax param {e.param!r} (Orbax "
                "joins keys with '.'); nothing was written. Rename one key, or export the others with --format safetensors"
            )
        seen[e.param] = e.keystr
    return out


# The item's own files: a param folder of one of these names would collide with them.
_ITEM_FILES = (METADATA_FILE, SHARDING_FILE, STRINGS_FILE, CHECKPOINT_METADATA, COMMIT_SUCCESS, ARRAY_METADATAS)


def _bad_param(param: str) -> str | None:
    """Why the param name cannot be a folder of the item (None if it can): Orbax writes a
    param's zarr array at `<item>/<param>/`, '/' in a key included."""
    if param == "":
        return None  # the item folder itself, as Orbax writes it
    parts = param.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "has an empty, '.' or '..' path component (a key with '/' makes folders)"
    longest = max(len(p.encode()) for p in parts)
    if longest > NAME_MAX:
        return (f"is one folder name of {longest} bytes (Orbax joins the keys with '.'), longer than the {NAME_MAX} "
                "bytes a file or folder name may have")
    if any(param == f or param.startswith(f + "/") for f in _ITEM_FILES):
        return "is the name of a file the Orbax checkpoint itself holds"
    return None


def _writes_folder(e: _Entry) -> bool:
    return isinstance(e.leaf, ArrayMetadata) or (
        isinstance(e.leaf, ValueMetadata) and e.leaf.value is not None and not isinstance(e.leaf.value, str))


def _in_files_of(param: str, ndims: dict[str, int]) -> str | None:
    """The param (of `ndims`: param -> rank) whose zarr files `param`'s folder would land
    on (`<q>/zarr.json`, a chunk `<q>/c/<i>/...`, or a scalar's one chunk `<q>/c`), or None.
    The param '' (a top-level key '') is the item folder itself: its files are the item's."""
    parts = param.split("/")
    for i in range(len(parts)):
        q, rest = "/".join(parts[:i]), parts[i:]
        if q not in ndims:
            continue
        if rest[0] == "zarr.json" or (rest[0] == "c" and (ndims[q] == 0 or (len(rest) > 1 and rest[1].isdigit()))):
            return q
    return None


def _check_exportable(meta: CheckpointMetadata, entries: Sequence[_Entry]) -> None:
    ndims = {e.param: len(e.leaf.shape) if isinstance(e.leaf, ArrayMetadata) else 0 for e in entries if _writes_folder(e)}
    for e in entries:
        where = f"leaf {e.keystr or '(root)'} of {meta.path}"
        if not e.names:
            raise UnsupportedValueError(
                f"{meta.path} holds one leaf (or one empty node) as its whole tree; an Orbax PyTree checkpoint holds a "
                "tree of named leaves. Save it as {'x': value} and export that"
            )
        writes_folder = _writes_folder(e)
        why = _bad_param(e.param) if writes_folder else None
        owner = _in_files_of(e.param, ndims) if writes_folder and why is None else None
        if owner is not None:
            why = f"lies on the zarr files (zarr.json, chunks c/...) of the param {owner!r}"
        if why is not None:
            raise UnsupportedValueError(
                f"{where} would be the Orbax param {e.param!r}, which {why}; nothing was written. Rename the key, "
                "or export with --format safetensors"
            )
        if isinstance(e.leaf, ArrayMetadata) and not zarr_supports_dtype(e.leaf.dtype):
            raise UnsupportedValueError(
                f"{where} has dtype {e.leaf.dtype}, which Orbax (zarr3 through TensorStore) cannot store; nothing was "
                "written. Convert it in your own code, or export with --format safetensors --upcast"
            )
        if isinstance(e.leaf, ValueMetadata) and not (e.leaf.value is None or isinstance(e.leaf.value, str) or _scalar(e.leaf.value) is not None):
            raise UnsupportedValueError(
                f"{where} holds {value_repr(e.leaf.value, 80)} ({type(e.leaf.value).__name__}), which Orbax cannot store (its "
                "scalars are 0-d numpy arrays: int64 at most); nothing was written. Store it as a string or an array"
            )


def _scalar(value: object) -> np.ndarray | None:
    """The 0-d array Orbax stores for a scalar leaf, None if it has none."""
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, (bool, int, float, complex)):
        arr = np.asarray(value)
        return arr if arr.dtype.kind in "biufc" else None
    return None


# --- writing one item -------------------------------------------------------------------------


def write_chunk_shape(shape: Sequence[int], chunk_shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """The zarr chunk shape written: the checkpoint's chunk shape, with leading dimensions
    cut until a chunk holds at most `REGION_BYTES` (each write is whole chunks)."""
    out = [max(1, c) for c in chunk_shape]
    for d in range(len(out)):
        rest = math.prod(out[d + 1:]) * itemsize
        if math.prod(out) * itemsize <= REGION_BYTES:
            break
        out[d] = max(1, REGION_BYTES // max(1, rest))
    return tuple(min(c, max(1, s)) for c, s in zip(out, shape))


def _zarr3_spec(storage: Storage, folder: str, shape: Sequence[int], dtype: np.dtype, chunks: Sequence[int]) -> dict:
    return {
        "driver": "zarr3",
        "kvstore": storage.kvstore_spec(folder),
        "metadata": {
            "shape": list(shape),
            "data_type": np.dtype(dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd", "configuration": {"level": 1}}],
        },
        "create": True,
        "store_data_equal_to_fill_value": True,
    }


def _write_array(storage: Storage, src_storage: Storage, src: str, item: str, name: str,
                 meta: ArrayMetadata) -> tuple[int, ...]:
    """Copies one array leaf of `src` (read through `src_storage`) into `storage`, region by
    region (whole chunks of the output); returns the chunk shape."""
    chunks = write_chunk_shape(meta.shape, meta.chunk_shape, meta.dtype.itemsize)
    store = ts.open(_zarr3_spec(storage, f"{item}/{name}", meta.shape, meta.dtype, chunks), context=_CONTEXT).result()
    read = _encoding.region_reader(src_storage, src, meta)
    whole = Box.whole(meta.shape)
    if not meta.shape:
        store.write(read(whole)).result()
        return chunks
    for cell in grid_cells(whole, chunks):
        box = cell_box(cell, chunks, meta.shape)
        region = read(box)  # one chunk in memory at a time
        store[box.slices()].write(region).result()
        del region
    return chunks


def _write_scalar(storage: Storage, item: str, name: str, value: np.ndarray) -> None:
    store = ts.open(_zarr3_spec(storage, f"{item}/{name}", (), value.dtype, ()), context=_CONTEXT).result()
    store.write(value).result()


def _sharding_json(meta: ArrayMetadata) -> str:
    """Orbax's JSON of the leaf's sharding (`_sharding`, read by target-less restores): the
    saved NamedSharding on devices 0..n-1 (Orbax would have recorded the real ids, which
    our manifest does not keep); any other sharding as a one-device mesh of device 0 (a
    SingleDeviceSharding's `device_str` names a platform, which the export cannot know)."""
    s = meta.saved_sharding
    named = s is not None and s.kind == "named"
    mesh_shape = list(s.mesh_shape) if s is not None and named else [1]
    axes = list(s.mesh_axis_names) if s is not None and named else ["devices"]
    spec = [list(e) if isinstance(e, tuple) else e for e in s.spec] if s is not None and named else []
    ids = np.arange(math.prod(mesh_shape)).reshape(mesh_shape).tolist()

    def devices(x: object) -> object:
        return [devices(y) for y in x] if isinstance(x, list) else {"id": x}

    return json.dumps({"sharding_type": "NamedSharding", "shape": mesh_shape, "axis_names": axes,
                       "axis_types": ["AxisType.Auto"] * len(mesh_shape), "partition_spec": spec,
                       "device_mesh": {"mesh": devices(ids)}})


def write_item(storage: Storage, src_storage: Storage, src: str, meta: CheckpointMetadata,
               item: str) -> tuple[dict[str, str], int]:
    """Writes the checkpoint at `src` of `src_storage` (its metadata `meta`) as an Orbax
    PyTree item folder `item` of `storage` (created); returns (param name -> key string,
    bytes of array data)."""
    import base64

    entries = orbax_entries(meta)
    _check_exportable(meta, entries)
    storage.makedirs(item)
    tree_metadata: dict[str, dict] = {}
    shardings: dict[str, str] = {}
    strings: dict[str, str] = {}
    array_metadatas: list[dict] = []
    params: dict[str, str] = {}
    total = 0
    for e in entries:
        name = e.param
        value_meta: dict = {}
        if e.leaf is None or (isinstance(e.leaf, ValueMetadata) and e.leaf.value is None):
            value_meta = {"value_type": e.empty_type or "None", "skip_deserialize": True}
        elif isinstance(e.leaf, ValueMetadata) and isinstance(e.leaf.value, str):
            strings[name] = e.leaf.value
            value_meta = {"value_type": "string", "skip_deserialize": False}
        elif isinstance(e.leaf, ValueMetadata):
            scalar = _scalar(e.leaf.value)
            assert scalar is not None  # _check_exportable
            _write_scalar(storage, item, name, scalar)
            value_meta = {"value_type": "scalar", "skip_deserialize": False}
        else:
            m = e.leaf
            chunks = _write_array(storage, src_storage, src, item, name, m)
            total += m.nbytes
            if m.kind == "numpy" and m.key_impl is None:
                value_meta = {"value_type": "np.ndarray", "skip_deserialize": False}
            else:
                value_meta = {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(chunks)}
                shardings[base64.b64encode(name.encode()).decode()] = _sharding_json(m)
                array_metadatas.append({"array_metadata": {
                    "param_name": name, "write_shape": list(chunks), "chunk_shape": list(chunks),
                    "ext_metadata": {"random_key_impl": m.key_impl} if m.key_impl else None}})
        params[name] = e.keystr
        key_metadata = [{"key": n, "key_type": t} for n, t in zip(e.names, e.key_types)]
        tree_metadata[str(e.names)] = {"key_metadata": key_metadata, "value_metadata": value_meta}
    if shardings:
        storage.write_file(f"{item}/{SHARDING_FILE}", _dumps(shardings))
    if strings:
        storage.write_file(f"{item}/{STRINGS_FILE}", _dumps(strings))
    if array_metadatas:
        storage.makedirs(f"{item}/array_metadatas")
        storage.write_file(f"{item}/{ARRAY_METADATAS}", _dumps({"array_metadatas": array_metadatas}))
    storage.write_file(f"{item}/{METADATA_FILE}", _dumps({
        "tree_metadata": tree_metadata, "use_ocdbt": False, "use_zarr3": True,
        "store_array_data_equal_to_fill_value": True, "custom_metadata": None}))
    back = read_json(storage, f"{item}/{METADATA_FILE}")  # what Orbax will read
    if not isinstance(back, dict) or len(back.get("tree_metadata", ())) != len(entries):
        raise OSError(f"{item}/{METADATA_FILE} does not read back as written")
    storage.write_file(f"{item}/{COMMIT_SUCCESS}", f"Checkpoint commit was successful to {item}".encode())
    return params, total


# --- what Orbax cannot hold -------------------------------------------------------------------


def dropped_state(storage: Storage, path: str, meta: CheckpointMetadata) -> list[str]:
    """One line for each thing of the checkpoint that the Orbax export leaves out.

    Raises:
      CorruptCheckpointError: a process's record is missing (names it).
    """
    out = []
    for i in range(meta.process_count):
        location = f"{path}/{process_record_name(i)}"
        try:
            record = read_process_record(storage, location)
        except FileNotFoundError as e:  # not skipped: a manifest claiming 10**9 processes read 10**9 missing files
            raise CorruptCheckpointError(
                f"{location} is missing: process {i} of {meta.process_count} left no record in {path}; nothing was "
                "exported") from e
        if record.per_process_state is not None:
            out.append(f"{path}: the per-process state of process {i} (Orbax has none; read it with "
                       f"ckpt.per_process_state({path!r}, process_index={i}) and save it yourself)")
    return out


def _metrics_for_orbax(metrics: object) -> dict:
    """The stored metrics as numbers again ("NaN", "Infinity" were stored as strings)."""
    if not isinstance(metrics, dict):
        return {}
    special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
    return {k: special.get(v, v) if isinstance(v, str) else v for k, v in metrics.items()}


def _step_metadata(meta: CheckpointMetadata, handlers: object, user: dict) -> bytes:
    ns = int(meta.created_unix_s * 1e9)
    return _dumps({"item_handlers": handlers, "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": ns,
                   "commit_timestamp_nsecs": ns, "custom_metadata": user})


def _user_metadata(meta: CheckpointMetadata) -> dict:
    user = {k: v for k, v in meta.user_metadata.items() if k != "metrics"}
    user["exported_from"] = {"format": "checkpointer", "path": meta.path, "step": meta.step}
    return user


# --- one checkpoint, a whole run --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OrbaxExport:
    """What `export_orbax` wrote (`export` turns it into an `ExportReport`)."""

    out: str
    steps: tuple[int, ...]
    params: dict[str, str]  # Orbax param name -> the item folder (of the newest step) that holds it
    dropped: tuple[str, ...]
    total_bytes: int


def _remove(storage: Storage, path: str) -> None:
    """Removes the folder or file at `path`, if any (what `overwrite` replaces)."""
    if storage.is_folder(path):
        storage.delete_tree(path)
    elif storage.exists(path):
        storage.delete_file(path)


def _publish(storage: Storage, write: Callable[[str], None], final: str, overwrite: bool) -> None:
    """Runs `write(folder)` into a temporary folder renamed to `final` when complete (or,
    without rename, into `final` with `commit_success.txt` last); removes it on failure.
    An existing `final` (only with `overwrite`) is removed just before the rename."""
    folder = f"{final}{TMP_INFIX}{time.time_ns()}" if storage.supports_rename else final
    if not storage.supports_rename:
        _remove(storage, final)  # no rename: the old one goes first
    try:
        write(folder)
        storage.write_file(f"{folder}/{COMMIT_SUCCESS}", f"Checkpoint commit was successful to {final}".encode())  # last
        if storage.supports_rename:
            if overwrite:
                _remove(storage, final)
            storage.rename(folder, final)
    except BaseException:
        try:
            storage.delete_tree(folder)
        except OSError as e:
            log.warning("could not remove the unfinished Orbax export %s: %s", folder, e)
        raise


def _export_one(storage: Storage, src: str, meta: CheckpointMetadata, out_storage: Storage, out: str, *,
                step_layout: bool, overwrite: bool) -> tuple[dict[str, str], int]:
    """One checkpoint as an Orbax item folder `out` (StandardCheckpointer's layout), or, with
    `step_layout`, as a CheckpointManager step folder `out` (`default/`, `metrics/`)."""
    result: dict = {}

    def write(folder: str) -> None:
        item = f"{folder}/{ITEM}" if step_layout else folder
        params, total = write_item(out_storage, storage, src, meta, item)
        handlers: object = STANDARD_HANDLER
        if step_layout:
            handlers = {ITEM: STANDARD_HANDLER}
            metrics = _metrics_for_orbax(meta.user_metadata.get("metrics"))
            if metrics:
                out_storage.makedirs(f"{folder}/{METRICS_ITEM}")
                out_storage.write_file(f"{folder}/{METRICS_ITEM}/{METRICS_ITEM}", _dumps(metrics))
                out_storage.write_file(f"{folder}/{METRICS_ITEM}/{COMMIT_SUCCESS}", b"Checkpoint commit was successful")
                handlers[METRICS_ITEM] = JSON_HANDLER
        out_storage.write_file(f"{folder}/{CHECKPOINT_METADATA}", _step_metadata(meta, handlers, _user_metadata(meta)))
        final_item = f"{out}/{ITEM}" if step_layout else out
        result.update(params={p: final_item for p in params}, total=total)

    _publish(out_storage, write, out, overwrite)
    return result["params"], result["total"]


def _check_out(storage: Storage, out: str, overwrite: bool) -> None:
    if (storage.exists(out) or storage.is_folder(out)) and not overwrite:
        raise CheckpointExistsError(f"{out} exists; pass --overwrite (overwrite=True) to replace it, or export elsewhere")


def _check_apart(storage: Storage, src: str, out_storage: Storage, dst: str, one_checkpoint: bool,
                 steps: Sequence[str] = ()) -> None:
    """Refuses an `out` that is the source or a folder above it (replacing it would delete
    the source once the export is written), and an `out` inside one checkpoint or inside
    one of the run's step folders `steps` (it would change a committed checkpoint, and
    retention would delete it with the step)."""
    if type(storage) is not type(out_storage):
        return
    if resolved(src) == resolved(dst) or below(dst, src) is not None:
        raise CheckpointExistsError(
            f"{dst} is the source {src} or a folder that holds it: writing the Orbax export there would delete the "
            "source; nothing was written. Export to a folder outside it")
    inside = below(src, dst)
    if one_checkpoint and inside is not None:
        raise CheckpointExistsError(
            f"{dst} is inside the checkpoint {src}: the export would change a committed checkpoint; nothing was "
            "written. Export to a folder outside it")
    if not one_checkpoint and inside is not None:
        first = inside.split("/", 1)[0]
        if first in steps:
            raise CheckpointExistsError(
                f"{dst} is inside the step {src.rstrip('/')}/{first} of {src}: the export would change a committed "
                "checkpoint, and retention would delete it with the step; nothing was written. Export beside the "
                f"steps ({src.rstrip('/')}/orbax) or outside the run")


def export_orbax(path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> OrbaxExport:
    """Writes a checkpoint as an Orbax checkpoint, or a manager directory as an Orbax
    CheckpointManager directory (see `export`, `format="orbax"`).

    Raises:
      CheckpointNotFoundError: `path` is neither a committed checkpoint nor a directory of
        committed steps.
      CheckpointExistsError: `out` exists and `overwrite` is False; `out` is `path` or a
        folder above it (even with `overwrite`: it would delete the source), or inside
        the one checkpoint `path` or one of the steps of the run `path`.
      UnsupportedValueError: a leaf Orbax cannot hold, or two leaves with one Orbax name
        (names them); raised before anything is written.
      CorruptCheckpointError: a process record is missing (before anything is written).
    """
    storage, src = storage_for(path)
    out_storage, dst = storage_for(out)
    try:
        meta: CheckpointMetadata | None = read_metadata(storage, src)
    except CheckpointNotFoundError:
        meta = None
    if meta is not None:
        _check_exportable(meta, orbax_entries(meta))
        _check_apart(storage, src, out_storage, dst, one_checkpoint=True)
        _check_out(out_storage, dst, overwrite)
        dropped = dropped_state(storage, src, meta)
        parent = dst.rstrip("/").rsplit("/", 1)[0] if "/" in dst.rstrip("/") else ""
        if parent:
            out_storage.makedirs(parent)
        params, total = _export_one(storage, src, meta, out_storage, dst, step_layout=False, overwrite=overwrite)
        _warn(dropped)
        return OrbaxExport(dst, (), params, tuple(dropped), total)
    folders = _commit.committed_folders(storage, src) if storage.is_folder(src) else {}
    if not folders:
        raise CheckpointNotFoundError(f"{src} is neither a committed checkpoint nor a manager directory with committed steps")
    metas = {s: read_metadata(storage, f"{src}/{f}") for s, f in sorted(folders.items())}
    for m in metas.values():
        _check_exportable(m, orbax_entries(m))
    _check_apart(storage, src, out_storage, dst, one_checkpoint=False,
                 steps=(*folders.values(), *map(str, folders)))
    _check_out(out_storage, dst, overwrite)
    all_dropped = [line for s, m in metas.items() for line in dropped_state(storage, f"{src}/{folders[s]}", m)]
    if not out_storage.is_folder(dst):
        _remove(out_storage, dst)  # a file there (overwrite: _check_out refused it otherwise)
    out_storage.makedirs(dst)
    all_params: dict[str, str] = {}
    total = 0
    try:
        # overwrite: steps the source does not have would read as part of the run, and the files
        # of an earlier one-checkpoint export there as a checkpoint of their own; the steps
        # exported again are replaced one by one below.
        stale = [n for n in out_storage.list_dir(dst) if not (n.isdigit() and int(n) in metas)]
        for name in stale:
            _remove(out_storage, f"{dst}/{name}")
        for s, m in metas.items():
            step_src = f"{src}/{folders[s]}"
            params, n = _export_one(storage, step_src, m, out_storage, f"{dst}/{s}", step_layout=True, overwrite=overwrite)
            all_params.update(params)
            total += n
    except BaseException as e:
        # The steps published so far are complete Orbax steps: left there, Orbax would list
        # a shorter run (or, over an earlier export, a mix of new and old steps) as complete.
        _remove_unfinished_run(out_storage, dst, e)
        raise
    _warn(all_dropped)
    return OrbaxExport(dst, tuple(metas), all_params, tuple(all_dropped), total)


def _remove_unfinished_run(storage: Storage, dst: str, error: BaseException) -> None:
    try:
        storage.delete_tree(dst)
    except OSError as e:
        log.warning("could not remove the unfinished Orbax export %s: %s", dst, e)
        error.add_note(f"the unfinished Orbax export {dst} could not be removed ({e}); delete it before using it")
        return
    error.add_note(f"the unfinished Orbax export {dst} was removed (it held only some of the steps); export again")


def _warn(dropped: Sequence[str]) -> None:
    if dropped:
        warnings.warn("the Orbax export left out what Orbax cannot hold:\n  " + "\n  ".join(dropped), UserWarning, stacklevel=4)
