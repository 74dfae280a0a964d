"""Leaf paths (escaping, safety checks) and the JSON tree structure (describe / rebuild)."""

import collections
import dataclasses
import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from checkpointer._errors import CorruptCheckpointError, StructureMismatchError
from checkpointer._format._tree import check_leaf_path, describe, escape_key, flatten, keystr, keystrs, leaf_path, rebuild

try:
    from optax import ScaleByAdamState
except ImportError:  # pragma: no cover
    ScaleByAdamState = collections.namedtuple("ScaleByAdamState", ["count", "mu", "nu"])


def _is_array(x):
    return isinstance(x, (np.ndarray, jax.Array))


# --- leaf path escaping --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, component",
    [
        ("w", "w"),
        ("linear_0", "linear_0"),
        ("a.b", "a.b"),
        ("test/test", "test%2Ftest"),
        ("mlp/~/linear_0", "mlp%2F~%2Flinear_0"),
        ("..", "%2E%2E"),
        (".", "%2E"),
        ("...", "%2E%2E%2E"),
        ("", "%"),
        ("%", "%25"),
        ("x%2Fy", "x%252Fy"),
        ("héllo", "h%C3%A9llo"),
        ("日本", "%E6%97%A5%E6%9C%AC"),
        ("a b", "a%20b"),
        ("a\x00b", "a%00b"),
        ("@x", "%40x"),
        ("@int:1", "%40int%3A1"),
        ("a\\b", "a%5Cb"),
    ],
)
def test_str_dict_key_escaping(key, component):
    assert escape_key(DictKey(key)) == component
    assert leaf_path([DictKey("params"), DictKey(key)]) == f"params/{component}"


@pytest.mark.parametrize(
    "entry, component",
    [
        (DictKey(1), "@int:1"),
        (DictKey(-3), "@int:-3"),
        (DictKey(True), "@bool:True"),
        (DictKey(1.5), "@float:1.5"),
        (DictKey(None), "@NoneType:None"),
        (DictKey(("a", 1)), "@tuple:%28%27a%27%2C%201%29"),
        (SequenceKey(3), "3"),
        (GetAttrKey("count"), "count"),
        (GetAttrKey(".."), "%2E%2E"),
        (FlattenedIndexKey(2), "2"),
    ],
)
def test_other_key_escaping(entry, component):
    assert escape_key(entry) == component


def test_root_leaf_path_is_empty():
    assert leaf_path([]) == ""
    assert flatten(np.zeros(2))[0][0] == ""


def test_int_and_str_keys_never_collide():
    tree = {"a": {1: "x"}, "b": {"1": "y"}, "c": {"@int:1": "z"}, "d": ["w"], "e": {-1: "v"}, "f": {"-1": "u"}}
    assert flatten(tree) == [
        ("a/@int:1", "x"),
        ("b/1", "y"),
        ("c/%40int%3A1", "z"),
        ("d/0", "w"),
        ("e/@int:-1", "v"),
        ("f/-1", "u"),
    ]


def test_dict_mixing_int_and_str_keys_raises_structure_mismatch():
    # JAX cannot order 1 and "1"; the docstring of `flatten` promises StructureMismatchError.
    with pytest.raises(StructureMismatchError):
        flatten({1: "a", "1": "b"})


def test_flatten_keeps_none_as_a_leaf():
    assert flatten({"a": None, "b": [None, 1]}) == [("a", None), ("b/0", None), ("b/1", 1)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(), unique=True, max_size=8))
def test_escaped_str_keys_are_distinct_single_safe_components(keys):
    components = [escape_key(DictKey(k)) for k in keys]
    assert len(set(components)) == len(keys)
    for c in components:
        assert "/" not in c
        assert check_leaf_path(f"params/{c}") == f"params/{c}"


# --- check_leaf_path -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["../x", "..", "/abs", "/", "a/../b", "a/..", "a//b", "a/", "./a", ".", "a/./b", "a\x00b", "a\\b", "..\\x", None, 3, b"a"],
)
def test_check_leaf_path_rejects_unsafe_paths(path):
    with pytest.raises(CorruptCheckpointError):
        check_leaf_path(path, where="/ckpt/1")


