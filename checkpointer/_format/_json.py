"""The JSON encoding of the format's files (`dumps`; `dumps_large` for the manifest and
the process records) and their checked parse (`loads`), within `MAX_MANIFEST_BYTES`."""

from __future__ import annotations

import json

from .._errors import CorruptCheckpointError

# Bound on a JSON file of the format (manifest, process record), checked before it is parsed.
MAX_MANIFEST_BYTES = 1 << 30


def dumps(obj: object) -> bytes:
    """The JSON encoding used for every file of the format."""
    return json.dumps(obj, indent=1, sort_keys=False, allow_nan=False).encode()


def _expands(obj: object, depth: int) -> bool:
    if isinstance(obj, dict):
        return bool(obj) and (depth < 2 or any(isinstance(v, list) and v and isinstance(v[0], dict) for v in obj.values()))
    if isinstance(obj, list):
        return bool(obj) and (depth < 1 or all(isinstance(v, dict) for v in obj))
    return False


_ENCODER = json.JSONEncoder(allow_nan=False)  # one instance: `json.dumps(..., allow_nan=False)` builds one per call


def _dump_lines(obj: object, depth: int, out: list[str]) -> None:
    if not _expands(obj, depth):
        out.append(_ENCODER.encode(obj))
        return
    pad = " " * (depth + 1)
    items: list[tuple[object, object]] = list(obj.items()) if isinstance(obj, dict) else [(None, v) for v in obj]  # type: ignore[attr-defined]
    out.append("{" if isinstance(obj, dict) else "[")
    for i, (k, v) in enumerate(items):
        out.append("\n" + pad + (_ENCODER.encode(k) + ": " if k is not None else ""))
        _dump_lines(v, depth + 1, out)
        if i + 1 < len(items):
            out.append(",")
    out.append("\n" + " " * depth + ("}" if isinstance(obj, dict) else "]"))


def dumps_large(obj: object) -> bytes:
    """The JSON encoding of the format's large files (manifest, process records): the
    top levels one entry per line and every list of objects one object per line (a
    leaf, a chunk, a packed box), each entry compact. Same JSON as `dumps`, other
    whitespace: it runs on the C encoder (`indent=` forces Python's, ~10 µs per
    value: 0.3 s for a record of 5,000 chunks)."""
    out: list[str] = []
    _dump_lines(obj, 0, out)
    return "".join(out).encode()


def loads(data: bytes, where: str) -> object:
    """Parses a JSON file of the format; raises CorruptCheckpointError if malformed."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON: {e}") from e
