"""One array leaf as a zarr v3 array: the chunking rule (`inner_chunk_shape`), its
`zarr.json` metadata (`sharding_indexed`, crc32c on every inner chunk and on each shard
index) and its TensorStore spec, and the crc32c of a chunk's data that process records
carry. Every chunk is stored (`store_data_equal_to_fill_value`), so a missing zarr shard
file is damage, never fill values. The byte layout of one shard file: `_shard_file`."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import crc32c
import numpy as np

from ._dtypes import dtype_name

if TYPE_CHECKING:
    from ._leaves import ArrayMetadata


# Inner chunks aim at 1/16 of the chunk within these bounds; see `inner_chunk_shape`.
INNER_CHUNK_TARGET_BYTES = 1 << 20
INNER_CHUNK_MIN_BYTES = 16 << 10
INNER_CHUNKS_PER_CHUNK = 16
MAX_SPLIT_FACTOR = 7
# Hard ceiling on an inner chunk, far below the 2 GiB that one read() system call
# returns on Linux and that many zarr codecs/readers handle; see `inner_chunk_shape`.
MAX_INNER_CHUNK_BYTES = 64 << 20


def _smallest_prime_factor(n: int) -> int:
    for p in range(2, int(math.isqrt(n)) + 1):
        if n % p == 0:
            return p
    return n


def inner_chunk_target_bytes(chunk_bytes: int) -> int:
    """The inner chunk size to aim for: 1/16 of the chunk, clamped to [16 KiB, 1 MiB]."""
    return min(INNER_CHUNK_TARGET_BYTES, max(INNER_CHUNK_MIN_BYTES, chunk_bytes // INNER_CHUNKS_PER_CHUNK))


def inner_chunk_shape(chunk_shape: Sequence[int], itemsize: int, target_bytes: int | None = None) -> tuple[int, ...]:
    """Chooses the inner chunk shape of a zarr shard file.

    Rule: start from the chunk (= saved shard) shape and, while the inner chunk is larger
    than the target (default `inner_chunk_target_bytes`: 1/16 of the chunk, at least
    16 KiB, at most 1 MiB), divide its longest dimension by that dimension's smallest
    prime factor (2 whenever the size is even), considering only dimensions whose
    smallest prime factor is at most 7: a dimension whose size has only large prime
    factors (1021) stays whole, so such a chunk may stay above the target. The result
    always divides the chunk shape (the `sharding_indexed` codec requires it). For
    power-of-two shapes the chunk is cut into about 16 inner chunks along its longest
    axes, so a target shard obtained by splitting saved shards up to 4 ways along two
    axes (or 16 along one), or by merging them, is a union of whole inner chunks: such
    reshardings read only the zarr shard files' indexes beyond the data.

    Args:
      chunk_shape: the chunk (saved shard) shape, elements per dimension.
      itemsize: bytes per element.
      target_bytes: override of the size inner chunks should not exceed, bytes.
    Returns:
      The inner chunk shape, same rank as `chunk_shape`.
    """
    if target_bytes is None:
        target_bytes = inner_chunk_target_bytes(math.prod(max(1, c) for c in chunk_shape) * itemsize)
    inner = [max(1, c) for c in chunk_shape]
    while math.prod(inner) * itemsize > target_bytes:
        # Split only by small primes: a size like 1021 (prime) stays whole rather
        # than collapsing to inner chunks one element wide.
        candidates = [i for i, d in enumerate(inner) if d > 1 and _smallest_prime_factor(d) <= MAX_SPLIT_FACTOR]
        if not candidates:
            break
        dim = max(candidates, key=lambda i: (inner[i], -i))
        inner[dim] //= _smallest_prime_factor(inner[dim])
    # Hard ceiling: an inner chunk still above MAX_INNER_CHUNK_BYTES (only dimensions
    # with large prime factors left, e.g. (46337, 46349)) has its longest dimension
    # split by its smallest prime factor whatever it is, as long as the inner chunk
    # stays at least INNER_CHUNK_MIN_BYTES (so a 1-D leaf of prime length stays whole
    # rather than becoming one-element inner chunks with an index 4x the data).
    while math.prod(inner) * itemsize > MAX_INNER_CHUNK_BYTES:
        candidates = [
            i for i, d in enumerate(inner)
            if d > 1 and math.prod(inner) // _smallest_prime_factor(d) * itemsize >= INNER_CHUNK_MIN_BYTES
        ]
        if not candidates:
            break
        dim = max(candidates, key=lambda i: (inner[i], -i))
        inner[dim] //= _smallest_prime_factor(inner[dim])
    return tuple(inner)


def zarr_metadata(shape: Sequence[int], dtype: np.dtype, chunk_shape: Sequence[int], inner_shape: Sequence[int]) -> dict:
    """The zarr v3 array metadata (`zarr.json`) of one leaf."""
    checked = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    if np.dtype(dtype).itemsize == 1 or np.dtype(dtype).kind == "b":
        checked = [{"name": "bytes"}, {"name": "crc32c"}]
    return {
        "shape": list(shape),
        "data_type": dtype_name(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, c) for c in chunk_shape]}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(inner_shape),
                    "codecs": checked,
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    "index_location": "end",
                },
            }
        ],
    }


@functools.cache
def zarr_supports_dtype(dtype: np.dtype) -> bool:
    """Whether TensorStore's zarr3 driver can store `dtype` (e.g. int4: yes; uint4: no)."""
    import tensorstore as ts

    try:
        ts.Spec({"driver": "zarr3", "kvstore": "memory://", "metadata": zarr_metadata((1,), dtype, (1,), (1,))})
    except ValueError:
        return False
    return True


ZarrSpecMode = Literal["create", "write", "read"]


def zarr_spec(kvstore: Mapping, meta: ArrayMetadata, *, mode: ZarrSpecMode) -> dict:
    """The TensorStore spec of a leaf's zarr array.

    Args:
      kvstore: the kvstore spec of the array's folder (`Storage.kvstore_spec`).
      meta: the leaf's manifest entry; its zarr metadata is part of every spec.
      mode: `"create"`: write, creating `zarr.json` (process 0 of a save); `"write"`:
        write into an array another process creates (its `zarr.json` is assumed, not
        read); `"read"`: open an existing array, refusing a `zarr.json` whose shape, dtype,
        chunk grid or codecs differ from the manifest (so bytes are never decoded as
        another dtype or inner-chunk layout), and a missing chunk (never fill values).
    Returns:
      A dict for `tensorstore.open`.
    """
    spec: dict[str, object] = {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": zarr_metadata(meta.shape, meta.dtype, meta.chunk_shape, meta.inner_chunk_shape),
    }
    if mode == "read":
        spec.update({"open": True, "fill_missing_data_reads": False, "recheck_cached_data": False})
    elif mode in ("create", "write"):
        spec["store_data_equal_to_fill_value"] = True
        spec["create" if mode == "create" else "assume_metadata"] = True
    else:
        raise ValueError(f"zarr_spec mode must be 'create', 'write' or 'read', got {mode!r}")
    return spec


def data_crc32c(data: np.ndarray) -> int:
    """crc32c of an array's C-order bytes (0 for an empty array): `data_crc32c` of a chunk
    in `processes/<i>.json`, checked by `verify` on top of the codec's checksums."""
    if data.size == 0:
        return 0
    return crc32c.crc32c(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
