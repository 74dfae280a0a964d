"""Hostile checkpoints: nothing is unpickled, evaluated or imported, nothing outside the
checkpoint path is read, and a damaged or malicious manifest / zarr.json is refused with a
`CheckpointError` (before anything large is allocated), never another exception."""

import ast
import builtins
import collections
import copy
import importlib
import json
import os
import pathlib
import pickle
import shutil
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._format import _json as _format_json

# About the per-leaf layout (each leaf its own zarr array and chunk files): small leaves
# are not packed here (tests/test_pack.py covers the packed layout).
pytestmark = pytest.mark.usefixtures("unpacked_layout")

LIB = pathlib.Path(ckpt.__file__).parent
State = collections.namedtuple("State", ["count", "mu"])


def _tree():
    mesh = make_mesh((2,), ("d",))
    return {
        "w": jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(mesh, P("d"))),
        "q": jax.device_put(np.arange(-8, 8, dtype=np.int8).astype(jnp.int4), NamedSharding(mesh, P("d"))),
        "h": np.arange(3, dtype=np.int64),
        "key": jax.random.key(1),
        "opt": State(np.int32(3), np.ones(2, np.float32)),
        "v": {"n": None, "i": 2**70, "f": -0.0, "s": "x", "b": True},
        "l": [1, (2, 3)],
    }


