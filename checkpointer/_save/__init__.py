"""Saving: the save planner (replica dedup and replica-parallel splits), the snapshot, the
writes and the commit, the async handle, `plan_save`, streaming saves for converters, and
the front-door `save` / `save_async`.
"""

from ._api import save, save_async
from ._async import BACKGROUND_NICE, AsyncSave
from ._incremental import bases_beside, guard, remember
from ._options import SaveOptions
from ._pipeline import SaveResult, Snapshot, manifest_bytes, release_host, run_background, take_snapshot, write_snapshot
from ._plan import LeafAssignment, ProcessWrites, SavePlan
from ._preview import plan_save
from ._stream import ArraySource, RegionReader, save_leaf_by_leaf

__all__ = ['BACKGROUND_NICE', 'SaveOptions', 'ArraySource', 'AsyncSave', 'bases_beside', 'guard', 'LeafAssignment', 'ProcessWrites', 'RegionReader', 'SavePlan', 'SaveResult', 'Snapshot', 'manifest_bytes', 'plan_save', 'release_host', 'remember', 'run_background', 'save', 'save_async', 'save_leaf_by_leaf', 'take_snapshot', 'write_snapshot']
