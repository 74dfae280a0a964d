"""The options of a save, one frozen object through the pipeline (`SaveOptions`): the
keyword arguments of `save` and `save_async`, as they stand in their signatures."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .. import _commit, _coord, _storage


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How one save is made; the fields are the keyword arguments of `ckpt.save` and
    `ckpt.save_async` (tests/test_layout.py checks that they stay equal), documented there.

    `CheckpointManager` holds the ones it takes at construction (the timeouts, the write
    rate, the pack threshold, `direct_io`) and fills in the per-step ones (`metadata` with the
    metrics, `overwrite=force`, `per_process_state`) with `dataclasses.replace`.
    """

    metadata: Mapping | None = None
    overwrite: bool = False
    commit_timeout_s: float = _coord.DEFAULT_COMMIT_TIMEOUT_S
    agreement_timeout_s: float = _commit.DEFAULT_AGREEMENT_TIMEOUT_S
    per_process_state: object = None
    max_write_bytes_per_s: float | None = None
    pack_small_leaves_bytes: int | None = None
    direct_io: str | bool = "auto"
    incremental: bool = False

    def __post_init__(self) -> None:
        _storage.check_direct_io(self.direct_io)
        _coord.check_timeout_s("commit_timeout_s", self.commit_timeout_s)
        _coord.check_timeout_s("agreement_timeout_s", self.agreement_timeout_s)