def _target():
    mesh = make_mesh((2,), ("d",))
    t = jax.tree_util.tree_map(lambda _: None, _tree(), is_leaf=lambda x: x is None)
    t["w"] = NamedSharding(mesh, P("d"))
    t["q"] = NamedSharding(make_mesh((4,), ("d",)), P("d"))
    return t


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A committed checkpoint of `_tree()` and its manifest; tests damage copies of it."""
    root = tmp_path_factory.mktemp("hostile")
    path = str(root / "orig" / "1")
    ckpt.save(path, _tree(), pack_small_leaves_bytes=0)  # module scope: `unpacked_layout` comes too late
    with open(f"{path}/manifest.json") as f:
        manifest = json.load(f)
    return path, manifest


@pytest.fixture
def victim(original, tmp_path):
    """A fresh copy of the original checkpoint at <tmp>/run/1."""
    src, manifest = original
    dst = tmp_path / "run" / "1"
    shutil.copytree(src, dst)
    return str(dst), copy.deepcopy(manifest)


def _write_manifest(path, manifest):
    with open(f"{path}/manifest.json", "w") as f:
        json.dump(manifest, f)


def _all_raise_corrupt(path, match=None):
    for call in (ckpt.metadata, ckpt.restore, ckpt.verify, lambda p: ckpt.restore(p, _target())):
        with pytest.raises(ckpt.CorruptCheckpointError, match=match):
            call(path)


# --- nothing pickled, evaluated or imported -------------------------------------------------


def test_library_source_has_no_pickle_eval_exec_or_dynamic_import():
    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "importlib", "runpy", "joblib"}
    banned_calls = {"eval", "exec", "compile", "__import__", "loads_pickle"}
    allowed = {"importlib.metadata"}  # reads the installed version; imports nothing
    # checkpointer/testing.py is the process harness of tests and examples: it imports
    # the worker function its caller names, and never reads a checkpoint.
    files = [f for f in LIB.rglob("*.py") if f.name != "testing.py"]
    assert len(files) > 40, files  # every module of every package
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names if a.name not in allowed}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]} if node.module not in allowed else set()
            else:
                names = set()
            assert not names & banned_modules, f"{f.name}:{node.lineno} imports {names & banned_modules}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in banned_calls, f"{f.name}:{node.lineno} calls {node.func.id}"


def test_restore_and_metadata_never_unpickle_or_import(victim, monkeypatch):
    path, manifest = victim
    # A hostile manifest naming importable things as node types and namedtuple names.
    manifest["structure"]["type"] = "os.system"
    manifest["structure"]["kind"] = "custom"
    opt = manifest["structure"]["children"][manifest["structure"]["keys"].index("opt")]
    opt["type"] = "__import__('os').system('touch /tmp/pwned')"
    _write_manifest(path, manifest)

    def forbidden(*a, **k):
        raise AssertionError("called a forbidden function")

    # The library's own modules load on first use of a name (lazy `checkpointer.__init__`):
    # load them now, so only what reading the hostile checkpoint does is under test.
    assert callable(ckpt.metadata) and callable(ckpt.restore)
    for mod, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (importlib, "import_module"),
                      (builtins, "exec")]:
        monkeypatch.setattr(mod, name, forbidden)
    meta = ckpt.metadata(path)
    out = ckpt.restore(path)
    assert isinstance(out, dict) and set(out) == set(_tree())  # the custom node comes back as a dict
    assert out["opt"]._fields == ("count", "mu") and type(out["opt"]).__name__ == "Record"
    assert meta.tree["opt"].count.value == np.int32(3)
    assert not os.path.exists("/tmp/pwned")


# --- leaf paths never leave the checkpoint --------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["../../outside", "../outside", "/abs/outside", "w/../../../outside", "a\x00b", "a\\..\\b", ".", "a//b", "w/."]
)
def test_escaping_leaf_path_in_manifest_is_refused_and_nothing_outside_is_read(victim, monkeypatch, bad):
    path, manifest = victim
    run_dir = os.path.dirname(path)
    # Plant a valid zarr array where "arrays/../../outside" would resolve: if the path
    # were followed, restore would happily return its content.
    shutil.copytree(f"{path}/arrays/w", f"{run_dir}/outside")
    entry = manifest["leaves"].pop("w")
    manifest["leaves"][bad] = entry
    w_node = manifest["structure"]["children"][manifest["structure"]["keys"].index("w")]
    w_node["path"] = bad
    _write_manifest(path, manifest)

    opened = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(file, *a, **k):
        opened.append(os.fspath(file))
        return real_open(file, *a, **k)

    def spy_os_open(file, *a, **k):
        opened.append(os.fspath(file))
        return real_os_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    _all_raise_corrupt(path, match="unsafe leaf path")
    monkeypatch.undo()
    outside = [p for p in opened if isinstance(p, str) and not os.path.abspath(p).startswith(path + "/")]
    assert outside == []


def test_escaping_path_only_in_the_structure_is_refused(victim):
    path, manifest = victim
    w_node = manifest["structure"]["children"][manifest["structure"]["keys"].index("w")]
    w_node["path"] = "../../outside"
    _write_manifest(path, manifest)
    _all_raise_corrupt(path)


def test_keys_that_look_like_paths_are_written_inside_the_checkpoint(tmp_path):
    tree = {"../../outside": np.ones(2, np.float32), "/abs": np.ones(2, np.float32), "a\x00b": np.ones(2, np.float32),
            "..": np.zeros(1, np.int8), "~": np.zeros(1, np.int8), "a\\b": np.zeros(1, np.int8)}
    ckpt.save(str(tmp_path / "c" / "1"), tree)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert sorted(os.listdir(tmp_path / "c")) == ["1"]
    names = sorted(os.listdir(tmp_path / "c" / "1" / "arrays"))
    assert names == sorted(["..%2F..%2Foutside", "%2Fabs", "a%00b", "%2E%2E", "~", "a%5Cb", "zarr.json"])  # + group node
    back = ckpt.restore(str(tmp_path / "c" / "1"))
    assert set(back) == set(tree)


def test_symlinked_chunk_to_a_file_outside_never_returns_its_content(victim, tmp_path):
    path, _ = victim
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET" * 100)
    chunk = f"{path}/arrays/w/c/0/0"
    os.remove(chunk)
    os.symlink(secret, chunk)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"w/c/0/0 is a link to .*secret, outside the checkpoint"):
        ckpt.restore(path)
    report = ckpt.verify(path)
    assert not report.ok and any("c/0/0" in p for p in report.problems)


def test_an_oversized_process_record_is_a_finding_of_verify_and_per_process_state(victim, monkeypatch):
    path, _ = victim
    limit = os.path.getsize(f"{path}/manifest.json") + 10
    with open(f"{path}/processes/0.json", "a") as f:
        f.write(" " * (limit + 100))  # still valid JSON, but past the bound
    monkeypatch.setattr(_format_json, "MAX_MANIFEST_BYTES", limit)
    report = ckpt.verify(path)
    assert not report.ok and any("0.json is malformed" in p and f"larger than {limit} bytes" in p for p in report.problems)
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"processes/0.json is larger than {limit} bytes"):
        ckpt.per_process_state(path, process_index=0)


# --- absurd values, unknown versions, wrong types -------------------------------------------


def _set(manifest, leaf, **fields):
    manifest["leaves"][leaf].update(fields)
    return manifest


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(shape=[2**61, 4], chunk_shape=[2**61, 4], inner_chunk_shape=[2**61, 4]), "more than"),
        (dict(shape=[2**62, 4]), "malformed shape"),
        (dict(shape=[-8, 4]), "malformed shape"),
        (dict(shape=[8, 4.0]), "malformed shape"),
        (dict(shape=[True, 4]), "malformed shape"),
        (dict(shape="8,4"), "malformed shape"),
        (dict(shape=[1] * 33, chunk_shape=[1] * 33, inner_chunk_shape=[1] * 33), "malformed shape"),
        (dict(chunk_shape=[16, 4]), "do not fit"),  # chunk larger than the array
        (dict(chunk_shape=[0, 4]), "do not fit"),
        (dict(inner_chunk_shape=[3, 4]), "do not fit"),  # does not divide the chunk
        (dict(shape=[2**40, 4], chunk_shape=[4, 4], inner_chunk_shape=[4, 4]), "chunks"),  # 2**38 chunks
        (dict(shape=[2**24, 2**20], chunk_shape=[2**24, 2**20], inner_chunk_shape=[1, 1]), "inner chunks"),
        (dict(dtype="object"), "dtype"),
        (dict(dtype="float32; rm -rf /"), "malformed dtype"),
        (dict(dtype="<f4"), "malformed dtype"),
        (dict(dtype="V8"), "dtype"),
        (dict(dtype=7), "malformed dtype"),
        (dict(key_impl=3), "key_impl"),
        (dict(kind="pickle"), "unknown array kind"),
        (dict(saved_sharding={"kind": "named"}), "saved_sharding"),
        (dict(type="pickle"), "unknown type"),
    ],
)
def test_absurd_or_mistyped_array_entries_are_refused(victim, fields, match):
    path, manifest = victim
    _write_manifest(path, _set(manifest, "w", **fields))
    _all_raise_corrupt(path, match=match)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("format_version", 3, "format_version 3.*Upgrade"),  # 2 has references (issue 30)
        ("format_version", "1", "format_version"),
        ("format_version", True, "format_version"),
        ("format_version", 1.0, "format_version"),
        ("format_version", None, "format_version"),
        ("step", "100", "step"),
        ("step", 1.5, "step"),
        ("leaves", [], "leaves"),
        ("structure", "dict", "structure"),
        ("user_metadata", [1], "user_metadata"),
        ("process_count", 0, "process_count"),
        ("process_count", True, "process_count"),
        ("process_bytes_written", [-1], "process_bytes_written"),
        ("process_bytes_written", "many", "process_bytes_written"),
        ("created_unix_s", "yesterday", "created_unix_s"),
    ],
)
def test_wrong_top_level_fields_are_refused(victim, field, value, match):
    path, manifest = victim
    manifest[field] = value
    _write_manifest(path, manifest)
    _all_raise_corrupt(path, match=match)


@pytest.mark.parametrize(
    "leaf, value",
    [
        ("v/i", {"type": "int", "hex": 12}),
        ("v/i", {"type": "int", "hex": "zz"}),
        ("v/f", {"type": "float", "hex": "00"}),
        ("v/s", {"type": "str", "value": 5}),
        ("v/b", {"type": "bool", "value": "yes"}),
        ("v/n", {"type": "pickle", "value": "gASVAAAA"}),
        ("v/n", "None"),
        ("opt/count", {"type": "numpy_scalar", "dtype": "object", "hex": "00"}),
        ("opt/count", {"type": "numpy_scalar", "dtype": "int32", "hex": "00"}),
    ],
)
def test_malformed_value_leaves_are_refused(victim, leaf, value):
    path, manifest = victim
    manifest["leaves"][leaf]["value"] = value
    _write_manifest(path, manifest)
    _all_raise_corrupt(path)


@pytest.mark.parametrize("impl, shape", [("no_such_impl", [2]), ("rbg", [2]), ("threefry2x32", [3])])
def test_inconsistent_prng_key_entries_are_refused(victim, impl, shape):
    path, manifest = victim
    _write_manifest(path, _set(manifest, "key", key_impl=impl, shape=shape, chunk_shape=shape, inner_chunk_shape=shape))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['key'\]"):
        ckpt.restore(path)


def test_absurd_but_self_consistent_shape_is_refused_before_allocating(victim):
    # 2**18 chunks of 2**20 float32 each: 1 TiB declared, under every per-field bound,
    # but the chunk files do not exist: refused after a stat, without allocating.
    path, manifest = victim
    n = 2**38
    _write_manifest(path, _set(manifest, "w", shape=[n, 4], chunk_shape=[2**20, 4], inner_chunk_shape=[2**16, 4]))
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['w'\].*c/0/0.*expected"):
            ckpt.restore(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20 and time.perf_counter() - t0 < 10


def test_oversized_manifest_is_refused_without_reading_it_all(victim, monkeypatch):
    path, manifest = victim
    monkeypatch.setattr(_format_json, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(ckpt.CorruptCheckpointError, match="larger than 1000 bytes"):
        ckpt.metadata(path)


def test_manifest_that_is_a_directory_or_missing_is_corrupt(victim):
    path, _ = victim
    os.remove(f"{path}/manifest.json")
    _all_raise_corrupt(path, match="manifest.json")
    os.mkdir(f"{path}/manifest.json")
    _all_raise_corrupt(path, match="manifest.json")


def test_deeply_nested_structure_is_refused(victim):
    path, manifest = victim
    for depth in (1200, 100_000):  # deeper than MAX_DEPTH; deeper than the JSON parser's recursion limit
        manifest["structure"] = "@"
        manifest["leaves"] = {"v/n": manifest["leaves"]["v/n"]}
        text = json.dumps(manifest).replace(
            '"@"', '{"kind": "list", "keys": [0], "children": [' * depth + '{"kind": "leaf", "path": "v/n"}' + "]}" * depth
        )
        with open(f"{path}/manifest.json", "w") as f:
            f.write(text)
        _all_raise_corrupt(path)


# --- zarr.json: disagreeing metadata is never decoded ------------------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        lambda z: z.update(data_type="int8"),  # same item size: would reinterpret
        lambda z: z["codecs"][0]["configuration"].update(chunk_shape=[1]),  # other inner layout
        lambda z: z.update(shape=[8]),
        lambda z: z.update(chunk_grid={"name": "regular", "configuration": {"chunk_shape": [16]}}),
        lambda z: z.clear(),
    ],
)
def test_zarr_json_disagreeing_with_the_manifest_is_refused(victim, edit):
    # The int4 leaf goes through TensorStore's array read, which uses zarr.json.
    path, _ = victim
    zpath = f"{path}/arrays/q/zarr.json"
    with open(zpath) as f:
        z = json.load(f)
    edit(z)
    with open(zpath, "w") as f:
        json.dump(z, f)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['q'\]"):
        ckpt.restore(path)
    report = ckpt.verify(path)
    assert not report.ok and all("leaf ['q']" in p for p in report.problems)


# --- fuzzing ------------------------------------------------------------------------------------


def _node_paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _node_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _node_paths(v, prefix + (i,))


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.sampled_from(["../x", "/etc/passwd", "\x00", "", "float64", "int4", "threefry2x32", "leaf", "dict", "namedtuple"]),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)


def _mutate(data, doc):
    """Applies 1-3 random edits (drop a key, replace a value) to a JSON document."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _node_paths(doc) if p]
        if not paths:
            break
        where = data.draw(st.sampled_from(paths))
        parent = _get(doc, where[:-1])
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[where[-1]]
        else:
            parent[where[-1]] = data.draw(_json)
    return json.dumps(doc).encode()