@pytest.mark.parametrize("path", ["", "a", "a/b", "%2E%2E", "a.b/c", "mlp%2F~%2Flinear_0/w", "@int:1/0", "h%C3%A9llo"])
def test_check_leaf_path_accepts_safe_paths(path):
    assert check_leaf_path(path) == path


def test_check_leaf_path_message_names_the_path_and_checkpoint():
    with pytest.raises(CorruptCheckpointError, match=r"'\.\./etc/passwd'.*in /ckpt/1"):
        check_leaf_path("../etc/passwd", where="in /ckpt/1")


# --- describe / rebuild ------------------------------------------------------------------------


def _roundtrip(tree):
    """describe -> JSON text -> rebuild, with each leaf replaced by the string '<path>'."""
    node = json.loads(json.dumps(describe(tree, _is_array)))
    return rebuild(node, lambda p: f"<{p}>", where="/ckpt/1")


def test_roundtrip_dicts_int_keys_lists_tuples_none_and_empty_containers():
    x = np.zeros(2)
    tree = {"a": {1: x, 2: x}, "b": [x, None], "c": (x,), "d": {}, "e": [], "f": (), "g": 3}
    out = _roundtrip(tree)
    assert out == {
        "a": {1: "<a/@int:1>", 2: "<a/@int:2>"},
        "b": ["<b/0>", "<b/1>"],
        "c": ("<c/0>",),
        "d": {},
        "e": [],
        "f": (),
        "g": "<g>",
    }
    assert list(out) == ["a", "b", "c", "d", "e", "f", "g"]
    assert [type(out[k]) for k in "abcdef"] == [dict, list, tuple, dict, list, tuple]


def test_roundtrip_keys_needing_escapes():
    x = np.zeros(1)
    out = _roundtrip({"mlp/~/linear_0": {"w": x}, "..": x, "": x, "日本": x})
    assert out == {"": "<%>", "..": "<%2E%2E>", "mlp/~/linear_0": {"w": "<mlp%2F~%2Flinear_0/w>"}, "日本": "<%E6%97%A5%E6%9C%AC>"}


@pytest.mark.parametrize("root", [None, np.zeros(3), 1.5])
def test_roundtrip_root_leaf(root):
    node = describe(root, _is_array)
    assert node == {"kind": "leaf", "path": ""}
    assert rebuild(node, lambda p: f"<{p}>") == "<>"


def test_roundtrip_adam_state():
    x = np.zeros(2)
    state = (ScaleByAdamState(count=np.zeros((), np.int32), mu={"w": x}, nu={"w": x}), ())
    out = _roundtrip(state)
    assert type(out) is tuple
    assert type(out[0]).__name__ == "ScaleByAdamState"
    assert out[0]._fields == ("count", "mu", "nu")
    assert out[0].count == "<0/count>"
    assert out[0].mu == {"w": "<0/mu/w>"}
    assert out[0].nu == {"w": "<0/nu/w>"}
    assert out[1] == ()


def test_roundtrip_namedtuple_without_fields():
    Empty = collections.namedtuple("EmptyState", [])
    out = _roundtrip({"opt": Empty()})
    assert type(out["opt"]).__name__ == "EmptyState"
    assert out["opt"] == ()


Point = collections.namedtuple("Point", ["x", "y"])


def test_roundtrip_nested_namedtuple():
    out = _roundtrip([Point(np.zeros(1), Point(np.zeros(1), None))])
    assert out == [("<0/x>", ("<0/y/x>", "<0/y/y>"))]
    assert type(out[0]).__name__ == "Point" and out[0]._fields == ("x", "y")
    assert type(out[0].y).__name__ == "Point"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _TrainStateForTest:
    params: object
    step: object


class _KeylessNodeForTest:
    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(
    _KeylessNodeForTest, lambda n: ((n.a, n.b), None), lambda aux, children: _KeylessNodeForTest(*children)
)


