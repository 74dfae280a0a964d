"""zarr-python data types for the ml_dtypes arrays a checkpoint holds, so that plain
zarr-python opens every array: `zarr.open_array(f"{ckpt}/arrays/params/w", mode="r")[...]`
gives a bfloat16 (float8_*, float4_e2m1fn, int4, int2) numpy array with the values saved.

zarr-python (>= 3.1) resolves a zarr v3 `"data_type"` through its registry of data types
(`zarr.core.dtype.data_type_registry`), which packages extend. This module defines one
`ZDType` per ml_dtypes type that this library writes and registers them:

- on import (`import checkpointer.zarr_dtypes`), and
- through the entry point group `zarr.data_type` of this package (pyproject.toml), which
  zarr-python loads on its own from 3.4.1: with the package installed, `import zarr` alone
  is enough there. zarr-python 3.1.0-3.4.0 never loads them (and `import checkpointer`
  does not import this module): `import checkpointer.zarr_dtypes` before opening, or the
  open fails with "No Zarr data type found that matches 'bfloat16'".

The zarr v3 JSON is TensorStore's, unchanged: `"data_type"` is the ml_dtypes name
(`"bfloat16"`, `"float8_e4m3fn"`, `"int4"`), the bytes codec has `"endian"` for bfloat16
and none for the one-byte types (a sub-byte type is stored one element per byte, as
TensorStore does), and `"fill_value"` is a JSON number, or for floats `"NaN"`,
`"Infinity"`, `"-Infinity"` or a hex string of the bits (`"0x7fc0"`). An array zarr-python
writes with these types is therefore the same JSON TensorStore reads. Zarr v2 metadata is
not supported (numpy names these types `V2`/`V1`, which would collide with raw bytes).

Typed PRNG keys need nothing here: their key data is stored as uint32.

Imports only zarr, numpy and ml_dtypes (the entry point loads it into any zarr-python
user's process: no JAX, no TensorStore). Multi-process: per process, no communication.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal, TypeGuard

import ml_dtypes
import numpy as np
from zarr.core.dtype import DataTypeValidationError, ZDType, data_type_registry
from zarr.core.dtype.common import HasEndianness, HasItemSize

# The ml_dtypes types TensorStore's zarr3 driver stores (tensorstore 0.1.81-0.1.86), by
# their zarr v3 name; float8_e4m3 and the unsigned sub-byte types it has no data type for.
FLOAT_NAMES = ("bfloat16", "float8_e3m4", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2",
               "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn")
INT_NAMES = ("int4", "int2")
_TWO_BYTES = ("bfloat16",)  # every other type is one byte (a sub-byte one stored one element per byte)
# float8_e8m0fnu has no zero: TensorStore reads a JSON fill value 0 as bits 0 (its smallest
# value, 2**-127) where ml_dtypes would cast 0 to NaN, and writes bits 0 as 0.0. Any other
# JSON number it reads 64 exponents low (1.0 as 2**-64): other fill values are written as
# the hex of their bits, which it reads exactly.
_NO_ZERO = ("float8_e8m0fnu",)
_SPECIAL = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}


class _MlDtype(ZDType[Any, Any], HasItemSize):
    """A zarr-python data type for one ml_dtypes type (`_ml_name`, `_kind` "f" or "i")."""

    _zarr_v3_name: ClassVar[str]
    _kind: ClassVar[Literal["f", "i"]]

    @classmethod
    def _dtype(cls) -> np.dtype:
        return np.dtype(getattr(ml_dtypes, cls._zarr_v3_name))

    @classmethod
    def _check_native_dtype(cls, dtype: Any) -> TypeGuard[Any]:
        return isinstance(dtype, np.dtype) and dtype.type is cls._dtype().type

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> Any:
        if not cls._check_native_dtype(dtype):
            raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {cls._zarr_v3_name}")
        if cls._dtype().itemsize > 1:
            return cls(endianness="big" if dtype.byteorder == ">" else "little")  # type: ignore[call-arg]
        return cls()

    def to_native_dtype(self) -> np.dtype:
        dtype = self._dtype()
        if getattr(self, "endianness", "little") == "big":
            return dtype.newbyteorder(">")
        return dtype

    @classmethod
    def _from_json_v2(cls, data: Any) -> Any:
        raise DataTypeValidationError(f"{cls._zarr_v3_name} has no zarr v2 encoding here (zarr v3 only); got {data!r}")

    @classmethod
    def _from_json_v3(cls, data: Any) -> Any:
        if data == cls._zarr_v3_name:
            return cls()
        raise DataTypeValidationError(f"Invalid JSON representation of {cls._zarr_v3_name}: {data!r}")

    def to_json(self, zarr_format: Any) -> Any:
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"{self._zarr_v3_name} is a zarr v3 data type only (zarr_format={zarr_format!r})")

    @property
    def item_size(self) -> int:
        return int(self._dtype().itemsize)

    def _check_scalar(self, data: object) -> bool:
        if isinstance(data, str):
            return self._kind == "f" and data in _SPECIAL
        return isinstance(data, (int, float, np.number, np.bool_)) or type(data).__module__ == "ml_dtypes"

    def cast_scalar(self, data: object) -> Any:
        if not self._check_scalar(data):
            raise TypeError(f"Cannot convert {data!r} of type {type(data).__name__} to a {self._zarr_v3_name} scalar")
        if isinstance(data, str):
            data = float(_SPECIAL[data])
        if self._kind == "i" and isinstance(data, (int, np.integer)) and not isinstance(data, (bool, np.bool_)):
            info = ml_dtypes.iinfo(self._dtype())
            if not info.min <= int(data) <= info.max:  # ml_dtypes would wrap it (int4(20) is 4), as numpy's ints refuse
                raise ValueError(f"{data} is out of the range of {self._zarr_v3_name} ({info.min}..{info.max})")
        return self.to_native_dtype().type(data)

    def default_scalar(self) -> Any:
        return self.to_native_dtype().type(0)

    def from_json_scalar(self, data: Any, *, zarr_format: Any) -> Any:
        if isinstance(data, str) and self._kind == "f" and data.startswith("0x"):
            bits = int(data, 16)  # the bit pattern, as TensorStore and the zarr v3 spec write it
            if bits >> (8 * self.item_size):
                raise TypeError(f"Invalid fill value {data!r} for {self._zarr_v3_name}: wider than its "
                                f"{self.item_size} byte(s)")
            raw = bits.to_bytes(self.item_size, "little")
            return np.frombuffer(raw, dtype=self._dtype())[0]
        if isinstance(data, bool) or not (isinstance(data, (int, float)) or (isinstance(data, str) and data in _SPECIAL)):
            raise TypeError(f"Invalid fill value {data!r} for {self._zarr_v3_name}")
        if self._kind == "i" and not isinstance(data, int):
            raise TypeError(f"Invalid fill value {data!r} for {self._zarr_v3_name}: an integer is needed")
        if self._zarr_v3_name in _NO_ZERO and data == 0:
            return np.zeros((), self._dtype())[()]  # TensorStore's reading of 0: bits 0 (2**-127), not NaN
        return self.cast_scalar(data)

    def to_json_scalar(self, data: object, *, zarr_format: Any) -> Any:
        value = self.cast_scalar(data)
        if self._kind == "i":
            return int(value)
        if self._zarr_v3_name in _NO_ZERO and not np.asarray(value).view(np.uint8).any():
            return 0.0  # as TensorStore writes its fill value of bits 0 (see from_json_scalar)
        f = float(value)
        if self._zarr_v3_name in _NO_ZERO and not np.isnan(f):
            # TensorStore reads a JSON number for float8_e8m0fnu with the exponent off by 64
            # (1.0 as bits 63, 2**-64); the hex of the bits it reads as written.
            return f"0x{int(np.asarray(value, self._dtype()).view(np.uint8)[()]):02x}"
        if np.isnan(f):
            bits = int.from_bytes(np.asarray(value, self._dtype()).tobytes(), "little")
            default = int.from_bytes(np.asarray(np.nan, self._dtype()).tobytes(), "little")
            return "NaN" if bits == default else f"0x{bits:0{2 * self.item_size}x}"
        if np.isinf(f):
            return "Infinity" if f > 0 else "-Infinity"
        return f


def _make(name: str, kind: Literal["f", "i"]) -> type[_MlDtype]:
    # Not np.dtype(ml_dtypes.<name>): an entry point must load even with an ml_dtypes
    # that lacks the type (zarr-python loads every entry point at its first lookup).
    bases: tuple[type, ...] = (_MlDtype, HasEndianness) if name in _TWO_BYTES else (_MlDtype,)
    cls = type(name.title().replace("_", ""), bases, {"_zarr_v3_name": name, "_kind": kind, "dtype_cls": np.dtype,
                                                      "__module__": __name__,
                                                      "__doc__": f"zarr-python data type `{name}` (ml_dtypes.{name})."})
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


# One class per type, by its zarr v3 name (`Bfloat16`, `Float8E4M3Fn`, `Int4`, ...): the
# entry points name them.
DATA_TYPES: dict[str, type[_MlDtype]] = {n: _make(n, "f") for n in FLOAT_NAMES} | {n: _make(n, "i") for n in INT_NAMES}
globals().update({cls.__name__: cls for cls in DATA_TYPES.values()})


def register() -> None:
    """Registers every type of `DATA_TYPES` with zarr-python (idempotent; done on import)."""
    for name, cls in DATA_TYPES.items():
        data_type_registry.register(name, cls)


register()
