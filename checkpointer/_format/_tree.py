"""Leaf paths and tree structure: from pytrees to safe names and back, without pickle.

A *leaf path* names one leaf of a pytree. It comes from `jax.tree_util` key paths: each
key becomes one `/`-separated component, escaped so that the joined path is a safe
relative name on every storage backend:

- a `str` dict key is percent-encoded (`urllib.parse.quote(key, safe="")`, which also
  encodes `/`, `@`, `%` and NUL); a key made only of dots (`.`, `..`) has its dots encoded;
- an `int` dict key becomes `@int:<n>`; other dict key types `@<type>:<quoted repr>`
  (`@` never appears unencoded in a `str` key, so the two cannot collide);
- a sequence index, a flattened index or an attribute name is written as is.

A leaf path never starts with `/`, never contains an empty, `.` or `..` component and
never contains NUL; `check_leaf_path` enforces that on read and write.

The tree structure is stored as a JSON *node*: containers (`dict`, `list`, `tuple`,
`namedtuple`, `custom`, `none`) with typed keys, and `{"kind": "leaf", "path": ...}`.
A `custom` node also records `key_kinds`, one per key (`"dict"`, `"attr"`, `"index"`,
`"flat"`: the `jax.tree_util` key entry type), since a custom node's `str` key may be a
`DictKey` (`nnx.State`, `FrozenDict`) or a `GetAttrKey` (a flax `TrainState`).

The user-facing name of a leaf is its *key string*, as `jax.tree_util.keystr` prints
the key path (`['params']['dense'].kernel[0]`); `keystrs` rebuilds it from the stored
structure alone. Manifests written before `key_kinds` existed print a custom node's
`str` key as `.name` when it is an identifier, else `['name']`.
With no target, a restore rebuilds dicts, lists, tuples and namedtuples as such and any
other registered node (a flax dataclass, a `TrainState`) as a dict of its attributes;
nothing is imported by name from a checkpoint.
"""

from __future__ import annotations

import collections
import keyword
import re
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from .._errors import CorruptCheckpointError, StructureMismatchError

if TYPE_CHECKING:
    # jax declares its key entry classes as `Any`, so to a type checker an entry is Any.
    KeyEntry = Any
else:
    KeyEntry = DictKey | SequenceKey | GetAttrKey | FlattenedIndexKey
JsonNode = dict
# A pytree (nested containers of leaves); JAX types pytrees as Any too.
PyTree = Any


def _is_none(x: object) -> bool:
    return x is None


# What `urllib.parse.quote(key, safe="")` leaves as it is: such a key (not only dots) is its own escape.
_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]+")


def _escape_str(key: str) -> str:
    if key.isascii() and key.isalnum():  # the common case, without the regex: letters and digits only
        return key
    if _UNRESERVED.fullmatch(key) and key.strip("."):
        return key
    if key and set(key) == {"."}:
        return "%2E" * len(key)
    if key == "":
        return "%"  # never produced by quote(); decodes back to ""
    return urllib.parse.quote(key, safe="")


def escape_key(entry: KeyEntry) -> str:
    """Returns the leaf-path component for one `jax.tree_util` key entry."""
    if isinstance(entry, DictKey):
        key = entry.key
        if isinstance(key, str):
            return _escape_str(key)
        if isinstance(key, bool) or not isinstance(key, int):
            return f"@{type(key).__name__}:{urllib.parse.quote(repr(key), safe='')}"
        return f"@int:{key}"
    if isinstance(entry, SequenceKey):
        return str(entry.idx)
    if isinstance(entry, GetAttrKey):
        return _escape_str(entry.name)
    if isinstance(entry, FlattenedIndexKey):
        return str(entry.key)
    raise StructureMismatchError(f"unsupported pytree key entry {entry!r} of type {type(entry).__name__}")


def leaf_path(key_path: Sequence[KeyEntry]) -> str:
    """Returns the escaped leaf path of a `jax.tree_util` key path; `""` names a root leaf."""
    return "/".join([escape_key(k) for k in key_path])


def check_leaf_path(path: object, *, where: str = "") -> str:
    """Raises `CorruptCheckpointError` if `path` could leave the checkpoint folder.

    Args:
      path: a leaf path as stored in a manifest (any JSON value; only a str can pass).
      where: the checkpoint path, for the message.
    Returns:
      `path`, unchanged.
    """
    # A component "", "." or "..": "//", "/./" or "/../" in "/" + path + "/" (a leading "/" too).
    if (
        not isinstance(path, str)
        or "\x00" in path
        or "\\" in path
        or (path != "" and ("//" in (p := f"/{path}/") or "/./" in p or "/../" in p))
    ):
        raise CorruptCheckpointError(
            f"unsafe leaf path {path!r} {where}: leaf paths must be relative, without '..', "
            "'.', empty components, backslashes or NUL. The manifest is damaged or hostile; "
            "do not restore it."
        )
    return path


