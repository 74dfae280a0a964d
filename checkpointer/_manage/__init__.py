"""A manager's directory over time: retention policies, `CheckpointManager`, two tiers.
"""

from ._manager import CheckpointManager, ManagerStatus, _DirectoryLock
from ._policies import KeepAny, KeepBest, KeepEvery, KeepLatest, KeepPolicy, KeepSteps
from ._tiers import local_listing

__all__ = ['CheckpointManager', 'KeepAny', 'KeepBest', 'KeepEvery', 'KeepLatest', 'KeepPolicy', 'KeepSteps', 'ManagerStatus', '_DirectoryLock', 'local_listing']
