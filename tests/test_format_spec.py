"""The format specification (docs/format.md) is enough to read a checkpoint without the
library (issue 26 item 2): a checkpoint saved with the defaults (packed small leaves, a
sharded array, non-array values) is read by `read_by_the_spec`, which follows the page
step by step with TensorStore, json and numpy alone, and every value equals what was saved.

`read_by_the_spec` runs in a fresh interpreter in which `import checkpointer` fails, so it
cannot lean on the library: a field the library needs but the page does not describe makes
this test fail."""

import json
import os
import pickle
import struct
import subprocess
import sys

import numpy as np
import tensorstore as ts

# --- the reader: TensorStore, json and numpy only, following docs/format.md --------------------


def _json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _zarr3(path):
    """A zarr v3 node, opened read-only with TensorStore's zarr3 driver."""
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}, read=True).result()


def _value(v):
    """A non-array value leaf ("Non-array values")."""
    kind = v["type"]
    if kind == "none":
        return None
    if kind in ("bool", "str"):
        return v["value"]
    if kind == "int":
        return int(v["hex"], 16)
    if kind == "float":
        return struct.unpack("<d", bytes.fromhex(v["hex"]))[0]
    if kind == "complex":
        re_, im = struct.unpack("<dd", bytes.fromhex(v["hex"]))
        return complex(re_, im)
    if kind == "numpy_scalar":
        return np.frombuffer(bytes.fromhex(v["hex"]), np.dtype(v["dtype"]))[0]
    raise ValueError(f"unknown value type {kind!r}")


def _packed_leaf(path, manifest, leaf_path, entry):
    """A packed array leaf: its boxes' bytes from the packs, placed at their origins (step 3)."""
    out = np.zeros(entry["shape"], np.dtype(entry["dtype"]))
    covered = 0
    for pack in manifest["packed"]:
        data = None
        for b in pack["boxes"]:
            if b["leaf"] != leaf_path:
                continue
            if data is None:  # the pack's bytes; TensorStore checks its crc32c codec
                data = _zarr3(f"{path}/{pack['array']}").read().result().tobytes()
            (origin, shape), off, n = b["box"], b["offset"], b["data_bytes"]
            values = np.frombuffer(data[off:off + n], np.dtype(entry["dtype"]).newbyteorder("<")).reshape(shape)
            out[tuple(slice(o, o + s) for o, s in zip(origin, shape))] = values
            covered += int(np.prod(shape))
    assert covered == out.size, f"{leaf_path}: the boxes do not tile the leaf"
    return out


def _array_leaf(path, manifest, leaf_path, entry):
    if entry.get("packed"):
        return _packed_leaf(path, manifest, leaf_path, entry)
    node = _json(f"{path}/arrays/{leaf_path}/zarr.json")  # "Arrays: arrays/<leaf path>/zarr.json"
    assert node["shape"] == entry["shape"] and node["data_type"] == entry["dtype"]
    assert node["chunk_grid"]["configuration"]["chunk_shape"] == entry["chunk_shape"]
    (codec,) = node["codecs"]
    assert codec["name"] == "sharding_indexed" and codec["configuration"].get("index_location", "end") == "end"
    assert codec["configuration"]["chunk_shape"] == entry["inner_chunk_shape"]
    return _zarr3(f"{path}/arrays/{leaf_path}").read().result()


def _tree(node, leaves):
    """The tree from `structure` (step 4): dicts, lists and tuples; custom nodes as dicts."""
    if node["kind"] == "leaf":
        return leaves[node["path"]]
    children = [_tree(c, leaves) for c in node["children"]]
    if node["kind"] == "list":
        return children
    if node["kind"] == "tuple":
        return tuple(children)
    keys = [k["int"] if isinstance(k, dict) and "int" in k else k for k in node["keys"]]
    return dict(zip(keys, children))


def read_by_the_spec(path):
    """Reads the checkpoint at `path` as docs/format.md says ("Reading a checkpoint, step by step")."""
    marker = _json(f"{path}/COMMITTED")  # step 1: no marker, no checkpoint
    manifest = _json(f"{path}/manifest.json")  # step 2
    assert manifest["format_version"] == 1
    assert marker["generation"] == manifest["generation"]
    leaves = {}
    for leaf_path, entry in manifest["leaves"].items():  # step 3
        if entry["type"] == "value":
            leaves[leaf_path] = _value(entry["value"])
        else:
            assert entry["type"] == "array"
            leaves[leaf_path] = _array_leaf(path, manifest, leaf_path, entry)
    return manifest, _tree(manifest["structure"], leaves)


def shard_file_inner_chunk(file_bytes, inner_chunk_shape, dtype, index):
    """Inner chunk `index` (C order of the inner grid) of a zarr shard file, from its bytes
    ("Zarr shard files"): the index and its crc32c at the end, each entry (offset, nbytes)."""
    entry_bytes, crc_bytes = 16, 4
    itemsize = np.dtype(dtype).itemsize
    inner_bytes = int(np.prod(inner_chunk_shape)) * itemsize
    # The file is n × (inner_bytes + 4) + 16 n + 4 bytes long.
    n_inner = (len(file_bytes) - crc_bytes) // (inner_bytes + crc_bytes + entry_bytes)
    table = np.frombuffer(file_bytes[-crc_bytes - entry_bytes * n_inner:-crc_bytes], "<u8").reshape(n_inner, 2)
    offset, nbytes = (int(x) for x in table[index])
    assert nbytes == inner_bytes + crc_bytes
    return np.frombuffer(file_bytes[offset:offset + inner_bytes], np.dtype(dtype).newbyteorder("<")).reshape(inner_chunk_shape), n_inner