def flatten(tree: object, is_leaf: Callable[[object], bool] = _is_none) -> list[tuple[str, object]]:
    """Flattens `tree` into `(leaf path, leaf)` pairs; `None` counts as a leaf.

    Raises:
      StructureMismatchError: two leaves escape to the same leaf path, or a dict mixes
        key types that JAX cannot order.
    """
    try:
        pairs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    except (TypeError, ValueError) as e:
        raise StructureMismatchError(
            f"cannot flatten the tree: {e}. Dict keys of one dict must be mutually comparable "
            "(JAX sorts them); use keys of one type."
        ) from e
    out = [(leaf_path(kp), leaf) for kp, leaf in pairs]
    if len({p for p, _ in out}) != len(out):
        seen: set[str] = set()
        for p, _ in out:
            if p in seen:
                raise StructureMismatchError(f"two leaves share the leaf path {p!r}; rename one of the keys")
            seen.add(p)
    return out


# --- structure as JSON -------------------------------------------------------------------


def _key_json(entry: KeyEntry) -> object:
    if isinstance(entry, DictKey):
        k = entry.key
        if isinstance(k, str):
            return k
        if isinstance(k, int) and not isinstance(k, bool):
            return {"int": k}
        return {"repr": repr(k)}
    if isinstance(entry, SequenceKey):
        return entry.idx
    if isinstance(entry, GetAttrKey):
        return entry.name
    return entry.key


def _key_kind(entry: KeyEntry) -> str:
    if isinstance(entry, DictKey):
        return "dict"
    if isinstance(entry, GetAttrKey):
        return "attr"
    if isinstance(entry, SequenceKey):
        return "index"
    return "flat"


def describe(tree: object, is_array_leaf: Callable[[object], bool]) -> JsonNode:
    """Returns the JSON node describing `tree`'s structure (see module docstring)."""

    def go(node: object, path: str) -> JsonNode:  # path: the node's leaf path (escaped, "/"-joined)
        if node is None:
            return {"kind": "leaf", "path": path}
        if is_array_leaf(node):
            return {"kind": "leaf", "path": path}
        children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        if len(children) == 1 and children[0][0] == () and children[0][1] is node:
            return {"kind": "leaf", "path": path}
        keys = [kp[0] for kp, _ in children]
        prefix = f"{path}/" if path else ""  # only the root's path is empty (no key escapes to "")
        out: JsonNode = {
            "keys": [_key_json(k) for k in keys],
            "children": [go(child, prefix + escape_key(k)) for k, (_, child) in zip(keys, children)],
        }
        if isinstance(node, dict):
            out["kind"] = "dict"
        elif isinstance(node, tuple) and hasattr(node, "_fields"):
            out["kind"] = "namedtuple"
            out["type"] = type(node).__name__
        elif isinstance(node, tuple):
            out["kind"] = "tuple"
        elif isinstance(node, list):
            out["kind"] = "list"
        else:
            out["kind"] = "custom"
            out["type"] = f"{type(node).__module__}.{type(node).__qualname__}"
            out["key_kinds"] = [_key_kind(k) for k in keys]
        return out

    return go(tree, "")


def _key_from_json(k: object, where: str) -> object:
    if isinstance(k, (str, int)) and not isinstance(k, bool):
        return k
    if isinstance(k, dict) and set(k) == {"int"} and isinstance(k["int"], int):
        return k["int"]
    if isinstance(k, dict) and set(k) == {"repr"} and isinstance(k["repr"], str):
        return k["repr"]
    raise CorruptCheckpointError(f"malformed tree key {k!r} in the manifest of {where}")


def _namedtuple_type(name: str, fields: Sequence[str]) -> type:
    safe = name if name.isidentifier() and not keyword.iskeyword(name) else "Record"
    return collections.namedtuple(safe, list(fields), rename=True)


MAX_DEPTH = 1000


def rebuild(node: JsonNode, leaf: Callable[[str], object], *, where: str = "") -> object:
    """Rebuilds a tree from its JSON node, calling `leaf(path)` for each leaf.

    Raises:
      CorruptCheckpointError: the node is malformed (unknown kind, wrong field types,
        nesting deeper than `MAX_DEPTH` or than the interpreter's recursion limit).
    """
    try:
        return _rebuild(node, leaf, where, 0)
    except RecursionError as e:
        raise CorruptCheckpointError(f"the tree structure in the manifest of {where} is nested too deeply") from e


def _rebuild(node: JsonNode, leaf: Callable[[str], object], where: str, depth: int) -> object:
    if depth > MAX_DEPTH or not isinstance(node, dict):
        raise CorruptCheckpointError(f"malformed tree structure in the manifest of {where}")
    kind = node.get("kind")
    if kind == "leaf":
        return leaf(check_leaf_path(node.get("path"), where=where))
    keys, children = node.get("keys"), node.get("children")
    if not isinstance(keys, list) or not isinstance(children, list) or len(keys) != len(children):
        raise CorruptCheckpointError(f"malformed {kind!r} node in the manifest of {where}")
    keys = [_key_from_json(k, where) for k in keys]
    values = [_rebuild(c, leaf, where, depth + 1) for c in children]
    if kind == "dict" or kind == "custom":
        return dict(zip(keys, values))
    if kind == "list":
        return values
    if kind == "tuple":
        return tuple(values)
    if kind == "namedtuple":
        name = node.get("type", "Record")
        return _namedtuple_type(name if isinstance(name, str) else "Record", [str(k) for k in keys])(*values)
    raise CorruptCheckpointError(f"unknown tree node kind {kind!r} in the manifest of {where}")


