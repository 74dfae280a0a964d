"""Non-array leaf values (None, bool, int, float, complex, str, numpy scalars) as JSON,
bit-exact, and back."""

from __future__ import annotations

import struct

import numpy as np

from .._errors import CorruptCheckpointError
from ._dtypes import dtype_from_name, dtype_name


def value_to_json(value: object) -> dict | None:
    """JSON for a non-array leaf, bit-exact; None if the value is not of a storable kind."""
    if value is None:
        return {"type": "none"}
    # numpy scalars first: np.float64 and np.complex128 subclass float and complex.
    if isinstance(value, np.generic) and value.dtype.kind in "biufc" or type(value).__module__ == "ml_dtypes":
        arr = np.asarray(value)
        return {"type": "numpy_scalar", "dtype": dtype_name(arr.dtype), "hex": arr.tobytes().hex()}
    if isinstance(value, bool):
        return {"type": "bool", "value": value}
    if isinstance(value, int):  # hex: no 4300-digit limit, any size
        return {"type": "int", "hex": format(value, "x")}
    if isinstance(value, float):
        return {"type": "float", "hex": struct.pack("<d", value).hex()}
    if isinstance(value, complex):
        return {"type": "complex", "hex": struct.pack("<dd", value.real, value.imag).hex()}
    if isinstance(value, str):
        return {"type": "str", "value": value}
    return None


def value_repr(value: object, max_chars: int = 60) -> str:
    """`repr(value)` cut to `max_chars` (`...` at the end), for a value leaf shown to a
    user. An int too long for Python's int-to-text limit (`sys.get_int_max_str_digits`,
    4300 digits by default, where `repr` raises ValueError) is `<int of N bits>`."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 13_000:  # > ~3,900 digits
        return f"<int of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= max_chars else text[: max(0, max_chars - 3)] + "..."


def value_from_json(obj: object, where: str) -> object:
    """Inverse of `value_to_json`. Raises CorruptCheckpointError on malformed input."""
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"malformed value {obj!r:.200} in {where}: not an object")
    try:
        t = obj["type"]
        if t == "none":
            return None
        if t == "bool" and isinstance(obj["value"], bool):
            return obj["value"]
        if t == "int" and isinstance(obj["hex"], str) and len(obj["hex"]) < 1_000_000:
            return int(obj["hex"], 16)
        if t == "float":
            return struct.unpack("<d", bytes.fromhex(obj["hex"]))[0]
        if t == "complex":
            re_, im = struct.unpack("<dd", bytes.fromhex(obj["hex"]))
            return complex(re_, im)
        if t == "str" and isinstance(obj["value"], str):
            return obj["value"]
        if t == "numpy_scalar":
            dtype = dtype_from_name(obj["dtype"], where=where)
            raw = bytes.fromhex(obj["hex"])
            if len(raw) != dtype.itemsize:
                raise ValueError("size")
            return np.frombuffer(raw, dtype=dtype)[0]
    except (KeyError, TypeError, ValueError, OverflowError, struct.error) as e:
        raise CorruptCheckpointError(f"malformed value {obj!r:.200} in {where}: {e}") from e
    raise CorruptCheckpointError(f"malformed value {obj!r:.200} in {where}")
