"""A manager's directory over time: retention policies, `CheckpointManager`, its writer's
lock and maintenance (shared with `checkpointer gc`), two tiers.
"""

from ._lock import DirectoryLock
from ._maintenance import maintain
from ._manager import CheckpointManager
from ._policies import KeepAny, KeepBest, KeepEvery, KeepLatest, KeepPolicy, KeepSteps
from ._status import ManagerStatus
from ._tiers import local_listing

__all__ = ['CheckpointManager', 'DirectoryLock', 'KeepAny', 'KeepBest', 'KeepEvery', 'KeepLatest', 'KeepPolicy', 'KeepSteps', 'ManagerStatus', 'local_listing', 'maintain']
