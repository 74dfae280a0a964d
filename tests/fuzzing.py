"""Shared pieces of the fuzz tests (tests/test_fuzz_*.py, issue 27 item 2): the hypothesis
profiles, strategies of hostile variants of a file, and the checks of the properties.

Profiles (`CHECKPOINTER_FUZZ`, default `ci`):
- `ci`: what `make test` runs, `CI_EXAMPLES` examples per test (scaled per test);
- `long`: `LONG_EXAMPLES` examples per test, the longer run:
  `CHECKPOINTER_FUZZ=long .venv/bin/python -m pytest -q tests/test_fuzz_*.py`;
- a number: that many examples per test (scaled per test), e.g. `CHECKPOINTER_FUZZ=200`.
Both: no deadline (the machine is shared and slow), every health check off (the tests
write files per example, and draw from large documents).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tracemalloc

import psutil
from hypothesis import HealthCheck, settings, strategies as st

import checkpointer as ckpt

CI_EXAMPLES = 20
LONG_EXAMPLES = 2000
settings.register_profile("checkpointer-ci", max_examples=CI_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("checkpointer-long", max_examples=LONG_EXAMPLES, deadline=None,
                          suppress_health_check=list(HealthCheck))
_CHOICE = os.environ.get("CHECKPOINTER_FUZZ", "ci")
if _CHOICE.isdigit():  # a number of examples per test: a run of its own size
    settings.register_profile(f"checkpointer-{_CHOICE}", settings.get_profile("checkpointer-ci"), max_examples=int(_CHOICE))
PROFILE = f"checkpointer-{_CHOICE}"

# The stated memory bound: a hostile file (a huge declared shape, length or offset) makes
# the reader grow the host memory by less than this (numpy's allocations, by tracemalloc,
# and the process's resident set, by psutil, which sees TensorStore's too).
MEMORY_BOUND_BYTES = 64 << 20


def fuzz(scale: float = 1.0) -> settings:
    """The profile's settings, `scale` times its examples (at least 1)."""
    base = settings.get_profile(PROFILE)
    return settings(base, max_examples=max(1, int(base.max_examples * scale)))


# --- hostile values ------------------------------------------------------------------------

HOSTILE_STRINGS = [
    "../outside", "../../outside", "/etc/passwd", "/tmp", "..", ".", "", "a/../../b", "a\x00b", "\\..\\x",
    "float64", "int4", "bfloat16", "F32", "BF16", "I64", "leaf", "dict", "namedtuple", "array", "value",
    "NaN", "Infinity", "1e309", "x" * 300,
]
HUGE_INTS = [-1, 0, 1, 2**31, 2**32 + 1, 2**62, 2**63, 2**64 + 7, -(2**63), 10**30]


class Deep:
    """`inner` nested in `levels` arrays: `[[...[inner]...]]` once `encode`d (Python's json
    cannot encode it: it recurses per level)."""

    def __init__(self, levels: int, inner: object = 0) -> None:
        self.levels, self.inner = levels, inner

    def __repr__(self) -> str:
        return f"Deep({self.levels}, {self.inner!r})"


def deep(levels: int, inner: object = 0) -> Deep:
    return Deep(levels, inner)


def encode(doc: object) -> bytes:
    """JSON of `doc`, `Deep` values included (NaN and Infinity as Python writes them)."""
    found: list[Deep] = []

    def token(o: object) -> object:
        if isinstance(o, Deep):
            found.append(o)
            return f"\x00deep{len(found) - 1}\x00"
        raise TypeError(f"not JSON: {o!r}")

    text = json.dumps(doc, default=token)
    for i, d in enumerate(found):
        text = text.replace(json.dumps(f"\x00deep{i}\x00"), "[" * d.levels + encode(d.inner).decode() + "]" * d.levels, 1)
    return text.encode()


