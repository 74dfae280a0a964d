"""Fuzzing the library's one JSON parser, `_format.load_json` (issue 27 item 2), which reads
every JSON file the library reads (manifest, process records, commit marker, journal lines,
pack index, zarr.json, safetensors header and index, Orbax metadata).

Properties: any input is a value or `CorruptCheckpointError` naming the file (never
RecursionError, whatever the nesting); the depth found without recursion is the true
depth; a valid document round-trips through `dumps` / `dumps_large`; memory stays within
`fuzzing.MEMORY_BOUND_BYTES` whatever the input.

`make test` runs the `ci` profile (tests/fuzzing.py); the longer run:
`CHECKPOINTER_FUZZ=long .venv/bin/python -m pytest -q tests/test_fuzz_json.py`.
"""

import json
import math

import pytest
from fuzzing import bounded_memory, depth_of, documented, encode, fuzz, hostile_json
from hypothesis import given, strategies as st

import checkpointer as ckpt
from checkpointer import _format

WHAT = "some/dir/file.json"


def _depth(obj):
    """The nesting depth, without recursion."""
    deepest, stack = 0, [(obj, 0)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (list, dict)):
            deepest = max(deepest, d + 1)
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


def _same(a, b):
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


tricky_text = st.text(alphabet=st.sampled_from('[]{}"\\ab:,é\n\x00'), max_size=12)
documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | tricky_text,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(tricky_text, c, max_size=4),
    max_leaves=20,
)


@fuzz(3)
@given(raw=st.binary(max_size=400) | st.text(alphabet=st.sampled_from('[]{}"\\a1,: '), max_size=400).map(str.encode))
def test_any_bytes_are_a_value_or_corrupt_naming_the_file(raw):
    documented(lambda: _format.load_json(raw, what=WHAT), WHAT)


@fuzz(3)
@given(doc=documents, large=st.booleans())
def test_a_valid_document_round_trips_and_its_depth_is_found_without_recursion(doc, large):
    raw = (_format.dumps_large if large else _format.dumps)(doc)
    assert _format.json_depth(raw) == _depth(doc)
    assert _same(_format.load_json(raw, what=WHAT), doc)
    assert _same(_format.load_json(raw.decode(), what=WHAT), doc)  # a str too (journal lines)


@fuzz(2)
@given(levels=st.integers(1, 200_000), kinds=st.sampled_from(["[", "{", "mixed"]), limit=st.integers(1, 600))
def test_any_nesting_is_parsed_or_refused_by_its_depth_never_recursion(levels, kinds, limit):
    if kinds == "[":
        raw = "[" * levels + "]" * levels
    elif kinds == "{":
        raw = '{"[": ' * levels + '"{"' + "}" * levels
    else:
        raw = '{"k": [' * (levels // 2) + "[]" + "]}" * (levels // 2)
        levels = 2 * (levels // 2) + 1
    if levels <= limit:
        assert _depth(_format.load_json(raw, what=WHAT, max_depth=limit)) == levels
    else:
        with pytest.raises(ckpt.CorruptCheckpointError, match=f"{WHAT} nests arrays and objects {levels} levels deep"):
            _format.load_json(raw, what=WHAT, max_depth=limit)


@fuzz(1)
@given(doc=hostile_json)
def test_a_hostile_document_parses_to_itself_or_is_refused_by_its_depth(doc):
    raw = encode(doc)
    refused = object()
    got = documented(lambda: [_format.load_json(raw, what=WHAT)], WHAT) or refused
    assert (got is refused) == (depth_of(doc) > _format.MAX_JSON_DEPTH)
    assert got is refused or _same(got[0], json.loads(raw))


def test_memory_stays_bounded_for_a_large_hostile_file():
    raw = b"[" * 10 + b'"' + b"[" * (48 << 20) + b'"' + b"]" * 10  # 48 MiB, brackets in a string; 10 deep
    with bounded_memory(), pytest.raises(ckpt.CorruptCheckpointError, match="nests arrays and objects 10 levels"):
        _format.load_json(raw, what=WHAT, max_depth=8)
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"{WHAT} is larger than 1024 bytes"):
        _format.load_json(raw, what=WHAT, max_bytes=1024)


@fuzz(2)
@given(doc=documents, chunk=st.integers(1, 16))
def test_the_depth_scan_follows_strings_and_escapes_across_any_chunk_boundary(doc, chunk):
    raw = _format.dumps(doc)
    real = _format._json._SCAN_CHUNK
    _format._json._SCAN_CHUNK = chunk
    try:
        assert _format.json_depth(raw) == _depth(doc)
    finally:
        _format._json._SCAN_CHUNK = real