def test_custom_node_with_attribute_keys_is_rebuilt_as_a_dict():
    tree = _TrainStateForTest(params={"w": np.zeros(2)}, step=np.zeros(()))
    node = describe(tree, _is_array)
    assert node["kind"] == "custom"
    assert node["type"].endswith("_TrainStateForTest")
    assert _roundtrip(tree) == {"params": {"w": "<params/w>"}, "step": "<step>"}


def test_custom_node_without_keys_is_rebuilt_as_a_dict_of_indices():
    out = _roundtrip({"n": _KeylessNodeForTest(np.zeros(1), [np.zeros(1)])})
    assert out == {"n": {0: "<n/0>", 1: ["<n/1/0>"]}}


@jax.tree_util.register_pytree_with_keys_class
class _DictKeyedNodeForTest:
    """A custom node with DictKey keys, as `nnx.State` and `FrozenDict` have."""

    def __init__(self, d):
        self.d = d

    def tree_flatten_with_keys(self):
        return [(DictKey(k), v) for k, v in sorted(self.d.items())], tuple(sorted(self.d))

    @classmethod
    def tree_unflatten(cls, keys, children):
        return cls(dict(zip(keys, children)))


def test_keystrs_from_the_stored_structure_equal_jax_keystr():
    x = np.zeros(1)
    strs = {
        "mlp/~/linear_0": {"w": x}, "it's": [x, (x, None)], "": x,
        "ts": _TrainStateForTest(params={"kernel": x}, step=x),
        "state": _DictKeyedNodeForTest({"kernel": x, "a b": x}),
        "keyless": _KeylessNodeForTest(x, x),
    }
    tree = {"s": strs, "i": {3: Point(x, x)}, "t": {("t", 1): x}}  # one key type per dict
    structure = json.loads(json.dumps(describe(tree, _is_array)))  # as stored
    want = {leaf_path(kp): jax.tree_util.keystr(kp)
            for kp, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda v: v is None)[0]}
    assert keystrs(structure) == want
    assert list(keystrs(structure)) == [p for p, _ in flatten(tree)]  # tree order
    assert want["s/mlp%2F~%2Flinear_0/w"] == "['s']['mlp/~/linear_0']['w']"
    assert want["s/ts/params/kernel"] == "['s']['ts'].params['kernel']"
    assert want["s/state/kernel"] == "['s']['state']['kernel']"
    assert want["s/keyless/0"] == "['s']['keyless'][<flat index 0>]"
    assert keystr(structure, "i/@int:3/x") == "['i'][3].x"
    assert keystr(structure, "t/@tuple:%28%27t%27%2C%201%29") == "['t'][('t', 1)]"
    assert keystrs(describe(x, _is_array)) == {"": ""}


def test_keystrs_of_a_structure_stored_before_key_kinds_guess_custom_keys():
    """Manifests without `key_kinds` print a custom node's identifier keys as attributes."""
    x = np.zeros(1)
    structure = describe({"ts": _TrainStateForTest(params={"w": x}, step=x), "st": _DictKeyedNodeForTest({"a b": x})}, _is_array)
    for node in (structure["children"][0], structure["children"][1]):
        del node["key_kinds"]
    assert keystrs(structure) == {"st/a%20b": "['st']['a b']", "ts/params/w": "['ts'].params['w']", "ts/step": "['ts'].step"}


def test_describe_paths_match_flatten_paths():
    x = np.zeros(1)
    tree = {"a": [x, (x, None)], "b": {3: Point(x, x)}, "c": _TrainStateForTest(x, x)}
    paths = []
    rebuild(describe(tree, _is_array), lambda p: paths.append(p))
    assert paths == [p for p, _ in flatten(tree)] == ["a/0", "a/1/0", "a/1/1", "b/@int:3/x", "b/@int:3/y", "c/params", "c/step"]


# --- rebuild on malformed input ----------------------------------------------------------------

LEAF = {"kind": "leaf", "path": "a"}