def depth_of(doc: object) -> int:
    """The nesting depth of `doc` once encoded, without recursion."""
    deepest, stack = 0, [(doc, 0)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, Deep):
            deepest = max(deepest, d + o.levels)
            stack.append((o.inner, d + o.levels))
        elif isinstance(o, (list, dict)):
            deepest = max(deepest, d + 1)
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


scalars = (st.none() | st.booleans() | st.integers() | st.sampled_from(HUGE_INTS)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8) | st.sampled_from(HOSTILE_STRINGS))
hostile_json = st.one_of(
    st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                 max_leaves=8),
    st.lists(st.sampled_from(HUGE_INTS), min_size=1, max_size=40),  # a huge shape, rank up to 40
    st.integers(1, 3000).map(deep),  # nested beyond the parser's and the walkers' limits
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def mutate_json(data, doc: object) -> bytes:
    """1-3 edits of a JSON document (drop a key, replace a value with a hostile one, or
    nest the whole value very deep), encoded (NaN and Infinity allowed: JSON's
    extensions a hostile writer may use)."""
    doc = copy.deepcopy(doc)  # (a Deep inside is shared, never edited in place)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            doc = data.draw(hostile_json)
            continue
        where = data.draw(st.sampled_from(paths), label="where")
        parent = doc
        for k in where[:-1]:
            parent = parent[k]
        how = data.draw(st.sampled_from(["drop", "replace", "replace", "bury"]), label="how")
        if how == "drop" and isinstance(parent, dict):
            del parent[where[-1]]
        elif how == "bury":
            parent[where[-1]] = deep(data.draw(st.sampled_from([600, 5_000, 50_000])), parent[where[-1]])
        else:
            parent[where[-1]] = data.draw(hostile_json, label="value")
    return encode(doc)


def damage_bytes(data, raw: bytes) -> bytes:
    """A byte-level variant: truncated, one byte flipped, a slice replaced, or noise."""
    how = data.draw(st.sampled_from(["truncate", "flip", "splice", "random"]), label="damage")
    if how == "truncate" and raw:
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    if how == "flip" and raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        return raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1 :]
    if how == "splice" and raw:
        i = data.draw(st.integers(0, len(raw)))
        j = data.draw(st.integers(i, min(len(raw), i + 64)))
        return raw[:i] + data.draw(st.binary(max_size=64)) + raw[j:]
    return data.draw(st.binary(max_size=300))


def hostile_variant(data, raw: bytes) -> bytes:
    """A hostile variant of the JSON file `raw`: byte damage (1 in 3) or JSON edits."""
    if data.draw(st.integers(0, 2), label="bytes?") == 0:
        return damage_bytes(data, raw)
    return mutate_json(data, json.loads(raw))


# --- the properties ------------------------------------------------------------------------


def documented(call, *names: str, errors: tuple[type[BaseException], ...] = (ckpt.CheckpointError,)):
    """Runs `call()`: returns its result, or None when it raised one of `errors` (the
    documented ones) whose message names one of `names` (the file, or its checkpoint).
    Any other exception propagates: the property fails."""
    try:
        return call()
    except errors as e:
        text = str(e)
        assert not names or any(n in text for n in names), f"{type(e).__name__} names none of {names}: {text[:500]}"
        return None


@contextlib.contextmanager
def bounded_memory(bound_bytes: int = MEMORY_BOUND_BYTES):
    """Asserts the block grows host memory by less than `bound_bytes`: the peak of
    tracemalloc (numpy and Python allocations) and the growth of the resident set
    (psutil; TensorStore's C++ allocations too)."""
    process = psutil.Process()
    rss0 = process.memory_info().rss
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1] - base
        if not tracing:
            tracemalloc.stop()
        grown = process.memory_info().rss - rss0
    assert peak < bound_bytes, f"allocated {peak} bytes at the peak, the bound is {bound_bytes}"
    assert grown < bound_bytes, f"the resident set grew by {grown} bytes, the bound is {bound_bytes}"
