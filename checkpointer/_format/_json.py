"""The JSON encoding of the format's files (`dumps`; `dumps_large` for the manifest and
the process records) and the library's one bounded JSON parser (`load_json`): every JSON
the library reads (manifest, process records, commit marker, step catalog, journal lines,
pack index, zarr.json, safetensors header and index, Orbax metadata) goes through it."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from .._errors import CheckpointError, CorruptCheckpointError, SaveError

# Bound on a JSON file of the format (manifest, process record), checked before it is parsed.
MAX_MANIFEST_BYTES = 1 << 30
# `load_json`'s default bounds. Depth counts nested arrays and objects: `[[1]]` is 2. No JSON
# the library writes nests beyond ~10 levels except the manifest's tree structure, two
# levels per tree level (`MANIFEST_MAX_DEPTH`); Python's `json` recurses per level (C stack
# and the interpreter's recursion limit), so the depth is checked before parsing, without
# recursion: a file nested 50,000 levels deep is refused as the caller's documented error
# instead of escaping as RecursionError.
MAX_JSON_BYTES = MAX_MANIFEST_BYTES
MAX_JSON_DEPTH = 512
# The manifest's bound: `_tree.MAX_DEPTH` tree levels (two JSON levels each) plus the
# manifest's own few. Python's parser gives up before (~900 levels from a shallow stack),
# which `load_json` reports as the same error.
MANIFEST_MAX_DEPTH = 2 * 1000 + 16

_SCAN_CHUNK = 1 << 20
_OPEN = np.zeros(256, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def dumps(obj: object) -> bytes:
    """The JSON encoding used for every file of the format."""
    return json.dumps(obj, indent=1, sort_keys=False, allow_nan=False).encode()


def _expands(obj: object, depth: int) -> bool:
    if isinstance(obj, dict):
        return bool(obj) and (depth < 2 or _has_object_list(obj))
    if isinstance(obj, list):
        return bool(obj) and (depth < 1 or all(isinstance(v, dict) for v in obj))
    return False


def _has_object_list(obj: dict) -> bool:
    for v in obj.values():
        if isinstance(v, list) and v and isinstance(v[0], dict):
            return True
    return False


_ENCODER = json.JSONEncoder(allow_nan=False)  # one instance: `json.dumps(..., allow_nan=False)` builds one per call
# `_ENCODER.encode` builds a C encoder per call; one built once encodes an entry in half the time. Without
# the circular check (`markers=None`): what the format's files hold is built by the library or was
# checked by a JSON round trip (user metadata, per-process state).
_MAKE_C_ENCODER = getattr(json.encoder, "c_make_encoder", None)  # CPython's _json accelerator (not in the stubs)
_C_ENCODER = (_MAKE_C_ENCODER(None, _ENCODER.default, json.encoder.encode_basestring_ascii, None, ": ", ", ", False, False, False)
              if _MAKE_C_ENCODER is not None else None)


def encode(obj: object) -> str:
    """`_ENCODER.encode(obj)` (compact, ASCII, no NaN), on the C encoder built once: an
    entry of `dumps_large`."""
    if _C_ENCODER is None or isinstance(obj, str):
        return _ENCODER.encode(obj)
    return "".join(_C_ENCODER(obj, 0))


encode_ascii = json.encoder.encode_basestring_ascii  # a str as `encode` writes it (C)
_encode = encode


class EncodedObjects(list):
    """A list of JSON objects that also carries each one's compact text (`texts`, as
    `dumps_large` would encode it), made once by its owner: `dumps_large` writes those
    texts instead of encoding the objects again (a pack index goes into the process
    record and the manifest, one object per small chunk); every other reader sees the
    list of objects. Never changed after it is made."""

    def __init__(self, objects: list[dict], texts: list[str]):
        super().__init__(objects)
        assert len(texts) == len(objects)
        self.texts = texts


def _dump_lines(obj: object, depth: int, out: list[str], memo: dict[int, str]) -> None:
    # From depth 2 on whether a dict expands depends on its contents alone: a compact one
    # met again (leaves of one layout share their manifest entry) reuses its text.
    memoized = depth >= 2 and isinstance(obj, dict)
    if memoized:
        text = memo.get(id(obj))
        if text is not None:
            out.append(text)
            return
    if not _expands(obj, depth):
        text = _encode(obj)
        if memoized:
            memo[id(obj)] = text
        out.append(text)
        return
    pad = "\n" + " " * (depth + 1)
    if isinstance(obj, dict):
        out.append("{")
        inner_memo = depth + 1 >= 2  # the children's texts are memoized (as `_dump_lines` would)
        for i, (k, v) in enumerate(obj.items()):
            # A str key as `_encode` writes it, without its call (a manifest has a key per leaf).
            out.append(("," if i else "") + pad + (encode_ascii(k) if type(k) is str else _encode(k)) + ": ")
            text = memo.get(id(v)) if inner_memo and type(v) is dict else None
            if text is not None:  # a leaf's entry shared with the leaves of its layout
                out.append(text)
            else:
                _dump_lines(v, depth + 1, out, memo)
        out.append("\n" + " " * depth + "}")
        return
    assert isinstance(obj, list)
    out.append("[")
    if depth >= 1 and isinstance(obj, EncodedObjects) and len(obj.texts) == len(obj):
        if obj.texts:  # `",".join(pad + text ...)`, joined in C
            out.append(pad + ("," + pad).join(obj.texts))
        out.append("\n" + " " * depth + "]")
        return
    for i, v in enumerate(obj):
        out.append(("," if i else "") + pad)
        if depth >= 1 and not _has_object_list(v):  # an entry of a list of objects (a chunk, a packed box): compact
            out.append(_encode(v))
        else:
            _dump_lines(v, depth + 1, out, memo)
    out.append("\n" + " " * depth + "]")


def dumps_large(obj: object) -> bytes:
    """The JSON encoding of the format's large files (manifest, process records): the
    top levels one entry per line and every list of objects one object per line (a
    leaf, a chunk, a packed box), each entry compact. Same JSON as `dumps`, other
    whitespace: it runs on the C encoder (`indent=` forces Python's, ~10 µs per
    value: 0.3 s for a record of 5,000 chunks). An object that appears several times
    (leaves of one layout share their manifest entry) is encoded once."""
    out: list[str] = []
    # id -> text of the compact objects met so far; they stay alive (in `obj`) meanwhile.
    _dump_lines(obj, 0, out, {})
    return "".join(out).encode()


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in `data` (brackets inside strings do not
    count), found without recursion, in time linear in `len(data)` (numpy, 1 MiB at a
    time: a fraction of `json.loads`' own time). Exact for valid JSON; for invalid JSON
    whatever the scan finds (the parser refuses it anyway)."""
    deepest = depth = carry = in_string = 0  # carry: backslashes ending the previous chunk
    for start in range(0, len(data), _SCAN_CHUNK):
        a = np.frombuffer(data, np.uint8, min(_SCAN_CHUNK, len(data) - start), start)
        n = len(a)
        quotes = np.flatnonzero(a == ord('"'))
        is_backslash = a == ord("\\")
        any_backslash = bool(is_backslash.any())
        if any_backslash:
            # last_plain[i]: the last index <= i that is not a backslash (-1: none in this chunk)
            last_plain = np.maximum.accumulate(np.where(is_backslash, np.int32(-1), np.arange(n, dtype=np.int32)))
            before = last_plain[np.maximum(quotes - 1, 0)]
            run = np.where(quotes == 0, 0, quotes - 1 - before) + np.where((quotes == 0) | (before == -1), carry, 0)
            quotes = quotes[run % 2 == 0]  # a quote after an even run of backslashes opens or closes a string
        elif carry % 2 and len(quotes) and quotes[0] == 0:
            quotes = quotes[1:]  # escaped by the backslashes ending the previous chunk
        toggles = np.zeros(n, np.uint8)
        toggles[quotes] = 1
        outside = np.bitwise_xor.accumulate(toggles) ^ np.uint8(1 - in_string)  # 1 outside strings
        running = np.cumsum(_OPEN[a] * outside.view(np.int8), dtype=np.int32) + depth
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
        in_string = 1 - int(outside[-1])
        if not any_backslash:
            carry = 0
        elif is_backslash[-1]:
            carry = n - 1 - int(last_plain[-1]) + (carry if last_plain[-1] == -1 else 0)
        else:
            carry = 0
    return deepest


