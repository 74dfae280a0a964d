"""Boxes: half-open regions `(origin, shape)` of a global array, and their arithmetic."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence


@dataclasses.dataclass(frozen=True, order=True)
class Box:
    """A half-open region of a global array.

    Attributes:
      origin: the first index along each dimension.
      shape: the extent along each dimension (0 allowed).
    """

    origin: tuple[int, ...]
    shape: tuple[int, ...]

    @staticmethod
    def from_index(index: Sequence[slice], global_shape: Sequence[int]) -> Box:
        """The box of a JAX shard index (a tuple of slices) within `global_shape`."""
        origin, shape = [], []
        for sl, dim in zip(index, global_shape):
            start, stop, step = sl.indices(dim)
            if step != 1:
                raise ValueError(f"strided shard index {index} is not supported")
            origin.append(start)
            shape.append(max(0, stop - start))
        return Box(tuple(origin), tuple(shape))

    @staticmethod
    def whole(global_shape: Sequence[int]) -> Box:
        """The box covering the whole array."""
        return Box((0,) * len(global_shape), tuple(global_shape))

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.origin, self.shape))

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        """The box as a tuple of slices into the global array."""
        return tuple(slice(o, o + s) for o, s in zip(self.origin, self.shape))

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """This box as slices into the buffer of `outer` (which must contain it)."""
        return tuple(slice(o - p, o - p + s) for o, p, s in zip(self.origin, outer.origin, self.shape))

    def intersect(self, other: Box) -> Box | None:
        """The overlap of two boxes, or None when it is empty."""
        origin = tuple(max(a, b) for a, b in zip(self.origin, other.origin))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(e <= o for o, e in zip(origin, stop)):
            return None
        return Box(origin, tuple(e - o for o, e in zip(origin, stop)))

    def to_json(self) -> list:
        return [list(self.origin), list(self.shape)]

    @staticmethod
    def from_json(obj: object) -> Box:
        if (
            not isinstance(obj, list)
            or len(obj) != 2
            or not all(isinstance(v, list) and all(isinstance(i, int) and i >= 0 for i in v) for v in obj)
            or len(obj[0]) != len(obj[1])
        ):
            raise ValueError(f"malformed box {obj!r}")
        return Box(tuple(obj[0]), tuple(obj[1]))


def grid_cells(box: Box, cell_shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Yields the indices of the grid cells (chunks) of shape `cell_shape` that `box`
    touches, in C order (last dimension fastest); none for an empty box."""
    if box.size == 0:
        return iter(())
    ranges = [range(o // c, (o + s - 1) // c + 1) for o, s, c in zip(box.origin, box.shape, cell_shape)]
    return itertools.product(*ranges)


def row_slabs(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    """`box` cut along its first dimension into consecutive slabs of at most `max_bytes`
    each (`itemsize` bytes per element), or of one row where a row is larger.

    Returns:
      The slabs in order; `[box]` for a 0-d box, `[]` for an empty one.
    """
    if not box.shape:
        return [box]
    if box.size == 0:
        return []
    row_bytes = box.size * itemsize // box.shape[0]
    rows = max(1, max_bytes // max(1, row_bytes))
    return [
        Box((box.origin[0] + start,) + box.origin[1:], (min(rows, box.shape[0] - start),) + box.shape[1:])
        for start in range(0, box.shape[0], rows)
    ]


def cell_box(cell: Sequence[int], cell_shape: Sequence[int], global_shape: Sequence[int]) -> Box:
    """The box of grid cell `cell`, clipped to the array."""
    origin = tuple(c * s for c, s in zip(cell, cell_shape))
    shape = tuple(max(0, min(s, g - o)) for o, s, g in zip(origin, cell_shape, global_shape))
    return Box(origin, shape)
