"""Import an Orbax PyTree checkpoint, read through TensorStore alone (no Orbax needed).

What an Orbax `PyTreeCheckpointHandler` / `StandardCheckpointHandler` item folder holds
(orbax-checkpoint 0.12, `_src/metadata/tree.py`, `_src/serialization/`):

```
<item>/_METADATA          {"tree_metadata": {"('a', 'b')": {"key_metadata": [{"key": "a",
                          "key_type": 2}, ...], "value_metadata": {"value_type": "jax.Array",
                          "write_shape": [...], "skip_deserialize": false}}, ...},
                          "use_ocdbt": bool, "use_zarr3": bool, ...}
<item>/_sharding          {base64(param name): JSON string of the sharding (NamedSharding:
                          "shape", "axis_names", "partition_spec"; or SingleDeviceSharding)}
<item>/_strings.json      {param name: str} for string leaves
<item>/manifest.ocdbt, d/ OCDBT: one key-value database holding every array as
                          `<param name>/.zarray` (zarr v2) or `<param name>/zarr.json` (v3)
                          plus its chunks; `ocdbt.process_<i>/` are the per-process parts
<item>/<param name>/      without OCDBT: one zarr array folder per leaf
<item>/array_metadatas/process_<i>
                          {"array_metadatas": [{"array_metadata": {"param_name": ...,
                          "ext_metadata": {"random_key_impl": "threefry2x32"} or null}}]}:
                          a typed PRNG key array is stored as its key data, with its impl here
```
A param name is the leaf's keys joined by `.`; `key_type` 1 is a sequence index, 2 a
dict key (or attribute). `value_type` is `jax.Array`, `np.ndarray`, `scalar` (a 0-d
array, restored as a Python number), `string`, or for empty nodes `None`, `Dict`,
`List`, `Tuple`, `NamedTuple`. A CheckpointManager step folder holds one item folder
per item (`default/`, `state/`, ...).

The import builds the tree as Orbax restores it without a target (dicts and lists,
Python scalars; numpy scalars of other dtypes than Python's numbers keep their type), keeps each array's saved sharding and shard shape, and writes it with
`_stream_save.save_leaf_by_leaf`: one chunk at a time, never the whole tree in memory.
Typed PRNG keys keep their impl (restored as typed keys). An empty node Orbax wrote as
`None` (optax's `EmptyState()`, any empty NamedTuple) stays a None leaf, listed as a
placeholder: restore fills it with the target's empty container (`_restore` matching).
Step folders and manager directories: `_orbax_run`.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import logging
import math
import os
from collections.abc import Callable

import numpy as np
import tensorstore as ts

from .._errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedValueError
from .._format import MAX_JSON_BYTES, SavedSharding, load_json
from .._save import ArraySource, RegionReader
from .._storage import Storage, storage_for

log = logging.getLogger("checkpointer")

METADATA_FILE = "_METADATA"
SHARDING_FILE = "_sharding"
STRINGS_FILE = "_strings.json"
ARRAY_METADATAS = "array_metadatas"
RANDOM_KEY_IMPL = "random_key_impl"
_EMPTY: dict[str, Callable[[], object]] = {"None": lambda: None, "Dict": dict, "List": list, "Tuple": tuple, "NamedTuple": tuple}
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
_ARRAY_KINDS = {"jax.Array": "jax", "np.ndarray": "numpy"}  # `ArraySource.kind` of a sharded array
# The most keys in one leaf's key path: jax's tree functions (and the nesting below) recurse
# per level, and a tree ~500 levels deep exceeds Python's default recursion limit of 1000
# in ckpt.save itself (and in Orbax's save): deeper is a corrupt _METADATA.
MAX_KEY_DEPTH = 400


def _context() -> ts.Context:
    """A new TensorStore context for one item: data chunks are never cached (each is read
    once); OCDBT's b-tree nodes are, a little. Not one for the whole process: its OCDBT
    cache would keep a checkpoint's manifest after Orbax saved another at the same path
    (a new database), and the next import would fail with "Configuration mismatch"."""
    return ts.Context({"cache_pool": {"total_bytes_limit": 0}, "cache_pool#ocdbt": {"total_bytes_limit": 8 << 20}})


def find_item(storage: Storage, src: str) -> str:
    """The Orbax item folder at `src`: `src` itself, or its one subfolder holding `_METADATA`.

    Raises:
      CheckpointNotFoundError: no `_METADATA` there, or several items to choose from.
    """
    if storage.exists(f"{src}/{METADATA_FILE}"):
        return src
    items = sorted(n for n in storage.list_dir(src) if storage.exists(f"{src}/{n}/{METADATA_FILE}"))
    if len(items) == 1:
        return f"{src}/{items[0]}"
    if items:
        raise CheckpointNotFoundError(
            f"{src} holds several Orbax items ({', '.join(items)}); import one of them, e.g. {src}/{items[0]}"
        )
    raise CheckpointNotFoundError(
        f"{src} is not an Orbax PyTree checkpoint: no {METADATA_FILE} in it or in a subfolder (an Orbax "
        "CheckpointManager step folder holds one folder per item, e.g. <step>/default). Checkpoints written "
        "by Orbax before _METADATA existed: restore them with Orbax and save them with ckpt.save"
    )


def resolved(path: str) -> str:
    """`path` as compared for containment: a local path resolved (`realpath`), a URL
    without its trailing '/'."""
    return os.path.realpath(path) if "://" not in path else path.rstrip("/")


def below(top: str, path: str) -> str | None:
    """`path` relative to the folder `top` ('/'-separated) when it lies strictly inside
    it, else None (`resolved` paths: the export's and the import's refusals of an output
    inside their source)."""
    a, b = resolved(top), resolved(path)
    sep = os.sep if "://" not in top else "/"
    head = a.rstrip(sep) + sep
    return b[len(head):].replace(sep, "/") if b.startswith(head) else None


def read_json(storage: Storage, path: str) -> object:
    """The JSON of the Orbax file at `path`, through the library's bounded parser.

    Raises:
      CorruptCheckpointError: not JSON, nested too deeply, or larger than `MAX_JSON_BYTES`
        (refused before reading); names the file.
    """
    try:
        raw = storage.read_file(path, max_bytes=MAX_JSON_BYTES)
    except OSError as e:
        if e.errno != errno.EFBIG:
            raise
        raise CorruptCheckpointError(f"{path} is larger than {MAX_JSON_BYTES} bytes: not an Orbax metadata file") from e
    return load_json(raw, what=path)


def _read_json_object(storage: Storage, path: str, *, required: bool) -> dict:
    """The JSON object in the file at `path`; {} when it is absent and not `required`."""
    if not storage.exists(path):
        if required:
            raise CheckpointNotFoundError(f"{path} is missing")
        return {}
    obj = read_json(storage, path)
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{path} holds a JSON {type(obj).__name__}, expected an object")
    return obj


def _keys(entry: dict, where: str) -> tuple:
    try:
        return tuple(int(k["key"]) if k["key_type"] == 1 else str(k["key"]) for k in entry["key_metadata"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"malformed key_metadata in {where}: {e}") from e


def _saved_sharding(raw: str | None, shape: tuple[int, ...]) -> tuple[SavedSharding | None, tuple[int, ...]]:
    """(SavedSharding, shard shape) from Orbax's JSON of a sharding; (None, shape) if absent."""
    if raw is None:
        return None, shape
    try:
        if not isinstance(raw, str):  # a damaged _sharding: Orbax writes JSON strings
            raise TypeError(f"a JSON {type(raw).__name__}, not a string")
        obj = load_json(raw, what="an Orbax sharding description")
        kind = obj.get("sharding_type")
        if kind == "NamedSharding":
            axes = tuple(str(a) for a in obj["axis_names"])
            mesh = tuple(int(s) for s in obj["shape"])
            size = dict(zip(axes, mesh))
            spec = tuple(tuple(e) if isinstance(e, list) else e for e in obj["partition_spec"])
            shard = []
            for i, dim in enumerate(shape):
                entry = spec[i] if i < len(spec) else None
                names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
                shard.append(dim // math.prod(size[n] for n in names) if dim else 0)
            return SavedSharding("named", axes, mesh, spec, tuple(shard), math.prod(mesh)), tuple(shard)
        if kind == "SingleDeviceSharding":
            return SavedSharding("single_device", (), (), (), shape, 1), shape
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        log.warning("unreadable Orbax sharding %s: %s", repr(raw)[:200], e)
    return SavedSharding("other", (), (), (), shape, 1), shape


def _array_spec(storage: Storage, item: str, name: str, use_ocdbt: bool, use_zarr3: bool) -> dict:
    if use_ocdbt:
        kvstore = {"driver": "ocdbt", "base": storage.kvstore_spec(item), "path": f"{name}/", "cache_pool": "cache_pool#ocdbt"}
    else:
        kvstore = storage.kvstore_spec(f"{item}/{name}")
    return {"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": kvstore, "open": True, "fill_missing_data_reads": False,
            "recheck_cached_data": False}


def _key_impls(storage: Storage, item: str) -> dict[str, str]:
    """Param name -> PRNG impl, from `array_metadatas/process_<i>` (absent before orbax 0.9)."""
    folder = f"{item}/{ARRAY_METADATAS}"
    if not storage.is_folder(folder):
        return {}
    impls: dict[str, str] = {}
    for name in sorted(storage.list_dir(folder)):
        if not name.startswith("process_"):
            continue
        obj = _read_json_object(storage, f"{folder}/{name}", required=True)
        entries = obj.get("array_metadatas", [])
        if not isinstance(entries, list):
            raise CorruptCheckpointError(f"{folder}/{name}: array_metadatas is not a list")
        for entry in entries:
            am = entry.get("array_metadata") if isinstance(entry, dict) else None
            if not isinstance(am, dict):
                continue
            ext = am.get("ext_metadata")
            if isinstance(ext, dict) and isinstance(ext.get(RANDOM_KEY_IMPL), str):
                impls[str(am.get("param_name"))] = ext[RANDOM_KEY_IMPL]
    return impls


@dataclasses.dataclass(frozen=True)
class OrbaxItem:
    """One Orbax PyTree item, read (`orbax_tree`).

    Attributes:
      folder: the item folder.
      tree: nested dicts and lists of `ArraySource`s and values.
      placeholders: key string -> Orbax's empty-node type (`None`, `Dict`, ...) of each
        empty node the tree holds as a None, `{}`, `[]` or `()` leaf.
      prng_keys: key strings of the typed PRNG key arrays.
    """

    folder: str
    tree: object
    placeholders: dict[str, str]
    prng_keys: tuple[str, ...]


# The dtypes Orbax stores a Python bool, int, float or complex as: such a scalar comes back
# as the Python number (as Orbax restores it); any other dtype was a numpy scalar.
_PYTHON_SCALAR_DTYPES = frozenset(np.dtype(t) for t in (np.bool_, np.int64, np.float64, np.complex128))


def _scalar(value: np.ndarray) -> object:
    """An Orbax `scalar` leaf: a Python number for the dtypes of Python's numbers, else the
    numpy scalar of its dtype (`np.float32(1.5)` keeps its type; `np.int64(-3)` is stored
    as a Python int is, so it comes back as one unless the target holds a numpy scalar)."""
    if value.ndim != 0:
        return value
    return value.item() if value.dtype in _PYTHON_SCALAR_DTYPES else value[()]


def _reader(store: ts.TensorStore) -> RegionReader:
    return lambda box: store[box.slices()].read().result()


def orbax_tree(src: str | os.PathLike) -> OrbaxItem:
    """Reads an Orbax checkpoint's metadata into a tree of `ArraySource`s and values.

    Args:
      src: the Orbax item folder, or a step folder with one item (local path or URL).
    Returns:
      An `OrbaxItem`: the tree as nested dicts and lists as Orbax restores them
      without a target; array leaves are `ArraySource`s that read through TensorStore.
    Raises:
      CheckpointNotFoundError: no Orbax checkpoint at `src`.
      UnsupportedValueError: a leaf written by a custom Orbax TypeHandler, or a key path
        deeper than `MAX_KEY_DEPTH` keys (names it).
      CorruptCheckpointError: the metadata or an array cannot be read.
    """
    storage, src = storage_for(src)
    item = find_item(storage, src)
    meta = _read_json_object(storage, f"{item}/{METADATA_FILE}", required=True)
    if not isinstance(meta.get("tree_metadata"), dict):
        raise CorruptCheckpointError(f"{item}/{METADATA_FILE} has no tree_metadata object")
    use_ocdbt, use_zarr3 = bool(meta.get("use_ocdbt", False)), bool(meta.get("use_zarr3", False))
    needs_arrays = any(isinstance(e, dict) and isinstance(e.get("value_metadata"), dict)
                       and e["value_metadata"].get("value_type") in _ARRAY_TYPES for e in meta["tree_metadata"].values())
    # Orbax writes no OCDBT database when no leaf is an array (empty nodes, None, strings).
    if use_ocdbt and needs_arrays and not storage.exists(f"{item}/manifest.ocdbt"):
        raise CorruptCheckpointError(
            f"{item} says use_ocdbt but has no manifest.ocdbt (an unfinished save, or per-process OCDBT databases "
            "that were never merged); restore it with Orbax and save it with ckpt.save"
        )
    context = _context()
    shardings = _read_json_object(storage, f"{item}/{SHARDING_FILE}", required=False)
    strings = _read_json_object(storage, f"{item}/{STRINGS_FILE}", required=False)
    impls = _key_impls(storage, item)
    placeholders: dict[str, str] = {}
    prng_keys: list[str] = []
    entries = []
    for entry in meta["tree_metadata"].values():
        keys = _keys(entry, f"{item}/{METADATA_FILE}")
        if len(keys) > MAX_KEY_DEPTH:
            raise UnsupportedValueError(
                f"{item}/{METADATA_FILE}: the leaf {''.join(f'[{k!r}]' for k in keys[:3])}... is {len(keys)} keys deep; "
                f"this import takes at most {MAX_KEY_DEPTH} (jax's tree functions, and ckpt.save, recurse per level); "
                "nothing was written. A _METADATA this deep is likely damaged: check it, or restore with Orbax")
        value_meta = entry.get("value_metadata") or {}
        if not isinstance(value_meta, dict):
            raise CorruptCheckpointError(f"{item}/{METADATA_FILE}: the value_metadata of {keys} is not an object")
        value_type = value_meta.get("value_type")
        if value_type is not None and not isinstance(value_type, str):
            raise CorruptCheckpointError(
                f"{item}/{METADATA_FILE}: the value_type of {keys} is {value_type!r}, not a type name (a string)")
        entries.append((keys, value_type, value_meta))
    # As Orbax's as_nested_tree: drop empty-node placeholders that prefix other entries.
    entries.sort(key=lambda e: tuple((type(k) is int, str(k)) for k in e[0]))
    all_keys = [e[0] for e in entries]
    flat = []
    for keys, value_type, _value_meta in entries:
        if value_type in _EMPTY and any(len(o) > len(keys) and o[: len(keys)] == keys for o in all_keys):
            continue
        name = ".".join(str(k) for k in keys)
        key_str = "".join(f"[{k!r}]" for k in keys)
        if value_type in _EMPTY:
            placeholders[key_str] = value_type
            flat.append((keys, _EMPTY[value_type]()))
        elif value_type == "string":
            if name not in strings:
                raise CorruptCheckpointError(f"{item}: string leaf {key_str} is not in {STRINGS_FILE}")
            flat.append((keys, str(strings[name])))
        elif value_type in _ARRAY_TYPES:
            try:
                store = ts.open(_array_spec(storage, item, name, use_ocdbt, use_zarr3), context=context, read=True).result()
            except Exception as e:
                raise CorruptCheckpointError(f"{item}: cannot open the array of leaf {key_str} ({name}): {e}") from e
            shape = tuple(int(s) for s in store.shape)
            dtype = np.dtype(store.dtype.numpy_dtype)
            if value_type == "scalar":
                value = np.asarray(store.read().result())
                flat.append((keys, _scalar(value)))
                continue
            b64 = base64.b64encode(name.encode()).decode()
            saved, shard = _saved_sharding(shardings.get(b64), shape)
            kind = _ARRAY_KINDS[value_type] if saved is not None else "numpy"
            impl = impls.get(name)
            if impl is not None:
                prng_keys.append(key_str)
            flat.append((keys, ArraySource(shape, dtype, shard, saved, kind, _reader(store), impl)))
        else:
            raise UnsupportedValueError(
                f"{item}: leaf {key_str} has Orbax value_type {value_type!r}, written by a TypeHandler this import "
                f"does not know (it reads {', '.join(list(_ARRAY_TYPES) + ['string'] + list(_EMPTY))}). Restore "
                "the checkpoint with Orbax and save it with ckpt.save"
            )
    return OrbaxItem(item, _nest(flat, item), placeholders, tuple(prng_keys))


def _nest(flat: list[tuple[tuple, object]], where: str) -> object:
    """Builds dicts (str keys) and lists (int keys 0..n-1) from (keys, leaf) pairs."""
    if len(flat) == 1 and flat[0][0] == ():
        return flat[0][1]
    root: dict = {}
    for keys, leaf in flat:
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise CorruptCheckpointError(f"{where}: the key path {keys} runs through a leaf")
        node[keys[-1]] = leaf

    def fix(node: object) -> object:
        if not isinstance(node, dict):
            return node
        if node and all(type(k) is int for k in node):
            if sorted(node) != list(range(len(node))):
                raise CorruptCheckpointError(f"{where}: sequence indices {sorted(node)} are not 0..{len(node) - 1}")
            return [fix(node[i]) for i in range(len(node))]
        return {k: fix(v) for k, v in node.items()}

    return fix(root)
