"""Dtypes of array leaves: their zarr v3 names and back, and the kinds a restore may cast
between (numpy's and ml_dtypes': bfloat16, float8_*, int4, ...)."""

from __future__ import annotations

import functools
import re
from typing import Literal

import numpy as np

from .._errors import CorruptCheckpointError


def dtype_name(dtype: np.dtype) -> str:
    """The zarr v3 / TensorStore data type name of a numpy (or ml_dtypes) dtype."""
    return _dtype_name(np.dtype(dtype))


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name  # ~20 µs in numpy (a regex per call); a save names every leaf's dtype


def dtype_from_name(name: object, *, where: str = "") -> np.dtype:
    """The numpy dtype for a stored dtype name (ml_dtypes names included; any JSON value
    is accepted and refused unless it names a numeric dtype)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16, float8_*, int4 with numpy)

    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_]+", name):
        raise CorruptCheckpointError(f"malformed dtype {name!r} in {where}")
    try:
        dtype = np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    except TypeError as e:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in {where}") from e
    if not is_numeric_dtype(dtype) or dtype.itemsize == 0 or dtype.name != name:
        raise CorruptCheckpointError(f"dtype {name!r} in {where} is not a numeric array dtype")
    return dtype


def is_numeric_dtype(dtype: np.dtype) -> bool:
    """Whether `dtype` is bool, integer, floating or complex, ml_dtypes' included
    (bfloat16, float8_*, int4, ...): the dtypes an array leaf may have."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" or dtype.type.__module__ == "ml_dtypes"


DTypeKind = Literal["b", "i", "f", "c"]
_NUMPY_KINDS: dict[str, DTypeKind] = {"b": "b", "i": "i", "u": "i", "f": "f", "c": "c"}


def dtype_kind(dtype: np.dtype) -> DTypeKind | None:
    """'b' bool, 'i' integer (signed or unsigned, int4 too), 'f' floating (bfloat16,
    float8_* too), 'c' complex; None for anything else. (numpy.can_cast's "same_kind"
    is not used: it allows int to float and, through ml_dtypes, float32 to int4.)"""
    import ml_dtypes

    dtype = np.dtype(dtype)
    if dtype.kind in _NUMPY_KINDS:
        return _NUMPY_KINDS[dtype.kind]
    try:
        ml_dtypes.iinfo(dtype)
        return "i"
    except (ValueError, TypeError):
        pass
    try:
        ml_dtypes.finfo(dtype)
        return "f"
    except (ValueError, TypeError):
        return None


def is_whole_byte_dtype(dtype: np.dtype) -> bool:
    """Whether each element fills its `itemsize` bytes: False for the packed sub-byte
    dtypes (int4, int2, float4_e2m1fn, ...), whose bits per element are fewer."""
    import ml_dtypes

    dtype = np.dtype(dtype)
    if dtype.kind in "bc":
        return True
    for info in (ml_dtypes.finfo, ml_dtypes.iinfo, np.finfo, np.iinfo):
        try:
            return info(dtype).bits == dtype.itemsize * 8
        except (ValueError, TypeError):
            continue
    return False
