"""The stored-leaf encodings: a leaf in its own zarr array, or packed into its writer's
pack. Operations that differ by encoding dispatch here, once."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .._format import ArrayMetadata, Box
from .._storage import Storage
from . import _pack, _read


def region_reader(storage: Storage, path: str, meta: ArrayMetadata) -> Callable[[Box], np.ndarray]:
    """Reads any region of a leaf, unplanned: `read(box)` returns the leaf's values in
    `box` (each a fresh array), for readers that walk a leaf region by region (export).

    Raises (from `read`):
      CorruptCheckpointError: stored bytes are missing, truncated or fail a checksum;
        names the leaf and the checkpoint path.
    """
    return (_pack.region_reader if meta.packed else _read.region_reader)(storage, path, meta)
