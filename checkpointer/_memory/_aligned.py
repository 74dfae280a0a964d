"""Host arrays whose data is aligned, so that XLA's CPU client adopts them without a copy."""

from __future__ import annotations

import math

import numpy as np


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data is `align`-byte aligned. XLA's CPU client
    adopts such buffers without copying (`jax.device_put` aliases them).

    Args:
      shape: the array shape, elements per dimension.
      dtype: the element type.
      align: the alignment of the first element, bytes.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)