# --- the test ---------------------------------------------------------------------------------


def _saved_state():
    import jax
    from conftest import make_mesh
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2048, 1024)).astype(np.float32)  # chunks of 1 MiB: its own zarr array
    b = rng.standard_normal(512).astype(np.float32)  # chunks of 512 B: packed
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(b, NamedSharding(mesh, P("model"))),
            "scale": jax.device_put(np.arange(6, dtype=np.int32).reshape(2, 3), NamedSharding(mesh, P())),
        },
        "layers": [np.full((4, 4), 2.5, np.float64), {3: np.arange(5, dtype=np.uint16)}],
        "step": 12345678901234567890,
        "lr": 0.1,
        "name": "run",
        "none": None,
    }


def _assert_same(got, want, where="tree"):
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got)
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    elif want is None or isinstance(want, int | float | str):
        assert got == want and type(got) is type(want), (where, got, want)
    else:
        want = np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got.dtype, got.shape)
        np.testing.assert_array_equal(got, want, err_msg=where)


def _read_in_a_process_without_the_library(path, out):
    """`read_by_the_spec(path)` in a fresh interpreter where `import checkpointer` fails."""
    code = f"""
import pickle, sys
sys.modules["checkpointer"] = None  # any import of the library raises ImportError
sys.path.insert(0, {os.path.dirname(__file__)!r})
import test_format_spec as spec
result = spec.read_by_the_spec({path!r})
assert not [m for m, mod in sys.modules.items() if m.startswith("checkpointer") and mod is not None]
with open({str(out)!r}, "wb") as f:
    pickle.dump(result, f)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr
    with open(out, "rb") as f:
        return pickle.load(f)  # noqa: S301 (written just now by the reader above)


def test_a_default_checkpoint_reads_with_tensorstore_alone_by_following_the_spec(tmp_path):
    import checkpointer as ckpt

    path = str(tmp_path / "7")
    state = _saved_state()
    ckpt.save(path, state, metadata={"epoch": 3})

    manifest, tree = _read_in_a_process_without_the_library(path, tmp_path / "tree.pickle")
    _assert_same(tree, state)
    assert manifest["user_metadata"] == {"epoch": 3} and manifest["process_count"] == 1
    leaves = manifest["leaves"]
    assert not leaves["params/w"].get("packed") and leaves["params/b"]["packed"] is True  # the defaults pack
    assert leaves["layers/1/@int:3"]["kind"] == "numpy" and leaves["layers/1/@int:3"]["saved_sharding"] is None
    assert leaves["params/w"]["saved_sharding"] == {"kind": "named", "mesh_axis_names": ["data", "model"], "mesh_shape": [2, 4],
                                                   "spec": ["data", "model"], "shard_shape": [1024, 256], "device_count": 8}

    # processes/0.json: its chunk records, the pack's without `leaf`, sizes as on disk.
    record = _json(f"{path}/processes/0.json")
    assert record["process_index"] == 0 and record["generation"] == manifest["generation"]
    for chunk in record["chunks"]:
        assert os.path.getsize(f"{path}/{chunk['key']}") == chunk["bytes"]
    assert sum(c["bytes"] for c in record["chunks"]) == record["bytes_written"] == manifest["process_bytes_written"][0]
    pack_chunks = [c for c in record["chunks"] if "leaf" not in c]
    assert [c["key"] for c in pack_chunks] == ["packed/process-0/c/0"]
    assert pack_chunks[0]["box"] == [[0], [pack_chunks[0]["data_bytes"]]] and pack_chunks[0]["bytes"] == pack_chunks[0]["data_bytes"] + 4
    assert {c["leaf"] for c in record["chunks"] if "leaf" in c} == {"params/w"}

    # The pack index: the manifest's, the record's copy, the pack's attributes (with dtype).
    (pack,) = manifest["packed"]
    assert record["packed"] == pack and pack["array"] == "packed/process-0" and pack["key"] == "packed/process-0/c/0"
    attrs = _json(f"{path}/packed/process-0/zarr.json")["attributes"]["checkpointer"]
    assert [{k: v for k, v in b.items() if k != "dtype"} for b in attrs["packed_index"]] == pack["boxes"]
    assert {b["leaf"]: b["dtype"] for b in attrs["packed_index"]} == {b["leaf"]: leaves[b["leaf"]]["dtype"] for b in pack["boxes"]}
    assert os.path.getsize(f"{path}/{pack['key']}") == pack["bytes"]

    # A zarr shard file's bytes: inner chunk 0 of chunk (1, 2) is w[1024:1152, 512:640].
    with open(f"{path}/arrays/params/w/c/1/2", "rb") as f:
        data = f.read()
    inner, n_inner = shard_file_inner_chunk(data, leaves["params/w"]["inner_chunk_shape"], "float32", 0)
    np.testing.assert_array_equal(inner, np.asarray(state["params"]["w"])[1024:1152, 512:640])
    assert n_inner == 16 and len(data) == 16 * (128 * 128 * 4 + 4) + 16 * 16 + 4

    # The zarr group nodes: the root, and a level of `arrays/` mapping names back to keys.
    root = _json(f"{path}/zarr.json")
    assert root["node_type"] == "group" and root["attributes"]["checkpointer"]["format_version"] == 1
    level = _json(f"{path}/arrays/params/zarr.json")["attributes"]["checkpointer"]
    assert level["key_path"] == "['params']" and level["children"] == {"w": "w"}  # packed leaves have no node