def load_json(
    data: bytes | str,
    *,
    what: str,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    error: type[CheckpointError] = CorruptCheckpointError,
) -> Any:
    """Parses JSON the library reads, within bounds checked before parsing.

    Args:
      data: the JSON text (UTF-8, or any encoding `json.loads` detects for bytes).
      what: the file (or file and line) named in the error, e.g. `'{path}/manifest.json'`.
      max_bytes: largest accepted `len(data)` (bytes, or characters for a `str`).
      max_depth: deepest accepted nesting of arrays and objects (`[[1]]` is 2).
      error: the error the caller documents for a malformed file.

    Returns:
      The parsed value (dict, list, str, int, float, bool or None). Its shape is the
      caller's to check.

    Raises:
      error (CorruptCheckpointError by default): `data` is larger than `max_bytes`, nests
        deeper than `max_depth`, or is not valid JSON . Never RecursionError, whatever the nesting.

    Multi-process: local; no coordination.
    """
    if len(data) > max_bytes:
        raise error(f"{what} is larger than {max_bytes} bytes ({len(data)}): refused before parsing")
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    depth = json_depth(raw)
    if depth > max_depth:
        raise error(f"{what} nests arrays and objects {depth} levels deep, more than the {max_depth} accepted: not a file the library reads")
    try:
        return json.loads(data)
    except (ValueError, RecursionError, TypeError) as e:
        raise error(f"{what} is not valid JSON: {str(e)[:200]}") from None


def finite_number(v: object) -> float | None:
    """A number read from JSON as a finite float, or None: not a number (a bool is not),
    infinite, or an int too large for a float (valid JSON, e.g. 10**400: `float()` of it
    raises OverflowError, which must never escape a parse)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def readable_size(data: bytes, what: str, hint: str) -> bytes:
    """`data`, a manifest or process record about to be written, if readers accept its
    size (`MAX_MANIFEST_BYTES`, the bound they read these files with).

    Args:
      data: the encoded file.
      what: the file, named in the error.
      hint: what makes it large and what to do instead, for the error.
    Raises:
      SaveError: larger than readers accept: a step committed with it could never be
        restored (nor its metadata read), so it must not be committed.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise SaveError(f"{what} would be {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} bytes a reader accepts "
                        f"(MAX_MANIFEST_BYTES): nothing was committed. {hint}")
    return data


def loads(data: bytes | str, where: str) -> Any:
    """`load_json` of a file of the format (manifest depth bound); raises CorruptCheckpointError."""
    return load_json(data, what=where, max_depth=MANIFEST_MAX_DEPTH)