@pytest.mark.parametrize(
    "node",
    [
        [],
        "leaf",
        None,
        3,
        {},
        {"kind": "leaf"},
        {"kind": "leaf", "path": 3},
        {"kind": "leaf", "path": "../x"},
        {"kind": "leaf", "path": "/etc/passwd"},
        {"kind": "leaf", "path": "a//b"},
        {"kind": "dict"},
        {"kind": "dict", "keys": ["a"], "children": []},
        {"kind": "dict", "keys": "a", "children": [LEAF]},
        {"kind": "dict", "keys": ["a"], "children": LEAF},
        {"kind": "dict", "keys": [1.5], "children": [LEAF]},
        {"kind": "dict", "keys": [True], "children": [LEAF]},
        {"kind": "dict", "keys": [None], "children": [LEAF]},
        {"kind": "dict", "keys": [["a"]], "children": [LEAF]},
        {"kind": "dict", "keys": [{"int": "1"}], "children": [LEAF]},
        {"kind": "dict", "keys": [{"int": 1, "x": 2}], "children": [LEAF]},
        {"kind": "dict", "keys": [{"repr": 1}], "children": [LEAF]},
        {"kind": "list", "keys": [0], "children": ["leaf"]},
        {"kind": "list", "keys": [0], "children": [None]},
        {"kind": "set", "keys": [], "children": []},
        {"kind": None, "keys": [], "children": []},
        {"kind": ["dict"], "keys": [], "children": []},
        {"kind": "tuple", "keys": [0], "children": [{"kind": "list", "keys": [0], "children": [{"kind": "leaf", "path": ".."}]}]},
    ],
)
def test_rebuild_rejects_malformed_nodes(node):
    with pytest.raises(CorruptCheckpointError):
        rebuild(node, lambda p: p, where="/ckpt/1")


def _nested(depth):
    node = {"kind": "leaf", "path": "x"}
    for _ in range(depth):
        node = {"kind": "list", "keys": [0], "children": [node]}
    return node


def test_rebuild_rejects_nesting_deeper_than_1000():
    with pytest.raises(CorruptCheckpointError):
        rebuild(_nested(1001), lambda p: p, where="/ckpt/1")


def test_rebuild_of_deep_but_legal_nesting_succeeds_or_raises_corrupt():
    # 600 levels is within the documented limit of 1000; rebuilding must either succeed or
    # raise CorruptCheckpointError, never escape as a RecursionError.
    try:
        out = rebuild(_nested(600), lambda p: p, where="/ckpt/1")
    except CorruptCheckpointError:
        return
    for _ in range(600):
        out = out[0]
    assert out == "x"


def test_rebuild_namedtuple_with_hostile_type_and_field_names():
    node = {"kind": "namedtuple", "type": "class", "keys": ["def", "_x", "ok", "ok"], "children": [LEAF] * 4}
    out = rebuild(node, lambda p: p)
    assert out == ("a", "a", "a", "a")
    assert type(out).__name__ == "Record"
    assert out.ok == "a"


# JSON-like values, and nodes built from them so that the fuzz reaches past the first check.
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=False)
    | st.text(max_size=3)
    | st.sampled_from(["leaf", "dict", "list", "a", "a/b", "", "..", "../a", "/a", "a//b", "a\\b", "a\x00", "None"])
    | st.sampled_from([{"int": 2}, {"int": "2"}, {"repr": "x"}, {"int": 1, "repr": "x"}, [], {}])
)
_kinds = st.sampled_from(["leaf", "dict", "list", "tuple", "namedtuple", "custom", "other"])
_fields = st.sampled_from(["kind", "keys", "children", "path", "type"])


def _node(kind, pairs, extra):
    return {"kind": kind, "keys": [k for k, _ in pairs], "children": [c for _, c in pairs], **extra}


_nodes = st.recursive(
    st.fixed_dictionaries({"kind": st.just("leaf"), "path": _scalars}) | _scalars,
    lambda inner: st.builds(
        _node,
        _kinds,
        st.lists(st.tuples(_scalars, inner), max_size=3),
        st.sampled_from([{}, {"type": "Point"}, {"type": 3}, {"type": "class"}, {"keys": ["x"]}, {"children": "ab"}]),
    )
    | st.dictionaries(_fields, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(_nodes)
def test_rebuild_fuzz_only_raises_corrupt_checkpoint_error(node):
    try:
        rebuild(node, lambda p: p, where="/ckpt/fuzz")
    except CorruptCheckpointError:
        pass