def _damage_bytes(data, raw):
    how = data.draw(st.sampled_from(["truncate", "flip", "random"]))
    if how == "truncate":
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    if how == "flip":
        i = data.draw(st.integers(0, len(raw) - 1))
        return raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1 :]
    return data.draw(st.binary(max_size=200))


def _only_checkpoint_errors(fn, *args):
    try:
        return fn(*args)
    except ckpt.CheckpointError:
        return None


_EXPECTED = {
    "w": np.arange(32, dtype=np.float32).reshape(8, 4).view(np.uint8),
    "q": np.arange(-8, 8, dtype=np.int8).astype(jnp.int4).view(np.uint8),
}

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(data=st.data())
def test_fuzzed_manifest_raises_only_checkpoint_errors(victim, data):
    path, manifest = victim
    if data.draw(st.integers(0, 4)) == 0:
        raw = _damage_bytes(data, json.dumps(manifest).encode())
    else:
        raw = _mutate(data, manifest)
    with open(f"{path}/manifest.json", "wb") as f:
        f.write(raw)
    _only_checkpoint_errors(ckpt.metadata, path)
    _only_checkpoint_errors(ckpt.restore, path)
    _only_checkpoint_errors(ckpt.restore, path, _target())


@FUZZ
@given(data=st.data())
def test_fuzzed_zarr_json_raises_only_checkpoint_errors_and_never_returns_wrong_values(victim, data):
    path, _ = victim
    leaf = data.draw(st.sampled_from(["w", "q"]))
    zpath = f"{path}/arrays/{leaf}/zarr.json"
    with open(f"{path}/arrays/{leaf}/zarr.json", "rb") as f:
        original = f.read()
    raw = _damage_bytes(data, original) if data.draw(st.booleans()) else _mutate(data, json.loads(original))
    with open(zpath, "wb") as f:
        f.write(raw)
    try:
        out = _only_checkpoint_errors(ckpt.restore, path)
        if out is not None:
            for k in ("w", "q"):
                np.testing.assert_array_equal(np.asarray(out[k]).view(np.uint8), _EXPECTED[k])
    finally:
        with open(zpath, "wb") as f:
            f.write(original)