def leaf_paths_of(node: JsonNode) -> list[str]:
    """The leaf paths of a JSON node, in order (iterative: no recursion limit).

    Raises:
      CorruptCheckpointError: a node is not an object or nests deeper than `MAX_DEPTH`.
    """
    out: list[str] = []
    stack = [(node, 0)]
    while stack:
        n, depth = stack.pop()
        if not isinstance(n, dict) or depth > MAX_DEPTH:
            raise CorruptCheckpointError("malformed or too deeply nested tree structure")
        if n.get("kind") == "leaf":
            path = n.get("path")
            if not isinstance(path, str):
                raise CorruptCheckpointError(f"malformed tree structure: leaf path {path!r:.100} is not a string")
            out.append(path)
            continue
        children = n.get("children", [])
        if not isinstance(children, list):
            raise CorruptCheckpointError("malformed tree structure: 'children' is not a list")
        stack.extend((c, depth + 1) for c in reversed(children))
    return out


# --- key strings -----------------------------------------------------------------------------

_KIND_OF_NODE = {"dict": "dict", "list": "index", "tuple": "index", "namedtuple": "attr"}


def key_entry_str(node_kind: object, key: object, key_kind: object = None) -> str:
    """One key of a stored node as `jax.tree_util.keystr` prints its key entry.

    Args:
      node_kind: the parent node's `kind` (`dict`, `list`, `tuple`, `namedtuple`, `custom`).
      key: the key in its JSON form (a str, an int, `{"int": n}`, `{"repr": text}`).
      key_kind: the parent's `key_kinds` entry for this key, if recorded (custom nodes).
    Returns:
      `['k']` (DictKey of a str), `[3]` (DictKey of an int, SequenceKey), `[<repr>]`
      (other DictKeys), `.name` (GetAttrKey), `[<flat index 3>]` (FlattenedIndexKey).
    """
    if isinstance(key, dict):
        if "int" in key:
            return f"[{key['int']}]"
        if "repr" in key:
            return f"[{key['repr']}]"
    kind = key_kind if key_kind in ("dict", "attr", "index", "flat") else _KIND_OF_NODE.get(str(node_kind))
    if kind is None:  # a custom node stored before key_kinds: guess from the key
        kind = "attr" if isinstance(key, str) and key.isidentifier() else "dict"
    if kind == "attr":
        return f".{key}"
    if kind == "flat":
        return f"[<flat index {key}>]"
    if kind == "dict" and isinstance(key, str):
        return f"[{key!r}]"
    return f"[{key}]"


def keystrs(structure: JsonNode) -> dict[str, str]:
    """Leaf path -> key string (as `jax.tree_util.keystr` prints the leaf's key path),
    rebuilt from a stored structure alone (iterative: no recursion limit).

    Args:
      structure: the manifest's `structure` (see `describe`).
    Returns:
      One entry per leaf, in tree order; a root leaf's key string is `""`.
    Raises:
      CorruptCheckpointError: a node is not an object, has malformed keys, or nests
        deeper than `MAX_DEPTH`.
    """
    out: dict[str, str] = {}
    stack: list[tuple[object, str, int]] = [(structure, "", 0)]
    while stack:
        n, prefix, depth = stack.pop()
        if not isinstance(n, dict) or depth > MAX_DEPTH:
            raise CorruptCheckpointError("malformed or too deeply nested tree structure")
        if n.get("kind") == "leaf":
            path = n.get("path")
            if not isinstance(path, str):
                raise CorruptCheckpointError(f"malformed tree structure: leaf path {path!r:.100} is not a string")
            out[path] = prefix
            continue
        keys, children = n.get("keys", []), n.get("children", [])
        kinds = n.get("key_kinds")
        if not isinstance(keys, list) or not isinstance(children, list) or len(keys) != len(children):
            raise CorruptCheckpointError("malformed tree structure: 'keys' and 'children' do not pair up")
        if not isinstance(kinds, list) or len(kinds) != len(keys):
            kinds = [None] * len(keys)
        for k, kk, c in reversed(list(zip(keys, kinds, children))):
            stack.append((c, prefix + key_entry_str(n.get("kind"), k, kk), depth + 1))
    return out


def keystr(structure: JsonNode, path: str) -> str:
    """The key string of one leaf path (see `keystrs`).

    Raises:
      KeyError: `path` is not a leaf of `structure`.
    """
    return keystrs(structure)[path]
