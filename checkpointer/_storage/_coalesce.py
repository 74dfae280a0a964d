"""Which byte ranges of one file to fetch together (`coalesce_ranges`): nearby ranges
become one request whenever the bytes between them cost less than another request
would, within a bound on the bytes read and thrown away (`max_over_read_ratio`) and
on one request's size (`read_chunk_bytes`). Pure; the readers (`Reader.request_cost_bytes`)
say what a request costs, in bytes of transfer.
"""

from __future__ import annotations

import numpy as np

# Default bound on bytes read over bytes needed, per leaf (or slab of leaves): a restore
# reads at most 5% more than it needs to save requests (docs/DESIGN-decisions.md,
# "Few requests from any store").
DEFAULT_MAX_OVER_READ_RATIO = 1.05
# One request that is read into a staging buffer (and copied out) covers at most this
# many bytes by default, or the reader's `run_bytes` if larger (16 MiB on object stores).
DEFAULT_READ_CHUNK_BYTES = 4 << 20


def check_read_options(max_over_read_ratio: object, read_chunk_bytes: object) -> None:
    """Raises ValueError unless `max_over_read_ratio` is a real number >= 1 and
    `read_chunk_bytes` a positive int (bytes) or None."""
    r = max_over_read_ratio
    if isinstance(r, bool) or not isinstance(r, (int, float, np.integer, np.floating)) or not r >= 1 or r == float("inf"):
        raise ValueError(f"max_over_read_ratio must be a number >= 1 (bytes read / bytes needed), got {r!r}")
    c = read_chunk_bytes
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1):
        raise ValueError(f"read_chunk_bytes must be a positive int (bytes) or None, got {c!r}")


def coalesce_ranges(
    starts: np.ndarray, ends: np.ndarray, *, request_cost_bytes: int, max_over_read_ratio: float, read_chunk_bytes: int,
) -> np.ndarray:
    """Groups byte ranges of one file into requests.

    Two ranges next to each other in the file are fetched by one request when the gap
    between them (bytes read and thrown away) is at most `request_cost_bytes`; the gaps
    taken are the smallest first, until all of them together reach
    `(max_over_read_ratio - 1)` times the bytes of the ranges. Adjacent or overlapping
    ranges always go together. A request is then cut where it would start a range more
    than `read_chunk_bytes` after its own start (so it spans at most `read_chunk_bytes`
    plus one range).

    Args:
      starts, ends: each range's first and one-past-last byte, int64, sorted by start.
      request_cost_bytes: what one more request costs, in bytes of transfer.
      max_over_read_ratio: bound on (bytes fetched) / (bytes of the ranges), >= 1.
      read_chunk_bytes: bound on one request's span, bytes (see above).
    Returns:
      The index of the first range of each request, ascending, starting with 0 (request
      `r` fetches ranges `[first[r], first[r + 1])`); empty for no ranges.
    """
    n = len(starts)
    if n == 0:
        return np.zeros(0, np.int64)
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    reach = np.maximum.accumulate(ends)
    gaps = starts[1:] - reach[:-1]  # gap before range i + 1 (<= 0: adjacent or overlapping)
    merge = gaps <= 0
    budget = (max_over_read_ratio - 1.0) * float((ends - starts).sum())
    candidates = np.flatnonzero((gaps > 0) & (gaps <= request_cost_bytes))
    if len(candidates) and budget > 0:
        order = candidates[np.argsort(gaps[candidates], kind="stable")]
        taken = order[np.cumsum(gaps[order]) <= budget]
        merge[taken] = True
    first = np.flatnonzero(~merge) + 1
    group = np.zeros(n, np.int64)
    group[first] = 1
    group = np.cumsum(group)
    group_start = starts[np.concatenate(([0], first))][group]
    window = (starts - group_start) // max(1, int(read_chunk_bytes))
    cut = np.ones(n, bool)
    cut[1:] = (group[1:] != group[:-1]) | (window[1:] != window[:-1])
    return np.flatnonzero(cut)
