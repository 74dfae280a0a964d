"""Browsable format: zarr v3 group nodes walked with zarr-python."""

import collections

import jax
import numpy as np
import zarr

import checkpointer as ckpt
from checkpointer._format._tree import describe
from checkpointer._format._zarr_groups import group_nodes

Pair = collections.namedtuple("Pair", ["left", "right"])


def _tree():
    rng = np.random.default_rng(0)
    return {
        "params": {"dense": {"kernel": rng.standard_normal((4, 3)).astype(np.float32), "bias": np.arange(3, dtype=np.int32)},
                   "mlp/~/linear_0": {"w": rng.standard_normal(5)}},
        "layers": [np.ones(2, np.uint8), {"a": np.zeros((2, 2), np.float16)}],
        "pair": Pair(np.arange(2.0), np.arange(3, dtype=np.int64)),
        "step": 3, "note": "x", "empty": {},
    }


def test_zarr_open_group_walks_the_tree_with_original_keys(tmp_path):
    path = str(tmp_path / "1")
    tree = _tree()
    ckpt.save(path, tree, pack_small_leaves_bytes=0)
    root = zarr.open_group(path, mode="r")
    assert root.attrs["checkpointer"]["tree"] == "arrays"
    arrays = zarr.open_group(f"{path}/arrays", mode="r")
    members = dict(arrays.members(max_depth=None))  # warnings are errors here: none may be raised
    flat = {jax.tree_util.keystr(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if isinstance(leaf, np.ndarray)}
    # Walk from the root group to every array by the attributes alone, mapping names to keys.
    found = {}

    def walk(group, prefix):
        attrs = group.attrs["checkpointer"]
        assert attrs["key_path"] == prefix
        for name, key in attrs["children"].items():
            child = group[name]
            if isinstance(child, zarr.Array):
                kind = attrs["node"]
                step = f"[{key!r}]" if kind == "dict" else (f".{key}" if kind == "namedtuple" else f"[{key}]")
                found[prefix + step] = child[...]
            else:
                walk(child, child.attrs["checkpointer"]["key_path"])

    walk(arrays, "")
    assert found.keys() == flat.keys()
    for k in flat:
        np.testing.assert_array_equal(found[k], flat[k])
        assert found[k].dtype == flat[k].dtype
    assert members["params/mlp%2F~%2Flinear_0"].attrs["checkpointer"]["key"] == "mlp/~/linear_0"
    assert members["params/mlp%2F~%2Flinear_0"].attrs["checkpointer"]["key_path"] == "['params']['mlp/~/linear_0']"
    assert members["layers"].attrs["checkpointer"]["children"] == {"0": 0, "1": 1}
    assert members["pair"].attrs["checkpointer"]["node"] == "namedtuple"


def test_group_nodes_do_not_stop_overwrite_or_restore(tmp_path):
    path = str(tmp_path / "1")
    ckpt.save(path, _tree(), pack_small_leaves_bytes=0)
    ckpt.save(path, {"w": np.ones(3)}, overwrite=True, pack_small_leaves_bytes=0)  # the root zarr.json is the format's own file
    np.testing.assert_array_equal(ckpt.restore(path)["w"], np.ones(3))
    assert zarr.open_group(f"{path}/arrays", mode="r").attrs["checkpointer"]["children"] == {"w": "w"}


def test_a_key_named_zarr_json_gets_no_group_node_at_its_level(tmp_path):
    path = str(tmp_path / "1")
    tree = {"zarr.json": np.arange(3), "b": {"c": np.ones(2)}}
    ckpt.save(path, tree, pack_small_leaves_bytes=0)
    out = ckpt.restore(path)
    np.testing.assert_array_equal(out["zarr.json"], np.arange(3))
    assert zarr.open_group(f"{path}/arrays/b", mode="r").attrs["checkpointer"]["key"] == "b"


def test_group_nodes_of_a_single_array_and_of_values_only():
    leaf = np.ones(2)
    assert set(group_nodes(describe(leaf, lambda x: isinstance(x, np.ndarray)), [""])) == {"zarr.json", "arrays/zarr.json"}
    assert set(group_nodes(describe({"a": 1}, lambda x: isinstance(x, np.ndarray)), [])) == {"zarr.json"}


def test_single_array_checkpoint_is_browsable(tmp_path):
    path = str(tmp_path / "1")
    ckpt.save(path, np.arange(4.0), pack_small_leaves_bytes=0)
    arrays = zarr.open_group(f"{path}/arrays", mode="r")
    np.testing.assert_array_equal(arrays["%root"][...], np.arange(4.0))
