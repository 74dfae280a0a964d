"""The byte layout of one zarr shard file (one chunk) of this format: inner chunks with
their crc32c, then the index and its crc32c (`ShardFileLayout`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class ShardFileLayout:
    """The byte layout of one zarr shard file (one chunk) of this format.

    ```
    inner chunk 0: raw bytes || crc32c (u32 LE)    inner_bytes_with_crc each, in the
    inner chunk 1: ...                             order the index says (C order as written)
    index: per inner chunk in C order (offset u64 LE, nbytes u64 LE)   16 bytes each
    crc32c(index) (u32 LE)
    ```
    The index sits at the end (`index_location: "end"`), `index_bytes` long from
    `index_offset`; every inner chunk is stored, so the file is `file_bytes` long.

    Attributes:
      chunk_shape: the chunk (= zarr shard) shape, elements.
      inner_chunk_shape: the inner chunk shape, elements.
      itemsize: bytes per element.
    """

    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    itemsize: int

    CRC_BYTES = 4
    INDEX_ENTRY_BYTES = 16
    MISSING = (1 << 64) - 1  # an index entry of an inner chunk that is not stored

    @property
    def inner_grid(self) -> tuple[int, ...]:
        """Inner chunks per dimension."""
        return tuple(max(1, c) // i for c, i in zip(self.chunk_shape, self.inner_chunk_shape))

    @property
    def inner_chunks(self) -> int:
        """Inner chunks in the file."""
        return math.prod(self.inner_grid)

    @property
    def inner_bytes(self) -> int:
        """Raw bytes of one inner chunk."""
        return math.prod(self.inner_chunk_shape) * self.itemsize

    @property
    def inner_bytes_with_crc(self) -> int:
        """Stored bytes of one inner chunk: raw bytes and their crc32c."""
        return self.inner_bytes + self.CRC_BYTES

    @property
    def index_bytes(self) -> int:
        """Bytes of the index and its crc32c."""
        return self.inner_chunks * self.INDEX_ENTRY_BYTES + self.CRC_BYTES

    @property
    def index_offset(self) -> int:
        """Where the index starts: right after the inner chunks."""
        return self.inner_chunks * self.inner_bytes_with_crc

    @property
    def file_bytes(self) -> int:
        """Size of the whole file."""
        return self.index_offset + self.index_bytes

    def inner_id(self, cell: Sequence[int]) -> int:
        """The C-order position of inner chunk `cell` (its entry in the index)."""
        out = 0
        for c, n in zip(cell, self.inner_grid):
            out = out * n + c
        return out

    @classmethod
    def split_crc(cls, blob) -> tuple[memoryview, int]:
        """`(data, stored crc32c)` of an inner chunk or index as stored (crc last)."""
        view = memoryview(blob)
        return view[: -cls.CRC_BYTES], int.from_bytes(view[-cls.CRC_BYTES :], "little")
