"""A manager's directory over time: retention policies (by step and by time),
`CheckpointManager` and the questions it answers, its writer's lock and maintenance
(shared with `checkpointer gc`), the status probe and `jax.monitoring` events, two tiers.
"""

from ._alerts import DirectoryStatus, SaveFailure, read_status
from ._events import EVENTS
from ._lock import DirectoryLock
from ._maintenance import maintain, referenced_steps, users_among
from ._manager import CheckpointManager
from ._policies import KeepAny, KeepBest, KeepEvery, KeepLatest, KeepPolicy, KeepSteps
from ._status import ManagerStatus
from ._tiers import local_listing
from ._time_policies import KeepEverySeconds, KeepNewerThan

__all__ = ['EVENTS', 'CheckpointManager', 'DirectoryLock', 'DirectoryStatus', 'KeepAny', 'KeepBest', 'KeepEvery', 'KeepEverySeconds', 'KeepLatest', 'KeepNewerThan', 'KeepPolicy', 'KeepSteps', 'ManagerStatus', 'SaveFailure', 'local_listing', 'maintain', 'read_status', 'referenced_steps', 'users_among']
