"""The options of a restore, one frozen object through the pipeline (`RestoreOptions`):
the keyword arguments of `restore` (and `restore_from`, `CheckpointManager.restore`), as
they stand in their signatures, checked once."""

from __future__ import annotations

import dataclasses

from .._encoding import RestoreStats
from .._storage import DEFAULT_MAX_OVER_READ_RATIO, check_read_options


@dataclasses.dataclass(frozen=True)
class RestoreOptions:
    """How one restore is made; the fields are the keyword arguments of `ckpt.restore`
    (tests/test_layout.py checks that they stay equal), documented there. `plan_restore`
    takes the same less `stats`, plus `process_index` and `processes`.

    Raises:
      ValueError: `max_inflight_bytes` is not a positive int or None, or `cooperative`
        is not a bool, `max_over_read_ratio` is not a number >= 1, or `read_chunk_bytes`
        is not a positive int or None (`missing` is checked where the target is matched, `_matching.match`).
    """

    partial: bool = False
    missing: str = "error"
    max_inflight_bytes: int | None = None
    stats: RestoreStats | None = None
    cooperative: bool = True
    max_over_read_ratio: float = DEFAULT_MAX_OVER_READ_RATIO
    read_chunk_bytes: int | None = None

    def __post_init__(self) -> None:
        m = self.max_inflight_bytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_inflight_bytes must be a positive int (bytes) or None, got {m!r}")
        if not isinstance(self.cooperative, bool):
            raise ValueError(f"cooperative must be True or False, got {self.cooperative!r}")
        check_read_options(self.max_over_read_ratio, self.read_chunk_bytes)