# --- packed small leaves (`_pack`): the manifest's index and the pack file ------------------


@pytest.fixture(scope="module")
def original_packed(tmp_path_factory):
    """`_tree()` saved with its small leaves packed (w, h, key, opt; q is int4: not packed)."""
    path = str(tmp_path_factory.mktemp("hostile_packed") / "orig" / "1")
    ckpt.save(path, _tree(), pack_small_leaves_bytes=256 << 10)
    with open(f"{path}/manifest.json") as f:
        manifest = json.load(f)
    assert manifest["packed"] and manifest["leaves"]["w"]["packed"]
    return path, manifest


@pytest.fixture
def victim_packed(original_packed, tmp_path):
    src, manifest = original_packed
    dst = tmp_path / "run" / "1"
    shutil.copytree(src, dst)
    return str(dst), copy.deepcopy(manifest)


def _check_values(out):
    if out is not None:
        np.testing.assert_array_equal(np.asarray(out["w"]).view(np.uint8), _EXPECTED["w"])
        np.testing.assert_array_equal(np.asarray(out["h"]), np.arange(3, dtype=np.int64))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_pack_index_raises_only_checkpoint_errors_and_never_returns_wrong_values(victim_packed, data):
    path, manifest = victim_packed  # each example writes the whole manifest anew
    if data.draw(st.booleans()):  # edits inside the packed section only
        packed = json.loads(_mutate(data, {"packed": manifest["packed"]}))
        manifest = dict(manifest, **packed) if isinstance(packed, dict) else manifest
        raw = json.dumps(manifest).encode()
    else:
        raw = _mutate(data, manifest)
    with open(f"{path}/manifest.json", "wb") as f:
        f.write(raw)
    _only_checkpoint_errors(ckpt.metadata, path)
    _check_values(_only_checkpoint_errors(ckpt.restore, path))
    _check_values(_only_checkpoint_errors(ckpt.restore, path, _target()))


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_damaged_pack_file_raises_only_checkpoint_errors_and_never_returns_wrong_values(victim_packed, data):
    path, _ = victim_packed
    pack = f"{path}/packed/process-0/c/0"
    with open(pack, "rb") as f:
        original = f.read()
    damaged = _damage_bytes(data, original)
    with open(pack, "wb") as f:
        f.write(damaged)
    try:
        _check_values(_only_checkpoint_errors(ckpt.restore, path))
        if damaged != original:
            assert not ckpt.verify(path).ok
    finally:  # the examples share the folder
        with open(pack, "wb") as f:
            f.write(original)


def test_an_infinite_mesh_size_in_saved_sharding_is_corrupt_not_overflow(victim):
    """Found by the manifest fuzzer in CI: `int(inf)` raises OverflowError, which is neither
    a ValueError nor a TypeError, so it escaped the parser as itself."""
    path, manifest = victim
    sharding = dict(manifest["leaves"]["w"]["saved_sharding"], mesh_shape=[float("inf")])
    _write_manifest(path, _set(manifest, "w", saved_sharding=sharding))
    _all_raise_corrupt(path, match="saved_sharding")


@pytest.mark.parametrize("process_count", [2, 10**9])
def test_a_manifest_claiming_more_processes_than_records_fails_verify(victim, process_count):
    # verify listed processes/ and checked what it found: a manifest claiming processes
    # whose records are missing passed as OK.
    path, manifest = victim
    manifest["process_count"] = process_count
    _write_manifest(path, manifest)
    report = ckpt.verify(path)
    assert not report.ok
    assert any(f"processes/1.json is missing (process 1 of {process_count}" in p for p in report.problems)
