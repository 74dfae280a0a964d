"""Zarr v3 group nodes that make a checkpoint browsable with zarr-python.

```
<path>/zarr.json                  group: the checkpoint (attributes: format, where the tree is)
<path>/arrays/zarr.json           group: the tree's root node
<path>/arrays/<a>/zarr.json       group: each intermediate tree level that holds arrays
<path>/arrays/<a>/<b>/zarr.json   array (written by TensorStore, as before)
```
Each tree group's attributes hold, under `"checkpointer"`, the user's original keys:
`key` (this node's key in its parent, JSON: a str, an int, `{"int": n}` for an int
dict key, `{"repr": ...}` for other key types; null for the root), `key_path` (as
`jax.tree_util.keystr` prints it, e.g. `['params']['dense']`), `node` (dict, list,
tuple, namedtuple, custom) and `children`: escaped member name -> original key, for the
members that are zarr nodes (sub-groups and arrays; non-array leaves live in the
manifest). So `zarr.open_group(f"{path}/arrays")` walks the tree by its escaped names,
and the attributes map each name back to the user's key.

Group nodes are additive: readers of the format never need them, and checkpoints
written before them restore as ever. A level one of whose members escapes to the name
`zarr.json` (a user key "zarr.json") gets no group node, since its file would collide.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from . import _json, _layout
from ._tree import key_entry_str

if TYPE_CHECKING:
    from .._storage import Storage

ZARR_JSON = "zarr.json"


def _group(attributes: dict) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": {"checkpointer": attributes}}


def group_nodes(structure: dict, array_paths: Iterable[str]) -> dict[str, dict]:
    """The group nodes of one checkpoint, by file path relative to the checkpoint path.

    Args:
      structure: the manifest's `structure` (see `_tree.describe`).
      array_paths: the leaf paths of the array leaves (only levels holding arrays get a
        group node: other levels have no folder).
    Returns:
      `{"zarr.json": root group, "arrays/zarr.json": tree root, "arrays/<a>/zarr.json": ...}`.
    """
    arrays = set(array_paths)
    out: dict[str, dict] = {ZARR_JSON: _group({"format_version": _layout.FORMAT_VERSION, "tree": _layout.ARRAYS,
                                               "manifest": _layout.MANIFEST})}

    def visit(node: dict, depth: int, key: object, key_path: str) -> list[str]:
        """Emits the group nodes under `node`; returns the array leaf paths below it."""
        if node.get("kind") == "leaf":
            return [node["path"]] if node.get("path") in arrays else []
        below, children = [], {}
        keys = node.get("keys", [])
        kinds = node.get("key_kinds") or [None] * len(keys)
        for k, kk, child in zip(keys, kinds, node.get("children", [])):
            child_below = visit(child, depth + 1, k, key_path + key_entry_str(node.get("kind"), k, kk))
            if child_below:
                children[child_below[0].split("/")[depth]] = k
                below += child_below
        if below and ZARR_JSON not in children:
            prefix = "/".join(below[0].split("/")[:depth])
            attrs = {"key": key, "key_path": key_path, "node": node.get("kind"), "children": children}
            if "type" in node:
                attrs["type"] = node["type"]
            out[f"{_layout.ARRAYS}/{prefix}/{ZARR_JSON}" if prefix else f"{_layout.ARRAYS}/{ZARR_JSON}"] = _group(attrs)
        return below

    if structure.get("kind") == "leaf":  # a tree that is one array lives in arrays/%root
        if structure.get("path") in arrays:
            out[f"{_layout.ARRAYS}/{ZARR_JSON}"] = _group({"key": None, "key_path": "", "node": "leaf",
                                                          "children": {"%root": None}})
    else:
        visit(structure, 0, None, "")
    return out


def write_group_nodes(storage: Storage, root: str, structure: dict, array_paths: Iterable[str]) -> None:
    """Writes every group node of `group_nodes` under `root`, concurrently.

    Raises:
      Whatever the kvstore raises (the caller turns it into a `SaveError`).
    """
    import tensorstore as ts

    from .._storage import ts_context

    kv = ts.KvStore.open(storage.kvstore_spec(root), context=ts_context()).result()
    futures = [kv.write(rel, _json.dumps(node)) for rel, node in group_nodes(structure, array_paths).items()]
    for f in futures:
        f.result()
